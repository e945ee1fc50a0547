"""Per-interval load series of a trace: what the forecaster sees each planner interval.

DOPD forecasts, per interval, the request rate and the mean input and output lengths
(DOPD §II-A, Alg. 2 lines 5–9); :func:`interval_series` turns a request list into those series.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from fulcrum.workload import Request

__all__ = ["interval_series"]


def interval_series(
    requests: Sequence[Request], interval_s: float, *, n_intervals: int | None = None
) -> dict[str, list[float]]:
    """Bin requests by arrival into intervals ``[k·T, (k+1)·T)`` of ``T = interval_s`` seconds.

    Args:
        requests: requests with ``arrival_s >= 0`` (any order).
        interval_s: interval length T, seconds (> 0), e.g. the planner interval.
        n_intervals: number of intervals to return; requests arriving at or after
            ``n_intervals · T`` are left out. ``None`` = up to and including the interval of the last
            arrival (which may be partial, so its rate is a lower bound of the true rate).

    Returns:
        ``{"rate": ..., "isl": ..., "osl": ...}``, each a list with one float per interval:
        ``rate`` = arrivals per second in the interval (0.0 when none arrived); ``isl`` / ``osl`` =
        mean input / output tokens of the requests arriving in it (``nan`` when none arrived, since a
        mean of nothing is undefined — forecasters must mask or carry over those points).
        Empty lists when there are no requests and ``n_intervals`` is ``None``.

    Raises:
        ValueError: ``interval_s`` is not a finite number > 0, ``n_intervals`` < 0, or an arrival is
            negative or not finite.
    """
    if not (math.isfinite(interval_s) and interval_s > 0):
        raise ValueError(f"interval_s must be a finite number > 0, got {interval_s}")
    if n_intervals is not None and n_intervals < 0:
        raise ValueError(f"n_intervals must be >= 0, got {n_intervals}")
    arrivals = np.fromiter((r.arrival_s for r in requests), dtype=float, count=len(requests))
    if arrivals.size and not (np.all(np.isfinite(arrivals)) and arrivals.min() >= 0):
        raise ValueError("arrival_s must be finite and >= 0 for every request")
    bins = np.floor(arrivals / interval_s).astype(np.int64)
    n = n_intervals if n_intervals is not None else (int(bins.max()) + 1 if bins.size else 0)
    keep = bins < n
    bins = bins[keep]
    isl = np.fromiter((r.isl for r in requests), dtype=float, count=len(requests))[keep]
    osl = np.fromiter((r.osl for r in requests), dtype=float, count=len(requests))[keep]
    counts = np.bincount(bins, minlength=n).astype(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_isl = np.bincount(bins, weights=isl, minlength=n) / counts
        mean_osl = np.bincount(bins, weights=osl, minlength=n) / counts
    mean_isl[counts == 0] = np.nan
    mean_osl[counts == 0] = np.nan
    return {
        "rate": (counts / interval_s).tolist(),
        "isl": mean_isl.tolist(),
        "osl": mean_osl.tolist(),
    }
