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
    if isinstance(obj, list):
        return [_drop_nulls(v) for v in obj]
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


def test_status_is_an_open_subresource_and_scale_points_at_the_total_replicas() -> None:
    version = _version(build_crd())
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.scaling.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert status["type"] == "object" and status["x-kubernetes-preserve-unknown-fields"] is True
    scaling = spec_schema()["properties"]["scaling"]["properties"]
    # not nullable: the scale subresource reads specReplicasPath as an int64 and the API server refuses an object
    # holding a null there ("<nil> is of the type <nil>, expected int64"); without nullable a null is pruned (unset)
    assert scaling["replicas"]["type"] == "integer" and "nullable" not in scaling["replicas"]
    assert "nullable" not in scaling["replicas"] and "default" not in scaling["replicas"]
    assert parse_llmserve({"spec": {"model": {"name": "m"}, "scaling": {"replicas": None}}}).spec.scaling.replicas is None
    assert scaling["replicaOwner"]["enum"] == ["Operator", "External"]
    assert scaling["replicaOwner"]["default"] == "Operator"


def test_printer_columns_show_mode_pools_ratio_forecast_slo_and_age() -> None:
    columns = {c["name"]: c["jsonPath"] for c in _version(build_crd())["additionalPrinterColumns"]}
    assert columns == {
        "Mode": ".spec.mode",
        "Prefill": ".status.pools.prefill.ready",
        "Decode": ".status.pools.decode.ready",
        "Ratio": ".status.plan.ratio",
        "Forecast RPS": ".status.forecast.rate",
        "SLO Attainment": ".status.sloAttainment",
        "Age": ".metadata.creationTimestamp",
        "Unified": ".status.pools.unified.ready",
        "Owner": ".spec.scaling.replicaOwner",
    }
    wide_only = {c["name"] for c in _version(build_crd())["additionalPrinterColumns"] if c.get("priority", 0) > 0}
    assert wide_only == {"Unified", "Owner"}


# --- structural schema ---------------------------------------------------------------------------


def test_schema_is_structural() -> None:
    root = _version(build_crd())["schema"]["openAPIV3Schema"]
    forbidden = {"$ref", "$defs", "anyOf", "allOf", "oneOf", "not", "title", "prefixItems", "const", "additionalProperties"}
    for path, node in _walk(root, "<root>"):
        keys = node.keys() - {"additionalProperties"} if isinstance(node.get("additionalProperties"), dict) else node.keys()
        assert not forbidden & keys, f"{path}: {sorted(forbidden & keys)}"
        if "additionalProperties" in node:  # a map: a value schema, never properties too
            assert isinstance(node["additionalProperties"], dict) and "properties" not in node, path
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields") or (
            node.get("x-kubernetes-int-or-string") is True), f"{path}: no type"
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node, f"{path}: int-or-string has no type"
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
    assert order["items"] == {"type": "integer", "minimum": 0, "maximum": 8} and order["minItems"] == order["maxItems"] == 3
    assert props["mode"]["enum"] == [m.value for m in Mode]
    assert props["router"]["properties"]["policy"]["enum"] == [p.value for p in RouterPolicy]
    assert props["router"]["properties"]["prefillQueue"]["enum"] == ["direct", "nats"]


def test_every_property_has_a_description_for_kubectl_explain() -> None:
    root = _version(build_crd())["schema"]["openAPIV3Schema"]
    missing = [
        path for path, node in _walk(root["properties"]["spec"], "spec")
        if not node.get("description") and not (path.endswith("[]") and node.get("type") != "object")
    ]  # scalar list items are described by their list
    assert missing == []


def test_new_fields_have_the_types_kubernetes_needs() -> None:
    props = spec_schema()["properties"]
    engine = props["engine"]["properties"]
    assert engine["kind"]["enum"] == ["vllm", "sim"] and engine["kind"]["default"] == "vllm"
    cpu = engine["resources"]["properties"]["requests"]["properties"]["cpu"]
    assert cpu["x-kubernetes-int-or-string"] is True and "type" not in cpu
    placement = props["placement"]["properties"]
    assert placement["nodeSelector"]["additionalProperties"]["type"] == "string"
    assert placement["tolerations"]["type"] == "array"
    assert placement["tolerations"]["items"]["properties"]["effect"]["enum"] == ["NoSchedule", "PreferNoSchedule", "NoExecute"]
    node_affinity = placement["affinity"]["properties"]["nodeAffinity"]
    assert node_affinity["type"] == "object" and node_affinity["x-kubernetes-preserve-unknown-fields"] is True
    assert props["connectors"]["default"] == {"etcd": "", "nats": ""}
    assert props["scaling"]["properties"]["drainTimeoutSeconds"]["default"] == 300


@pytest.mark.parametrize(("value", "ok"), [(4, True), ("500m", True), ("16Gi", True), ("0.5", True), ("1e3", True),
                                           (0.5, False), ("lots", False), ("16 Gi", False), (True, False)])
def test_resource_quantities_accept_integers_and_kubernetes_quantity_strings(value: Any, ok: bool) -> None:
    spec = {"model": {"name": "m"}, "engine": {"resources": {"requests": {"cpu": value}}}}
    if ok:
        parsed = parse_llmserve({"spec": spec}).spec.engine.resources.requests.cpu
        assert parsed == str(value)
    else:
        with pytest.raises(SpecError, match="spec.engine.resources.requests.cpu"):
            parse_llmserve({"spec": spec})


