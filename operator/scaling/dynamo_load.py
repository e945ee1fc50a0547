"""``dynamo-load``: a re-implementation of NVIDIA Dynamo's load-based planner, as a reference.

``fulcrum replay --compare`` measures Fulcrum's planner against it. The logic follows Dynamo's code in
``ai-dynamo/dynamo``:

- ``components/src/dynamo/planner/utils/prefill_planner.py`` and ``decode_planner.py``
  (``load_plan_adjustment``): every tick, a pool grows by one when its load is above the target, and shrinks
  by one only when the load would stay below the target after the survivors absorb it —
  ``load < target · (N−1)/N · sensitivity``, i.e. ``load · N/(N−1) < target · sensitivity``;
- ``components/src/dynamo/planner/config/defaults.py`` (``SLAPlannerDefaults``): ``load_adjustment_interval = 5`` s,
  ``load_scaling_down_sensitivity = 80`` (%), ``min_endpoint = 1``;
- ``components/planner/src/dynamo/planner/defaults.py`` (``LoadPlannerDefaults``, the first load planner):
  ``prefill_queue_scale_up_threshold = 5.0`` requests, ``decode_kv_scale_up_threshold = 0.9``;
- ``examples/llm/components/planner.py`` (the first load planner): scale-ins first, then prefill
  out before decode ("prefill queueing can also lead to high kv load on decode workers"), each scale-out only
  while ``used GPUs + engine GPUs ≤ max_gpu_budget``;
- ``components/src/dynamo/planner/core/load_scaling.py``: decode load = (scheduled + queued KV) / max KV;
- ``utils/planner_core.py`` (``BasePlanner`` load loop): scaling is blocking — after a change the pool only
  observes until the deployment reports the new count ("Scaling in progress ... observing only"), bounded
  by ``wait_for_graph_deployment_ready``'s 180 × 10 s = 30 min. (The first load planner had instead a
  3-interval grace period before removing a new decode worker and a queue-trend check before adding a
  prefill worker, with fixed scale-in thresholds 0.2 queued requests / 50 % KV and no N/(N−1) check; the
  blocking wait and the N/(N−1) check of the later planner are what is modelled here.)

Signals, per pool, from a Fulcrum :class:`Observation`:

- prefill: requests waiting for prefill per prefill instance, ``prefill_queue / N_p`` (Dynamo: active
  prefill tokens per worker; the same thing in units of ISL);
- decode: KV utilisation of the scheduled plus queued requests, ``kv_utilisation + decode_queue / N_d ·
  ISL / KV_capacity``.

Targets (``DynamoLoadSettings.thresholds``):

- ``"sla"`` (default; the version with the N/(N−1) check): derived from the SLOs the way Dynamo's online
  regressions do, with the profile standing in for the regression. Prefill: TTFT grows linearly with the
  tokens ahead of a request, ``TTFT(q) = (q + 1) · TTFT_profile(ISL)``, so the queue that still meets the TTFT
  SLO is ``q* = TTFT_SLO / TTFT_profile(ISL) − 1`` requests per instance (Dynamo:
  ``target_active_tokens = x_sla − ISL``). Decode: the KV load at which the ITL reaches the TPOT SLO at
  context ``ISL + OSL/2``, ``u* = b*·context / KV_capacity`` with ``b*`` the largest batch meeting it
  (Dynamo: ``x_sla`` of the ITL regression over active KV blocks). An unreachable SLO (``q* ≤ 0``, or one
  request alone misses the ITL) leaves the pool alone, as Dynamo does ("SLA unachievable, skipping").
- ``"static"``: the first load planner's thresholds, 5 queued requests per prefill instance and 90 % KV.

Assumptions (Fulcrum observes pool means, Dynamo per-worker values): Dynamo scales out when *all* workers
are above target and in when *all* are below the boundary; with one mean per pool the mean stands for every
worker (a balanced router). ``Observation.ready`` must report ready instances per pool for the blocking
wait; a pool whose ready count never reaches the target resumes after ``max_scaling_wait_s``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from fulcrum.api.llmserve import LLMServeSpec
from fulcrum.forecast.workload import WorkloadForecaster
from fulcrum.observation import Observation
from fulcrum.ratio.profile import PerformanceProfile
from fulcrum.scaling.dynamo_sla import clamp_to_gpu_budget, decode_best_batch, pick_tp
from fulcrum.scaling.planner import Decision, PlanNumbers
from fulcrum.target import ClusterTarget, Pool, PoolSize

__all__ = ["DynamoLoadSettings", "DynamoLoadPlanner", "PoolMove", "load_move"]


@dataclass(frozen=True)
class DynamoLoadSettings:
    """Settings of :class:`DynamoLoadPlanner`, with the Dynamo default each stands for.

    Attributes:
        tick_s: seconds between decisions (Dynamo ``load_adjustment_interval = 5``).
        thresholds: ``"sla"`` (targets derived from the SLOs and the profile) or ``"static"`` (fixed ones below).
        prefill_queue_scale_up_threshold: static prefill target, queued requests per prefill instance
            (Dynamo ``LoadPlannerDefaults.prefill_queue_scale_up_threshold = 5.0``).
        decode_kv_scale_up_threshold: static decode target, KV utilisation 0..1 (Dynamo 0.9).
        scale_down_sensitivity: fraction of the target the load must stay under after a scale-in
            (Dynamo ``load_scaling_down_sensitivity = 80`` %).
        min_endpoint: fewest replicas per pool (Dynamo ``min_endpoint = 1``).
        max_scaling_wait_s: longest wait for a pool to reach its new count before deciding again (Dynamo
            ``wait_for_graph_deployment_ready``: 180 attempts × 10 s).
    """

    tick_s: float = 5.0
    thresholds: Literal["sla", "static"] = "sla"
    prefill_queue_scale_up_threshold: float = 5.0
    decode_kv_scale_up_threshold: float = 0.9
    scale_down_sensitivity: float = 0.8
    min_endpoint: int = 1
    max_scaling_wait_s: float = 1800.0

    def __post_init__(self) -> None:
        if not self.tick_s > 0:
            raise ValueError(f"tick_s must be > 0, got {self.tick_s}")
        if self.thresholds not in ("sla", "static"):
            raise ValueError(f"thresholds must be 'sla' or 'static', got {self.thresholds!r}")
        if not 0 < self.scale_down_sensitivity <= 1:
            raise ValueError(f"scale_down_sensitivity must be in (0, 1], got {self.scale_down_sensitivity}")
        if self.min_endpoint < 1:
            raise ValueError(f"min_endpoint must be >= 1, got {self.min_endpoint}")


@dataclass(frozen=True)
class PoolMove:
    """The ±1 decision of one pool.

    Attributes:
        delta: -1, 0 or +1 replicas.
        load: the pool's signal (requests per instance, or KV utilisation).
        target: scale-out threshold, same unit (NaN when there is none this tick).
        boundary: scale-in boundary ``target·(N−1)/N·sensitivity`` (NaN when N ≤ 1 or no target).
        why: one phrase.
    """

    delta: int
    load: float
    target: float
    boundary: float
    why: str


def load_move(load: float, target: float, n: int, sensitivity: float, min_endpoint: int) -> PoolMove:
    """Dynamo's ``load_plan_adjustment`` for one pool of ``n`` instances.

    +1 when ``load > target``; −1 when ``n > 1`` and ``load < target·(n−1)/n·sensitivity`` (the N/(N−1)
    check: the ``n−1`` survivors would carry ``load·n/(n−1)``, still below ``target·sensitivity``) unless
    that would go below ``min_endpoint``; else 0. A non-finite load or target gives 0.

    Args:
        load: the pool's current signal per instance.
        target: the scale-out threshold (same unit).
        n: current instances of the pool.
        sensitivity: ``load_scaling_down_sensitivity`` as a fraction (0, 1].
        min_endpoint: fewest instances.
    """
    nan = math.nan
    if not (math.isfinite(load) and math.isfinite(target)):
        return PoolMove(0, load, target, nan, "no signal")
    if load > target:
        return PoolMove(+1, load, target, nan, "above target")
    if n > 1:
        boundary = target * (n - 1) / n * sensitivity
        if load < boundary:
            if n - 1 < min_endpoint:
                return PoolMove(0, load, target, boundary, "below boundary, at min_endpoint")
            return PoolMove(-1, load, target, boundary, "below N/(N-1) boundary")
        return PoolMove(0, load, target, boundary, "within band")
    return PoolMove(0, load, target, nan, "within band")


class DynamoLoadPlanner:
    """Dynamo's load-based planner for Disaggregated serving: ±1 replica per pool per 5 s tick.

    Args:
        spec: the ``LLMServe`` spec: SLOs (for ``thresholds="sla"``), TPs, initial pools, GPU budget.
        profile: the performance profile (SLA-derived targets, KV capacity).
        settings: see :class:`DynamoLoadSettings`.

    Raises:
        PlanningError: no usable TP for a pool (a TP must be at most ``spec.gpu.gpusPerNode`` and hold the weights
            plus one ``spec.engine.maxModelLen``-token sequence of KV cache; a pinned ``tpPrefill``/``tpDecode`` that
            does not is named: :func:`~fulcrum.scaling.dynamo_sla.pick_tp`), or one instance of each pool exceeds
            ``maxGPUs``.

    Attributes:
        name: ``"dynamo-load"``.
        tick_s: ``settings.tick_s`` (5 s).
        forecaster: None; horizon_steps: 1 (it does not forecast).
    """

    def __init__(self, spec: LLMServeSpec, profile: PerformanceProfile, settings: DynamoLoadSettings | None = None) -> None:
        self.name = "dynamo-load"
        self.forecaster: WorkloadForecaster | None = None  # load-based: reacts to what it sees, no forecast
        self.horizon_steps = 1
        self._settings = settings or DynamoLoadSettings()
        self.tick_s = float(self._settings.tick_s)
        self._spec = spec
        self._profile = profile
        max_tp = spec.gpu.gpus_per_node  # one instance is one pod: its TP fits one node
        self._tp_p = pick_tp(spec.scaling.tp_prefill, profile, "prefill", spec.engine.max_model_len, max_tp=max_tp)
        self._tp_d = pick_tp(spec.scaling.tp_decode, profile, "decode", spec.engine.max_model_len, max_tp=max_tp)
        self._kv_cap_d = profile.kv_capacity_tokens(self._tp_d)
        self._min_gpus = spec.scaling.min_gpus
        self._max_gpus = spec.scaling.max_gpus
        clamp_to_gpu_budget(1, 1, self._tp_p, self._tp_d, 0, self._max_gpus, self._settings.min_endpoint)
        self._isl = 0.0  # last mean ISL seen, tokens (Dynamo: cluster-averaged last_isl)
        self._osl = 0.0
        self._pending: dict[Pool, tuple[int, float]] = {}  # pool → (replicas asked for, since time_s)

    def initial(self) -> ClusterTarget:
        """The starting pools: ``spec.scaling.initial_prefill/initial_decode`` (≥ ``min_endpoint``) in budget."""
        s = self._spec.scaling
        n_p, n_d = clamp_to_gpu_budget(
            s.initial_prefill, s.initial_decode, self._tp_p, self._tp_d, self._min_gpus, self._max_gpus,
            self._settings.min_endpoint,
        )
        return ClusterTarget(prefill=PoolSize(n_p, self._tp_p), decode=PoolSize(n_d, self._tp_d))

    def step(self, obs: Observation, current: ClusterTarget) -> Decision:
        """One tick: at most one replica more or fewer per pool. Never raises on odd observations."""
        if obs.arrivals > 0 and math.isfinite(obs.mean_isl) and obs.mean_isl > 0:
            self._isl = float(obs.mean_isl)
            if math.isfinite(obs.mean_osl) and obs.mean_osl > 0:
                self._osl = float(obs.mean_osl)
        n_p, n_d = current.prefill.replicas, current.decode.replicas
        if current.prefill.tp != self._tp_p or current.decode.tp != self._tp_d or self._out_of_budget(n_p, n_d):
            return self._reconcile(obs, current)

        busy = {pool: self._in_progress(pool, obs, current) for pool in Pool.disaggregated()}
        p_target, p_note = self._prefill_target()
        d_target, d_note = self._decode_target()
        sens, floor = self._settings.scale_down_sensitivity, self._settings.min_endpoint
        p_move = load_move(self._prefill_load(obs, n_p), p_target, n_p, sens, floor)
        d_move = load_move(self._decode_load(obs, n_d), d_target, n_d, sens, floor)
        dp = 0 if busy[Pool.PREFILL] else p_move.delta
        dd = 0 if busy[Pool.DECODE] else d_move.delta

        dp, dd, held = self._fit_budget(n_p, n_d, dp, dd)
        new_p, new_d = n_p + dp, n_d + dd
        for pool, delta, new in ((Pool.PREFILL, dp, new_p), (Pool.DECODE, dd, new_d)):
            if delta != 0:
                self._pending[pool] = (new, obs.time_s)
        target = ClusterTarget(
            prefill=PoolSize(new_p, self._tp_p), decode=PoolSize(new_d, self._tp_d), routing=current.routing
        )
        assert target.gpus <= self._max_gpus and abs(dp) <= 1 and abs(dd) <= 1
        reason = "dynamo-load: " + "; ".join(
            [
                self._describe("prefill", n_p, new_p, p_move, busy[Pool.PREFILL], p_note),
                self._describe("decode", n_d, new_d, d_move, busy[Pool.DECODE], d_note),
                *held,
            ]
        )
        inputs: dict[str, Any] = {
            "prefill_queue_per_instance": p_move.load,
            "prefill_target": p_move.target,
            "prefill_boundary": p_move.boundary,
            "decode_kv_load": d_move.load,
            "decode_target": d_move.target,
            "decode_boundary": d_move.boundary,
            "prefill_in_progress": busy[Pool.PREFILL],
            "decode_in_progress": busy[Pool.DECODE],
            "isl": self._isl,
            "osl": self._osl,
            "thresholds": self._settings.thresholds,
            "tp_p": self._tp_p,
            "tp_d": self._tp_d,
        }
        return Decision(time_s=obs.time_s, target=target, reason=reason, numbers=PlanNumbers(detail=inputs))

    # -- signals and targets -----------------------------------------------------------------------------

    @staticmethod
    def _prefill_load(obs: Observation, n: int) -> float:
        """Requests waiting for prefill per prefill instance."""
        return max(obs.prefill_queue, 0) / n if n > 0 else math.nan

    def _decode_load(self, obs: Observation, n: int) -> float:
        """KV utilisation of scheduled plus queued requests per decode instance, 0..1+ (NaN if unknown)."""
        u = float(obs.kv_utilisation)
        if not math.isfinite(u) or n <= 0:
            return math.nan
        queued = max(obs.decode_queue, 0) / n * self._isl / self._kv_cap_d
        return max(u, 0.0) + queued

    def _prefill_target(self) -> tuple[float, str]:
        """Scale-out threshold, queued requests per instance, and a note when there is none."""
        if self._settings.thresholds == "static":
            return self._settings.prefill_queue_scale_up_threshold, ""
        if self._isl <= 0:
            return math.nan, "no ISL seen yet"
        q_star = (self._spec.slo.ttft_ms / 1e3) / self._profile.ttft(self._isl, self._tp_p) - 1.0
        if q_star <= 0:
            return math.nan, f"TTFT SLO unreachable at ISL {self._isl:.0f}"
        return q_star, ""

    def _decode_target(self) -> tuple[float, str]:
        """Scale-out threshold as KV utilisation 0..1, and a note when there is none."""
        if self._settings.thresholds == "static":
            return self._settings.decode_kv_scale_up_threshold, ""
        if self._isl <= 0:
            return math.nan, "no ISL seen yet"
        context = self._isl + self._osl / 2
        itl = self._spec.slo.tpot_ms / 1e3
        if not self._profile.tpot(1, context, self._tp_d) <= itl:
            return math.nan, f"ITL SLO unreachable at context {context:.0f}"
        b_star = decode_best_batch(self._profile, self._tp_d, itl, context)
        return min(b_star * context / self._kv_cap_d, 1.0), ""

    # -- blocking scaling and budget ---------------------------------------------------------------------

    def _in_progress(self, pool: Pool, obs: Observation, current: ClusterTarget) -> bool:
        """Dynamo's blocking scale: observe only until the pool's ready count reaches what was asked."""
        if pool not in self._pending:
            return False
        want, since = self._pending[pool]
        now_target = current.pool(pool).replicas
        ready = obs.ready.of(pool)
        if now_target != want or ready == want or obs.time_s - since >= self._settings.max_scaling_wait_s:
            del self._pending[pool]
            return False
        return True

    def _fit_budget(self, n_p: int, n_d: int, dp: int, dd: int) -> tuple[int, int, list[str]]:
        """Scale-ins first (never below ``minGPUs``), then scale-outs, prefill first, within ``maxGPUs``.

        Dynamo's first load planner (``examples/llm/components/planner.py``): removals before additions, and
        an addition only while ``used GPUs + engine GPUs ≤ max_gpu_budget``.
        """
        used = n_p * self._tp_p + n_d * self._tp_d
        held: list[str] = []
        moves = {Pool.PREFILL: dp, Pool.DECODE: dd}
        tps = {Pool.PREFILL: self._tp_p, Pool.DECODE: self._tp_d}
        for pool in Pool.disaggregated():
            if moves[pool] < 0:
                if used - tps[pool] < self._min_gpus:
                    moves[pool] = 0
                    held.append(f"{pool} scale-in held by minGPUs={self._min_gpus}")
                else:
                    used -= tps[pool]
        for pool in Pool.disaggregated():
            if moves[pool] > 0:
                if used + tps[pool] > self._max_gpus:
                    moves[pool] = 0
                    held.append(f"{pool} scale-out held by maxGPUs={self._max_gpus}")
                else:
                    used += tps[pool]
        return moves[Pool.PREFILL], moves[Pool.DECODE], held

    def _out_of_budget(self, n_p: int, n_d: int) -> bool:
        m = self._settings.min_endpoint
        return n_p < m or n_d < m or n_p * self._tp_p + n_d * self._tp_d > self._max_gpus

    def _reconcile(self, obs: Observation, current: ClusterTarget) -> Decision:
        """Bring a target that is outside the budget (or has other TPs) back into it in one move."""
        n_p, n_d = clamp_to_gpu_budget(
            current.prefill.replicas, current.decode.replicas, self._tp_p, self._tp_d, self._min_gpus,
            self._max_gpus, self._settings.min_endpoint,
        )
        self._pending.clear()
        target = ClusterTarget(prefill=PoolSize(n_p, self._tp_p), decode=PoolSize(n_d, self._tp_d), routing=current.routing)
        return Decision(
            time_s=obs.time_s,
            target=target,
            reason=f"dynamo-load: reconcile to the GPU budget / TPs ({n_p} P × TP{self._tp_p}, {n_d} D × TP{self._tp_d})",
            numbers=PlanNumbers(detail={"tp_p": self._tp_p, "tp_d": self._tp_d}),
        )

    @staticmethod
    def _describe(pool: str, old: int, new: int, move: PoolMove, busy: bool, note: str) -> str:
        if busy:
            return f"{pool} {old} (scaling in progress, observing)"
        if note:
            return f"{pool} {old} ({note})"
        arrow = f"{old}→{new}" if new != old else f"{old}"
        return f"{pool} {arrow} (load {move.load:.3g} vs target {move.target:.3g}: {move.why})"
