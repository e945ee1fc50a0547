"""Instance models: a prefill (P) instance and a decode-capable engine (D or unified), timed by a profile.

Prefill instance (:class:`PrefillInstance`)
    Runs one prefill batch at a time from its own waiting queue (the prompts the router's policy sent it, in
    the groups the router's DOPD Alg. 1 gate released): like an engine, it takes the waiting prompts first come
    first served up to its token budget (at least one). A batch of prompts of lengths ``isls`` takes
    ``StepCost.prefill_batch_s(isls)`` seconds (:mod:`fulcrum.ratio.step_cost`, the one step-cost model); the
    first token of every member is produced at its end (a Libra split inside the prompt prefills only the head,
    ``prefill_stop`` tokens, and produces no token).

Engine instance (:class:`EngineInstance`, roles ``"decode"`` and ``"unified"``)
    A vLLM-style engine with continuous batching and chunked prefill:

    - **Batch.** At most ``max_batch`` requests run (vLLM ``max_num_seqs``; default the profile's CUDA-graph
      cap cc_g, DOPD eq. 14). Every running request that has its KV cache decodes one token per step.
    - **Step time** (:meth:`fulcrum.ratio.step_cost.StepCost.step_s`, its default ``per_part`` model).
      ``decode_step_s(n, mean context)`` — the profile's ``tpot`` — for the ``n`` decoding requests, plus, when some
      requests are being prefilled on the instance (unified requests, DOPD's ultra-short "local" requests,
      recomputation after preemption), the prefill time of this step's chunk. The chunk holds at most
      ``prefill_chunk_tokens`` tokens taken FCFS (vLLM chunked prefill, Sarathi-style mixing of prefill
      and decode; as with vLLM's ``max_num_batched_tokens``, the budget is shared with the one token of each
      decoding request, keeping at least one prefill token per step). Prompt pieces that start at token 0
      cost ``prefill_batch_s`` of their lengths (batched prefill); a continuation of a prompt from
      token ``o`` to ``o + c`` costs the marginal ``ttft(o + c) − ttft(o)``, so the chunks of one prompt
      add up to exactly ``ttft(isl)`` and the quadratic attention term lands on the later chunks.
    - **First token.** A request prefilled here gets its first token at the end of the step that completes
      its prefill; it decodes from the next step. A request whose KV came from a P instance already has its
      first token (produced by the prefill) and decodes from the step boundary after it was admitted. A
      request that arrives with a partial prompt prefix (``kv_prefix`` tokens, a Libra split inside the
      prompt) prefills the rest as a continuation of that prefix.
    - **Handoff (the router's micro-requests).** A request with a ``planned`` next instance leaves once its
      part here is done — after ``handoff_at`` generated tokens (a disaggregated or Libra split decision's
      first instance A), or after prefilling ``prefill_stop < isl`` prompt tokens — and the host's
      ``on_handoff`` moves its KV on.
    - **KV memory (grow, then preempt by recompute, like vLLM).** A request's KV footprint is its context,
      ``isl + generated`` tokens, and grows by one token per step; a request being prefilled reserves its
      whole prompt. A waiting request is admitted only when its current context fits next to the contexts
      of the running ones (an empty instance admits its head regardless, so a request larger than the
      cache still runs rather than hanging). When the contexts of the running requests outgrow
      ``profile.kv_capacity_tokens(tp)``, the most recently admitted request is preempted (vLLM v1
      ``Scheduler.schedule``, FCFS policy: ``preempted_req = self.running.pop()``), its KV is dropped and
      it goes back to the front of the waiting queue; when readmitted it recomputes ``isl + generated``
      tokens as a prefill. This is the waiting decode queue the planner observes.
    - **Spans (speed).** Between two changes of the running set, the batch is constant, so the instance
      does not schedule one event per step: it keeps a step counter, the time and step index at the start
      of the current span, the step time of the span, and a heap of per-request finish step indices. The
      span ends at the earliest of: the next finish, the step at which Σcontext overflows the KV cache, or
      ``max_span_steps`` steps; a new request that can be admitted cuts it short at the end of the step in
      progress. Σcontext is tracked incrementally as ``Σ(ctx_i − join_step_i) + n·step``. The step time is
      ``decode_step_s(n, c̄)`` at the mean context over the planned span, ``c̄ = c0 + (L − 1)/2`` for a span of L
      steps starting at mean context c0: exact where the profile is linear in context (between grid
      lines), so a span matches one event per step (``max_span_steps=1``) to float precision there. A
      span cut short by a joining request keeps the step time it was planned with (a small overestimate).
      A step with prefill work is always a span of one step. An idle engine that is offered work starts at
      the same instant, after every other event of that instant (so simultaneous arrivals share the first
      step). Decoding thus costs O(log n) per request joining or leaving, not O(batch) per step.

Tables of a TP the profile lacks: the pool's own role must be measured at its TP (a P pool needs a prefill
table, a D/unified pool a decode table — :class:`~fulcrum.errors.ProfileError` otherwise, raised by the
cluster when it builds or applies a target; here: ``prefill_tp_rule``/``decode_tp_rule="exact"``); the
auxiliary prefill on a decode-capable instance (local and recomputed prompts, the prefill side of unified
instances) uses the prefill table of the nearest measured TP (ties: the smaller, slower one), unscaled, i.e.
conservatively (``prefill_tp_rule="nearest"``). DOPD's profile, for instance, has prefill only at TP=1 and decode
only at TP=2.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from enum import IntEnum
from typing import Protocol

from fulcrum.ratio.profile import PerformanceProfile
from fulcrum.ratio.step_cost import StepCost
from fulcrum.simulator.kernel import Kernel, Priority

__all__ = [
    "InstanceState",
    "Phase",
    "SimRequest",
    "InstanceHost",
    "Instance",
    "PrefillInstance",
    "EngineInstance",
]


class InstanceState(IntEnum):
    """Life cycle of an instance (a pod)."""

    STARTING = 0  #: provisioned (GPUs counted), not serving yet
    READY = 1  #: serving and accepting new work
    DRAINING = 2  #: serving its in-flight requests only; removed when empty or at the drain timeout
    REMOVED = 3  #: gone (GPUs released)


class Phase(IntEnum):
    """Where a request is inside an engine instance."""

    OUTSIDE = 0  #: not on an engine (queued at the router, prefilling on a P instance, in transfer)
    WAITING = 1  #: in an engine's waiting queue
    PREFILLING = 2  #: admitted, prompt (or recomputation) being prefilled in chunks
    DECODING = 3  #: admitted, decoding one token per step


class SimRequest:
    """Mutable state of one request during a run (internal; :class:`RequestRecord` is the result).

    Attributes:
        idx: position in arrival order.
        arrival: arrival time, s. isl / osl: prompt and output tokens.
        path: "disaggregated" | "split" | "local" | "unified" (the routing decision's kind and where it ran).
        first_token / finish: times, s (``nan`` until they happen).
        generated: output tokens produced, as of the last time the request was settled.
        kv_ready: its KV cache is on the engine it was offered to (True after a KV transfer); False means it
            must be prefilled there (``isl + generated`` tokens).
        phase: :class:`Phase`. pf_total / pf_done: tokens of the prefill in progress, and done.
        join_step / gen_join / base: decode bookkeeping (step index and tokens at joining; ``ctx − join_step``).
        token: bumps whenever the request leaves a decode batch (stale finish-heap entries are skipped).
        enq: when it entered the router's wait or a prefill instance's gate, s. dest: engine a KV transfer heads to.
        preemptions: times it was preempted. migrating: asked to leave its engine at the next step boundary
            (decode rescheduling).
        prefill_start: when its first prefill began (on a P instance, or admitted to an engine), s; ``nan`` until.
        prefill_iid / decode_iid: the instance that first prefilled it / the engine it finished on (-1 until).
        planned: iid of the instance that takes the request over after its handoff (-1: none; the routing
            decision's second instance B). handoff_at: generated tokens after which it leaves for ``planned``
            (k + 1 for a decision with ``handoff_after = k``). prefill_stop: prompt tokens the first instance
            prefills (``isl``, or the split token s < isl of a split inside the prompt). kv_prefix: prompt tokens
            whose KV came with it (the head of a split inside the prompt), prefilled no more where it lands.
            routed: a routing decision was made for it (a re-dispatch tells the policy the old one finished).
    """

    __slots__ = (
        "idx",
        "arrival",
        "isl",
        "osl",
        "path",
        "first_token",
        "finish",
        "generated",
        "kv_ready",
        "phase",
        "pf_total",
        "pf_done",
        "join_step",
        "gen_join",
        "base",
        "token",
        "enq",
        "dest",
        "preemptions",
        "migrating",
        "prefill_start",
        "prefill_iid",
        "decode_iid",
        "planned",
        "handoff_at",
        "prefill_stop",
        "kv_prefix",
        "routed",
    )

    def __init__(self, idx: int, arrival: float, isl: int, osl: int) -> None:
        self.idx = idx
        self.arrival = arrival
        self.isl = isl
        self.osl = osl
        self.path = ""
        self.first_token = math.nan
        self.finish = math.nan
        self.generated = 0
        self.kv_ready = False
        self.phase = Phase.OUTSIDE
        self.pf_total = 0
        self.pf_done = 0
        self.join_step = 0
        self.gen_join = 0
        self.base = 0
        self.token = 0
        self.enq = 0.0
        self.dest: EngineInstance | None = None
        self.preemptions = 0
        self.migrating = False
        self.prefill_start = math.nan
        self.prefill_iid = -1
        self.decode_iid = -1
        self.planned = -1
        self.handoff_at = 0
        self.prefill_stop = isl
        self.kv_prefix = 0
        self.routed = False

    @property
    def partial(self) -> bool:
        """Its first instance prefills only the head of the prompt and hands the KV on without a token."""
        return self.planned >= 0 and self.generated == 0 and self.prefill_stop < self.isl


class InstanceHost(Protocol):
    """What an instance reports to the cluster (implemented by :class:`~fulcrum.simulator.cluster.Simulation`)."""

    def on_first_token(self, r: SimRequest, t: float) -> None:
        """``r`` produced its first token at ``t`` seconds (called once per request)."""

    def on_finish(self, r: SimRequest, t: float) -> None:
        """``r`` produced its last token at ``t`` seconds."""

    def on_prefill_done(self, inst: PrefillInstance, batch: list[SimRequest]) -> None:
        """``inst`` finished prefilling ``batch`` at the kernel's ``now`` (first tokens not yet reported)."""

    def on_instance_drained(self, inst: Instance) -> None:
        """A draining ``inst`` has no work left."""

    def on_migrate_out(self, r: SimRequest, inst: EngineInstance, t: float) -> None:
        """``r`` left ``inst`` at the step boundary ``t`` for a migration; its KV (``isl + generated``) moves."""

    def on_handoff(self, r: SimRequest, inst: EngineInstance, t: float) -> None:
        """``r`` finished its part on ``inst`` at ``t`` (``handoff_at`` tokens, or the ``prefill_stop`` head of its
        prompt) and leaves for ``r.planned``; its KV moves."""


class Instance:
    """Common life-cycle fields of an instance.

    Attributes:
        iid: instance id, unique in the run, increasing in creation order.
        role: "prefill" | "decode" | "unified".
        tp: tensor-parallel size (GPUs of the instance).
        state: :class:`InstanceState`. provisioned_at / ready_at: seconds.
        drain_handle / ready_handle: kernel handles of the pending drain timeout / readiness, if any.
    """

    role: str = ""

    def __init__(self, iid: int, tp: int, provisioned_at: float, ready_at: float) -> None:
        self.iid = iid
        self.tp = tp
        self.state = InstanceState.STARTING
        self.provisioned_at = provisioned_at
        self.ready_at = ready_at
        self.drain_handle: int | None = None
        self.ready_handle: int | None = None

    @property
    def accepting(self) -> bool:
        """Ready and not draining: may be given new work."""
        return self.state == InstanceState.READY

    @property
    def load(self) -> int:
        """Requests on the instance (the least-loaded choices compare this)."""
        raise NotImplementedError

    def is_empty(self) -> bool:
        """No in-flight work (a draining instance is removed when this holds)."""
        return self.load == 0


class PrefillInstance(Instance):
    """A P instance: one prefill batch at a time from its waiting queue (module doc).

    The batch time is ``StepCost.prefill_batch_s(lengths)`` seconds over the members' ``prefill_stop`` lengths at
    the instance's TP (which the profile must have measured: :class:`~fulcrum.errors.ProfileError` otherwise).
    The KV transfer that follows does not occupy the instance (NIXL transfers are pulled by the decode side
    asynchronously). ``batch_tokens`` is the token budget of one batch (the cluster keeps it at the plan's
    ``max_prefill_batch_tokens``).
    """

    role = "prefill"

    def __init__(
        self,
        host: InstanceHost,
        kernel: Kernel,
        iid: int,
        tp: int,
        profile: PerformanceProfile,
        provisioned_at: float,
        ready_at: float,
    ) -> None:
        super().__init__(iid, tp, provisioned_at, ready_at)
        self._host = host
        self._kernel = kernel
        self._cost = StepCost.from_profile(profile, tp, prefill_tp_rule="exact")
        self.batch: list[SimRequest] | None = None
        self.queue: deque[SimRequest] = deque()  #: prompts waiting for a batch, oldest first
        self.batch_tokens = 8192  #: token budget of one batch
        self.queued_tokens = 0  #: Σ prefill_stop over the running batch and the queue, tokens
        self._event: int | None = None
        self._busy_done = 0.0
        self._started = 0.0

    @property
    def load(self) -> int:
        return (len(self.batch) if self.batch else 0) + len(self.queue)

    def offer(self, *rs: SimRequest) -> None:
        """Queue ``rs`` here at ``kernel.now`` (a group released together); a batch starts at once when the
        instance is idle."""
        self.queue.extend(rs)
        self.queued_tokens += sum(r.prefill_stop for r in rs)
        if self.batch is None:
            self._start_next()

    def take_queue(self) -> list[SimRequest]:
        """Remove and return the prompts not started yet, oldest first (the cluster re-routes them)."""
        out = list(self.queue)
        self.queue.clear()
        self.queued_tokens -= sum(r.prefill_stop for r in out)
        return out

    def _start_next(self) -> None:
        """Start the waiting prompts first come first served up to ``batch_tokens`` (at least one)."""
        q = self.queue
        if not q:
            return
        batch = [q.popleft()]
        tokens = batch[0].prefill_stop
        while q and tokens + q[0].prefill_stop <= self.batch_tokens:
            r = q.popleft()
            batch.append(r)
            tokens += r.prefill_stop
        self.start(batch)

    def busy_seconds(self, t: float) -> float:
        """Seconds spent prefilling from creation to ``t`` (the compute utilisation of BanaServe eq. 32 is its
        rate of change)."""
        return self._busy_done + (t - self._started if self.batch is not None else 0.0)

    @property
    def idle(self) -> bool:
        """No batch running."""
        return self.batch is None

    def start(self, batch: list[SimRequest]) -> float:
        """Begin prefilling ``batch`` (non-empty) at ``kernel.now``. Returns the batch time, seconds."""
        assert self.batch is None and batch
        duration = self._cost.prefill_batch_s([r.prefill_stop for r in batch])
        self.batch = batch
        self._started = self._kernel.now
        for r in batch:
            if r.prefill_iid < 0:
                r.prefill_start, r.prefill_iid = self._started, self.iid
        self._event = self._kernel.schedule(self._kernel.now + duration, Priority.PREFILL_DONE, self._on_done)
        return duration

    def _on_done(self, _: int) -> None:
        batch = self.batch
        assert batch is not None
        self.batch = None
        self._event = None
        self._busy_done += self._kernel.now - self._started
        self.queued_tokens -= sum(r.prefill_stop for r in batch)
        self._start_next()
        self._host.on_prefill_done(self, batch)

    def evict_all(self) -> list[SimRequest]:
        """Abort the running batch and empty the queue (forced removal); returns their requests, batch first,
        to be prefilled again."""
        if self._event is not None:
            self._kernel.cancel(self._event)
            self._event = None
        batch, self.batch = self.batch or [], None
        out = batch + list(self.queue)
        self.queue.clear()
        self.queued_tokens = 0
        return out


class EngineInstance(Instance):
    """A decode (``role="decode"``) or unified (``role="unified"``) instance; see the module docstring.

    Args:
        host: receives first tokens, finishes and the drained signal.
        kernel: the simulation's event loop.
        iid, role, tp: identity; ``tp`` must have a decode table in ``profile``.
        profile: latencies (priced by :class:`~fulcrum.ratio.step_cost.StepCost`) and KV capacity.
        max_batch: most running requests (>= 1).
        chunk_tokens: prefill tokens per step (>= 1).
        max_span_steps: longest span in steps (None: unbounded; 1: one event per step, recomputing the step
            time from the current mean context each step).
    """

    def __init__(
        self,
        host: InstanceHost,
        kernel: Kernel,
        iid: int,
        role: str,
        tp: int,
        profile: PerformanceProfile,
        max_batch: int,
        chunk_tokens: int,
        max_span_steps: int | None,
        provisioned_at: float,
        ready_at: float,
    ) -> None:
        super().__init__(iid, tp, provisioned_at, ready_at)
        self.role = role
        self._host = host
        self._kernel = kernel
        self._cost = StepCost.from_profile(profile, tp, decode_tp_rule="exact")
        self._max_batch = max_batch
        self._chunk = chunk_tokens
        self._max_span = max_span_steps
        self.capacity = profile.kv_capacity_tokens(tp)  #: KV cache capacity, tokens
        self.running: dict[int, SimRequest] = {}  # admission order (vLLM's running list)
        self.prefilling: deque[SimRequest] = deque()
        self.waiting: deque[SimRequest] = deque()
        self.incoming = 0  #: KV transfers on their way here (maintained by the cluster)
        self.incoming_tokens = 0  #: prompt tokens of those transfers (maintained by the cluster)
        self._waiting_tokens = 0  # Σ(isl + generated) over the waiting queue
        self._fin: list[tuple[int, int, int, SimRequest]] = []  # (finish step, seq, token, request)
        self._seq = 0
        self.n_dec = 0  #: decoding requests
        self._sum_base = 0  # Σ(ctx_i − join_step_i) over decoding requests
        self._reserved = 0  # prompt tokens reserved by prefilling requests
        self._s0 = 0  # step index at the start of the current span
        self._t0 = 0.0  # time at the start of the current span, s
        self._dt = 0.0  # step time in the current span, s
        self._span_end = 0  # step index of the scheduled event
        self._pieces: list[tuple[SimRequest, int]] | None = None  # prefill chunk of the single step in progress
        self._event: int | None = None
        self._leaving: list[SimRequest] = []  # asked to migrate out at the next step boundary

    # ---- views -------------------------------------------------------------------------------------------

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting) + self.incoming

    def _steps_done(self, t: float) -> int:
        """Steps completed by time ``t`` (never past the pending event's step)."""
        if self._event is None or self._pieces is not None or self._dt <= 0.0:
            return self._s0
        k = self._s0 + int((t - self._t0) / self._dt)
        return min(max(k, self._s0), self._span_end)

    def kv_used(self, t: float) -> float:
        """KV tokens held at time ``t`` (contexts of decoding requests plus reserved prompts)."""
        return float(self._sum_base + self.n_dec * self._steps_done(t) + self._reserved)

    def projected_tokens(self, t: float) -> float:
        """KV tokens held at ``t`` plus those of waiting requests and incoming transfers (the room check of
        the decode choice)."""
        return self.kv_used(t) + self._waiting_tokens + self.incoming_tokens

    def waiting_counts(self) -> tuple[int, int]:
        """(waiting requests that still need their first token, waiting requests that already have it)."""
        fresh = sum(1 for r in self.waiting if r.generated == 0)
        return fresh, len(self.waiting) - fresh

    def decoding(self, t: float) -> list[tuple[SimRequest, int]]:
        """The decoding requests at ``t`` with the tokens each has generated by then (admission order)."""
        k = self._steps_done(t)
        return [(r, r.gen_join + (k - r.join_step)) for r in self.running.values() if r.phase == Phase.DECODING]

    def step_time(self, t: float) -> float:
        """Decode step time of the current batch at ``t``, seconds (one request at context 1 when idle)."""
        n = self.n_dec
        if n == 0:
            return self._cost.decode_step_s(1, 1)
        return self._cost.decode_step_s(n, (self._sum_base + n * self._steps_done(t)) / n)

    def request_migration(self, r: SimRequest) -> bool:
        """Ask ``r`` (decoding here) to leave at the end of the step in progress; the host's ``on_migrate_out``
        is called then (ARES §5.4: the request pauses, the rest of the batch goes on). Returns False when ``r``
        is not decoding here or already leaving."""
        if r.migrating or r.phase != Phase.DECODING or self.running.get(r.idx) is not r:
            return False
        r.migrating = True
        self._leaving.append(r)
        if self._event is None or self._pieces is not None:
            return True  # a single (prefill) step is in progress: its end is the boundary
        nb = self._steps_done(self._kernel.now) + 1
        if nb < self._span_end:
            self._kernel.cancel(self._event)
            self._span_end = nb
            self._event = self._kernel.schedule(self._t0 + (nb - self._s0) * self._dt, Priority.STEP, self._on_step, nb)
        return True

    # ---- entry -------------------------------------------------------------------------------------------

    def offer(self, r: SimRequest) -> None:
        """Queue ``r`` here at ``kernel.now``; it joins at the next step boundary where it fits."""
        r.phase = Phase.WAITING
        self.waiting.append(r)
        self._waiting_tokens += r.isl + r.generated
        if len(self.waiting) > 1:
            return  # the head is blocked; ``r`` queues behind it
        now = self._kernel.now
        if self._event is None:  # idle: start at this instant, once every request arriving now is queued
            self._t0 = now
            self._dt = 0.0
            self._span_end = self._s0
            self._event = self._kernel.schedule(now, Priority.START, self._on_step, self._s0)
            return
        if self._pieces is not None:
            return  # a single step is running; its end admits
        nb = self._steps_done(now) + 1  # boundary at the end of the step in progress
        if nb >= self._span_end or not self._fits(r, nb):
            return
        self._kernel.cancel(self._event)
        self._span_end = nb
        self._event = self._kernel.schedule(self._t0 + (nb - self._s0) * self._dt, Priority.STEP, self._on_step, nb)

    def _fits(self, r: SimRequest, s: int) -> bool:
        cnt = len(self.running)
        if cnt >= self._max_batch:
            return False
        used = self._sum_base + self.n_dec * s + self._reserved
        return cnt == 0 or used + r.isl + r.generated <= self.capacity

    # ---- a step boundary ---------------------------------------------------------------------------------

    def _on_step(self, s: int) -> None:
        t = self._kernel.now
        self._event = None
        host = self._host
        fin = self._fin
        while fin and fin[0][0] <= s:
            f, _, tok, r = heapq.heappop(fin)
            if tok != r.token:
                continue  # left the batch earlier (preempted)
            self._leave_decode(r)
            del self.running[r.idx]
            r.phase = Phase.OUTSIDE
            generated = r.gen_join + (f - r.join_step)
            if generated < r.osl:  # its part here is done: hand off to the planned instance
                r.generated = generated
                r.kv_ready = False
                host.on_handoff(r, self, self._t0 + (f - self._s0) * self._dt)
                continue
            r.generated = r.osl
            r.decode_iid = self.iid
            host.on_finish(r, self._t0 + (f - self._s0) * self._dt)
        if self._pieces is not None:
            self._finish_pieces(s, t)
        if self._leaving:
            self._migrate_out(s, t)
        self._preempt(s)
        self._admit(s)
        self._plan(s, t)
        if self.state == InstanceState.DRAINING and self.is_empty():
            host.on_instance_drained(self)

    def _finish_pieces(self, s: int, t: float) -> None:
        pieces = self._pieces
        assert pieces is not None
        self._pieces = None
        for r, c in pieces:
            r.pf_done += c
            if r.pf_done < r.pf_total:
                continue
            popped = self.prefilling.popleft()
            assert popped is r
            self._reserved -= r.pf_total
            if r.partial:  # the head of a split inside the prompt: no token, the KV moves on
                del self.running[r.idx]
                r.phase = Phase.OUTSIDE
                self._host.on_handoff(r, self, t)
                continue
            r.generated += 1
            r.kv_ready = True
            if math.isnan(r.first_token):
                self._host.on_first_token(r, t)
            if r.generated >= r.osl:
                del self.running[r.idx]
                r.phase = Phase.OUTSIDE
                r.decode_iid = self.iid
                self._host.on_finish(r, t)
            elif r.planned >= 0 and r.generated >= r.handoff_at:
                del self.running[r.idx]
                r.phase = Phase.OUTSIDE
                r.kv_ready = False
                self._host.on_handoff(r, self, t)
            else:
                self._join_decode(r, s)

    def _migrate_out(self, s: int, t: float) -> None:
        leaving, self._leaving = self._leaving, []
        for r in leaving:
            r.migrating = False
            if self.running.get(r.idx) is not r or r.phase != Phase.DECODING:
                continue  # finished at this boundary
            r.generated = r.gen_join + (s - r.join_step)
            self._leave_decode(r)
            del self.running[r.idx]
            r.kv_ready = False
            r.phase = Phase.OUTSIDE
            self._host.on_migrate_out(r, self, t)

    def _join_decode(self, r: SimRequest, s: int) -> None:
        r.phase = Phase.DECODING
        r.join_step = s
        r.gen_join = r.generated
        r.base = r.isl + r.generated - s
        self.n_dec += 1
        self._sum_base += r.base
        self._seq += 1
        end = r.handoff_at if r.planned >= 0 and 0 < r.handoff_at < r.osl else r.osl  # leaves there, or finishes
        heapq.heappush(self._fin, (s + end - r.generated, self._seq, r.token, r))

    def _leave_decode(self, r: SimRequest) -> None:
        r.token += 1
        self.n_dec -= 1
        self._sum_base -= r.base

    def _preempt(self, s: int) -> None:
        """Preempt the latest-admitted requests while the contexts overflow the KV cache (vLLM recompute)."""
        running = self.running
        used = self._sum_base + self.n_dec * s + self._reserved
        while used > self.capacity and len(running) > 1:
            _, r = running.popitem()  # the most recently admitted
            if r.phase == Phase.PREFILLING:
                self.prefilling.remove(r)
                self._reserved -= r.pf_total
                used -= r.pf_total
            else:
                r.generated = r.gen_join + (s - r.join_step)
                self._leave_decode(r)
                used -= r.isl + r.generated
            r.kv_ready = False
            r.phase = Phase.WAITING
            r.preemptions += 1
            self.waiting.appendleft(r)
            self._waiting_tokens += r.isl + r.generated

    def _admit(self, s: int) -> None:
        waiting = self.waiting
        if not waiting:
            return
        running = self.running
        used = self._sum_base + self.n_dec * s + self._reserved
        cnt = len(running)
        while waiting and cnt < self._max_batch:
            r = waiting[0]
            need = r.isl + r.generated
            if cnt and used + need > self.capacity:
                break
            waiting.popleft()
            self._waiting_tokens -= need
            cnt += 1
            used += need
            running[r.idx] = r
            if r.kv_ready:
                self._join_decode(r, s)
            else:
                r.phase = Phase.PREFILLING
                if r.prefill_iid < 0:
                    r.prefill_start, r.prefill_iid = self._kernel.now, self.iid
                r.pf_total = r.prefill_stop if r.partial else need
                r.pf_done = min(r.kv_prefix, r.pf_total)  # a prompt head whose KV came with it
                r.kv_prefix = 0  # used: a later recompute (preemption) starts from 0
                self._reserved += r.pf_total
                self.prefilling.append(r)

    def _plan(self, s: int, t: float) -> None:
        """Start the next span at step ``s``, time ``t``: set its step time and schedule its end."""
        self._s0 = s
        self._t0 = t
        n = self.n_dec
        if self.prefilling:
            budget = max(self._chunk - n, 1)  # the step's token budget is shared with one token per decoder
            pieces: list[tuple[SimRequest, int]] = []
            for r in self.prefilling:
                c = min(r.pf_total - r.pf_done, budget)
                pieces.append((r, c))
                budget -= c
                if budget <= 0:
                    break
            chunks = [(r.pf_done, c) for r, c in pieces]
            dt = self._cost.step_s(chunks, n, (self._sum_base + n * s) / n if n else 0.0)
            self._pieces = pieces
            target = s + 1
        elif n:
            fin = self._fin
            while fin[0][2] != fin[0][3].token:
                heapq.heappop(fin)
            target = fin[0][0]
            if len(self.running) > 1:
                over = math.floor((self.capacity - self._reserved - self._sum_base) / n) + 1
                if over < target:
                    target = max(over, s + 1)
            if self._max_span is not None and target - s > self._max_span:
                target = s + self._max_span
            # step j of the span runs at mean context c0 + j − 1: time it at the span's mean context
            dt = self._cost.decode_step_s(n, (self._sum_base + n * s) / n + (target - s - 1) / 2)
        else:
            self._event = None
            self._dt = 0.0
            return
        assert len(self.running) == n + len(self.prefilling) and target > s
        self._dt = dt
        self._span_end = target
        self._event = self._kernel.schedule(t + (target - s) * dt, Priority.STEP, self._on_step, target)

    # ---- forced removal ----------------------------------------------------------------------------------

    def evict_all(self) -> list[SimRequest]:
        """Drop everything at ``kernel.now`` (drain timeout): returns the requests, KV lost, admission order
        first, then the waiting queue. Each keeps the tokens it generated."""
        k = self._steps_done(self._kernel.now)
        if self._event is not None:
            self._kernel.cancel(self._event)
            self._event = None
        out: list[SimRequest] = []
        for r in self.running.values():
            if r.phase == Phase.DECODING:
                r.generated = min(r.gen_join + (k - r.join_step), r.osl - 1)
                r.token += 1
            out.append(r)
        out.extend(self.waiting)
        for r in out:
            r.kv_ready = False
            r.phase = Phase.OUTSIDE
        self.running.clear()
        self.prefilling.clear()
        self.waiting.clear()
        self._waiting_tokens = 0
        self._fin.clear()
        self.n_dec = 0
        self._sum_base = 0
        self._reserved = 0
        self._pieces = None
        for r in self._leaving:
            r.migrating = False
        self._leaving.clear()
        return out