def test_a_quantity_number_with_a_fraction_is_refused_with_the_string_form_to_write() -> None:
    """int-or-string takes integers only: the API server refuses ``cpu: 0.5``, so the model does too, and says
    what to write instead; an integral float is an integer to the API server too."""
    spec = {"model": {"name": "m"}, "engine": {"resources": {"limits": {"cpu": 0.5}}}}
    with pytest.raises(SpecError, match=r'spec\.engine\.resources\.limits\.cpu: 0\.5 .*"500m" or "0\.5"'):
        parse_llmserve({"spec": spec})
    spec["engine"]["resources"]["limits"]["cpu"] = 4.0
    assert parse_llmserve({"spec": spec}).spec.engine.resources.limits.cpu == "4"


def test_the_crd_checks_the_quantity_syntax_of_the_string_form() -> None:
    from fulcrum.api.llmserve import _QUANTITY

    resources = spec_schema()["properties"]["engine"]["properties"]["resources"]["properties"]
    for side in ("requests", "limits"):
        for name in ("cpu", "memory"):
            node = resources[side]["properties"][name]
            assert node["x-kubernetes-int-or-string"] is True and node["pattern"] == _QUANTITY.pattern


def test_metadata_name_leaves_room_for_the_child_object_names() -> None:
    parse_llmserve({"metadata": {"name": "a" * 55}, "spec": {"model": {"name": "m"}}})
    for bad in ("a" * 56, "1abc", "Abc"):
        with pytest.raises(SpecError, match="metadata.name"):
            parse_llmserve({"metadata": {"name": bad}, "spec": {"model": {"name": "m"}}})


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
    ("engine batch limits set", {"engine": {"maxNumSeqs": 64, "maxNumBatchedTokens": 2048}}),
    ("engine batched tokens equal to max seqs", {"engine": {"maxNumSeqs": 512, "maxNumBatchedTokens": 512}}),
    ("engine batched tokens below max seqs", {"engine": {"maxNumSeqs": 512, "maxNumBatchedTokens": 511}}),
    ("engine batched tokens below the default max seqs", {"engine": {"maxNumBatchedTokens": 255}}),
    ("engine max seqs above the default batched tokens", {"engine": {"maxNumSeqs": 8193}}),
    ("engine batch limits null", {"engine": {"maxNumSeqs": None, "maxNumBatchedTokens": None}}),
    ("engine sim, batched tokens below max seqs", {"engine": {"kind": "sim", "maxNumSeqs": 16, "maxNumBatchedTokens": 8}}),
    ("gpu label, sim engine, gpu.type not a label value",
     {"engine": {"kind": "sim"}, "gpu": {"type": "H100 SXM"}, "placement": {"gpuTypeLabel": "nvidia.com/gpu.product"}}),
    ("gpu label, vllm engine, gpu.type not a label value",
     {"gpu": {"type": "H100 SXM"}, "placement": {"gpuTypeLabel": "nvidia.com/gpu.product"}}),
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
    ("integral floats", {"scaling": {"minGPUs": 2.0, "maxGPUs": 8.0, "tpDecode": 2.0, "replicas": 4.0},
                         "gpu": {"gpusPerNode": 8.0}, "engine": {"maxNumSeqs": 16.0, "maxNumBatchedTokens": 4096.0}}),
    ("integral floats, min above max", {"scaling": {"minGPUs": 9.0, "maxGPUs": 8.0}}),
    ("tp within node", {"scaling": {"tpDecode": 8}}),
    ("tp above default node size", {"scaling": {"tpDecode": 16}}),
    ("tp above given node size", {"gpu": {"gpusPerNode": 4}, "scaling": {"tpPrefill": 8}}),
    ("tp above max GPUs", {"scaling": {"maxGPUs": 2, "minGPUs": 1, "tpUnified": 4}}),
    ("tp null", {"scaling": {"tpUnified": None}}),
    ("external with replicas", {"scaling": {"replicaOwner": "External", "replicas": 4}}),
    ("external without replicas", {"scaling": {"replicaOwner": "External"}}),
    ("external with null replicas", {"scaling": {"replicaOwner": "External", "replicas": None}}),
    ("operator ignores replicas", {"scaling": {"replicaOwner": "Operator", "replicas": 3}}),
    ("external zero replicas, min 0", {"scaling": {"replicaOwner": "External", "replicas": 0, "minGPUs": 0}}),
    ("external zero replicas, min 1", {"scaling": {"replicaOwner": "External", "replicas": 0}}),
    ("replicas at max GPUs", {"scaling": {"replicas": 64}}),
    ("replicas above max GPUs", {"scaling": {"replicas": 65}}),
    ("replicas too few for min GPUs", {"gpu": {"gpusPerNode": 2}, "scaling": {"minGPUs": 10, "replicas": 4}}),
    ("replicas enough for min GPUs", {"gpu": {"gpusPerNode": 2}, "scaling": {"minGPUs": 10, "replicas": 5}}),
    ("nats queue with a url", {"router": {"prefillQueue": "nats"}, "connectors": {"nats": "nats://nats:4222"}}),
    ("nats queue without a url", {"router": {"prefillQueue": "nats"}}),
    ("nats queue with an empty url", {"router": {"prefillQueue": "nats"}, "connectors": {"nats": ""}}),
    ("direct queue without a url", {"router": {"prefillQueue": "direct"}, "connectors": {"etcd": "etcd:2379"}}),
    ("sim engine", {"engine": {"kind": "sim"}}),
    ("prefix pull with load_aware", {"router": {"policy": "load_aware", "prefixPull": True}}),
    ("prefix pull with disaggregated", {"router": {"policy": "disaggregated", "prefixPull": True}}),
    ("prefix pull with the default policy", {"router": {"prefixPull": True}}),
    ("round robin, unified", {"mode": "Unified", "router": {"policy": "round_robin"}}),
    ("least loaded, unified", {"mode": "Unified", "router": {"policy": "least_loaded"}}),
    ("round robin, default mode", {"router": {"policy": "round_robin"}}),
    ("least loaded, disaggregated", {"mode": "Disaggregated", "router": {"policy": "least_loaded"}}),
    ("round robin, auto", {"mode": "Auto", "router": {"policy": "round_robin"}}),
    ("load aware, auto", {"mode": "Auto", "router": {"policy": "load_aware"}}),
    ("dopd, unified", {"mode": "Unified", "scaling": {"planner": "dopd"}}),
    ("dynamo-sla, unified", {"mode": "Unified", "scaling": {"planner": "dynamo-sla"}}),
    ("dynamo-load, unified", {"mode": "Unified", "scaling": {"planner": "dynamo-load"}}),
    ("static, unified", {"mode": "Unified", "scaling": {"planner": "static"}}),
    ("dopd, auto", {"mode": "Auto", "scaling": {"planner": "dopd"}}),
    ("dynamo-load, default mode", {"scaling": {"planner": "dynamo-load"}}),
    ("toleration of a key", {"placement": {"tolerations": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]}}),
    ("toleration of every taint", {"placement": {"tolerations": [{"operator": "Exists"}]}}),
    ("empty toleration", {"placement": {"tolerations": [{}]}}),
    ("toleration without key, Equal", {"placement": {"tolerations": [{"key": "", "operator": "Equal"}]}}),
    ("toleration without key, a value", {"placement": {"tolerations": [{"value": "v"}]}}),
    ("Exists with a value", {"placement": {"tolerations": [{"key": "a", "operator": "Exists", "value": "v"}]}}),
    ("Exists with an empty value", {"placement": {"tolerations": [{"key": "a", "operator": "Exists", "value": ""}]}}),
    ("Exists with a null value", {"placement": {"tolerations": [{"key": "a", "operator": "Exists", "value": None}]}}),
    ("Equal with a value", {"placement": {"tolerations": [{"key": "a", "operator": "Equal", "value": "v"}]}}),
    ("seconds without an effect", {"placement": {"tolerations": [{"key": "a", "tolerationSeconds": 30}]}}),
    ("seconds with NoSchedule",
     {"placement": {"tolerations": [{"key": "a", "effect": "NoSchedule", "tolerationSeconds": 30}]}}),
    ("seconds with NoExecute",
     {"placement": {"tolerations": [{"key": "a", "effect": "NoExecute", "tolerationSeconds": 30}]}}),
    ("a good toleration, then a bad one",
     {"placement": {"tolerations": [{"operator": "Exists"}, {"key": "a", "operator": "Exists", "value": "v"}]}}),
]


