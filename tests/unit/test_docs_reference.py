"""The committed LLMServe reference (docs/reference/llmserve.md) is exactly what its generator writes."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from fulcrum.api.crd import PRINTER_COLUMNS, spec_schema

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gen_llmserve_reference.py"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_llmserve_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_reference_equals_the_generators_output() -> None:
    gen = _generator()
    committed = gen.REFERENCE_PATH.read_text(encoding="utf-8")
    assert committed == gen.render(), (
        "docs/reference/llmserve.md is stale: run `python scripts/gen_llmserve_reference.py`"
    )


def test_every_spec_field_of_the_model_has_a_row() -> None:
    gen = _generator()
    text = gen.render()
    paths = [row[0].strip("`") for name, node in spec_schema()["properties"].items()
             for row in gen.field_rows(node, f"spec.{name}")]
    assert "spec.scaling.forecaster.predictionLevel" in paths
    assert "spec.placement.tolerations[].effect" in paths
    for path in paths:
        assert f"| `{path}` |" in text, path


def test_every_cel_rule_and_printer_column_is_listed() -> None:
    gen = _generator()
    text = gen.render()
    rules = list(gen.cel_rules(spec_schema(), "spec"))
    assert len(rules) >= 9
    for _, _, message, _ in rules:
        assert message.replace("|", "\\|") in text
    for column in PRINTER_COLUMNS:
        assert f"`{column['jsonPath']}`" in text


def test_check_mode_reports_a_stale_page(tmp_path: Path) -> None:
    gen = _generator()
    stale = tmp_path / "llmserve.md"
    stale.write_text("# old\n", encoding="utf-8")
    assert gen.main(["--check", "--output", str(stale)]) == 1
    assert gen.main(["--output", str(stale)]) == 0
    assert gen.main(["--check", "--output", str(stale)]) == 0
