"""The LLMServe CRD generated from the pydantic model: committed file, structure, defaults, CEL rules."""

from __future__ import annotations

import argparse
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from fulcrum.api import LLMServeSpec, Mode, RouterPolicy, parse_llmserve
from fulcrum.api.crd import CRD_NAME, build_crd, render_crd_yaml, spec_schema
from fulcrum.commands import crd as crd_command
from fulcrum.errors import SpecError

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "llmserve.yaml"


def _version(crd: dict[str, Any]) -> dict[str, Any]:
    (version,) = crd["spec"]["versions"]
    assert isinstance(version, dict)
    return version


def _walk(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from _walk(child, f"{path}.{name}")
    if "items" in node:
        yield from _walk(node["items"], f"{path}[]")


def _apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """Kubernetes structural defaulting: fill absent (or null, when not nullable) properties top-down."""
    if not isinstance(obj, dict) or schema.get("type") != "object":
        return obj
    out = dict(obj)
    for name, child in schema.get("properties", {}).items():
        if out.get(name) is None and not (name in out and child.get("nullable")) and "default" in child:
            out[name] = copy.deepcopy(child["default"])
        if name in out:
            out[name] = _apply_defaults(child, out[name])
    return out


def _drop_nulls(obj: Any) -> Any:
    """Kubernetes treats null-valued fields as absent in CEL expressions."""
    if isinstance(obj, dict):
        return {k: _drop_nulls(v) for k, v in obj.items() if v is not None}
    return obj


# --- the committed file --------------------------------------------------------------------------


def test_committed_crd_file_is_exactly_what_the_model_generates() -> None:
    assert CRD_FILE.read_text(encoding="utf-8") == render_crd_yaml(), (
        "crds/llmserve.yaml is stale: run `fulcrum crd --output crds/llmserve.yaml`"
    )
    assert yaml.safe_load(CRD_FILE.read_text(encoding="utf-8")) == build_crd()


def test_crd_command_prints_the_yaml_and_writes_it_to_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser(prog="fulcrum")
    crd_command.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["crd"])
    assert args.func is crd_command.run
    assert args.func(args) == 0
    assert capsys.readouterr().out == render_crd_yaml()
    out = tmp_path / "crd.yaml"
    args = parser.parse_args(["crd", "--output", str(out)])
    assert args.func(args) == 0
    assert out.read_text(encoding="utf-8") == render_crd_yaml()


# --- identity ------------------------------------------------------------------------------------


def test_crd_names_group_version_and_scope() -> None:
    crd = build_crd()
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    assert crd["kind"] == "CustomResourceDefinition"
    assert crd["metadata"]["name"] == CRD_NAME == "llmserves.fulcrum.dev"
    spec = crd["spec"]
    assert spec["group"] == "fulcrum.dev"
    assert spec["scope"] == "Namespaced"
    assert spec["names"] == {
        "kind": "LLMServe",
        "listKind": "LLMServeList",
        "plural": "llmserves",
        "singular": "llmserve",
        "shortNames": ["llms"],
    }
    version = _version(crd)
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)


def test_status_is_an_open_subresource_and_there_is_no_scale_subresource() -> None:
    version = _version(build_crd())
    assert version["subresources"] == {"status": {}}
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert status["type"] == "object" and status["x-kubernetes-preserve-unknown-fields"] is True


def test_printer_columns_show_mode_pools_ratio_forecast_slo_and_age() -> None:
    columns = {c["name"]: c["jsonPath"] for c in _version(build_crd())["additionalPrinterColumns"]}
    assert columns == {
        "Mode": ".spec.mode",
        "Prefill": ".status.pools.prefill.ready",
        "Decode": ".status.pools.decode.ready",
        "Ratio": ".status.plan.ratio",
        "Forecast RPS": ".status.forecast.rate",
        "SLO": ".status.sloAttainment",
        "Age": ".metadata.creationTimestamp",
    }


# --- structural schema ---------------------------------------------------------------------------


def test_schema_is_structural() -> None:
    root = _version(build_crd())["schema"]["openAPIV3Schema"]
    forbidden = {"$ref", "$defs", "anyOf", "allOf", "oneOf", "not", "title", "prefixItems", "const", "additionalProperties"}
    for path, node in _walk(root, "<root>"):
        assert not forbidden & node.keys(), f"{path}: {sorted(forbidden & node.keys())}"
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"{path}: no type"
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            if key in node:
                assert node[key] is True, f"{path}: {key} must be the OpenAPI v3.0 boolean form"
                assert ("minimum" if key == "exclusiveMinimum" else "maximum") in node
        if "enum" in node:
            assert node["type"] == "string"
        if node.get("type") == "array":
            assert "items" in node, path
    metadata = root["properties"]["metadata"]
    assert set(metadata["properties"]) <= {"name", "generateName"}  # all Kubernetes allows there


def test_spec_schema_keeps_the_model_constraints_in_openapi_v3_0_form() -> None:
    spec = spec_schema()
    props = spec["properties"]
    assert spec["required"] == ["model"]
    assert props["model"]["properties"]["name"]["minLength"] == 1
    assert props["model"]["properties"]["servedName"] == {
        "type": "string",
        "description": "Name clients use in the OpenAI API; defaults to `name`.",
        "nullable": True,
    }
    ttft = props["slo"]["properties"]["ttftMs"]
    assert (ttft["minimum"], ttft["exclusiveMinimum"], ttft["default"]) == (0, True, 2000.0)
    level = props["scaling"]["properties"]["forecaster"]["properties"]["predictionLevel"]
    assert (level["minimum"], level["exclusiveMinimum"], level["maximum"], level["exclusiveMaximum"]) == (
        0.5, True, 1.0, True,
    )
    order = props["scaling"]["properties"]["forecaster"]["properties"]["order"]
    assert order["items"] == {"type": "integer"} and order["minItems"] == order["maxItems"] == 3
    assert props["mode"]["enum"] == [m.value for m in Mode]
    assert props["router"]["properties"]["policy"]["enum"] == [p.value for p in RouterPolicy]
    assert props["router"]["properties"]["prefillQueue"]["enum"] == ["direct", "nats"]


