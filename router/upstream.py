"""The pool of upstream instances: membership, per-instance accounting, health and ejection — over a transport.

For each instance the pool keeps what the router itself dispatched — requests in flight, prompt tokens queued
for prefill, KV tokens of running requests — and turns it into the
:class:`~fulcrum.routing.base.InstanceView` the policies read. How a call reaches an engine is not its
business: every call goes through the injected :class:`Transport` (the seam; httpx's transports are the model):
:class:`fulcrum.router.transport.HttpTransport` (one shared ``aiohttp`` session, keep-alive connections) or
:class:`fulcrum.router.transport.QueuedTransport` (prefill legs through the NATS prefill queue, every other call
over HTTP). The transport translates the wire's failures into :class:`UpstreamFailure`; the pool records them
against the instance (the ejection rules below) and counts its successes.

Failures (:class:`UpstreamFailure`):

- connection refused/reset, a timeout, or a stream broken mid-way eject the instance at once;
- ``eject_after_failures`` consecutive 5xx answers eject it;
- an ejection lasts ``eject_base_s · 2^(n−1)`` seconds (n = ejections in a row, capped at ``eject_max_s``); after
  it a passing ``/health`` probe (every ``health_interval_s``) or a successful request re-admits it.

Whether a failed call is retried elsewhere is the caller's decision (only while nothing was streamed).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import re
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from fulcrum.router.config import RouterConfig
from fulcrum.router.metrics import RouterMetrics
from fulcrum.routing.base import InstanceView
from fulcrum.router.registry import InstanceRecord

__all__ = ["FailureCause", "UpstreamFailure", "Deadline", "UpstreamResponse", "Transport", "InstanceState", "Ticket",
           "UpstreamPool", "upstream_message", "parse_gauge", "BusyBody", "busy_body", "retry_after_of"]

log = logging.getLogger(__name__)

FailureCause = Literal["connect", "timeout", "status", "broken"]


class UpstreamFailure(Exception):
    """An upstream call failed.

    Attributes:
        instance: the instance id.
        cause: "connect" (refused, reset, DNS), "timeout", "status" (a 5xx answer), "broken" (cut mid-answer).
        status: the engine's HTTP status for "status", else 0.
        message: the engine's own error message, or a description of the failure.
        instance_fault: whether the instance itself failed (the pool records it: ejection rules); False for a
            failure of a queued prefill job, which any prefill worker may have run.
        retryable: whether routing the request again may succeed; False for a job every worker refuses as
            malformed (``InvalidPrefillJobError``), which a retry would only resubmit.
    """

    def __init__(self, instance: str, cause: FailureCause, message: str, status: int = 0, *,
                 instance_fault: bool = True, retryable: bool = True) -> None:
        super().__init__(f"{instance}: {cause}: {message}")
        self.instance = instance
        self.cause = cause
        self.message = message
        self.status = status
        self.instance_fault = instance_fault
        self.retryable = retryable


def upstream_message(raw: bytes, status: int) -> str:
    """The error message in an engine's answer (OpenAI ``{"error": {"message"}}``, ``{"message"}``, text)."""
    try:
        data = json.loads(raw)
    except ValueError:
        text = raw.decode(errors="replace").strip()
        return text[:500] or f"upstream answered HTTP {status}"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])[:500]
        for key in ("message", "detail", "error"):
            if isinstance(data.get(key), str):
                return str(data[key])[:500]
    return f"upstream answered HTTP {status}"


class BusyBody(bytes):
    """An engine's 429 body that came with a ``Retry-After`` header: the bytes as sent, and ``retry_after``, the
    header's value (delay-seconds or an HTTP-date, RFC 9110 §10.2.3) that the router passes on when it relays the
    429 to the client. The transports return one only for such a 429 (:func:`busy_body`); every other answer is
    plain ``bytes``, so the 200 path copies no header. Being ``bytes``, it travels unchanged through the code that
    carries an answer's body to the client (``fulcrum.router.relay.Outcome.body``)."""

    retry_after: str


_HTTP_DATE = re.compile(r"[A-Za-z]{3}, \d{2} [A-Za-z]{3} \d{4} \d{2}:\d{2}:\d{2} GMT")