def _cel_rules(schema: dict[str, Any], obj: Any) -> Iterator[tuple[str, Any]]:
    """(rule, self) for every x-kubernetes-validations rule whose node is present in ``obj`` (list items too)."""
    for rule in schema.get("x-kubernetes-validations", []):
        yield rule["rule"], obj
    if isinstance(obj, dict):
        for name, child in schema.get("properties", {}).items():
            if name in obj:
                yield from _cel_rules(child, obj[name])
    if isinstance(obj, list) and "items" in schema:
        for item in obj:
            yield from _cel_rules(schema["items"], item)


def _model_accepts(spec: dict[str, Any]) -> bool:
    """Whether the pydantic model takes ``spec`` (a SpecError is a refusal)."""
    try:
        parse_llmserve({"spec": spec})
    except SpecError:
        return False
    return True


@pytest.mark.parametrize(("case", "overrides"), _CEL_CASES, ids=[c for c, _ in _CEL_CASES])
def test_cel_rules_accept_exactly_the_specs_the_model_accepts(case: str, overrides: dict[str, Any]) -> None:
    celpy = pytest.importorskip("celpy", reason="cel-python is not installed (pip install cel-python)")
    spec = {"model": {"name": "m"}, **overrides}
    model_ok = _model_accepts(spec)
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


def _schema_at(schema: dict[str, Any], names: list[str]) -> dict[str, Any] | None:
    for name in names:
        schema = schema.get("properties", {}).get(name)
        if schema is None:
            return None
    return schema


def test_every_integer_a_cel_rule_reads_is_wrapped_in_int() -> None:
    """Found in review against kube-apiserver 1.28: an integral float from a JSON client (``minGPUs: 2.0``) passes
    ``type: integer`` but reaches CEL as a double, and a rule comparing it with an int fails ("expected int, got
    float64 evaluating rule: minGPUs must be <= maxGPUs"). int(...) around every integer read makes both forms work
    (cel-python mixes ints and doubles freely, so this is checked on the rule text)."""
    import re

    spec = spec_schema()
    reads = re.compile(r"(int\(|has\()?self((?:\.[A-Za-z_]\w*)+)(\))?")
    checked = 0
    for path, node in _walk(spec, "spec"):
        for rule in node.get("x-kubernetes-validations", []):
            for m in reads.finditer(rule["rule"]):
                target = _schema_at(node, m.group(2).split(".")[1:])
                if target is None or target.get("type") != "integer":
                    continue
                checked += 1
                assert m.group(1) in ("int(", "has(") and m.group(3) == ")", f"{path}: {rule['rule']}: {m.group(0)}"
    assert checked >= 15


