"""What the planner loop sees of the serving load in one interval.

The same :class:`Observation` comes from Prometheus in a cluster (router admission-side metrics and vLLM
metrics) and from the simulator in ``fulcrum replay``. Demand is measured at admission (arrivals), never at
completion, so queueing during a burst is visible as demand (DESIGN: "demand measured at completion hides
queueing").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fulcrum.target import Pool

__all__ = ["QUANTILE_LEVELS", "Observation", "ReadyCounts"]

#: Quantile levels of the ISL/OSL distributions carried in observations and forecasts.
QUANTILE_LEVELS: tuple[float, ...] = (0.1, 0.25, 0.5, 0.75, 0.9, 0.99)


@dataclass(frozen=True)
class ReadyCounts:
    """Instances ready to serve at the end of the interval, per pool."""

    prefill: int = 0
    decode: int = 0
    unified: int = 0

    def of(self, pool: Pool) -> int:
        """Ready instances of ``pool``."""
        if pool is Pool.PREFILL:
            return self.prefill
        if pool is Pool.DECODE:
            return self.decode
        return self.unified

    @property
    def total(self) -> int:
        """Ready instances in all pools."""
        return self.prefill + self.decode + self.unified


@dataclass(frozen=True)
class Observation:
    """Load and service measured over one planner interval ``(time_s - interval_s, time_s]``.

    Attributes:
        time_s: end of the interval, seconds since the start of the run.
        interval_s: interval length T, seconds.
        arrivals: requests admitted in the interval (count).
        mean_isl: mean prompt length of admitted requests, tokens (0 when none arrived).
        mean_osl: mean output length, tokens: of requests admitted in the interval where known (replay knows
            each request's OSL; in a cluster: the router's predicted OSL at admission, or completions).
        isl_quantiles: ISL at :data:`QUANTILE_LEVELS`, tokens (empty when none arrived).
        osl_quantiles: OSL at :data:`QUANTILE_LEVELS`, tokens (empty when unknown).
        isl_sq_mean: E[ISL²] of admitted requests, tokens² (DOPD eq. 7), 0 when none.
        arrival_cv2: squared coefficient of variation of inter-arrival times c_a² (DOPD eq. 10); 1.0 (Poisson)
            when fewer than three arrivals.
        concurrency: time-averaged requests in the system (admitted, not finished), count.
        completed: requests finished in the interval (count).
        ttft_attainment: share of requests whose first token came in the interval with TTFT ≤ SLO; NaN if none.
        tpot_attainment: share of requests finished in the interval with TPOT ≤ SLO; NaN if none.
        slo_attainment: share of requests finished in the interval meeting both SLOs; NaN if none.
        ttft_p_s: TTFT at the SLO percentile over first tokens in the interval, seconds; NaN if none.
        tpot_p_s: TPOT at the SLO percentile over finished requests, seconds; NaN if none.
        prefill_queue: requests waiting for prefill at the end of the interval.
        decode_queue: requests waiting for a decode slot (KV memory) at the end of the interval.
        kv_utilisation: mean KV cache usage of decode-capable instances, 0..1; NaN when unknown (an exporter
            answered no share, e.g. percent: the KV-based scale-out checks then skip it).
        ready: instances ready per pool at the end of the interval.
    """

    time_s: float
    interval_s: float
    arrivals: int
    mean_isl: float
    mean_osl: float
    isl_quantiles: tuple[float, ...] = ()
    osl_quantiles: tuple[float, ...] = ()
    isl_sq_mean: float = 0.0
    arrival_cv2: float = 1.0
    concurrency: float = 0.0
    completed: int = 0
    ttft_attainment: float = math.nan
    tpot_attainment: float = math.nan
    slo_attainment: float = math.nan
    ttft_p_s: float = math.nan
    tpot_p_s: float = math.nan
    prefill_queue: int = 0
    decode_queue: int = 0
    kv_utilisation: float = 0.0
    ready: ReadyCounts = field(default_factory=ReadyCounts)

    @property
    def rate_rps(self) -> float:
        """Arrival rate over the interval, requests per second."""
        return self.arrivals / self.interval_s if self.interval_s > 0 else 0.0
