"""Which metric names Fulcrum's parts export, and which ones a PromQL expression reads.

Used by ``tests/unit/test_dashboards.py`` and ``tests/unit/test_alerts.py`` to check that every metric a panel or
an alert queries exists. Sources:

- router: ``fulcrum.router.metrics.RouterMetrics``' registry, instantiated (with the per-instance collector);
- operator: ``fulcrum.controller.metrics.OperatorMetrics``' registry, instantiated;
- scheduler: ``fulcrum.worker.slo_scheduler.SchedulerMetrics``' registry, instantiated;
- vLLM: :data:`VLLM` (the names DESIGN.md lists, seen on vLLM 0.32's ``/metrics``), with their metric types.

A family's exposed sample names follow Prometheus' conventions: counters ``<name>_total``, histograms
``<name>_bucket``/``_sum``/``_count``, gauges ``<name>``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

__all__ = ["VLLM", "PROMQL_WORDS", "metric_names", "exported", "sample_names"]

#: vLLM's metrics (DESIGN.md, "Metrics"), name -> type. Older releases' names are accepted too.
VLLM: dict[str, str] = {
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:prompt_tokens_by_source": "counter",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:nixl_xfer_time_seconds": "histogram",
    "vllm:nixl_num_failed_transfers": "counter",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:time_per_output_token_seconds": "histogram",
}

#: PromQL words that look like names: aggregations, functions, keywords.
PROMQL_WORDS = frozenset(
    """sum min max avg group stddev stdvar count count_values bottomk topk quantile limitk limit_ratio
    by without on ignoring group_left group_right bool and or unless offset atan2
    abs absent absent_over_time ceil changes clamp clamp_max clamp_min day_of_month day_of_week day_of_year
    days_in_month delta deriv exp floor histogram_quantile histogram_count histogram_sum histogram_fraction
    holt_winters hour idelta increase irate label_join label_replace ln log2 log10 minute month predict_linear
    rate resets round scalar sgn sort sort_desc sqrt time timestamp vector year avg_over_time min_over_time
    max_over_time sum_over_time count_over_time quantile_over_time stddev_over_time stdvar_over_time
    last_over_time present_over_time inf nan""".split()
)

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_BRACES = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_NAME = re.compile(r"(?<![\w:.$])([a-zA-Z_:][a-zA-Z0-9_:]*)")
_VAR = re.compile(r"\$\{?\w+\}?")


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (Grafana ``$variables`` allowed).

    >>> sorted(metric_names('sum by (le) (rate(a_bucket{x="y"}[5m])) / scalar(b)'))
    ['a_bucket', 'b']
    """
    text = _STRING.sub('""', expr)
    text = _BRACES.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _VAR.sub(" 1 ", text)
    out = set()
    for m in _NAME.finditer(text):
        name = m.group(1)
        rest = text[m.end():].lstrip()
        if name in PROMQL_WORDS or rest.startswith("("):
            continue
        out.add(name)
    return out


def sample_names(families: Iterable[tuple[str, str]]) -> set[str]:
    """Exposed sample names of ``(family name, type)`` pairs."""
    out: set[str] = set()
    for name, kind in families:
        if kind == "counter":
            out |= {name + "_total", name + "_created"}
        elif kind == "histogram":
            out |= {name + "_bucket", name + "_sum", name + "_count", name + "_created"}
        elif kind == "summary":
            out |= {name, name + "_sum", name + "_count"}
        else:
            out.add(name)
    return out


def _registry_families(registry: Any) -> list[tuple[str, str]]:
    return [(m.name, m.type) for m in registry.collect()]


def exported() -> dict[str, set[str]]:
    """Sample names each part exports: ``{"router" | "operator" | "scheduler" | "vllm": names}``.

    Raises:
        ImportError: a part's metrics module cannot be imported (its extra is not installed).
    """
    from fulcrum.controller.metrics import OperatorMetrics
    from fulcrum.router.metrics import RouterMetrics
    from fulcrum.worker.latency_table import StepLatencyTable
    from fulcrum.worker.slo_scheduler import SchedulerMetrics, StepPlanner

    router = RouterMetrics()
    router.attach_pool(lambda: [])
    scheduler = SchedulerMetrics(StepPlanner(StepLatencyTable(), 0.1))
    return {
        "router": sample_names(_registry_families(router.registry)),
        "operator": sample_names(_registry_families(OperatorMetrics().registry)),
        "scheduler": sample_names(_registry_families(scheduler.registry)),
        "vllm": sample_names(VLLM.items()),
    }