def test_a_null_for_a_field_that_is_not_nullable_means_the_default_as_the_api_server_prunes_it(tmp_path: Path) -> None:
    """Found in review: the API server prunes a null of a non-nullable field and defaults it (`mode:` left empty in
    YAML is Disaggregated), while `fulcrum replay`/`plan` (load_llmserve) refused it."""
    from fulcrum.api import load_llmserve

    path = tmp_path / "llmserve.yaml"
    path.write_text("apiVersion: fulcrum.dev/v1alpha1\nkind: LLMServe\nmetadata: {name: x}\n"
                    "spec:\n  model: {name: m}\n  mode:\n  scaling:\n", encoding="utf-8")
    spec = load_llmserve(path).spec
    assert spec.mode is Mode.DISAGGREGATED and spec.scaling == LLMServeSpec(model={"name": "m"}).scaling
    nested = parse_llmserve({"spec": {
        "model": {"name": "m"}, "engine": {"kind": None, "extraArgs": None}, "connectors": {"etcd": None},
        "router": {"rescheduling": None, "policy": None}, "placement": {"tolerations": [{"operator": "Exists",
                                                                                          "value": None}]},
        "scaling": {"replicaOwner": None, "replicas": None, "forecaster": {"order": None, "seasonLength": None}},
    }}).spec
    default = LLMServeSpec(model={"name": "m"})
    assert nested.engine == default.engine and nested.connectors == default.connectors
    assert nested.router == default.router and nested.scaling == default.scaling
    assert nested.placement.tolerations[0].value is None
    # what the schema refuses the model still refuses: a null list item, a null where a value is required
    for bad in ({"engine": {"extraArgs": [None]}}, {"model": None}):
        with pytest.raises(SpecError):
            parse_llmserve({"spec": {"model": {"name": "m"}, **bad}})
    # and the nulls the CRD keeps (nullable fields) agree with the simulated API server defaulting
    schema = spec_schema()
    for overrides in ({"mode": None, "scaling": None}, {"scaling": {"forecaster": None, "tpDecode": None}}):
        spec_doc = {"model": {"name": "m"}, **overrides}
        stored = _drop_nulls(_apply_defaults(schema, spec_doc))
        assert parse_llmserve({"spec": spec_doc}).spec == parse_llmserve({"spec": stored}).spec


def test_cel_cases_cover_both_accepted_and_rejected_specs() -> None:
    verdicts = set()
    for _, overrides in _CEL_CASES:
        try:
            parse_llmserve({"spec": {"model": {"name": "m"}, **overrides}})
            verdicts.add(True)
        except SpecError:
            verdicts.add(False)
    assert verdicts == {True, False}


def test_toleration_rules_are_those_kubernetes_enforces_on_a_pod() -> None:
    """An empty key needs operator Exists, Exists takes no value, tolerationSeconds needs effect NoExecute: the API
    server refuses the worker Deployments otherwise, so the model and the CRD refuse the spec up front."""
    def check(toleration: dict[str, Any], message: str) -> None:
        with pytest.raises(SpecError, match=rf"spec\.placement\.tolerations\.0: .*{message}"):
            parse_llmserve({"spec": {"model": {"name": "m"}, "placement": {"tolerations": [toleration]}}})

    check({}, "operator must be Exists when key is empty")
    check({"key": "a", "operator": "Exists", "value": "v"}, "value must be empty when operator is Exists")
    check({"key": "a", "tolerationSeconds": 5}, "effect must be NoExecute when tolerationSeconds is set")
    rules = spec_schema()["properties"]["placement"]["properties"]["tolerations"]["items"]["x-kubernetes-validations"]
    assert [r["fieldPath"] for r in rules] == [".operator", ".value", ".effect", ".key"]


# --- values the API server refuses by type or bound --------------------------------------------------