def busy_body(raw: bytes, retry_after: str | None) -> bytes:
    """``raw`` (an engine's 429 body) as a :class:`BusyBody` carrying ``retry_after`` (the engine's ``Retry-After``
    header, None when absent); ``raw`` unchanged when the header is absent or not a valid value (delay-seconds:
    digits; or an IMF-fixdate HTTP-date such as ``Sun, 06 Nov 1994 08:49:37 GMT``), which is then not passed on."""
    if retry_after is None:
        return raw
    value = retry_after.strip()
    if not (value.isascii() and value.isdigit() and len(value) <= 10) and _HTTP_DATE.fullmatch(value) is None:
        return raw
    out = BusyBody(raw)
    out.retry_after = value
    return out


def retry_after_of(body: bytes | None) -> str | None:
    """The engine's ``Retry-After`` carried by an answer's body (:class:`BusyBody`), or None."""
    return body.retry_after if isinstance(body, BusyBody) else None


@dataclass(frozen=True, slots=True)
class Deadline:
    """Time limits of one upstream call, seconds.

    Attributes:
        connect_s: to open a connection.
        total_s: for the whole call, answer included (None: no overall limit, as for streams).
        idle_s: between two reads of the answer (None: none; streams use the larger of the router's
            ``timeouts.first_token_s`` and ``idle_s`` as a backstop: the relay loop enforces each itself).
    """

    connect_s: float
    total_s: float | None
    idle_s: float | None = None


class _Chunks(Protocol):
    def iter_any(self) -> AsyncIterator[bytes]: ...


class UpstreamResponse(Protocol):
    """An engine's answer as a transport yields it, its body not yet read (``aiohttp.ClientResponse`` is one)."""

    @property
    def status(self) -> int:
        """The HTTP status."""
        ...

    @property
    def content(self) -> _Chunks:
        """The body as it arrives: ``content.iter_any()`` yields its bytes in the pieces read."""
        ...

    async def read(self) -> bytes:
        """The whole body."""
        ...

    def close(self) -> None:
        """Close the connection at once (vLLM then aborts the request and frees its KV)."""
        ...


class Transport(Protocol):
    """How the pool's calls reach an engine: the seam between the pool (membership, accounting, health) and the
    wire. Implementations: :class:`fulcrum.router.transport.HttpTransport` (direct HTTP),
    :class:`fulcrum.router.transport.QueuedTransport` (prefill legs through the NATS prefill queue); tests inject
    fakes.

    Every method translates its wire's failures into :class:`UpstreamFailure` (``instance`` = the ``iid`` given;
    the pool records those with ``instance_fault``); a 5xx answer is a failure with cause "status" and the
    engine's message (:func:`upstream_message`). ``base`` is the instance's URL, ``path`` the endpoint's
    (``/v1/completions``).
    """

    def open(self, iid: str, base: str, path: str, body: dict[str, Any], deadline: Deadline
             ) -> AbstractAsyncContextManager[UpstreamResponse]:
        """POST ``body`` as JSON; yields the answer (status < 500) with its body unread. Failures while the caller
        reads inside the block (timeouts, resets) are translated too; leaving the block early closes the
        connection (vLLM then aborts the request). The ``read()`` of a 429 that came with a ``Retry-After`` header
        returns a :class:`BusyBody` carrying it.

        Raises:
            UpstreamFailure: connect error, timeout, 5xx answer, an answer cut mid-way.
        """
        ...

    async def post(self, iid: str, base: str, path: str, body: dict[str, Any] | bytes, deadline: Deadline, *,
                   queueable: bool) -> tuple[int, bytes, Any | None]:
        """POST ``body`` as JSON (``bytes``: already encoded, sent as is; never a prefill leg) and read the whole
        answer: (status, raw body, the parsed body or None when this transport did not parse it); the raw body of a
        429 that came with a ``Retry-After`` header is a :class:`BusyBody` carrying it. ``queueable``: a
        prefill leg may go through the prefill queue (only :meth:`UpstreamPool.post_json` allows it; relayed
        answers and prefix pulls go to the instance).

        Raises:
            UpstreamFailure: as :meth:`open`.
            fulcrum.router.errors.NoHealthyInstance: a queued prefill leg found no prefill capacity.
        """
        ...

    async def get(self, iid: str, base: str, path: str, deadline: Deadline) -> tuple[int, bytes]:
        """GET ``base + path``: (status, raw body), 5xx included (health probes and scrapes read the status).

        Raises:
            UpstreamFailure: connect error, timeout, broken answer.
        """
        ...

    async def close(self) -> None:
        """Release connections (and a prefill queue) for good."""
        ...


