"""What the simulator measures: windowed observations for the planner, and the run's summary.

:class:`MetricsRecorder` keeps append-only, time-sorted logs (arrivals, first tokens, completions, and the
running integral of the number of requests in the system), so that :meth:`MetricsRecorder.observe` costs
O(log N + events in the window): each window is cut out of the logs by bisection.

Demand is measured at admission — a request counts in the window of its arrival, whether or not it has been
served — as DESIGN.md asks ("demand measured at completion hides queueing during bursts"). The first window
of a run, ``(now − window, now]`` with ``now − window <= 0``, is taken as ``[0, now]`` so a request arriving at
exactly ``t = 0`` is counted.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from fulcrum.api.llmserve import SLOSpec
from fulcrum.observation import QUANTILE_LEVELS, Observation, ReadyCounts
from fulcrum.simulator.records import RequestRecord

__all__ = ["ClusterSnapshot", "MetricsRecorder", "percentile", "summarize"]

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class ClusterSnapshot:
    """Instantaneous cluster state the observation carries (at its end time).

    Attributes:
        prefill_queue: requests waiting for a prefill (shared P queue, unified and local requests not yet
            started), count.
        decode_queue: requests that have their first token and wait for a decode slot (KV memory or batch
            room, a decode instance to appear, or recomputation after preemption), count.
        kv_utilisation: mean KV cache usage of decode-capable instances, 0..1.
        ready: instances ready (and not draining) per pool.
    """

    prefill_queue: int = 0
    decode_queue: int = 0
    kv_utilisation: float = 0.0
    ready: ReadyCounts = field(default_factory=ReadyCounts)


def percentile(values: Sequence[float] | FloatArray, q: float) -> float:
    """The ``q``-th percentile (0..100, linear interpolation) of ``values``; ``inf`` entries allowed.

    numpy interpolates ``inf − inf`` to NaN; here a percentile that falls among infinite values (that gives any
    weight to one) is ``inf``, and one between two finite values is ``numpy.percentile``'s, to the last bit (what
    a user computes from ``fulcrum replay --records``). NaN when ``values`` is empty.
    """
    arr = np.sort(np.asarray(values, dtype=float))
    n = arr.size
    if n == 0:
        return math.nan
    if np.isfinite(arr[-1]):
        return float(np.percentile(arr, q))
    finite = np.isfinite(arr)
    if not finite.any():
        return math.inf
    # numpy's own interpolation, with the infinite values stood in for by the largest float: a result that leans
    # on one at all lands beyond the largest finite value (weight ≥ 1e-16 of ~1.8e308), and is then inf
    largest = float(arr[finite][-1])
    value = float(np.percentile(np.where(finite, arr, np.finfo(float).max), q))
    return value if value <= largest else math.inf


class MetricsRecorder:
    """Logs of one simulation run, and the windowed :class:`~fulcrum.observation.Observation` built on them.

    Args:
        arrivals / isl / osl: per request in arrival order: arrival times (s, sorted), prompt and output
            tokens; shape (n,).
        slo: the SLOs attainment is measured against.

    The cluster calls :meth:`arrive`, :meth:`first_token` and :meth:`finish` as events happen, in time order.
    """

    def __init__(self, arrivals: FloatArray, isl: FloatArray, osl: FloatArray, slo: SLOSpec) -> None:
        self._arr = arrivals
        self._isl = isl
        self._osl = osl
        self._slo = slo
        self._ttft_slo = slo.ttft_ms / 1e3
        self._tpot_slo = slo.tpot_ms / 1e3
        # first tokens: time, TTFT
        self._ft_t: list[float] = []
        self._ft_v: list[float] = []
        # completions: time, TTFT, TPOT
        self._c_t: list[float] = []
        self._c_ttft: list[float] = []
        self._c_tpot: list[float] = []
        # requests in the system N(t): change times, ∫_0^t N, N after the change
        self._n = 0
        self._cum = 0.0
        self._last = 0.0
        self._n_t: list[float] = [0.0]
        self._n_cum: list[float] = [0.0]
        self._n_val: list[int] = [0]

    def _change(self, t: float, delta: int) -> None:
        self._cum += self._n * (t - self._last)
        self._last = t
        self._n += delta
        if self._n_t[-1] == t:
            self._n_cum[-1] = self._cum
            self._n_val[-1] = self._n
        else:
            self._n_t.append(t)
            self._n_cum.append(self._cum)
            self._n_val.append(self._n)

    def arrive(self, t: float) -> None:
        """A request was admitted at ``t`` seconds."""
        self._change(t, +1)

    def first_token(self, t: float, ttft: float) -> None:
        """A first token came out at ``t`` seconds, ``ttft`` seconds after its request's arrival."""
        self._ft_t.append(t)
        self._ft_v.append(ttft)

    def finish(self, t: float, ttft: float, tpot: float) -> None:
        """A request finished at ``t`` seconds with these TTFT and TPOT (seconds)."""
        self._c_t.append(t)
        self._c_ttft.append(ttft)
        self._c_tpot.append(tpot)
        self._change(t, -1)

    def in_system(self) -> int:
        """Requests admitted and not finished, now."""
        return self._n

    def _integral(self, x: float) -> float:
        """∫_0^x N(t) dt."""
        i = bisect_right(self._n_t, x) - 1
        if i < 0:
            return 0.0
        return self._n_cum[i] + self._n_val[i] * (x - self._n_t[i])

    def observe(self, now: float, window_s: float, state: ClusterSnapshot) -> Observation:
        """Measurements over ``(now − window_s, now]`` (see the module docstring for the first window).

        Raises:
            ValueError: ``window_s`` is not positive.
        """
        if not window_s > 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        lo = now - window_s
        lo_key = lo if lo > 0 else -math.inf
        start = max(lo, 0.0)

        a = int(np.searchsorted(self._arr, lo_key, side="right"))
        b = int(np.searchsorted(self._arr, now, side="right"))
        n_arr = b - a
        isl = self._isl[a:b]
        osl = self._osl[a:b]
        if n_arr:
            mean_isl = float(isl.mean())
            mean_osl = float(osl.mean())
            isl_q = tuple(float(v) for v in np.quantile(isl, QUANTILE_LEVELS))
            osl_q = tuple(float(v) for v in np.quantile(osl, QUANTILE_LEVELS))
            isl_sq = float(np.mean(isl * isl))
        else:
            mean_isl = mean_osl = isl_sq = 0.0
            isl_q = osl_q = ()
        cv2 = 1.0
        if n_arr >= 3:
            gaps = np.diff(self._arr[a:b])
            m = float(gaps.mean())
            if m > 0:
                cv2 = float(gaps.var(ddof=1)) / (m * m)

        span = now - start
        conc = (self._integral(now) - self._integral(start)) / span if span > 0 else float(self._n)

        fa = bisect_right(self._ft_t, lo_key)
        fb = bisect_right(self._ft_t, now)
        ttfts = np.asarray(self._ft_v[fa:fb], dtype=float)
        ca = bisect_right(self._c_t, lo_key)
        cb = bisect_right(self._c_t, now)
        c_ttft = np.asarray(self._c_ttft[ca:cb], dtype=float)
        c_tpot = np.asarray(self._c_tpot[ca:cb], dtype=float)

        q = self._slo.percentile
        ttft_ok = ttfts <= self._ttft_slo
        tpot_ok = c_tpot <= self._tpot_slo
        both_ok = tpot_ok & (c_ttft <= self._ttft_slo)
        return Observation(
            time_s=now,
            interval_s=window_s,
            arrivals=n_arr,
            mean_isl=mean_isl,
            mean_osl=mean_osl,
            isl_quantiles=isl_q,
            osl_quantiles=osl_q,
            isl_sq_mean=isl_sq,
            arrival_cv2=cv2,
            concurrency=conc,
            completed=cb - ca,
            ttft_attainment=float(ttft_ok.mean()) if ttfts.size else math.nan,
            tpot_attainment=float(tpot_ok.mean()) if c_tpot.size else math.nan,
            slo_attainment=float(both_ok.mean()) if c_tpot.size else math.nan,
            ttft_p_s=percentile(ttfts, q),
            tpot_p_s=percentile(c_tpot, q),
            prefill_queue=state.prefill_queue,
            decode_queue=state.decode_queue,
            kv_utilisation=state.kv_utilisation,
            ready=state.ready,
        )