def _openapi_to_jsonschema(node: dict[str, Any]) -> dict[str, Any]:
    """A structural OpenAPI v3.0 node as draft-4 JSON schema (nullable, int-or-string; x-kubernetes-* dropped)."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {n: _openapi_to_jsonschema(c) for n, c in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _openapi_to_jsonschema(value)
        elif not key.startswith("x-kubernetes") and key not in ("nullable", "default", "description"):
            out[key] = value
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]  # a pattern applies to the string form only
    if node.get("nullable") and "type" in out:
        out["type"] = (out["type"] if isinstance(out["type"], list) else [out["type"]]) + ["null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


_VALUE_CASES: list[tuple[str, dict[str, Any], bool]] = [
    ("cpu lots", {"engine": {"resources": {"requests": {"cpu": "lots"}}}}, False),
    ("cpu 2", {"engine": {"resources": {"requests": {"cpu": 2}}}}, True),
    ("cpu 500m", {"engine": {"resources": {"requests": {"cpu": "500m"}}}}, True),
    ("cpu 0.5 as a string", {"engine": {"resources": {"limits": {"cpu": "0.5"}}}}, True),
    ("cpu 0.5 as a number", {"engine": {"resources": {"limits": {"cpu": 0.5}}}}, False),
    ("memory 16Gi", {"engine": {"resources": {"limits": {"memory": "16Gi"}}}}, True),
    ("memory 16 Gi", {"engine": {"resources": {"limits": {"memory": "16 Gi"}}}}, False),
    ("order (2, 0, 1)", {"scaling": {"forecaster": {"order": [2, 0, 1]}}}, True),
    ("order negative", {"scaling": {"forecaster": {"order": [-1, 0, 0]}}}, False),
    ("order negative q", {"scaling": {"forecaster": {"order": [0, 1, -1]}}}, False),
    ("order (8, 2, 8)", {"scaling": {"forecaster": {"order": [8, 2, 8]}}}, True),
    ("order p 9", {"scaling": {"forecaster": {"order": [9, 1, 1]}}}, False),
    ("order p 2**70", {"scaling": {"forecaster": {"order": [2**70, 1, 1]}}}, False),
    ("maxGPUs as a string", {"scaling": {"maxGPUs": "8"}}, False),
    ("maxGPUs as a boolean", {"scaling": {"maxGPUs": True}}, False),
    ("tpDecode as a string", {"scaling": {"tpDecode": "2"}}, False),
    ("replicas as a string", {"scaling": {"replicaOwner": "External", "replicas": "4"}}, False),
    ("rescheduling yes", {"router": {"rescheduling": "yes"}}, False),
    ("rescheduling 1", {"router": {"rescheduling": 1}}, False),
    ("rescheduling true", {"router": {"rescheduling": True}}, True),
    ("ttftMs as a string", {"slo": {"ttftMs": "100"}}, False),
    ("ttftMs an integer", {"slo": {"ttftMs": 100}}, True),
    ("intervalSeconds an integer", {"scaling": {"intervalSeconds": 30}}, True),
    ("memoryGiB as a string", {"gpu": {"memoryGiB": "80"}}, False),
    ("maxNumSeqs 1", {"engine": {"maxNumSeqs": 1, "maxNumBatchedTokens": 1}}, True),
    ("maxNumSeqs 0", {"engine": {"maxNumSeqs": 0}}, False),
    ("maxNumSeqs above its bound", {"engine": {"maxNumSeqs": 65_537, "maxNumBatchedTokens": 100_000}}, False),
    ("maxNumSeqs as a string", {"engine": {"maxNumSeqs": "64"}}, False),
    ("maxNumBatchedTokens 0", {"engine": {"maxNumBatchedTokens": 0}}, False),
    ("maxNumBatchedTokens above its bound", {"engine": {"maxNumBatchedTokens": 4_194_305}}, False),
    ("maxNumBatchedTokens as a float", {"engine": {"maxNumBatchedTokens": 4096.5}}, False),
    ("tolerationSeconds as a string",
     {"placement": {"tolerations": [{"key": "a", "effect": "NoExecute", "tolerationSeconds": "30"}]}}, False),
    # found in review: minGPUs 1e9 hung the planner's top-up; initialPrefill 100000 made 100000 replicas
    ("maxGPUs at its bound", {"scaling": {"maxGPUs": 65_536}}, True),
    ("maxGPUs above its bound", {"scaling": {"maxGPUs": 65_537}}, False),
    ("minGPUs above its bound", {"scaling": {"minGPUs": 1_000_000_000, "maxGPUs": 1_000_000_000}}, False),
    ("initialPrefill at its bound", {"scaling": {"initialPrefill": 4096}}, True),
    ("initialPrefill above its bound", {"scaling": {"initialPrefill": 100_000}}, False),
    ("initialDecode above its bound", {"scaling": {"initialDecode": 4097}}, False),
    ("initialUnified above its bound", {"scaling": {"initialUnified": 4097}}, False),
]


@pytest.mark.parametrize(("case", "overrides", "ok"), _VALUE_CASES, ids=[c for c, _, _ in _VALUE_CASES])
def test_the_crd_schema_and_the_model_refuse_the_same_values(case: str, overrides: dict[str, Any], ok: bool) -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (pip install jsonschema)")
    spec = {"model": {"name": "m"}, **overrides}
    model_ok = _model_accepts(spec)
    schema = spec_schema()
    errors = list(jsonschema.Draft4Validator(_openapi_to_jsonschema(schema)).iter_errors(_apply_defaults(schema, spec)))
    assert (model_ok, not errors) == (ok, ok), f"{case}: model {model_ok}, CRD {errors or 'accepts'}"


def test_documents_take_the_camelcase_names_only_and_python_keeps_the_field_names(tmp_path: Path) -> None:
    """The API server prunes a snake_case key (or refuses it with strict field validation): a document that
    uses one is refused with the key named, not read as if the cluster would keep it."""
    from fulcrum.api import ScalingSpec, load_llmserve

    with pytest.raises(SpecError, match=r"spec\.scaling\.min_gpus: unknown field 'min_gpus'.*'minGPUs'"):
        parse_llmserve({"spec": {"model": {"name": "m"}, "scaling": {"min_gpus": 3}}})
    with pytest.raises(SpecError, match=r"spec\.model\.served_name: unknown field 'served_name'.*'servedName'"):
        parse_llmserve({"spec": {"model": {"name": "m", "served_name": "x"}}})
    with pytest.raises(SpecError, match=r"spec\.scaling\.bogus: unknown field 'bogus'"):
        parse_llmserve({"spec": {"model": {"name": "m"}, "scaling": {"bogus": 1}}})
    doc = tmp_path / "llmserve.yaml"
    doc.write_text("spec:\n  model: {name: m}\n  scaling:\n    interval_seconds: 30\n", encoding="utf-8")
    with pytest.raises(SpecError, match=r"spec\.scaling\.interval_seconds: unknown field.*'intervalSeconds'"):
        load_llmserve(doc)
    assert parse_llmserve({"spec": {"model": {"name": "m"}, "scaling": {"minGPUs": 3}}}).spec.scaling.min_gpus == 3
    assert ScalingSpec(min_gpus=3, max_gpus=8).min_gpus == 3  # Python constructs by field name
    assert LLMServeSpec.model_validate({"model": {"name": "m"}, "scaling": {"min_gpus": 2}}).scaling.min_gpus == 2


# --- node labels: the rules Kubernetes applies to a pod's nodeSelector ---------------------------------------
#
# Kubernetes' label rules (k8s.io/apimachinery/pkg/util/validation: IsQualifiedName, IsValidLabelValue): a key is
# an optional prefix (a DNS-1123 subdomain of at most 253 characters) and `/`, then a name of 1 to 63 characters
# matching ([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]; a value is empty or such a name. placement.gpuTypeLabel is
# a key, and makes gpu.type the value of that node label.

_SUBDOMAIN_253 = ".".join(["a" * 63] * 4)[:253]  # a DNS-1123 subdomain of exactly 253 characters
assert len(_SUBDOMAIN_253) == 253 and not _SUBDOMAIN_253.endswith(".")


def _selector(node_selector: dict[str, str]) -> dict[str, Any]:
    return {"placement": {"nodeSelector": node_selector}}


def _gpu_label(gpu_type: str, label: str = "nvidia.com/gpu.product", **extra: Any) -> dict[str, Any]:
    return {"gpu": {"type": gpu_type}, "placement": {"gpuTypeLabel": label}, **extra}


_LABEL_CASES: list[tuple[str, dict[str, Any], bool]] = [
    ("selector: prefixed key", _selector({"cloud.example.com/pool": "gpu"}), True),
    ("selector: plain key, empty value", _selector({"pool": ""}), True),
    ("selector: names with _ . - and capitals", _selector({"My_Pool.v-2": "A100_80GB.v-2"}), True),
    ("selector: one-character key and value", _selector({"a": "b"}), True),
    ("selector: 63-character name", _selector({"a" * 63: "x"}), True),
    ("selector: 64-character name", _selector({"a" * 64: "x"}), False),
    ("selector: 253-character prefix", _selector({_SUBDOMAIN_253 + "/n": "x"}), True),
    ("selector: 254-character prefix", _selector({"b" + _SUBDOMAIN_253 + "/n": "x"}), False),
    ("selector: key with a space and !", _selector({"bad key!": "x"}), False),
    ("selector: empty key", _selector({"": "x"}), False),
    ("selector: empty name after the prefix", _selector({"example.com/": "x"}), False),
    ("selector: empty prefix", _selector({"/pool": "x"}), False),
    ("selector: two slashes", _selector({"a/b/c": "x"}), False),
    ("selector: capital in the prefix", _selector({"Example.com/pool": "x"}), False),
    ("selector: prefix starting with -", _selector({"-example.com/pool": "x"}), False),
    ("selector: prefix with an empty label", _selector({"example..com/pool": "x"}), False),
    ("selector: underscore in the prefix", _selector({"my_example.com/pool": "x"}), False),
    ("selector: name starting with .", _selector({".pool": "x"}), False),
    ("selector: name ending with -", _selector({"pool-": "x"}), False),
    ("selector: a good key, then a bad one", _selector({"pool": "x", "bad/key/": "y"}), False),
    ("selector: value with a space", _selector({"pool": "H100 SXM"}), False),
    ("selector: value ending with -", _selector({"pool": "gpu-"}), False),
    ("selector: value with a slash", _selector({"pool": "a/b"}), False),
    ("selector: 63-character value", _selector({"pool": "v" * 63}), True),
    ("selector: 64-character value", _selector({"pool": "v" * 64}), False),
    ("selector: 64 entries", _selector({f"k{i}": "v" for i in range(64)}), True),
    ("selector: 65 entries", _selector({f"k{i}": "v" for i in range(65)}), False),
    ("gpu label: set, a good gpu.type", _gpu_label("H100"), True),
    ("gpu label: set, a product name", _gpu_label("NVIDIA-H100-80GB-HBM3"), True),
    ("gpu label: a plain key", _gpu_label("H100", "gpu"), True),
    ("gpu label: set, gpu.type with a space", _gpu_label("H100 SXM"), False),
    ("gpu label: set, gpu.type ending with -", _gpu_label("H100-"), False),
    ("gpu label: set, 63-character gpu.type", _gpu_label("g" * 63), True),
    ("gpu label: set, 64-character gpu.type", _gpu_label("g" * 64), False),
    # a sim worker gets no GPU-type selector (operator/controller/resources.py), so gpu.type is no label value there
    ("gpu label: set, sim engine, gpu.type with a space", _gpu_label("H100 SXM", engine={"kind": "sim"}), True),
    ("gpu label: set, sim engine, 64-character gpu.type", _gpu_label("g" * 64, engine={"kind": "sim"}), True),
    ("gpu label: set, vllm engine, gpu.type with a space", _gpu_label("H100 SXM", engine={"kind": "vllm"}), False),
    ("gpu label: bad key, sim engine", _gpu_label("H100", "gpu product", engine={"kind": "sim"}), False),
    ("gpu label: unset, gpu.type with a space", {"gpu": {"type": "H100 SXM"}}, True),
    ("gpu label: empty, gpu.type with a space", _gpu_label("H100 SXM", ""), True),
    ("gpu label: unset, 64-character gpu.type", {"gpu": {"type": "g" * 64}}, True),
    ("gpu.type of 254 characters", {"gpu": {"type": "g" * 254}}, False),
    ("gpu label: with a space", _gpu_label("H100", "gpu product"), False),
    ("gpu label: 254-character prefix", _gpu_label("H100", "b" + _SUBDOMAIN_253 + "/n"), False),
    ("gpu label: 253-character prefix", _gpu_label("H100", _SUBDOMAIN_253 + "/n"), True),
    ("gpu label: empty name", _gpu_label("H100", "nvidia.com/"), False),
]


def _crd_accepts(spec: dict[str, Any]) -> bool:
    """Whether the API server would take ``spec``: the OpenAPI schema (types, bounds, patterns) after defaulting,
    then every CEL rule."""
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (pip install jsonschema)")
    celpy = pytest.importorskip("celpy", reason="cel-python is not installed (pip install cel-python)")
    schema = spec_schema()
    defaulted = _apply_defaults(schema, spec)
    if list(jsonschema.Draft4Validator(_openapi_to_jsonschema(schema)).iter_errors(defaulted)):
        return False
    env = celpy.Environment()
    for rule, self_value in _cel_rules(schema, _drop_nulls(defaulted)):
        result = env.program(env.compile(rule)).evaluate({"self": celpy.json_to_cel(self_value)})
        assert isinstance(result, celpy.celtypes.BoolType), f"{rule} -> {result!r}"
        if not result:
            return False
    return True


def test_a_bad_node_selector_is_refused_naming_the_field_and_the_rule() -> None:
    def check(node_selector: dict[str, str], message: str) -> None:
        with pytest.raises(SpecError, match=message):
            parse_llmserve({"spec": {"model": {"name": "m"}, **_selector(node_selector)}})

    check({"bad key!": "x"}, r"spec\.placement\.nodeSelector: .*'bad key!'.*name part must consist of alphanumeric "
                              r"characters, '-', '_' or '\.', and must start and end with an alphanumeric character")
    check({"Example.com/pool": "x"}, r"spec\.placement\.nodeSelector: .*'Example\.com/pool'.*prefix part .*DNS-1123 "
                                      r"subdomain")
    check({"a" * 64: "x"}, r"spec\.placement\.nodeSelector: .*name part must be no more than 63 characters")
    check({"b" + _SUBDOMAIN_253 + "/n": "x"}, r"spec\.placement\.nodeSelector: .*prefix part must be no more than "
                                              r"253 characters")
    check({"pool": "H100 SXM"}, r"spec\.placement\.nodeSelector\.pool: 'H100 SXM' is not a valid label value: .*"
                                r"empty string or consist of alphanumeric characters")
    check({"pool": "v" * 64}, r"spec\.placement\.nodeSelector\.pool: .*must be no more than 63 characters")
    check({f"k{i}": "v" for i in range(65)}, r"spec\.placement\.nodeSelector: .*at most 64")


def test_gpu_type_must_be_a_label_value_when_gpu_type_label_makes_it_one() -> None:
    with pytest.raises(SpecError, match=r"spec: .*gpu\.type 'H100 SXM' is not a valid label value, which "
                                        r"placement\.gpuTypeLabel \(nvidia\.com/gpu\.product\) requires: "):
        parse_llmserve({"spec": {"model": {"name": "m"}, **_gpu_label("H100 SXM")}})
    with pytest.raises(SpecError, match=r"spec\.placement\.gpuTypeLabel: 'gpu product' is not a valid label key: "
                                        r"name part must consist of"):
        parse_llmserve({"spec": {"model": {"name": "m"}, **_gpu_label("H100", "gpu product")}})
    rules = spec_schema()["x-kubernetes-validations"]
    (rule,) = [r for r in rules if r.get("fieldPath") == ".gpu.type"]
    assert "placement.gpuTypeLabel" in rule["message"] and "label value" in rule["message"]
    # engine kind sim puts no GPU-type selector on its pods: its gpu.type is free text
    sim = parse_llmserve({"spec": {"model": {"name": "m"}, **_gpu_label("H100 SXM", engine={"kind": "sim"})}})
    assert sim.spec.gpu.type == "H100 SXM"
    assert "self.engine.kind == 'sim'" in rule["rule"]


def test_the_crd_bounds_what_its_label_rules_read() -> None:
    """The API server refuses a CRD whose CEL rules could cost too much (the cost of a rule is estimated from the
    largest map and string it may see): the node selector has at most 64 entries, gpu.type at most 253
    characters, and values and gpuTypeLabel are checked by plain patterns, which cost nothing."""
    from fulcrum.api.llmserve import LABEL_KEY_PATTERN, LABEL_VALUE_PATTERN

    props = spec_schema()["properties"]
    placement = props["placement"]["properties"]
    selector = placement["nodeSelector"]
    assert selector["maxProperties"] == 64
    assert selector["additionalProperties"] == {"type": "string", "maxLength": 63, "pattern": LABEL_VALUE_PATTERN}
    assert all(LABEL_KEY_PATTERN in r["rule"] for r in selector["x-kubernetes-validations"])
    label = placement["gpuTypeLabel"]
    assert label["maxLength"] == 253 + 1 + 63 and label["pattern"] == f"^({LABEL_KEY_PATTERN[1:-1]})?$"
    assert props["gpu"]["properties"]["type"]["maxLength"] == 253


# --- tolerations: the label rules of Kubernetes' ValidateTolerations --------------------------------------
#
# k8s.io/kubernetes/pkg/apis/core/validation ValidateTolerations: a non-empty key must be a label key
# (ValidateLabelName, i.e. IsQualifiedName); with operator Equal (or none) the value must be a label value
# (IsValidLabelValue); with Exists the value must be empty. A label value is empty or a name, so requiring it
# whatever the operator takes exactly what Kubernetes takes.


def _toleration(**toleration: Any) -> dict[str, Any]:
    return {"placement": {"tolerations": [toleration]}}


_TOLERATION_CASES: list[tuple[str, dict[str, Any], bool]] = [
    ("key with a prefix", _toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule"), True),
    ("key with a prefix, Equal and a value", _toleration(key="nvidia.com/gpu", operator="Equal", value="present"), True),
    ("empty key, Exists", _toleration(key="", operator="Exists"), True),
    ("no key, Exists", _toleration(operator="Exists"), True),
    ("null key, Exists", _toleration(key=None, operator="Exists"), True),
    ("names with _ . - and capitals", _toleration(key="My_Taint.v-2", value="A100_80GB.v-2"), True),
    ("key with a space and !", _toleration(key="bad key!", operator="Exists"), False),
    ("capital in the key's prefix", _toleration(key="Example.com/x", operator="Exists"), False),
    ("key with two slashes", _toleration(key="a/b/c", operator="Exists"), False),
    ("key with an empty prefix", _toleration(key="/x", operator="Exists"), False),
    ("key with an empty name", _toleration(key="example.com/", operator="Exists"), False),
    ("key name ending with -", _toleration(key="taint-", operator="Exists"), False),
    ("key with a 63-character name", _toleration(key="a" * 63, operator="Exists"), True),
    ("key with a 64-character name", _toleration(key="a" * 64, operator="Exists"), False),
    ("key with a 253-character prefix", _toleration(key=_SUBDOMAIN_253 + "/n", operator="Exists"), True),
    ("key with a 254-character prefix", _toleration(key="b" + _SUBDOMAIN_253 + "/n", operator="Exists"), False),
    ("Equal, value with a space", _toleration(key="a", operator="Equal", value="a b"), False),
    ("no operator, value with a space", _toleration(key="a", value="a b"), False),
    ("Equal, value ending with -", _toleration(key="a", operator="Equal", value="v-"), False),
    ("Equal, value with a slash", _toleration(key="a", operator="Equal", value="a/b"), False),
    ("Equal, empty value", _toleration(key="a", operator="Equal", value=""), True),
    ("Equal, 63-character value", _toleration(key="a", operator="Equal", value="v" * 63), True),
    ("Equal, 64-character value", _toleration(key="a", operator="Equal", value="v" * 64), False),
    ("Exists, value with a space", _toleration(key="a", operator="Exists", value="a b"), False),
    ("a good toleration, then a bad key",
     {"placement": {"tolerations": [{"operator": "Exists"}, {"key": "bad key!", "operator": "Exists"}]}}, False),
]


@pytest.mark.parametrize(("case", "overrides", "ok"), _LABEL_CASES + _TOLERATION_CASES,
                         ids=[c for c, _, _ in _LABEL_CASES + _TOLERATION_CASES])
def test_node_labels_and_tolerations_are_checked_as_kubernetes_checks_them(
        case: str, overrides: dict[str, Any], ok: bool) -> None:
    """The model and the CRD take exactly the node-selector keys and values, the gpuTypeLabel and the toleration keys
    and values Kubernetes takes on a pod template, so that a bad one is refused at ``kubectl apply`` instead of by
    the operator's apply of the worker Deployments."""
    spec = {"model": {"name": "m"}, **overrides}
    model_ok = _model_accepts(spec)
    assert (model_ok, _crd_accepts(spec)) == (ok, ok), f"{case}: model {model_ok}, CRD {_crd_accepts(spec)}"


