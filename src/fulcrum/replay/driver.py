"""``fulcrum replay``: the operator's control loop against the simulated cluster on a real trace.

The loop is the operator's :class:`~fulcrum.scaling.loop.ControlLoop`, with the simulator as the
:class:`~fulcrum.cluster.Cluster`: every ``planner.tick_s`` seconds of simulated time,
:meth:`~fulcrum.scaling.loop.ControlLoop.run_interval` observes (the simulator's measurements over the last tick),
steps the planner (forecast, plan) under the loop's rules (hold when blind, the external replica owner) and
applies the target (the simulator resizes its pools, with start-up delay and drain). After the last arrival the cluster
drains and the run is scored per request (TTFT, TPOT) and overall (SLO attainment, goodput, GPU-hours), with
p50/p90/p99 of TTFT, TPOT, end-to-end latency and queueing time (:mod:`fulcrum.replay.distribution`). SLO targets
the planner's plans found out of the profile's reach are tallied per metric (``PolicyRun.slo_infeasible``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from fulcrum.api.llmserve import LLMServeSpec
from fulcrum.ratio.profile import PerformanceProfile, recompute_tokens_per_s
from fulcrum.ratio.feasibility import SLOInfeasible
from fulcrum.replay.distribution import LatencyDistribution
from fulcrum.replay.rescheduling import ares_rescheduler, learned_remaining
from fulcrum.replay.roles import SimulatedDuties
from fulcrum.replay.result import ForecastPoint, InfeasibleSLO, PolicyRun, PolicySummary, TimelinePoint
from fulcrum.replay.routing import routing_factory
from fulcrum.scaling.loop import ControlLoop, distribute, external_replicas
from fulcrum.scaling.planner import Planner
from fulcrum.scaling.registry import make_planner
from fulcrum.simulator import Rescheduler, SimConfig, Simulation
from fulcrum.target import ClusterTarget, Pool
from fulcrum.workload import Request

__all__ = ["run_policy", "run_planner", "scale_arrivals", "ReplayOptions", "warmup_seconds"]


def scale_arrivals(requests: Sequence[Request], time_scale: float) -> list[Request]:
    """Multiply every arrival time by ``time_scale`` (< 1 compresses the trace: a higher request rate).

    Raises:
        ValueError: ``time_scale`` is not a finite positive number.
    """
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise ValueError(f"time scale must be a finite positive number, got {time_scale}")
    if time_scale == 1.0:
        return list(requests)
    return [replace(r, arrival_s=r.arrival_s * time_scale) for r in requests]


@dataclass(frozen=True)
class ReplayOptions:
    """How a replay runs.

    Attributes:
        sim: simulator settings (start-up delay defaults to the spec's ``podStartupSeconds``).
        progress: show a progress bar (tqdm, on stderr) per policy.
        warmup_s: score only requests arriving after this many seconds, and GPU time from then on; ``None``
            means pod start-up + 2 intervals: the cold start of the spec's initial pools, the same for every
            policy, says nothing about a planner. 0 scores the whole trace.
        routing: the router's routing policy the simulator runs (:mod:`fulcrum.routing`; built by
            :func:`fulcrum.replay.routing.routing_factory`); None: the spec's ``router.policy``.
    """

    sim: SimConfig | None = None
    progress: bool = False
    warmup_s: float | None = None
    routing: str | None = None


def warmup_seconds(spec: LLMServeSpec, options: ReplayOptions) -> float:
    """The warm-up a replay leaves out of scoring (see :class:`ReplayOptions`), seconds.

    A negative ``options.warmup_s`` is taken as 0 (score everything); ``fulcrum replay`` refuses one before it gets
    here (``--warmup must be ... >= 0``).

    Raises:
        ValueError: ``options.warmup_s`` is nan or infinite (every score would read nan).
    """
    if options.warmup_s is not None:
        warmup = float(options.warmup_s)
        if not math.isfinite(warmup):
            raise ValueError(f"warmup_s must be a finite number of seconds, got {warmup:g}")
        return max(warmup, 0.0)
    return spec.scaling.pod_startup_seconds + 2 * spec.scaling.interval_seconds


class _InfeasibleTally:
    """Counts, per metric, the intervals whose plan found an SLO target out of reach, and keeps the worst."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[SLOInfeasible, int, float]] = {}
        self.intervals = 0

    def add(self, t: float, found: tuple[SLOInfeasible, ...] | None) -> None:
        self.intervals += 1
        for f in found or ():
            worst, n, first = self._seen.get(f.metric, (f, 0, t))
            self._seen[f.metric] = (f if f.best_s > worst.best_s else worst, n + 1, first)

    def result(self) -> tuple[InfeasibleSLO, ...]:
        out = []
        for metric in ("ttft", "tpot"):
            if metric in self._seen:
                worst, n, first = self._seen[metric]
                out.append(InfeasibleSLO(worst, n, self.intervals, first))
        return tuple(out)


