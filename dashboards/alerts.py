"""Fulcrum's alert rules: the one source of ``dashboards/alerts.yaml`` and the chart's PrometheusRule template.

Each rule's expression and duration may name a threshold as ``$(key)``, where ``key`` is a key of the chart's
``prometheusRule.thresholds`` values. ``dashboards/build.py`` writes the rules twice from here:

- ``dashboards/alerts.yaml``: a plain Prometheus rule file (``rule_files:``) with the chart's default thresholds
  (read from ``charts/fulcrum/values.yaml``, so the defaults live in one place);
- ``charts/fulcrum/templates/prometheusrule.yaml``: the same rules with ``{{ .Values.prometheusRule.thresholds.key }}``
  and Prometheus' own ``{{ $labels.x }}`` escaped from Helm.

The rules read only metrics Fulcrum's parts export (``tests/unit/test_alerts.py`` checks each name): the operator's
``fulcrum_operator_*``, the router's ``fulcrum_router_*`` and vLLM's ``vllm:*``. Labels: operator series carry
``llmserve`` (and ``pool``/``series``); router and worker series carry ``namespace``/``llmserve`` from the chart's
PodMonitor relabelling. ``docs/dashboards.md`` says what to do when each fires.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["GROUP", "RULES", "THRESHOLD", "plain_rules", "helm_template"]

#: Name of the one rule group.
GROUP = "fulcrum"

#: ``$(key)``: a threshold from ``prometheusRule.thresholds``.
THRESHOLD = re.compile(r"\$\((\w+)\)")

#: The rules, in the order they appear in both outputs.
RULES: tuple[dict[str, Any], ...] = (
    {
        "alert": "FulcrumSLOAttainmentLow",
        "expr": "min by (llmserve) (fulcrum_operator_slo_attainment) < $(sloAttainmentTarget)",
        "for": "$(for)",
        "labels": {"severity": "warning"},
        "annotations": {
            "summary": "LLMServe {{ $labels.llmserve }} meets its SLOs for {{ $value | humanizePercentage }} of requests",
            "description": (
                "The share of requests meeting both the TTFT and the TPOT SLO has stayed below the target. The operator "
                "scales out reactively when attainment falls; if it cannot, check maxGPUs, pending pods and the "
                "PoolNotReady alert (docs/dashboards.md#fulcrumsloattainmentlow)."
            ),
        },
    },
    {
        "alert": "FulcrumForecastErrorHigh",
        "expr": "max by (llmserve, series) (fulcrum_operator_forecast_error) > $(forecastErrorMax)",
        "for": "$(for)",
        "labels": {"severity": "info"},
        "annotations": {
            "summary": "Forecast of {{ $labels.series }} for {{ $labels.llmserve }} is off by {{ $value | humanizePercentage }}",
            "description": (
                "The relative one-step forecast error stays high: the workload changed shape (the forecaster refits "
                "on a structural break) or the window is too short (docs/dashboards.md#fulcrumforecasterrorhigh)."
            ),
        },
    },
    {
        "alert": "FulcrumPoolNotReady",
        "expr": (
            "sum by (llmserve, pool) (fulcrum_operator_ready_instances)"
            " < sum by (llmserve, pool) (fulcrum_operator_planned_instances)"
        ),
        "for": "$(poolNotReadyFor)",
        "labels": {"severity": "warning"},
        "annotations": {
            "summary": "Pool {{ $labels.pool }} of {{ $labels.llmserve }} has fewer ready instances than planned",
            "description": (
                "Planned instances have not become ready: pods pending on GPUs, image pulls, or failing readiness "
                "(docs/dashboards.md#fulcrumpoolnotready)."
            ),
        },
    },
    {
        "alert": "FulcrumDrainStuck",
        "expr": (
            "time() - max by (llmserve, pool) (fulcrum_operator_drain_started_timestamp_seconds > 0)"
            " > $(drainStuckSeconds)"
        ),
        "for": "0m",
        "labels": {"severity": "warning"},
        "annotations": {
            "summary": "The drain of pool {{ $labels.pool }} of {{ $labels.llmserve }} has run {{ $value | humanizeDuration }}",
            "description": (
                "Instances being scaled in keep running or waiting requests until the drain timeout: long decodes, "
                "or the router still sends them work (docs/dashboards.md#fulcrumdrainstuck)."
            ),
        },
    },
    {
        "alert": "FulcrumRouterNoHealthyInstance",
        "expr": "max by (namespace, llmserve) (fulcrum_router_instances_available) == 0",
        "for": "1m",
        "labels": {"severity": "critical"},
        "annotations": {
            "summary": "The router of {{ $labels.namespace }}/{{ $labels.llmserve }} has no healthy instance",
            "description": (
                "Every instance the router knows is unhealthy or ejected: requests fail with 503 "
                "(docs/dashboards.md#fulcrumrouternohealthyinstance)."
            ),
        },
    },
    {
        "alert": "FulcrumNIXLTransferFailures",
        "expr": (
            "sum by (namespace, llmserve) (rate(vllm:nixl_num_failed_transfers_total[5m]))"
            " > $(nixlFailuresPerSecond)"
        ),
        "for": "$(for)",
        "labels": {"severity": "warning"},
        "annotations": {
            "summary": "KV transfers over NIXL fail in {{ $labels.namespace }}/{{ $labels.llmserve }} ({{ $value }}/s)",
            "description": (
                "Decode instances cannot pull KV blocks from prefill instances: the side-channel port (nixl, 5600) is "
                "blocked, or the UCX transport is misconfigured (docs/dashboards.md#fulcrumnixltransferfailures)."
            ),
        },
    },
)


def _fill(text: str, thresholds: Mapping[str, Any]) -> str:
    def one(m: re.Match[str]) -> str:
        key = m.group(1)
        if key not in thresholds:
            raise KeyError(f"alert threshold $({key}) is not in prometheusRule.thresholds")
        return str(thresholds[key])

    return THRESHOLD.sub(one, text)


def plain_rules(thresholds: Mapping[str, Any]) -> dict[str, Any]:
    """The rules as a Prometheus rule file (``{"groups": [...]}``), thresholds filled in.

    Raises:
        KeyError: a rule names a threshold that ``thresholds`` lacks.
    """
    rules = []
    for rule in RULES:
        r = dict(rule)
        r["expr"] = _fill(rule["expr"], thresholds)
        r["for"] = _fill(rule["for"], thresholds)
        rules.append(r)
    return {"groups": [{"name": GROUP, "rules": rules}]}


def _helm_escape(text: str) -> str:
    """Prometheus' ``{{ ... }}`` as literal text in a Helm template."""
    return re.sub(r"\{\{(.*?)\}\}", lambda m: '{{ "{{" }}' + m.group(1) + '{{ "}}" }}', text)


