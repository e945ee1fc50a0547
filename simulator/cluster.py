"""The simulated cluster: pools of instances, routed by the router's own policies, scaling with start-up and drain.

:class:`Simulation` is what ``fulcrum replay`` drives in place of Kubernetes: ``apply`` a
:class:`~fulcrum.target.ClusterTarget`, ``run_until`` the next planner tick, ``observe`` the last interval,
and ``finish`` for the per-request records. Instances are modelled in :mod:`fulcrum.simulator.instances`.

Routing: the simulator routes every request through the router's own policy (a :class:`~fulcrum.routing.base.Policy`
of :mod:`fulcrum.routing`, built from the plan's :class:`~fulcrum.target.RoutingParams` by the ``policy`` factory;
default :func:`default_policy`, the LLMServe default ``disaggregated``). At arrival it builds one
:class:`~fulcrum.routing.base.InstanceView` per serving instance with the router's accounting (requests in flight,
prompt tokens sent and not prefilled, KV held or on its way), asks ``policy.route``, calls ``on_start``, and runs
the decision; ``on_finish`` comes at the last token. The output length the policy sees is the router's online
estimate (:class:`~fulcrum.routing.length_predictor.BucketedQuantilePredictor`), never the trace's. A decision runs as
the router runs it:

- **colocated** on a decode instance (path "local", e.g. DOPD's ultra-short prompts, §II-C/§V-E) or a unified
  instance (path "unified"): the engine prefills it in chunks beside its decoding requests and decodes it.
- **disaggregated** (path "disaggregated"): instance A prefills; on a prefill instance the prompt first passes the
  policy's DOPD Alg. 1 gate (:attr:`~fulcrum.routing.base.PolicyCapabilities.prefill_batcher`: one
  :class:`~fulcrum.routing.batcher.PrefillBatcher` per prefill instance, released at once when the instance has no
  prefill in flight, as the router's :class:`~fulcrum.router.prefill_gate.PrefillGate`), then waits in the
  instance's queue, which runs batches first come first served up to ``max_prefill_batch_tokens``. The first token
  comes out at the end of the batch (TTFT = queueing + prefill). The KV (``isl`` tokens) then moves to B, taking
  ``kv_transfer_seconds(tokens, kv_link_gbps) + kv_transfer_overhead_s``; the transfer does not block A (NIXL
  pulls) and links are not shared (no contention). B queues it for KV room and a batch slot.
- **split** (path "split", Libra §4.1 micro-requests): past the prompt (``handoff_after = k > 0``), engine A
  prefills and decodes k tokens, then hands its KV (``isl + k``) to B, which decodes the rest; inside the prompt
  (``split_token = s < isl``, only with ``SimConfig.partial_prefix``), A prefills the first s tokens, the KV of
  those moves to B, and B prefills the rest as a continuation and decodes.

A decision's B that no longer accepts work when the KV is ready (drained, removed) is replaced by the policy's
choice among the decode-capable instances; requests the policy finds no instance for (no decode-capable instance
ready: the router's 503) wait at the router and are routed again when an instance becomes ready.

Scaling (:meth:`Simulation.apply`):

- scale-out provisions instances at once (GPUs counted from then) that become ready after ``pod_startup_s``;
  before starting a new instance the pool un-drains a draining one of the same TP (the busiest first);
- scale-in picks the least-loaded instances (not-yet-ready ones first among equals, then the newest): a
  starting instance is cancelled at once; a ready one stops getting new work, finishes its in-flight requests
  (drain) and is removed when empty, or at ``drain_timeout_s``, when its remaining requests are re-dispatched
  (KV lost: prompts are routed again, decoding requests are recomputed elsewhere) — no request is lost;
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from fulcrum.api.llmserve import SLOSpec
from fulcrum.errors import ProfileError
from fulcrum.observation import Observation, ReadyCounts
from fulcrum.ratio.profile import PerformanceProfile
from fulcrum.routing.base import InstanceView, NoInstanceError, Policy, RequestInfo, RouteDecision
from fulcrum.routing.batcher import PrefillBatch, PrefillBatcher
from fulcrum.routing.length_predictor import BucketedQuantilePredictor
from fulcrum.routing.registry import PlanPolicyFactory, policy_params
from fulcrum.simulator.instances import EngineInstance, Instance, InstanceState, PrefillInstance, SimRequest
from fulcrum.simulator.kernel import Kernel, Priority
from fulcrum.simulator.metrics import ClusterSnapshot, MetricsRecorder, summarize
from fulcrum.simulator.records import (
    REJECTED,
    DecodeInstanceView,
    DecodeRequestView,
    InstanceStatus,
    RequestRecord,
    RoleView,
    exceeds_context,
    output_within_context,
)
from fulcrum.target import ClusterTarget, Pool, PoolSize, RoutingParams
from fulcrum.workload import Request

__all__ = ["SimConfig", "SimResult", "Simulation", "Rescheduler", "RoleBalancer", "DutyBalancer", "PolicyFactory",
           "default_policy", "next_policy", "policy_config", "serving_unified"]

Rescheduler = Callable[[float, Sequence[DecodeInstanceView]], Sequence[tuple[int, int]]]
"""A decode rescheduler: (now s, decode instances) → migrations as (request idx, target instance iid). The
pure planner is ``fulcrum.rebalancing.decode_rescheduling.plan_migration`` (ARES Alg. 1); the caller adapts it
(the simulator sits below the planners' callers in the layers)."""
RoleBalancer = Callable[[float, Sequence[RoleView]], Sequence[tuple[int, str]]]
"""A role balancer: (now s, ready P and D instances) → role changes as (instance iid, "prefill" | "decode").
The pure planner is ``fulcrum.rebalancing.role_reassignment.plan_role_change`` (BanaServe Alg. 1 with a
role flip); ``fulcrum.replay.roles`` adapts it. The simulator's own: it flips whole P and D instances, which
the live router never does (compare :class:`DutyBalancer`)."""


class DutyBalancer(Protocol):
    """The live router's role reassignment (router config ``roles``): a duty for each instance of a unified pool,
    shown to the routing policy as the instance's role, and re-evaluated every ``reschedule_interval_s``. The
    book and its rule are ``fulcrum.rebalancing.duties.DutyBook`` (BanaServe Alg. 1 with a role flip);
    ``fulcrum.replay.roles.SimulatedDuties`` adapts it (the simulator sits below the planners' callers)."""

    def apply(self, views: Sequence[InstanceView]) -> list[InstanceView]:
        """``views`` with each ``both`` instance's role replaced by its duty."""
        ...

    migrate_on_flip: bool
    """The router config's ``roles.migrate_on_flip``: an instance that takes prefill duty hands its running
    decodes to decode-capable instances (with a ``rescheduler``; otherwise they finish there)."""

    def step(self, now: float, views: Sequence[InstanceView], oldest_wait_s: Mapping[str, float],
             target: ClusterTarget) -> tuple[str, str] | None:
        """One period at ``now`` seconds over the registered ``views`` (``both`` roles as registered), with each
        instance's oldest prompt not yet prefilled (seconds waited) and the applied ``target`` (whose plan bounds
        the duties): the flip made as (instance id, new duty), or None."""
        ...

PolicyFactory = Callable[[RoutingParams], Policy]
"""Builds the routing policy from the plan's routing parameters (as the operator writes the router's config:
:func:`fulcrum.routing.registry.policy_params` then :func:`~fulcrum.routing.registry.make_policy`). A factory
with a ``config(routing)`` method (:class:`~fulcrum.routing.registry.PlanPolicyFactory`) says what the router's
config holds of the policy; the simulation then changes the policy only when that changes, as the router does,
and then reconfigures it in place where the factory has a ``rebuild`` (the policy keeps its prefix index and
tie-breakers). Without ``config``, any change of the routing parameters builds a new policy."""


def policy_config(factory: PolicyFactory, routing: RoutingParams) -> Any:
    """What the router's config holds of the policy ``factory`` builds under ``routing`` (its ``config``), or
    ``routing`` itself for a factory without one: the simulation rebuilds the policy when this changes."""
    config = getattr(factory, "config", None)
    return config(routing) if callable(config) else routing

def next_policy(factory: PolicyFactory, policy: Policy, routing: RoutingParams) -> Policy:
    """The policy after the router's config section changed to ``routing``'s: reconfigured in place where the
    factory can (its ``rebuild``, :meth:`~fulcrum.routing.registry.PlanPolicyFactory.rebuild`), else new."""
    rebuild = getattr(factory, "rebuild", None)
    return rebuild(policy, routing) if callable(rebuild) else factory(routing)


_ROLES = tuple(p.value for p in Pool)


default_policy = PlanPolicyFactory(
    "disaggregated", lambda routing: policy_params("disaggregated", routing, disaggregated=True, kv_block_tokens=16))
"""The LLMServe default, ``disaggregated`` (DOPD §V-B/§V-E), with the plan's parameters and vLLM's 16-token
KV blocks."""


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
        partial_prefix: the simulated KV connector moves a partial prompt prefix (every instance reports
            ``supports_partial_prefix``): the split policy may cut a request inside its prompt (Libra §4.1,
            s < P: A prefills the head, B loads it and prefills the rest). The router's equivalent is its
            config's ``kv_connector.partial_prefix`` (vLLM with NIXL ``bidirectional_kv_xfer``).
        max_model_len: the model's context, tokens, as the engines and the router enforce it: a prompt of
            ``max_model_len`` tokens or more is rejected at admission, as the router answers it (HTTP 400
            ``context_length_exceeded``; path ``"rejected"``, never served, a miss of both SLOs in the scores,
            not an arrival in the planner's observations); a request's output stops at the context's end,
            ``max_model_len − isl`` tokens (vLLM's default ``max_tokens``), which is also the output cap the
            policy sees (what the router assumes when a client sends no ``max_tokens``).
        migration: how a decode migration (the rescheduler's, or a unified instance leaving decode duty) moves
            a running request: ``"kv"`` — its KV crosses the link (ARES §5.2; ``kv_link_gbps``, counted in
            ``migration_seconds``); ``"recompute"`` — the live router's way (vLLM's NIXL connector cannot hand
            over a running request's KV): the target prefills the prompt and the tokens generated so far, as
            a request preempted by recompute does (its cost lands in the target's steps, not in
            ``migration_seconds``).
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
    partial_prefix: bool = True
    max_model_len: int = 8192
    migration: Literal["kv", "recompute"] = "kv"

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
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_span_steps is not None and self.max_span_steps < 1:
            raise ValueError(f"max_span_steps must be >= 1, got {self.max_span_steps}")
        if self.migration not in ("kv", "recompute"):
            raise ValueError(f"migration must be 'kv' or 'recompute', got {self.migration!r}")


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
        migrated_tokens: context tokens (prompt + generated) those migrations moved (``migration="kv"``: × the
            profile's ``kv_bytes_per_token`` = bytes) or had recomputed (``"recompute"``).
        migration_seconds: Σ KV transfer time of the migrations, seconds (each pauses its request that long).
        role_changes: instances moved between prefill and decode duty by the role balancer, and unified instances
            whose duty the router's role reassignment (``duties``) flipped.
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
        role_balancer: asked for role changes of whole P/D instances at the same ticks (None: fixed roles).
        duties: the router's role reassignment of unified instances (:class:`DutyBalancer`), asked at the same
            ticks; a unified instance taking prefill duty hands its running decodes to decode-capable instances
            when the duties say ``migrate_on_flip`` and there is a ``rescheduler``, as the router does. None: no
            duties. Needs ``config.reschedule_interval_s > 0``.
        on_finished: called with each request's (ISL, OSL), tokens, when it finishes (e.g. a remaining-length
            predictor learning online, as the router's rescheduler does); None: nothing.
        policy: builds the routing policy (:mod:`fulcrum.routing`) from the plan's routing parameters, at the
            start and whenever an applied target changes what the router's config holds of the policy
            (:func:`policy_config`: the operator rewrites the router's config, and the router builds a new
            policy only when its policy section changed); None: :func:`default_policy`.

    Raises:
        ValueError: a malformed request, or ``duties`` without a tick (``reschedule_interval_s <= 0``).
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
        policy: PolicyFactory | None = None,
        on_finished: Callable[[int, int], None] | None = None,
        duties: DutyBalancer | None = None,
    ) -> None:
        if duties is not None and not config.reschedule_interval_s > 0:
            raise ValueError("duties are re-evaluated every reschedule_interval_s: it must be > 0, got "
                             f"{config.reschedule_interval_s!r}")
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
        reqs: list[SimRequest] = []
        for k, i in enumerate(order):
            q = requests[i]
            if not (math.isfinite(q.arrival_s) and q.arrival_s >= 0):
                raise ValueError(f"request {i}: arrival_s must be a finite number >= 0, got {q.arrival_s!r}")
            if q.isl < 1 or q.osl < 1:
                raise ValueError(f"request {i}: isl and osl must be >= 1, got isl={q.isl}, osl={q.osl}")
            rejected = exceeds_context(int(q.isl), config.max_model_len)
            out = int(q.osl) if rejected else output_within_context(int(q.isl), int(q.osl), config.max_model_len)
            reqs.append(SimRequest(k, float(q.arrival_s), int(q.isl), out))
            if rejected:
                reqs[-1].path = REJECTED
        self._reqs = reqs
        self._profile = profile
        self._slo = slo
        self._cfg = config
        self._max_batch = config.max_decode_batch or profile.cuda_graph_max_batch
        self._kernel = Kernel()
        admitted = [r for r in reqs if r.path != REJECTED]  # what the router's metrics see
        arr = np.fromiter((r.arrival for r in admitted), dtype=float, count=len(admitted))
        isl = np.fromiter((r.isl for r in admitted), dtype=float, count=len(admitted))
        osl = np.fromiter((r.osl for r in admitted), dtype=float, count=len(admitted))
        self._metrics = MetricsRecorder(arr, isl, osl, slo)
        self._pools: dict[str, list[Instance]] = {role: [] for role in _ROLES}
        self._by_id: dict[int, Instance] = {}
        self._next_id = 0
        self._unrouted: deque[SimRequest] = deque()  # no instance could take them: waiting at the router
        self._kv_pending: deque[SimRequest] = deque()  # prefilled, KV waiting for a decode-capable instance
        self._engine_pending: deque[SimRequest] = deque()  # evicted mid-decode, waiting for a decode-capable one
        self._make_policy = policy if policy is not None else default_policy
        self._policy: Policy = self._make_policy(initial.routing)
        self._lengths = BucketedQuantilePredictor()
        self._gates: dict[int, PrefillBatcher[RequestInfo]] = {}  # prefill instance → its DOPD Alg. 1 group
        self._gate_timers: dict[int, int] = {}  # prefill instance → kernel handle of its group's timeout
        self._done = 0
        self._result: SimResult | None = None
        self._timeline: list[tuple[float, int, int]] = []
        self._target = initial
        self._policy_config = policy_config(self._make_policy, initial.routing)  # the router config's policy
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
        self._duties = duties
        self._on_finished = on_finished
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
        config = policy_config(self._make_policy, target.routing)
        if config != self._policy_config:  # the operator rewrote the router's policy section
            self._policy_config = config
            grouping = self._policy.capabilities
            self._policy = next_policy(self._make_policy, self._policy, target.routing)
            if self._policy.capabilities is not grouping:  # a new policy, or new DOPD Alg. 1 grouping
                for inst in self._pools["prefill"]:
                    self._flush_gate(inst)  # the router closes its old gate, releasing every waiting prompt
        for inst in self._pools["prefill"]:
            assert isinstance(inst, PrefillInstance)
            inst.batch_tokens = target.routing.max_prefill_batch_tokens
        if self._unified_mode and not was_unified:
            for inst in self._pools["prefill"]:  # prompts not started yet take the new path
                assert isinstance(inst, PrefillInstance)
                self._flush_gate(inst)
                for r in inst.take_queue():
                    self._dispatch_new(r)
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
            inst.batch_tokens = self._target.routing.max_prefill_batch_tokens
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
        self._flush_gate(inst)  # its waiting group goes now: the instance takes no new prompts
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
            for r in batch:
                self._dispatch_new(r)
        else:
            assert isinstance(inst, EngineInstance)
            evicted = inst.evict_all()
            self._remove(inst)
            for r in evicted:
                if r.generated == 0:
                    self._dispatch_new(r)
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
        if i + 1 < len(self._reqs):
            self._kernel.schedule(self._reqs[i + 1].arrival, Priority.ARRIVAL, self._on_arrival, i + 1)
        if r.path == REJECTED:  # its prompt does not fit the context: answered 400, done
            self._done += 1
            return
        self._metrics.arrive(t)
        self._dispatch_new(r)

    def _dispatch_new(self, r: SimRequest) -> None:
        """Ask the policy where a request with no KV anywhere runs (at arrival, or again after an eviction or a
        mode switch), tell it the decision started, and send the request there; with no instance to take it,
        it waits at the router (``_unrouted``) until one becomes ready."""
        r.planned, r.handoff_at, r.prefill_stop, r.kv_prefix = -1, 0, r.isl, 0
        now = self._kernel.now
        info = self._request_info(r)
        if r.routed:
            self._policy.on_finish(info.request_id, now)  # a re-dispatch: the old decision is over
        try:
            d = self._policy.route(info, self._views(), now)
        except NoInstanceError:
            r.enq = now
            self._unrouted.append(r)
            return
        self._policy.on_start(info, d, now)
        r.routed = True
        self._execute(r, d)

    def _request_info(self, r: SimRequest) -> RequestInfo:
        """What the policy knows of ``r`` at admission, as the router builds it: the prompt length, the client's
        cap (the model's context left, ``SimConfig.max_model_len − isl``) and the output-length predictor's
        estimate (:class:`~fulcrum.routing.length_predictor.BucketedQuantilePredictor`, fed the output lengths
        of finished requests, as the router feeds it)."""
        cap = max(self._cfg.max_model_len - r.isl, 1)
        return RequestInfo(request_id=str(r.idx), prompt_tokens=r.isl, max_tokens=cap,
                           predicted_output_tokens=self._lengths.predict(r.isl, cap))

    def _views(self, engines_only: bool = False) -> list[InstanceView]:
        """What the routing policy gets: :meth:`_registered`, with each unified instance's duty as its role when
        the router reassigns roles (``duties``)."""
        views = self._registered(engines_only)
        return self._duties.apply(views) if self._duties is not None else views

    def _registered(self, engines_only: bool = False) -> list[InstanceView]:
        """The router's view of the serving instances (ready or draining; starting ones are not registered yet),
        in creation order: in Unified mode the unified pool; in Disaggregated mode the prefill and decode pools,
        and the unified pool while no decode instance is ready (a mode switch under way). ``engines_only``
        leaves the prefill instances out (a request that must land on a decode-capable instance).

        The accounting is the router's (:class:`~fulcrum.routing.base.InstanceView`): ``inflight`` counts the
        requests sent and not finished (queued, running, or in KV transfer towards it), ``queued_prefill_tokens``
        the prompt tokens sent and not prefilled yet, ``running_tokens`` the KV held or on its way; the engines'
        scraped utilisations are unknown (NaN), so policies fall back on that accounting as the router does
        before its first scrape.
        """
        roles: tuple[str, ...]
        if self._unified_mode:
            roles = ("unified",)
        elif any(i.state == InstanceState.READY for i in self._pools["decode"]):
            roles = ("prefill", "decode")
        else:
            roles = ("prefill", "decode", "unified")
        if engines_only:
            roles = tuple(x for x in roles if x != "prefill")
        now = self._kernel.now
        routing = self._target.routing
        partial = self._cfg.partial_prefix
        views: list[InstanceView] = []
        for role in roles:
            for inst in self._pools[role]:
                if inst.state not in (InstanceState.READY, InstanceState.DRAINING):
                    continue
                draining = inst.state == InstanceState.DRAINING
                if isinstance(inst, PrefillInstance):
                    gate = self._gates.get(inst.iid)
                    views.append(InstanceView(
                        id=str(inst.iid), role="prefill", tp=inst.tp, draining=draining,
                        inflight=inst.load + (gate.pending if gate is not None else 0),
                        queued_prefill_tokens=inst.queued_tokens + (gate.pending_tokens if gate is not None else 0),
                        max_num_batched_tokens=routing.max_prefill_batch_tokens, max_num_seqs=self._max_batch,
                        supports_partial_prefix=partial,
                    ))
                    continue
                assert isinstance(inst, EngineInstance)
                queued = sum(r.pf_total - r.pf_done for r in inst.prefilling)
                held = inst.incoming_tokens
                for r in inst.waiting:
                    if r.kv_ready:
                        held += r.isl + r.generated
                    else:
                        queued += (r.prefill_stop if r.partial else r.isl + r.generated) - r.kv_prefix
                views.append(InstanceView(
                    id=str(inst.iid), role="both" if inst.role == "unified" else "decode", tp=inst.tp,
                    draining=draining, inflight=inst.load, queued_prefill_tokens=queued,
                    running_tokens=int(inst.kv_used(now)) + held, kv_capacity_tokens=int(inst.capacity),
                    max_num_batched_tokens=self._cfg.prefill_chunk_tokens, max_num_seqs=self._max_batch,
                    supports_partial_prefix=partial,
                ))
        return views

    def _execute(self, r: SimRequest, d: RouteDecision) -> None:
        """Run decision ``d`` for ``r``: colocated on its instance, or A's part (prefill, or prefill and
        ``handoff_after`` tokens, or the prompt head up to ``split_token``) then a KV handoff to B."""
        first = self._by_id[int(d.first)]
        second = self._by_id[int(d.second)] if d.second is not None else None
        if d.kind == "colocated" or second is None:
            if not isinstance(first, EngineInstance):
                raise ValueError(f"routing policy {self._policy.name!r} colocated a request on prefill instance {d.first}")
            r.path = "unified" if first.role == "unified" else "local"
            first.offer(r)
            return
        r.path = d.kind
        r.planned = second.iid
        r.handoff_at = d.handoff_after + 1  # A's tokens: the first one, then k more (the router's max_tokens = k + 1)
        if 0 < d.split_token < r.isl:
            r.prefill_stop = d.split_token
        if isinstance(first, PrefillInstance):
            r.handoff_at = 1  # a prefill instance produces the first token only
            self._to_prefill(first, r)
        else:
            assert isinstance(first, EngineInstance)
            first.offer(r)

    def _pick_engine(self, r: SimRequest) -> EngineInstance | None:
        """The decode-capable instance the policy chooses for ``r`` among decode-capable instances only (its KV
        must move to one, or it is recomputed on one): the decision's second instance, else its only one; None
        when none is available."""
        views = self._views(engines_only=True)
        try:
            d = self._policy.route(self._request_info(r), views, self._kernel.now)
        except NoInstanceError:
            return None
        inst = self._by_id[int(d.second if d.second is not None else d.first)]
        assert isinstance(inst, EngineInstance)
        return inst

    def _to_engine(self, r: SimRequest, dest: EngineInstance | None = None) -> None:
        """Give ``r`` (evicted or migrated with tokens generated, its KV lost) to ``dest`` to recompute, or to the
        decode-capable instance the policy picks."""
        r.planned, r.handoff_at, r.prefill_stop, r.kv_prefix = -1, 0, r.isl, 0
        if dest is None:
            dest = self._pick_engine(r)
        if dest is None:
            self._engine_pending.append(r)
        else:
            dest.offer(r)

    # ---- helpers: prefill instances and the DOPD Alg. 1 gate --------------------------------------------------

    def _to_prefill(self, inst: PrefillInstance, r: SimRequest) -> None:
        """Send ``r``'s prefill leg to ``inst`` through the policy's DOPD Alg. 1 gate, as the router's
        :class:`~fulcrum.router.prefill_gate.PrefillGate` does: none when the policy groups no prefills; else
        the prompt joins ``inst``'s :class:`~fulcrum.routing.batcher.PrefillBatcher` and goes with its group, at
        once when ``inst`` has no prefill in flight (Alg. 1's empty queue)."""
        now = self._kernel.now
        r.enq = now
        make = self._policy.capabilities.prefill_batcher
        if make is None:
            inst.offer(r)
            return
        gate = self._gates.get(inst.iid)
        if gate is None:
            gate = self._gates[inst.iid] = make()
        idle = inst.queued_tokens == 0
        released = gate.add(self._gate_item(r), now)
        if idle:
            released += gate.flush(now)
        self._release(inst, released)
        self._arm_gate(inst.iid)

    def _gate_item(self, r: SimRequest) -> RequestInfo:
        """``r`` as the gate holds it: the batcher reads only the prompt length it prefills there."""
        return RequestInfo(request_id=str(r.idx), prompt_tokens=r.prefill_stop, max_tokens=1, predicted_output_tokens=1)

    def _release(self, inst: PrefillInstance, batches: list[PrefillBatch[RequestInfo]]) -> None:
        for batch in batches:
            inst.offer(*(self._reqs[int(item.request_id)] for item in batch.items))

    def _arm_gate(self, iid: int) -> None:
        """(Re)schedule the timeout of ``iid``'s open group, or none when no group is open."""
        handle = self._gate_timers.pop(iid, None)
        if handle is not None:
            self._kernel.cancel(handle)
        gate = self._gates.get(iid)
        deadline = gate.next_deadline() if gate is not None else None
        if deadline is not None:
            self._gate_timers[iid] = self._kernel.schedule(max(deadline, self._kernel.now), Priority.TIMER,
                                                           self._on_gate_timer, iid)

    def _on_gate_timer(self, iid: int) -> None:
        self._gate_timers.pop(iid, None)
        gate = self._gates.get(iid)
        inst = self._by_id[iid]
        if gate is None or not isinstance(inst, PrefillInstance):
            return
        self._release(inst, gate.poll(self._kernel.now))
        self._arm_gate(iid)

    def _flush_gate(self, inst: Instance) -> None:
        """Release ``inst``'s open group now (it drains, or the policy changed)."""
        gate = self._gates.pop(inst.iid, None)
        handle = self._gate_timers.pop(inst.iid, None)
        if handle is not None:
            self._kernel.cancel(handle)
        if gate is not None and isinstance(inst, PrefillInstance):
            self._release(inst, gate.flush(self._kernel.now))

    def on_prefill_done(self, inst: PrefillInstance, batch: list[SimRequest]) -> None:
        """A P instance finished ``batch`` (see :class:`~fulcrum.simulator.instances.InstanceHost`): each
        member gets its first token and its KV moves to its decode instance (the head of a split inside the
        prompt moves without a token)."""
        t = self._kernel.now
        for r in batch:
            if r.partial:
                self._send_kv(r)
                continue
            r.generated = 1
            self.on_first_token(r, t)
            if r.osl <= 1:
                self.on_finish(r, t)
            else:
                self._send_kv(r)
        if inst.state == InstanceState.DRAINING and inst.is_empty():
            self._remove(inst)

    def on_handoff(self, r: SimRequest, inst: EngineInstance, t: float) -> None:
        """``r`` finished its part on engine ``inst`` (see :class:`~fulcrum.simulator.instances.InstanceHost`):
        its KV moves to its planned instance."""
        self._send_kv(r)

    def _send_kv(self, r: SimRequest) -> None:
        """Move ``r``'s KV (the prompt head of a split inside the prompt, else ``isl + generated − 1`` tokens) to the
        decision's second instance, or, when that one no longer accepts work, to the one the policy picks."""
        planned = self._by_id.get(r.planned) if r.planned >= 0 else None
        partial = r.partial or (r.generated == 0 and r.kv_prefix > 0)  # a prompt head, maybe sent again
        if partial:
            r.kv_prefix = r.prefill_stop
        tokens = r.prefill_stop if partial else r.isl + r.generated  # the context it holds there
        kv = r.prefill_stop if partial else r.isl + r.generated - 1  # the last token's KV is not computed yet
        r.planned, r.handoff_at, r.prefill_stop = -1, 0, r.isl
        dest = planned if isinstance(planned, EngineInstance) and planned.accepting else self._pick_engine(r)
        if dest is None:
            self._kv_pending.append(r)
            return
        dest.incoming += 1
        dest.incoming_tokens += tokens
        r.dest = dest
        r.kv_ready = not partial
        delay = self._profile.kv_transfer_seconds(kv, self._cfg.kv_link_gbps) + self._cfg.kv_transfer_overhead_s
        self._kernel.schedule(self._kernel.now + delay, Priority.KV_ARRIVAL, self._on_kv_arrival, r.idx)

    def _on_kv_arrival(self, idx: int) -> None:
        r = self._reqs[idx]
        dest = r.dest
        assert dest is not None
        r.dest = None
        dest.incoming -= 1
        dest.incoming_tokens -= r.kv_prefix if not r.kv_ready else r.isl + r.generated
        if dest.state == InstanceState.REMOVED:
            self._send_kv(r)  # its destination was removed meanwhile: send the KV elsewhere
            return
        dest.offer(r)

    def _dispatch_all(self) -> None:
        """Hand waiting work to instances that can take it (after a readiness, un-drain or removal)."""
        if self._kv_pending and self._views(engines_only=True):
            pending = list(self._kv_pending)
            self._kv_pending.clear()
            for r in pending:
                self._send_kv(r)
        if self._engine_pending and self._views(engines_only=True):
            pending = list(self._engine_pending)
            self._engine_pending.clear()
            for r in pending:
                self._to_engine(r)
        if self._unrouted and self._views():
            pending = list(self._unrouted)
            self._unrouted.clear()
            for r in pending:
                self._dispatch_new(r)

    # ---- decode rescheduling (ARES) ----------------------------------------------------------------------

    def _on_reschedule(self, _: int) -> None:
        now = self._kernel.now
        prefill_duty: set[str] = set()
        if self._duties is not None:
            registered = self._registered()
            self._step_duties(now, registered)
            # as the router's rescheduler: decode-capable instances only, so not a unified instance on prefill duty
            prefill_duty = {v.id for v in self._duties.apply(registered) if v.role == "prefill"}
        engines: list[EngineInstance] = []
        for role in ("decode", "unified"):
            for inst in self._pools[role]:
                if (isinstance(inst, EngineInstance) and inst.state in (InstanceState.READY, InstanceState.DRAINING)
                        and str(inst.iid) not in prefill_duty):
                    engines.append(inst)
        views: list[DecodeInstanceView] = []
        loads: list[int] = []
        for inst in engines:
            dec = inst.decoding(now)
            loads.append(sum(r.isl + g for r, g in dec))
            # a decode resuming here (moved by recompute, or preempted) is this instance's load already, as the
            # router tracks a migrated request on its target from the moment it is sent there
            resuming = [(r, r.generated) for r in (*inst.prefilling, *inst.waiting) if r.generated > 0]
            views.append(DecodeInstanceView(
                iid=inst.iid, accepting=inst.state == InstanceState.READY, kv_capacity_tokens=inst.capacity,
                step_time_s=inst.step_time(now),
                requests=tuple(DecodeRequestView(r.idx, r.isl, g, r.osl) for r, g in (*dec, *resuming)
                               if not r.migrating),
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

    def _step_duties(self, now: float, registered: list[InstanceView]) -> None:
        """One period of the router's role reassignment (:class:`DutyBalancer`) over the ``registered`` views. An
        instance's oldest prompt not yet prefilled is timed from its arrival (the router routes on arrival; this
        misses only the wait of a request that sat at the router with no instance). A unified instance that takes
        prefill duty keeps its running decodes, or, with ``migrate_on_flip`` and a rescheduler, hands them to
        decode-capable instances."""
        waits: dict[str, float] = {}
        for inst in self._pools["unified"]:
            if isinstance(inst, EngineInstance):
                pending = [r.arrival for r in inst.prefilling]
                pending += [r.arrival for r in inst.waiting if not r.kv_ready]
                if pending:
                    waits[str(inst.iid)] = now - min(pending)
        assert self._duties is not None
        flip = self._duties.step(now, registered, waits, self._target)
        if flip is None:
            return
        self._role_changes += 1
        iid, duty = flip
        engine = self._by_id.get(int(iid))
        if (duty == "prefill" and self._duties.migrate_on_flip and self._rescheduler is not None
                and isinstance(engine, EngineInstance)):
            for r, _ in engine.decoding(now):
                engine.request_migration(r)  # the target is chosen when it leaves (a decode-capable instance)

    def _oldest_prefill_wait(self) -> float | None:
        """When the longest-waiting prompt not yet prefilling entered a prefill instance's queue or gate, s."""
        times = [r.enq for r in self._unrouted]
        for inst in self._pools["prefill"]:
            assert isinstance(inst, PrefillInstance)
            if inst.queue:
                times.append(inst.queue[0].enq)
            gate = self._gates.get(inst.iid)
            deadline = gate.next_deadline() if gate is not None else None
            if gate is not None and deadline is not None:
                times.append(deadline - gate.batch_timeout_s)
        return min(times) if times else None

    def _role_views(self, now: float) -> list[RoleView]:
        window = now - self._last_tick
        self._last_tick = now
        oldest = self._oldest_prefill_wait()
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
        """``r`` left ``inst`` for a migration to the chosen target (another decode-capable instance if that one is
        gone): its KV (``isl + generated`` tokens) moves there and it rejoins with its KV ready, or, with
        ``SimConfig.migration == "recompute"``, the target prefills those tokens again."""
        dest = self._mig_target.pop(r.idx, None)
        if dest is None or dest.state != InstanceState.READY:
            dest = self._pick_engine(r)
        if dest is None:
            self._engine_pending.append(r)  # nowhere to go: it will be recomputed where it lands
            return
        tokens = r.isl + r.generated
        self._migrations += 1
        self._migrated_tokens += tokens
        if self._cfg.migration == "recompute":  # the router's way: the target prefills prompt + generated tokens
            self._to_engine(r, dest)
            return
        dest.incoming += 1
        dest.incoming_tokens += tokens
        r.dest = dest
        r.kv_ready = True
        delay = self._profile.kv_transfer_seconds(tokens, self._cfg.kv_link_gbps) + self._cfg.kv_transfer_overhead_s
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
        self._lengths.observe(r.isl, r.osl)
        self._policy.on_finish(str(r.idx), t)
        if self._on_finished is not None:
            self._on_finished(r.isl, r.osl)

    def _record(self, r: SimRequest) -> RequestRecord:
        ttft = r.first_token - r.arrival if not math.isnan(r.first_token) else math.inf
        queue = r.prefill_start - r.arrival if not math.isnan(r.prefill_start) else math.inf
        if math.isnan(r.finish):
            return RequestRecord(r.arrival, r.isl, r.osl, ttft, math.inf, math.inf, r.path, queue, r.prefill_iid)
        tpot = (r.finish - r.first_token) / (r.osl - 1) if r.osl > 1 else 0.0
        return RequestRecord(r.arrival, r.isl, r.osl, ttft, tpot, r.finish, r.path, queue, r.prefill_iid, r.decode_iid)

    def _snapshot(self) -> ClusterSnapshot:
        now = self._kernel.now
        prefill_q = len(self._unrouted)
        for inst in self._pools["prefill"]:
            assert isinstance(inst, PrefillInstance)
            gate = self._gates.get(inst.iid)
            prefill_q += len(inst.queue) + (gate.pending if gate is not None else 0)
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
