"""The prefill queue on NATS JetStream: the router enqueues remote-prefill jobs, P-instances pull them (DOPD §V-C).

DOPD §V-C ("Connector"): "The prefill queue is implemented using a NATS service acting as a first-in-first-out
(FIFO) queue that holds requests awaiting remote prefill ... P-instances continuously poll this queue and dequeue
requests into their local processing queues." Optional per LLMServe (``spec.router.prefillQueue: nats``).

Layout (one stream per LLMServe; the operator picks the names, defaults below):

- stream ``FULCRUM_PREFILL``: subjects ``[<subject_prefix>.jobs]``, ``retention=workqueue`` (a message is removed
  once acknowledged: each job is done once), memory storage (jobs are short-lived; the router resubmits after a
  NATS restart), ``max_age`` bounds what a crashed router leaves behind, a duplicate window makes re-publishing
  the same job id idempotent (``Nats-Msg-Id``);
- one durable pull consumer ``prefill-workers`` shared by every worker: any number of workers pull from it, so
  the queue is elastic by construction (a new P-instance simply starts pulling); explicit acks, ``ack_wait`` (a
  worker that dies mid-job loses the job to another worker after ``ack_wait``), ``max_deliver``;
- replies: core NATS, not JetStream. Each router has one inbox ``_INBOX.<nuid>``; a job carries the headers
  ``Fulcrum-Job-Id`` and ``Fulcrum-Reply-To: _INBOX.<nuid>.<job id>``, the worker publishes its reply there, and
  the router resolves the waiting ``submit`` by job id.

Delivery is at least once: a worker replies, then acks, and sends ``in_progress`` heartbeats every
``ack_wait / 3`` while the handler runs, so only a dead worker's job is redelivered; a duplicate reply is ignored.

Request path (router config ``prefill_queue: {kind: nats}``): the router publishes each prefill leg as the job
``{"path": "/v1/completions" | "/v1/chat/completions", "body": <the engine request>}``; a worker next to a prefill
engine (:func:`run_prefill_worker`, or ``python -m fulcrum.router.prefill_queue``) POSTs the body to its engine and
replies ``{"status": <HTTP status>, "body": <the engine's JSON answer>}`` (with ``kv_transfer_params``). An engine
4xx is a reply (the client's error, not retried); a 5xx or an unreachable engine raises, so the job is nak'ed and
retried on another worker. A job that no worker could run (not JSON, not an object, ``path`` not an engine path,
``body`` not an object) is answered with its error at once and terminated (JetStream AckTerm): it is delivered once,
never redelivered, and ``submit`` raises :class:`InvalidPrefillJobError`.

Errors::

    FulcrumError
    └── PrefillQueueError          NATS unreachable, stream misconfigured, queue closed
        ├── PrefillTimeoutError    no reply within the timeout (also a TimeoutError); the job was withdrawn
        ├── PrefillJobError        the worker's handler failed on every delivery (its message is kept)
        │   └── InvalidPrefillJobError the job is malformed (also a ValueError): answered and terminated at once
        └── EngineUnavailableError (worker side) the local engine failed: the job is nak'ed and retried elsewhere
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, RetentionPolicy, StorageType, StreamConfig

from fulcrum.cancellation import cancel_and_wait
from fulcrum.errors import FulcrumError, clipped

__all__ = [
    "Handler",
    "NatsPrefillQueue",
    "PrefillJobError",
    "PrefillQueueError",
    "PrefillTimeoutError",
    "PrefillWorker",
    "QueueLayout",
    "ENGINE_PATHS",
    "EngineUnavailableError",
    "InvalidPrefillJobError",
    "engine_handler",
    "run_prefill_worker",
    "main",
]

log = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
"""A worker's job handler: the job (a JSON object) in, the reply (a JSON object) out; raising means failure."""

JOB_ID_HEADER = "Fulcrum-Job-Id"
REPLY_TO_HEADER = "Fulcrum-Reply-To"
MSG_ID_HEADER = "Nats-Msg-Id"

_PUBLISH_ATTEMPT_S = 2.0
"""How long one publish attempt waits for JetStream's ack, seconds: a publish made while NATS reconnects can be
lost with the old connection, so it is sent again (same ``Nats-Msg-Id``: deduplicated) rather than waited on
for the whole request timeout."""


class PrefillQueueError(FulcrumError):
    """The prefill queue could not be used: NATS unreachable, stream misconfigured, queue closed."""


class PrefillTimeoutError(PrefillQueueError, TimeoutError):
    """No worker replied within the timeout; the job was withdrawn from the stream (best effort)."""


class PrefillJobError(PrefillQueueError):
    """A worker's handler failed on the last allowed delivery; the message is the worker's error text."""


class InvalidPrefillJobError(PrefillJobError, ValueError):
    """A job that cannot be run on any worker: not JSON, not an object, or (:func:`engine_handler`) a ``path``
    that is not an engine path or a ``body`` that is not an object.

    Worker side: a handler raises it to refuse a job; the worker replies the error at once and terminates the
    message (AckTerm), so it is never redelivered (other handler errors are retried up to ``max_deliver``).
    Router side: ``submit`` raises it for such a reply (a :class:`PrefillJobError`, so callers that handle that
    need no change).
    """


