"""Build Fulcrum's Grafana dashboard and alert rules; write them where Grafana, Prometheus and the chart read them.

Usage: ``python dashboards/build.py`` (writes) or ``python dashboards/build.py --check`` (exit 1 when a committed
file differs from what this script builds). Needs ``grafana-foundation-sdk`` (Grafana's typed dashboard builders,
PyPI) for the dashboard; the alert rules are plain Python (``dashboards/alerts.py``).

Outputs:
- ``dashboards/fulcrum-llmserve.json`` and its copy ``charts/fulcrum/dashboards/fulcrum-llmserve.json`` (the chart
  ships it as a ConfigMap for Grafana's dashboard sidecar);
- ``dashboards/alerts.yaml`` (a Prometheus rule file, the chart's default thresholds) and
  ``charts/fulcrum/templates/prometheusrule.yaml`` (the same rules as a PrometheusRule, thresholds from values).

The dashboard is per LLMServe (variables ``namespace`` and ``llmserve``). Router and worker series are selected by
``namespace``/``llmserve`` labels, which the chart's PodMonitor copies from the pods' ``fulcrum.dev/llmserve``
label; the operator's series carry ``llmserve``. Every metric a query names is exported by the router
(``router/metrics.py``), the operator (``fulcrum_operator_*``), vLLM (``vllm:*``) or the worker's SLO-aware
scheduler (``fulcrum_scheduler_*``): ``tests/unit/test_dashboards.py`` checks it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CHART = REPO / "charts" / "fulcrum"
sys.path.insert(0, str(HERE))

import alerts  # noqa: E402  (dashboards/ is a folder of scripts, not a package)

__all__ = ["DASHBOARD_FILE", "build_dashboard", "alerts_yaml", "outputs", "main"]

DASHBOARD_FILE = "fulcrum-llmserve.json"

#: Label matchers of the router's and workers' series of the selected LLMServe.
SEL = 'namespace="$namespace", llmserve="$llmserve"'
#: Label matchers of the operator's series of the selected LLMServe (the operator labels them ``namespace/name``).
OSEL = 'llmserve="$namespace/$llmserve"'
RI = "$__rate_interval"


def _q(expr: str, legend: str, ref: str) -> Any:
    from grafana_foundation_sdk.builders import prometheus

    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref)


def _ts(title: str, unit: str, desc: str, targets: list[tuple[str, str]], *, w: int = 12, h: int = 8) -> Any:
    from grafana_foundation_sdk.builders import timeseries
    from grafana_foundation_sdk.models.dashboard import DataSourceRef

    p = (
        timeseries.Panel()
        .title(title)
        .description(desc)
        .datasource(DataSourceRef(type_val="prometheus", uid="${datasource}"))
        .unit(unit)
        .span(w)
        .height(h)
        .line_width(1)
        .fill_opacity(10)
    )
    for i, (expr, legend) in enumerate(targets):
        p = p.with_target(_q(expr, legend, chr(ord("A") + i)))
    return p


def _own_axis(unit: str) -> list[Any]:
    """Override properties of a series whose unit differs from its panel's: ``unit`` (a Grafana unit id) on the
    right-hand axis."""
    from grafana_foundation_sdk.models.dashboard import DynamicConfigValue

    return [DynamicConfigValue(id_val="unit", value=unit),
            DynamicConfigValue(id_val="custom.axisPlacement", value="right")]


def _quantiles(metric: str, sel: str) -> list[tuple[str, str]]:
    return [
        (f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{sel}}}[{RI}])))", f"p{int(q * 100)}")
        for q in (0.5, 0.9, 0.99)
    ]


def build_dashboard() -> dict[str, Any]:
    """The per-LLMServe dashboard as Grafana JSON (a dict; panels laid out on the 24-column grid).

    Raises:
        ImportError: ``grafana-foundation-sdk`` is not installed.
    """
    from grafana_foundation_sdk.builders import heatmap
    from grafana_foundation_sdk.builders.dashboard import (
        AnnotationQuery,
        Dashboard,
        DatasourceVariable,
        QueryVariable,
        Row,
        TextBoxVariable,
    )
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, DynamicConfigValue, VariableRefresh

    ds = DataSourceRef(type_val="prometheus", uid="${datasource}")
    d = (
        Dashboard("Fulcrum / LLMServe")
        .uid("fulcrum-llmserve")
        .description("One LLMServe: demand and its forecast, the plan and the pools, SLOs, routing, KV transfer, "
                     "queues and the workers' SLO-aware scheduler. Built by dashboards/build.py.")
        .tags(["fulcrum", "llm", "vllm"])
        .refresh("30s")
        .time("now-3h", "now")
        .timezone("browser")
        .with_variable(DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            QueryVariable("namespace").label("Namespace").datasource(ds)
            .query("label_values(fulcrum_router_requests_admitted_total, namespace)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        )
        .with_variable(
            QueryVariable("llmserve").label("LLMServe").datasource(ds)
            .query('label_values(fulcrum_router_requests_admitted_total{namespace="$namespace"}, llmserve)')
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        )
        .with_variable(TextBoxVariable("ttft_slo_s").label("TTFT SLO (s)").default_value("2"))
        .with_variable(TextBoxVariable("tpot_slo_s").label("TPOT SLO (s)").default_value("0.1"))
        .with_variable(TextBoxVariable("slo_target").label("SLO attainment target").default_value("0.9"))
        .annotation(
            AnnotationQuery().name("Scale events").datasource(ds).enable(True).icon_color("orange")
            .expr(f"sum by (pool, direction) (increase(fulcrum_operator_scale_events_total{{{OSEL}}}[2m])) > 0")
        )
    )

    # ---- demand
    d = d.with_row(Row("Demand: actual and forecast"))
    d = d.with_panel(
        _ts(
            "Request rate: actual vs forecast",
            "reqps",
            "Admitted requests per second at the router, and the operator's forecast for the interval "
            "with its prediction band (the operator's lower/upper bound; DOPD §II-A, DESIGN principle 3).",
            [
                (f"sum(rate(fulcrum_router_requests_admitted_total{{{SEL}}}[{RI}]))", "actual"),
                (f'fulcrum_operator_forecast_rate{{{OSEL}, quantile="mean"}}', "forecast"),
                (f'fulcrum_operator_forecast_rate{{{OSEL}, quantile="lower"}}', "forecast lower"),
                (f'fulcrum_operator_forecast_rate{{{OSEL}, quantile="upper"}}', "forecast upper"),
            ],
            w=24,
        )
        .override_by_name("forecast", [DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]})])
        .override_by_name("forecast upper", [
            DynamicConfigValue(id_val="custom.fillBelowTo", value="forecast lower"),
            DynamicConfigValue(id_val="custom.lineWidth", value=0),
            DynamicConfigValue(id_val="custom.fillOpacity", value=20),
        ])
        .override_by_name("forecast lower", [DynamicConfigValue(id_val="custom.lineWidth", value=0)])
    )
    d = d.with_panel(
        _ts(
            "Input length (ISL): actual vs forecast",
            "none",
            "Mean and p90 prompt length admitted, tokens, and the operator's forecast of the mean ISL.",
            [
                (f"sum(rate(fulcrum_router_input_tokens_sum{{{SEL}}}[{RI}])) / sum(rate(fulcrum_router_input_tokens_count{{{SEL}}}[{RI}]))", "mean"),
                (f"histogram_quantile(0.9, sum by (le) (rate(fulcrum_router_input_tokens_bucket{{{SEL}}}[{RI}])))", "p90"),
                (f"fulcrum_operator_forecast_isl_tokens{{{OSEL}}}", "forecast"),
            ],
        )
    )
    d = d.with_panel(
        _ts(
            "Output length (OSL): actual, predicted, forecast",
            "none",
            "Mean generated length (at completion), the router's predicted length at admission, tokens, and the "
            "operator's forecast of the mean OSL.",
            [
                (f"sum(rate(fulcrum_router_output_tokens_sum{{{SEL}}}[{RI}])) / sum(rate(fulcrum_router_output_tokens_count{{{SEL}}}[{RI}]))", "actual mean"),
                (f"sum(rate(fulcrum_router_predicted_output_tokens_sum{{{SEL}}}[{RI}])) / sum(rate(fulcrum_router_predicted_output_tokens_count{{{SEL}}}[{RI}]))", "predicted mean"),
                (f"fulcrum_operator_forecast_osl_tokens{{{OSEL}}}", "forecast"),
            ],
        )
    )

    # ---- capacity
    d = d.with_row(Row("Capacity: plan and pools"))
    d = d.with_panel(
        _ts(
            "Instances per pool: planned vs ready",
            "short",
            "Prefill, decode and unified instances the operator planned and those ready (Deployments' readyReplicas); "
            "scale events are annotations.",
            [
                (f"sum by (pool) (fulcrum_operator_planned_instances{{{OSEL}}})", "planned {{pool}}"),
                (f"sum by (pool) (fulcrum_operator_ready_instances{{{OSEL}}})", "ready {{pool}}"),
            ],
        )
    )
    d = d.with_panel(
        _ts(
            "GPUs: planned vs ready",
            "short",
            "GPUs the plan asks for (instances × TP) and the GPUs of ready instances, all pools together and per "
            "pool; the budget is spec.scaling.maxGPUs.",
            [
                (f"sum(fulcrum_operator_planned_gpus{{{OSEL}}})", "planned"),
                (f"sum(fulcrum_operator_ready_gpus{{{OSEL}}})", "ready"),
                (f"sum by (pool) (fulcrum_operator_planned_gpus{{{OSEL}}})", "planned {{pool}}"),
            ],
        )
    )
    d = d.with_panel(
        _ts(
            "P/D ratio: planned vs actual",
            "short",
            "Prefill per decode instance: the plan (DOPD eq. 15) and the ready instances' ratio.",
            [
                (f"fulcrum_operator_planned_pd_ratio{{{OSEL}}}", "planned"),
                (f'sum(fulcrum_operator_ready_instances{{{OSEL}, pool="prefill"}}) / sum(fulcrum_operator_ready_instances{{{OSEL}, pool="decode"}})', "actual (ready)"),
            ],
        )
    )
    d = d.with_panel(
        _ts(
            "Healthy instances by role (router view)",
            "short",
            "Instances the router may route to, by the role the router assigns (prefill, decode, both), and those "
            "draining before a scale-in (no new requests).",
            [
                (f"count by (role) (fulcrum_router_instance_healthy{{{SEL}}} == 1)", "{{role}}"),
                (f"sum(fulcrum_router_instance_draining{{{SEL}}})", "draining"),
            ],
        )
    )
    d = d.with_panel(
        _ts(
            "Scale events",
            "short",
            "Scale-outs and scale-ins per pool (count in each 5-minute window).",
            [(f"sum by (pool, direction) (increase(fulcrum_operator_scale_events_total{{{OSEL}}}[5m]))", "{{pool}} {{direction}}")],
        )
    )

    # ---- SLOs
    d = d.with_row(Row("Latency and SLOs"))
    d = d.with_panel(
        _ts(
            "TTFT p50 / p90 / p99 vs SLO",
            "s",
            "Time to first token seen by clients (router histogram), against the TTFT SLO variable.",
            _quantiles("fulcrum_router_ttft_seconds", SEL) + [("vector($ttft_slo_s)", "SLO")],
        )
    )
    d = d.with_panel(
        _ts(
            "TPOT p50 / p90 / p99 vs SLO",
            "s",
            "Time per output token after the first (router histogram), against the TPOT SLO variable and the SLO "
            "the workers' schedulers target.",
            _quantiles("fulcrum_router_tpot_seconds", SEL)
            + [("vector($tpot_slo_s)", "SLO"), (f"max(fulcrum_scheduler_tpot_slo_seconds{{{SEL}}})", "SLO (workers)")],
        )
    )
    d = d.with_panel(
        _ts(
            "SLO attainment",
            "percentunit",
            "Share of requests meeting both TTFT and TPOT SLOs in each interval (operator), against the target.",
            [(f"fulcrum_operator_slo_attainment{{{OSEL}}}", "attainment"), ("vector($slo_target)", "target")],
        )
    )
    d = d.with_panel(
        _ts(
            "Throughput and goodput",
            "none",
            "Output tokens/s of all requests, and goodput estimated as throughput × SLO attainment (tokens/s).",
            [
                (f"sum(rate(fulcrum_router_output_tokens_sum{{{SEL}}}[{RI}]))", "throughput"),
                (f"sum(rate(fulcrum_router_output_tokens_sum{{{SEL}}}[{RI}])) * scalar(max(fulcrum_operator_slo_attainment{{{OSEL}}}))", "goodput"),
            ],
        )
    )

    # ---- routing
    d = d.with_row(Row("Routing: colocate, disaggregate, split"))
    d = d.with_panel(
        _ts(
            "How requests ran",
            "percentunit",
            "Share of requests colocated, disaggregated and split (router), and the policies' decisions.",
            [(
                f"sum by (kind) (rate(fulcrum_router_routed_requests_total{{{SEL}}}[{RI}])) / ignoring(kind) group_left "
                f"sum(rate(fulcrum_router_routed_requests_total{{{SEL}}}[{RI}]))",
                "{{kind}}",
            )],
        )
    )
    d = d.with_panel(
        heatmap.Panel()
        .title("Split ratio φ distribution")
        .description("φ = s / L of split requests (Libra Alg. 1), per time bucket.")
        .datasource(ds)
        .span(12)
        .height(8)
        .calculate(False)
        .with_target(
            _q(f"sum by (le) (increase(fulcrum_router_split_ratio_bucket{{{SEL}}}[{RI}]))", "{{le}}", "A").format("heatmap")
        )
    )
    d = d.with_panel(
        _ts(
            "KV transferred",
            "none",
            "Prompt tokens whose KV arrived by transfer (vLLM, tokens/s; × the profile's KV bytes per token = "
            "bytes/s) and failed NIXL transfers per second.",
            [
                (f'sum(rate(vllm:prompt_tokens_by_source_total{{{SEL}, source="external_kv_transfer"}}[{RI}]))', "tokens/s"),
                (f"sum(rate(vllm:nixl_num_failed_transfers_total{{{SEL}}}[{RI}]))", "failed transfers/s"),
            ],
        )
    )
    d = d.with_panel(
        _ts(
            "KV transfer latency",
            "s",
            "NIXL transfer time (vLLM) and, seen from the router, engine B's time to first token on transferred "
            "KV and the whole handoff, p90.",
            [
                (f"histogram_quantile(0.9, sum by (le) (rate(vllm:nixl_xfer_time_seconds_bucket{{{SEL}}}[{RI}])))", "NIXL p90"),
                (f"histogram_quantile(0.9, sum by (le, kind) (rate(fulcrum_router_kv_transfer_seconds_bucket{{{SEL}}}[{RI}])))", "KV first token p90 {{kind}}"),
                (f"histogram_quantile(0.9, sum by (le, kind) (rate(fulcrum_router_handoff_seconds_bucket{{{SEL}}}[{RI}])))", "handoff p90 {{kind}}"),
            ],
        )
    )

    # ---- queues and balance
    d = d.with_row(Row("Queues and load balance"))
    d = d.with_panel(
        _ts(
            "Queue depths",
            "short",
            "Requests waiting and running in the engines per pool (vLLM), and prompt tokens the router dispatched "
            "and not yet prefilled per role; jobs waiting in the NATS prefill queue (prefillQueue: nats).",
            [
                (f"sum by (pool) (vllm:num_requests_waiting{{{SEL}}})", "waiting {{pool}}"),
                (f"sum by (pool) (vllm:num_requests_running{{{SEL}}})", "running {{pool}}"),
                (f"sum by (role) (fulcrum_router_instance_queued_prefill_tokens{{{SEL}}})", "queued prefill tokens {{role}}"),
                (f"sum(fulcrum_router_prefill_queue_depth{{{SEL}}})", "NATS prefill queue"),
            ],
        )
    )
    d = d.with_panel(
        _ts(
            "Per-instance load",
            "short",
            "In-flight requests per instance as the router dispatched them (BanaServe Alg. 2 balances these) and "
            "the engines' KV cache usage.",
            [
                (f"fulcrum_router_instance_inflight{{{SEL}}}", "{{instance}}"),
                (f"max by (pod) (vllm:kv_cache_usage_perc{{{SEL}}})", "KV {{pod}}"),
            ],
        )
        # KV usage is a 0..1 share, not a count: a percentage on its own axis
        .override_by_regexp("KV .*", _own_axis("percentunit"))
    )

    # ---- scheduler
    d = d.with_row(Row("Workers: SLO-aware scheduler (Libra Alg. 2)"))
    d = d.with_panel(
        _ts(
            "Prefill token budget per step",
            "none",
            "The budget M of each worker's last step and the prefill tokens scheduled per step (p90), tokens.",
            [
                (f"fulcrum_scheduler_prefill_budget_tokens{{{SEL}}}", "budget {{pod}}"),
                (f"histogram_quantile(0.9, sum by (le, pod) (rate(fulcrum_scheduler_scheduled_prefill_tokens_bucket{{{SEL}}}[{RI}])))", "scheduled p90 {{pod}}"),
            ],
        )
    )
    d = d.with_panel(
        _ts(
            "Step time: measured vs predicted",
            "s",
            "Measured step time p90, the latency table's prediction for the last step, and budget violations/s.",
            [
                (f"histogram_quantile(0.9, sum by (le, pod) (rate(fulcrum_scheduler_step_seconds_bucket{{{SEL}}}[{RI}])))", "measured p90 {{pod}}"),
                (f"fulcrum_scheduler_predicted_step_seconds{{{SEL}}}", "predicted {{pod}}"),
                (f"rate(fulcrum_scheduler_budget_violations_total{{{SEL}}}[{RI}])", "violations/s {{pod}}"),
                (f"fulcrum_scheduler_table_entries{{{SEL}}}", "table entries {{pod}}"),
            ],
        )
        # the panel's unit is seconds; violations are a rate and table entries a count: each on its own axis
        .override_by_regexp("violations/s .*", _own_axis("ops"))
        .override_by_regexp("table entries .*", _own_axis("short"))
    )

    out: dict[str, Any] = json.loads(json.dumps(d.build(), cls=JSONEncoder))
    # stable panel ids (the SDK leaves 0); Grafana needs them unique within a dashboard
    for i, panel in enumerate(out["panels"], start=1):
        panel["id"] = i
    return out


def _threshold_defaults() -> dict[str, Any]:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    return dict(values["prometheusRule"]["thresholds"])


def alerts_yaml() -> str:
    """``dashboards/alerts.yaml``: the rules with the chart's default thresholds (no Grafana SDK needed)."""
    header = (
        "# Generated by dashboards/build.py from dashboards/alerts.py: do not edit.\n"
        "# Fulcrum's alert rules for a Prometheus without the Operator (rule_files:), with the chart's default\n"
        "# thresholds; the chart's PrometheusRule (prometheusRule.enabled) holds the same rules.\n"
    )
    return header + yaml.safe_dump(alerts.plain_rules(_threshold_defaults()), sort_keys=False, width=120, allow_unicode=True)


def outputs() -> dict[Path, str]:
    """Every generated file and its content (what ``main`` writes or checks)."""
    dash = json.dumps(build_dashboard(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    rules = alerts_yaml()
    return {
        HERE / DASHBOARD_FILE: dash,
        CHART / "dashboards" / DASHBOARD_FILE: dash,
        HERE / "alerts.yaml": rules,
        CHART / "templates" / "prometheusrule.yaml": alerts.helm_template(),
    }


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check`` compare) every output; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a committed file differs from the build")
    args = ap.parse_args(argv)
    stale = []
    for path, text in outputs().items():
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(REPO)}")
    for path in stale:
        print(f"stale: {path.relative_to(REPO)} (run python dashboards/build.py)", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