@dataclass(slots=True)
class InstanceState:
    """What the router knows about one instance (mutable; owned by the pool)."""

    record: InstanceRecord
    healthy: bool = True
    draining: bool = False
    ejected_until: float = 0.0
    ejections_in_a_row: int = 0
    consecutive_failures: int = 0
    inflight: int = 0
    queued_prefill_tokens: int = 0
    running_tokens: int = 0
    compute_utilisation: float = math.nan
    memory_utilisation: float = math.nan
    removed: bool = False

    def available(self, now: float) -> bool:
        """Healthy, not ejected, not draining, still registered."""
        return self.healthy and not self.draining and not self.removed and now >= self.ejected_until

    def view(self, now: float, partial_prefix: bool = False) -> InstanceView:
        """The policy's view; ``partial_prefix``: the router config says every engine loads partial prefixes
        (``kv_connector.partial_prefix``), else the instance's own ``partial_prefix`` label says so."""
        r = self.record
        return InstanceView(
            id=r.id, role=r.role, tp=r.tp,
            healthy=self.healthy and not self.removed and now >= self.ejected_until,
            draining=self.draining, inflight=self.inflight,
            queued_prefill_tokens=self.queued_prefill_tokens, running_tokens=self.running_tokens,
            kv_capacity_tokens=r.kv_capacity_tokens, max_num_batched_tokens=r.max_num_batched_tokens,
            max_num_seqs=r.max_concurrency, compute_utilisation=self.compute_utilisation,
            memory_utilisation=self.memory_utilisation,
            supports_partial_prefix=partial_prefix or r.labels.get("partial_prefix", "") == "true",
        )


@dataclass(slots=True)
class Ticket:
    """The accounting of one upstream call on one instance; ``release`` is idempotent.

    Attributes:
        state: the instance.
        queued: prompt tokens this call prefills on the instance (0 when its KV comes from elsewhere), tokens.
        context: KV tokens it holds once running (prompt + generated so far), tokens.
    """

    state: InstanceState
    queued: int
    context: int
    started: bool = False
    released: bool = False
    _counted: int = field(default=0)

    def first_token(self) -> None:
        """The prefill is done: queued prompt tokens become running KV."""
        if self.started or self.released:
            return
        self.started = True
        self.state.queued_prefill_tokens -= self.queued
        self.state.running_tokens += self.context
        self._counted = self.context

    def add_tokens(self, n: int) -> None:
        """``n`` more tokens generated (their KV is now held)."""
        if self.released:
            return
        if not self.started:
            self.first_token()
        self.state.running_tokens += n
        self._counted += n

    def release(self) -> None:
        """The call ended (finished, failed or cancelled)."""
        if self.released:
            return
        self.released = True
        if not self.started:
            self.state.queued_prefill_tokens -= self.queued
        self.state.running_tokens -= self._counted
        self.state.inflight -= 1