@dataclass(frozen=True, slots=True)
class QueueLayout:
    """The JetStream names and settings that the router and the workers of one LLMServe must share.

    Attributes:
        stream: stream name, e.g. ``FULCRUM_PREFILL`` (per LLMServe in a cluster: ``PREFILL_<ns>_<name>``).
        subject_prefix: subjects live under it; jobs are published on ``<subject_prefix>.jobs``.
        durable: name of the one durable pull consumer all workers share.
        ack_wait_s: seconds without ack (or ``in_progress`` heartbeat) before a job is redelivered. 30 s: far
            above one prefill, and only a dead worker stops heartbeating.
        max_deliver: deliveries per job before the worker gives up and replies an error. 3: one retry on
            another worker after a transient failure, without looping on a poison job.
        max_age_s: a job older than this is dropped by the stream (a crashed router's leftovers), seconds.
        storage: ``"memory"`` (default: jobs are short-lived) or ``"file"``.
    """

    stream: str = "FULCRUM_PREFILL"
    subject_prefix: str = "fulcrum.prefill"
    durable: str = "prefill-workers"
    ack_wait_s: float = 30.0
    max_deliver: int = 3
    max_age_s: float = 300.0
    storage: Literal["memory", "file"] = "memory"

    def __post_init__(self) -> None:
        if not self.stream or any(c in self.stream for c in " .*>"):
            raise ValueError(f"bad stream name {self.stream!r}")
        if not self.subject_prefix or any(c in self.subject_prefix for c in " *>"):
            raise ValueError(f"bad subject prefix {self.subject_prefix!r}")
        if self.ack_wait_s <= 0 or self.max_age_s <= 0 or self.max_deliver < 1:
            raise ValueError("ack_wait_s and max_age_s must be > 0 and max_deliver >= 1")

    @classmethod
    def for_llmserve(cls, namespace: str, name: str, **settings: Any) -> "QueueLayout":
        """The names of one LLMServe's queue: stream ``PREFILL_<NAMESPACE>_<NAME>`` (upper case, other characters
        as ``_``), subjects ``fulcrum.prefill.<namespace>.<name>`` (``.`` in a name as ``_``).

        Raises:
            ValueError: an empty namespace or name, or invalid ``settings``.
        """
        if not namespace or not name:
            raise ValueError("namespace and name must not be empty")

        def token(x: str) -> str:
            return "".join(c if c.isalnum() or c in "_-" else "_" for c in x)

        return cls(stream=f"PREFILL_{token(namespace)}_{token(name)}".upper(),
                   subject_prefix=f"fulcrum.prefill.{token(namespace)}.{token(name)}", **settings)

    @property
    def jobs_subject(self) -> str:
        """The subject jobs are published on."""
        return f"{self.subject_prefix}.jobs"

    def stream_config(self) -> StreamConfig:
        """The work-queue stream's configuration."""
        return StreamConfig(
            name=self.stream,
            subjects=[self.jobs_subject],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.MEMORY if self.storage == "memory" else StorageType.FILE,
            max_age=self.max_age_s,
            duplicate_window=min(120.0, self.max_age_s),
        )

    def consumer_config(self) -> ConsumerConfig:
        """The shared durable pull consumer's configuration."""
        return ConsumerConfig(
            name=self.durable,
            durable_name=self.durable,
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s,
            max_deliver=self.max_deliver,
            filter_subject=self.jobs_subject,
            max_ack_pending=-1,
        )


async def _connect(servers: str | list[str], name: str, timeout_s: float,
                   after_reconnect: Callable[[], None] | None = None) -> NatsClient:
    """Connect; once connected, reconnect for ever (logged). The first connection is bounded by ``timeout_s``.

    ``after_reconnect`` is called after each reconnection (a restarted nats-server with memory storage has lost
    the stream and the consumer: the caller sets them up again).

    Raises:
        PrefillQueueError: no server answered within ``timeout_s``.
    """

    async def on_error(exc: Exception) -> None:
        log.warning("nats %s: %s: %s", name, type(exc).__name__, exc)

    async def on_disconnected() -> None:
        log.warning("nats %s: disconnected; reconnecting", name)

    async def on_reconnected() -> None:
        log.info("nats %s: reconnected", name)
        if after_reconnect is not None:
            after_reconnect()

    nc = NatsClient()
    try:
        # with max_reconnect_attempts=-1 nats-py retries the first connection for ever too: bound it here
        await asyncio.wait_for(
            nc.connect(
                servers,
                name=name,
                error_cb=on_error,
                disconnected_cb=on_disconnected,
                reconnected_cb=on_reconnected,
                max_reconnect_attempts=-1,
                reconnect_time_wait=1,
                connect_timeout=max(1, int(timeout_s)),
            ),
            timeout_s,
        )
    except Exception as exc:  # TimeoutError, NoServersError, OSError
        with contextlib.suppress(Exception):
            await nc.close()
        raise PrefillQueueError(f"cannot connect to NATS at {servers} within {timeout_s} s: {exc!r}") from exc
    return nc


async def _ensure_stream_and_consumer(js: JetStreamContext, layout: QueueLayout) -> None:
    """Create the work-queue stream and the shared consumer, or check and update existing ones.

    Raises:
        PrefillQueueError: the stream exists with another retention policy, or JetStream is unavailable.
    """
    try:
        try:
            await js.add_stream(layout.stream_config())
        except nats.js.errors.BadRequestError:
            info = await js.stream_info(layout.stream)
            if info.config.retention != RetentionPolicy.WORK_QUEUE:
                raise PrefillQueueError(
                    f"stream {layout.stream} exists with retention {info.config.retention}, not workqueue"
                ) from None
            try:
                await js.update_stream(layout.stream_config())
            except nats.js.errors.BadRequestError as exc:
                log.warning("prefill queue: stream %s kept with its existing settings (%s)", layout.stream, exc)
        try:
            await js.add_consumer(layout.stream, layout.consumer_config())
        except nats.js.errors.BadRequestError as exc:
            await js.consumer_info(layout.stream, layout.durable)  # exists: use it as it is
            log.warning("prefill queue: consumer %s kept with its existing settings (%s)", layout.durable, exc)
    except PrefillQueueError:
        raise
    except Exception as exc:
        raise PrefillQueueError(f"JetStream stream {layout.stream} could not be set up: {exc}") from exc


