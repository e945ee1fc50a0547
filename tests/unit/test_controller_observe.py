"""Observation from PromQL answers (fulcrum.controller.observe), against CANNED Prometheus API answers.

The same observer runs against a real Prometheus scraping a prometheus-client exporter in
tests/integration/test_controller_prometheus.py.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import requests

from fulcrum.cluster import ObservationError
from fulcrum.controller import observe as observe_mod
from fulcrum.controller.observe import (
    ALL_QUERIES,
    PrometheusObserver,
    Selectors,
    histogram_quantile,
    histogram_share_below,
)
from fulcrum.observation import ReadyCounts

SEL = Selectors.for_llmserve("llama", "prod")


def vec(v: float, **labels: str) -> dict[str, Any]:
    return {"metric": labels, "value": [1700000000.0, str(v)]}


def hist(bounds_counts: list[tuple[str, float]]) -> list[dict[str, Any]]:
    return [vec(c, le=le) for le, c in bounds_counts]


class CannedPrometheus:
    """FAKE Prometheus client: answers keyed by the exact PromQL the observer must send."""

    def __init__(self, answers: dict[str, list[dict[str, Any]]], window: str = "60s") -> None:
        self.by_query = {}
        for series, template in ALL_QUERIES.items():
            q = template.format(router=SEL.router, prefill_pods=SEL.prefill_pods, decode_pods=SEL.decode_pods,
                                window=window)
            self.by_query[q] = answers.get(series, [])
        self.sent: list[str] = []

    def custom_query(self, query: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        self.sent.append(query)
        if query not in self.by_query:
            raise AssertionError(f"unexpected PromQL {query}")
        return self.by_query[query]


ANSWERS = {
    "arrivals": [vec(600)],
    "input_tokens_sum": [vec(600_000)],
    "input_tokens_count": [vec(600)],
    "input_tokens_buckets": hist([("512", 100), ("1024", 400), ("2048", 600), ("+Inf", 600)]),
    "output_tokens_sum": [vec(75_000)],
    "output_tokens_count": [vec(500)],
    "output_tokens_buckets": hist([("128", 250), ("256", 500), ("+Inf", 500)]),
    "completed": [vec(500)],
    "concurrency": [vec(42.5)],
    "ttft_buckets": hist([("0.5", 300), ("1.0", 400), ("2.5", 480), ("5.0", 500), ("+Inf", 500)]),
    "tpot_buckets": hist([("0.04", 250), ("0.06", 450), ("0.08", 475), ("0.1", 500), ("+Inf", 500)]),
    "prefill_queue": [vec(4)],
    "prefill_queue_nats": [vec(3)],
    "decode_queue": [vec(2)],
    "kv_usage": [vec(0.8)],
}


def observer(client: Any) -> PrometheusObserver:
    return PrometheusObserver(client, SEL, ttft_slo_s=2.0, tpot_slo_s=0.08, percentile=90)


def test_an_interval_is_observed_from_router_and_vllm_series() -> None:
    prom = CannedPrometheus(ANSWERS)
    o = observer(prom).observe(3600.0, 60.0, ReadyCounts(3, 2, 0))
    assert o.arrivals == 600 and o.rate_rps == 10.0 and o.interval_s == 60.0 and o.time_s == 3600.0
    assert o.mean_isl == 1000.0 and o.mean_osl == 150.0
    assert o.isl_quantiles[2] == pytest.approx(512 + 512 * (300 - 100) / 300)  # median inside (512, 1024]
    assert o.completed == 500 and o.concurrency == 42.5
    assert o.ttft_attainment == pytest.approx((400 + 80 * (2.0 - 1.0) / 1.5) / 500)
    assert o.tpot_attainment == pytest.approx(475 / 500)
    assert o.slo_attainment == min(o.ttft_attainment, o.tpot_attainment)
    assert o.ttft_p_s == pytest.approx(1.0 + 1.5 * (450 - 400) / 80)
    assert o.prefill_queue == 7 and o.decode_queue == 2 and o.kv_utilisation == 0.8
    assert o.ready == ReadyCounts(3, 2, 0)
    assert 'job="llama-router"' in prom.sent[0] and "[60s]" in prom.sent[0]


def test_without_completions_the_osl_is_the_predicted_one_and_attainment_is_unknown() -> None:
    answers = {k: v for k, v in ANSWERS.items() if k not in ("output_tokens_count", "output_tokens_sum",
                                                             "output_tokens_buckets", "ttft_buckets", "tpot_buckets")}
    answers["predicted_output_sum"] = [vec(600 * 200)]
    answers["predicted_output_count"] = [vec(600)]
    o = observer(CannedPrometheus(answers)).observe(60.0, 60.0, ReadyCounts())
    assert o.mean_osl == 200.0 and o.osl_quantiles == ()
    assert math.isnan(o.slo_attainment) and math.isnan(o.ttft_p_s)


def test_no_router_series_is_an_observation_error() -> None:
    with pytest.raises(ObservationError, match="no router series"):
        observer(CannedPrometheus({})).observe(60.0, 60.0, ReadyCounts())


def test_an_unreachable_prometheus_is_an_observation_error() -> None:
    class Down:
        def custom_query(self, query: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
            raise requests.exceptions.ConnectionError("connection refused")

    with pytest.raises(ObservationError, match="ConnectionError"):
        observer(Down()).observe(60.0, 60.0, ReadyCounts())


def test_histogram_quantile_and_share_follow_promql_interpolation() -> None:
    b = [(1.0, 10.0), (2.0, 30.0), (math.inf, 40.0)]
    assert histogram_quantile(0.5, b) == pytest.approx(1.5)
    assert histogram_quantile(0.1, b) == pytest.approx(0.4)
    assert histogram_quantile(0.99, b) == 2.0  # in the +Inf bucket: the highest finite bound
    assert math.isnan(histogram_quantile(0.5, []))
    assert histogram_share_below(1.5, b) == pytest.approx(20 / 40)
    assert histogram_share_below(10.0, b) == pytest.approx(30 / 40)
    assert histogram_share_below(0.5, b) == pytest.approx(5 / 40)
    assert math.isnan(histogram_share_below(1.0, [(1.0, 0.0), (math.inf, 0.0)]))


def test_every_query_names_its_selector_and_window() -> None:
    for series, q in ALL_QUERIES.items():
        assert "{window}" in q or "vllm:" in q or "queue_depth" in q, series  # gauges: read now
        assert "{router}" in q or "{prefill_pods}" in q or "{decode_pods}" in q, series


class CannedRange:
    """FAKE Prometheus range client: per series, {evaluation time: value} (one sample vector per time)."""

    def __init__(self, series: dict[str, dict[float, float]], fail: bool = False) -> None:
        self.series, self.fail = series, fail
        self.calls: list[tuple[str, float, float, str]] = []

    def custom_query(self, query: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        raise AssertionError("history must use range queries only")

    def custom_query_range(self, query: str, start_time: Any, end_time: Any, step: str,
                           params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        self.calls.append((query, start_time.timestamp(), end_time.timestamp(), step))
        if self.fail:
            raise requests.ConnectionError("connection refused")
        for name, template in ALL_QUERIES.items():
            if query == template.format(router=SEL.router, prefill_pods=SEL.prefill_pods,
                                        decode_pods=SEL.decode_pods, window="60s"):
                points = self.series.get(name, {})
                return [{"metric": {}, "values": [[t, str(v)] for t, v in sorted(points.items())]}] if points else []
        raise AssertionError(f"unexpected PromQL {query}")


def test_history_builds_one_observation_per_past_interval_from_range_queries() -> None:
    # the router appeared at t=1200: the interval ending at 1140 has no router series and is left out
    prom = CannedRange({
        "arrivals": {1200.0: 60, 1260.0: 120, 1320.0: 0},
        "input_tokens_sum": {1200.0: 60_000, 1260.0: 240_000},
        "input_tokens_count": {1200.0: 60, 1260.0: 120},
        "predicted_output_sum": {1200.0: 6_000, 1260.0: 24_000},
        "predicted_output_count": {1200.0: 60, 1260.0: 120},
        "concurrency": {1200.0: 3.0, 1260.0: 7.5, 1320.0: 1.0},
    })
    hist = observer(prom).history(1320.0, 60.0, 4, ReadyCounts(2, 1, 0))
    assert [o.time_s for o in hist] == [1200.0, 1260.0, 1320.0]
    assert [o.arrivals for o in hist] == [60, 120, 0]
    assert [o.rate_rps for o in hist] == [1.0, 2.0, 0.0]
    assert [o.mean_isl for o in hist] == [1000.0, 2000.0, 0.0]
    assert [o.mean_osl for o in hist] == [100.0, 200.0, 0.0]  # nothing finished: the predicted OSL
    assert [o.concurrency for o in hist] == [3.0, 7.5, 1.0]
    assert all(o.interval_s == 60.0 and o.ready == ReadyCounts(2, 1, 0) for o in hist)
    _, start, end, step = prom.calls[0]
    assert (start, end, step) == (1140.0, 1320.0, "60s")  # count intervals, the newest ending at end_s
    assert len({q for q, *_ in prom.calls}) == len(prom.calls)  # each template queried once for all times


def test_history_of_an_unscraped_router_is_empty_and_a_failing_prometheus_an_observation_error() -> None:
    assert observer(CannedRange({})).history(600.0, 60.0, 10, ReadyCounts()) == []
    with pytest.raises(ObservationError, match="range query failed"):
        observer(CannedRange({}, fail=True)).history(600.0, 60.0, 10, ReadyCounts())
    with pytest.raises(ValueError, match="count >= 1"):
        observer(CannedRange({})).history(600.0, 60.0, 0, ReadyCounts())


# --- answers that are no usable load: ObservationError (the loop holds and reports Degraded), never a silent 0 ----

def _observe(**over: list[dict[str, Any]]) -> Any:
    answers = dict(ANSWERS)
    answers.update(over)
    return PrometheusObserver(CannedPrometheus(answers), SEL, ttft_slo_s=2.0, tpot_slo_s=0.08, percentile=90,
                              max_model_len=8192).observe(3600.0, 60.0, ReadyCounts(1, 1, 0))


@pytest.mark.parametrize("answer", [
    [{"metric": {}, "value": [1700000000.0, "NaN"]}],
    [{"metric": {}, "value": [1700000000.0, "+Inf"]}],
    [{"metric": {}}],
    [{"metric": {}, "value": None}],
], ids=["NaN", "+Inf", "no-value", "value-None"])
def test_arrivals_without_a_finite_value_are_an_observation_error_not_zero_arrivals(answer) -> None:
    with pytest.raises(ObservationError, match="arrivals"):
        _observe(arrivals=answer)


@pytest.mark.parametrize("over", [
    {"input_tokens_sum": [], "input_tokens_count": [], "input_tokens_buckets": []},
    {"input_tokens_sum": [vec(0)]},
    {"input_tokens_sum": [{"metric": {}, "value": [1700000000.0, "NaN"]}]},
    {"input_tokens_sum": [vec(1e300)], "input_tokens_count": [vec(1e-300)]},
], ids=["series-missing", "zero", "NaN", "infinite"])
def test_arrivals_with_unknown_prompt_lengths_are_an_observation_error(over) -> None:
    with pytest.raises(ObservationError, match="no usable mean prompt length"):
        _observe(**over)


def test_arrivals_with_unknown_output_lengths_are_an_observation_error() -> None:
    with pytest.raises(ObservationError, match="no usable mean output length"):
        _observe(output_tokens_sum=[], output_tokens_count=[], output_tokens_buckets=[])


def test_a_mean_prompt_longer_than_max_model_len_is_an_observation_error() -> None:
    with pytest.raises(ObservationError, match="exceeds maxModelLen 8192"):
        _observe(input_tokens_sum=[vec(600 * 300_075)])
    o = _observe(input_tokens_sum=[vec(600 * 8192)])  # at the limit: planned
    assert o.mean_isl == 8192.0


def test_no_arrivals_need_no_lengths() -> None:
    o = _observe(arrivals=[vec(0)], input_tokens_sum=[], input_tokens_count=[], input_tokens_buckets=[],
                 output_tokens_sum=[], output_tokens_count=[], output_tokens_buckets=[])
    assert o.arrivals == 0 and o.mean_isl == 0.0 and o.mean_osl == 0.0


@pytest.mark.parametrize("over", [
    {"prefill_queue": [vec(1e308)], "prefill_queue_nats": [vec(1e308)]},
    {"prefill_queue": [{"metric": {}, "value": [1700000000.0, "+Inf"]}]},
    {"prefill_queue": [{"metric": {}, "value": [1700000000.0, "NaN"]}]},
    {"prefill_queue_nats": [{"metric": {}, "value": [1700000000.0, "NaN"]}]},
], ids=["overflowing-sum", "+Inf", "NaN", "nats-NaN"])
def test_a_prefill_queue_that_is_not_finite_is_an_observation_error_not_an_overflow(over) -> None:
    # NaN too: a backlog nobody knows is no backlog of 0 (the loop holds, as on NaN arrivals)
    with pytest.raises(ObservationError, match="prefill queue"):
        _observe(**over)


def test_an_absent_prefill_queue_series_is_no_queue() -> None:
    o = _observe(prefill_queue=[], prefill_queue_nats=[])
    assert o.prefill_queue == 0
    o = _observe(prefill_queue_nats=[])
    assert o.prefill_queue == 4


def _answer(raw: str) -> list[dict[str, Any]]:
    return [{"metric": {}, "value": [1700000000.0, raw]}]


@pytest.mark.parametrize("series, raw, match", [
    ("decode_queue", "NaN", r"decode queue of nan requests \(vllm:num_requests_waiting\): no usable backlog"),
    ("decode_queue", "-Inf", r"decode queue of -inf requests \(vllm:num_requests_waiting\): no usable backlog"),
    ("concurrency", "NaN", r"concurrency of nan requests in flight \(fulcrum_router_instance_inflight\): "
                           r"no usable load"),
    ("concurrency", "-Inf", r"concurrency of -inf requests in flight \(fulcrum_router_instance_inflight\)"),
    ("completed", "NaN", r"nan completions in 60 s \(nan requests/s; fulcrum_router_e2e_seconds_count\): no usable "
                         r"completion count"),
    ("completed", "-Inf", r"-inf completions in 60 s \(.*fulcrum_router_e2e_seconds_count\)"),
    ("prefill_queue", "-Inf", r"prefill queue of -inf requests \(vllm:num_requests_waiting\): no usable backlog"),
    ("prefill_queue_nats", "NaN", r"prefill queue of nan requests \(fulcrum_router_prefill_queue_depth\)"),
], ids=["decode-queue-NaN", "decode-queue--Inf", "concurrency-NaN", "concurrency--Inf", "completed-NaN",
        "completed--Inf", "prefill-queue--Inf", "nats-queue-NaN"])
def test_a_present_series_answering_nan_or_inf_is_an_observation_error_naming_series_and_value(series, raw,
                                                                                                match) -> None:
    # each moves a decision when read as 0: a decode queue the reactive guard's decode scale-out and dynamo-load's
    # decode load, concurrency dynamo-sla's decode correction, completions the guard's sample count and dynamo-sla's
    # demand; a value nobody knows is no 0 (the loop holds, as on NaN arrivals or a NaN prefill queue)
    with pytest.raises(ObservationError, match=match):
        _observe(**{series: _answer(raw)})


@pytest.mark.parametrize("series", ["decode_queue", "concurrency", "completed"])
def test_a_present_series_without_a_value_is_an_observation_error(series: str) -> None:
    with pytest.raises(ObservationError, match="Prometheus answered .*nan"):
        _observe(**{series: [{"metric": {}}]})


def test_an_absent_decode_queue_concurrency_or_completions_series_is_zero() -> None:
    # no decode-capable pod yet, no request in flight, none finished: 0 is what is there
    o = _observe(decode_queue=[], concurrency=[], completed=[])
    assert (o.decode_queue, o.concurrency, o.completed) == (0, 0.0, 0)
    assert o.prefill_queue == 7 and o.arrivals == 600  # the rest is read as usual


def test_nan_completions_with_no_interval_are_an_observation_error_not_a_division_by_zero() -> None:
    answers = dict(ANSWERS)
    answers.update(completed=_answer("NaN"), arrivals=[vec(0)])
    with pytest.raises(ObservationError, match=r"nan completions in 0 s \(fulcrum_router_e2e_seconds_count\)"):
        observer(CannedPrometheus(answers, window="1s")).observe(0.0, 0.0, ReadyCounts())


@pytest.mark.parametrize("raw", ["NaN", "-Inf"])
def test_a_kv_cache_usage_answering_nan_is_unknown_not_an_empty_cache(raw: str,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    # read as 0 it was an empty cache: dynamo-load's decode load under its boundary, a scale-in; unknown is no
    # signal for the KV checks (as a usage above 1), and the rest of the observation still plans
    with caplog.at_level("WARNING", logger="fulcrum.controller.observe"):
        o = _observe(kv_usage=_answer(raw))
    assert math.isnan(o.kv_utilisation)
    assert o.arrivals == 600 and o.decode_queue == 2
    assert "KV cache usage of" in caplog.text and "read as unknown" in caplog.text
    assert _observe(kv_usage=[]).kv_utilisation == 0.0  # absent: no decode-capable pod, no usage


@pytest.mark.parametrize("over, match", [
    ({"arrivals": [vec(60 * 1e12)]}, r"6e\+13 arrivals in 60 s \(1e\+12 requests/s.*above the plausible 1e\+06"),
    ({"arrivals": [vec(60 * 1e6 + 60)]}, r"arrivals in 60 s .*above the plausible 1e\+06 requests/s"),
    ({"prefill_queue": [vec(1e300)]}, r"prefill queue of 1e\+300 requests \(vllm:num_requests_waiting\), above "
                                      r"the plausible 1e\+09"),
    ({"prefill_queue_nats": [vec(1e300)]}, r"prefill queue of 1e\+300 requests \(fulcrum_router_prefill_queue"),
    ({"prefill_queue": [vec(1e9 + 1)]}, r"prefill queue .*above the plausible 1e\+09"),
    ({"decode_queue": [vec(1e300)]}, r"decode queue of 1e\+300 requests .*above the plausible 1e\+09"),
    ({"decode_queue": [{"metric": {}, "value": [1700000000.0, "+Inf"]}]}, r"decode queue of inf requests"),
    ({"concurrency": [vec(1e300)]}, r"concurrency of 1e\+300 requests in flight .*above the plausible 1e\+09"),
    ({"concurrency": [{"metric": {}, "value": [1700000000.0, "+Inf"]}]}, r"concurrency of inf"),
    ({"completed": [vec(1e300)]}, r"1e\+300 completions in 60 s .*above the plausible 1e\+06 requests/s"),
    ({"output_tokens_sum": [vec(500 * 2.0**32)]}, r"mean output length of 4\.29497e\+09 tokens .*above the "
                                                  r"plausible 2147483647 tokens"),
    ({"output_tokens_sum": [vec(1e300)], "output_tokens_count": [vec(1)]}, r"mean output length of 1e\+300"),
    ({"predicted_output_sum": [vec(1e300)], "predicted_output_count": [vec(600)], "output_tokens_sum": [],
      "output_tokens_count": []}, r"mean output length of 1\.66667e\+297"),
], ids=["arrivals-1e12-rps", "arrivals-just-above", "prefill-queue-1e300", "nats-queue-1e300",
        "prefill-queue-just-above", "decode-queue-1e300", "decode-queue-Inf", "concurrency-1e300", "concurrency-Inf", "completed-1e300",
        "osl-2^32", "osl-1e300", "predicted-osl-1e300"])
def test_a_finite_but_implausible_answer_is_an_observation_error_not_load(over, match) -> None:
    # a one-scrape glitch or a counter mishap, planned as load, would scale to maxGPUs for several intervals
    with pytest.raises(ObservationError, match=match):
        _observe(**over)


def test_a_mean_prompt_beyond_2_31_tokens_is_an_observation_error_without_max_model_len() -> None:
    def obs(isl_sum: float, arrivals: float = 600) -> Any:
        answers = dict(ANSWERS)
        answers.update(input_tokens_sum=[vec(isl_sum)], arrivals=[vec(arrivals)])
        return observer(CannedPrometheus(answers)).observe(3600.0, 60.0, ReadyCounts())

    with pytest.raises(ObservationError, match=r"mean prompt length of 4\.29497e\+09 tokens \(input tokens sum "
                                               r".*above the plausible 2147483647 tokens"):
        obs(600 * 2.0**32)
    with pytest.raises(ObservationError, match="mean prompt length of 1e\\+300"):
        obs(600 * 1e300, arrivals=0)  # nothing arrived: the length still goes into the Observation
    assert obs(600 * (2**31 - 1)).mean_isl == 2**31 - 1  # at the bound: taken as it is


def test_values_at_the_plausibility_bounds_are_taken_as_they_are() -> None:
    o = _observe(arrivals=[vec(60 * 1e6)], input_tokens_count=[vec(60 * 1e6)], input_tokens_sum=[vec(60e6 * 1000)],
                 prefill_queue=[vec(1e9)], prefill_queue_nats=[vec(1e9)], decode_queue=[vec(1e9)],
                 concurrency=[vec(1e9)], completed=[vec(60 * 1e6)])
    assert o.arrivals == 60_000_000 and o.rate_rps == 1e6 and o.mean_isl == 1000.0
    assert o.prefill_queue == 2_000_000_000 and o.decode_queue == 1_000_000_000
    assert o.concurrency == 1e9 and o.completed == 60_000_000


def test_negative_and_absent_answers_read_as_zero() -> None:
    o = _observe(decode_queue=[vec(-1e300)], concurrency=[vec(-1e300)], completed=[vec(-1e300)],
                 prefill_queue=[vec(-1e300)], prefill_queue_nats=[], arrivals=[vec(-1e300)],
                 kv_usage=[vec(-1e300)])
    assert (o.arrivals, o.decode_queue, o.concurrency, o.completed, o.prefill_queue) == (0, 0, 0.0, 0, 0)
    assert o.kv_utilisation == 0.0  # a share: clamped to 0..1, as before
    assert _observe(kv_usage=[vec(1.004)]).kv_utilisation == 1.0  # float rounding above a full cache
    o = _observe(decode_queue=[], concurrency=[], completed=[], kv_usage=[])
    assert (o.decode_queue, o.concurrency, o.completed, o.kv_utilisation) == (0, 0.0, 0, 0.0)


def test_history_leaves_out_an_interval_with_an_arrivals_spike() -> None:
    prom = CannedRange({
        "arrivals": {1200.0: 60, 1260.0: 60 * 1e12, 1320.0: 120},
        "input_tokens_sum": {1200.0: 60_000, 1260.0: 60_000, 1320.0: 240_000},
        "input_tokens_count": {1200.0: 60, 1260.0: 60, 1320.0: 120},
        "predicted_output_sum": {1200.0: 6_000, 1260.0: 6_000, 1320.0: 24_000},
        "predicted_output_count": {1200.0: 60, 1260.0: 60, 1320.0: 120},
    })
    hist = observer(prom).history(1320.0, 60.0, 3, ReadyCounts())
    assert [(o.time_s, o.arrivals) for o in hist] == [(1200.0, 60), (1320.0, 120)]  # the forecaster never sees it


def test_history_leaves_out_an_interval_with_a_nan_decode_queue() -> None:
    prom = CannedRange({
        "arrivals": {1200.0: 60, 1260.0: 60, 1320.0: 120},
        "input_tokens_sum": {1200.0: 60_000, 1260.0: 60_000, 1320.0: 240_000},
        "input_tokens_count": {1200.0: 60, 1260.0: 60, 1320.0: 120},
        "predicted_output_sum": {1200.0: 6_000, 1260.0: 6_000, 1320.0: 24_000},
        "predicted_output_count": {1200.0: 60, 1260.0: 60, 1320.0: 120},
        "decode_queue": {1200.0: 1, 1260.0: math.nan},  # absent at 1320: no queue
    })
    hist = observer(prom).history(1320.0, 60.0, 3, ReadyCounts())
    assert [(o.time_s, o.decode_queue) for o in hist] == [(1200.0, 1), (1320.0, 0)]


def test_a_bucket_whose_le_is_no_number_is_skipped() -> None:
    o = _observe(input_tokens_buckets=hist([("abc", 100), ("NaN", 200), ("1024", 400), ("2048", 600), ("+Inf", 600)]))
    assert o.mean_isl == 1000.0
    assert o.isl_quantiles and all(math.isfinite(q) for q in o.isl_quantiles)
    assert o.isl_quantiles[2] == pytest.approx(1024 * 300 / 400)  # as if the bad buckets were absent


def test_history_leaves_out_intervals_whose_answers_are_no_usable_load() -> None:
    class Range:
        def custom_query_range(self, query: str, start_time: Any, end_time: Any, step: str,
                               params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
            if "requests_admitted_total" in query:
                return [{"metric": {}, "values": [[1000.0, "600"], [1060.0, "NaN"], [1120.0, "600"]]}]
            if "input_tokens_sum" in query:
                return [{"metric": {}, "values": [[1000.0, "600000"], [1060.0, "0"], [1120.0, "600000"]]}]
            if "input_tokens_count" in query or "output_tokens_count" in query:
                return [{"metric": {}, "values": [[t, "600"] for t in (1000.0, 1060.0, 1120.0)]}]
            if "output_tokens_sum" in query:
                return [{"metric": {}, "values": [[t, "90000"] for t in (1000.0, 1060.0, 1120.0)]}]
            return []

    obs = observer(Range()).history(1120.0, 60.0, 3, ReadyCounts())
    assert [o.time_s for o in obs] == [1000.0, 1120.0]


class _PromCluster:
    """Prometheus answers → PrometheusObserver → ControlLoop.run_interval (what the operator's interval runs)."""

    def __init__(self, loop: Any, answers: dict[str, list[dict[str, Any]]]) -> None:
        self.loop, self.answers, self.t, self.applied = loop, answers, 0.0, []

    def observe(self, interval_s: float) -> Any:
        self.t += interval_s
        c = self.loop.current
        return PrometheusObserver(CannedPrometheus(self.answers, window="10s"), SEL, ttft_slo_s=2.0, tpot_slo_s=0.08,
                                  percentile=90, max_model_len=8192).observe(
            self.t, interval_s, ReadyCounts(c.prefill.replicas, c.decode.replicas, 0))

    def apply(self, target: Any, reason: str) -> None:
        self.applied.append(target)


@pytest.mark.parametrize("bad", [
    {"arrivals": [{"metric": {}, "value": [1700000000.0, "NaN"]}]},
    {"arrivals": [{"metric": {}, "value": [1700000000.0, "+Inf"]}]},
    {"input_tokens_sum": [], "input_tokens_count": [], "input_tokens_buckets": []},
    {"input_tokens_sum": [vec(600 * 300_075)]},
    {"prefill_queue": [vec(1e308)], "prefill_queue_nats": [vec(1e308)]},
    {"arrivals": [vec(10 * 1e12)]},
    {"prefill_queue": [vec(1e300)]},
    {"decode_queue": [vec(1e300)]},
    {"decode_queue": [{"metric": {}, "value": [1700000000.0, "NaN"]}]},
    {"concurrency": [{"metric": {}, "value": [1700000000.0, "NaN"]}]},
    {"completed": [{"metric": {}, "value": [1700000000.0, "NaN"]}]},
], ids=["arrivals-NaN", "arrivals-Inf", "isl-missing", "isl-beyond-context", "queue-overflow", "arrivals-1e12-rps",
        "prefill-queue-1e300", "decode-queue-1e300", "decode-queue-NaN", "concurrency-NaN", "completed-NaN"])
def test_unusable_answers_hold_the_pools_and_report_degraded_in_the_loop(bad, table_i) -> None:
    from fulcrum.api.llmserve import parse_llmserve
    from fulcrum.scaling.loop import ControlLoop
    from fulcrum.target import ClusterTarget, PoolSize

    spec = parse_llmserve({"spec": {"model": {"name": "m"}, "scaling": {
        "intervalSeconds": 10, "cooldownSeconds": 0, "podStartupSeconds": 0}}}).spec
    loop = ControlLoop(spec, table_i, ClusterTarget(prefill=PoolSize(1, 1), decode=PoolSize(1, 2)))
    answers = dict(ANSWERS)
    answers.update(input_tokens_sum=[vec(600_000)], input_tokens_count=[vec(600)])
    cluster = _PromCluster(loop, answers)
    for _ in range(25):
        assert loop.run_interval(cluster).degraded is None
    steady = loop.current
    assert steady.prefill.replicas >= 1 and steady.decode.replicas >= 1
    answers.update(bad)
    for _ in range(3):
        out = loop.run_interval(cluster)  # no exception escapes
        assert out.target == steady and not out.observed and out.degraded
        assert "not scaling blind" in out.reason
    assert cluster.applied[-1] == steady


@pytest.mark.parametrize("usage", [1.5, 85.0, 1e300, math.inf])
def test_a_kv_cache_usage_above_one_is_no_share_but_unknown(usage: float, caplog: pytest.LogCaptureFixture) -> None:
    # read as a full cache (the old clamp), it set off the reactive guard's scale-out whenever a request waited; an
    # ObservationError would stop all planning for one exporter's unit: the rest of the observation still plans
    with caplog.at_level("WARNING", logger="fulcrum.controller.observe"):
        o = _observe(kv_usage=[vec(usage)])
    assert math.isnan(o.kv_utilisation)
    assert o.arrivals == _observe().arrivals > 0  # the load is read as usual
    assert "KV cache usage of" in caplog.text and "read as unknown" in caplog.text


def test_a_histogram_whose_inf_bucket_answers_nan_is_unknown_not_one_without_its_tail() -> None:
    # The +Inf bucket is the total: dropped, the 100 requests slower than 5 s vanished and attainment read 1.0.
    o = _observe(ttft_buckets=hist([("0.5", 300), ("1.0", 400), ("5.0", 500), ("+Inf", math.nan)]),
                 tpot_buckets=hist([("0.04", 250), ("0.1", 500)]))  # no +Inf bucket at all
    assert math.isnan(o.ttft_attainment) and math.isnan(o.tpot_attainment) and math.isnan(o.slo_attainment)
    assert math.isnan(o.ttft_p_s) and math.isnan(o.tpot_p_s)
    o = _observe(input_tokens_buckets=hist([("512", 100), ("1024", 400), ("+Inf", math.inf)]))
    assert o.isl_quantiles == () and o.mean_isl == 1000.0  # the mean comes from sum/count, still known


def test_a_finite_bucket_answering_nan_is_skipped_and_counts_are_made_monotone() -> None:
    o = _observe(ttft_buckets=hist([("0.5", 300), ("1.0", math.nan), ("2.5", 480), ("5.0", 470), ("+Inf", 500)]))
    assert o.ttft_attainment == pytest.approx((300 + 180 * (2.0 - 0.5) / 2.0) / 500)  # as if 1.0 were absent
    # 5.0's 470 (below 2.5's 480: increase() extrapolation) is read as 480, as PromQL's histogram_quantile does.
    assert observe_mod._buckets(hist([("2.5", 480), ("5.0", 470), ("+Inf", 500)])) == [
        (2.5, 480.0), (5.0, 480.0), (math.inf, 500.0)]
