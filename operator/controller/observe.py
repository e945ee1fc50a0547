"""Observe: one planner interval's :class:`~fulcrum.observation.Observation` from Prometheus.

Demand comes from the router's admission-side metrics (``fulcrum_router_*``, ``router/metrics.py``): arrivals,
prompt lengths and predicted output lengths are counted when a request is admitted, so a burst that queues is
seen as demand at once (DESIGN, "demand measured at completion hides queueing"). Service (TTFT, TPOT, SLO
attainment) comes from the router's client-side histograms; queues and KV usage from vLLM's own gauges
(``vllm:*``, the names in DESIGN) on the worker pods. Ready instance counts are not Prometheus' business: the
caller passes the pool Deployments' ``status.readyReplicas`` (one source of truth, no kube-state-metrics needed).

Every PromQL query is a documented module constant (one per series; ``docs/operator.md`` lists them). They are
templates over ``{router}`` (label matchers selecting the router's series), ``{pods}`` (the worker pods of a
pool) and ``{window}`` (the interval, e.g. ``60s``). Histograms are fetched as whole bucket vectors and their
quantiles and the share under an SLO computed here with Prometheus' own interpolation (linear within a bucket),
so any SLO works, not only one that falls on a bucket boundary.

Errors: Prometheus unreachable, answering an error, or holding no router series at all raises
:class:`fulcrum.cluster.ObservationError`; the loop then keeps its last plan and reports Degraded (never scales in blind).
So do answers that are no usable load: NaN or infinite arrivals; a prefill queue, decode queue, concurrency or
completions series that is present but answers NaN or ±Inf (each moves the plan or the reactive guard, and read as
0 it would move them wrongly; an absent one is 0: nothing waiting, in flight or finished); and finite values no
deployment of one model reaches (:data:`MAX_ARRIVAL_RATE_RPS`, :data:`MAX_REQUESTS_IN_SYSTEM`,
:data:`MAX_MEAN_TOKENS`): a one-scrape glitch or a counter mishap, planned as load, would scale to ``maxGPUs`` for
several intervals. A KV cache usage answering NaN or ±Inf, or above :data:`MAX_KV_USAGE` (no share: an exporter
reporting percent), is read as unknown (NaN, logged), not as an empty or a full cache: only the KV-based scale-out
checks need it and they take NaN as no signal, so the rest of the observation still plans.

History (:meth:`PrometheusObserver.history`): the same queries as range queries (``query_range``, step = the
interval), one Observation per past interval, so a forecaster that starts with the operator (a restart, a new
spec generation) is fitted on the load Prometheus kept instead of starting cold (DOPD Alg. 2 needs a window of
past intervals before its ARIMA forecasts are its own).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Protocol

from fulcrum.cluster import ObservationError
from fulcrum.observation import QUANTILE_LEVELS, Observation, ReadyCounts

log = logging.getLogger(__name__)

__all__ = [
    "QueryClient",
    "Selectors",
    "PrometheusObserver",
    "histogram_quantile",
    "histogram_share_below",
    "Q_ARRIVALS",
    "Q_INPUT_TOKENS_SUM",
    "Q_INPUT_TOKENS_COUNT",
    "Q_INPUT_TOKENS_BUCKETS",
    "Q_OUTPUT_TOKENS_SUM",
    "Q_OUTPUT_TOKENS_COUNT",
    "Q_OUTPUT_TOKENS_BUCKETS",
    "Q_PREDICTED_OUTPUT_SUM",
    "Q_PREDICTED_OUTPUT_COUNT",
    "Q_COMPLETED",
    "Q_CONCURRENCY",
    "Q_TTFT_BUCKETS",
    "Q_TPOT_BUCKETS",
    "Q_PREFILL_QUEUE",
    "Q_PREFILL_QUEUE_NATS",
    "Q_DECODE_QUEUE",
    "Q_KV_USAGE",
    "ALL_QUERIES",
    "MAX_ARRIVAL_RATE_RPS",
    "MAX_REQUESTS_IN_SYSTEM",
    "MAX_MEAN_TOKENS",
    "MAX_KV_USAGE",
]

# ------------------------------------------------------------------------------------------------ plausibility
# Bounds above which an answer is a glitch (a bad scrape, a counter reset read as an increase, a broken exporter),
# not load: the interval is an ObservationError and the loop holds. Each is orders of magnitude above anything one
# LLMServe (one model) can reach, so no real load is ever refused; below them values are taken as they are.

#: Arrivals (and completions) per second above which the series is a glitch, requests/s. A whole fleet of H100s
#: serving a 70B model finishes ~1e4 requests/s; 1e6 is a hundred such fleets behind one router.
MAX_ARRIVAL_RATE_RPS = 1e6
#: Requests waiting (prefill queue, decode queue) or in flight (concurrency) at once above which the series is a
#: glitch. Each waiting request holds its prompt in router or engine memory: 1e9 of them is terabytes of prompts.
MAX_REQUESTS_IN_SYSTEM = 1e9
#: Mean prompt or output length above which the series is a glitch, tokens: ``2**31 - 1``, the bound the trace
#: reader (``fulcrum.traces.reader``) puts on one request's lengths; no engine takes such a request.
MAX_MEAN_TOKENS = 2**31 - 1
#: KV cache usage above which the answer is no share (vLLM's ``kv_cache_usage_perc`` is a fraction, 0..1, despite its
#: name): an exporter reporting percent, or a glitch, read as unknown (NaN). Read as a full cache it set off the
#: reactive guard's and dynamo-load's scale-outs. The 1% above 1 absorbs float rounding (read as 1).
MAX_KV_USAGE = 1.01

# ------------------------------------------------------------------------------------------------ PromQL
#: Requests admitted by the router in the interval (count). Empty answer = the router is not scraped → error.
Q_ARRIVALS = "sum(increase(fulcrum_router_requests_admitted_total{{{router}}}[{window}]))"
#: Prompt tokens admitted in the interval (sum of ISL), tokens.
Q_INPUT_TOKENS_SUM = "sum(increase(fulcrum_router_input_tokens_sum{{{router}}}[{window}]))"
#: Prompts admitted in the interval (the ISL histogram's count).
Q_INPUT_TOKENS_COUNT = "sum(increase(fulcrum_router_input_tokens_count{{{router}}}[{window}]))"
#: ISL histogram of the interval, one sample per ``le`` bucket (tokens).
Q_INPUT_TOKENS_BUCKETS = "sum by (le) (increase(fulcrum_router_input_tokens_bucket{{{router}}}[{window}]))"
#: Generated tokens of requests finished in the interval (sum of OSL), tokens.
Q_OUTPUT_TOKENS_SUM = "sum(increase(fulcrum_router_output_tokens_sum{{{router}}}[{window}]))"
#: Requests finished in the interval with a known OSL.
Q_OUTPUT_TOKENS_COUNT = "sum(increase(fulcrum_router_output_tokens_count{{{router}}}[{window}]))"
#: OSL histogram of the interval (finished requests), tokens.
Q_OUTPUT_TOKENS_BUCKETS = "sum by (le) (increase(fulcrum_router_output_tokens_bucket{{{router}}}[{window}]))"
#: Predicted output tokens of requests admitted in the interval (the OSL when nothing finished yet).
Q_PREDICTED_OUTPUT_SUM = "sum(increase(fulcrum_router_predicted_output_tokens_sum{{{router}}}[{window}]))"
#: Requests admitted in the interval with a predicted OSL.
Q_PREDICTED_OUTPUT_COUNT = "sum(increase(fulcrum_router_predicted_output_tokens_count{{{router}}}[{window}]))"
#: Requests finished in the interval (end-to-end latency observations).
Q_COMPLETED = "sum(increase(fulcrum_router_e2e_seconds_count{{{router}}}[{window}]))"
#: Time-averaged requests dispatched and not finished over the interval, all instances.
Q_CONCURRENCY = "sum(avg_over_time(fulcrum_router_instance_inflight{{{router}}}[{window}]))"
#: TTFT histogram of the interval (seconds), as the client saw it.
Q_TTFT_BUCKETS = "sum by (le) (increase(fulcrum_router_ttft_seconds_bucket{{{router}}}[{window}]))"
#: TPOT histogram of the interval (seconds per output token after the first).
Q_TPOT_BUCKETS = "sum by (le) (increase(fulcrum_router_tpot_seconds_bucket{{{router}}}[{window}]))"
#: Requests waiting in the engines of prefill-capable pools (prefill + unified) now.
Q_PREFILL_QUEUE = "sum(vllm:num_requests_waiting{{{prefill_pods}}})"
#: Prefill jobs in the NATS queue not yet taken by a prefill worker (router ``prefill_queue: nats``); every router
#: replica reports the same stream, hence ``max``.
Q_PREFILL_QUEUE_NATS = "max(fulcrum_router_prefill_queue_depth{{{router}}})"
#: Requests waiting in the engines of the decode pool now (no KV room).
Q_DECODE_QUEUE = "sum(vllm:num_requests_waiting{{{decode_pods}}})"
#: Mean KV cache usage (0..1) of decode-capable engines now; older vLLM releases call it gpu_cache_usage_perc.
Q_KV_USAGE = "avg(vllm:kv_cache_usage_perc{{{decode_pods}}} or vllm:gpu_cache_usage_perc{{{decode_pods}}})"

#: Every query template, by series name (documentation and tests).
ALL_QUERIES: dict[str, str] = {
    "arrivals": Q_ARRIVALS,
    "input_tokens_sum": Q_INPUT_TOKENS_SUM,
    "input_tokens_count": Q_INPUT_TOKENS_COUNT,
    "input_tokens_buckets": Q_INPUT_TOKENS_BUCKETS,
    "output_tokens_sum": Q_OUTPUT_TOKENS_SUM,
    "output_tokens_count": Q_OUTPUT_TOKENS_COUNT,
    "output_tokens_buckets": Q_OUTPUT_TOKENS_BUCKETS,
    "predicted_output_sum": Q_PREDICTED_OUTPUT_SUM,
    "predicted_output_count": Q_PREDICTED_OUTPUT_COUNT,
    "completed": Q_COMPLETED,
    "concurrency": Q_CONCURRENCY,
    "ttft_buckets": Q_TTFT_BUCKETS,
    "tpot_buckets": Q_TPOT_BUCKETS,
    "prefill_queue": Q_PREFILL_QUEUE,
    "prefill_queue_nats": Q_PREFILL_QUEUE_NATS,
    "decode_queue": Q_DECODE_QUEUE,
    "kv_usage": Q_KV_USAGE,
}


class QueryClient(Protocol):
    """What the observer needs of a Prometheus client (``prometheus_api_client.PrometheusConnect`` has it)."""

    def custom_query(self, query: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]: ...

    def custom_query_range(self, query: str, start_time: datetime, end_time: datetime, step: str,
                           params: dict[str, Any] | None = None) -> list[dict[str, Any]]: ...


@dataclass(frozen=True)
class Selectors:
    """PromQL label matchers (the text inside ``{...}``) that pick one LLMServe's series.

    Attributes:
        router: the router's series. Default: the scrape job of the router Service in the namespace
            (a ServiceMonitor names the job after the Service, ``<name>-router``).
        prefill_pods: worker pods of the prefill-capable pools (prefill and unified).
        decode_pods: worker pods of the decode-capable pools (decode and unified).
    """

    router: str
    prefill_pods: str
    decode_pods: str

    @classmethod
    def for_llmserve(cls, name: str, namespace: str) -> "Selectors":
        """The default matchers for LLMServe ``name`` in ``namespace`` (pod names ``<name>-<pool>-…``)."""
        ns = f'namespace="{namespace}"'
        return cls(
            router=f'{ns},job="{name}-router"',
            prefill_pods=f'{ns},pod=~"{name}-(prefill|unified)-.*"',
            decode_pods=f'{ns},pod=~"{name}-(decode|unified)-.*"',
        )


def _buckets(result: Sequence[dict[str, Any]]) -> list[tuple[float, float]]:
    """``[(le, cumulative count)]`` sorted by ``le`` from a ``sum by (le)`` answer; ``[]`` (no histogram, so
    NaN quantiles and attainment: unknown) when the ``+Inf`` bucket is absent or answers no finite count.

    The ``+Inf`` bucket is the histogram's total: without it the observations above the highest finite bound
    would be left out (an attainment read too high, a quantile too low). A finite bucket whose count is NaN or
    infinite, or whose ``le`` is no number, is skipped: the counts are cumulative, so the next bucket still holds
    its observations and only the resolution drops. Counts that fall with a rising bound (``increase()``'s
    extrapolation over a counter reset) are raised to the running maximum, as PromQL's ``histogram_quantile``
    does, so a share never goes backwards.
    """
    out: list[tuple[float, float]] = []
    total: float | None = None
    for r in result:
        le = r.get("metric", {}).get("le")
        if le is None:
            continue
        try:
            bound = float(le)  # float("+Inf") parses
        except (TypeError, ValueError):
            continue  # a label that is no number (a broken exporter): the bucket is skipped
        if math.isnan(bound):
            continue
        v = _value(r)
        if math.isinf(bound) and bound > 0:
            total = v
        elif math.isfinite(v):
            out.append((bound, v))
    if total is None or not math.isfinite(total):
        if out:
            log.warning("histogram without a usable +Inf bucket (%s): read as unknown",
                        "absent" if total is None else f"{total!r}")
        return []
    out.sort()
    out.append((math.inf, total))
    running = 0.0
    monotone: list[tuple[float, float]] = []
    for bound, c in out:
        running = max(running, c)
        monotone.append((bound, running))
    return monotone


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float:
    """The ``q`` quantile of a cumulative histogram, interpolated linearly within the bucket (as PromQL's
    ``histogram_quantile``; the lowest bucket starts at 0; a quantile in the +Inf bucket is the highest finite
    bound). NaN when the histogram is empty.

    Args:
        q: quantile level in [0, 1].
        buckets: ``(upper bound, cumulative count)`` pairs sorted by bound, the last ``+Inf``.
    """
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return prev_le


def histogram_share_below(x: float, buckets: Sequence[tuple[float, float]]) -> float:
    """Share of observations ≤ ``x`` in a cumulative histogram (linear within the bucket holding ``x``); NaN
    when empty. The SLO attainment of a latency histogram at target ``x`` seconds."""
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    total = buckets[-1][1]
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if x <= le:
            if math.isinf(le):
                return prev_c / total
            frac = (x - prev_le) / (le - prev_le) if le > prev_le else 1.0
            return min(1.0, (prev_c + frac * (c - prev_c)) / total)
        prev_le, prev_c = le, c
    return 1.0


def _duration(seconds: float) -> str:
    """A PromQL duration of whole seconds, at least ``1s``."""
    return f"{max(int(round(seconds)), 1)}s"


def _value(r: dict[str, Any]) -> float:
    try:
        return float(r["value"][1])
    except (KeyError, IndexError, TypeError, ValueError):
        return math.nan


class PrometheusObserver:
    """Builds one :class:`Observation` per interval from PromQL answers (see module doc).

    Args:
        client: a Prometheus query client (``PrometheusConnect(url)``).
        selectors: label matchers of this LLMServe's series.
        ttft_slo_s: TTFT target, seconds; tpot_slo_s: TPOT target, seconds; percentile: SLO percentile (e.g. 90).
    """

    def __init__(self, client: QueryClient, selectors: Selectors, *, ttft_slo_s: float, tpot_slo_s: float,
                 percentile: float, max_model_len: int | None = None) -> None:
        self.client = client
        self.selectors = selectors
        self.ttft_slo_s = ttft_slo_s
        self.tpot_slo_s = tpot_slo_s
        self.percentile = percentile
        self.max_model_len = max_model_len

    def _promql(self, template: str, window_s: float) -> str:
        s = self.selectors
        return template.format(router=s.router, prefill_pods=s.prefill_pods, decode_pods=s.decode_pods,
                               window=_duration(window_s))

    def query(self, template: str, window_s: float) -> list[dict[str, Any]]:
        """Run one query template over a ``window_s`` window.

        Raises:
            ObservationError: Prometheus unreachable or answering an error (the cause chained).
        """
        promql = self._promql(template, window_s)
        try:
            return list(self.client.custom_query(promql))
        except Exception as err:  # requests' ConnectionError/Timeout, PrometheusApiClientException, bad JSON
            raise ObservationError(f"Prometheus query failed ({type(err).__name__}: {err}) for {promql}") from err

    def observe(self, time_s: float, interval_s: float, ready: ReadyCounts) -> Observation:
        """The Observation of the interval ``(time_s - interval_s, time_s]``.

        Args:
            time_s: end of the interval, seconds (the caller's clock; only carried into the Observation).
            interval_s: interval length, seconds (the PromQL window).
            ready: ready instances per pool (from the Deployments' status).

        Raises:
            ObservationError: Prometheus unreachable/failing, no router series at all (not scraped), or answers
                that are no usable load (:meth:`_observation`).
        """
        return self._observation(time_s, interval_s, ready, lambda template: self.query(template, interval_s))

    def history(self, end_s: float, interval_s: float, count: int, ready: ReadyCounts) -> list[Observation]:
        """The Observations of the ``count`` intervals ending at ``end_s - k·interval_s`` (k = count−1 … 0),
        oldest first, from range queries (one ``query_range`` per query template, step ``interval_s``).

        Intervals in which the router had no series (before it existed, or a scrape gap) are left out, so the
        list may be shorter than ``count``, or empty; so are intervals whose answers are no usable load (the
        :class:`ObservationError` cases of :meth:`observe` other than Prometheus failing). ``ready`` is carried into every Observation (Prometheus
        does not hold the Deployments' ready counts; the forecaster does not read them).

        Args:
            end_s: end of the newest interval, Unix seconds (Prometheus' time axis).
            interval_s: interval length, seconds (the PromQL window and the range step).
            count: intervals wanted, ≥ 1.

        Raises:
            ValueError: ``count`` < 1 or ``interval_s`` ≤ 0.
            ObservationError: Prometheus unreachable or answering an error.
        """
        if count < 1 or not interval_s > 0:
            raise ValueError(f"need count >= 1 and interval_s > 0, got {count} and {interval_s}")
        start_s = end_s - (count - 1) * interval_s
        by_template: dict[str, dict[float, list[dict[str, Any]]]] = {}

        def at(template: str) -> dict[float, list[dict[str, Any]]]:
            if template not in by_template:
                by_template[template] = self._range(template, interval_s, start_s, end_s)
            return by_template[template]

        out: list[Observation] = []
        for t in sorted(at(Q_ARRIVALS)):
            def samples_at(template: str, t: float = t) -> list[dict[str, Any]]:
                return at(template).get(t, [])
            try:
                out.append(self._observation(t, interval_s, ready, samples_at))
            except ObservationError:
                continue  # a past interval with unusable answers: left out, as a scrape gap
        return out

    def _range(self, template: str, interval_s: float, start_s: float, end_s: float) -> dict[float, list[dict[str, Any]]]:
        """One range query → {evaluation time (s, ms-rounded): instant-query-shaped samples at that time}."""
        promql = self._promql(template, interval_s)
        try:
            series = self.client.custom_query_range(
                promql, start_time=datetime.fromtimestamp(start_s, tz=timezone.utc),
                end_time=datetime.fromtimestamp(end_s, tz=timezone.utc), step=_duration(interval_s))
        except Exception as err:  # requests' ConnectionError/Timeout, PrometheusApiClientException, bad JSON
            raise ObservationError(f"Prometheus range query failed ({type(err).__name__}: {err}) for {promql}") from err
        at: dict[float, list[dict[str, Any]]] = {}
        for one in series:
            for t, v in one.get("values", []):
                at.setdefault(round(float(t), 3), []).append({"metric": one.get("metric", {}), "value": [t, v]})
        return at

    def _observation(self, time_s: float, interval_s: float, ready: ReadyCounts,
                     fetch: Callable[[str], list[dict[str, Any]]]) -> Observation:
        """Build the Observation from ``fetch(template)`` answers (instant-query shaped).

        Raises:
            ObservationError: answers that are no usable load, so the loop holds instead of planning on them: no
                router series; arrivals NaN, infinite or without a value; arrivals but no usable mean prompt or
                output length (series missing, 0 or NaN: planning them as 1-token requests would empty the
                prefill pool); a mean prompt that is not finite or longer than ``max_model_len``; a prefill
                queue (either series), decode queue, concurrency or completions series answering a value that
                is not finite (NaN, ``±Inf`` or no value; the error names the series and the value; an absent
                series is 0); values no deployment reaches (``+Inf`` included): arrivals or completions above
                :data:`MAX_ARRIVAL_RATE_RPS` per second, a prefill queue (either series), decode queue or
                concurrency above :data:`MAX_REQUESTS_IN_SYSTEM`, a mean prompt or output length above
                :data:`MAX_MEAN_TOKENS`. (A KV cache usage answering NaN or ``±Inf``, or above
                :data:`MAX_KV_USAGE`, is read as unknown, NaN; an absent one as 0.) Negative values are still
                read as 0; a token sum or count answering NaN or absent reads as 0 (no length; with arrivals,
                the "no usable mean length" error above).
        """

        def scalar(template: str, default: float = 0.0) -> float:
            res = fetch(template)
            v = _value(res[0]) if res else math.nan
            return v if math.isfinite(v) else default

        def reading(template: str, bound: float, bound_text: str, describe: Callable[[float], str],
                    unusable: str) -> float:
            """A gauge or count the plan or the reactive guard decides on: an absent series is 0 (nothing
            waiting, nothing in flight, nothing finished); a present one answering NaN or ±Inf (or no value), or
            a value above ``bound`` (``+Inf`` included), is the error "Prometheus answered ``describe(value)``
            [, above the plausible ``bound_text``]: ``unusable``". Negative values are returned as they are
            (the caller clamps them to 0)."""
            res = fetch(template)
            if not res:
                return 0.0
            v = _value(res[0])
            if v > bound:
                raise ObservationError(
                    f"Prometheus answered {describe(v)}, above the plausible {bound_text}: {unusable}")
            if not math.isfinite(v):
                raise ObservationError(f"Prometheus answered {describe(v)}: {unusable}")
            return v

        arrivals_res = fetch(Q_ARRIVALS)
        if not arrivals_res:
            raise ObservationError(
                f"Prometheus has no router series for {{{self.selectors.router}}} (is the router scraped?)")
        arrivals_f = _value(arrivals_res[0])
        if not math.isfinite(arrivals_f):
            raw = arrivals_res[0].get("value")
            raise ObservationError(
                f"Prometheus answered arrivals {raw[1] if isinstance(raw, (list, tuple)) and len(raw) > 1 else raw!r} "
                f"for {{{self.selectors.router}}}: no usable request count")
        if interval_s > 0 and arrivals_f / interval_s > MAX_ARRIVAL_RATE_RPS:
            raise ObservationError(
                f"Prometheus answered {arrivals_f:g} arrivals in {interval_s:g} s ({arrivals_f / interval_s:g} "
                f"requests/s; fulcrum_router_requests_admitted_total) for {{{self.selectors.router}}}, above the "
                f"plausible {MAX_ARRIVAL_RATE_RPS:g} requests/s: no usable request count")
        arrivals = max(int(round(arrivals_f)), 0)
        isl_sum = scalar(Q_INPUT_TOKENS_SUM)
        isl_n = scalar(Q_INPUT_TOKENS_COUNT)
        isl_b = _buckets(fetch(Q_INPUT_TOKENS_BUCKETS))
        osl_sum = scalar(Q_OUTPUT_TOKENS_SUM)
        osl_n = scalar(Q_OUTPUT_TOKENS_COUNT)
        osl_b = _buckets(fetch(Q_OUTPUT_TOKENS_BUCKETS))
        if osl_n <= 0:  # nothing finished yet: the router's predicted OSL at admission
            osl_sum = scalar(Q_PREDICTED_OUTPUT_SUM)
            osl_n = scalar(Q_PREDICTED_OUTPUT_COUNT)
        ttft_b = _buckets(fetch(Q_TTFT_BUCKETS))
        tpot_b = _buckets(fetch(Q_TPOT_BUCKETS))
        ttft_att = histogram_share_below(self.ttft_slo_s, ttft_b)
        tpot_att = histogram_share_below(self.tpot_slo_s, tpot_b)
        # Joint attainment needs per-request data the histograms lack: min() is its upper bound, and the two
        # targets miss together under overload, when the bound is tight.
        both = [a for a in (ttft_att, tpot_att) if math.isfinite(a)]
        level = self.percentile / 100.0
        has_isl = bool(isl_b) and isl_b[-1][1] > 0
        has_osl = bool(osl_b) and osl_b[-1][1] > 0
        mean_isl = isl_sum / isl_n if isl_n > 0 else 0.0
        mean_osl = osl_sum / osl_n if osl_n > 0 else 0.0
        if arrivals > 0:
            if not (math.isfinite(mean_isl) and mean_isl > 0):
                raise ObservationError(
                    f"{arrivals} arrivals but no usable mean prompt length (input tokens sum {isl_sum:g} over "
                    f"count {isl_n:g}; are the fulcrum_router_input_tokens series scraped?)")
            if self.max_model_len is not None and mean_isl > self.max_model_len:
                raise ObservationError(
                    f"mean prompt length {mean_isl:g} tokens exceeds maxModelLen {self.max_model_len}: "
                    f"no load the engine can serve")
            if not (math.isfinite(mean_osl) and mean_osl > 0):
                raise ObservationError(
                    f"{arrivals} arrivals but no usable mean output length (output tokens sum {osl_sum:g} over "
                    f"count {osl_n:g}; are the fulcrum_router_output_tokens series scraped?)")
        # checked whether or not anything arrived (a length is carried into the Observation either way); an
        # overflowing mean (sum 1e300 over count 1e-300) with no arrivals is caught here too
        for what, tokens, mean, total, n in (("prompt", "input", mean_isl, isl_sum, isl_n),
                                             ("output", "output", mean_osl, osl_sum, osl_n)):
            if mean > MAX_MEAN_TOKENS:
                raise ObservationError(
                    f"Prometheus answered a mean {what} length of {mean:g} tokens ({tokens} tokens sum {total:g} over "
                    f"count {n:g}), above the plausible {MAX_MEAN_TOKENS} tokens: no usable load")
        # An absent series is 0: no engine waiting (no pod of the pool yet), no NATS queue, no request in flight or
        # finished. A present series answering NaN or ±Inf is no such 0 but a value nobody knows, as arrivals
        # answering NaN are a load nobody knows; so is one above the bound. Each of these moves a decision if read
        # as 0 (or as the glitch), so the interval is an ObservationError and the loop holds:
        # - prefill queue (either series): the reactive guard's prefill/unified scale-out, dynamo-load's prefill load;
        # - decode queue: the reactive guard's decode/unified scale-out (``decode_queue > 0``), its backlog-draining
        #   check, dynamo-load's decode load (0 reads as a cache with room: a scale-in);
        # - concurrency: dynamo-sla's decode correction factor (the ITL expected at 0 requests per instance is the
        #   lowest, so the observed ITL over it inflates the decode plan) and the concurrency series the forecasters
        #   learn (a 0 dragged into their forecast);
        # - completions: the reactive guard's sample count (0 silences it), dynamo-sla's demand (``completed``: a 0
        #   fed to its rate predictor plans the next intervals low), the weight of the interval's SLO attainment.
        # Above the bound, planned as load, each would scale out (queues, concurrency) or outweigh every past
        # interval's SLO attainment (completions).
        def queue(template: str, pool: str, series: str) -> float:
            return reading(template, MAX_REQUESTS_IN_SYSTEM, f"{MAX_REQUESTS_IN_SYSTEM:g} requests", lambda v: (
                f"a {pool} queue of {v:g} requests ({series})"), "no usable backlog")

        prefill_queue = (queue(Q_PREFILL_QUEUE, "prefill", "vllm:num_requests_waiting")  # two bounded gauges: finite
                         + queue(Q_PREFILL_QUEUE_NATS, "prefill", "fulcrum_router_prefill_queue_depth"))
        decode_queue = queue(Q_DECODE_QUEUE, "decode", "vllm:num_requests_waiting")
        concurrency = reading(Q_CONCURRENCY, MAX_REQUESTS_IN_SYSTEM, f"{MAX_REQUESTS_IN_SYSTEM:g} requests", lambda v: (
            f"a concurrency of {v:g} requests in flight (fulcrum_router_instance_inflight)"), "no usable load")
        # KV usage is the one gauge read as unknown (NaN) instead: only the KV-based scale-out checks need it and
        # they take NaN as no signal (the reactive guard's ``> 0.9`` is False, dynamo-load holds the decode pool),
        # so the rest of the observation still plans. Read as 0 a NaN was an empty cache (dynamo-load's scale-in);
        # an absent series (no decode-capable pod yet) is still 0.
        kv_res = fetch(Q_KV_USAGE)
        kv_usage = _value(kv_res[0]) if kv_res else 0.0
        if kv_usage > MAX_KV_USAGE:  # +Inf too: no share, whatever it is
            log.warning("Prometheus answered a KV cache usage of %g (vllm:kv_cache_usage_perc), above 1: it is a share "
                        "in 0..1 (does an exporter report percent?); read as unknown", kv_usage)
            kv_usage = math.nan
        elif not math.isfinite(kv_usage):  # NaN, -Inf or no value
            log.warning("Prometheus answered a KV cache usage of %g (vllm:kv_cache_usage_perc); read as unknown",
                        kv_usage)
            kv_usage = math.nan
        max_completed = MAX_ARRIVAL_RATE_RPS * interval_s if interval_s > 0 else math.inf

        def completions(v: float) -> str:
            rate = f"{v / interval_s:g} requests/s; " if interval_s > 0 else ""
            return f"{v:g} completions in {interval_s:g} s ({rate}fulcrum_router_e2e_seconds_count)"

        completed = reading(Q_COMPLETED, max_completed, f"{MAX_ARRIVAL_RATE_RPS:g} requests/s", completions,
                            "no usable completion count")
        return Observation(
            time_s=time_s,
            interval_s=interval_s,
            arrivals=arrivals,
            mean_isl=mean_isl,
            mean_osl=mean_osl,
            isl_quantiles=tuple(histogram_quantile(q, isl_b) for q in QUANTILE_LEVELS) if has_isl else (),
            osl_quantiles=tuple(histogram_quantile(q, osl_b) for q in QUANTILE_LEVELS) if has_osl else (),
            concurrency=max(concurrency, 0.0),
            completed=max(int(round(completed)), 0),
            ttft_attainment=ttft_att,
            tpot_attainment=tpot_att,
            slo_attainment=min(both) if both else math.nan,
            ttft_p_s=histogram_quantile(level, ttft_b),
            tpot_p_s=histogram_quantile(level, tpot_b),
            prefill_queue=max(int(round(prefill_queue)), 0),
            decode_queue=max(int(round(decode_queue)), 0),
            kv_utilisation=min(max(kv_usage, 0.0), 1.0) if not math.isnan(kv_usage) else math.nan,
            ready=ready,
        )