def test_kubernetes_defaulting_of_a_minimal_spec_gives_what_pydantic_gives() -> None:
    """Object defaults (from default factories) let the API server fill the spec as the model does."""
    schema = spec_schema()
    minimal = {"model": {"name": "m"}}
    defaulted = _apply_defaults(schema, minimal)
    expected = LLMServeSpec.model_validate(minimal).model_dump(mode="json", by_alias=True, exclude_none=True)
    assert defaulted == expected
    assert defaulted["profile"] == {"name": "dopd-llama70b-fp8-h100"}
    # a partly given object gets its missing members, not the whole object default
    partial = _apply_defaults(schema, {"model": {"name": "m"}, "gpu": {"type": "A100", "memoryGiB": 40}})
    assert partial["gpu"] == {"type": "A100", "memoryGiB": 40, "hbmBandwidthGBps": 3350.0, "gpusPerNode": 8}


def test_the_crd_object_is_valid_for_kubernetes_per_kubernetes_validate() -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (pip install kubernetes-validate)"
    )
    crd = build_crd()
    # fieldPath in x-kubernetes-validations appeared in 1.28, the oldest release the CRD supports
    for version in ("1.28", kubernetes_validate.latest_version()):
        kubernetes_validate.validate(crd, version, strict=True)
    broken = copy.deepcopy(crd)
    _version(broken)["schema"]["openAPIV3Schema"]["properties"]["spec"]["x-kubernetes-validations"][0]["rules"] = "x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.28", strict=True)


# --- CEL rules -----------------------------------------------------------------------------------

_CEL_CASES: list[tuple[str, dict[str, Any]]] = [
    ("defaults", {}),
    ("min equals max", {"scaling": {"minGPUs": 4, "maxGPUs": 4}}),
    ("min above max", {"scaling": {"minGPUs": 9, "maxGPUs": 8}}),
    ("min above default max", {"scaling": {"minGPUs": 65}}),
    ("profile path only", {"profile": {"path": "p.yaml"}}),
    ("profile configMap only", {"profile": {"configMap": "prof"}}),
    ("profile two sources", {"profile": {"name": "a", "path": "p.yaml"}}),
    ("profile three sources", {"profile": {"name": "a", "path": "p", "configMap": "c"}}),
    ("profile no source", {"profile": {}}),
    ("profile empty name and a path", {"profile": {"name": "", "path": "p.yaml"}}),
    ("profile null name and a path", {"profile": {"name": None, "path": "p.yaml"}}),
    ("tp within node", {"scaling": {"tpDecode": 8}}),
    ("tp above default node size", {"scaling": {"tpDecode": 16}}),
    ("tp above given node size", {"gpu": {"gpusPerNode": 4}, "scaling": {"tpPrefill": 8}}),
    ("tp above max GPUs", {"scaling": {"maxGPUs": 2, "minGPUs": 1, "tpUnified": 4}}),
    ("tp null", {"scaling": {"tpUnified": None}}),
]


def _cel_rules(schema: dict[str, Any], obj: Any) -> Iterator[tuple[str, Any]]:
    """(rule, self) for every x-kubernetes-validations rule whose node is present in ``obj``."""
    for rule in schema.get("x-kubernetes-validations", []):
        yield rule["rule"], obj
    if isinstance(obj, dict):
        for name, child in schema.get("properties", {}).items():
            if name in obj:
                yield from _cel_rules(child, obj[name])


@pytest.mark.parametrize(("case", "overrides"), _CEL_CASES, ids=[c for c, _ in _CEL_CASES])
def test_cel_rules_accept_exactly_the_specs_the_model_accepts(case: str, overrides: dict[str, Any]) -> None:
    celpy = pytest.importorskip("celpy", reason="cel-python is not installed (pip install cel-python)")
    spec = {"model": {"name": "m"}, **overrides}
    try:
        parse_llmserve({"spec": spec})
        model_ok = True
    except SpecError:
        model_ok = False
    schema = spec_schema()
    obj = _drop_nulls(_apply_defaults(schema, spec))
    env = celpy.Environment()
    cel_ok = True
    for rule, self_value in _cel_rules(schema, obj):
        program = env.program(env.compile(rule))
        result = program.evaluate({"self": celpy.json_to_cel(self_value)})
        assert isinstance(result, celpy.celtypes.BoolType), f"{rule} -> {result!r}"
        cel_ok = cel_ok and bool(result)
    assert cel_ok == model_ok, f"{case}: CEL says {cel_ok}, pydantic says {model_ok}"


def test_cel_cases_cover_both_accepted_and_rejected_specs() -> None:
    verdicts = set()
    for _, overrides in _CEL_CASES:
        try:
            parse_llmserve({"spec": {"model": {"name": "m"}, **overrides}})
            verdicts.add(True)
        except SpecError:
            verdicts.add(False)
    assert verdicts == {True, False}