def _helm_value(text: str) -> str:
    return THRESHOLD.sub(lambda m: "{{ .Values.prometheusRule.thresholds." + m.group(1) + " }}", text)


def _q(text: str) -> str:
    """A YAML double-quoted scalar (JSON string escaping is valid YAML)."""
    return json.dumps(text)


def helm_template() -> str:
    """``charts/fulcrum/templates/prometheusrule.yaml``: the rules as a Prometheus Operator ``PrometheusRule``."""
    lines = [
        "{{- if .Values.prometheusRule.enabled }}",
        "# Generated by dashboards/build.py from dashboards/alerts.py: do not edit (dashboards/alerts.yaml has the",
        "# same rules for a Prometheus without the Operator).",
        "apiVersion: monitoring.coreos.com/v1",
        "kind: PrometheusRule",
        "metadata:",
        '  name: {{ include "fulcrum.fullname" . }}',
        "  namespace: {{ .Release.Namespace }}",
        "  labels:",
        '    {{- include "fulcrum.labels" . | nindent 4 }}',
        "    app.kubernetes.io/component: alerts",
        "    {{- with .Values.prometheusRule.labels }}",
        "    {{- toYaml . | nindent 4 }}",
        "    {{- end }}",
        "spec:",
        "  groups:",
        f"    - name: {GROUP}",
        "      rules:",
    ]
    for rule in RULES:
        lines.append(f"        - alert: {rule['alert']}")
        lines.append(f"          expr: {_helm_value(_q(rule['expr']))}")
        lines.append(f"          for: {_helm_value(rule['for'])}")
        lines.append("          labels:")
        for k, v in rule["labels"].items():
            lines.append(f"            {k}: {_q(v)}")
        lines.append("          annotations:")
        for k, v in rule["annotations"].items():
            lines.append(f"            {k}: {_helm_escape(_q(v))}")
    lines.append("{{- end }}")
    return "\n".join(lines) + "\n"