def summarize(records: Sequence[RequestRecord], slo: SLOSpec, gpu_seconds: float, end_s: float) -> dict[str, float]:
    """Headline figures of a run (the fields of :class:`~fulcrum.replay.result.PolicySummary`).

    Every request of the trace counts; an unfinished one (``inf`` times) misses the SLOs it has no time for.

    Returns:
        ``slo_attainment`` (share meeting both TTFT and TPOT SLOs), ``ttft_attainment``, ``tpot_attainment``
        (0..1; NaN for an empty trace); ``goodput_tokens_per_s`` (output tokens of requests meeting both SLOs
        per second of trace span) and ``throughput_tokens_per_s`` (output tokens of finished requests per
        second of trace span), the span being first → last arrival (first arrival → ``end_s`` when all arrive
        together; 0 tokens/s if that is 0 too); ``gpu_hours`` (∫ provisioned GPUs dt / 3600);
        ``ttft_p_s`` / ``tpot_p_s`` (at ``slo.percentile``, seconds; ``inf`` when the percentile falls on
        unserved requests); ``requests``.
    """
    n = len(records)
    gpu_hours = gpu_seconds / 3600.0
    if n == 0:
        nan = math.nan
        return {
            "slo_attainment": nan,
            "goodput_tokens_per_s": 0.0,
            "throughput_tokens_per_s": 0.0,
            "gpu_hours": gpu_hours,
            "ttft_p_s": nan,
            "tpot_p_s": nan,
            "ttft_attainment": nan,
            "tpot_attainment": nan,
            "requests": 0.0,
        }
    arrival = np.fromiter((r.arrival_s for r in records), dtype=float, count=n)
    osl = np.fromiter((r.osl for r in records), dtype=float, count=n)
    ttft = np.fromiter((r.ttft_s for r in records), dtype=float, count=n)
    tpot = np.fromiter((r.tpot_s for r in records), dtype=float, count=n)
    finish = np.fromiter((r.finish_s for r in records), dtype=float, count=n)
    ttft_ok = ttft <= slo.ttft_ms / 1e3
    tpot_ok = tpot <= slo.tpot_ms / 1e3
    both = ttft_ok & tpot_ok
    span = float(arrival.max() - arrival.min())
    if span <= 0:
        span = end_s - float(arrival.min())
    done = np.isfinite(finish)
    good = float(osl[both].sum())
    total = float(osl[done].sum())
    return {
        "slo_attainment": float(both.mean()),
        "goodput_tokens_per_s": good / span if span > 0 else 0.0,
        "throughput_tokens_per_s": total / span if span > 0 else 0.0,
        "gpu_hours": gpu_hours,
        "ttft_p_s": percentile(ttft, slo.percentile),
        "tpot_p_s": percentile(tpot, slo.percentile),
        "ttft_attainment": float(ttft_ok.mean()),
        "tpot_attainment": float(tpot_ok.mean()),
        "requests": float(n),
    }