def test_a_bad_toleration_key_or_value_is_refused_naming_the_field_and_the_rule() -> None:
    def check(toleration: dict[str, Any], message: str) -> None:
        with pytest.raises(SpecError, match=message):
            parse_llmserve({"spec": {"model": {"name": "m"}, **_toleration(**toleration)}})

    check({"key": "bad key!", "operator": "Exists"},
          r"spec\.placement\.tolerations\.0\.key: 'bad key!' is not a valid label key: name part must consist of "
          r"alphanumeric characters, '-', '_' or '\.', and must start and end with an alphanumeric character")
    check({"key": "Example.com/x", "operator": "Exists"},
          r"spec\.placement\.tolerations\.0\.key: 'Example\.com/x' is not a valid label key: prefix part .*DNS-1123 "
          r"subdomain")
    check({"key": "b" + _SUBDOMAIN_253 + "/n", "operator": "Exists"},
          r"spec\.placement\.tolerations\.0\.key: .*prefix part must be no more than 253 characters")
    check({"key": "a", "operator": "Equal", "value": "a b"},
          r"spec\.placement\.tolerations\.0\.value: 'a b' is not a valid label value: it must be an empty string or "
          r"consist of alphanumeric characters")
    check({"key": "a", "value": "v" * 64},
          r"spec\.placement\.tolerations\.0\.value: .*must be no more than 63 characters")


