"""Alert rules: dashboards/alerts.yaml and the chart's PrometheusRule come from dashboards/alerts.py, pass
``promtool check rules``, fire on the series that should fire them (``promtool test rules``), stay quiet on
healthy series, and read only metrics Fulcrum's parts export."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = REPO / "dashboards"
ALERTS_YAML = DASHBOARDS / "alerts.yaml"
sys.path.insert(0, str(DASHBOARDS))

import alerts  # noqa: E402
import metrics_catalog  # noqa: E402

EXPECTED = {"FulcrumSLOAttainmentLow", "FulcrumForecastErrorHigh", "FulcrumPoolNotReady", "FulcrumDrainStuck",
            "FulcrumRouterNoHealthyInstance", "FulcrumNIXLTransferFailures"}


def _build() -> Any:
    spec = importlib.util.spec_from_file_location("fulcrum_dashboards_build_alerts", DASHBOARDS / "build.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not found (Debian package prometheus: apt-get install -y prometheus)")
    return path


def _rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(ALERTS_YAML.read_text())["groups"] for r in g["rules"]]


def test_the_committed_rule_file_and_chart_template_are_what_alerts_py_generates() -> None:
    build = _build()
    assert ALERTS_YAML.read_text() == build.alerts_yaml()
    template = REPO / "charts" / "fulcrum" / "templates" / "prometheusrule.yaml"
    assert template.read_text() == alerts.helm_template()


def test_the_rules_cover_the_failures_operators_must_see() -> None:
    assert {r["alert"] for r in _rules()} == EXPECTED
    for r in _rules():
        assert r["labels"]["severity"] in {"info", "warning", "critical"}
        assert r["annotations"]["summary"] and "docs/dashboards.md#" in r["annotations"]["description"]
        anchor = r["annotations"]["description"].split("docs/dashboards.md#", 1)[1].split(")", 1)[0]
        assert anchor == r["alert"].lower()
        assert f"### {r['alert']}" in (REPO / "docs" / "dashboards.md").read_text()


def test_thresholds_default_to_the_chart_values() -> None:
    values = yaml.safe_load((REPO / "charts" / "fulcrum" / "values.yaml").read_text())["prometheusRule"]["thresholds"]
    by = {r["alert"]: r for r in _rules()}
    assert by["FulcrumSLOAttainmentLow"]["expr"].endswith(f"< {values['sloAttainmentTarget']}")
    assert by["FulcrumPoolNotReady"]["for"] == values["poolNotReadyFor"]
    assert by["FulcrumDrainStuck"]["expr"].endswith(f"> {values['drainStuckSeconds']}")
    with pytest.raises(KeyError, match="nixlFailuresPerSecond"):
        alerts.plain_rules({k: v for k, v in values.items() if k != "nixlFailuresPerSecond"})


def test_every_metric_an_alert_reads_is_exported() -> None:
    known = set().union(*metrics_catalog.exported().values())
    for r in _rules():
        names = metrics_catalog.metric_names(r["expr"])
        assert names, r["alert"]
        assert names <= known, (r["alert"], names - known)


def test_promtool_accepts_the_rule_file() -> None:
    out = subprocess.run([_promtool(), "check", "rules", str(ALERTS_YAML)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(EXPECTED)} rules found" in out.stdout


# promtool unit tests: input series over time -> the alerts expected at each evaluation time
_UNIT_TESTS = {
    "rule_files": [str(ALERTS_YAML)],
    "evaluation_interval": "1m",
    "tests": [
        {   # attainment 50% for 10 minutes fires after `for: 5m`; a healthy LLMServe stays quiet
            "interval": "1m",
            "input_series": [
                {"series": 'fulcrum_operator_slo_attainment{llmserve="default/bad"}', "values": "0.5x15"},
                {"series": 'fulcrum_operator_slo_attainment{llmserve="default/good"}', "values": "0.99x15"},
            ],
            "alert_rule_test": [
                {"eval_time": "3m", "alertname": "FulcrumSLOAttainmentLow", "exp_alerts": []},
                {"eval_time": "10m", "alertname": "FulcrumSLOAttainmentLow", "exp_alerts": [{
                    "exp_labels": {"severity": "warning", "llmserve": "default/bad"},
                    "exp_annotations": {
                        "summary": "LLMServe default/bad meets its SLOs for 50% of requests",
                        "description": alerts.RULES[0]["annotations"]["description"],
                    },
                }]},
            ],
        },
        {   # a pool one instance short for 15 minutes; the other pool complete
            "interval": "1m",
            "input_series": [
                {"series": 'fulcrum_operator_planned_instances{llmserve="default/a", pool="decode"}', "values": "3x20"},
                {"series": 'fulcrum_operator_ready_instances{llmserve="default/a", pool="decode"}', "values": "2x20"},
                {"series": 'fulcrum_operator_planned_instances{llmserve="default/a", pool="prefill"}', "values": "2x20"},
                {"series": 'fulcrum_operator_ready_instances{llmserve="default/a", pool="prefill"}', "values": "2x20"},
            ],
            "alert_rule_test": [
                {"eval_time": "5m", "alertname": "FulcrumPoolNotReady", "exp_alerts": []},
                {"eval_time": "15m", "alertname": "FulcrumPoolNotReady", "exp_alerts": [{
                    "exp_labels": {"severity": "warning", "llmserve": "default/a", "pool": "decode"},
                    "exp_annotations": {
                        "summary": "Pool decode of default/a has fewer ready instances than planned",
                        "description": alerts.RULES[2]["annotations"]["description"],
                    },
                }]},
            ],
        },
        {   # every instance unhealthy for 2 minutes (a router that knows no instance at all exports 0 too)
            "interval": "1m",
            "input_series": [
                {"series": 'fulcrum_router_instances_available{namespace="ns", llmserve="a", pod="a-router-0"}', "values": "2 1 0 0 0 0"},
            ],
            "alert_rule_test": [
                {"eval_time": "1m", "alertname": "FulcrumRouterNoHealthyInstance", "exp_alerts": []},
                {"eval_time": "4m", "alertname": "FulcrumRouterNoHealthyInstance", "exp_alerts": [{
                    "exp_labels": {"severity": "critical", "namespace": "ns", "llmserve": "a"},
                    "exp_annotations": {
                        "summary": "The router of ns/a has no healthy instance",
                        "description": alerts.RULES[4]["annotations"]["description"],
                    },
                }]},
            ],
        },
        {   # one failed NIXL transfer per second, over the 0.01/s default
            "interval": "1m",
            "input_series": [
                {"series": 'vllm:nixl_num_failed_transfers_total{namespace="ns", llmserve="a", pod="a-decode-1"}', "values": "0+60x20"},
            ],
            "alert_rule_test": [
                {"eval_time": "12m", "alertname": "FulcrumNIXLTransferFailures", "exp_alerts": [{
                    "exp_labels": {"severity": "warning", "namespace": "ns", "llmserve": "a"},
                    "exp_annotations": {
                        "summary": "KV transfers over NIXL fail in ns/a (1/s)",
                        "description": alerts.RULES[5]["annotations"]["description"],
                    },
                }]},
            ],
        },
        {   # a decode drain that began at 1m and never ends; a prefill drain that began at 1m and ended at 3m
            "interval": "1m",
            "input_series": [
                {"series": 'fulcrum_operator_drain_started_timestamp_seconds{llmserve="default/a", pool="decode"}', "values": "0 60x10"},
                {"series": 'fulcrum_operator_drain_started_timestamp_seconds{llmserve="default/a", pool="prefill"}', "values": "0 60 60 0x8"},
            ],
            "alert_rule_test": [
                {"eval_time": "5m", "alertname": "FulcrumDrainStuck", "exp_alerts": []},
                {"eval_time": "8m", "alertname": "FulcrumDrainStuck", "exp_alerts": [{
                    "exp_labels": {"severity": "warning", "llmserve": "default/a", "pool": "decode"},
                    "exp_annotations": {
                        "summary": "The drain of pool decode of default/a has run 7m 0s",
                        "description": alerts.RULES[3]["annotations"]["description"],
                    },
                }]},
            ],
        },
        {   # forecast error 0.8 on the rate series fires; 0.1 on ISL does not
            "interval": "1m",
            "input_series": [
                {"series": 'fulcrum_operator_forecast_error{llmserve="default/a", series="rate"}', "values": "0.8x10"},
                {"series": 'fulcrum_operator_forecast_error{llmserve="default/a", series="isl"}', "values": "0.1x10"},
            ],
            "alert_rule_test": [
                {"eval_time": "8m", "alertname": "FulcrumForecastErrorHigh", "exp_alerts": [{
                    "exp_labels": {"severity": "info", "llmserve": "default/a", "series": "rate"},
                    "exp_annotations": {
                        "summary": "Forecast of rate for default/a is off by 80%",
                        "description": alerts.RULES[1]["annotations"]["description"],
                    },
                }]},
            ],
        },
    ],
}


def test_the_alerts_fire_on_failing_series_and_not_on_healthy_ones(tmp_path: Path) -> None:
    promtool = _promtool()
    path = tmp_path / "alerts-test.yaml"
    path.write_text(yaml.safe_dump(_UNIT_TESTS, sort_keys=False))
    out = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout
    tested = {t["alertname"] for case in _UNIT_TESTS["tests"] for t in case["alert_rule_test"]}
    assert tested == EXPECTED


def test_the_chart_renders_the_same_rules_as_the_plain_file_with_default_values() -> None:
    sys.path.insert(0, str(REPO / "tests"))
    import helm_render

    reason = helm_render.helm_missing()
    if reason:
        pytest.skip(reason)
    objs = helm_render.objects(helm_render.render({"prometheusRule": {"enabled": True}}))
    (rule,) = [o for o in objs if o["kind"] == "PrometheusRule"]
    plain = yaml.safe_load(ALERTS_YAML.read_text())
    assert rule["spec"]["groups"] == plain["groups"]
