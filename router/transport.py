"""The transports under the upstream pool (:class:`fulcrum.router.upstream.Transport`): direct HTTP and the NATS
prefill queue.

- :class:`HttpTransport`: every call over one shared ``aiohttp.ClientSession`` (one ``TCPConnector``: connections
  to each engine are kept alive and reused); aiohttp's errors are translated into
  :class:`~fulcrum.router.upstream.UpstreamFailure` here, at the boundary.
- :class:`QueuedTransport`: as its direct transport, except that a prefill leg (:func:`is_prefill_leg`) posted
  through :meth:`~fulcrum.router.upstream.UpstreamPool.post_json` is published as a job on the NATS JetStream
  prefill queue while one is in use (router config ``prefill_queue.kind: nats``; DOPD §V-C): a prefill worker's
  reply is returned as the engine's answer, so the handoff code runs unchanged and the decode leg follows as in
  the direct case.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import aiohttp

from fulcrum.router.config import PrefillQueueConfig
from fulcrum.router.errors import NoHealthyInstance
from fulcrum.router.metrics import RouterMetrics
from fulcrum.router.upstream import (
    Deadline,
    Transport,
    UpstreamFailure,
    UpstreamResponse,
    busy_body,
    upstream_message,
)

__all__ = ["HttpTransport", "QueuedTransport", "is_prefill_leg", "queued_answer", "new_session", "retire_queue"]

log = logging.getLogger(__name__)

_JSON = {"Content-Type": "application/json"}
_ENGINE_PATHS = ("/v1/completions", "/v1/chat/completions")


def new_session(connection_limit: int) -> aiohttp.ClientSession:
    """The router's shared upstream session: a pooled ``TCPConnector`` (``connection_limit`` connections in all,
    none per host), keep-alive 60 s, no decompression, no proxies from the environment, no cookies."""
    connector = aiohttp.TCPConnector(limit=connection_limit, limit_per_host=0, keepalive_timeout=60,
                                     enable_cleanup_closed=False)
    return aiohttp.ClientSession(connector=connector, auto_decompress=False, trust_env=False,
                                 cookie_jar=aiohttp.DummyCookieJar())


class HttpTransport:
    """Direct HTTP to the engines (:class:`~fulcrum.router.upstream.Transport`): every call over one shared
    ``aiohttp`` session.

    Args:
        session: the shared client session (its connector is the connection pool); closed by :meth:`close`.
    """

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session
        self._timeouts: dict[Deadline, aiohttp.ClientTimeout] = {}

    def _timeout(self, d: Deadline) -> aiohttp.ClientTimeout:
        got = self._timeouts.get(d)
        if got is None:
            if len(self._timeouts) > 64:  # per-call totals (tokenize) would otherwise pile up
                self._timeouts.clear()
            got = self._timeouts[d] = aiohttp.ClientTimeout(total=d.total_s, connect=d.connect_s,
                                                            sock_connect=d.connect_s, sock_read=d.idle_s)
        return got

    @asynccontextmanager
    async def open(self, iid: str, base: str, path: str, body: dict[str, Any], deadline: Deadline
                   ) -> AsyncIterator[UpstreamResponse]:
        """As :meth:`fulcrum.router.upstream.Transport.open`.

        Raises:
            UpstreamFailure: connect error, timeout, 5xx answer, an answer cut mid-way.
        """
        try:
            async with self.session.post(base + path, data=json.dumps(body).encode(), headers=_JSON,
                                         timeout=self._timeout(deadline)) as resp:
                if resp.status >= 500:
                    raw = await resp.read()
                    raise UpstreamFailure(iid, "status", upstream_message(raw, resp.status), resp.status)
                if resp.status == 429:  # its Retry-After rides on the body read (BusyBody)
                    yield _BusyResponse(resp)
                else:
                    yield resp
        except aiohttp.ClientError as err:
            raise _translate(iid, err) from err
        except (TimeoutError, asyncio.TimeoutError) as err:
            raise UpstreamFailure(iid, "timeout", f"{iid} did not answer in time") from err

    async def post(self, iid: str, base: str, path: str, body: dict[str, Any] | bytes, deadline: Deadline, *,
                   queueable: bool) -> tuple[int, bytes, Any | None]:
        """As :meth:`fulcrum.router.upstream.Transport.post` (never parses: the parsed body is None).

        Raises:
            UpstreamFailure: connect error, timeout, 5xx answer, an answer cut mid-way.
        """
        status, raw = await self._post_aiohttp(iid, base, path, body, deadline)
        if status >= 500:
            raise UpstreamFailure(iid, "status", upstream_message(raw, status), status)
        return status, raw, None

    async def _post_aiohttp(self, iid: str, base: str, path: str, body: dict[str, Any] | bytes, deadline: Deadline
                            ) -> tuple[int, bytes]:
        try:
            async with self.session.post(base + path, data=_encode(body), headers=_JSON,
                                         timeout=self._timeout(deadline)) as resp:
                if resp.status == 429:  # the one header passed on to the client (BusyBody); none on other answers
                    return 429, busy_body(await resp.read(), resp.headers.get("Retry-After"))
                return resp.status, await resp.read()
        except aiohttp.ClientError as err:
            raise _translate(iid, err) from err
        except (TimeoutError, asyncio.TimeoutError) as err:
            raise UpstreamFailure(iid, "timeout", f"{iid} did not answer in time") from err

    async def get(self, iid: str, base: str, path: str, deadline: Deadline) -> tuple[int, bytes]:
        """As :meth:`fulcrum.router.upstream.Transport.get`.

        Raises:
            UpstreamFailure: connect error, timeout, an answer cut mid-way.
        """
        try:
            async with self.session.get(base + path, timeout=self._timeout(deadline)) as resp:
                return resp.status, await resp.read()
        except aiohttp.ClientError as err:
            raise _translate(iid, err) from err
        except (TimeoutError, asyncio.TimeoutError, OSError) as err:
            raise UpstreamFailure(iid, "timeout" if not isinstance(err, OSError) else "connect",
                                  f"{iid}: {type(err).__name__}: {err}") from err

    async def close(self) -> None:
        """Close the session (its connections)."""
        await self.session.close()


class _BusyResponse:
    """An engine's 429 as :meth:`HttpTransport.open` yields it (:class:`~fulcrum.router.upstream.UpstreamResponse`):
    the aiohttp response, whose whole body :meth:`read` returns with the engine's ``Retry-After``
    (:func:`~fulcrum.router.upstream.busy_body`)."""

    __slots__ = ("_resp",)

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp

    @property
    def status(self) -> int:
        """429."""
        return self._resp.status

    @property
    def content(self) -> aiohttp.StreamReader:
        """The body as it arrives (the Retry-After is not on it)."""
        return self._resp.content

    async def read(self) -> bytes:
        """The whole body, a :class:`~fulcrum.router.upstream.BusyBody` when a valid ``Retry-After`` came."""
        return busy_body(await self._resp.read(), self._resp.headers.get("Retry-After"))

    def close(self) -> None:
        """Close the connection at once."""
        self._resp.close()


def _encode(body: dict[str, Any] | bytes) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


def _translate(iid: str, err: aiohttp.ClientError) -> UpstreamFailure:
    if isinstance(err, aiohttp.ClientConnectorError):
        return UpstreamFailure(iid, "connect", f"cannot connect to {iid}: {err}")
    if isinstance(err, aiohttp.ServerTimeoutError):  # a socket read (or connect) limit: slow, not broken
        return UpstreamFailure(iid, "timeout", f"{iid} did not answer in time: {type(err).__name__}: {err}")
    return UpstreamFailure(iid, "broken", f"{iid} broke the connection: {type(err).__name__}: {err}")


# ------------------------------------------------------------------------------------------ prefill queue
def is_prefill_leg(path: str, body: Mapping[str, Any]) -> bool:
    """Whether an engine call is a prefill leg for the queue: a generation call whose ``kv_transfer_params`` ask
    the engine to keep its KV for a remote decode (``do_remote_decode``) — the disaggregated prefill and the split
    A leg (``fulcrum.router.handoff``)."""
    kv = body.get("kv_transfer_params")
    return path in _ENGINE_PATHS and isinstance(kv, Mapping) and kv.get("do_remote_decode") is True


def _new_queue(cfg: PrefillQueueConfig) -> Any:
    """A :class:`fulcrum.router.prefill_queue.NatsPrefillQueue` for ``cfg`` (connects on first use); imported
    here so that a router without the queue does not load nats-py."""
    from fulcrum.router.prefill_queue import NatsPrefillQueue

    return NatsPrefillQueue(cfg.servers(), cfg.stream, cfg.subject_prefix, durable=cfg.durable,
                            ack_wait_s=cfg.ack_wait_s, max_deliver=cfg.max_deliver, name="fulcrum-router",
                            connect_timeout_s=cfg.connect_timeout_s)


async def retire_queue(queue: Any, wait_s: float, sleep: Callable[[float], Any] = asyncio.sleep) -> None:
    """Close a replaced queue once the jobs still waiting on it are answered (or after ``wait_s`` seconds)."""
    waited = 0.0
    try:
        while queue.waiting and waited < wait_s:
            await sleep(0.1)
            waited += 0.1
    finally:
        await queue.close()


def queued_answer(iid: str, reply: Mapping[str, Any]) -> tuple[int, bytes, Any | None]:
    """A worker's reply ``{"status", "body"}`` as :meth:`~fulcrum.router.upstream.Transport.post`'s
    (status, raw, parsed-or-None).

    Raises:
        UpstreamFailure: "broken" when the reply is not of that shape, "status" for a 5xx (both not the chosen
            instance's fault: any worker may have run the job)."""
    status, data = reply.get("status"), reply.get("body")
    if not isinstance(status, int) or isinstance(status, bool) or not 100 <= status < 600:
        raise UpstreamFailure(iid, "broken", "a prefill worker replied without an HTTP status", instance_fault=False)
    raw = json.dumps(data).encode()
    if status >= 500:
        raise UpstreamFailure(iid, "status", f"prefill worker's engine answered HTTP {status}", status,
                              instance_fault=False)
    return status, raw, data if status == 200 else None


class QueuedTransport:
    """Direct calls over ``direct``; prefill legs through the NATS JetStream prefill queue when one is in use.

    :meth:`post` of a prefill leg (:func:`is_prefill_leg`, ``queueable``) publishes ``{"path", "body"}`` as a job,
    awaits a prefill worker's reply ``{"status", "body"}`` (``fulcrum.router.prefill_queue.engine_handler``) and
    returns it as the engine's answer. Every other call, and every call while no queue is in use
    (``prefill_queue.kind: direct``), goes to ``direct``. The instance the policy chose for the prefill keeps the
    router's accounting of the job (any puller may run it: the queue balances prefills by itself, DOPD §V-C).

    Outcomes (``fulcrum_router_prefill_jobs{outcome}``): ``ok``; ``failed`` — the workers' engines failed on
    every delivery → :class:`UpstreamFailure`, not held against the chosen instance (the router retries the
    request, then 502 with the worker's error); ``timeout`` — no worker replied within ``prefill_queue.timeout_s``
    — and ``unavailable`` — NATS unreachable — → 503 with the reason, or with ``on_timeout: direct`` the prefill
    leg over ``direct`` to the chosen instance while it is registered (``direct``). A queued job's 429 comes
    without ``Retry-After`` (the worker's reply carries no headers); every call over ``direct`` keeps it.

    Args:
        direct: the transport of every other call.
        metrics: the prefill-job metrics.
        clock: monotonic seconds (job latency).
        registered: whether an instance id is still registered (the ``direct`` fallback needs it).
        queue_factory: builds the queue for a ``kind: nats`` config (default: a ``NatsPrefillQueue``).
    """

    def __init__(self, direct: Transport, metrics: RouterMetrics, clock: Callable[[], float],
                 registered: Callable[[str], bool],
                 queue_factory: Callable[[PrefillQueueConfig], Any] = _new_queue) -> None:
        self.direct = direct
        self.metrics = metrics
        self.clock = clock
        self.registered = registered
        self.queue_factory = queue_factory
        self.queue: Any | None = None
        self.config = PrefillQueueConfig()

    def use_queue(self, cfg: PrefillQueueConfig) -> Any | None:
        """Switch to the queue ``cfg`` describes (none for ``kind: direct``); returns the queue it replaced."""
        old = self.queue
        self.config = cfg
        self.queue = self.queue_factory(cfg) if cfg.kind == "nats" else None
        return old

    def open(self, iid: str, base: str, path: str, body: dict[str, Any], deadline: Deadline
             ) -> AbstractAsyncContextManager[UpstreamResponse]:
        """Always ``direct``'s (streams and relayed answers never go through the queue)."""
        return self.direct.open(iid, base, path, body, deadline)

    async def get(self, iid: str, base: str, path: str, deadline: Deadline) -> tuple[int, bytes]:
        """Always ``direct``'s."""
        return await self.direct.get(iid, base, path, deadline)

    async def close(self) -> None:
        """Close the queue in use, then ``direct``."""
        try:
            if self.queue is not None:
                await self.queue.close()
        finally:
            await self.direct.close()

    async def post(self, iid: str, base: str, path: str, body: dict[str, Any] | bytes, deadline: Deadline, *,
                   queueable: bool) -> tuple[int, bytes, Any | None]:
        """As :meth:`fulcrum.router.upstream.Transport.post`; a queueable prefill leg goes through the queue when
        one is in use.

        Raises:
            UpstreamFailure: as the direct call; for a queued job (``instance_fault`` False), "status" when it
                failed on every delivery and "broken" when the reply is malformed.
            NoHealthyInstance: (queued, ``on_timeout: unavailable``) no worker replied in time, or NATS is
                unreachable; the message says which.
        """
        queue = self.queue
        if queue is None or not queueable or isinstance(body, bytes) or not is_prefill_leg(path, body):
            return await self.direct.post(iid, base, path, body, deadline, queueable=queueable)
        from fulcrum.router.prefill_queue import (
            InvalidPrefillJobError,
            PrefillJobError,
            PrefillQueueError,
            PrefillTimeoutError,
        )

        cfg = self.config
        m = self.metrics
        t0 = self.clock()
        m.prefill_jobs_waiting.inc()
        try:
            reply = await queue.submit({"path": path, "body": body}, timeout_s=cfg.timeout_s)
        except PrefillTimeoutError:
            outcome, reason = "timeout", f"no prefill worker replied within {cfg.timeout_s:g} s (prefill queue {cfg.stream})"
        except InvalidPrefillJobError as err:  # the worker refused the job as malformed: no retry would differ
            m.child(m.prefill_jobs, "failed").inc()
            raise UpstreamFailure(iid, "status", f"prefill job refused by the worker as malformed: {err}", 502,
                                  instance_fault=False, retryable=False) from err
        except PrefillJobError as err:
            m.child(m.prefill_jobs, "failed").inc()
            raise UpstreamFailure(iid, "status", f"prefill failed on every worker: {err}", 502,
                                  instance_fault=False) from err
        except PrefillQueueError as err:
            outcome, reason = "unavailable", f"the prefill queue is unavailable: {err}"
        else:
            m.child(m.prefill_jobs, "ok").inc()
            m.prefill_job_seconds.observe(max(0.0, self.clock() - t0))
            return queued_answer(iid, reply)
        finally:
            m.prefill_jobs_waiting.dec()
        m.child(m.prefill_jobs, outcome).inc()
        if cfg.on_timeout == "direct" and self.registered(iid):
            log.warning("%s; prefilling on %s over HTTP", reason, iid)
            m.child(m.prefill_jobs, "direct").inc()
            return await self.direct.post(iid, base, path, body, deadline, queueable=False)
        log.warning("%s", reason)
        raise NoHealthyInstance(f"no prefill capacity for the request: {reason}")