def run_policy(
    name: str,
    requests: Sequence[Request],
    spec: LLMServeSpec,
    profile: PerformanceProfile,
    options: ReplayOptions = ReplayOptions(),
) -> PolicyRun:
    """Replay ``requests`` under policy ``name`` and score it.

    Args:
        name: a key of :data:`fulcrum.scaling.registry.PLANNERS`.
        requests: the trace, sorted by arrival (seconds from 0).
        spec: the ``LLMServe`` spec (SLOs, limits, interval, start-up time).
        profile: the performance profile timing the simulated instances.

    Raises:
        ValueError: unknown planner name or an empty trace.
        PlanningError: the profile cannot hold the model under the spec's TP and GPU limits.
    """
    if not requests:
        raise ValueError("the trace has no requests")
    return run_planner(make_planner(name, spec, profile), requests, spec, profile, options, name=name)


def _rescheduling(spec: LLMServeSpec, profile: PerformanceProfile, sim_cfg: SimConfig,
                  target: Callable[[], ClusterTarget]) -> tuple[Rescheduler | None, Callable[[int, int], None] | None]:
    """The simulated router's ARES decode rescheduling when ``spec.router.rescheduling`` is on (ARES Alg. 1 every
    ``sim_cfg.reschedule_interval_s``, 1 s by default as in the router, with the remaining-length predictor
    learnt online from finished requests); (None, None) when it is off or the tick is disabled.

    Migrations move as ``sim_cfg.migration`` says: by recompute, as the live router does (vLLM's connector cannot
    hand over a running request's KV; docs/rebalancing.md), priced by the prefill throughput the operator writes
    for the ``target`` in force (:func:`~fulcrum.ratio.profile.recompute_tokens_per_s`); or, with ``"kv"``, as
    ARES does, over
    ``sim_cfg.kv_link_gbps`` at the profile's KV bytes per token."""
    if not spec.router.rescheduling or sim_cfg.reschedule_interval_s <= 0:
        return None, None
    predict, feed = learned_remaining(spec.model.served_name or spec.model.name)
    if sim_cfg.migration == "recompute":
        return ares_rescheduler(predict, profile=profile,
                                recompute_tokens_per_s=lambda: recompute_tokens_per_s(profile, target())), feed
    return ares_rescheduler(predict, profile=profile, link_gbps=sim_cfg.kv_link_gbps), feed


