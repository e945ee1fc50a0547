"""The operator's Prometheus metrics, ``fulcrum_operator_*`` (names fixed by the contracts), on their own registry.

``fulcrum operator --metrics-port 9090`` serves them. Every interval's forecast, plan, readiness and SLO
attainment is a gauge labelled by LLMServe (``namespace/name``); scale events and reconcile errors are counters;
drains a histogram. Rates are requests per second, lengths tokens, times seconds.
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fulcrum.observation import Observation, ReadyCounts
from fulcrum.scaling.loop import LoopOutcome
from fulcrum.target import ClusterTarget, Pool


__all__ = ["OperatorMetrics"]

#: Values of the ``pool`` label.
_POOLS = tuple(p.value for p in Pool)

_DRAIN_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class OperatorMetrics:
    """All ``fulcrum_operator_*`` metrics (contract names). Label ``llmserve`` = ``namespace/name``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.forecast_rate = Gauge("fulcrum_operator_forecast_rate", "Forecast request rate, requests/s",
                                   ["llmserve", "quantile"], registry=r)
        self.forecast_isl = Gauge("fulcrum_operator_forecast_isl_tokens", "Forecast mean ISL, tokens", ["llmserve"], registry=r)
        self.forecast_osl = Gauge("fulcrum_operator_forecast_osl_tokens", "Forecast mean OSL, tokens", ["llmserve"], registry=r)
        self.planned_instances = Gauge("fulcrum_operator_planned_instances", "Instances the plan asks for",
                                       ["llmserve", "pool"], registry=r)
        self.planned_ratio = Gauge("fulcrum_operator_planned_pd_ratio", "Planned prefill instances per decode instance",
                                   ["llmserve"], registry=r)
        self.ready_instances = Gauge("fulcrum_operator_ready_instances", "Ready instances per pool", ["llmserve", "pool"], registry=r)
        self.planned_gpus = Gauge("fulcrum_operator_planned_gpus", "GPUs the plan asks for per pool (instances × TP)",
                                  ["llmserve", "pool"], registry=r)
        self.ready_gpus = Gauge("fulcrum_operator_ready_gpus", "GPUs of ready instances per pool (ready × planned TP)",
                                ["llmserve", "pool"], registry=r)
        self.slo_attainment = Gauge("fulcrum_operator_slo_attainment", "SLO attainment observed over the last interval (0..1)",
                                    ["llmserve"], registry=r)
        self.scale_events = Counter("fulcrum_operator_scale_events", "Pool resizes by direction",
                                    ["llmserve", "pool", "direction"], registry=r)
        self.forecast_error = Gauge("fulcrum_operator_forecast_error",
                                    "Relative error |forecast - observed| / observed of the last forecast of each series",
                                    ["llmserve", "series"], registry=r)
        self.drain_seconds = Histogram("fulcrum_operator_drain_seconds", "Time spent draining scaled-in instances",
                                       buckets=_DRAIN_BUCKETS, registry=r)
        self.drain_started = Gauge("fulcrum_operator_drain_started_timestamp_seconds",
                                   "Unix time the drain in progress of a pool began; 0 when none is in progress",
                                   ["llmserve", "pool"], registry=r)
        self.reconcile_errors = Counter("fulcrum_operator_reconcile_errors", "Reconciles or intervals that failed", registry=r)
        self.observation_failures = Counter("fulcrum_operator_observation_failures",
                                            "Intervals without an observation (Prometheus down or empty)", ["llmserve"], registry=r)
        self._last_forecast: dict[str, dict[str, float]] = {}

    def record_interval(self, key: str, outcome: LoopOutcome, ready: ReadyCounts, *,
                        count_plan_changes: bool = True) -> None:
        """Export one interval's numbers for LLMServe ``key`` (``namespace/name``).

        Args:
            count_plan_changes: count the plan's pool changes (``outcome.changes``) in
                ``fulcrum_operator_scale_events_total``. The plan's changes are not always what the cluster did
                (a plan that only shortens a drain in flight grows nothing; a scale-in happens when its drain ends):
                a caller that reports each resize as it happens with :meth:`record_scale` passes False.
        """
        self.record_target(key, outcome.target, ready)
        if not outcome.observed:
            self.observation_failures.labels(key).inc()
            return
        obs = outcome.observation
        if obs is not None:
            self._record_errors(key, obs)
            if math.isfinite(obs.slo_attainment):
                self.slo_attainment.labels(key).set(obs.slo_attainment)
            else:  # no request finished: no attainment, rather than the last one held (FulcrumSLOAttainmentLow)
                self._drop(self.slo_attainment, key)
        fc = outcome.forecast
        rate = fc.get("rate", {})
        for q, src in (("mean", "mean"), ("lower", "lower"), ("upper", "upper")):
            v = rate.get(src)
            if isinstance(v, (int, float)) and math.isfinite(v):
                self.forecast_rate.labels(key, q).set(v)
        for gauge, series in ((self.forecast_isl, "isl"), (self.forecast_osl, "osl")):
            v = fc.get(series, {}).get("mean")
            if isinstance(v, (int, float)) and math.isfinite(v):
                gauge.labels(key).set(v)
        ratio = outcome.numbers.ratio
        if math.isfinite(ratio):
            self.planned_ratio.labels(key).set(ratio)
        self._last_forecast[key] = {s: float(fc[s]["mean"]) for s in ("rate", "isl", "osl") if s in fc}
        if count_plan_changes:
            for pool, (old, new) in outcome.changes.items():
                self.record_scale(key, pool, old, new)

    def record_scale(self, key: str, pool: Pool, old: int, new: int) -> None:
        """Count one resize of ``pool`` of LLMServe ``key`` that happened: ``old`` → ``new`` replicas (instances),
        direction ``out`` when it grew, ``in`` when it shrank; nothing when equal. Call it with what the ScaledOut
        and ScaledIn Events report, so that ``fulcrum_operator_scale_events_total`` and the Events agree."""
        if new != old:
            self.scale_events.labels(key, pool.value, "out" if new > old else "in").inc()

    def _record_errors(self, key: str, obs: Observation) -> None:
        """``fulcrum_operator_forecast_error`` of the last interval's forecast against ``obs``, per series. A series
        whose error is undefined (nothing observed: 0 requests/s or tokens; no finite forecast) loses its sample
        rather than holding the last one, on which FulcrumForecastErrorHigh would fire through a quiet period."""
        last = self._last_forecast.get(key)
        if not last:
            return
        actual = {"rate": obs.rate_rps, "isl": obs.mean_isl, "osl": obs.mean_osl}
        for series, a in actual.items():
            predicted = last.get(series, math.nan)
            if a > 0 and math.isfinite(predicted):
                self.forecast_error.labels(key, series).set(abs(predicted - a) / a)
            else:
                self._drop(self.forecast_error, key, series)

    @staticmethod
    def _drop(gauge: Gauge, *labels: str) -> None:
        """Remove one labelled sample of ``gauge``; nothing when it has none."""
        try:
            gauge.remove(*labels)
        except KeyError:
            pass

    def record_target(self, key: str, target: ClusterTarget, ready: ReadyCounts) -> None:
        """Planned and ready instances per pool."""
        for pool, size in target.pools():
            self.planned_instances.labels(key, pool.value).set(size.replicas)
            self.ready_instances.labels(key, pool.value).set(ready.of(pool))
            self.planned_gpus.labels(key, pool.value).set(size.gpus)
            self.ready_gpus.labels(key, pool.value).set(ready.of(pool) * size.tp)

    def forget(self, key: str) -> None:
        """Drop the per-LLMServe gauges of a deleted LLMServe ``key`` (``namespace/name``).

        Every gauge labelled by it goes, including the forecast quantiles, the forecast errors and the drain start
        times: a gauge left behind keeps its last value, so FulcrumForecastErrorHigh (dashboards/alerts.py) would
        go on firing for an LLMServe that is gone, and its forecast would stay on the dashboard. Its counters stay
        (Prometheus' ``rate``/``increase`` handle a counter that stops).
        """
        self._last_forecast.pop(key, None)
        for g in (self.forecast_isl, self.forecast_osl, self.planned_ratio, self.slo_attainment):
            self._drop(g, key)
        for g, values in ((self.forecast_rate, ("mean", "lower", "upper")),
                          (self.forecast_error, ("rate", "isl", "osl")),
                          (self.planned_instances, _POOLS), (self.ready_instances, _POOLS),
                          (self.planned_gpus, _POOLS), (self.ready_gpus, _POOLS), (self.drain_started, _POOLS)):
            for value in values:
                self._drop(g, key, value)