def test_the_crd_checks_toleration_keys_and_values_by_pattern_and_bounds_its_one_rule_on_the_key() -> None:
    """Key and value are plain ``pattern``/``maxLength`` (no CEL cost); only the 253-character bound of the key's
    prefix, which RE2 cannot express with the rest of the key, is a CEL rule, on a key of at most 317 characters in
    a list of at most 64 tolerations."""
    from fulcrum.api.llmserve import LABEL_KEY_PATTERN, LABEL_PREFIX_LENGTH_PATTERN, LABEL_VALUE_PATTERN

    tolerations = spec_schema()["properties"]["placement"]["properties"]["tolerations"]
    assert tolerations["maxItems"] == 64
    item = tolerations["items"]
    key, value = item["properties"]["key"], item["properties"]["value"]
    assert (key["maxLength"], key["pattern"], key["nullable"]) == (253 + 1 + 63, f"^({LABEL_KEY_PATTERN[1:-1]})?$", True)
    assert (value["maxLength"], value["pattern"], value["nullable"]) == (63, LABEL_VALUE_PATTERN, True)
    (rule,) = [r for r in item["x-kubernetes-validations"] if r["fieldPath"] == ".key"]
    assert LABEL_PREFIX_LENGTH_PATTERN in rule["rule"] and "253" in rule["message"] and "key" in rule["message"]
