"""The Grafana dashboard (dashboards/fulcrum-llmserve.json): well-formed, laid out, rebuilt identically by
dashboards/build.py, every query valid PromQL (promtool) and every metric it reads exported by a Fulcrum part."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = REPO / "dashboards"
DASHBOARD = DASHBOARDS / "fulcrum-llmserve.json"
sys.path.insert(0, str(DASHBOARDS))

import metrics_catalog  # noqa: E402

# What Grafana needs of a dashboard JSON model (the essentials of its dashboard schema).
_TARGET = {
    "type": "object",
    "required": ["expr", "refId"],
    "properties": {"expr": {"type": "string", "minLength": 1}, "refId": {"type": "string", "pattern": "^[A-Z]$"},
                   "legendFormat": {"type": "string"}},
}
_GRID = {
    "type": "object",
    "required": ["h", "w", "x", "y"],
    "properties": {"h": {"type": "integer", "minimum": 1}, "w": {"type": "integer", "minimum": 1, "maximum": 24},
                   "x": {"type": "integer", "minimum": 0, "maximum": 23}, "y": {"type": "integer", "minimum": 0}},
}
DASHBOARD_SCHEMA = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "required": ["title", "uid", "panels", "templating", "schemaVersion", "time", "annotations"],
    "properties": {
        "title": {"type": "string", "minLength": 1},
        "uid": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,40}$"},
        "schemaVersion": {"type": "integer", "minimum": 30},
        "time": {"type": "object", "required": ["from", "to"]},
        "templating": {"type": "object", "required": ["list"], "properties": {"list": {"type": "array", "items": {
            "type": "object", "required": ["name", "type"]}}}},
        "annotations": {"type": "object", "required": ["list"]},
        "panels": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["id", "type", "title", "gridPos"],
                "properties": {"id": {"type": "integer", "minimum": 1}, "type": {"type": "string"},
                               "title": {"type": "string", "minLength": 1}, "gridPos": _GRID},
                "if": {"properties": {"type": {"const": "row"}}},
                "then": {"properties": {"panels": {"type": "array", "maxItems": 0}}},
                "else": {"required": ["targets", "datasource", "description"],
                         "properties": {"targets": {"type": "array", "minItems": 1, "items": _TARGET}}},
            },
        },
    },
}


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _queries(d: dict[str, Any]) -> list[tuple[str, str]]:
    """``(where, expr)`` for every panel target and annotation query."""
    out = [(f"panel {p['title']!r}", t["expr"]) for p in d["panels"] for t in p.get("targets", [])]
    out += [(f"annotation {a['name']!r}", a["expr"]) for a in d["annotations"]["list"] if a.get("expr")]
    return out


def _load_build() -> Any:
    spec = importlib.util.spec_from_file_location("fulcrum_dashboards_build", DASHBOARDS / "build.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_dashboard_is_a_well_formed_grafana_dashboard() -> None:
    d = _dashboard()
    jsonschema.Draft7Validator.check_schema(DASHBOARD_SCHEMA)
    jsonschema.Draft7Validator(DASHBOARD_SCHEMA).validate(d)
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    names = {v["name"] for v in d["templating"]["list"]}
    assert {"datasource", "namespace", "llmserve"} <= names
    for p in d["panels"]:
        refs = [t["refId"] for t in p.get("targets", [])]
        assert len(refs) == len(set(refs)), p["title"]
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def test_panels_tile_the_grid_without_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for p in _dashboard()["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]


def test_every_query_selects_one_llmserve() -> None:
    for where, expr in _queries(_dashboard()):
        for sel in re.findall(r"\{([^{}]*)\}", expr):
            assert "$llmserve" in sel, f"{where}: {expr}"


def test_the_panels_the_design_asks_for_are_there() -> None:
    titles = " | ".join(p["title"] for p in _dashboard()["panels"])
    for words in ("Request rate: actual vs forecast", "ISL", "OSL", "planned vs ready", "P/D ratio: planned vs actual",
                  "TTFT p50 / p90 / p99 vs SLO", "TPOT p50 / p90 / p99 vs SLO", "SLO attainment", "goodput",
                  "Split ratio", "How requests ran", "KV transfer", "Queue depths", "Per-instance load",
                  "budget"):
        assert words in titles, words
    d = _dashboard()
    (band,) = [p for p in d["panels"] if p["title"].startswith("Request rate")]
    fills = [o for o in band["fieldConfig"]["overrides"]
             for prop in o["properties"] if prop["id"] == "custom.fillBelowTo"]
    assert fills and fills[0]["matcher"]["options"] == "forecast upper"
    assert any("scale_events" in a.get("expr", "") for a in d["annotations"]["list"])


def test_the_metric_name_extractor_finds_names_and_skips_functions_labels_and_variables() -> None:
    expr = ('sum by (le, pod) (rate(a_bucket{namespace="$namespace", x=~"b|c"}[$__rate_interval])) '
            '/ ignoring(kind) group_left sum(b_total offset 5m) * scalar(max(vllm:c{d="e"})) > vector($slo)')
    assert sorted(metric_names(expr)) == ["a_bucket", "b_total", "vllm:c"]


def metric_names(expr: str) -> set[str]:
    return metrics_catalog.metric_names(expr)


def test_every_metric_a_panel_reads_is_exported_by_router_operator_vllm_or_scheduler() -> None:
    exported = metrics_catalog.exported()
    known = set().union(*exported.values())
    used: dict[str, str] = {}
    for where, expr in _queries(_dashboard()):
        for name in metric_names(expr):
            used.setdefault(name, where)
    assert used
    missing = {n: w for n, w in used.items() if n not in known}
    assert not missing, f"metrics no part exports: {missing}"
    # each source is used: the dashboard covers the router, operator, vLLM and the scheduler
    for source, names in exported.items():
        assert set(used) & names, source
    # an unknown name would be caught
    assert "fulcrum_router_no_such_metric_total" not in known


def test_the_vllm_names_are_the_ones_design_lists() -> None:
    design = REPO.parent / "shared" / "DESIGN.md"
    if not design.exists():
        pytest.skip(f"{design} not found")
    text = design.read_text()
    for name, kind in metrics_catalog.VLLM.items():
        # the older names are quoted without the prefix ("Older releases used `gpu_cache_usage_perc`")
        assert name in text or f"`{name.split(':', 1)[1]}`" in text, name


def test_every_query_is_valid_promql() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not found (Debian package prometheus)")
    d = _dashboard()
    variables = {"$__rate_interval": "1m", "$namespace": "ns", "$llmserve": "llm", "$ttft_slo_s": "2",
                 "$tpot_slo_s": "0.1", "$slo_target": "0.9"}
    rules = []
    for i, (_, expr) in enumerate(_queries(d)):
        for k in sorted(variables, key=len, reverse=True):
            expr = expr.replace(k, variables[k])
        assert "$" not in expr, expr
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    tmp = REPO / ".pytest_cache" / "dashboard-queries.yaml"
    tmp.parent.mkdir(exist_ok=True)
    tmp.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run([promtool, "check", "rules", str(tmp)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules)} rules found" in out.stdout


def test_the_chart_ships_the_committed_dashboard() -> None:
    for path in DASHBOARDS.glob("*.json"):
        assert (REPO / "charts" / "fulcrum" / "dashboards" / path.name).read_text() == path.read_text()


def test_the_build_script_reproduces_every_committed_output() -> None:
    pytest.importorskip("grafana_foundation_sdk", reason="pip install 'grafana-foundation-sdk==1769699998!10.1.0'")
    build = _load_build()
    outputs = build.outputs()
    assert DASHBOARD in outputs
    for path, text in outputs.items():
        assert path.read_text() == text, f"{path} is stale: run python dashboards/build.py"
