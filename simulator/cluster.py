"""The simulated cluster: pools of instances, the router's policies, scaling with start-up and drain.

:class:`Simulation` is what ``fulcrum replay`` drives in place of Kubernetes: ``apply`` a
:class:`~fulcrum.target.ClusterTarget`, ``run_until`` the next planner tick, ``observe`` the last interval,
and ``finish`` for the per-request records. Instances are modelled in :mod:`fulcrum.simulator.instances`.

Request paths (the router's choice, :class:`~fulcrum.target.RoutingParams`):

- **disaggregated** (mode Disaggregated, prompt longer than ``ultra_short_tokens``): the request joins one
  shared prefill queue that idle P instances pull from (DOPD §V-C; the NATS queue of DESIGN's connector).
  Batches are formed FCFS up to ``max_prefill_batch_tokens``, or, with ``length_aware_batching``, by DOPD
  Alg. 1 (:class:`PrefillQueue`). The first token comes out at the end of the prefill batch (TTFT = queueing +
  prefill). Then the KV cache moves to a decode instance chosen least-loaded among those with KV room (the
  least-loaded overall when none has room), taking ``kv_transfer_seconds(isl, kv_link_gbps) +
  kv_transfer_overhead_s``; the transfer does not block the P instance (NIXL pulls) and links are not
  shared (no contention). The request then waits in that instance's queue for KV room and a batch slot.
- **local** (mode Disaggregated, ``isl <= ultra_short_tokens``; DOPD §II-C, §V-E "PD-aggregation"): sent at
  arrival to a decode instance (same choice) and prefilled there inside its next step, no transfer.
- **unified** (mode Unified, ``target.unified.replicas > 0``): sent at arrival to the least-loaded unified
  instance, which mixes chunked prefill with decoding (vLLM).

"Least loaded" counts requests (running + waiting + incoming); ties go to the oldest instance. Requests that
find no instance to go to wait at the router (prefill queue, or a pending queue for decode-capable
instances) and are dispatched when one becomes ready; a decode-capable target of the disaggregated paths is a
decode instance, or a unified instance when no decode instance accepts work (mode changes).

Scaling (:meth:`Simulation.apply`):

- scale-out provisions instances at once (GPUs counted from then) that become ready after ``pod_startup_s``;
  before starting a new instance the pool un-drains a draining one of the same TP (the busiest first);
- scale-in picks the least-loaded instances (not-yet-ready ones first among equals, then the newest): a
  starting instance is cancelled at once; a ready one stops getting new work, finishes its in-flight requests
  (drain) and is removed when empty, or at ``drain_timeout_s``, when its remaining requests are re-dispatched
  (KV lost: prompts go back to the queue, decoding requests are recomputed elsewhere) — no request is lost;
- a TP change of a pool drains every instance of the old TP and starts instances of the new one;
- switching between Unified and Disaggregated moves requests not yet started to the new path; in-flight
  ones finish where they are. A target holding both kinds of pools is a switch under way (make-before-break):
  requests keep the old path until the old pools leave the target (:func:`serving_unified`).

GPU accounting: ``gpu_timeline`` holds (time, provisioned GPUs, ready GPUs) at every change, provisioned =
every instance not removed (starting, ready, draining), ready = instances up and serving (ready or
draining), so the gap between the two is start-up; ``gpu_seconds`` = ∫ provisioned GPUs dt over the run.
The planner's :class:`~fulcrum.observation.ReadyCounts` count ready, non-draining instances only.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from fulcrum.api.llmserve import SLOSpec
from fulcrum.errors import ProfileError
from fulcrum.observation import Observation, ReadyCounts
from fulcrum.ratio.profile import PerformanceProfile
from fulcrum.simulator.instances import EngineInstance, Instance, InstanceState, PrefillInstance, SimRequest
from fulcrum.simulator.kernel import Kernel, Priority
from fulcrum.simulator.metrics import ClusterSnapshot, MetricsRecorder, summarize
from fulcrum.simulator.records import (
    DecodeInstanceView,
    DecodeRequestView,
    InstanceStatus,
    RequestRecord,
    RoleView,
)
from fulcrum.target import ClusterTarget, Pool, PoolSize, RoutingParams
from fulcrum.workload import Request

__all__ = ["SimConfig", "SimResult", "PrefillQueue", "Simulation", "Rescheduler", "RoleBalancer", "serving_unified"]

Rescheduler = Callable[[float, Sequence[DecodeInstanceView]], Sequence[tuple[int, int]]]
"""A decode rescheduler: (now s, decode instances) → migrations as (request idx, target instance iid). The
pure planner is ``fulcrum.rebalancing.decode_rescheduling.plan_migration`` (ARES Alg. 1); the caller adapts it
(the simulator sits below the planners' callers in the layers)."""
RoleBalancer = Callable[[float, Sequence[RoleView]], Sequence[tuple[int, str]]]
"""A role balancer: (now s, ready P and D instances) → role changes as (instance iid, "prefill" | "decode").
The pure planner is ``fulcrum.rebalancing.role_reassignment.plan_role_change`` (BanaServe Alg. 1 with a
role flip); ``fulcrum.replay.roles`` adapts it."""

_ROLES = tuple(p.value for p in Pool)


def serving_unified(target: ClusterTarget, was_unified: bool) -> bool:
    """Whether new requests take the unified path under ``target``: yes when it holds only a unified pool, no
    when it holds only prefill/decode pools, and unchanged when it holds both — a mode switch under way
    (make-before-break, :mod:`fulcrum.scaling.mode`): the old mode keeps serving until its pools leave the
    target, which the planner does once the new pools are ready.
    """
    uni = target.unified.replicas > 0
    pd = target.prefill.replicas + target.decode.replicas > 0
    if uni != pd:
        return uni
    return was_unified


@dataclass(frozen=True)
class SimConfig:
    """Settings of the simulated cluster.

    Attributes:
        pod_startup_s: scale-out → ready, seconds (image pull, weight load, CUDA graph capture; DESIGN's
            ``podStartupSeconds`` default).
        kv_link_gbps: KV transfer bandwidth between instances, GB/s (NIXL over RDMA/NVLink; 25 GB/s ≈ a
            200 Gb/s RDMA NIC).
        kv_transfer_overhead_s: fixed cost per transfer, seconds (handshake, block descriptors; DOPD §II-C
            reports 15–80 ms for whole transfers of short prompts).
        max_decode_batch: most running requests per decode-capable instance (vLLM ``max_num_seqs``); None =
            the profile's ``cuda_graph_max_batch`` (cc_g of DOPD eq. 14).
        prefill_chunk_tokens: prefill tokens per engine step on decode-capable instances (vLLM chunked
            prefill, ``max_num_batched_tokens``-like budget).
        drain_timeout_s: longest a draining instance may run before its leftovers are re-dispatched, seconds
            (Kubernetes ``terminationGracePeriodSeconds``).
        grace_s: after the last arrival, :meth:`Simulation.finish` stops and counts unfinished requests as
            misses (``inf`` times), seconds.
        max_span_steps: longest run of decode steps an engine advances at once (None = until its batch
            changes). 1 recomputes the step time from the current mean context at every step: slower,
            and the reference the span approximation is checked against.
        reschedule_interval_s: period of the decode-rescheduling tick, seconds (ARES Alg. 1 line 3: "every
            1 second"); 0 = no tick. At each tick the decode instances' token loads are sampled
            (:attr:`SimResult.decode_load_samples`) and the simulation's ``rescheduler``, if any, is asked for
            migrations.
    """

    pod_startup_s: float = 120.0
    kv_link_gbps: float = 25.0
    kv_transfer_overhead_s: float = 0.005
    max_decode_batch: int | None = None
    prefill_chunk_tokens: int = 2048
    drain_timeout_s: float = 600.0
    grace_s: float = 1800.0
    max_span_steps: int | None = None
    reschedule_interval_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("pod_startup_s", "kv_transfer_overhead_s", "drain_timeout_s", "grace_s", "reschedule_interval_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if not (math.isfinite(self.kv_link_gbps) and self.kv_link_gbps > 0):
            raise ValueError(f"kv_link_gbps must be positive, got {self.kv_link_gbps!r}")
        if self.max_decode_batch is not None and self.max_decode_batch < 1:
            raise ValueError(f"max_decode_batch must be >= 1, got {self.max_decode_batch}")
        if self.prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {self.prefill_chunk_tokens}")
        if self.max_span_steps is not None and self.max_span_steps < 1:
            raise ValueError(f"max_span_steps must be >= 1, got {self.max_span_steps}")


@dataclass
class SimResult:
    """What a run produced.

    Attributes:
        records: one per request of the trace, in arrival order.
        gpu_timeline: (time s, provisioned GPUs, ready GPUs) at t = 0 and at every change.
        gpu_seconds: ∫ provisioned GPUs dt from 0 to ``end_s``, GPU·s.
        end_s: end of the run, seconds (last completion, or last arrival + grace when requests were left
            unfinished, or the time the caller had already run to, whichever is latest).
        events: kernel events handled (for benchmarks).
        decode_load_samples: at each rescheduling tick (``SimConfig.reschedule_interval_s``), the time and the
            token load (Σ KV tokens of decoding requests) of every ready or draining decode-capable instance.
        migrations: decode requests migrated by the rescheduler.
        migrated_tokens: KV tokens those migrations moved (× the profile's ``kv_bytes_per_token`` = bytes).
        migration_seconds: Σ KV transfer time of the migrations, seconds (each pauses its request that long).
        role_changes: instances moved between prefill and decode duty by the role balancer.
    """

    records: list[RequestRecord]
    gpu_timeline: list[tuple[float, int, int]]
    gpu_seconds: float
    end_s: float
    events: int = field(default=0)
    decode_load_samples: list[tuple[float, tuple[int, ...]]] = field(default_factory=list)
    migrations: int = 0
    migrated_tokens: int = 0
    migration_seconds: float = 0.0
    role_changes: int = 0

    def decode_load_variance(self, since_s: float = 0.0, until_s: float = math.inf) -> float:
        """Mean over the ticks in ``[since_s, until_s]`` of the variance of the instances' token loads (ARES
        eq. 3), tokens²; 0 without samples. (The drain after the last arrival, when one long request is left
        on one instance, is imbalance no rescheduler can fix: pass the last arrival as ``until_s``.)"""
        vs = [float(np.var(loads)) for t, loads in self.decode_load_samples
              if since_s <= t <= until_s and len(loads) > 1]
        return float(np.mean(vs)) if vs else 0.0

    def gpu_seconds_between(self, start_s: float, end_s: float) -> float:
        """∫ provisioned GPUs dt over [start_s, end_s], GPU·s (from ``gpu_timeline``)."""
        tl = self.gpu_timeline
        if not tl or end_s <= start_s:
            return 0.0
        total = 0.0
        for (t0, g, _), (t1, _, _) in zip(tl, tl[1:] + [(max(end_s, tl[-1][0]), 0, 0)]):
            lo, hi = max(t0, start_s), min(t1, end_s)
            if hi > lo:
                total += g * (hi - lo)
        return total

    def summary(self, slo: SLOSpec, since_s: float = 0.0) -> dict[str, float]:
        """Headline figures (see :func:`fulcrum.simulator.metrics.summarize`): slo_attainment,
        goodput_tokens_per_s, throughput_tokens_per_s, gpu_hours, ttft_p_s, tpot_p_s, ttft_attainment,
        tpot_attainment, requests.

        Args:
            since_s: score only requests arriving at or after this time, and GPU time from it on (a warm-up
                that leaves the cold start of the initial pools out of the comparison).
        """
        if since_s <= 0:
            return summarize(self.records, slo, self.gpu_seconds, self.end_s)
        recs = [r for r in self.records if r.arrival_s >= since_s]
        return summarize(recs, slo, self.gpu_seconds_between(since_s, self.end_s), self.end_s)


class PrefillQueue:
    """The shared queue P instances pull from, and how one pull forms a batch.

    FCFS (``length_aware_batching`` off): the oldest requests, up to ``max_prefill_batch_tokens`` prompt
    tokens (at least one request).

    DOPD Alg. 1 (``length_aware_batching`` on), with ``i_next = long_request_tokens``: a prompt of at least
    ``i_next`` tokens is prefilled at once and alone (l. 23–24); shorter ones are grouped, oldest first, into a
    batch that goes when its total reaches ``i_next`` (l. 4, also when the token budget is reached) or when
    its oldest member has waited ``batch_timeout_s`` (the TIMER of l. 4; with a timeout of 0 this is l. 10–12,
    "queue empty → run the batch"). A long prompt never waits behind a forming short batch; when the oldest
    request is long it goes first. A request is classified short/long when it enters the queue.
    """

    def __init__(self) -> None:
        self._short: deque[SimRequest] = deque()
        self._long: deque[SimRequest] = deque()
        self._seq = 0

    def __len__(self) -> int:
        return len(self._short) + len(self._long)

    def push(self, r: SimRequest, now: float, routing: RoutingParams) -> None:
        """Enqueue ``r`` (arrived at the queue at ``now`` seconds)."""
        self._seq += 1
        r.qseq = self._seq
        r.enq = now
        if routing.length_aware_batching and r.isl >= routing.long_request_tokens:
            self._long.append(r)
        else:
            self._short.append(r)

    def push_front(self, rs: Sequence[SimRequest]) -> None:
        """Put requests back at the head (an aborted batch), keeping their order and queue times."""
        for r in reversed(rs):
            self._seq += 1
            r.qseq = -self._seq  # older than anything queued
            self._short.appendleft(r)

    def drain_all(self) -> list[SimRequest]:
        """Remove and return every queued request, oldest first."""
        out = sorted([*self._short, *self._long], key=lambda r: r.qseq)
        self._short.clear()
        self._long.clear()
        return out

    def _pop_oldest(self) -> SimRequest:
        s, lg = self._short, self._long
        if s and (not lg or s[0].qseq < lg[0].qseq):
            return s.popleft()
        return lg.popleft()

    def oldest_enqueued(self) -> float | None:
        """Queue-entry time of the oldest queued request, seconds (None when empty)."""
        return self._oldest().enq if self else None

    def _oldest(self) -> SimRequest:
        s, lg = self._short, self._long
        if s and (not lg or s[0].qseq < lg[0].qseq):
            return s[0]
        return lg[0]

    def take(self, now: float, routing: RoutingParams) -> tuple[list[SimRequest] | None, float | None]:
        """One batch for an idle P instance at ``now``, or (None, wake-up time) when the batch must wait
        (None, None when the queue is empty)."""
        if not self:
            return None, None
        budget = routing.max_prefill_batch_tokens
        if not routing.length_aware_batching:
            batch = [self._pop_oldest()]
            tokens = batch[0].isl
            while self and tokens + self._oldest().isl <= budget:
                r = self._pop_oldest()
                batch.append(r)
                tokens += r.isl
            return batch, None
        short, long_ = self._short, self._long
        if long_ and (not short or long_[0].qseq < short[0].qseq):
            return [long_.popleft()], None
        i_next = routing.long_request_tokens
        count = 0
        tokens = 0
        full = False
        for r in short:
            if count and tokens + r.isl > budget:
                full = True
                break
            count += 1
            tokens += r.isl
            if tokens >= i_next:
                full = True
                break
        head = short[0]
        if full or now >= head.enq + routing.batch_timeout_s:
            return [short.popleft() for _ in range(count)], None
        if long_:
            return [long_.popleft()], None
        return None, head.enq + routing.batch_timeout_s


class Simulation:
    """A discrete-event P/D cluster replaying ``requests``, timed by ``profile`` (see the module docstring).

    Args:
        requests: the trace (any order; replayed in arrival order, ties in given order). Each needs
            ``isl >= 1``, ``osl >= 1`` and a finite ``arrival_s >= 0``.
        profile: latencies (prefill, decode step) and KV capacity per TP.
        slo: SLOs the observations measure attainment against.
        initial: the pools at t = 0; they start READY.
        config: :class:`SimConfig`.
        rescheduler: asked for decode migrations every ``config.reschedule_interval_s`` (None: none).
        role_balancer: asked for role changes at the same ticks (None: fixed roles).

    Raises:
        ValueError: a malformed request.
        ProfileError: a pool's TP is not measured in the profile (P: prefill table; D, unified: decode table).
    """

    def __init__(
        self,
        requests: Sequence[Request],
        profile: PerformanceProfile,
        slo: SLOSpec,
        initial: ClusterTarget,
        config: SimConfig = SimConfig(),
        rescheduler: Rescheduler | None = None,
        role_balancer: RoleBalancer | None = None,
    ) -> None:
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
        reqs: list[SimRequest] = []
        for k, i in enumerate(order):
            q = requests[i]
            if not (math.isfinite(q.arrival_s) and q.arrival_s >= 0):
                raise ValueError(f"request {i}: arrival_s must be a finite number >= 0, got {q.arrival_s!r}")
            if q.isl < 1 or q.osl < 1:
                raise ValueError(f"request {i}: isl and osl must be >= 1, got isl={q.isl}, osl={q.osl}")
            reqs.append(SimRequest(k, float(q.arrival_s), int(q.isl), int(q.osl)))
        self._reqs = reqs
        self._profile = profile
        self._slo = slo
        self._cfg = config
        self._max_batch = config.max_decode_batch or profile.cuda_graph_max_batch
        self._kernel = Kernel()
        arr = np.fromiter((r.arrival for r in reqs), dtype=float, count=len(reqs))
        isl = np.fromiter((r.isl for r in reqs), dtype=float, count=len(reqs))
        osl = np.fromiter((r.osl for r in reqs), dtype=float, count=len(reqs))
        self._metrics = MetricsRecorder(arr, isl, osl, slo)
        self._pools: dict[str, list[Instance]] = {role: [] for role in _ROLES}
        self._by_id: dict[int, Instance] = {}
        self._next_id = 0
        self._pq = PrefillQueue()
        self._kv_pending: deque[SimRequest] = deque()  # prefilled, KV waiting for a decode-capable instance
        self._engine_pending: deque[SimRequest] = deque()  # local / evicted, waiting for a decode-capable one
        self._unified_pending: deque[SimRequest] = deque()  # unified, waiting for a unified instance
        self._timer_at: float | None = None
        self._done = 0
        self._result: SimResult | None = None
        self._timeline: list[tuple[float, int, int]] = []
        self._target = initial
        self._serving_unified = serving_unified(initial, False)
        self._check_tps(initial)
        for role in _ROLES:
            size = initial.pool(Pool(role))
            for _ in range(size.replicas):
                inst = self._new_instance(role, size.tp, ready_at=0.0)
                inst.state = InstanceState.READY
        self._record_gpus()
        self._rescheduler = rescheduler
        self._role_balancer = role_balancer
        self._reassign: dict[int, str] = {}  # draining instance → the role it takes once drained
        self._role_changes = 0
        self._last_tick = 0.0
        self._busy_at_tick: dict[int, float] = {}
        self._mig_target: dict[int, EngineInstance] = {}
        self._load_samples: list[tuple[float, tuple[int, ...]]] = []
        self._migrations = 0
        self._migrated_tokens = 0
        self._migration_s = 0.0
        if reqs:
            self._kernel.schedule(reqs[0].arrival, Priority.ARRIVAL, self._on_arrival, 0)
            if config.reschedule_interval_s > 0:
                self._kernel.schedule(config.reschedule_interval_s, Priority.TIMER, self._on_reschedule)

    # ---- public API --------------------------------------------------------------------------------------

    @property
    def now(self) -> float:
        """Current simulated time, seconds."""
        return self._kernel.now

    @property
    def target(self) -> ClusterTarget:
        """The target in force."""
        return self._target

    def run_until(self, t: float) -> None:
        """Process every event with time <= ``t`` seconds; then ``now = t``.

        Raises:
            ValueError: ``t`` is before ``now``.
        """
        self._kernel.run_until(t)

    def apply(self, target: ClusterTarget, reason: str = "") -> None:
        """Resize the pools towards ``target`` at ``now`` (see the module docstring for the rules); the target in
        force is a no-op. Part of :class:`fulcrum.cluster.Cluster` (``reason`` is not recorded here).

        Raises:
            ProfileError: a pool's TP is not measured in the profile.
        """
        if target == self._target:
            return
        self._check_tps(target)
        was_unified = self._unified_mode
        self._target = target
        self._serving_unified = serving_unified(target, was_unified)
        for pool in Pool:
            self._resize(pool.value, target.pool(pool))
        if self._unified_mode and not was_unified:
            for r in self._pq.drain_all():
                self._route_new(r)
        elif was_unified and not self._unified_mode:
            moved = list(self._unified_pending)
            self._unified_pending.clear()
            for r in moved:
                self._route_new(r)
        self._record_gpus()
        self._dispatch_all()

    def observe(self, window_s: float) -> Observation:
        """Load and service over ``(now − window_s, now]`` (see :mod:`fulcrum.simulator.metrics`).

        Raises:
            ValueError: ``window_s`` is not positive.
        """
        return self._metrics.observe(self._kernel.now, window_s, self._snapshot())

    def ready(self) -> ReadyCounts:
        """Instances ready to serve now, per pool (:class:`fulcrum.cluster.Cluster`)."""
        return self._snapshot().ready

    def draining(self) -> dict[Pool, int]:
        """Instances draining now (serving their in-flight requests only), per pool that has any
        (:class:`fulcrum.cluster.Cluster`)."""
        n = {p: sum(1 for i in self._pools[p.value] if i.state == InstanceState.DRAINING) for p in Pool}
        return {p: k for p, k in n.items() if k}

    def instances(self) -> list[InstanceStatus]:
        """Every instance not yet removed, in creation order, as of ``now``."""
        now = self._kernel.now
        out: list[InstanceStatus] = []
        for inst in sorted((i for role in _ROLES for i in self._pools[role]), key=lambda i: i.iid):
            if isinstance(inst, EngineInstance):
                running, waiting = len(inst.running), len(inst.waiting)
                kv, cap = inst.kv_used(now), inst.capacity
            else:
                running, waiting, kv, cap = inst.load, 0, 0.0, 0.0
            out.append(InstanceStatus(
                iid=inst.iid, role=inst.role, tp=inst.tp, state=inst.state.name.lower(), running=running,
                waiting=waiting, kv_tokens=kv, kv_capacity_tokens=cap, provisioned_at_s=inst.provisioned_at,
                ready_at_s=inst.ready_at,
            ))
        return out

    def finish(self) -> SimResult:
        """Run until every request is done, or ``grace_s`` after the last arrival; return the result.

        Calling it again returns the same result.
        """
        if self._result is not None:
            return self._result
        k = self._kernel
        n = len(self._reqs)
        deadline = (self._reqs[-1].arrival + self._cfg.grace_s) if n else k.now
        while self._done < n:
            if k.next_time() > deadline:
                break
            k.step()
        if self._done < n and deadline > k.now:
            k.run_until(deadline)
        end = k.now
        records = [self._record(r) for r in self._reqs]
        self._result = SimResult(
            records=records,
            gpu_timeline=list(self._timeline),
            gpu_seconds=self._gpu_seconds(end),
            end_s=end,
            events=k.processed,
            decode_load_samples=list(self._load_samples),
            migrations=self._migrations,
            migrated_tokens=self._migrated_tokens,
            migration_seconds=self._migration_s,
            role_changes=self._role_changes,
        )
        return self._result

    # ---- helpers: pools ----------------------------------------------------------------------------------

    @property
    def _unified_mode(self) -> bool:
        """Whether new requests take the unified path (see :func:`serving_unified`)."""
        return self._serving_unified


    def _check_tps(self, target: ClusterTarget) -> None:
        p = self._profile
        if target.prefill.replicas and target.prefill.tp not in p.prefill:
            raise ProfileError(
                f"profile {p.name!r} has no prefill table for TP={target.prefill.tp} (has {p.prefill_tps}); prefill pool"
            )
        for role in ("decode", "unified"):
            size = target.pool(Pool(role))
            if size.replicas and size.tp not in p.decode:
                raise ProfileError(
                    f"profile {p.name!r} has no decode table for TP={size.tp} (has {p.decode_tps}); {role} pool"
                )

    def _new_instance(self, role: str, tp: int, ready_at: float) -> Instance:
        iid = self._next_id
        self._next_id += 1
        now = self._kernel.now
        inst: Instance
        if role == "prefill":
            inst = PrefillInstance(self, self._kernel, iid, tp, self._profile, now, ready_at)
        else:
            inst = EngineInstance(
                self, self._kernel, iid, role, tp, self._profile, self._max_batch, self._cfg.prefill_chunk_tokens,
                self._cfg.max_span_steps, now, ready_at,
            )
        self._pools[role].append(inst)
        self._by_id[iid] = inst
        return inst

    def _resize(self, role: str, size: PoolSize) -> None:
        live = list(self._pools[role])
        for inst in live:
            if inst.tp != size.tp and inst.state in (InstanceState.STARTING, InstanceState.READY):
                self._drain(inst)
        same = [i for i in live if i.tp == size.tp and i.state != InstanceState.REMOVED]
        active = [i for i in same if i.state in (InstanceState.STARTING, InstanceState.READY)]
        diff = size.replicas - len(active)
        if diff > 0:
            draining = sorted((i for i in same if i.state == InstanceState.DRAINING), key=lambda i: (-i.load, i.iid))
            for inst in draining[:diff]:
                self._undrain(inst)
                diff -= 1
            for _ in range(diff):
                self._start(role, size.tp)
        elif diff < 0:
            victims = sorted(active, key=lambda i: (i.load, i.state == InstanceState.READY, -i.iid))
            for inst in victims[:-diff]:
                self._drain(inst)

    def _start(self, role: str, tp: int) -> None:
        now = self._kernel.now
        inst = self._new_instance(role, tp, ready_at=now + self._cfg.pod_startup_s)
        if self._cfg.pod_startup_s == 0:
            inst.state = InstanceState.READY
        else:
            inst.ready_handle = self._kernel.schedule(inst.ready_at, Priority.READY, self._on_ready, inst.iid)

    def _on_ready(self, iid: int) -> None:
        inst = self._by_id[iid]
        inst.ready_handle = None
        if inst.state != InstanceState.STARTING:
            return
        inst.state = InstanceState.READY
        self._record_gpus()
        self._dispatch_all()

    def _drain(self, inst: Instance) -> None:
        if inst.state == InstanceState.STARTING:
            if inst.ready_handle is not None:
                self._kernel.cancel(inst.ready_handle)
                inst.ready_handle = None
            self._remove(inst)
            return
        inst.state = InstanceState.DRAINING
        if inst.is_empty():
            self._remove(inst)
            return
        inst.drain_handle = self._kernel.schedule(
            self._kernel.now + self._cfg.drain_timeout_s, Priority.DRAIN_TIMEOUT, self._on_drain_timeout, inst.iid
        )

    def _undrain(self, inst: Instance) -> None:
        inst.state = InstanceState.READY
        if inst.drain_handle is not None:
            self._kernel.cancel(inst.drain_handle)
            inst.drain_handle = None

    def _remove(self, inst: Instance) -> None:
        inst.state = InstanceState.REMOVED
        if inst.drain_handle is not None:
            self._kernel.cancel(inst.drain_handle)
            inst.drain_handle = None
        self._pools[inst.role].remove(inst)
        role = self._reassign.pop(inst.iid, None)
        if role is not None:  # a role change: the same GPUs take the other duty, weights already loaded
            now = self._kernel.now
            new = self._new_instance(role, inst.tp, ready_at=now)
            new.ready_handle = self._kernel.schedule(now, Priority.READY, self._on_ready, new.iid)
        self._record_gpus()

    def _on_drain_timeout(self, iid: int) -> None:
        inst = self._by_id[iid]
        inst.drain_handle = None
        if inst.state != InstanceState.DRAINING:
            return
        if isinstance(inst, PrefillInstance):
            batch = inst.evict_all()
            self._remove(inst)
            self._pq.push_front(batch)
        else:
            assert isinstance(inst, EngineInstance)
            evicted = inst.evict_all()
            self._remove(inst)
            for r in evicted:
                if r.generated == 0:
                    self._route_new(r)
                else:
                    self._to_engine(r)
        self._dispatch_all()

    def on_instance_drained(self, inst: Instance) -> None:
        """An instance reports that it drained (see :class:`~fulcrum.simulator.instances.InstanceHost`)."""
        if inst.state == InstanceState.DRAINING:
            self._remove(inst)

    def _record_gpus(self) -> None:
        prov = 0
        ready = 0
        for role in _ROLES:
            for inst in self._pools[role]:
                prov += inst.tp
                if inst.state in (InstanceState.READY, InstanceState.DRAINING):
                    ready += inst.tp
        t = self._kernel.now
        tl = self._timeline
        if tl and tl[-1][0] == t:
            tl[-1] = (t, prov, ready)
            if len(tl) > 1 and tl[-2][1:] == (prov, ready):
                tl.pop()
        elif not tl or tl[-1][1:] != (prov, ready):
            tl.append((t, prov, ready))

    def _gpu_seconds(self, end: float) -> float:
        tl = self._timeline
        total = 0.0
        for (t0, g, _), (t1, _, _) in zip(tl, tl[1:]):
            total += g * (min(t1, end) - min(t0, end))
        t_last, g_last, _ = tl[-1]
        if end > t_last:
            total += g_last * (end - t_last)
        return total

    # ---- helpers: routing --------------------------------------------------------------------------------

    def _on_arrival(self, i: int) -> None:
        r = self._reqs[i]
        t = self._kernel.now
        self._metrics.arrive(t)
        if i + 1 < len(self._reqs):
            self._kernel.schedule(self._reqs[i + 1].arrival, Priority.ARRIVAL, self._on_arrival, i + 1)
        self._route_new(r)

    def _route_new(self, r: SimRequest) -> None:
        """Send a request that has no token yet down its path (see the module docstring)."""
        routing = self._target.routing
        if self._unified_mode:
            r.path = "unified"
            dest = self._least_loaded(self._pools["unified"])
            if dest is None:
                self._unified_pending.append(r)
            else:
                dest.offer(r)
        elif r.isl <= routing.ultra_short_tokens:
            r.path = "local"
            self._to_engine(r)
        else:
            r.path = "disaggregated"
            self._pq.push(r, self._kernel.now, routing)
            self._pump_prefill()

    @staticmethod
    def _least_loaded(pool: list[Instance]) -> EngineInstance | None:
        best: EngineInstance | None = None
        for inst in pool:
            if inst.state == InstanceState.READY and (best is None or inst.load < best.load):
                assert isinstance(inst, EngineInstance)
                best = inst
        return best

    def _decode_candidates(self) -> list[Instance]:
        for role in ("decode", "unified"):
            pool = [i for i in self._pools[role] if i.state == InstanceState.READY]
            if pool:
                return pool
        return []

    def _choose_decode(self, need: int) -> EngineInstance | None:
        """Least-loaded decode-capable instance with room for ``need`` more KV tokens, else least-loaded."""
        now = self._kernel.now
        best_room: EngineInstance | None = None
        best_any: EngineInstance | None = None
        for inst in self._decode_candidates():
            assert isinstance(inst, EngineInstance)
            if best_any is None or inst.load < best_any.load:
                best_any = inst
            if (best_room is None or inst.load < best_room.load) and inst.projected_tokens(now) + need <= inst.capacity:
                best_room = inst
        return best_room or best_any

    def _to_engine(self, r: SimRequest) -> None:
        """Give ``r`` (no KV anywhere: local, or evicted) to a decode-capable instance to prefill there."""
        dest = self._choose_decode(r.isl + r.generated)
        if dest is None:
            self._engine_pending.append(r)
        else:
            dest.offer(r)

    def _pump_prefill(self) -> None:
        pq = self._pq
        if not pq:
            return
        routing = self._target.routing
        now = self._kernel.now
        for inst in self._pools["prefill"]:
            if inst.state != InstanceState.READY:
                continue
            assert isinstance(inst, PrefillInstance)
            if not inst.idle:
                continue
            batch, wake = pq.take(now, routing)
            if batch is None:
                if wake is not None and (self._timer_at is None or wake < self._timer_at or self._timer_at < now):
                    self._timer_at = wake
                    self._kernel.schedule(wake, Priority.TIMER, self._on_timer)
                return
            inst.start(batch)
            if not pq:
                return

    def _on_timer(self, _: int) -> None:
        if self._timer_at is not None and self._timer_at <= self._kernel.now:
            self._timer_at = None
        self._pump_prefill()

    def on_prefill_done(self, inst: PrefillInstance, batch: list[SimRequest]) -> None:
        """A P instance finished ``batch`` (see :class:`~fulcrum.simulator.instances.InstanceHost`)."""
        t = self._kernel.now
        for r in batch:
            r.generated = 1
            self.on_first_token(r, t)
            if r.osl <= 1:
                self.on_finish(r, t)
            else:
                self._send_kv(r)
        if inst.state == InstanceState.DRAINING:
            self._remove(inst)
        else:
            self._pump_prefill()

    def _send_kv(self, r: SimRequest) -> None:
        dest = self._choose_decode(r.isl + r.generated)
        if dest is None:
            self._kv_pending.append(r)
            return
        dest.incoming += 1
        dest.incoming_tokens += r.isl + r.generated
        r.dest = dest
        delay = self._profile.kv_transfer_seconds(r.isl, self._cfg.kv_link_gbps) + self._cfg.kv_transfer_overhead_s
        self._kernel.schedule(self._kernel.now + delay, Priority.KV_ARRIVAL, self._on_kv_arrival, r.idx)

    def _on_kv_arrival(self, idx: int) -> None:
        r = self._reqs[idx]
        dest = r.dest
        assert dest is not None
        r.dest = None
        dest.incoming -= 1
        dest.incoming_tokens -= r.isl + r.generated
        if dest.state == InstanceState.REMOVED:
            self._send_kv(r)  # its destination was removed meanwhile: send the KV elsewhere
            return
        r.kv_ready = True
        dest.offer(r)

    def _dispatch_all(self) -> None:
        """Hand queued work to instances that can take it (after a readiness, un-drain or removal)."""
        self._pump_prefill()
        if self._kv_pending and self._decode_candidates():
            pending = list(self._kv_pending)
            self._kv_pending.clear()
            for r in pending:
                self._send_kv(r)
        if self._engine_pending and self._decode_candidates():
            pending = list(self._engine_pending)
            self._engine_pending.clear()
            for r in pending:
                self._to_engine(r)
        if self._unified_pending and self._unified_mode:
            while self._unified_pending:
                dest = self._least_loaded(self._pools["unified"])
                if dest is None:
                    break
                dest.offer(self._unified_pending.popleft())

    # ---- decode rescheduling (ARES) ----------------------------------------------------------------------

    def _on_reschedule(self, _: int) -> None:
        now = self._kernel.now
        engines: list[EngineInstance] = []
        for role in ("decode", "unified"):
            for inst in self._pools[role]:
                if isinstance(inst, EngineInstance) and inst.state in (InstanceState.READY, InstanceState.DRAINING):
                    engines.append(inst)
        views: list[DecodeInstanceView] = []
        loads: list[int] = []
        for inst in engines:
            dec = inst.decoding(now)
            loads.append(sum(r.isl + g for r, g in dec))
            views.append(DecodeInstanceView(
                iid=inst.iid, accepting=inst.state == InstanceState.READY, kv_capacity_tokens=inst.capacity,
                step_time_s=inst.step_time(now),
                requests=tuple(DecodeRequestView(r.idx, r.isl, g, r.osl) for r, g in dec if not r.migrating),
            ))
        self._load_samples.append((now, tuple(loads)))
        if self._role_balancer is not None:
            for iid, role in self._role_balancer(now, self._role_views(now)):
                self.reassign(iid, role)
        if self._rescheduler is not None and len(engines) > 1:
            by_id = {inst.iid: inst for inst in engines}
            for idx, iid in self._rescheduler(now, views):
                dest = by_id.get(iid)
                r = self._reqs[idx]
                src = next((e for e in engines if e.running.get(idx) is r), None)
                if dest is None or dest.state != InstanceState.READY or src is None or src is dest:
                    continue
                if src.request_migration(r):
                    self._mig_target[idx] = dest
        if self._done < len(self._reqs):
            self._kernel.schedule(now + self._cfg.reschedule_interval_s, Priority.TIMER, self._on_reschedule)

    def _role_views(self, now: float) -> list[RoleView]:
        window = now - self._last_tick
        self._last_tick = now
        oldest = self._pq.oldest_enqueued()
        queue_p = min((now - oldest) / (self._slo.ttft_ms / 1000.0), 1.0) if oldest is not None else 0.0
        tpot_slo = self._slo.tpot_ms / 1000.0
        views: list[RoleView] = []
        for inst in self._pools["prefill"]:
            if inst.state != InstanceState.READY:
                continue
            assert isinstance(inst, PrefillInstance)
            busy = inst.busy_seconds(now)
            prev = self._busy_at_tick.get(inst.iid)
            self._busy_at_tick[inst.iid] = busy
            span = window if prev is not None else now - inst.ready_at
            compute = min((busy - (prev or 0.0)) / span, 1.0) if span > 0 else 0.0
            views.append(RoleView(inst.iid, "prefill", inst.tp, compute, queue_p))
        for inst in self._pools["decode"]:
            if inst.state != InstanceState.READY:
                continue
            assert isinstance(inst, EngineInstance)
            compute = min(inst.step_time(now) / tpot_slo, 1.0) if inst.n_dec else 0.0
            memory = min(inst.projected_tokens(now) / inst.capacity, 1.0) if inst.capacity > 0 else 1.0
            views.append(RoleView(inst.iid, "decode", inst.tp, compute, memory))
        return views

    def reassign(self, iid: int, role: str) -> bool:
        """Move a ready P or D instance to the other duty without a restart (DESIGN principle 2: ``kv_both``
        instances; BanaServe's adaptive reallocation). It takes no new work of its old duty at once; a decode
        instance hands its running requests to the other decode instances (the decode-rescheduling handoff);
        once it holds nothing it takes the new duty, with no start-up delay. Returns False when ``iid`` is not
        a ready P/D instance, ``role`` is its current one, or the profile has no table for its TP in ``role``.
        """
        inst = self._by_id.get(iid)
        if inst is None or inst.state != InstanceState.READY or role not in ("prefill", "decode") or inst.role == role:
            return False
        if inst.role not in ("prefill", "decode"):
            return False
        tables = self._profile.prefill if role == "prefill" else self._profile.decode
        if inst.tp not in tables:
            return False
        if role == "decode" and sum(1 for i in self._pools["prefill"] if i.state == InstanceState.READY) < 2:
            return False  # the last prefill instance stays
        if role == "prefill" and sum(1 for i in self._pools["decode"] if i.state == InstanceState.READY) < 2:
            return False  # the last decode instance stays
        self._reassign[iid] = role
        self._role_changes += 1
        now = self._kernel.now
        if isinstance(inst, EngineInstance):
            decoding = inst.decoding(now)
            self._drain(inst)
            for r, _ in decoding:
                inst.request_migration(r)  # the target is chosen when it leaves (least-loaded decode instance)
        else:
            self._drain(inst)
        return True

    def on_migrate_out(self, r: SimRequest, inst: EngineInstance, t: float) -> None:
        """``r`` left ``inst`` for a migration: move its KV (``isl + generated`` tokens) to the chosen target
        (another decode instance if that one is gone), where it rejoins with its KV ready."""
        dest = self._mig_target.pop(r.idx, None)
        if dest is None or dest.state != InstanceState.READY:
            dest = self._choose_decode(r.isl + r.generated)
        if dest is None:
            self._engine_pending.append(r)  # nowhere to go: it will be recomputed where it lands
            return
        tokens = r.isl + r.generated
        dest.incoming += 1
        dest.incoming_tokens += tokens
        r.dest = dest
        delay = self._profile.kv_transfer_seconds(tokens, self._cfg.kv_link_gbps) + self._cfg.kv_transfer_overhead_s
        self._migrations += 1
        self._migrated_tokens += tokens
        self._migration_s += delay
        self._kernel.schedule(t + delay, Priority.KV_ARRIVAL, self._on_kv_arrival, r.idx)

    # ---- helpers: measurements ---------------------------------------------------------------------------

    def on_first_token(self, r: SimRequest, t: float) -> None:
        """Record ``r``'s first token at ``t`` seconds."""
        r.first_token = t
        self._metrics.first_token(t, t - r.arrival)

    def on_finish(self, r: SimRequest, t: float) -> None:
        """Record ``r``'s completion at ``t`` seconds."""
        r.finish = t
        tpot = (t - r.first_token) / (r.osl - 1) if r.osl > 1 else 0.0
        self._metrics.finish(t, r.first_token - r.arrival, tpot)
        self._done += 1

    def _record(self, r: SimRequest) -> RequestRecord:
        ttft = r.first_token - r.arrival if not math.isnan(r.first_token) else math.inf
        queue = r.prefill_start - r.arrival if not math.isnan(r.prefill_start) else math.inf
        if math.isnan(r.finish):
            return RequestRecord(r.arrival, r.isl, r.osl, ttft, math.inf, math.inf, r.path, queue, r.prefill_iid)
        tpot = (r.finish - r.first_token) / (r.osl - 1) if r.osl > 1 else 0.0
        return RequestRecord(r.arrival, r.isl, r.osl, ttft, tpot, r.finish, r.path, queue, r.prefill_iid, r.decode_iid)

    def _snapshot(self) -> ClusterSnapshot:
        now = self._kernel.now
        prefill_q = len(self._pq) + len(self._unified_pending)
        decode_q = len(self._kv_pending)
        for r in self._engine_pending:
            if r.generated == 0:
                prefill_q += 1
            else:
                decode_q += 1
        utils: list[float] = []
        ready = {role: 0 for role in _ROLES}
        for role in _ROLES:
            for inst in self._pools[role]:
                if inst.state == InstanceState.READY:
                    ready[role] += 1
                if isinstance(inst, EngineInstance) and inst.state in (InstanceState.READY, InstanceState.DRAINING):
                    fresh, started = inst.waiting_counts()
                    prefill_q += fresh
                    decode_q += started
                    utils.append(min(inst.kv_used(now) / inst.capacity, 1.0) if inst.capacity > 0 else 1.0)
        return ClusterSnapshot(
            prefill_queue=prefill_q,
            decode_queue=decode_q,
            kv_utilisation=float(np.mean(utils)) if utils else 0.0,
            ready=ReadyCounts(prefill=ready["prefill"], decode=ready["decode"], unified=ready["unified"]),
        )
