"""The operator's metrics (operator/controller/metrics.py) after an LLMServe is deleted.

``OperatorMetrics.forget`` must drop every per-LLMServe gauge: a gauge left behind keeps its last value for ever,
so FulcrumForecastErrorHigh (dashboards/alerts.py, on ``fulcrum_operator_forecast_error``) would go on firing for
an LLMServe that no longer exists, and the dashboard would show its forecast.
"""

from __future__ import annotations

from fulcrum.controller.metrics import OperatorMetrics
from fulcrum.observation import Observation, ReadyCounts
from fulcrum.scaling.loop import LoopOutcome
from fulcrum.target import ClusterTarget, Pool, PoolSize

KEY = "team-a/llama"
OTHER = "team-a/other"
TARGET = ClusterTarget(prefill=PoolSize(2, 1), decode=PoolSize(1, 1))


def _outcome(rate_rps: float, t: float) -> LoopOutcome:
    obs = Observation(time_s=t, interval_s=10.0, arrivals=int(rate_rps * 10), mean_isl=1000.0, mean_osl=200.0,
                      slo_attainment=0.5)
    forecast = {"rate": {"mean": 10.0, "lower": 8.0, "upper": 12.0}, "isl": {"mean": 1000.0}, "osl": {"mean": 200.0}}
    return LoopOutcome(target=TARGET, reason="plan", observed=True, forecast=forecast, observation=obs)


def _series(m: OperatorMetrics, key: str) -> list[str]:
    return sorted({s.name for fam in m.registry.collect() for s in fam.samples if s.labels.get("llmserve") == key
                   and fam.type == "gauge"})


def test_forgetting_an_llmserve_drops_every_gauge_an_alert_or_panel_reads() -> None:
    m = OperatorMetrics()
    ready = ReadyCounts(prefill=1, decode=1)
    for key in (KEY, OTHER):
        m.record_interval(key, _outcome(10.0, 10.0), ready)
        m.record_interval(key, _outcome(1.0, 20.0), ready)  # forecast 10/s, observed 1/s: error 9 > forecastErrorMax
        m.drain_started.labels(key, Pool.PREFILL.value).set(0.0)
    assert m.registry.get_sample_value("fulcrum_operator_forecast_error", {"llmserve": KEY, "series": "rate"}) == 9.0
    m.forget(KEY)
    assert _series(m, KEY) == []
    assert "fulcrum_operator_forecast_error" in _series(m, OTHER)  # the other LLMServe keeps its series
    assert "fulcrum_operator_forecast_rate" in _series(m, OTHER)


def test_record_scale_counts_one_resize_by_its_direction_and_nothing_for_none() -> None:
    m = OperatorMetrics()
    m.record_scale(KEY, Pool.PREFILL, 1, 4)
    m.record_scale(KEY, Pool.PREFILL, 4, 3)
    m.record_scale(KEY, Pool.DECODE, 2, 2)
    get = m.registry.get_sample_value
    assert get("fulcrum_operator_scale_events_total", {"llmserve": KEY, "pool": "prefill", "direction": "out"}) == 1.0
    assert get("fulcrum_operator_scale_events_total", {"llmserve": KEY, "pool": "prefill", "direction": "in"}) == 1.0
    assert get("fulcrum_operator_scale_events_total", {"llmserve": KEY, "pool": "decode", "direction": "out"}) is None


def test_an_interval_counts_the_plans_changes_unless_the_caller_reports_each_resize_itself() -> None:
    changed = LoopOutcome(target=TARGET, reason="plan", observed=True, changes={Pool.PREFILL: (1, 2)})
    labels = {"llmserve": KEY, "pool": "prefill", "direction": "out"}
    m = OperatorMetrics()
    m.record_interval(KEY, changed, ReadyCounts())
    assert m.registry.get_sample_value("fulcrum_operator_scale_events_total", labels) == 1.0
    m = OperatorMetrics()
    m.record_interval(KEY, changed, ReadyCounts(), count_plan_changes=False)
    assert m.registry.get_sample_value("fulcrum_operator_scale_events_total", labels) is None


def test_an_interval_without_requests_leaves_no_stale_error_or_attainment_for_the_alerts() -> None:
    """Traffic that stops after a bad interval: the relative forecast error (÷ 0 requests) and the SLO attainment
    (no request finished: NaN) are undefined, so their series go instead of holding the bad values, on which
    FulcrumForecastErrorHigh and FulcrumSLOAttainmentLow would fire for the whole quiet period."""
    m = OperatorMetrics()
    ready = ReadyCounts(prefill=1, decode=1)
    m.record_interval(KEY, _outcome(10.0, 10.0), ready)
    m.record_interval(KEY, _outcome(1.0, 20.0), ready)  # forecast 10/s, observed 1/s; attainment 0.5
    get = m.registry.get_sample_value
    assert get("fulcrum_operator_forecast_error", {"llmserve": KEY, "series": "rate"}) == 9.0
    assert get("fulcrum_operator_slo_attainment", {"llmserve": KEY}) == 0.5
    quiet = Observation(time_s=30.0, interval_s=10.0, arrivals=0, mean_isl=0.0, mean_osl=0.0)
    m.record_interval(KEY, LoopOutcome(target=TARGET, reason="hold", observed=True, observation=quiet,
                                       forecast={"rate": {"mean": 0.5}}), ready)
    assert get("fulcrum_operator_forecast_error", {"llmserve": KEY, "series": "rate"}) is None
    assert get("fulcrum_operator_slo_attainment", {"llmserve": KEY}) is None
    m.record_interval(KEY, _outcome(1.0, 40.0), ready)  # requests again: both come back
    assert get("fulcrum_operator_forecast_error", {"llmserve": KEY, "series": "rate"}) == 0.5  # |0.5 - 1| / 1
    assert get("fulcrum_operator_slo_attainment", {"llmserve": KEY}) == 0.5
