"""Units of the series on the committed dashboard (dashboards/fulcrum-llmserve.json, built by dashboards/build.py).

A panel's unit applies to every series on it unless an override (by name or by regexp of the legend) sets the
series' own. A series in seconds (a ``*_seconds`` metric, or an SLO variable ``$..._s``) must be shown in seconds;
a series that is not (a count, a rate of a counter, table entries) must not be shown as seconds; a 0..1 share
(``vllm:kv_cache_usage_perc``) must be shown as a percentage (``percentunit``).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = REPO / "dashboards"
sys.path.insert(0, str(DASHBOARDS))

import metrics_catalog  # noqa: E402

SHARES = {"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "fulcrum_operator_slo_attainment"}


def _panels() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for p in json.loads((DASHBOARDS / "fulcrum-llmserve.json").read_text())["panels"]:
        out.extend(p.get("panels") or [] if p.get("type") == "row" else [p])
    return [p for p in out if p.get("type") == "timeseries"]


def _unit_of(panel: dict[str, Any], legend: str) -> str | None:
    """The unit Grafana shows the series with legend ``legend`` in (``{{label}}`` filled with a sample value)."""
    name = re.sub(r"\{\{\s*\w+\s*\}\}", "x", legend)
    fc = panel.get("fieldConfig") or {}
    unit = (fc.get("defaults") or {}).get("unit")
    for ov in fc.get("overrides") or []:
        m = ov["matcher"]
        hit = (m["id"] == "byName" and m["options"] == name) or (m["id"] == "byRegexp" and re.fullmatch(m["options"], name))
        if hit:
            for prop in ov["properties"]:
                if prop["id"] == "unit":
                    unit = prop["value"]
    return unit


def _kind(expr: str) -> str:
    names = metrics_catalog.metric_names(expr)
    if names and all(n in SHARES or n.endswith("_perc") for n in names):  # a share times a rate is no share
        return "share"
    if any("_seconds" in n for n in names) or re.search(r"\$\w+_s\b", expr):
        return "seconds"
    return "other"


CASES = [(p["title"], t["legendFormat"], t["expr"]) for p in _panels() for t in p.get("targets") or []]


@pytest.mark.parametrize(("title", "legend", "expr"), CASES, ids=[f"{c[0]}: {c[1]}" for c in CASES])
def test_every_dashboard_series_is_shown_in_its_own_unit(title: str, legend: str, expr: str) -> None:
    panel = next(p for p in _panels() if p["title"] == title)
    unit = _unit_of(panel, legend)
    kind = _kind(expr)
    if kind == "seconds":
        assert unit == "s", f"{title} / {legend}: seconds shown as {unit!r}"
    elif kind == "share":
        assert unit == "percentunit", f"{title} / {legend}: a 0..1 share shown as {unit!r}"
    else:
        assert unit != "s", f"{title} / {legend}: {expr} is not in seconds but shown as seconds"
