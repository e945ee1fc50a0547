"""One step-cost model (issue 12, item 2; STYLE.md §15): only ``fulcrum.ratio.step_cost`` evaluates a profile's
latency coefficients, and the code that models engine steps (simulator, sim-worker and scheduler, router and
routing core, replay, rebalancing) takes every step time from it instead of reading the profile's tables itself.

The planning code (``fulcrum.ratio``, ``fulcrum.scaling``) and the operator may still ask the profile for one
request's TTFT or one decode step's TPOT (``profile.ttft`` / ``profile.tpot``) in their queueing models; they may
not take its tables or fitted coefficients apart.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OWNERS = {REPO / "operator" / "ratio" / "profile.py", REPO / "operator" / "ratio" / "step_cost.py"}

COEFFICIENTS = frozenset({
    "quadratic", "_fit", "_q",  # PrefillTable's NNLS fit τ + κ1·x + κ2·x² (DOPD eq. 5)
    "prefill_batch_time",  # the profile's batched-prefill formula (DOPD Alg. 1)
    "per_seq_s", "per_context_token_s", "fit_decode",  # the linear decode fit w + m·b + k·b·c
    "prefill_table", "decode_table",  # a StepCost's tables
})
"""Names that only the profile and the step-cost module may touch."""
TABLE_LOOKUPS = frozenset({"ttft", "tpot", "prefill_batch_time"})
"""Profile latency lookups the step-modelling packages must leave to the step-cost module."""
STEP_MODELLING = (
    "fulcrum.simulator", "fulcrum.worker", "fulcrum.router", "fulcrum.routing", "fulcrum.replay", "fulcrum.rebalancing",
)
"""Packages that model engine steps (``fulcrum.routing``: the routing core issue 12 moves the predictor into)."""


def package_files() -> dict[Path, str]:
    """Every source file of the ``fulcrum`` package as pyproject.toml maps it → its module name."""
    mapping: dict[str, str] = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    out: dict[Path, str] = {}
    for pkg, folder in mapping.items():
        root = REPO / folder
        for f in root.rglob("*.py"):
            rel = f.relative_to(root).with_suffix("")
            out[f] = ".".join((pkg, *rel.parts))
    return out


def _table_of_profile(node: ast.expr) -> bool:
    """``<x>.prefill[...]`` or ``<x>.decode[...]``: one of a profile's per-TP tables."""
    return isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr in (
        "prefill", "decode")


def violations(tree: ast.AST, module: str) -> list[str]:
    """Where ``tree`` evaluates a latency coefficient or (in a step-modelling package) looks up a step time."""
    found: list[str] = []
    step_modelling = module.startswith(STEP_MODELLING)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COEFFICIENTS:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Name) and node.id == "fit_decode":
            found.append(f"line {node.lineno}: fit_decode")
        elif isinstance(node, ast.Call):
            func = node.func
            if _table_of_profile(func):
                found.append(f"line {node.lineno}: a profile table called")
            elif isinstance(func, ast.Attribute) and _table_of_profile(func.value):
                found.append(f"line {node.lineno}: .{func.attr}() of a profile table")
            elif step_modelling and isinstance(func, ast.Attribute) and func.attr in TABLE_LOOKUPS:
                found.append(f"line {node.lineno}: .{func.attr}() — take step times from fulcrum.ratio.step_cost")
    return found


def test_only_the_step_cost_module_evaluates_latency_coefficients():
    files = package_files()
    assert len(files) > 50 and REPO / "operator" / "ratio" / "step_cost.py" in files
    bad: list[str] = []
    for path, module in sorted(files.items()):
        if path in OWNERS:
            continue
        for v in violations(ast.parse(path.read_text(encoding="utf-8"), str(path)), module):
            bad.append(f"{path.relative_to(REPO)} {v}")
    assert not bad, "step costs evaluated outside fulcrum.ratio.step_cost:\n" + "\n".join(bad)


def test_the_check_sees_each_kind_of_private_step_cost():
    """The checker itself: each shape of a second step-cost model is reported (fakes of the removed copies)."""
    sources = {
        "fulcrum.simulator.fake": "d = self._profile.tpot(n, c, tp)",
        "fulcrum.worker.fake": "x = profile.prefill_batch_time(fresh, tp)",
        "fulcrum.router.fake": "t = profile.prefill[tp](x) + profile.decode[tp].__call__(1, 1)",
        "fulcrum.ratio.fake": "_, k1, k2 = profile.prefill[tp].quadratic",
        "fulcrum.scaling.fake": "s = costs.per_seq_s * b",
    }
    for module, src in sources.items():
        assert violations(ast.parse(src), module), module
    # planning code may ask for one request's latency; the metric objects named ttft/tpot are not lookups
    assert not violations(ast.parse("t = profile.ttft(isl, tp) + profile.tpot(b, c, tp)"), "fulcrum.ratio.planner")
    assert not violations(ast.parse("m.ttft.observe(now - t0)"), "fulcrum.router.relay")
