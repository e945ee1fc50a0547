"""The ``LLMServe`` CustomResourceDefinition, generated from the pydantic model.

The CRD is never written by hand: :func:`build_crd` converts ``LLMServe``'s pydantic JSON schema (by
alias, camelCase) into a Kubernetes ``apiextensions.k8s.io/v1`` CustomResourceDefinition, and
``crds/llmserve.yaml`` is its output (``fulcrum crd --output crds/llmserve.yaml``); a unit test keeps the
file equal to the model.

Conversion to a *structural* schema (what Kubernetes requires of a CRD):

- every ``$ref`` is inlined from ``$defs``; the field's own ``description``/``default`` win over the
  referenced definition's;
- ``title`` and ``additionalProperties: false`` are dropped (the API server prunes unknown fields;
  ``kubectl``'s field validation reports them); a map (``dict[str, X]``) keeps ``additionalProperties: X``
  and has no ``properties``; an open object (``dict[str, Any]``) becomes
  ``x-kubernetes-preserve-unknown-fields: true`` (e.g. ``placement.affinity.nodeAffinity``, passed through to
  the pods and validated by the API server when the Deployment is applied);
- a Kubernetes quantity (``engine.resources``) is ``x-kubernetes-int-or-string: true`` without a type, so
  that ``cpu: 4`` and ``cpu: 500m`` are both accepted;
- ``anyOf: [X, {type: null}]`` becomes ``X`` with ``nullable: true`` (but for ``scaling.replicas``, the scale
  subresource's path, which cannot hold a null: there the API server prunes a null, which means unset too); any
  other union is an error;
- ``prefixItems`` (tuples) becomes ``type: array`` with one ``items`` schema (all positions must share
  it) and ``minItems``/``maxItems``;
- ``exclusiveMinimum: x`` (JSON Schema 2020-12) becomes ``minimum: x, exclusiveMinimum: true``
  (OpenAPI v3.0, which Kubernetes speaks), likewise for the maximum;
- defaults: pydantic leaves out the defaults of ``default_factory`` fields; they are added here (the
  factory's value, dumped by alias without ``null`` members), so that the API server fills nested
  objects (``spec.gpu``, ``spec.scaling``…) exactly as pydantic does and the CEL rules below always see
  their fields. ``default: null`` is dropped (absent and null mean the same to the model).

Cross-field rules of the model become CEL ``x-kubernetes-validations``: ``minGPUs <= maxGPUs``,
``replicaOwner: External`` requires ``replicas``, and ``replicas <= maxGPUs`` on ``spec.scaling``; exactly one
non-empty source on ``spec.profile``; on ``spec``: each fixed TP at most ``gpu.gpusPerNode`` and
``scaling.maxGPUs``, ``scaling.replicas × gpu.gpusPerNode >= scaling.minGPUs`` (an instance uses 1 to
gpusPerNode GPUs); on ``spec.engine``:
``maxNumBatchedTokens >= maxNumSeqs`` (vLLM's rule, the defaults 8192 and 256 standing in for unset fields; the
model alone checks ``maxNumBatchedTokens >= maxModelLen`` with chunked prefill turned off in ``extraArgs``); on each
``spec.placement.tolerations[]`` item (at most 64) the rules Kubernetes applies to a pod's tolerations (operator
``Exists`` when ``key`` is empty, no ``value`` with ``Exists``, ``tolerationSeconds`` only with effect
``NoExecute``, the prefix of ``key`` at most 253 characters; the rest of ``key`` a label key and ``value`` a label
value are plain ``pattern``/``maxLength``); and Kubernetes' label rules where the worker pods' ``nodeSelector``
comes from: every ``spec.placement.nodeSelector`` key a label key (at most 64 keys, which bounds the rule's cost),
``spec.placement.gpuTypeLabel``'s prefix at most 253 characters, and ``spec.gpu.type`` a label value when
``gpuTypeLabel`` is set and ``spec.engine.kind`` is not ``sim`` (a sim pod gets no GPU-type selector) (the values and the rest of ``gpuTypeLabel`` are plain ``pattern``/``maxLength``) — so that
such a spec is refused at ``kubectl apply`` instead of when the operator applies its Deployments. The rules rely on the object defaults above (defaulting runs before
validation, so ``spec.scaling``, ``spec.gpu``, ``spec.placement``, ``spec.connectors`` and their members are always
present) and on Kubernetes treating null-valued fields as absent in CEL. The rules use
``fieldPath``, so the CRD needs Kubernetes 1.28 or newer (CEL validation itself is on by default since 1.25).

``status`` is an open object (``x-kubernetes-preserve-unknown-fields``) written by the operator.

Subresources: ``status`` and ``scale`` (``specReplicasPath: .spec.scaling.replicas``, ``statusReplicasPath:
.status.replicas``, ``labelSelectorPath: .status.selector``), so ``kubectl scale``, an HPA or KEDA can set the
total instance count. Who owns that count is a rule of the spec, not of the API: with
``spec.scaling.replicaOwner: Operator`` (the default) the planner sizes every pool and ignores
``spec.scaling.replicas`` (a scale write changes nothing, so an autoscaler cannot fight the planner); with
``External`` the operator obeys ``spec.scaling.replicas`` as the total and only splits it between the pools
(prefill, decode, unified) by the planned P/D ratio. ``status.replicas`` is the number of ready instances in
all pools and ``status.selector`` the label selector of their pods (what an HPA reads for pod metrics).
"""

