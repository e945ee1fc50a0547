"""The P/D plan: instance counts, TP and split-policy parameters for a forecast workload.

Disaggregated mode follows DOPD Alg. 2 (lines 10–14) and §IV-B–C, made robust for production:

1. D-instance TP and concurrency cc_d from memory, bandwidth, the CUDA-graph cap and the profiled TPOT
   (eqs. 11–14, :mod:`fulcrum.ratio.capacity`, :mod:`fulcrum.ratio.tp`).
2. Ultra-short prompts (DOPD §II-C, §V-E) are prefilled locally on D-instances: those whose marginal prefill
   time κ1·x + κ2·x² (the fixed cost τ is shared with the decode step) is below the KV transfer time it
   saves, and small enough to keep the decode step within the TPOT SLO.
3. P-instance TP by eq. (16) plus memory; prefill service time from the *distribution* of ISL (eqs. 6–8), not
   its mean; P count = the fewest instances whose TTFT at the SLO percentile (queueing by eqs. 10, 17 in
   G/G/c form, plus the prompt's own prefill and KV transfer) meets the TTFT SLO (:mod:`fulcrum.ratio.queueing`).
4. D count = decode concurrency demand λ·E[OSL]·t_d (Little's law) over cc_d at a target utilisation.
5. The balanced ratio of eq. (15), n_p/n_d = cc_d·t_p/(t_d·OSL), is reported beside the planned integer ratio.
6. Integer counts under min/max GPUs: over budget, both pools shrink in proportion to their need; under the
   minimum, instances are added where utilisation is highest.
7. Split-policy parameters for the router (DOPD Alg. 1): the long-request threshold i_next (forecast mean ISL)
   and the batching timeout by eq. (18).

Unified mode sizes one pool of ``kv_both`` instances doing chunked prefill and decode (Libra/DynaServe §3):
per instance, the largest arrival rate whose decode step stretched by the prefill work still meets the TPOT
SLO and whose prefill at the percentile still meets the TTFT SLO. Auto picks the mode with fewer GPUs.

Both modes first check that the SLOs can be met at all at the forecast lengths (:mod:`fulcrum.ratio.feasibility`:
TPOT at batch 1, TTFT of the percentile prompt on an idle instance). A target out of reach is reported on the plan
(``slo_infeasible``, also ``inputs["slo_infeasible"]``) and the plan is sized for the best achievable value plus
``PlannerSettings.infeasible_slo_slack`` instead of buying instances up to ``maxGPUs`` for a target no count meets.

Every :class:`Plan` carries the numbers it came from (``inputs``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import special

from fulcrum.api.llmserve import DEFAULT_MAX_NUM_SEQS, LLMServeSpec, Mode, SLOSpec
from fulcrum.errors import PlanningError
from fulcrum.ratio.capacity import DecodeCapacity, decode_capacity, kv_context_moments, kv_instances_needed
from fulcrum.ratio.feasibility import SLOInfeasible, relaxed_slo, slo_feasibility
from fulcrum.ratio.lengths import LengthDistribution
from fulcrum.ratio.profile import PerformanceProfile
from fulcrum.ratio.queueing import batching_timeout, mean_wait, min_servers_for_ttft, wait_quantile
from fulcrum.ratio.step_cost import StepCost
from fulcrum.ratio.tp import check_fixed_tp, choose_decode_tp, choose_prefill_tp, fits_max_model_len
from fulcrum.target import ClusterTarget, Pool, PoolSize, RoutingParams

__all__ = [
    "NO_GPU_BOUND",
    "PlannerSettings",
    "WorkloadEstimate",
    "Plan",
    "unified_tpot_miss",
    "fit_budget",
    "initial_in_budget",
    "RatioPlan",
    "plan",
    "plan_modes",
    "plan_disaggregated",
    "plan_unified",
    "plan_ratio",
    "ultra_short_threshold",
]


NO_GPU_BOUND = 1 << 30
"""The ``max_gpus`` of a plan with no GPU budget (a count no plan reaches; :func:`plan_disaggregated`,
:func:`plan_unified`, ``fulcrum plan`` without ``--max-gpus``)."""


@dataclass(frozen=True)
class PlannerSettings:
    """Tunables of the planner, each with the reason for its default.

    Attributes:
        bandwidth_utilisation: α of eq. (12); DOPD: "α = 0.6 is considered excellent".
        graph_headroom: usable share of the CUDA-graph cap, eq. (14); DOPD suggests 0.9 for bursts.
        prefill_target_utilisation: highest planned ρ of the prefill pool (queueing explodes as ρ → 1, eq. 10).
        decode_target_utilisation: highest planned share of cc_d in use, headroom for bursts within an interval.
        kv_link_gbps: KV transfer bandwidth between instances, GB/s (NIXL over RDMA; 25 GB/s = 200 Gb/s NIC).
        kv_transfer_overhead_s: fixed cost of one KV transfer; DOPD §II-C measures 15–80 ms with NIXL.
        batching_alpha: α of eq. (18), the share of the expected wait a short prompt may spend being grouped.
        max_model_len: longest context, tokens (the engines' ``--max-model-len``, ``spec.engine.maxModelLen``):
            every planned instance, P, D or unified, must hold one sequence of this length in its KV cache,
            V_mem/M_token of DOPD eq. (11) (:meth:`~fulcrum.ratio.profile.PerformanceProfile.kv_capacity_tokens`),
            or vLLM refuses to start; TPs that do not are never planned (:mod:`fulcrum.ratio.tp`).
        max_tp: largest TP considered (GPUs per node).
        kv_occupancy_quantile: level of the KV-cache demand a decode (or unified) pool must hold
            (:func:`fulcrum.ratio.capacity.kv_instances_needed`; eq. (13) alone sizes for the mean). An overflow
            preempts and recomputes requests, which slows every step, so the level sits above the SLO percentile:
            0.95 is the lowest of 0.9/0.95/0.99 whose plans met a P90 SLO at every steady Poisson rate of
            ``benchmarks/bench_plan_calibration.py`` (0.9 planned one decode instance at 5 req/s of the synthetic
            trace's lengths on the Splitwise profile, and those pools reached 60%; 0.99 added a second decode
            instance already at 4.5 req/s, where one reaches 99%).
        infeasible_slo_slack: a target the profile cannot meet at any count is planned as best · (1 + slack):
            0.1 lies within a profile's run-to-run noise, and since a memory-bound decode step of a few tens of
            requests costs little more than one request's (DOPD Table I), D-instances still batch instead of
            holding one request each (which would scale to ``maxGPUs`` and still miss the target).
        tp_switch_gain: a Unified plan leaves the TP its pool already runs (``current_tp``) only for a TP that
            serves at least this much more per GPU: a TP change replaces the whole pool (new instances start,
            the old ones drain), and two TPs within a few percent of each other swapped with the lengths every
            few minutes on the Azure code trace (seven pool replacements in the first 37 minutes, issue 13);
            with 0.15 the same replay kept TP2 throughout.
        max_num_seqs: the engines' ``--max-num-seqs``, a bound on the requests one decode or unified instance
            runs at once (cc_d); None = none (eq. 14's CUDA-graph cap alone). 256, the worker's default, as
            :meth:`from_spec` gives for an unset ``spec.engine.maxNumSeqs`` (so ``fulcrum plan`` without an LLMServe
            plans as the operator does); above every bundled profile's 0.9 × 256 graph cap, so their plans do not
            change, while a measured profile's default cap of 512 meets it.
    """

    bandwidth_utilisation: float = 0.6
    graph_headroom: float = 0.9
    prefill_target_utilisation: float = 0.9
    decode_target_utilisation: float = 0.9
    kv_link_gbps: float = 25.0
    kv_transfer_overhead_s: float = 0.015
    batching_alpha: float = 0.5
    max_model_len: int = 8192
    max_tp: int = 8
    kv_occupancy_quantile: float = 0.95
    infeasible_slo_slack: float = 0.1
    tp_switch_gain: float = 0.15
    max_num_seqs: int | None = DEFAULT_MAX_NUM_SEQS

    @classmethod
    def from_spec(cls, spec: LLMServeSpec) -> "PlannerSettings":
        """Settings implied by an ``LLMServe`` spec (max model length, GPUs per node, the engines' max-num-seqs)."""
        seqs = spec.engine.max_num_seqs if spec.engine.max_num_seqs is not None else DEFAULT_MAX_NUM_SEQS
        return cls(max_model_len=spec.engine.max_model_len, max_tp=spec.gpu.gpus_per_node, max_num_seqs=seqs)


@dataclass(frozen=True)
class WorkloadEstimate:
    """The load a plan is made for (a forecast or an observation).

    Attributes:
        rate_rps: arrival rate λ, requests/s (≥ 0).
        isl: prompt length distribution, tokens.
        osl: output length distribution, tokens.
        arrival_cv2: squared coefficient of variation of inter-arrival times c_a² (1 = Poisson).
    """

    rate_rps: float
    isl: LengthDistribution
    osl: LengthDistribution
    arrival_cv2: float = 1.0

    @classmethod
    def from_means(cls, rate_rps: float, mean_isl: float, mean_osl: float, arrival_cv2: float = 1.0) -> "WorkloadEstimate":
        """A workload known only by its means (DOPD Alg. 2's view)."""
        return cls(rate_rps, LengthDistribution.point(mean_isl), LengthDistribution.point(mean_osl), arrival_cv2)


@dataclass(frozen=True)
class Plan:
    """One planning decision: what to run, and the numbers behind it.

    Attributes:
        mode: "Disaggregated" or "Unified".
        prefill / decode / unified: pool sizes (replicas, TP).
        routing: split-policy parameters for the router.
        ratio: planned n_p / n_d (integers); NaN in Unified mode or with no D-instances.
        balanced_ratio: eq. (15) n_p/n_d = cc_d·t_p/(t_d·OSL) (continuous); NaN in Unified mode.
        decode_concurrency: cc_d per D-instance (or per unified instance), requests.
        t_p_s: mean prefill time per remote request E[T_prefill] (eqs. 6, 16), seconds.
        t_d_s: decode step time at the planned batch, seconds (the expected TPOT).
        expected_ttft_s: TTFT at the SLO percentile the plan expects (queue + prefill + transfer), seconds.
        gpus: GPUs the plan uses.
        feasible: False when the budget or the hardware cannot meet the SLOs for this load.
        notes: why a plan is infeasible or was adjusted, one line each.
        need: the continuous instance need per pool of the mode (e.g. 2.4 instances) before rounding and the
            budget, for the scaling policy's N/(N−1) scale-in check; pools left out are needed as planned.
        inputs: every number the plan came from, for status, events and reports.
        slo_infeasible: the SLO targets no instance count meets at these lengths (TTFT first), each with the
            best value the profile achieves; the plan is sized for those best values (module doc). Empty when
            both targets can be met. Also in ``inputs["slo_infeasible"]``.
    """

    mode: str
    prefill: PoolSize
    decode: PoolSize
    unified: PoolSize
    routing: RoutingParams
    ratio: float
    balanced_ratio: float
    decode_concurrency: int
    t_p_s: float
    t_d_s: float
    expected_ttft_s: float
    gpus: int
    feasible: bool = True
    notes: tuple[str, ...] = ()
    need: dict[Pool, float] = field(default_factory=dict)
    inputs: dict[str, Any] = field(default_factory=dict)
    slo_infeasible: tuple[SLOInfeasible, ...] = ()

    def target(self) -> ClusterTarget:
        """The cluster target this plan asks for."""
        return ClusterTarget(prefill=self.prefill, decode=self.decode, unified=self.unified, routing=self.routing)


@dataclass(frozen=True)
class RatioPlan:
    """The static P/D ratio for fixed lengths (``fulcrum plan`` with a concurrency; DOPD §IV-B, Alg. 2 l.10–14).

    Attributes:
        ratio: n_p/n_d by eq. (15).
        prefill_replicas: ⌈ratio · n_d⌉.
        decode_replicas: n_d = ⌈concurrency / cc_d⌉ (1 when the D capacity is given).
        decode_concurrency: cc_d used, requests per D-instance.
        t_p_s: prefill time of one ISL-token prompt at TP_p, seconds.
        t_d_s: decode step time at batch cc_d and context ISL + OSL/2 at TP_d, seconds.
        capacity: the eq. (11)–(14) breakdown for TP_d.
    """

    ratio: float
    prefill_replicas: int
    decode_replicas: int
    decode_concurrency: int
    t_p_s: float
    t_d_s: float
    tp_prefill: int
    tp_decode: int
    capacity: DecodeCapacity


def _q(slo: SLOSpec) -> float:
    return min(max(slo.percentile / 100.0, 0.5), 0.999)


def ultra_short_threshold(
    profile: PerformanceProfile, tp_prefill: int, tp_decode: int, t_d: float, tpot_slo_s: float, settings: PlannerSettings
) -> int:
    """Largest prompt (tokens) worth prefilling locally on a D-instance instead of remotely (DOPD §II-C, §V-E).

    Local prefill adds its marginal compute κ1·x + κ2·x² (the profile's eq.-5 fit at TP_d if measured, else at
    TP_p scaled by TP_p/TP_d: :meth:`fulcrum.ratio.step_cost.StepCost.prefill_fit_marginal_s`) to one decode step; remote prefill adds the KV transfer (overhead + bytes/bandwidth)
    to the request's TTFT. The threshold is the largest x where the local cost is no larger than the transfer
    and the stretched decode step still meets the TPOT SLO. 0 when no prompt qualifies.
    """
    cost = StepCost.from_profile(
        profile, tp_decode, prefill_tp=tp_decode if tp_decode in profile.prefill else tp_prefill,
        scale_borrowed_prefill=True,
    )

    def ok(x: int) -> bool:
        marginal = cost.prefill_fit_marginal_s(x)
        transfer = settings.kv_transfer_overhead_s + profile.kv_transfer_seconds(x, settings.kv_link_gbps)
        return marginal <= transfer and t_d + marginal <= tpot_slo_s

    if not ok(1):
        return 0
    lo, hi = 1, 1 << 20
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _remote_part(isl: LengthDistribution, threshold: int) -> tuple[float, LengthDistribution]:
    """Share of requests longer than ``threshold`` and their length distribution."""
    pts = [(x, w) for x, w in zip(isl.points, isl.weights) if x > threshold]
    share = sum(w for _, w in pts)
    if share <= 0:
        return 0.0, isl
    return share, LengthDistribution(tuple(x for x, _ in pts), tuple(w / share for _, w in pts))


def fit_budget(needs: dict[str, float], tps: dict[str, int], counts: dict[str, int], min_gpus: int, max_gpus: int) -> tuple[dict[str, int], list[str]]:
    """Integer instance counts per pool fitted to the GPU budget [``min_gpus``, ``max_gpus``] (DOPD Alg. 2's
    integer counts under the ``LLMServe``'s scaling.minGPUs/maxGPUs).

    Args:
        needs: the continuous instance need of each pool (instances; the split of a cut or a top-up follows it).
        tps: each pool's TP (GPUs per instance).
        counts: the counts before the budget (instances); a pool at 0 stays at 0.
        min_gpus / max_gpus: the budget, GPUs.

    Returns:
        The fitted counts and notes saying what the budget changed (e.g. that the cut counts cannot hold the need).
        Over ``max_gpus`` the counts shrink in proportion to need × TP, keeping one instance of each pool; under
        ``min_gpus`` instances are added where utilisation would be highest. Arithmetic, not one instance per
        step, so a budget of millions of GPUs costs what a small one does.
    """
    notes: list[str] = []
    gpus = sum(counts[k] * tps[k] for k in counts)
    if gpus > max_gpus:
        total_need = sum(needs[k] * tps[k] for k in counts) or 1.0
        share = {k: needs[k] * tps[k] / total_need for k in counts}
        new = {k: max(int(math.floor(max_gpus * share[k] / tps[k])), 1 if counts[k] > 0 else 0) for k in counts}
        while sum(new[k] * tps[k] for k in new) > max_gpus and any(new[k] > 1 for k in new):
            k = max((k for k in new if new[k] > 1), key=lambda k: new[k] / max(needs[k], 1e-9))
            new[k] -= 1
        # use what the floors left over, where utilisation would be highest
        _greedy_fast_forward(new, needs, tps, [k for k in new if counts[k] > 0],
                             max_gpus - sum(new[k] * tps[k] for k in new) - max(tps[k] for k in new), ties=0.0)
        while True:
            room = max_gpus - sum(new[k] * tps[k] for k in new)
            cands = [k for k in new if counts[k] > 0 and tps[k] <= room]
            if not cands:
                break
            k = max(cands, key=lambda k: needs[k] / max(new[k], 1e-9))
            new[k] += 1
        if sum(new[k] * tps[k] for k in new) > max_gpus:  # one instance of each pool the load needs is over it
            notes.append(_smallest_over_budget(max_gpus, tps, [k for k in new if new[k] > 0],
                                               f"; {gpus} GPUs needed"))
        else:
            notes.append(f"GPU budget: {gpus} GPUs needed, capped at maxGPUs={max_gpus}")
        counts = new
    gpus = sum(counts[k] * tps[k] for k in counts)
    if gpus < min_gpus:
        # a fill gives every empty pool one instance first: the deployment can then serve at zero load (1 prefill
        # + 1 decode, not 3 prefill and no decode for minGPUs 3, TPs 1 and 2), also when minGPUs is below one of
        # each (1 or 2: prefill and no decode answers nothing); then by need, up to minGPUs
        for k in counts:
            if counts[k] == 0:
                counts[k] = 1
                gpus += tps[k]
        # the loop below adds one instance at a time; jump over all but its last few steps first (an arithmetic
        # that picks the same instances), so that a large minGPUs costs no more than a small one
        gpus += _greedy_fast_forward(counts, needs, tps, list(counts), min_gpus - gpus - 1, ties=-1.0)
        while gpus < min_gpus:
            k = max(counts, key=lambda k: (needs[k] / max(counts[k], 1e-9)) if needs[k] > 0 else -1.0)
            counts[k] += 1
            gpus += tps[k]
        if sum(tps.values()) > max_gpus:  # one instance of each pool is already over the budget
            notes.append(_smallest_over_budget(max_gpus, tps, list(counts)))
    return counts, notes



_POOL_NAMES = {"p": "prefill", "d": "decode", "u": "unified"}
"""The words for the pool keys of :func:`fit_budget` in notes."""


def initial_in_budget(wanted: dict[str, int], tps: dict[str, int], max_gpus: int) -> tuple[dict[str, int], str | None]:
    """The spec's initial counts cut to ``spec.scaling.maxGPUs`` the way :meth:`FulcrumPlanner.initial
    <fulcrum.scaling.fulcrum.FulcrumPlanner.initial>` cuts them: by the planner's own budget fit
    (:func:`fit_budget`, the counts standing for the need), in proportion to the counts, at least
    one instance of each pool that has any, what the floors leave over filled. Counts within ``max_gpus`` are kept
    as they are (below minGPUs too: a planner tops them up in its first interval; ``static`` never does).

    Args:
        wanted: instances per pool, keyed ``"p"`` (prefill), ``"d"`` (decode), ``"u"`` (unified); a pool at 0 stays 0.
        tps: each pool's TP (GPUs per instance), same keys.
        max_gpus: ``spec.scaling.maxGPUs``, GPUs.

    Returns:
        ``(counts, note)``: the counts to start with (same keys) and, when they were cut, one line saying so in the
        Fulcrum planner's words (``"initial pools cut to maxGPUs: prefill 6 → 4 (TP 1), ... (18 GPUs asked,
        maxGPUs=8)"``), else None. The caller logs the note. When one instance of each pool alone exceeds
        ``max_gpus`` the counts keep one of each (still over it) and the note says the budget cannot hold them.
    """
    gpus = sum(wanted[k] * tps[k] for k in wanted)
    if gpus <= max_gpus:
        return dict(wanted), None
    counts, notes = fit_budget({k: float(n) for k, n in wanted.items()}, tps, dict(wanted), 0, max_gpus)
    note = (
        "initial pools cut to maxGPUs: "
        + ", ".join(f"{_POOL_NAMES[k]} {wanted[k]} → {counts[k]} (TP {tps[k]})" for k in wanted)
        + f" ({gpus} GPUs asked, maxGPUs={max_gpus})" + "".join(f"; {n}" for n in notes if "cannot hold" in n)
    )
    return counts, note


def _greedy_fast_forward(counts: dict[str, int], needs: dict[str, float], tps: dict[str, int], pools: list[str],
                         room: int, ties: float) -> int:
    """Make at once a prefix of the picks of :func:`fit_budget`'s one-instance-at-a-time loops, in place, and
    return the GPUs it added (at most ``room``; nothing when ``room`` < 1).

    Those loops add one instance to the pool of ``pools`` with the largest ``needs[k] / counts[k]`` (the first such
    pool on a tie; a pool without need has the key ``ties``: -1.0 or 0.0, below any pool with a need) until the GPUs
    reach a bound. With a need in some pool (every count >= 1), the picks are D'Hondt's: all quotients
    ``needs[k] / c`` (c = counts[k], counts[k] + 1, ...) in decreasing order, so every quotient above a threshold
    ``t`` is a prefix of them; ``t`` is chosen from the continuous solution with a margin of two instances of each
    pool, and raised until the prefix fits ``room``. The caller passes as ``room`` a bound under which the loop
    would surely have made every pick of the prefix, and its loop then makes the last few picks itself. Without a
    need in any pool every key is ``ties`` and the loop adds to the first pool only.
    """
    if room < 1 or not pools:
        return 0
    wanted = [k for k in pools if needs[k] > 0]
    if not wanted:
        if any(needs[k] != 0 for k in pools) and ties == 0.0:  # negative needs: keys differ, leave it to the loop
            return 0
        first = pools[0]
        n = room // tps[first]
        counts[first] += n
        return n * tps[first]
    if any(counts[k] < 1 for k in wanted):
        return 0
    goal = room - 2 * sum(tps[k] for k in wanted)
    if goal <= 0:
        return 0
    t = sum(tps[k] * needs[k] for k in wanted) / (goal + sum(tps[k] * counts[k] for k in wanted))
    for _ in range(64):
        if not (t > 0 and math.isfinite(t)) or max(needs[k] / t for k in wanted) > 2.0**52:
            return 0
        add = {k: _quotients_above(needs[k], counts[k], t) for k in wanted}
        used = sum(add[k] * tps[k] for k in wanted)
        if used <= room:
            for k in wanted:
                counts[k] += add[k]
            return used
        t *= 2.0
    return 0


def _quotients_above(need: float, count: int, t: float) -> int:
    """How many of ``need / count``, ``need / (count + 1)``, ... (as floats, decreasing) are above ``t``."""
    m = max(int(need / t) - count, 0)
    while m > 0 and not need / (count + m - 1) > t:
        m -= 1
    while need / (count + m) > t:
        m += 1
    return m



def _smallest_over_budget(max_gpus: int, tps: dict[str, int], pools: list[str], tail: str = "") -> str:
    """The note for a ``maxGPUs`` below one instance of each of ``pools`` (at their TPs ``tps``)."""
    return (f"GPU budget: maxGPUs={max_gpus} cannot hold the smallest deployment ("
            + " + ".join(f"1 {_POOL_NAMES.get(k, k)} TP{tps[k]}" for k in pools)
            + f" = {sum(tps[k] for k in pools)} GPUs{tail})")


def plan_disaggregated(
    workload: WorkloadEstimate,
    profile: PerformanceProfile,
    slo: SLOSpec,
    *,
    min_gpus: int = 0,
    max_gpus: int = NO_GPU_BOUND,
    tp_prefill: int | None = None,
    tp_decode: int | None = None,
    settings: PlannerSettings = PlannerSettings(),
) -> Plan:
    """Plan P and D pools for ``workload`` (see module doc, steps 1–7).

    Raises:
        PlanningError: no TP of the profile holds the model, or a fixed TP is not in the profile, or no TP up to
            ``settings.max_tp`` holds one ``settings.max_model_len``-token sequence in its KV cache, or a fixed
            TP (``tp_prefill``/``tp_decode``, from ``spec.scaling.tpPrefill``/``tpDecode``) does not
            (:func:`fulcrum.ratio.tp.fits_max_model_len`, :func:`~fulcrum.ratio.tp.check_fixed_tp`).
    """
    q = _q(slo)
    mml = settings.max_model_len
    infeasible = slo_feasibility(  # judged at the TPs that can be planned: those that hold maxModelLen
        profile, slo, workload.isl, workload.osl,
        prefill_tps=[tp for tp in profile.prefill_tps if profile.kv_capacity_tokens(tp) >= mml],
        decode_tps=[tp for tp in profile.decode_tps if profile.kv_capacity_tokens(tp) >= mml],
        fixed_prefill=tp_prefill, fixed_decode=tp_decode, max_tp=settings.max_tp, kv_link_gbps=settings.kv_link_gbps,
        kv_transfer_overhead_s=settings.kv_transfer_overhead_s, slack=settings.infeasible_slo_slack,
    )
    slo = relaxed_slo(slo, infeasible)
    ttft_slo, tpot_slo = slo.ttft_ms / 1e3, slo.tpot_ms / 1e3
    lam = max(float(workload.rate_rps), 0.0) if math.isfinite(workload.rate_rps) else 0.0
    mean_isl, mean_osl = workload.isl.mean(), workload.osl.mean()
    cap = choose_decode_tp(
        profile, mean_isl, mean_osl, tpot_slo, fixed=tp_decode, max_tp=settings.max_tp,
        bandwidth_utilisation=settings.bandwidth_utilisation, graph_headroom=settings.graph_headroom,
        max_num_seqs=settings.max_num_seqs, max_model_len=settings.max_model_len,
    )
    tp_p = choose_prefill_tp(
        profile, workload.isl, ttft_slo, q, fixed=tp_prefill, max_tp=settings.max_tp, max_model_len=settings.max_model_len
    )
    notes: list[str] = [f.message() for f in infeasible]
    if cap.cc_slo < 1:
        notes.append(f"TPOT SLO {slo.tpot_ms} ms is below the profiled single-request step at TP={cap.tp}")
    u = ultra_short_threshold(profile, tp_p, cap.tp, cap.step_s, tpot_slo, settings)
    share_remote, remote_isl = _remote_part(workload.isl, u)
    lam_p = lam * share_remote
    es = remote_isl.expect(lambda x: profile.ttft(x, tp_p))
    es2 = remote_isl.expect(lambda x: profile.ttft(x, tp_p) ** 2)
    cs2 = max(es2 / (es * es) - 1.0, 0.0) if es > 0 else 0.0
    isl_q = remote_isl.quantile(q)
    s_q = profile.ttft(isl_q, tp_p)
    transfer_q = settings.kv_transfer_overhead_s + profile.kv_transfer_seconds(isl_q, settings.kv_link_gbps)
    ca2 = max(float(workload.arrival_cv2), 0.0) if math.isfinite(workload.arrival_cv2) else 1.0
    n_p_need = lam_p * es / settings.prefill_target_utilisation
    n_p = min_servers_for_ttft(
        lam_p, es, s_q + transfer_q, ca2, cs2, ttft_slo, q, target_utilisation=settings.prefill_target_utilisation
    )
    # decode: Little's law with the step time at the batch the pool will actually run; the KV caches must also
    # hold a high quantile of the in-flight contexts, not only their mean (capacity module doc)
    kv_m1, kv_m2 = kv_context_moments(workload.isl, workload.osl)
    kv_tokens = profile.kv_capacity_tokens(cap.tp)
    t_d = cap.step_s
    n_d_need = kv_need = 0.0
    for _ in range(3):
        demand = lam * mean_osl * t_d
        kv_need = kv_instances_needed(demand, kv_m1, kv_m2, kv_tokens, settings.kv_occupancy_quantile)
        n_d_need = max(demand / (cap.cc * settings.decode_target_utilisation), kv_need)
        n_d = max(math.ceil(n_d_need - 1e-9), 0)
        batch = demand / n_d if n_d else 0.0
        t_d = profile.tpot(max(batch, 1.0), cap.context_tokens, cap.tp)
    n_d = max(math.ceil(n_d_need - 1e-9), 0)
    if lam > 0:
        n_d = max(n_d, 1)
        n_p = max(n_p, 1) if lam_p > 0 else n_p
    counts, budget_notes = fit_budget(
        {"p": n_p_need, "d": n_d_need}, {"p": tp_p, "d": cap.tp}, {"p": n_p, "d": n_d}, min_gpus, max_gpus
    )
    notes += budget_notes
    n_p, n_d = counts["p"], counts["d"]
    wq_q = wait_quantile(lam_p, es, ca2, cs2, n_p, q) if n_p > 0 else (math.inf if lam_p > 0 else 0.0)
    wq_mean = mean_wait(lam_p, es, ca2, cs2, n_p) if n_p > 0 else (math.inf if lam_p > 0 else 0.0)
    expected_ttft = wq_q + s_q + transfer_q
    feasible = not budget_notes and expected_ttft <= ttft_slo and cap.cc_slo >= 1 and not infeasible
    if expected_ttft > ttft_slo:
        if math.isfinite(expected_ttft):
            notes.append(f"expected P{slo.percentile:g} TTFT {expected_ttft:.3f}s exceeds the {ttft_slo:.3f}s SLO")
        else:  # the prefill queue grows without bound (a budget cut the pool under the load)
            notes.append(f"expected P{slo.percentile:g} TTFT unbounded, against the {ttft_slo:.3f}s SLO: {n_p} prefill "
                         f"instance{'s' if n_p != 1 else ''} cannot keep up with {lam_p:.3g} req/s")
    balanced = cap.cc * es / (cap.step_s * mean_osl) if es > 0 else math.nan
    slack = ttft_slo - (wq_q + s_q + transfer_q)
    routing = RoutingParams(
        ultra_short_tokens=u,
        long_request_tokens=max(int(round(mean_isl)), 1),
        batch_timeout_s=batching_timeout(wq_mean, slack, settings.batching_alpha),
        length_aware_batching=True,
        max_prefill_batch_tokens=max(int(round(mean_isl)), settings.max_model_len),
    )
    inputs: dict[str, Any] = {
        "rate_rps": lam, "mean_isl": mean_isl, "mean_osl": mean_osl, "isl_q": isl_q, "percentile": slo.percentile,
        "arrival_cv2": ca2, "service_cv2": cs2, "remote_share": share_remote, "ultra_short_tokens": u,
        "tp_prefill": tp_p, "tp_decode": cap.tp, "cc_d": cap.cc, "cc_mem": cap.cc_mem, "cc_bw": cap.cc_bw,
        "cc_graph": cap.cc_graph, "cc_slo": cap.cc_slo, "cc_limited_by": cap.limited_by,
        "t_p_s": es, "t_p_q_s": s_q, "t_d_full_s": cap.step_s, "t_d_s": t_d, "kv_transfer_q_s": transfer_q,
        "prefill_need": n_p_need, "decode_need": n_d_need, "decode_kv_need": kv_need, "wait_q_s": wq_q, "wait_mean_s": wq_mean,
        "prefill_utilisation": lam_p * es / n_p if n_p else 0.0,
        "decode_utilisation": lam * mean_osl * t_d / (n_d * cap.cc) if n_d else 0.0,
        "slo_infeasible": infeasible,
    }
    return Plan(
        mode=Mode.DISAGGREGATED.value,
        prefill=PoolSize(n_p, tp_p),
        decode=PoolSize(n_d, cap.tp),
        unified=PoolSize(0, 1),
        routing=routing,
        ratio=n_p / n_d if n_d else math.nan,
        balanced_ratio=balanced,
        decode_concurrency=cap.cc,
        t_p_s=es,
        t_d_s=t_d,
        expected_ttft_s=expected_ttft,
        gpus=n_p * tp_p + n_d * cap.tp,
        feasible=feasible,
        notes=tuple(notes),
        need={Pool.PREFILL: n_p_need, Pool.DECODE: n_d_need},
        inputs=inputs,
        slo_infeasible=infeasible,
    )


IN_PROGRESS_POINTS = 4
"""Points per prompt length :func:`plan_unified` gives :func:`unified_tpot_miss` for the prompt already being
prefilled when a request's decode window opens (midpoints of its remaining share; 4 reach every point of
``benchmarks/bench_plan_calibration.py``, 2 and 3 leave the code trace's Unified plans at 87–90%)."""


def unified_tpot_miss(lam: float, t_d: float, step_s: float, prefill_s: float, osl: LengthDistribution,
                      tpot_slo: float, prefill_dist: tuple[Sequence[float], Sequence[float]] | None = None,
                      in_progress_points: int = 0) -> float:
    """Share of requests whose TPOT misses ``tpot_slo`` on a unified instance (chunked prefill mixed into decode).

    A request of OSL o decodes for o − 1 steps, a window of W = (o − 1)·``step_s`` seconds. Every prompt that
    arrives meanwhile (Poisson, rate ``lam``) adds its prefill time to those steps, so its TPOT is
    t_d + S/(o − 1), S the prefill time of the k ~ Poisson(λ·W) prompts; it misses when S > B = (SLO − t_d)·(o − 1).
    P = Σ_o w_o · P(S_o > B_o) over the OSL distribution (requests of one token have no TPOT). The mean of this
    TPOT is t_d/(1 − ρ_p), the mean-step model; what this adds is its tail, which short outputs behind long
    prompts dominate (Libra §3 on prefill–decode interference).

    With every prompt costing the mean ``prefill_s``, S = k·E[T] and P(S > B) is the Poisson tail
    P(k > ⌊B/E[T]⌋), exactly. With ``prefill_dist`` — the prefill time of each prompt-length point, seconds, and
    its probability (e.g. ``profile.ttft`` at the ISL distribution's points) — S is compound Poisson:
    P(S > B) = Σ_k P(k)·P(T_1 + … + T_k > B), exact for k = 1 and 2 (one or two long prompts are what a short
    answer misses behind), and for k ≥ 3 a gamma with the mean and variance of S given k ≥ 3 (E[k|k≥3]·E[T],
    E[k|k≥3]·Var[T] + Var[k|k≥3]·E[T]²): a handful of array operations, since the planner calls this inside a
    bisection on λ. On the Azure code trace's lengths (prompts up to 7.4k tokens, answers of 11 tokens at the
    median) the mean alone left unified plans at 37–80% attainment against a P90 SLO
    (``benchmarks/bench_plan_calibration.py``).

    With ``in_progress_points`` = K > 0, S also holds the rest of the prompt already being prefilled when the
    window opens: with probability ρ_p = λ·E[T] the instance is prefilling (the window starts at a random
    time of its prefill work); the prompt in progress is then length-biased (point i with probability
    ∝ p_i·T_i, a long prompt occupies the instance longer) and its remaining share uniform, here its K
    midpoints (j + ½)/K·T_i. P(S > B) is then the mixture of the tails above at the budgets B − R. Without it
    the Unified plans for the code trace's lengths still reached only 80–89% (a 7.4k-token prompt started just
    before a 2-token answer's window is not among the prompts arriving in it).

    Args:
        lam: arrival rate at the instance, requests/s.
        t_d: decode step time without prefill at the batch and context, seconds.
        step_s: mean decode step with the prefill share mixed in, seconds.
        prefill_s: mean prefill time of one prompt, seconds.
        osl: output-length distribution, tokens.
        tpot_slo: TPOT target, seconds.
        prefill_dist: (prefill times s, probabilities) of one prompt, or None for every prompt at ``prefill_s``.
        in_progress_points: K, points per prefill time for the prompt in progress (0: not counted).

    Returns:
        The probability of a TPOT miss, in [0, 1].
    """
    if t_d > tpot_slo:
        return 1.0
    if lam <= 0 or prefill_s <= 0:
        return 0.0
    n = np.maximum(np.asarray(osl.points, dtype=float) - 1.0, 0.0)
    w = np.asarray(osl.weights, dtype=float)
    has = n >= 1.0
    if not has.any():
        return 0.0
    n, w = n[has], w[has]
    budget = (tpot_slo - t_d) * n  # B_o, seconds of prefill the window can absorb
    m = lam * n * step_s  # E[k] per OSL point
    if prefill_dist is not None:
        times = np.asarray(prefill_dist[0], dtype=float)
        weights = np.asarray(prefill_dist[1], dtype=float)
        weights = weights / weights.sum()
    else:
        times, weights = np.array([prefill_s]), np.array([1.0])
    if in_progress_points > 0:
        mu = float(np.dot(weights, times))
        rho = min(lam * mu, 1.0)
        biased = weights * times / max(mu, 1e-300)  # the prompt in progress, length-biased
        k = int(in_progress_points)
        rest = np.concatenate(([0.0], (times[:, None] * ((np.arange(k) + 0.5) / k)[None, :]).ravel()))
        p_rest = np.concatenate(([1.0 - rho], np.repeat(rho * biased / k, k)))
        budget = (budget[None, :] - rest[:, None]).ravel()
        m = np.broadcast_to(m, (len(rest), len(m))).ravel()
        w = (p_rest[:, None] * w[None, :]).ravel()
    return float(np.clip(np.dot(w, _prefill_tail(budget, m, times, weights, prefill_s)), 0.0, 1.0))


def _prefill_tail(budget: np.ndarray, m: np.ndarray, times: np.ndarray, weights: np.ndarray, prefill_s: float
                  ) -> np.ndarray:
    """P(S > B) per element of ``budget`` (s; below 0 always a miss), S compound Poisson with E[k] = ``m`` over
    prefill times ``times`` with probabilities ``weights`` (see :func:`unified_tpot_miss`)."""
    mu = float(np.dot(weights, times))
    var = float(np.dot(weights, (times - mu) ** 2))
    if var <= 1e-12 * prefill_s**2:  # one prefill time: the exact Poisson tail P(Poisson(m) > ⌊B/T⌋)
        tail: np.ndarray = np.where(budget < 0.0, 1.0, special.pdtrc(np.floor(np.maximum(budget, 0.0) / prefill_s), m))
        return tail
    p0 = np.exp(-m)
    p1, p2 = p0 * m, p0 * m * m / 2.0
    p3 = np.maximum(1.0 - p0 - p1 - p2, 0.0)  # P(k ≥ 3)
    tail1 = (weights[:, None] * (times[:, None] > budget[None, :])).sum(axis=0)
    pair = (times[:, None] + times[None, :]).ravel()
    pw = (weights[:, None] * weights[None, :]).ravel()
    tail2 = (pw[:, None] * (pair[:, None] > budget[None, :])).sum(axis=0)
    # k ≥ 3: S given k ≥ 3 as one gamma with that conditional sum's mean and variance
    tail3 = np.zeros_like(m)
    some = p3 > 1e-12
    if some.any():
        ms, p1s, p2s, p3s = m[some], p1[some], p2[some], p3[some]
        ek = np.maximum(ms - p1s - 2.0 * p2s, 0.0) / p3s  # E[k | k ≥ 3]
        vk = np.maximum((ms + ms * ms - p1s - 4.0 * p2s) / p3s - ek * ek, 0.0)  # Var[k | k ≥ 3]
        s_mean = np.maximum(ek * mu, 1e-12)
        s_var = np.maximum(ek * var + vk * mu * mu, 1e-24)
        tail3[some] = special.gammaincc(s_mean * s_mean / s_var, np.maximum(budget[some], 0.0) * s_mean / s_var)
    miss: np.ndarray = p0 * (budget < 0.0) + p1 * tail1 + p2 * tail2 + p3 * tail3
    return miss


def _unified_step(profile: PerformanceProfile, tp: int, context: float, es: float, osl: float, lam: float
                  ) -> tuple[float, float] | None:
    """Mean decode step (s) and batch of a unified instance receiving ``lam`` requests/s: the fixed point of
    step = t_d(B, ctx)/(1 − ρ_p), B = λ·E[OSL]·step (Little), ρ_p = λ·E[T_prefill] (``es`` s); None when
    ρ_p ≥ 0.95 (prefill alone nearly saturates the instance)."""
    rho_p = lam * es
    if rho_p >= 0.95:
        return None
    b, step = 1.0, profile.tpot(1, context, tp)
    for _ in range(20):
        step = profile.tpot(max(b, 1.0), context, tp) / (1.0 - rho_p)
        b_new = lam * osl * step
        if abs(b_new - b) < 1e-3:
            return step, b_new
        b = b_new
    return step, b


def _unified_kv_need(profile: PerformanceProfile, tp: int, context: float, es: float, workload: WorkloadEstimate,
                     lam: float, n_rate: float, quantile: float) -> float:
    """Unified instances (continuous, ≥ ``n_rate``) whose KV caches hold the ``quantile`` of the in-flight
    contexts (:func:`fulcrum.ratio.capacity.kv_instances_needed`) when ``lam`` req/s is spread over them (``es``:
    mean prefill time, s): the batch, and with it the KV demand, shrinks as instances are added, so n = f(n) is
    solved by bisection."""
    if lam <= 0:
        return 0.0
    osl = workload.osl.mean()
    m1, m2 = kv_context_moments(workload.isl, workload.osl)
    capacity = profile.kv_capacity_tokens(tp)

    def f(n: float) -> float:
        mixed = _unified_step(profile, tp, context, es, osl, lam / n)
        if mixed is None:
            return math.inf
        return kv_instances_needed(lam * osl * mixed[0], m1, m2, capacity, quantile)

    lo = max(n_rate, 1e-6)
    if f(lo) <= lo:
        return n_rate
    hi = lo * 2.0
    while f(hi) > hi and hi < 1e6:
        lo, hi = hi, hi * 2.0
    for _ in range(30):
        mid = (lo + hi) / 2.0
        if f(mid) > mid:
            lo = mid
        else:
            hi = mid
    return hi


def _unified_rate_per_instance(
    profile: PerformanceProfile, tp: int, workload: WorkloadEstimate, cap: DecodeCapacity, slo: SLOSpec, q: float
) -> tuple[float, float]:
    """Largest arrival rate (req/s) one unified instance sustains within both SLOs, and its step time there.

    Per second the instance spends ρ_p = λ·E[T_prefill] on prefill chunks; decode steps stretch by 1/(1 − ρ_p):
    step = t_d(B, ctx)/(1 − ρ_p) with B = λ·E[OSL]·step (Little). The mean step must meet the TPOT SLO, and the
    share of requests whose own TPOT misses it (:func:`unified_tpot_miss`: the prompts prefilled during a short
    output's few steps) must stay within 1 − percentile. TTFT at the percentile ≈ T_prefill(ISL_q)/(1 − ρ_d)
    where ρ_d is the decode share of time. Bisection on λ.
    """
    ttft_slo, tpot_slo = slo.ttft_ms / 1e3, slo.tpot_ms / 1e3
    es = workload.isl.expect(lambda x: profile.ttft(x, tp))
    s_q = profile.ttft(workload.isl.quantile(q), tp)
    osl = workload.osl.mean()
    prefill_dist = ([profile.ttft(x, tp) for x in workload.isl.points], workload.isl.weights)

    def step_at(lam: float) -> tuple[float, float] | None:
        mixed = _unified_step(profile, tp, cap.context_tokens, es, osl, lam)
        if mixed is None:
            return None
        step, b = mixed
        rho_p = lam * es
        if b > cap.cc or step > tpot_slo:
            return None
        t_d = profile.tpot(max(b, 1.0), cap.context_tokens, tp)
        if unified_tpot_miss(lam, t_d, step, es, workload.osl, tpot_slo, prefill_dist, IN_PROGRESS_POINTS) > 1.0 - q:
            return None
        rho_d = 1.0 - rho_p
        ttft = s_q / max(1.0 - min(rho_d * 0.5, 0.9), 0.1)  # half of decode time interleaves with prefill chunks
        if ttft > ttft_slo:
            return None
        return step, b

    lo, hi = 0.0, 1.0
    while step_at(hi) is not None and hi < 1e6:
        lo, hi = hi, hi * 2
    while hi - lo > 1e-4 * hi:  # λ to 0.01%: ~14 halvings of the doubling bracket, not 40
        mid = (lo + hi) / 2
        if step_at(mid) is not None:
            lo = mid
        else:
            hi = mid
    res = step_at(lo)
    return lo, (res[0] if res else profile.tpot(1, cap.context_tokens, tp))


def plan_unified(
    workload: WorkloadEstimate,
    profile: PerformanceProfile,
    slo: SLOSpec,
    *,
    min_gpus: int = 0,
    max_gpus: int = NO_GPU_BOUND,
    tp_unified: int | None = None,
    settings: PlannerSettings = PlannerSettings(),
    current_tp: int | None = None,
) -> Plan:
    """Plan one pool of unified (``kv_both``) instances (see module doc).

    The TP is the one that serves the most requests per GPU, except that the TP the pool already runs
    (``current_tp``, None for a new pool) is kept unless another serves ``settings.tp_switch_gain`` more.

    Only TPs whose KV cache holds one ``settings.max_model_len``-token sequence are candidates
    (:mod:`fulcrum.ratio.tp`).

    Raises:
        PlanningError: the profile has no TP measured for both prefill and decode, or none holds the model, or
            none up to ``settings.max_tp`` holds one ``settings.max_model_len``-token sequence in its KV cache
            (:func:`fulcrum.ratio.tp.fits_max_model_len`), or ``tp_unified`` (``spec.scaling.tpUnified``) does not
            (:func:`fulcrum.ratio.tp.check_fixed_tp`).
    """
    q = _q(slo)
    tpot_slo = slo.tpot_ms / 1e3
    measured = sorted(set(profile.prefill) & set(profile.decode))
    common = measured
    if tp_unified is not None:
        common = [tp for tp in common if tp == tp_unified]
    common = [tp for tp in common if tp <= settings.max_tp or tp == tp_unified]
    if not common:
        raise PlanningError(
            f"profile {profile.name!r} has no TP measured for both prefill {profile.prefill_tps} and decode "
            f"{profile.decode_tps}{f' equal to {tp_unified}' if tp_unified else ''}: Unified mode needs one"
        )
    if tp_unified is not None:
        check_fixed_tp(profile, tp_unified, settings.max_model_len, "spec.scaling.tpUnified", measured)
    else:
        common = fits_max_model_len(profile, common, settings.max_model_len, phase="unified", max_tp=settings.max_tp)
    infeasible = slo_feasibility(
        profile, slo, workload.isl, workload.osl, prefill_tps=common, decode_tps=common,
        max_tp=max(common), slack=settings.infeasible_slo_slack,
    )
    slo = relaxed_slo(slo, infeasible)
    tpot_slo = slo.tpot_ms / 1e3
    lam = max(float(workload.rate_rps), 0.0) if math.isfinite(workload.rate_rps) else 0.0
    best: tuple[float, int, DecodeCapacity, float, float] | None = None
    kept: tuple[float, int, DecodeCapacity, float, float] | None = None
    for tp in common:
        cap = decode_capacity(
            profile, tp, workload.isl.mean(), workload.osl.mean(), tpot_slo,
            bandwidth_utilisation=settings.bandwidth_utilisation, graph_headroom=settings.graph_headroom,
            max_num_seqs=settings.max_num_seqs,
        )
        if cap.cc < 1:
            continue
        mu, step = _unified_rate_per_instance(profile, tp, workload, cap, slo, q)
        per_gpu = mu / tp
        if best is None or per_gpu > best[0] * 1.000001:
            best = (per_gpu, tp, cap, mu, step)
        if tp == current_tp:
            kept = (per_gpu, tp, cap, mu, step)
    if best is None:
        raise PlanningError(f"profile {profile.name!r}: no unified TP holds the model weights and one request's KV "
                            f"cache at a context of {cap.context_tokens:.0f} tokens")
    if kept is not None and kept[0] > 0 and best[0] < kept[0] * (1.0 + settings.tp_switch_gain):
        best = kept  # a TP change replaces the pool: only for a real gain
    _, tp, cap, mu, step = best
    notes: list[str] = [f.message() for f in infeasible]
    if mu <= 0:
        notes.append("no arrival rate meets both SLOs on one unified instance")
        need = lam * 1e3
    else:
        need = lam / (mu * settings.decode_target_utilisation)
    t_p = workload.isl.expect(lambda x: profile.ttft(x, tp))
    rate_need = need
    if mu > 0:  # the KV caches must hold a high quantile of the in-flight contexts (capacity module doc)
        need = _unified_kv_need(profile, tp, cap.context_tokens, t_p, workload, lam, need,
                                settings.kv_occupancy_quantile)
    n = max(math.ceil(need - 1e-9), 1 if lam > 0 else 0)
    counts, budget_notes = fit_budget({"u": need}, {"u": tp}, {"u": n}, min_gpus, max_gpus)
    notes += budget_notes
    n = counts["u"]
    u = ultra_short_threshold(profile, tp, tp, step, tpot_slo, settings)
    # eq. (15) at the unified TP: the duty split role reassignment is bounded around (RoutingParams.prefill_share)
    r = cap.cc * t_p / (cap.step_s * max(workload.osl.mean(), 1.0)) if cap.step_s > 0 else math.nan
    share = r / (1.0 + r) if math.isfinite(r) and r >= 0 else None
    inputs: dict[str, Any] = {
        "rate_rps": lam, "mean_isl": workload.isl.mean(), "mean_osl": workload.osl.mean(), "tp_unified": tp,
        "rate_per_instance": mu, "cc": cap.cc, "step_s": step, "unified_need": need, "unified_rate_need": rate_need, "ultra_short_tokens": u,
        "prefill_share": share, "slo_infeasible": infeasible,
    }
    return Plan(
        mode=Mode.UNIFIED.value,
        prefill=PoolSize(0, 1),
        decode=PoolSize(0, 1),
        unified=PoolSize(n, tp),
        routing=RoutingParams(
            ultra_short_tokens=u,
            long_request_tokens=max(int(round(workload.isl.mean())), 1),
            batch_timeout_s=0.0,
            length_aware_batching=False,
            max_prefill_batch_tokens=settings.max_model_len,
            prefill_share=share,
            decode_concurrency=cap.cc,  # >= 1: TPs with cc < 1 were skipped above
        ),
        ratio=math.nan,
        balanced_ratio=math.nan,
        decode_concurrency=cap.cc,
        t_p_s=t_p,
        t_d_s=step,
        expected_ttft_s=profile.ttft(workload.isl.quantile(q), tp),
        gpus=n * tp,
        feasible=not notes,
        notes=tuple(notes),
        need={Pool.UNIFIED: float(need)},
        inputs=inputs,
        slo_infeasible=infeasible,
    )


def plan(
    workload: WorkloadEstimate, profile: PerformanceProfile, spec: LLMServeSpec, settings: PlannerSettings | None = None,
    *, current_tp_unified: int | None = None,
) -> Plan:
    """Plan for an ``LLMServe`` spec: its mode, SLOs, TP pins and GPU limits.

    In ``Auto`` mode both modes are planned and the one with fewer GPUs wins (feasible plans first; ties go to
    Disaggregated, whose pools scale independently). Unified is skipped when the profile cannot plan it.
    ``current_tp_unified``: the TP the unified pool runs now, if any (kept unless another TP gains
    ``settings.tp_switch_gain``, :func:`plan_unified`).

    Raises:
        PlanningError: the requested mode cannot be planned with this profile.
    """
    s = settings or PlannerSettings.from_spec(spec)
    if spec.mode != Mode.AUTO:
        return _plan_mode(spec.mode, workload, profile, spec, s, current_tp_unified)
    plans = plan_modes(workload, profile, spec, s, current_tp_unified=current_tp_unified)
    return min(plans.values(), key=lambda p: (not p.feasible, p.gpus, p.mode != Mode.DISAGGREGATED.value))


def plan_modes(
    workload: WorkloadEstimate, profile: PerformanceProfile, spec: LLMServeSpec, settings: PlannerSettings | None = None,
    *, current_tp_unified: int | None = None,
) -> dict[str, Plan]:
    """Both modes' plans for ``workload`` under ``spec``'s SLOs, TP pins and GPU limits, whatever ``spec.mode``
    says: ``{"Disaggregated": ..., "Unified": ...}`` (keys are :class:`Mode` values). Unified is left out when
    the profile cannot plan it. What :func:`plan` chooses from in Auto mode, and what the Auto planner
    (:mod:`fulcrum.scaling.fulcrum`) weighs before a switch of mode.

    Raises:
        PlanningError: the profile cannot plan Disaggregated serving.
    """
    s = settings or PlannerSettings.from_spec(spec)
    out = {Mode.DISAGGREGATED.value: _plan_mode(Mode.DISAGGREGATED, workload, profile, spec, s, current_tp_unified)}
    try:
        out[Mode.UNIFIED.value] = _plan_mode(Mode.UNIFIED, workload, profile, spec, s, current_tp_unified)
    except PlanningError:
        pass
    return out


def _plan_mode(mode: Mode, workload: WorkloadEstimate, profile: PerformanceProfile, spec: LLMServeSpec,
               settings: PlannerSettings, current_tp_unified: int | None) -> Plan:
    """``mode``'s plan (Disaggregated or Unified) with ``spec``'s SLOs, TP pins and GPU limits."""
    sc = spec.scaling
    kw: dict[str, Any] = {"min_gpus": sc.min_gpus, "max_gpus": sc.max_gpus, "settings": settings}
    if mode == Mode.UNIFIED:
        return plan_unified(workload, profile, spec.slo, tp_unified=sc.tp_unified, current_tp=current_tp_unified, **kw)
    return plan_disaggregated(workload, profile, spec.slo, tp_prefill=sc.tp_prefill, tp_decode=sc.tp_decode, **kw)


def plan_ratio(
    profile: PerformanceProfile,
    isl: float,
    osl: float,
    *,
    tp_prefill: int | None = None,
    tp_decode: int | None = None,
    tpot_slo_s: float = 0.08,
    decode_concurrency: float | None = None,
    concurrency: float | None = None,
    settings: PlannerSettings = PlannerSettings(),
) -> RatioPlan:
    """The optimal P/D ratio for fixed lengths, DOPD eq. (15) and Alg. 2 lines 10–14.

    t_p = TTFT(ISL, TP_p); t_d = TPOT(cc_d, ISL + OSL/2, TP_d) (the decode step at full batch and the mean
    context of eq. 13); ratio = cc_d·t_p/(t_d·OSL); n_d = ⌈concurrency / cc_d⌉; n_p = ⌈ratio·n_d⌉.

    Args:
        decode_concurrency: a given D-instance capacity cc_d (e.g. DOPD §VI-A3's 235); computed by
            eqs. (11)–(14) when None.
        concurrency: total concurrent requests to serve; one D-instance when None.

    Raises:
        PlanningError: a fixed TP is not in the profile, or no TP holds the model, or no TP up to
            ``settings.max_tp`` holds one ``settings.max_model_len``-token sequence in its KV cache, or a fixed TP
            does not (:mod:`fulcrum.ratio.tp`).
    """
    isl_d = LengthDistribution.point(isl)
    tp_p = choose_prefill_tp(
        profile, isl_d, math.inf, 0.9, fixed=tp_prefill, max_tp=settings.max_tp, max_model_len=settings.max_model_len
    )
    if tp_decode is not None:
        if tp_decode in profile.decode_tps:  # an unmeasured one: decode_capacity's "no decode table" error
            check_fixed_tp(profile, tp_decode, settings.max_model_len, "spec.scaling.tpDecode", profile.decode_tps)
        cap = decode_capacity(
            profile, tp_decode, isl, osl, tpot_slo_s, bandwidth_utilisation=settings.bandwidth_utilisation,
            graph_headroom=settings.graph_headroom, override_cc=decode_concurrency, max_num_seqs=settings.max_num_seqs,
        )
    else:
        cap = choose_decode_tp(profile, isl, osl, tpot_slo_s, max_tp=settings.max_tp,
                               bandwidth_utilisation=settings.bandwidth_utilisation, graph_headroom=settings.graph_headroom,
                               max_num_seqs=settings.max_num_seqs, max_model_len=settings.max_model_len)
        if decode_concurrency is not None:
            cap = decode_capacity(profile, cap.tp, isl, osl, tpot_slo_s, override_cc=decode_concurrency,
                                  bandwidth_utilisation=settings.bandwidth_utilisation, graph_headroom=settings.graph_headroom,
                                  max_num_seqs=settings.max_num_seqs)
    if cap.cc < 1:
        raise PlanningError(f"profile {profile.name!r}: the weights leave no KV memory for one request of "
                            f"{cap.context_tokens:.0f} tokens' context at TP={cap.tp}")
    t_p = profile.ttft(isl, tp_p)
    ratio = cap.cc * t_p / (cap.step_s * max(osl, 1.0))
    n_d = max(math.ceil(concurrency / cap.cc - 1e-9), 1) if concurrency is not None else 1
    return RatioPlan(
        ratio=ratio,
        prefill_replicas=max(math.ceil(ratio * n_d - 1e-9), 1),
        decode_replicas=n_d,
        decode_concurrency=cap.cc,
        t_p_s=t_p,
        t_d_s=cap.step_s,
        tp_prefill=tp_p,
        tp_decode=cap.tp,
        capacity=cap,
    )