class UpstreamPool:
    """All instances, their accounting and health; calls travel through the injected transport.

    Args:
        transport: how calls reach the engines (:class:`Transport`).
        config: timeouts, ejection and health settings (``update_config`` swaps them live).
        metrics: where ejections and failures are counted.
        clock: monotonic seconds (injected: tests move it by hand).
    """

    def __init__(self, transport: Transport, config: RouterConfig, metrics: RouterMetrics,
                 clock: Callable[[], float]) -> None:
        self.transport = transport
        self.metrics = metrics
        self.clock = clock
        self._states: dict[str, InstanceState] = {}
        self._rr = itertools.count()
        self._prefills: dict[str, list[tuple[float, Ticket]]] = {}
        self.learned_max_model_len: int | None = None
        self.config = config
        self._set_deadlines(config)
        self._errors = {c: metrics.child(metrics.upstream_errors, c)
                        for c in ("connect", "timeout", "status", "broken")}

    # ---------------------------------------------------------------- membership and views
    def set_records(self, records: Iterable[InstanceRecord]) -> list[str]:
        """Replace the instance list; kept instances keep their state, removed ones leave (calls in flight on
        them finish normally). Returns the ids of the instances that left (the router drops what its policy keeps
        about them, ``fulcrum.router.app.forget_instance``)."""
        new = {r.id: r for r in records}
        left = []
        for iid, st in list(self._states.items()):
            if iid not in new:
                st.removed = True
                del self._states[iid]
                left.append(iid)
        for iid, rec in new.items():
            if iid in self._states:
                self._states[iid].record = rec
            else:
                self._states[iid] = InstanceState(record=rec)
        return left

    def update_config(self, config: RouterConfig) -> None:
        """Swap timeouts and ejection settings."""
        self.config = config
        self._set_deadlines(config)

    def _set_deadlines(self, config: RouterConfig) -> None:
        t = config.timeouts
        # a stream's reads: vLLM sends the headers at once, so the first event can take first_token_s after them;
        # the relay loop enforces first_token_s and idle_s itself, the socket limit is only a backstop
        self._stream_deadline = Deadline(t.connect_s, None, max(t.first_token_s, t.idle_s))
        self._whole_deadline = Deadline(t.connect_s, t.request_s)
        self._health_deadline = Deadline(t.connect_s, t.health_s)

    def ids(self) -> list[str]:
        """Registered instance ids."""
        return list(self._states)

    def __contains__(self, iid: object) -> bool:
        """Whether ``iid`` is registered."""
        return iid in self._states

    def state(self, iid: str) -> InstanceState:
        """The state of one instance. Raises KeyError when it is not registered."""
        return self._states[iid]

    def view_of(self, iid: str) -> InstanceView | None:
        """One instance's view as :meth:`views` shows it, or None when it is not registered."""
        st = self._states.get(iid)
        return st.view(self.clock(), self.config.kv_connector.partial_prefix) if st is not None else None

    def views(self, exclude: Sequence[str] = ()) -> list[InstanceView]:
        """Every instance's view; ids in ``exclude`` are shown unhealthy (retries avoid them)."""
        now = self.clock()
        partial = self.config.kv_connector.partial_prefix
        out = []
        for st in self._states.values():
            v = st.view(now, partial)
            if exclude and st.record.id in exclude and v.healthy:
                v = InstanceView(**{**{f: getattr(v, f) for f in v.__dataclass_fields__}, "healthy": False})
            out.append(v)
        return out

    def available_ids(self, exclude: Sequence[str] = ()) -> list[str]:
        """Ids of available instances, least loaded first (in flight, then queued prefill tokens)."""
        now = self.clock()
        avail = [s for s in self._states.values() if s.available(now) and s.record.id not in exclude]
        avail.sort(key=lambda s: (s.inflight, s.queued_prefill_tokens, s.running_tokens))
        return [s.record.id for s in avail]

    def any_available(self, exclude: Sequence[str] = ()) -> str | None:
        """One available instance, rotating (for /tokenize and similar side calls)."""
        now = self.clock()
        ids = [i for i, s in self._states.items() if s.available(now) and i not in exclude]
        if not ids:
            return None
        return ids[next(self._rr) % len(ids)]

    # ---------------------------------------------------------------- load accounting
    def acquire(self, iid: str, queued: int, context: int) -> Ticket:
        """Account one call dispatched to ``iid`` (``queued`` prompt tokens to prefill, ``context`` KV tokens).

        Calls with prompt tokens to prefill are remembered with their start time for
        :meth:`oldest_prefill_wait` (role reassignment's prefill pressure).

        Raises:
            UpstreamFailure: ``iid`` is no longer registered (the registry dropped it since it was routed to);
                not the instance's fault, so nothing is recorded against it and the caller routes again.
        """
        st = self._states.get(iid)
        if st is None:
            raise UpstreamFailure(iid, "connect", f"{iid} is no longer registered", instance_fault=False)
        st.inflight += 1
        st.queued_prefill_tokens += queued
        ticket = Ticket(state=st, queued=queued, context=context)
        if queued > 0:
            waiting = self._prefills.get(iid)
            if waiting is None:
                waiting = self._prefills[iid] = []
            elif len(waiting) >= 64:
                waiting[:] = [(t, k) for t, k in waiting if not (k.started or k.released)]
            waiting.append((self.clock(), ticket))
        return ticket

    def oldest_prefill_wait(self) -> dict[str, float]:
        """Instance id → seconds the oldest prefill dispatched to it and not yet done has waited (absent: none)."""
        now = self.clock()
        out: dict[str, float] = {}
        for iid, waiting in list(self._prefills.items()):
            waiting[:] = [(t, k) for t, k in waiting if not (k.started or k.released)]
            if waiting:
                out[iid] = now - waiting[0][0]
            else:
                del self._prefills[iid]
        return out

    # ---------------------------------------------------------------- failures
    def record_failure(self, iid: str, cause: FailureCause) -> None:
        """Count a failure; eject per the rules in the module docstring."""
        self._errors[cause].inc()
        st = self._states.get(iid)
        if st is None:
            return
        st.consecutive_failures += 1
        if cause != "status" or st.consecutive_failures >= self.config.eject_after_failures:
            self.eject(iid, cause)

    def record_success(self, iid: str) -> None:
        """A call succeeded: reset the failure counters."""
        st = self._states.get(iid)
        if st is not None:
            st.consecutive_failures = 0
            st.ejections_in_a_row = 0

    def eject(self, iid: str, cause: str) -> None:
        """Take ``iid`` out of rotation for the backoff period."""
        st = self._states.get(iid)
        if st is None:
            return
        now = self.clock()
        if now < st.ejected_until:
            return
        st.ejections_in_a_row += 1
        length = min(self.config.eject_base_s * 2 ** (st.ejections_in_a_row - 1), self.config.eject_max_s)
        st.ejected_until = now + length
        st.consecutive_failures = 0
        self.metrics.child(self.metrics.ejections, iid, cause).inc()
        log.warning("instance %s ejected for %.1f s (%s)", iid, length, cause)

    def _failed(self, err: UpstreamFailure) -> None:
        if err.instance_fault:
            self.record_failure(err.instance, err.cause)

    # ---------------------------------------------------------------- calls
    def _deadline(self, stream: bool, total_s: float | None) -> Deadline:
        if stream:
            return self._stream_deadline
        if total_s is None:
            return self._whole_deadline
        return Deadline(self.config.timeouts.connect_s, total_s)

    @asynccontextmanager
    async def open(self, iid: str, path: str, body: dict[str, Any], *, stream: bool,
                   total_s: float | None = None) -> AsyncIterator[UpstreamResponse]:
        """POST ``body`` to ``iid`` over the transport; yields the response (status < 500) with its body unread.

        Failures raised inside the ``async with`` block while reading (timeouts, resets) are translated too.
        Leaving the block early closes the connection, which makes vLLM abort the request. Never through the
        prefill queue.

        Raises:
            UpstreamFailure: connect error, timeout, 5xx answer, or an answer cut mid-way; recorded against
                the instance (ejection rules) before raising.
                Also when ``iid`` is no longer registered (not recorded: not the instance's fault).
        """
        known = self._states.get(iid)
        if known is None:
            raise UpstreamFailure(iid, "connect", f"{iid} is no longer registered", instance_fault=False)
        base = known.record.url
        try:
            async with self.transport.open(iid, base, path, body, self._deadline(stream, total_s)) as resp:
                yield resp
        except UpstreamFailure as err:
            self._failed(err)
            raise
        self.record_success(iid)

    async def fetch(self, iid: str, path: str, body: dict[str, Any] | bytes, total_s: float | None = None, *,
                    queueable: bool = False) -> tuple[int, bytes, Any | None]:
        """POST ``body`` (``bytes``: JSON already encoded) and read the whole answer: (status, raw body, parsed
        body or None when the transport did not parse it). 4xx are returned (a 429's ``Retry-After`` rides on its
        raw body, :class:`BusyBody`). ``queueable``: a prefill leg may go through the prefill queue.

        Raises:
            UpstreamFailure: as :meth:`open`.
            NoHealthyInstance: a queued prefill leg found no prefill capacity (the message says why).
        """
        known = self._states.get(iid)
        if known is None:
            raise UpstreamFailure(iid, "connect", f"{iid} is no longer registered", instance_fault=False)
        base = known.record.url
        try:
            got = await self.transport.post(iid, base, path, body, self._deadline(False, total_s), queueable=queueable)
        except UpstreamFailure as err:
            self._failed(err)
            raise
        self.record_success(iid)
        return got

    async def post_json(self, iid: str, path: str, body: dict[str, Any], total_s: float | None = None, *,
                        queueable: bool = True) -> tuple[int, bytes, Any]:
        """POST and read the whole answer: (status, raw body, parsed JSON or None). 4xx are returned. A prefill
        leg goes through the prefill queue where the transport has one, unless ``queueable`` is False.

        Raises:
            UpstreamFailure: as :meth:`open`, and "broken" when a 200 answer is not JSON.
            NoHealthyInstance: as :meth:`fetch`.
        """
        status, raw, data = await self.fetch(iid, path, body, total_s, queueable=queueable)
        if status != 200:
            return status, raw, None
        if data is not None:
            return status, raw, data
        try:
            return status, raw, json.loads(raw)
        except ValueError as err:
            self.record_failure(iid, "broken")
            raise UpstreamFailure(iid, "broken", f"{iid} answered 200 with a body that is not JSON") from err

    # ---------------------------------------------------------------- health
    async def probe(self, iid: str) -> bool:
        """GET ``/health`` (and ``/metrics`` for utilisation); updates the instance's health. Never raises."""
        st = self._states.get(iid)
        if st is None:
            return False
        deadline = self._health_deadline
        try:
            status, _ = await self.transport.get(iid, st.record.url, "/health", deadline)
            ok = status == 200
        except UpstreamFailure:
            ok = False
        was = st.healthy
        st.healthy = ok
        if ok and self.clock() >= st.ejected_until:
            st.ejections_in_a_row = 0 if was else st.ejections_in_a_row
        if not ok and was:
            self.eject(iid, "health")
        if ok:
            await self._scrape(st, deadline)
        return ok

    async def _scrape(self, st: InstanceState, deadline: Deadline) -> None:
        try:
            status, raw = await self.transport.get(st.record.id, st.record.url, "/metrics", deadline)
        except UpstreamFailure:
            return
        if status != 200:
            return
        text = raw.decode(errors="replace")
        running = parse_gauge(text, ("vllm:num_requests_running",))
        usage = parse_gauge(text, ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"))
        if running is not None:
            st.compute_utilisation = min(1.0, running / max(1, st.record.max_concurrency))
        if usage is not None:
            st.memory_utilisation = usage

    async def served_models(self) -> tuple[list[str], int | None]:
        """The model names an available instance's ``GET /v1/models`` answers, sorted, and the smallest
        ``max_model_len`` it gives (tokens; None when it gives none): what the router lists on ``/v1/models`` when
        neither its config nor the instances' records name the model. Asks the instances in turn, with the health
        probe's deadline, until one answers; ``([], None)`` when none does. Never raises."""
        for iid in self.available_ids():
            st = self._states.get(iid)
            if st is None:  # the registry dropped it while an earlier instance was asked
                continue
            try:
                status, raw = await self.transport.get(iid, st.record.url, "/v1/models", self._health_deadline)
                entries = json.loads(raw)["data"] if status == 200 else []
            except (UpstreamFailure, ValueError, KeyError, TypeError):
                continue
            models = [m for m in entries if isinstance(m, dict)] if isinstance(entries, list) else []
            names = sorted({str(m["id"]) for m in models if m.get("id")})
            if names:
                lens = [m["max_model_len"] for m in models
                        if isinstance(m.get("max_model_len"), int) and m["max_model_len"] > 0]
                return names, (min(lens) if lens else None)
        return [], None

    async def probe_all(self) -> None:
        """Probe every instance concurrently."""
        await asyncio.gather(*(self.probe(i) for i in list(self._states)))

    async def health_loop(self, sleep: Callable[[float], Any] = asyncio.sleep) -> None:
        """Probe every ``health_interval_s`` until cancelled."""
        while True:
            await self.probe_all()
            await sleep(self.config.health_interval_s)


def parse_gauge(text: str, names: Sequence[str]) -> float | None:
    """Sum of the samples of the first metric in ``names`` found in a Prometheus text exposition."""
    for name in names:
        total, found = 0.0, False
        for line in text.splitlines():
            if line.startswith(name) and (len(line) > len(name) and line[len(name)] in "{ "):
                try:
                    total += float(line.rsplit(" ", 1)[1])
                    found = True
                except (ValueError, IndexError):
                    continue
        if found:
            return total
    return None