from __future__ import annotations

import copy
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, NoDefault
from pydantic_core import core_schema

from fulcrum.api.llmserve import (API_VERSION, DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS,
                                  DISAGGREGATED_ONLY_PLANNERS, KIND,
                                  LABEL_KEY_PATTERN, LABEL_PREFIX_LENGTH_PATTERN, LABEL_VALUE_MAX_LENGTH,
                                  LABEL_VALUE_PATTERN, LLMServe)

__all__ = [
    "GROUP",
    "VERSION",
    "PLURAL",
    "SINGULAR",
    "SHORT_NAMES",
    "CRD_NAME",
    "PRINTER_COLUMNS",
    "SCALE_SUBRESOURCE",
    "build_crd",
    "spec_schema",
    "render_crd_yaml",
]

GROUP, VERSION = API_VERSION.split("/")
PLURAL = "llmserves"
SINGULAR = "llmserve"
SHORT_NAMES = ("llms",)
CRD_NAME = f"{PLURAL}.{GROUP}"

PRINTER_COLUMNS: tuple[dict[str, Any], ...] = (
    {"name": "Mode", "type": "string", "jsonPath": ".spec.mode", "description": "Serving mode."},
    {
        "name": "Prefill",
        "type": "integer",
        "jsonPath": ".status.pools.prefill.ready",
        "description": "Ready prefill instances.",
    },
    {
        "name": "Decode",
        "type": "integer",
        "jsonPath": ".status.pools.decode.ready",
        "description": "Ready decode instances.",
    },
    {
        "name": "Ratio",
        "type": "number",
        "jsonPath": ".status.plan.ratio",
        "description": "Planned prefill instances per decode instance (DOPD eq. 15).",
    },
    {
        "name": "Forecast RPS",
        "type": "number",
        "jsonPath": ".status.forecast.rate",
        "description": "Forecast request rate for the next interval, requests/s.",
    },
    {
        "name": "SLO Attainment",
        "type": "number",
        "jsonPath": ".status.sloAttainment",
        "description": "Fraction of recent requests meeting both TTFT and TPOT targets.",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {
        "name": "Unified",
        "type": "integer",
        "jsonPath": ".status.pools.unified.ready",
        "description": "Ready unified (kv_both) instances.",
        "priority": 1,
    },
    {
        "name": "Owner",
        "type": "string",
        "jsonPath": ".spec.scaling.replicaOwner",
        "description": "Who sets the total instance count: Operator or External.",
        "priority": 1,
    },
)
"""``additionalPrinterColumns`` of ``kubectl get llmserves`` (priority 1 = only with ``-o wide``); the operator
writes the status fields."""

SCALE_SUBRESOURCE: dict[str, str] = {
    "specReplicasPath": ".spec.scaling.replicas",
    "statusReplicasPath": ".status.replicas",
    "labelSelectorPath": ".status.selector",
}
"""The ``scale`` subresource: the total instance count (obeyed with ``replicaOwner: External`` only)."""

# Keys a structural schema node may carry after conversion (anything else from pydantic is an error,
# so that a model change producing an unsupported construct fails the tests instead of the cluster).
_KEPT_KEYS = frozenset(
    {
        "type", "description", "default", "enum", "format", "pattern", "minLength", "maxLength",
        "minimum", "maximum", "minItems", "maxItems", "maxProperties", "properties", "required", "items",
    }
)
_DROPPED_KEYS = frozenset({"title", "additionalProperties"})


def _tp_rule(field: str) -> dict[str, str]:
    tp = f"self.scaling.{field}"
    return {
        "rule": f"!has({tp}) || (int({tp}) <= int(self.gpu.gpusPerNode) && int({tp}) <= int(self.scaling.maxGPUs))",
        "message": f"scaling.{field} must be <= gpu.gpusPerNode and <= scaling.maxGPUs",
        "fieldPath": f".scaling.{field}",
    }


def _cel_literal(text: str) -> str:
    """``text`` as a CEL string literal; the label patterns hold no quote and no backslash, which keeps the CRD
    readable (no escaping) and this function trivial."""
    if "'" in text or "\\" in text:
        raise ValueError(f"not a plain CEL string literal: {text!r}")
    return f"'{text}'"


def _given(field: str) -> str:
    """CEL: 1 if ``field`` is a non-empty string, else 0 ("" counts as unset, as in pydantic; Kubernetes
    treats null-valued fields as absent in CEL, so ``has`` is false for them)."""
    return f"(has(self.{field}) && size(self.{field}) > 0 ? 1 : 0)"


# CEL rules by the property path of the spec node they are attached to (() = spec itself; "[]" = the items of
# the list before it, "{}" = the values of the map before it). They mirror the model validators
# EngineSpec._batch_limits_fit (its first rule), ScalingSpec._min_le_max, ProfileRef._exactly_one,
# LLMServeSpec._tp_fits, LLMServeSpec._replicas_and_connectors (router.policy against mode too) and
# Toleration._as_kubernetes_validates, and the label rules of PlacementSpec's nodeSelector keys, gpuTypeLabel and toleration keys (the prefix length; the rest is a pattern) and
# LLMServeSpec._gpu_type_is_a_label_value (node-selector and toleration values are plain patterns, which cost
# nothing). Rules on list items are costed by the API server per possible item (a list without maxItems: about a
# million): keep them to a few has()/size()/== terms. A rule's cost is estimated from the largest map, list and
# string it may see: the node selector has maxProperties, the tolerations maxItems, gpu.type and a toleration's key
# a maxLength, without which kube-apiserver refuses the CRD ("estimated rule cost exceeds budget"). Every integer field
# a rule reads is wrapped in int(): a JSON client may send an integral float (``minGPUs: 2.0``), which the schema's
# ``type: integer`` accepts but CEL then sees as a double ("expected int, got float64"); int() of an int is the int.
_DISAGGREGATED_ONLY = sorted(DISAGGREGATED_ONLY_PLANNERS, key=lambda p: p.value)
_VALIDATIONS: dict[tuple[str, ...], list[dict[str, str]]] = {
    (): [
        _tp_rule("tpPrefill"),
        _tp_rule("tpDecode"),
        _tp_rule("tpUnified"),
        {
            "rule": "!has(self.scaling.replicas) || "
                    "int(self.scaling.replicas) * int(self.gpu.gpusPerNode) >= int(self.scaling.minGPUs)",
            "message": "scaling.replicas × gpu.gpusPerNode must be >= scaling.minGPUs",
            "fieldPath": ".scaling.replicas",
        },
        {
            "rule": "self.mode != 'Unified' || !has(self.scaling.planner) || "
                    f"!(self.scaling.planner in [{', '.join(repr(p.value) for p in _DISAGGREGATED_ONLY)}])",
            "message": f"scaling.planner {', '.join(p.value for p in _DISAGGREGATED_ONLY)} plan prefill and decode "
                       "pools only: they need mode Disaggregated or Auto",
            "fieldPath": ".scaling.planner",
        },
        {
            "rule": "self.mode == 'Unified' || !(self.router.policy in ['round_robin', 'least_loaded'])",
            "message": "router.policy round_robin and least_loaded never use a prefill instance: they need mode Unified",
            "fieldPath": ".router.policy",
        },
        {
            # engine kind sim puts no GPU-type selector on its pods (engine defaults to an object with a kind)
            "rule": f"size(self.placement.gpuTypeLabel) == 0 || self.engine.kind == 'sim' || "
                    f"(size(self.gpu.type) <= {LABEL_VALUE_MAX_LENGTH} && "
                    f"self.gpu.type.matches({_cel_literal(LABEL_VALUE_PATTERN)}))",
            "message": "gpu.type must be a valid label value when placement.gpuTypeLabel is set and engine.kind is vllm "
                       "(it becomes that node label's value): at most 63 alphanumeric characters, '-', '_' or '.', "
                       "starting and ending with an alphanumeric character",
            "fieldPath": ".gpu.type",
        },
    ],
    ("engine",): [
        {
            # vLLM's own check; the one against maxModelLen applies only with chunked prefill off in extraArgs, which
            # the model checks (reading extraArgs item by item would cost a CEL rule too much)
            "rule": f"(has(self.maxNumBatchedTokens) ? int(self.maxNumBatchedTokens) : {DEFAULT_MAX_NUM_BATCHED_TOKENS}) "
                    f">= (has(self.maxNumSeqs) ? int(self.maxNumSeqs) : {DEFAULT_MAX_NUM_SEQS})",
            "message": f"maxNumBatchedTokens (unset: {DEFAULT_MAX_NUM_BATCHED_TOKENS}) must be >= maxNumSeqs (unset: "
                       f"{DEFAULT_MAX_NUM_SEQS}), as vLLM requires",
            "fieldPath": ".maxNumBatchedTokens",
        },
    ],
    ("router",): [
        {
            "rule": "!self.prefixPull || self.policy == 'load_aware'",
            "message": "router.prefixPull requires router.policy load_aware",
            "fieldPath": ".prefixPull",
        },
    ],
    ("scaling",): [
        {"rule": "int(self.minGPUs) <= int(self.maxGPUs)", "message": "minGPUs must be <= maxGPUs", "fieldPath": ".minGPUs"},
        {
            "rule": "self.replicaOwner != 'External' || has(self.replicas)",
            "message": "replicaOwner External requires replicas",
            "fieldPath": ".replicas",
        },
        {
            "rule": "!has(self.replicas) || int(self.replicas) <= int(self.maxGPUs)",
            "message": "replicas must be <= maxGPUs (an instance uses at least one GPU)",
            "fieldPath": ".replicas",
        },
    ],
    ("placement", "nodeSelector"): [
        {
            "rule": f"self.all(k, k.matches({_cel_literal(LABEL_KEY_PATTERN)}) && "
                    f"k.matches({_cel_literal(LABEL_PREFIX_LENGTH_PATTERN)}))",
            "message": "every key must be a valid label key: an optional prefix (a lowercase DNS-1123 subdomain of at "
                       "most 253 characters) and '/', then a name of 1 to 63 alphanumeric characters, '-', '_' or '.', "
                       "starting and ending with an alphanumeric character",
        },
    ],
    ("placement", "gpuTypeLabel"): [
        {
            "rule": f"self.matches({_cel_literal(LABEL_PREFIX_LENGTH_PATTERN)})",
            "message": "the prefix part of the label key (before '/') must be no more than 253 characters",
        },
    ],
    ("placement", "tolerations", "[]"): [
        {
            "rule": "(has(self.key) && size(self.key) > 0) || (has(self.operator) && self.operator == 'Exists')",
            "message": "operator must be Exists when key is empty (a toleration of every taint)",
            "fieldPath": ".operator",
        },
        {
            "rule": "!has(self.value) || size(self.value) == 0 || !has(self.operator) || self.operator != 'Exists'",
            "message": "value must be empty when operator is Exists",
            "fieldPath": ".value",
        },
        {
            "rule": "!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
            "message": "effect must be NoExecute when tolerationSeconds is set",
            "fieldPath": ".effect",
        },
        {
            # the rest of the label rules are key's and value's patterns; RE2 cannot bound the prefix in the pattern
            "rule": f"!has(self.key) || self.key.matches({_cel_literal(LABEL_PREFIX_LENGTH_PATTERN)})",
            "message": "key must be a valid label key: the prefix part of the key (before '/') must be no more than 253 "
                       "characters",
            "fieldPath": ".key",
        },
    ],
    ("profile",): [
        {
            "rule": " + ".join(_given(f) for f in ("name", "path", "configMap")) + " == 1",
            "message": "set exactly one of name, path, configMap",
        }
    ],
}


_NOT_NULLABLE: frozenset[tuple[str, ...]] = frozenset({("scaling", "replicas")})
"""Optional fields emitted without ``nullable: true``, so that the API server prunes a null (= unset) instead of
storing it: the scale subresource reads ``spec.scaling.replicas`` (``specReplicasPath``) as an integer and refuses an
object that holds a null there ("<nil> is of the type <nil>, expected int64")."""


class _FactoryDefaults(GenerateJsonSchema):
    """JSON schema generator that also reports the defaults of ``default_factory`` fields."""

    def get_default_value(self, schema: core_schema.WithDefaultSchema) -> Any:
        factory = schema.get("default_factory")
        if factory is None or schema.get("default_factory_takes_data"):
            return schema.get("default", NoDefault)
        value = factory()  # type: ignore[call-arg]
        if isinstance(value, BaseModel):
            return value.model_dump(mode="json", by_alias=True, exclude_none=True)
        return value


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Inline one level of ``$ref``: the referenced definition, overlaid with the node's own keys."""
    if "$ref" not in node:
        return node
    ref = node["$ref"]
    prefix = "#/$defs/"
    if not ref.startswith(prefix) or ref[len(prefix):] not in defs:
        raise ValueError(f"unresolvable $ref {ref!r}")
    merged = dict(defs[ref[len(prefix):]])
    merged.update({k: v for k, v in node.items() if k != "$ref"})
    return merged


def _unwrap_nullable(node: dict[str, Any], path: str) -> tuple[dict[str, Any], bool]:
    """``anyOf: [X, {type: null}]`` → (X overlaid with the node's other keys, True)."""
    if "anyOf" not in node:
        return node, False
    branches = node["anyOf"]
    non_null = [b for b in branches if b != {"type": "null"}]
    if len(non_null) != 1 or len(branches) != 2:
        raise ValueError(f"{path}: only `X | None` unions can be expressed in a structural schema")
    merged = dict(non_null[0])
    merged.update({k: v for k, v in node.items() if k != "anyOf"})
    return merged, True


def _structural(node: dict[str, Any], defs: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    """Convert one pydantic JSON-schema node (and its children) to a structural OpenAPI v3.0 node."""
    where = "spec" + "".join(p if p in ("[]", "{}") else f".{p}" for p in path)
    node = _resolve(node, defs)
    node, nullable = _unwrap_nullable(node, where)
    node = _resolve(node, defs)  # a nullable $ref: anyOf [{$ref}, null]
    for key in ("allOf", "oneOf", "not", "const"):
        if key in node:
            raise ValueError(f"{where}: `{key}` cannot be expressed in a structural schema")
    out: dict[str, Any] = {}
    if node.get("x-kubernetes-int-or-string") is True:
        out["x-kubernetes-int-or-string"] = True  # no type: int or string (a Kubernetes quantity)
    elif "type" not in node:
        raise ValueError(f"{where}: schema node without a type")
    else:
        out["type"] = node["type"]
    if "description" in node:
        out["description"] = node["description"]
    extra = node.get("additionalProperties", False)
    for key, value in node.items():
        if key in _DROPPED_KEYS or key in (
            "type", "description", "properties", "items", "prefixItems", "x-kubernetes-int-or-string",
        ):
            continue
        if key in ("exclusiveMinimum", "exclusiveMaximum"):
            bound = "minimum" if key == "exclusiveMinimum" else "maximum"
            if bound in node:
                raise ValueError(f"{where}: both {bound} and {key} are set")
            out[bound] = value
            out[key] = True
        elif key == "default":
            if value is not None:
                out["default"] = value
        elif key in _KEPT_KEYS:
            out[key] = value
        else:
            raise ValueError(f"{where}: unsupported JSON-schema keyword {key!r}")
    if nullable and path not in _NOT_NULLABLE:
        out["nullable"] = True
    kind = node.get("type")
    if kind == "object" and isinstance(extra, dict):  # a map: dict[str, X]
        if node.get("properties"):
            raise ValueError(f"{where}: an object cannot have both properties and additionalProperties")
        out["additionalProperties"] = _structural(extra, defs, (*path, "{}"))  # "{}": the map's values
    elif kind == "object" and extra is True:  # an open object: dict[str, Any]
        if node.get("properties"):
            raise ValueError(f"{where}: an open object cannot have properties")
        out["x-kubernetes-preserve-unknown-fields"] = True
    elif kind == "object":
        out["properties"] = {
            name: _structural(child, defs, (*path, name)) for name, child in node.get("properties", {}).items()
        }
    if kind == "array":
        out["items"] = _array_items(node, defs, path, where)
    rules = _VALIDATIONS.get(path)
    if rules:
        out["x-kubernetes-validations"] = copy.deepcopy(rules)
    return out


def _array_items(node: dict[str, Any], defs: dict[str, Any], path: tuple[str, ...], where: str) -> dict[str, Any]:
    if "prefixItems" in node:
        items = [_structural(i, defs, (*path, "[]")) for i in node["prefixItems"]]
        if any(i != items[0] for i in items):
            raise ValueError(f"{where}: a tuple with different item types cannot be expressed structurally")
        return items[0]
    if "items" not in node:
        raise ValueError(f"{where}: array without items")
    return _structural(node["items"], defs, (*path, "[]"))


def spec_schema() -> dict[str, Any]:
    """The structural OpenAPI v3.0 schema of ``LLMServe.spec`` (camelCase), with CEL rules.

    Raises:
        ValueError: the model uses a construct a structural schema cannot express, or a CEL rule is
            attached to a path the model no longer has (a programming error caught by the tests).
    """
    schema = LLMServe.model_json_schema(by_alias=True, mode="validation", schema_generator=_FactoryDefaults)
    defs = schema.get("$defs", {})
    spec = _structural(schema["properties"]["spec"], defs, ())
    for path in _VALIDATIONS:
        node = spec
        for name in path:
            node = node.get("items", {}) if name == "[]" else node.get("properties", {}).get(name, {})
        if "x-kubernetes-validations" not in node:
            raise ValueError(f"CEL rules target spec.{'.'.join(path)}, which the model does not have")
    return spec


def _metadata_schema() -> dict[str, Any]:
    """``metadata`` may only restrict ``name``/``generateName``; take the name rules from ``ObjectMeta``."""
    meta = LLMServe.model_json_schema(by_alias=True)["$defs"]["ObjectMeta"]["properties"]["name"]
    name = {k: meta[k] for k in ("type", "minLength", "maxLength", "pattern") if k in meta}
    return {"type": "object", "properties": {"name": name}}


def build_crd() -> dict[str, Any]:
    """Build the ``llmserves.fulcrum.dev`` CustomResourceDefinition (``apiextensions.k8s.io/v1``).

    Returns:
        the CRD as a plain mapping, ready for ``yaml.safe_dump`` or ``kubectl apply``: group
        ``fulcrum.dev``, one version ``v1alpha1`` (served, storage), namespaced, kind ``LLMServe``
        (plural ``llmserves``, singular ``llmserve``, short name ``llms``), structural schema of the
        spec with CEL rules, an open status, the status and scale subresources and the printer columns
        :data:`PRINTER_COLUMNS`. Deterministic: the same model gives the same mapping.
    """
    root_doc = (LLMServe.__doc__ or "").strip()
    schema = {
        "type": "object",
        "description": root_doc,
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": f"Always {API_VERSION}."},
            "kind": {"type": "string", "description": f"Always {KIND}."},
            "metadata": _metadata_schema(),
            "spec": spec_schema(),
            "status": {
                "type": "object",
                "description": "Observed state, written by the operator: conditions, forecast, plan, pools, SLO attainment.",
                "x-kubernetes-preserve-unknown-fields": True,
            },
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": {"status": {}, "scale": dict(SCALE_SUBRESOURCE)},
                    "additionalPrinterColumns": [dict(c) for c in PRINTER_COLUMNS],
                }
            ],
        },
    }


_HEADER = (
    "# Generated from the LLMServe model (src/fulcrum/api/llmserve.py) by `fulcrum crd`. Do not edit:\n"
    "# run `fulcrum crd --output crds/llmserve.yaml` after changing the model.\n"
)


def render_crd_yaml(crd: dict[str, Any] | None = None) -> str:
    """Render ``crd`` (default: :func:`build_crd`) as the YAML text of ``crds/llmserve.yaml``."""
    body = yaml.safe_dump(
        build_crd() if crd is None else crd, sort_keys=False, allow_unicode=True, width=100
    )
    return _HEADER + body
