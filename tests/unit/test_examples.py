"""The LLMServe manifests in examples/: valid per the model and the CRD; broken variants name the field."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from fulcrum.api import LLMServe, Mode, RouterPolicy, load_llmserve
from fulcrum.api.crd import build_crd
from fulcrum.errors import SpecError
from fulcrum.ratio.profiles import builtin_profile

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NAMES = [
    "llmserve-disaggregated-70b-h100.yaml", "llmserve-unified-70b-a100.yaml", "llmserve-auto.yaml", "llmserve-sim.yaml",
]


def _load(name: str) -> LLMServe:
    return load_llmserve(EXAMPLES / name)


def test_every_example_manifest_is_listed_here() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted(NAMES)


def test_disaggregated_example_is_dopd_llama70b_fp8_on_h100() -> None:
    spec = _load("llmserve-disaggregated-70b-h100.yaml").spec
    assert spec.mode is Mode.DISAGGREGATED
    assert "70B" in spec.model.name
    assert spec.gpu.type == "H100"
    assert spec.profile.name == "dopd-llama70b-fp8-h100"
    assert (spec.slo.ttft_ms, spec.slo.tpot_ms, spec.slo.percentile) == (2000.0, 80.0, 90.0)
    assert (spec.scaling.tp_prefill, spec.scaling.tp_decode) == (1, 2)
    assert spec.scaling.min_gpus >= 1 + 2  # room for one prefill and one decode instance


def test_unified_example_is_llama2_70b_on_a100_80gb_with_the_split_policy_and_its_measured_profile() -> None:
    spec = _load("llmserve-unified-70b-a100.yaml").spec
    assert spec.mode is Mode.UNIFIED
    assert "70b" in spec.model.name
    assert (spec.gpu.type, spec.gpu.memory_gib, spec.gpu.hbm_bandwidth_gbps) == ("A100", 80.0, 2039.0)
    assert spec.router.policy is RouterPolicy.SPLIT
    assert spec.profile.name == "splitwise-llama2-70b-a100"
    profile = builtin_profile(spec.profile.name)
    assert profile.gpu_type == "A100" and "Splitwise" in profile.source


def test_auto_example_uses_the_splitwise_profile() -> None:
    spec = _load("llmserve-auto.yaml").spec
    assert spec.mode is Mode.AUTO
    assert spec.profile.name == "splitwise-llama2-70b-h100"


@pytest.mark.parametrize("name", NAMES)
def test_named_profiles_of_the_examples_are_built_in(name: str) -> None:
    profile = _load(name).spec.profile
    if profile.name is not None:
        assert builtin_profile(profile.name).name == profile.name


@pytest.mark.parametrize("name", NAMES)
def test_each_example_is_accepted_by_the_crd_schema(name: str) -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    document = yaml.safe_load((EXAMPLES / name).read_text(encoding="utf-8"))
    # OpenAPI v3.0 bounds (boolean exclusiveMinimum) are draft-4 JSON Schema
    jsonschema.Draft4Validator(schema).validate(document)


def _broken(name: str, edit: Any) -> dict[str, Any]:
    document = copy.deepcopy(yaml.safe_load((EXAMPLES / name).read_text(encoding="utf-8")))
    edit(document["spec"])
    assert isinstance(document, dict)
    return document


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda s: s["slo"].__setitem__("ttftMs", -100), "spec.slo.ttftMs"),
        (lambda s: s["scaling"].update(minGPUs=s["scaling"]["maxGPUs"] + 1), "minGPUs"),
        (lambda s: s.__setitem__("replicas", 3), "spec.replicas"),
        (lambda s: s["slo"].__setitem__("ttftMS", 100), "spec.slo.ttftMS"),
        (lambda s: s["profile"].update(name="a", path="b.yaml"), "spec.profile"),
        (lambda s: s["profile"].update(configMap="c"), "spec.profile"),
    ],
    ids=["negative-ttft", "min-above-max", "unknown-field", "misspelt-field", "name-and-path", "extra-configmap"],
)
def test_broken_variants_raise_spec_error_naming_the_field(
    tmp_path: Path, name: str, edit: Any, field: str
) -> None:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(_broken(name, edit)), encoding="utf-8")
    with pytest.raises(SpecError) as info:
        load_llmserve(path)
    assert field in str(info.value)


def test_a_negative_ttft_is_also_rejected_by_the_crd_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    document = _broken(NAMES[0], lambda s: s["slo"].__setitem__("ttftMs", -100))
    with pytest.raises(jsonschema.ValidationError, match="-100"):
        jsonschema.Draft4Validator(schema).validate(document)
