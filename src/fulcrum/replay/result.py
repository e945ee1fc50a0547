"""Results of one replay: what the report, the ``--json`` output and the comparison table read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fulcrum.ratio.feasibility import SLOInfeasible
from fulcrum.replay.distribution import LatencyDistribution
from fulcrum.simulator.records import RequestRecord

__all__ = ["RequestRecord", "TimelinePoint", "ForecastPoint", "PolicySummary", "PolicyRun", "InfeasibleSLO"]


@dataclass(frozen=True, slots=True)
class TimelinePoint:
    """Cluster state at a planner tick."""

    time_s: float
    rate_rps: float
    prefill: int
    decode: int
    unified: int
    gpus: int
    ready_gpus: int


@dataclass(frozen=True, slots=True)
class ForecastPoint:
    """A forecast made at ``made_at_s`` for the interval ending at ``time_s``, and what was then observed."""

    time_s: float
    made_at_s: float
    series: str  # "rate" | "isl" | "osl"
    mean: float
    lower: float
    upper: float
    actual: float


@dataclass(frozen=True)
class PolicySummary:
    """Headline figures of one policy on one trace.

    Attributes:
        slo_attainment: share of the scored requests (arrivals after the warm-up, rejected prompts and requests
            unfinished at the end included) meeting both TTFT and TPOT SLOs, 0..1; NaN when none is scored.
        goodput_tokens_per_s: output tokens/s of the scored requests meeting both SLOs, over the span of their
            arrivals (first → last; :func:`fulcrum.simulator.metrics.summarize`).
        throughput_tokens_per_s: output tokens/s of the scored requests that finished, over the same span.
        gpu_hours: GPU-hours provisioned from the end of the warm-up to the end of the run (pods counted from
            scale-out until removed, start-up included).
        ttft_p_s / tpot_p_s: TTFT / TPOT at the SLO percentile over the scored requests, seconds.
        requests: the scored requests.
        scale_events: changes of target.
        latency: p50/p90/p99 of TTFT, TPOT, end-to-end latency and queueing time over the scored requests
            (arrivals after the warm-up), seconds (:mod:`fulcrum.replay.distribution`).
    """

    slo_attainment: float
    goodput_tokens_per_s: float
    throughput_tokens_per_s: float
    gpu_hours: float
    ttft_p_s: float
    tpot_p_s: float
    ttft_attainment: float
    tpot_attainment: float
    requests: int
    scale_events: int
    latency: LatencyDistribution = field(default_factory=LatencyDistribution.empty)


@dataclass(frozen=True)
class InfeasibleSLO:
    """An SLO target a policy's plans found out of the profile's reach at the forecast lengths in some intervals
    (:mod:`fulcrum.ratio.feasibility`; only planners that judge feasibility report it: ``fulcrum``).

    Attributes:
        worst: the report of the interval with the largest best achievable value (target, best, lengths, TP,
            the value planned for instead), seconds and tokens.
        intervals: planner intervals that found this target out of reach.
        total_intervals: planner intervals in the run.
        first_time_s: end of the first such interval, seconds since the start of the trace.
    """

    worst: SLOInfeasible
    intervals: int
    total_intervals: int
    first_time_s: float

    def message(self) -> str:
        """One line: the worst interval's numbers and how often, e.g. ``TPOT target 80 ms cannot be met: best
        94.2 ms at batch 1 (TP2, ISL 14000, OSL 2000 tokens); planning for 103.6 ms — in 12 of 60 intervals,
        first at t = 420 s``."""
        return (f"{self.worst.message()} — in {self.intervals} of {self.total_intervals} intervals, "
                f"first at t = {self.first_time_s:g} s")

    def as_dict(self) -> dict[str, Any]:
        """The worst report's fields plus ``intervals``, ``total_intervals`` and ``first_time_s``."""
        return {**self.worst.as_dict(), "intervals": self.intervals, "total_intervals": self.total_intervals,
                "first_time_s": self.first_time_s}


@dataclass
class PolicyRun:
    """Everything one policy produced on one trace.

    Attributes (beyond the obvious): ``warmup_s`` — requests arriving before it are not scored (seconds);
    ``slo_infeasible`` — SLO targets its plans found out of reach, TTFT first; ``migrations`` — decode requests
    the simulated router moved (ARES rescheduling, on when the spec's ``router.rescheduling`` is; the whole trace);
    ``role_changes`` — duty flips of unified instances by the simulated router's role reassignment (on when the
    spec's ``router.roleReassignment`` is; the whole trace); ``held`` — the ticks at which the control loop kept the
    pools in force because the planner failed on the observed load (time s, the loop's ``degraded`` message;
    :meth:`fulcrum.scaling.loop.ControlLoop.step`), empty when it never did; ``ticks`` — the planner ticks run.
    """

    policy: str
    summary: PolicySummary
    records: list[RequestRecord] = field(default_factory=list)
    timeline: list[TimelinePoint] = field(default_factory=list)
    forecasts: list[ForecastPoint] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    warmup_s: float = 0.0
    slo_infeasible: tuple[InfeasibleSLO, ...] = ()
    migrations: int = 0
    role_changes: int = 0
    held: tuple[tuple[float, str], ...] = ()
    ticks: int = 0