def run_planner(
    planner: Planner,
    requests: Sequence[Request],
    spec: LLMServeSpec,
    profile: PerformanceProfile,
    options: ReplayOptions = ReplayOptions(),
    *,
    name: str | None = None,
) -> PolicyRun:
    """Replay ``requests`` under an already built ``planner`` and score it (what :func:`run_policy` does after
    building the planner by name; the static-best sweep builds its own).

    Raises:
        ValueError: an empty trace.
        PlanningError: the profile cannot hold the model under the spec's TP and GPU limits.
    """
    if not requests:
        raise ValueError("the trace has no requests")
    name = name or planner.name
    wall0 = time.perf_counter()
    rebalancing = spec.router.rescheduling or spec.router.role_reassignment
    sim_cfg = options.sim or SimConfig(pod_startup_s=spec.scaling.pod_startup_seconds,
                                       max_model_len=spec.engine.max_model_len,
                                       reschedule_interval_s=1.0 if rebalancing else 0.0, migration="recompute")
    current = planner.initial()
    total = external_replicas(spec)
    if total is not None:  # as the operator starts an externally owned LLMServe
        current = distribute(total, current, max_gpus=spec.scaling.max_gpus)
    routing = routing_factory(options.routing or spec.router.policy.value, spec, profile)
    # the rescheduler prices a migration with the target in force (the router config's), asked at each tick of
    # the simulation built just below
    rescheduler, feed = _rescheduling(spec, profile, sim_cfg, lambda: sim.target)
    duties = SimulatedDuties(spec.slo.ttft_ms / 1000.0) if spec.router.role_reassignment else None
    sim = Simulation(requests, profile, spec.slo, current, sim_cfg, policy=routing, rescheduler=rescheduler,
                     on_finished=feed, duties=duties)
    loop = ControlLoop(spec, profile, current, planner=planner)
    tick = planner.tick_s
    end = requests[-1].arrival_s
    n_ticks = int(math.ceil(end / tick)) + 1
    horizon = planner.horizon_steps
    timeline: list[TimelinePoint] = []
    forecasts: list[ForecastPoint] = []
    pending: dict[int, list[tuple[float, str, dict[str, float]]]] = {}
    decisions = []
    held: list[tuple[float, str]] = []
    scale_events = 0
    infeasible = _InfeasibleTally()
    bar = None
    if options.progress:
        from tqdm import tqdm

        bar = tqdm(total=n_ticks, desc=f"{name:>11}", unit="tick", leave=False, mininterval=0.5)
    for k in range(1, n_ticks + 1):
        t = k * tick
        sim.run_until(t)
        previous = loop.current
        outcome = loop.run_interval(sim)
        if outcome.degraded is not None:  # the planner failed on this tick's load: the loop held the pools
            held.append((t, outcome.degraded))
        obs = outcome.observation
        assert obs is not None  # the simulator always observes
        actual = {"rate": obs.rate_rps, "isl": obs.mean_isl, "osl": obs.mean_osl}
        for made_at, series, fc in pending.pop(k, []):
            if obs.arrivals > 0 or series == "rate":
                forecasts.append(ForecastPoint(t, made_at, series, fc["mean"], fc["lower"], fc["upper"], actual[series]))
        infeasible.add(t, outcome.numbers.slo_infeasible)
        for series in ("rate", "isl", "osl"):
            if series in outcome.forecast:
                pending.setdefault(k + horizon, []).append((t, series, outcome.forecast[series]))
        current = outcome.target
        if not current.same_pools(previous):
            scale_events += 1
            decisions.append({"time_s": t, "reason": outcome.reason,
                              **{p.value: current.pool(p).replicas for p in Pool}})
        timeline.append(TimelinePoint(
            time_s=t, rate_rps=obs.rate_rps, prefill=current.prefill.replicas, decode=current.decode.replicas,
            unified=current.unified.replicas, gpus=current.gpus,
            ready_gpus=sum(obs.ready.of(p) * size.tp for p, size in current.pools()),
        ))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    result = sim.finish()
    warmup = warmup_seconds(spec, options)
    s = result.summary(spec.slo, since_s=warmup)
    summary = PolicySummary(
        slo_attainment=s["slo_attainment"],
        goodput_tokens_per_s=s["goodput_tokens_per_s"],
        throughput_tokens_per_s=s["throughput_tokens_per_s"],
        gpu_hours=s["gpu_hours"],
        ttft_p_s=s["ttft_p_s"],
        tpot_p_s=s["tpot_p_s"],
        ttft_attainment=s["ttft_attainment"],
        tpot_attainment=s["tpot_attainment"],
        requests=int(s["requests"]),
        scale_events=scale_events,
        latency=LatencyDistribution.of(result.records, since_s=warmup),
    )
    return PolicyRun(
        policy=name,
        summary=summary,
        migrations=result.migrations,
        role_changes=result.role_changes,
        records=list(result.records),
        timeline=timeline,
        forecasts=forecasts,
        decisions=decisions,
        wall_s=time.perf_counter() - wall0,
        warmup_s=warmup,
        slo_infeasible=infeasible.result(),
        held=tuple(held),
        ticks=n_ticks,
    )