class _StreamRestore:
    """What the router's queue and the worker share after a reconnection: ``_stale`` (set on reconnection) and
    :meth:`_restore`, which sets the stream and the consumer up again (a restarted nats-server with memory storage
    lost them)."""

    _js: Any
    _stale: bool
    layout: QueueLayout

    async def _restore(self) -> None:
        """Set the stream and the consumer up again; ``_stale`` stays set when that fails, so the next call tries
        again.

        Raises:
            PrefillQueueError: JetStream is unavailable or the stream cannot be set up.
        """
        assert self._js is not None
        self._stale = False
        try:
            await _ensure_stream_and_consumer(self._js, self.layout)
        except BaseException:
            self._stale = True
            raise


class NatsPrefillQueue(_StreamRestore):
    """Router side of the prefill queue: submit jobs and await their replies; report the queue depth.

    Args:
        servers: NATS URL(s), e.g. ``"nats://nats:4222"``.
        stream, subject_prefix, durable, ack_wait_s, max_deliver, max_age_s, storage: see :class:`QueueLayout`
            (workers must use the same values).
        name: client name shown by the NATS server.
        connect_timeout_s: how long the first connection may take, seconds (later outages are reconnected for
            ever). 5 s.

    ``connect()`` is called by the first ``submit``/``depth`` when not called before. Safe to share between
    concurrent tasks of one event loop.
    """

    def __init__(
        self,
        servers: str | list[str],
        stream: str = "FULCRUM_PREFILL",
        subject_prefix: str = "fulcrum.prefill",
        *,
        durable: str = "prefill-workers",
        ack_wait_s: float = 30.0,
        max_deliver: int = 3,
        max_age_s: float = 300.0,
        storage: Literal["memory", "file"] = "memory",
        name: str = "fulcrum-router",
        connect_timeout_s: float = 5.0,
    ) -> None:
        self.layout = QueueLayout(stream, subject_prefix, durable, ack_wait_s, max_deliver, max_age_s, storage)
        self._servers = servers
        self._connect_timeout_s = connect_timeout_s
        self._name = name
        self._nc: NatsClient | None = None
        self._js: JetStreamContext | None = None
        self._inbox = ""
        self._pending: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._connect_lock = asyncio.Lock()
        self._closed = False
        self._stale = False  # set on reconnection: check (and recreate) the stream before the next publish
        # jobs waiting for a reply: what was published (payload, headers) and the stream sequence it got, so
        # that a reconnection can publish them again (a restarted nats-server with memory storage lost them)
        self._sent: dict[str, tuple[bytes, dict[str, str]]] = {}
        self._seqs: dict[str, int] = {}
        self._republishing: asyncio.Task[None] | None = None

    async def connect(self) -> None:
        """Connect, create/check the stream and consumer, subscribe to this router's reply inbox. Idempotent.

        Raises:
            PrefillQueueError: NATS unreachable or the stream cannot be set up.
        """
        async with self._connect_lock:
            if self._closed:
                raise PrefillQueueError("prefill queue is closed")
            if self._nc is not None:
                return
            nc = await _connect(self._servers, self._name, self._connect_timeout_s, self._mark_stale)
            try:
                js = nc.jetstream()
                await _ensure_stream_and_consumer(js, self.layout)
                inbox = nc.new_inbox()
                await nc.subscribe(f"{inbox}.*", cb=self._on_reply)
            except BaseException:
                await nc.close()
                raise
            self._nc, self._js, self._inbox = nc, js, inbox

    def _mark_stale(self) -> None:
        """After a reconnection: check the stream before the next publish, and publish the waiting jobs again."""
        self._stale = True
        if self._sent and not self._closed and (self._republishing is None or self._republishing.done()):
            self._republishing = asyncio.create_task(self._republish())

    async def _republish(self) -> None:
        """Publish the jobs still waiting for a reply again, with their own ``Nats-Msg-Id``.

        A job whose message the stream still holds (file storage, a network blip) is left alone; one the stream
        lost (a restarted nats-server with memory storage) is queued again instead of waiting for its timeout.
        A job a worker had in hand when the stream was lost may then run twice; the first reply wins (at least
        once), and a copy within the stream's duplicate window is dropped by JetStream.
        """
        try:
            if self._js is None:
                return
            await self._restore()
            again = 0
            for job_id, (payload, headers) in list(self._sent.items()):
                if self._js is None or job_id not in self._sent or await self._still_queued(job_id):
                    continue
                try:
                    ack = await self._js.publish(self.layout.jobs_subject, payload, timeout=_PUBLISH_ATTEMPT_S,
                                                 stream=self.layout.stream, headers=headers)
                except nats.errors.Error as exc:  # the waiting submit still times out cleanly
                    log.warning("prefill queue: job %s not published again after reconnecting: %s", job_id, exc)
                    continue
                if not ack.duplicate:
                    again += 1
                    if job_id in self._seqs:
                        self._seqs[job_id] = ack.seq
            if again:
                log.warning("prefill queue: %d waiting job(s) were lost by NATS (restarted?) and published again",
                            again)
        except Exception as exc:  # PrefillQueueError from _restore: the next submit sets the stream up again
            log.warning("prefill queue: waiting jobs not published again after reconnecting: %s", exc)

    async def _still_queued(self, job_id: str) -> bool:
        """Whether the stream still holds this job's message (waiting or in a worker's hands)."""
        seq = self._seqs.get(job_id)
        if seq is None or self._js is None:
            return False
        try:
            msg = await self._js.get_msg(self.layout.stream, seq)
        except Exception:  # NotFoundError: taken and acknowledged, or lost with the stream
            return False
        return bool((msg.headers or {}).get(MSG_ID_HEADER) == job_id)


    async def _publish(self, job_id: str, payload: bytes, headers: dict[str, str], deadline: float) -> Any:
        """Publish one job to the stream by ``deadline`` (``time.monotonic()`` seconds); the JetStream ack.

        Each attempt waits at most ``_PUBLISH_ATTEMPT_S``; a lost ack (NATS reconnecting) or a missing stream
        (a restarted nats-server with memory storage) is retried with the same ``Nats-Msg-Id``, which the
        stream's duplicate window makes idempotent, after setting the stream up again where needed.

        Raises:
            PrefillTimeoutError: no attempt was acknowledged by ``deadline``.
            PrefillQueueError: the publish was refused (e.g. the job is over the server's ``max_payload``), or
                the stream could not be set up again.
        """
        assert self._js is not None
        while True:
            if self._stale:
                try:
                    await asyncio.wait_for(self._restore(), max(0.1, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    raise PrefillTimeoutError(f"job {job_id}: stream {self.layout.stream} could not be set up "
                                              "again in time") from None
            remaining = deadline - time.monotonic()
            try:
                return await self._js.publish(
                    self.layout.jobs_subject, payload, timeout=max(0.1, min(remaining, _PUBLISH_ATTEMPT_S)),
                    stream=self.layout.stream, headers=headers,
                )
            except nats.js.errors.NoStreamResponseError as exc:
                self._stale = True  # the stream is gone: set it up again, then publish again
                if deadline - time.monotonic() <= 0:
                    raise PrefillTimeoutError(f"job {job_id}: stream {self.layout.stream} did not accept the "
                                              "publish in time") from exc
                log.warning("prefill queue: stream %s missing (nats-server restarted?); setting it up again",
                            self.layout.stream)
            except nats.errors.TimeoutError as exc:
                if deadline - time.monotonic() <= 0:
                    raise PrefillTimeoutError(
                        f"job {job_id}: JetStream did not acknowledge the publish in time") from exc
            except nats.errors.MaxPayloadError as exc:
                limit = self._nc.max_payload if self._nc is not None else 0
                raise PrefillQueueError(
                    f"job {job_id} is {len(payload)} bytes, over the NATS server's max_payload of {limit} bytes: "
                    "raise max_payload in the nats-server configuration (up to 64 MB), or send such prompts "
                    "without the queue") from exc
            except nats.errors.Error as exc:
                raise PrefillQueueError(f"job {job_id}: publish failed: {exc}") from exc
            await asyncio.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    async def _on_reply(self, msg: Msg) -> None:
        job_id = msg.subject.rsplit(".", 1)[-1]
        future = self._pending.get(job_id)
        if future is None or future.done():
            return  # a duplicate (redelivered job) or a reply after the timeout
        try:
            reply = json.loads(msg.data)
        except ValueError as exc:
            future.set_exception(PrefillQueueError(f"job {job_id}: unreadable reply: {exc}"))
            return
        if not isinstance(reply, dict):
            future.set_exception(PrefillQueueError(f"job {job_id}: reply is not a JSON object"))
        elif reply.get("ok"):
            result = reply.get("result")
            future.set_result(result if isinstance(result, dict) else {})
        else:
            error = InvalidPrefillJobError if reply.get("invalid") else PrefillJobError
            future.set_exception(error(f"job {job_id}: {reply.get('error', 'worker failed')}"))

    async def submit(self, job: dict[str, Any], timeout_s: float = 30.0) -> dict[str, Any]:
        """Enqueue one prefill job and wait for a worker's reply.

        Args:
            job: the job, a JSON-serialisable object (e.g. the OpenAI request with ``max_tokens=1`` and
                ``kv_transfer_params``); the worker's handler receives it as is.
            timeout_s: seconds to wait, publish included.

        Returns:
            The handler's reply object (e.g. the prefill response carrying ``kv_transfer_params``).

        Raises:
            PrefillTimeoutError: no reply in time (no worker, or all busy); the job is deleted from the stream
                so that no worker prefills for a request nobody waits for any more. A job that a restarted
                nats-server lost while it waited is published again after the reconnection (:meth:`_republish`).
            PrefillJobError: the handler failed on its last allowed delivery; :class:`InvalidPrefillJobError`
                (a subclass) when the worker refused the job as malformed on its first delivery.
            PrefillQueueError: NATS unreachable, the stream cannot be set up again, the job is over the server's
                ``max_payload`` (the message names both sizes), or the queue was closed while waiting.
            TypeError: ``job`` is not JSON-serialisable.
        """
        payload = json.dumps(job).encode()
        deadline = time.monotonic() + timeout_s
        await self.connect()
        assert self._js is not None
        job_id = uuid.uuid4().hex
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[job_id] = future
        headers = {JOB_ID_HEADER: job_id, REPLY_TO_HEADER: f"{self._inbox}.{job_id}", MSG_ID_HEADER: job_id}
        self._sent[job_id] = (payload, headers)
        try:
            ack = await self._publish(job_id, payload, headers, deadline)
            self._seqs.setdefault(job_id, ack.seq)
            try:
                return await asyncio.wait_for(future, max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                await self._withdraw(self._seqs.get(job_id, ack.seq))
                raise PrefillTimeoutError(f"job {job_id}: no prefill worker replied within {timeout_s} s") from None
            except asyncio.CancelledError:
                if future.cancelled() and self._closed:
                    raise PrefillQueueError(f"job {job_id}: prefill queue closed while waiting") from None
                await self._withdraw(self._seqs.get(job_id, ack.seq))
                raise
        finally:
            self._pending.pop(job_id, None)
            self._sent.pop(job_id, None)
            self._seqs.pop(job_id, None)

    @property
    def waiting(self) -> int:
        """Jobs this router submitted and still waits for (count)."""
        return len(self._pending)

    async def _withdraw(self, seq: int) -> None:
        """Delete a job from the stream (best effort: it may have been taken or acknowledged meanwhile)."""
        if self._js is None:
            return
        with contextlib.suppress(Exception):
            await self._js.delete_msg(self.layout.stream, seq)

    async def depth(self) -> int:
        """Jobs waiting for a first delivery (submitted, not yet taken by any worker): demand at admission.

        Jobs being processed, or waiting to be redelivered after a failure, are not counted.

        Raises:
            PrefillQueueError: NATS unreachable or the consumer missing.
        """
        await self.connect()
        assert self._js is not None
        if self._stale:  # reconnected: the stream may be gone with a restarted nats-server
            await self._restore()
        try:
            info = await self._js.consumer_info(self.layout.stream, self.layout.durable)
        except Exception as exc:
            raise PrefillQueueError(f"consumer {self.layout.durable} could not be read: {exc}") from exc
        return int(info.num_pending or 0)

    async def close(self) -> None:
        """Fail the jobs still waiting (``PrefillQueueError``) and close the connection. Idempotent."""
        self._closed = True
        for future in self._pending.values():
            if not future.done():
                future.cancel()
        republishing, self._republishing = self._republishing, None
        if republishing is not None:
            await cancel_and_wait([republishing])
        nc, self._nc, self._js = self._nc, None, None
        if nc is not None:
            with contextlib.suppress(Exception):
                await nc.close()


def _json_type(value: Any) -> str:
    """The JSON type of a decoded value (``"array"``, ``"string"``, ...), for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object" if isinstance(value, dict) else type(value).__name__


class PrefillWorker(_StreamRestore):
    """Worker side (a P-instance): pull jobs from the shared consumer, run the handler, reply, acknowledge.

    Args:
        servers: NATS URL(s).
        stream, subject_prefix, durable, ack_wait_s, max_deliver, max_age_s, storage: see :class:`QueueLayout`
            (the same values as the router's).
        concurrency: jobs handled at once by this worker. 1 keeps a single worker strictly FIFO.
        fetch_timeout_s: how long one pull waits for a job, seconds; bounds how long ``close()`` waits for the
            pull loop. 1 s.
        worker_id: shown in logs and replies (default: a random id).
        connect_timeout_s: how long the first connection may take, seconds. 5 s.

    A failing handler: the job is nak'ed and redelivered (to any worker) until ``max_deliver`` deliveries, then
    the router gets an error reply and the job is terminated. Redelivery is immediate, except after an
    :class:`EngineUnavailableError` (``fetch_timeout_s + 0.5`` s later, so that a worker that paused on it no
    longer has a pull waiting that would take the job again). A job that cannot be valid on any worker — not a
    JSON object, or the handler raises :class:`InvalidPrefillJobError` — gets its error reply at once and is
    terminated (AckTerm): delivered once, never redelivered. A reply over the server's ``max_payload`` is replaced
    by an error reply naming the sizes (the router gets ``PrefillJobError`` at once, not a timeout). After each
    reconnection the stream and the consumer are set up again before the next pull (a restarted nats-server with
    memory storage lost them, and a pull on a missing consumer only times out).
    """

    def __init__(
        self,
        servers: str | list[str],
        stream: str = "FULCRUM_PREFILL",
        subject_prefix: str = "fulcrum.prefill",
        *,
        durable: str = "prefill-workers",
        ack_wait_s: float = 30.0,
        max_deliver: int = 3,
        max_age_s: float = 300.0,
        storage: Literal["memory", "file"] = "memory",
        concurrency: int = 1,
        fetch_timeout_s: float = 1.0,
        worker_id: str | None = None,
        connect_timeout_s: float = 5.0,
    ) -> None:
        if concurrency < 1 or fetch_timeout_s <= 0:
            raise ValueError("concurrency must be >= 1 and fetch_timeout_s > 0")
        self.layout = QueueLayout(stream, subject_prefix, durable, ack_wait_s, max_deliver, max_age_s, storage)
        self.worker_id = worker_id or uuid.uuid4().hex[:8]
        self._servers = servers
        self._connect_timeout_s = connect_timeout_s
        self._concurrency = concurrency
        self._fetch_timeout_s = fetch_timeout_s
        self._nc: NatsClient | None = None
        self._sub: JetStreamContext.PullSubscription | None = None
        self._closing = asyncio.Event()
        self._open = asyncio.Event()  # cleared by pause(): no new pulls
        self._open.set()
        self._pull_loop_done: asyncio.Event | None = None  # set when run()'s pull loop has ended
        self._jobs: set[asyncio.Task[None]] = set()
        self._js: JetStreamContext | None = None
        self._stale = False  # set on reconnection: the pull loop sets the stream and the consumer up again
        self._connect_lock = asyncio.Lock()

    async def connect(self) -> None:
        """Connect, create/check the stream and consumer, bind a pull subscription. Idempotent.

        Raises:
            PrefillQueueError: NATS unreachable or the stream cannot be set up.
        """
        async with self._connect_lock:  # concurrent callers share one connection
            if self._nc is not None:
                return
            nc = await _connect(self._servers, f"fulcrum-prefill-worker-{self.worker_id}",
                                self._connect_timeout_s, self._mark_stale)
            try:
                js = nc.jetstream()
                await _ensure_stream_and_consumer(js, self.layout)
                self._sub = await js.pull_subscribe_bind(durable=self.layout.durable, stream=self.layout.stream)
            except BaseException:
                await nc.close()
                raise
            self._nc, self._js = nc, js

    def _mark_stale(self) -> None:
        self._stale = True

    async def run(self, handler: Handler) -> None:
        """Pull and handle jobs until ``close()`` is called; cancelling it naks the jobs in hand (redelivered now).

        Raises:
            PrefillQueueError: the first connection failed (later NATS outages are logged and retried).
        """
        await self.connect()
        assert self._sub is not None
        slots = asyncio.Semaphore(self._concurrency)
        failures = 0
        loop_done = self._pull_loop_done = asyncio.Event()
        try:
            while not self._closing.is_set():
                if not self._open.is_set():  # paused: look again within a fetch timeout (close() stays prompt)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._open.wait(), self._fetch_timeout_s)
                    continue
                await slots.acquire()
                try:
                    if self._stale and self._js is not None:
                        # reconnected: a restarted nats-server (memory storage) lost the stream and the consumer,
                        # and a pull on a missing consumer only times out; set them up again first
                        await self._restore()
                    msgs = await self._sub.fetch(1, timeout=self._fetch_timeout_s)
                    failures = 0
                except nats.errors.TimeoutError:
                    slots.release()
                    continue
                except Exception as exc:  # disconnected, reconnecting, JetStream briefly unavailable
                    slots.release()
                    if self._closing.is_set():
                        break
                    failures += 1
                    delay = min(5.0, 0.1 * 2 ** min(failures, 6))
                    log.warning("prefill worker %s: pull failed (%s: %s); retrying in %.1f s",
                                self.worker_id, type(exc).__name__, exc, delay)
                    await asyncio.sleep(delay)
                    continue
                for msg in msgs:
                    task = asyncio.create_task(self._handle(msg, handler))
                    self._jobs.add(task)
                    task.add_done_callback(self._jobs.discard)
                    task.add_done_callback(lambda _t: slots.release())
        except asyncio.CancelledError:
            jobs = list(self._jobs)
            for task in jobs:
                task.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
            raise
        finally:
            loop_done.set()
        if self._jobs:  # close(): let the jobs in hand finish
            await asyncio.gather(*list(self._jobs), return_exceptions=True)

    @property
    def paused(self) -> bool:
        """Whether :meth:`pause` stopped the pulling."""
        return not self._open.is_set()

    def pause(self) -> None:
        """Take no new jobs until :meth:`resume` (the jobs in hand continue; a pull already waiting may still
        deliver one). For a worker whose engine is failing, so that the queue gives its jobs to others."""
        self._open.clear()

    def resume(self) -> None:
        """Pull again after :meth:`pause`."""
        self._open.set()

    async def _heartbeat(self, msg: Msg) -> None:
        """Tell JetStream the job is still being worked on, every ack_wait / 3, so it is not redelivered."""
        while True:
            await asyncio.sleep(self.layout.ack_wait_s / 3.0)
            with contextlib.suppress(Exception):
                await msg.in_progress()

    async def _reply(self, msg: Msg, body: dict[str, Any]) -> None:
        reply_to = (msg.headers or {}).get(REPLY_TO_HEADER)
        if not reply_to or self._nc is None:
            return
        job_id = (msg.headers or {}).get(JOB_ID_HEADER, "")
        body = {**body, "worker": self.worker_id, "job_id": job_id}
        data = json.dumps(body).encode()
        limit = self._nc.max_payload
        if limit and len(data) > limit:  # the router would wait for its timeout: tell it why instead
            log.error("prefill worker %s: reply to job %s is %d bytes, over the NATS server's max_payload of %d",
                      self.worker_id, job_id, len(data), limit)
            data = json.dumps({
                "ok": False, "worker": self.worker_id, "job_id": job_id,
                "error": f"the worker's reply is {len(data)} bytes, over the NATS server's max_payload of {limit} "
                         "bytes: raise max_payload in the nats-server configuration",
            }).encode()
        try:
            await self._nc.publish(reply_to, data)
        except Exception as exc:
            log.warning("prefill worker %s: reply to %s failed: %s", self.worker_id, reply_to, exc)

    async def _refuse(self, msg: Msg, job_id: str, reason: str) -> None:
        """Answer a job no worker could run with its error, then terminate it (AckTerm: never redelivered)."""
        log.error("prefill worker %s: job %s is invalid (%s); answered and terminated, not redelivered",
                  self.worker_id, job_id, reason)
        await self._reply(msg, {"ok": False, "invalid": True, "error": f"invalid prefill job: {reason}"})
        try:
            await msg.term()
        except Exception as exc:  # the connection dropped: redelivered after ack_wait and refused again
            log.warning("prefill worker %s: terminating job %s failed: %s", self.worker_id, job_id, exc)

    async def _handle(self, msg: Msg, handler: Handler) -> None:
        job_id = (msg.headers or {}).get(JOB_ID_HEADER, "?")
        try:
            job = json.loads(msg.data)
        except ValueError as exc:  # UnicodeDecodeError too
            await self._refuse(msg, job_id, f"not JSON: {exc}")
            return
        if not isinstance(job, dict):
            await self._refuse(msg, job_id, f"a JSON {_json_type(job)}, not an object")
            return
        heartbeat = asyncio.create_task(self._heartbeat(msg))
        try:
            result = await handler(job)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await msg.nak()
            raise
        except InvalidPrefillJobError as exc:  # no worker could run it: no retry
            await self._refuse(msg, job_id, str(exc))
            return
        except Exception as exc:
            delivered = msg.metadata.num_delivered or 1
            if delivered >= self.layout.max_deliver:
                log.error("prefill worker %s: job %s failed on delivery %d/%d (%s); giving up",
                          self.worker_id, job_id, delivered, self.layout.max_deliver, exc)
                await self._reply(msg, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
                with contextlib.suppress(Exception):
                    await msg.term()
            else:
                # an engine failure is redelivered after this worker's waiting pull has expired (and
                # run_prefill_worker has paused it), so another worker gets the job; other failures at once
                delay = self._fetch_timeout_s + 0.5 if isinstance(exc, EngineUnavailableError) else None
                log.warning("prefill worker %s: job %s failed on delivery %d/%d (%s); redelivering",
                            self.worker_id, job_id, delivered, self.layout.max_deliver, exc)
                with contextlib.suppress(Exception):
                    await msg.nak(delay=delay)
            return
        finally:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
        await self._reply(msg, {"ok": True, "result": result})
        try:
            await msg.ack()
        except Exception as exc:  # the job was withdrawn (router timed out) or the connection dropped
            log.warning("prefill worker %s: ack of job %s failed: %s", self.worker_id, job_id, exc)

    async def close(self) -> None:
        """Stop pulling (after the pull in progress, at most ``fetch_timeout_s``), let the jobs in hand finish,
        close the connection. Idempotent."""
        self._closing.set()
        if self._pull_loop_done is not None:  # the pull loop ends within one fetch timeout
            await self._pull_loop_done.wait()
        if self._jobs:
            await asyncio.gather(*list(self._jobs), return_exceptions=True)
        nc, self._nc, self._sub, self._js = self._nc, None, None, None
        if nc is not None:
            with contextlib.suppress(Exception):
                await nc.close()


# ------------------------------------------------------------------------------------------ beside an engine
ENGINE_PATHS: frozenset[str] = frozenset({"/v1/completions", "/v1/chat/completions"})
"""The engine paths a prefill job may name (anything else is refused: a job is not a general HTTP proxy)."""


class EngineUnavailableError(PrefillQueueError):
    """The local engine failed (5xx, refused, timed out): the job is nak'ed and retried on another worker."""


def engine_handler(session: aiohttp.ClientSession, engine_url: str, timeout_s: float = 600.0) -> Handler:
    """A :class:`PrefillWorker` handler that runs each job on the engine at ``engine_url``.

    Job ``{"path": one of ENGINE_PATHS, "body": {...}}`` → ``POST engine_url + path`` → reply ``{"status": int,
    "body": <the engine's JSON answer>}``. A 2xx/4xx answer is the reply (a 4xx is the client's error and is not
    retried); a 5xx, a connection failure or ``timeout_s`` seconds without an answer raise
    :class:`EngineUnavailableError` (nak → another worker).

    Raises (from the handler): InvalidPrefillJobError (a ValueError) for a malformed job — ``path`` missing or not
    one of ENGINE_PATHS, ``body`` missing or not an object: the worker replies the error at once and terminates
    the job, no other worker gets it; EngineUnavailableError as above.
    """
    base = engine_url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def handle(job: dict[str, Any]) -> dict[str, Any]:
        path, body = job.get("path"), job.get("body")
        if not isinstance(path, str) or path not in ENGINE_PATHS:  # a list or dict path is not hashable
            shown = "missing" if path is None else clipped(repr(path))
            raise InvalidPrefillJobError(f"path {shown}: a prefill job needs a path in {sorted(ENGINE_PATHS)}")
        if not isinstance(body, dict):
            shown = "missing" if body is None else f"a JSON {_json_type(body)}"
            raise InvalidPrefillJobError(f"body {shown}: a prefill job needs an object body (the engine request)")
        try:
            async with session.post(base + str(path), json=body, timeout=timeout) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise EngineUnavailableError(f"engine {base}: {type(exc).__name__}: {exc}") from exc
        if status >= 500:
            raise EngineUnavailableError(f"engine {base} answered HTTP {status}: {raw[:300].decode(errors='replace')}")
        try:
            data = json.loads(raw)
        except ValueError:
            if status == 200:
                raise EngineUnavailableError(f"engine {base} answered 200 with a body that is not JSON") from None
            data = {"error": {"message": raw[:500].decode(errors="replace"), "type": "upstream_error"}}
        return {"status": status, "body": data}

    return handle


async def _engine_ready(session: aiohttp.ClientSession, engine_url: str, stop: asyncio.Event,
                        interval_s: float) -> bool:
    """Wait until ``GET /health`` answers 200 (True) or ``stop`` is set (False)."""
    timeout = aiohttp.ClientTimeout(total=max(1.0, interval_s))
    while not stop.is_set():
        try:
            async with session.get(engine_url.rstrip("/") + "/health", timeout=timeout) as resp:
                await resp.read()
                if resp.status == 200:
                    return True
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            pass
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)
    return False


async def run_prefill_worker(
    nats_url: str | list[str],
    engine_url: str,
    *,
    stream: str = "FULCRUM_PREFILL",
    subject_prefix: str = "fulcrum.prefill",
    durable: str = "prefill-workers",
    ack_wait_s: float = 30.0,
    max_deliver: int = 3,
    concurrency: int = 4,
    request_timeout_s: float = 600.0,
    worker_id: str | None = None,
    stop: asyncio.Event | None = None,
    wait_for_engine: bool = True,
    ready_interval_s: float = 0.5,
) -> None:
    """Pull prefill jobs for the engine at ``engine_url`` until ``stop`` is set (DOPD §V-C: P-instances poll the
    prefill queue and dequeue requests into their local processing queues).

    What a worker pod starts next to a prefill (or ``both``) engine. Waits for the engine's ``/health`` first
    (``wait_for_engine``), so a starting vLLM takes no jobs; then runs :class:`PrefillWorker` with
    :func:`engine_handler`. When the engine fails a job (5xx, refused, timed out) the job is nak'ed for another
    worker and this one pauses until the engine's ``/health`` answers 200 again (probed every
    ``ready_interval_s``), so a broken engine does not keep taking — and failing — the queue's jobs. Setting ``stop`` ends it gracefully: no new pulls, the jobs in hand finish and are
    acknowledged. Cancelling it naks the jobs in hand (redelivered at once).

    Args:
        nats_url: NATS URL(s). engine_url: the engine's base URL, e.g. ``http://127.0.0.1:8000``.
        stream, subject_prefix, durable, ack_wait_s, max_deliver: the queue layout (the router's values).
        concurrency: jobs in hand at once (the engine batches them), count. 4.
        request_timeout_s: one engine call's limit, seconds.
        worker_id: shown in logs and replies (default: random). stop: ends the worker when set.

    Raises:
        PrefillQueueError: the first NATS connection failed (later outages are retried).
        ValueError: invalid layout or concurrency.
    """
    stop = stop if stop is not None else asyncio.Event()
    worker = PrefillWorker(nats_url, stream, subject_prefix, durable=durable, ack_wait_s=ack_wait_s,
                           max_deliver=max_deliver, concurrency=concurrency, worker_id=worker_id)
    connector = aiohttp.TCPConnector(limit=max(concurrency, 1) * 2)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        if wait_for_engine and not await _engine_ready(session, engine_url, stop, ready_interval_s):
            return
        await worker.connect()
        log.info("prefill worker %s: pulling %s for %s", worker.worker_id, worker.layout.jobs_subject, engine_url)
        base = engine_handler(session, engine_url, request_timeout_s)
        recovery: list[asyncio.Task[None]] = []

        async def recover() -> None:
            if await _engine_ready(session, engine_url, stop, ready_interval_s):
                log.info("prefill worker %s: engine %s healthy again; pulling", worker.worker_id, engine_url)
                worker.resume()

        async def handler(job: dict[str, Any]) -> dict[str, Any]:
            try:
                return await base(job)
            except EngineUnavailableError as exc:
                if not worker.paused:  # leave the queue to healthy workers until /health answers 200 again
                    log.warning("prefill worker %s: %s; pausing until the engine is healthy", worker.worker_id, exc)
                    worker.pause()
                    recovery[:] = [asyncio.create_task(_delayed(ready_interval_s, recover))]
                raise

        run = asyncio.create_task(worker.run(handler))
        stopper = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({run, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if not run.done():
                await worker.close()
            await run
        finally:
            # the pull loop's fetch is built on wait_for, which can swallow one cancel (Python 3.11)
            await cancel_and_wait([run, stopper, *recovery])
            await worker.close()


async def _delayed(delay_s: float, then: Callable[[], Awaitable[None]]) -> None:
    """``then()`` after ``delay_s`` seconds (a failing engine gets at least that long before it is probed)."""
    await asyncio.sleep(delay_s)
    await then()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fulcrum.router.prefill_queue --nats URL --engine URL [...]``: a prefill puller process.

    SIGTERM/SIGINT stop it gracefully (jobs in hand finish). Exit 0 when stopped, 1 when NATS is unreachable,
    2 on bad arguments.
    """
    import argparse
    import signal

    ap = argparse.ArgumentParser(prog="python -m fulcrum.router.prefill_queue",
                                 description="Pull prefill jobs from the NATS queue and run them on one engine.")
    ap.add_argument("--nats", required=True, help="NATS URL(s), comma-separated")
    ap.add_argument("--engine", required=True, help="the engine's base URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--stream", default="FULCRUM_PREFILL")
    ap.add_argument("--subject-prefix", default="fulcrum.prefill")
    ap.add_argument("--durable", default="prefill-workers")
    ap.add_argument("--ack-wait-s", type=float, default=30.0)
    ap.add_argument("--max-deliver", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument("--worker-id", default=None)
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        QueueLayout(args.stream, args.subject_prefix, args.durable, args.ack_wait_s, args.max_deliver)
        if args.concurrency < 1:
            raise ValueError("--concurrency must be >= 1")
    except ValueError as exc:
        ap.error(str(exc))

    async def go() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await run_prefill_worker(
            [u.strip() for u in args.nats.split(",") if u.strip()], args.engine, stream=args.stream,
            subject_prefix=args.subject_prefix, durable=args.durable, ack_wait_s=args.ack_wait_s,
            max_deliver=args.max_deliver, concurrency=args.concurrency, request_timeout_s=args.request_timeout_s,
            worker_id=args.worker_id, stop=stop,
        )

    try:
        asyncio.run(go())
    except PrefillQueueError as exc:
        print(f"error: {exc}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
