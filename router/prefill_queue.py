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

Errors::

    FulcrumError
    └── PrefillQueueError          NATS unreachable, stream misconfigured, queue closed
        ├── PrefillTimeoutError    no reply within the timeout (also a TimeoutError); the job was withdrawn
        └── PrefillJobError        the worker's handler failed on every delivery (its message is kept)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, RetentionPolicy, StorageType, StreamConfig

from fulcrum.errors import FulcrumError

__all__ = [
    "Handler",
    "NatsPrefillQueue",
    "PrefillJobError",
    "PrefillQueueError",
    "PrefillTimeoutError",
    "PrefillWorker",
    "QueueLayout",
]

log = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
"""A worker's job handler: the job (a JSON object) in, the reply (a JSON object) out; raising means failure."""

JOB_ID_HEADER = "Fulcrum-Job-Id"
REPLY_TO_HEADER = "Fulcrum-Reply-To"
MSG_ID_HEADER = "Nats-Msg-Id"


class PrefillQueueError(FulcrumError):
    """The prefill queue could not be used: NATS unreachable, stream misconfigured, queue closed."""


class PrefillTimeoutError(PrefillQueueError, TimeoutError):
    """No worker replied within the timeout; the job was withdrawn from the stream (best effort)."""


class PrefillJobError(PrefillQueueError):
    """A worker's handler failed on the last allowed delivery; the message is the worker's error text."""


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


async def _connect(servers: str | list[str], name: str, timeout_s: float) -> NatsClient:
    """Connect; once connected, reconnect for ever (logged). The first connection is bounded by ``timeout_s``.

    Raises:
        PrefillQueueError: no server answered within ``timeout_s``.
    """

    async def on_error(exc: Exception) -> None:
        log.warning("nats %s: %s: %s", name, type(exc).__name__, exc)

    async def on_disconnected() -> None:
        log.warning("nats %s: disconnected; reconnecting", name)

    async def on_reconnected() -> None:
        log.info("nats %s: reconnected", name)

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


class NatsPrefillQueue:
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
            nc = await _connect(self._servers, self._name, self._connect_timeout_s)
            try:
                js = nc.jetstream()
                await _ensure_stream_and_consumer(js, self.layout)
                inbox = nc.new_inbox()
                await nc.subscribe(f"{inbox}.*", cb=self._on_reply)
            except BaseException:
                await nc.close()
                raise
            self._nc, self._js, self._inbox = nc, js, inbox

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
            future.set_exception(PrefillJobError(f"job {job_id}: {reply.get('error', 'worker failed')}"))

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
                so that no worker prefills for a request nobody waits for any more.
            PrefillJobError: the handler failed on its last allowed delivery.
            PrefillQueueError: NATS unreachable, stream missing, or the queue was closed while waiting.
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
        try:
            try:
                ack = await self._js.publish(
                    self.layout.jobs_subject, payload, timeout=max(0.1, deadline - time.monotonic()),
                    stream=self.layout.stream, headers=headers,
                )
            except nats.errors.TimeoutError as exc:
                raise PrefillTimeoutError(f"job {job_id}: JetStream did not acknowledge the publish in time") from exc
            except nats.errors.Error as exc:
                raise PrefillQueueError(f"job {job_id}: publish failed: {exc}") from exc
            try:
                return await asyncio.wait_for(future, max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                await self._withdraw(ack.seq)
                raise PrefillTimeoutError(f"job {job_id}: no prefill worker replied within {timeout_s} s") from None
            except asyncio.CancelledError:
                if future.cancelled() and self._closed:
                    raise PrefillQueueError(f"job {job_id}: prefill queue closed while waiting") from None
                await self._withdraw(ack.seq)
                raise
        finally:
            self._pending.pop(job_id, None)

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
        nc, self._nc, self._js = self._nc, None, None
        if nc is not None:
            with contextlib.suppress(Exception):
                await nc.close()


class PrefillWorker:
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
    the router gets an error reply and the job is terminated. A job that is not JSON is terminated (logged).
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
        self._pull_loop_done: asyncio.Event | None = None  # set when run()'s pull loop has ended
        self._jobs: set[asyncio.Task[None]] = set()

    async def connect(self) -> None:
        """Connect, create/check the stream and consumer, bind a pull subscription. Idempotent.

        Raises:
            PrefillQueueError: NATS unreachable or the stream cannot be set up.
        """
        if self._nc is not None:
            return
        nc = await _connect(self._servers, f"fulcrum-prefill-worker-{self.worker_id}", self._connect_timeout_s)
        try:
            js = nc.jetstream()
            await _ensure_stream_and_consumer(js, self.layout)
            self._sub = await js.pull_subscribe_bind(durable=self.layout.durable, stream=self.layout.stream)
        except BaseException:
            await nc.close()
            raise
        self._nc = nc

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
                await slots.acquire()
                try:
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
        body = {**body, "worker": self.worker_id, "job_id": (msg.headers or {}).get(JOB_ID_HEADER, "")}
        try:
            await self._nc.publish(reply_to, json.dumps(body).encode())
        except Exception as exc:
            log.warning("prefill worker %s: reply to %s failed: %s", self.worker_id, reply_to, exc)

    async def _handle(self, msg: Msg, handler: Handler) -> None:
        job_id = (msg.headers or {}).get(JOB_ID_HEADER, "?")
        try:
            job = json.loads(msg.data)
            if not isinstance(job, dict):
                raise ValueError("job is not a JSON object")
        except ValueError as exc:
            log.error("prefill worker %s: job %s is unreadable (%s); terminated", self.worker_id, job_id, exc)
            await self._reply(msg, {"ok": False, "error": f"unreadable job: {exc}"})
            with contextlib.suppress(Exception):
                await msg.term()
            return
        heartbeat = asyncio.create_task(self._heartbeat(msg))
        try:
            result = await handler(job)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await msg.nak()
            raise
        except Exception as exc:
            delivered = msg.metadata.num_delivered or 1
            if delivered >= self.layout.max_deliver:
                log.error("prefill worker %s: job %s failed on delivery %d/%d (%s); giving up",
                          self.worker_id, job_id, delivered, self.layout.max_deliver, exc)
                await self._reply(msg, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
                with contextlib.suppress(Exception):
                    await msg.term()
            else:
                log.warning("prefill worker %s: job %s failed on delivery %d/%d (%s); redelivering",
                            self.worker_id, job_id, delivered, self.layout.max_deliver, exc)
                with contextlib.suppress(Exception):
                    await msg.nak()
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
        nc, self._nc, self._sub = self._nc, None, None
        if nc is not None:
            with contextlib.suppress(Exception):
                await nc.close()
