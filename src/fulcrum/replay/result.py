"""Results of one replay: what the report, the ``--json`` output and the comparison table read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fulcrum.simulator.records import RequestRecord

__all__ = ["RequestRecord", "TimelinePoint", "ForecastPoint", "PolicySummary", "PolicyRun"]


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
        slo_attainment: share of requests meeting both TTFT and TPOT SLOs, 0..1.
        goodput_tokens_per_s: output tokens/s of requests meeting both SLOs, over the trace span.
        throughput_tokens_per_s: output tokens/s of all requests.
        gpu_hours: GPU-hours provisioned (pods counted from scale-out until removed, start-up included).
        ttft_p_s / tpot_p_s: TTFT / TPOT at the SLO percentile, seconds.
        requests: requests in the trace.
        scale_events: changes of target.
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


@dataclass
class PolicyRun:
    """Everything one policy produced on one trace."""

    policy: str
    summary: PolicySummary
    records: list[RequestRecord] = field(default_factory=list)
    timeline: list[TimelinePoint] = field(default_factory=list)
    forecasts: list[ForecastPoint] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
