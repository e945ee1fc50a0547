"""The ``LLMServe`` resource: the one schema shared by the CRD, the operator and ``fulcrum replay``.

A platform engineer writes one ``LLMServe`` (model, GPUs, SLOs, limits); the planner reads the same
object whether it runs in the operator or in replay. Field names are camelCase on the wire (Kubernetes
convention) and snake_case in Python. A document (:func:`parse_llmserve`, :func:`load_llmserve`) must use the
camelCase names — the API server prunes (or, with strict field validation, rejects) any other key, so a
snake_case key is reported as unknown; Python code constructing the models may use either. Numbers and
booleans must be YAML/JSON numbers and booleans, as Kubernetes requires (``"8"`` or ``"yes"`` are rejected,
an integer where a float is expected is fine).

Invalid specs raise :class:`fulcrum.errors.SpecError` whose message names every offending field by its
path (e.g. ``spec.scaling.maxGPUs``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
import functools
from pathlib import Path
import re
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from pydantic.alias_generators import to_camel

from fulcrum.errors import SpecError, safe_yaml, yaml_problem

__all__ = [
    "API_VERSION",
    "KIND",
    "Mode",
    "EngineKind",
    "ReplicaOwner",
    "PlannerName",
    "ForecasterMethod",
    "RouterPolicy",
    "Quantity",
    "LABEL_KEY_PATTERN",
    "LABEL_KEY_MAX_LENGTH",
    "LABEL_PREFIX_LENGTH_PATTERN",
    "LABEL_VALUE_PATTERN",
    "LABEL_VALUE_MAX_LENGTH",
    "LabelValue",
    "OptionalLabelKey",
    "ModelSpec",
    "ResourceQuantities",
    "ResourcesSpec",
    "EngineSpec",
    "DEFAULT_MAX_NUM_SEQS",
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "MAX_GPUS_LIMIT",
    "MAX_INSTANCES_LIMIT",
    "SIM_WORKER_MANAGED_FLAGS",
    "VLLM_MANAGED_FLAGS",
    "VLLM_WORKER_FLAGS",
    "VLLM_REFUSED_FLAGS",
    "BatchLimitNames",
    "SPEC_BATCH_LIMIT_NAMES",
    "WORKER_BATCH_LIMIT_NAMES",
    "chunked_prefill",
    "chunked_prefill_off_problem",
    "extra_arg_flag",
    "malformed_extra_arg",
    "GPUSpec",
    "SLOSpec",
    "ForecasterSpec",
    "ScalingSpec",
    "ProfileRef",
    "RouterSpec",
    "Toleration",
    "Affinity",
    "PlacementSpec",
    "ConnectorsSpec",
    "LLMServeSpec",
    "ObjectMeta",
    "LLMServe",
    "load_llmserve",
    "parse_llmserve",
]

API_VERSION = "fulcrum.dev/v1alpha1"
KIND = "LLMServe"


class _Model(BaseModel):
    """Base: camelCase aliases, unknown fields rejected, immutable."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class Mode(str, Enum):
    """How instances serve requests.

    - ``Disaggregated``: separate prefill (P) and decode (D) pools, KV moved over NIXL (DOPD).
    - ``Unified``: one pool of ``kv_both`` instances; the router splits each request into
      micro-requests (Libra §4.1) and colocates ultra-short ones.
    - ``Auto``: the planner picks whichever needs fewer GPUs for the forecast load.
    """

    DISAGGREGATED = "Disaggregated"
    UNIFIED = "Unified"
    AUTO = "Auto"


class EngineKind(str, Enum):
    """What runs in the worker pods.

    - ``vllm``: ``fulcrum worker`` in ``spec.engine.image`` (vLLM with NIXL), ``nvidia.com/gpu`` = TP per pod.
    - ``sim``: ``fulcrum sim-worker`` in the Fulcrum control-plane image, an OpenAI-compatible emulator timed
      by ``spec.profile``; no GPU (GPU-free clusters, the quick start and the e2e test).
    """

    VLLM = "vllm"
    SIM = "sim"


class ReplicaOwner(str, Enum):
    """Who sets the total instance count.

    - ``Operator``: the planner (forecast → P/D plan); ``spec.scaling.replicas`` is ignored.
    - ``External``: an HPA or KEDA writes ``spec.scaling.replicas`` through the scale subresource; the
      operator splits that total between the pools by the planned P/D ratio.
    """

    OPERATOR = "Operator"
    EXTERNAL = "External"


class PlannerName(str, Enum):
    """The planner the operator runs every interval (the same planners ``fulcrum replay --policy`` compares).

    - ``fulcrum``: forecast at the pod start-up horizon, P/D ratio and TP from the profile (DOPD eqs. 11–16),
      queueing headroom for the SLO percentile, hysteresis and a reactive guard (docs/planner.md).
    - ``dopd``: DOPD Algorithm 2 as published (point forecasts, eqs. 11–15).
    - ``static``: the spec's initial instance counts, never changed.
    - ``dynamo-sla``: NVIDIA Dynamo's SLA planner (re-implemented from its published code; demand at arrivals).
    - ``dynamo-load``: NVIDIA Dynamo's load-based planner (re-implemented from its published code).
    """

    FULCRUM = "fulcrum"
    DOPD = "dopd"
    STATIC = "static"
    DYNAMO_SLA = "dynamo-sla"
    DYNAMO_LOAD = "dynamo-load"


DISAGGREGATED_ONLY_PLANNERS = frozenset({PlannerName.DOPD, PlannerName.DYNAMO_SLA, PlannerName.DYNAMO_LOAD})
"""Planners that plan prefill and decode pools only (DOPD Alg. 2, Dynamo's planners): refused with mode Unified,
which deploys no prefill or decode pool (the operator would run no worker)."""


class ForecasterMethod(str, Enum):
    """Forecasting method for each load series (see ``fulcrum.forecast``).

    ``select`` (the default) runs ARIMA, exponential smoothing and the baselines side by side and forecasts each
    series with the one whose recent one-step errors beat the last value's (``fulcrum.forecast.selector``);
    the others are single methods.
    """

    ARIMA = "arima"
    LAST_VALUE = "last_value"
    MOVING_AVERAGE = "moving_average"
    SEASONAL_NAIVE = "seasonal_naive"
    SELECT = "select"


class RouterPolicy(str, Enum):
    """Per-request policy of the router (``router/``; docs/router.md).

    - ``round_robin``, ``least_loaded``: each request whole on one instance, in turn or the least busy; mode
      ``Unified`` only (they never send work to a prefill instance).
    - ``disaggregated``: DOPD's scheduling: prefill on a P instance, decode on a D instance, ultra-short prompts
      local, DOPD Alg. 1 length-aware prefill batches.
    - ``split``: Libra's micro-requests: a split point per request between two instances (§4.1).
    - ``load_aware``: BanaServe Alg. 2: the least loaded instance by compute + memory utilisation (eq. 37),
      disaggregated while a prefill instance is available.
    """

    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    DISAGGREGATED = "disaggregated"
    SPLIT = "split"
    LOAD_AWARE = "load_aware"


#: Policies that colocate every request on one instance (never a prefill-only one): Unified mode only.
_COLOCATING_POLICIES = frozenset({RouterPolicy.ROUND_ROBIN, RouterPolicy.LEAST_LOADED})


# The Kubernetes resource.Quantity syntax (k8s.io/apimachinery/pkg/api/resource), e.g. 500m, 4, 16Gi, 1e3.
_QUANTITY = re.compile(
    r"^[+-]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


def _quantity_to_str(value: Any) -> Any:
    """YAML ``cpu: 4`` is an int; a Kubernetes quantity is int-or-string: keep its text. A number with a fraction
    (``cpu: 0.5``) is rejected, as the API server rejects it (int-or-string takes integers only): write it as a
    string."""
    if isinstance(value, bool):
        return value  # rejected by the str check
    if isinstance(value, float):
        if value.is_integer():  # 4.0: an integer to the API server too
            return str(int(value))
        raise PydanticCustomError(
            "quantity_number",
            "{value} is not an integer: Kubernetes takes a quantity as an integer or a string; write it as a string, "
            'e.g. "500m" or "0.5"',
            {"value": repr(value)},
        )
    if isinstance(value, int):
        return str(value)
    return value


def _check_quantity(value: str) -> str:
    if not _QUANTITY.fullmatch(value):
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 500m, 4, 16Gi)")
    return value


Quantity = Annotated[
    str,
    BeforeValidator(_quantity_to_str),
    AfterValidator(_check_quantity),
    # the pattern applies to the string form only (an integer is always a quantity)
    WithJsonSchema({"x-kubernetes-int-or-string": True, "pattern": _QUANTITY.pattern}),
]
"""A Kubernetes resource quantity (``500m``, ``4``, ``16Gi``); integers are accepted and kept as text, numbers
with a fraction are not (the API server rejects them: write ``"0.5"`` or ``"500m"``)."""


def _number_only(value: Any) -> Any:
    """A number field takes a YAML/JSON number only: the API server rejects ``"8"`` (a string) and ``true`` (a
    boolean) for it, where pydantic would coerce both."""
    if isinstance(value, (str, bytes, bytearray, bool)):
        raise PydanticCustomError(
            "number_type", "Input should be a number, not {kind} {value}",
            {"kind": "a boolean" if isinstance(value, bool) else "a string", "value": repr(value)},
        )
    return value


Int = Annotated[int, BeforeValidator(_number_only)]
"""An integer field: a number (``8``, or ``8.0``), never a string or a boolean (``{"type": "integer"}``)."""

Float = Annotated[float, BeforeValidator(_number_only)]
"""A float field: any number (``100`` or ``0.5``), never a string or a boolean (``{"type": "number"}``)."""

NonNegativeInt = Annotated[int, Field(ge=0), BeforeValidator(_number_only)]
"""An integer >= 0 (the bound before the validator, so that it reaches the JSON schema as ``minimum: 0``)."""


# Kubernetes' rules for node labels (k8s.io/apimachinery/pkg/util/validation: IsQualifiedName, IsDNS1123Subdomain,
# IsValidLabelValue), which the API server applies to a pod's nodeSelector: a worker Deployment whose selector breaks
# them is refused (422) when the operator applies it, so the spec is checked up front, here and in the CRD.
_LABEL_NAME_RE = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")  # Kubernetes' qualifiedNameFmt
_DNS1123_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_DNS1123_SUBDOMAIN_RE = re.compile(_DNS1123_SUBDOMAIN)
_NAME_RULE = "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character"

LABEL_VALUE_MAX_LENGTH = 63
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
"""A label value: empty, or a name (with :data:`LABEL_VALUE_MAX_LENGTH`, at most 63 characters)."""

LABEL_KEY_MAX_LENGTH = 253 + 1 + 63
"""A label key: a prefix of at most 253 characters, ``/``, a name of at most 63."""
LABEL_KEY_PATTERN = rf"^({_DNS1123_SUBDOMAIN}/)?[A-Za-z0-9]([-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?$"
"""A label key, all but the length of its prefix: an optional DNS-1123 subdomain and ``/``, then a name of 1 to 63
characters (the bounded repetition bounds the name; RE2, which the API server runs, has no look-ahead to bound the
prefix as well: see :data:`LABEL_PREFIX_LENGTH_PATTERN`). No backslash and no quote, so that it can sit in a CEL
string literal."""
LABEL_PREFIX_LENGTH_PATTERN = r"^[^/]{0,253}(/|$)"
"""Matches a label key whose prefix (the part before ``/``, if any) has at most 253 characters."""


def _label_key_problems(key: str) -> list[str]:
    """What Kubernetes' IsQualifiedName says of ``key`` (empty = a valid label key), in its words."""
    parts = key.split("/")
    if len(parts) > 2:
        return ["a label key is a name with an optional DNS subdomain prefix and one '/' (e.g. example.com/MyName)"]
    problems = []
    if len(parts) == 2:
        prefix = parts[0]
        if not prefix:
            problems.append("prefix part must be non-empty")
        else:
            if len(prefix) > 253:
                problems.append("prefix part must be no more than 253 characters")
            if not _DNS1123_SUBDOMAIN_RE.fullmatch(prefix):
                problems.append("prefix part must be a lowercase DNS-1123 subdomain: lower case alphanumeric characters, "
                                "'-' or '.', starting and ending with an alphanumeric character (e.g. example.com)")
    name = parts[-1]
    if not name:
        problems.append("name part must be non-empty")
    else:
        if len(name) > 63:
            problems.append("name part must be no more than 63 characters")
        if not _LABEL_NAME_RE.fullmatch(name):
            problems.append(f"name part {_NAME_RULE}")
    return problems


def _label_value_problems(value: str) -> list[str]:
    """What Kubernetes' IsValidLabelValue says of ``value`` (empty = a valid label value), in its words."""
    problems = []
    if len(value) > LABEL_VALUE_MAX_LENGTH:
        problems.append(f"it must be no more than {LABEL_VALUE_MAX_LENGTH} characters")
    if value and not _LABEL_NAME_RE.fullmatch(value):
        problems.append(f"it must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must "
                        f"start and end with an alphanumeric character")
    return problems


def _check_label_value(value: str) -> str:
    problems = _label_value_problems(value)
    if problems:
        raise PydanticCustomError("label_value", "{value} is not a valid label value: {problems}",
                                  {"value": repr(value), "problems": "; ".join(problems)})
    return value


def _check_optional_label_key(key: str) -> str:
    problems = _label_key_problems(key) if key else []
    if problems:
        raise PydanticCustomError("label_key", "{key} is not a valid label key: {problems}",
                                  {"key": repr(key), "problems": "; ".join(problems)})
    return key


def _check_label_keys(labels: dict[str, str]) -> dict[str, str]:
    bad = [f"{key!r} is not a valid label key: {'; '.join(problems)}"
           for key in labels if (problems := _label_key_problems(key))]
    if bad:
        raise PydanticCustomError("label_key", "{bad}", {"bad": "; ".join(bad)})
    return labels


LabelValue = Annotated[
    str,
    AfterValidator(_check_label_value),
    WithJsonSchema({"type": "string", "maxLength": LABEL_VALUE_MAX_LENGTH, "pattern": LABEL_VALUE_PATTERN}),
]
"""A Kubernetes label value: empty, or at most 63 alphanumeric characters, ``-``, ``_`` or ``.`` that start and end
with an alphanumeric character."""

OptionalLabelKey = Annotated[
    str,
    AfterValidator(_check_optional_label_key),
    WithJsonSchema({"type": "string", "maxLength": LABEL_KEY_MAX_LENGTH, "pattern": f"^({LABEL_KEY_PATTERN[1:-1]})?$"}),
]
"""A Kubernetes label key, or ``""`` (= none). The JSON schema's pattern checks all but the length of the prefix,
which the CRD checks with a CEL rule (:data:`LABEL_PREFIX_LENGTH_PATTERN`)."""


class ModelSpec(_Model):
    """The served model."""

    name: str = Field(min_length=1, description="Model id or path passed to vLLM (e.g. meta-llama/Llama-3.1-70B-Instruct).")
    served_name: str | None = Field(default=None, description="Name clients use in the OpenAI API; defaults to `name`.")


class ResourceQuantities(_Model):
    """CPU and memory of one worker container (GPUs are set by the operator: ``nvidia.com/gpu`` = TP)."""

    cpu: Quantity | None = Field(default=None, description="CPU cores, a Kubernetes quantity (e.g. 8 or 500m); unset = none.")
    memory: Quantity | None = Field(default=None, description="Memory, a Kubernetes quantity (e.g. 64Gi); unset = none.")


class ResourcesSpec(_Model):
    """Requests and limits of the worker container besides GPUs."""

    requests: ResourceQuantities = Field(default_factory=ResourceQuantities, description="What the scheduler reserves per worker pod.")
    limits: ResourceQuantities = Field(default_factory=ResourceQuantities, description="The most a worker pod may use.")


DEFAULT_MAX_NUM_SEQS = 256
"""vLLM ``--max-num-seqs`` when ``spec.engine.maxNumSeqs`` is unset (``fulcrum worker``'s and vLLM's GPU default)."""
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
"""vLLM ``--max-num-batched-tokens`` when ``spec.engine.maxNumBatchedTokens`` is unset (``fulcrum worker``'s)."""

MAX_NUM_SEQS_LIMIT = 65_536
"""The largest ``spec.engine.maxNumSeqs`` (far above what one engine's KV cache holds at once)."""
MAX_NUM_BATCHED_TOKENS_LIMIT = 4_194_304
"""The largest ``spec.engine.maxNumBatchedTokens`` (twice the largest ``maxModelLen``)."""

_VLLM_FLAGS: tuple[tuple[str, str, str], ...] = (
    # (vLLM flag, the `fulcrum worker` flag that sets it, or "" when the worker always sets it, what decides it)
    ("--model", "--model", "spec.model.name"),
    ("--served-model-name", "--served-model-name", "spec.model.servedName"),
    ("--tensor-parallel-size", "--tp", "the planner's TP per pool"),
    ("-tp", "--tp", "the planner's TP per pool"),
    ("--host", "--host", "the operator (0.0.0.0)"),
    ("--port", "--port", "the operator (the pod's http port)"),
    ("--max-model-len", "--max-model-len", "spec.engine.maxModelLen"),
    ("--block-size", "--block-size", "spec.engine.blockSize"),
    ("--max-num-seqs", "--max-num-seqs", f"spec.engine.maxNumSeqs (unset: {DEFAULT_MAX_NUM_SEQS})"),
    ("--max-num-batched-tokens", "--max-num-batched-tokens",
     f"spec.engine.maxNumBatchedTokens (unset: {DEFAULT_MAX_NUM_BATCHED_TOKENS})"),
    ("--enable-prefix-caching", "", "fulcrum worker (always on: the router's prefix-aware routing and prefix pulls "
                                    "rely on cached prefixes)"),
    ("--kv-transfer-config", "--kv-connector", "the operator (NIXL, the pool's KV role)"),
    ("--scheduler-cls", "--scheduler", "the operator (the SLO-aware scheduler)"),
)
_VLLM_BOOLEAN_FLAGS = frozenset({"--enable-prefix-caching"})
"""Boolean flags the worker always turns on, which vLLM declares with ``argparse.BooleanOptionalAction``: each has
a ``--no-`` twin (``--no-enable-prefix-caching``) that would turn it off, so the twin is managed; the flag itself
may be repeated (it sets the value the worker sets, as copied vLLM command lines often do)."""


def _with_no_twins(table: Mapping[str, str]) -> dict[str, str]:
    out = dict(table)
    for flag in sorted(_VLLM_BOOLEAN_FLAGS):
        out["--no-" + flag[2:]] = out.pop(flag)
    return out


VLLM_MANAGED_FLAGS: dict[str, str] = _with_no_twins({flag: source for flag, _, source in _VLLM_FLAGS})
"""vLLM flags that ``fulcrum worker`` always sets → what decides their value. ``engine.extraArgs`` of kind ``vllm``
may not repeat them: vLLM's argument parser keeps the last value, so a repeat would silently override, e.g., the
planner's TP while the registration still advertises the planned one. For a boolean flag the worker always turns
on, only its ``--no-`` twin (``--no-enable-prefix-caching``) is managed: repeating the flag changes nothing."""

VLLM_WORKER_FLAGS: dict[str, str] = _with_no_twins({flag: worker for flag, worker, _ in _VLLM_FLAGS})
"""The same vLLM flags → the ``fulcrum worker`` flag that sets them ("" = none: the worker always sets it); the
worker's own table (``fulcrum.worker.vllm_args.MANAGED_FLAGS``) is this one."""

SIM_WORKER_MANAGED_FLAGS: dict[str, str] = {
    **{flag: "the operator"
       for flag in ("--profile", "--tp", "--model", "--host", "--port", "--role", "--pool", "--block-size", "--etcd",
                    "--nats", "--namespace", "--llmserve", "--drain-timeout-s")},
    "--max-model-len": "spec.engine.maxModelLen",
    # the planner counts on these per instance (cc_d): set them through the fields, never behind its back
    "--max-num-seqs": f"spec.engine.maxNumSeqs (unset: {DEFAULT_MAX_NUM_SEQS})",
    "--max-num-batched-tokens": f"spec.engine.maxNumBatchedTokens (unset: {DEFAULT_MAX_NUM_BATCHED_TOKENS})",
}
"""``fulcrum sim-worker`` flags that the operator sets; ``engine.extraArgs`` of kind ``sim`` may not repeat them."""


def extra_arg_flag(arg: str, managed: Mapping[str, str]) -> str | None:
    """The flag of ``managed`` that the extra argument ``arg`` sets, read as vLLM's ``FlexibleArgumentParser`` reads
    it, or None.

    ``--flag=value`` names ``--flag``; ``--flag.key=value`` sets a field of ``--flag``; ``_`` in a long flag's name
    counts as ``-``; and argparse takes a prefix of a long flag (``--tensor-parallel``) for the flag. A value (an
    item that does not start with ``-``) names no flag.
    """
    if not arg.startswith("-"):
        return None
    name = arg.split("=", 1)[0]
    if name.startswith("--"):
        name = "--" + name[2:].split(".", 1)[0].replace("_", "-")
    if name in managed:
        return name
    if name.startswith("--") and len(name) > 3:
        prefixed = [flag for flag in managed if flag.startswith("--") and flag.startswith(name)]
        if prefixed:
            return min(prefixed)
    return None


def malformed_extra_arg(args: Sequence[str], i: int) -> str | None:
    """Why item ``i`` of an extra-argument list cannot be passed as one argv item, or None.

    Refused: a flag with whitespace in its name (``"--max-num-seqs 4"`` reaches the engine as one unknown argument:
    write the flag and its value as two items) and an empty or blank item that is not the value of the flag
    before it (the engine would refuse an invisible positional argument).
    """
    arg = args[i]
    if arg.startswith("-") and any(ch.isspace() for ch in arg.split("=", 1)[0]):
        return f"{arg!r} has whitespace in the flag: write the flag and its value as two items"
    if not arg.strip():
        previous = args[i - 1] if i > 0 else ""
        if not (previous.startswith("-") and "=" not in previous):
            return f"item {i} is empty (or blank) and follows no flag it could be the value of"
    return None


VLLM_REFUSED_FLAGS: dict[str, str] = {
    "--disable-log-stats": "it turns off vLLM's stat loggers, and with them the vllm:num_requests_* gauges on "
                           "/metrics that the worker's drain waits on (it would always run to --drain-timeout-s) and "
                           "the router's load view reads; leave it out",
}
"""vLLM flags that neither ``engine.extraArgs`` (kind ``vllm``) nor ``fulcrum worker``'s extra vLLM arguments may
carry, whatever their value → why, and the fix (the end of a sentence that starts "refused: "). Matched as
:func:`extra_arg_flag` reads a flag (``--disable_log_stats`` and the abbreviation ``--disable-log-st`` count)."""

_CHUNKED_PREFILL_FLAGS = {"--enable-chunked-prefill": "on", "--no-enable-chunked-prefill": "off"}


def chunked_prefill(extra_args: Sequence[str]) -> bool:
    """Whether vLLM runs with chunked prefill given these extra arguments: on (vLLM's default for generative models,
    which ``fulcrum worker`` keeps) unless the last ``--[no-]enable-chunked-prefill`` among them turns it off
    (read as :func:`extra_arg_flag` reads a flag: ``--no_enable_chunked_prefill`` counts)."""
    on = True
    for arg in extra_args:
        flag = extra_arg_flag(arg, _CHUNKED_PREFILL_FLAGS)
        if flag is not None:
            on = _CHUNKED_PREFILL_FLAGS[flag] == "on"
    return on


@dataclass(frozen=True, slots=True)
class BatchLimitNames:
    """How a message of :func:`chunked_prefill_off_problem` names the settings it speaks of."""

    tokens: str
    """the per-step token budget: ``maxNumBatchedTokens`` in the spec, ``--max-num-batched-tokens`` on the CLI."""
    max_model_len: str
    """the context length cap: ``maxModelLen`` in the spec, ``--max-model-len`` on the CLI."""
    extra_args: str
    """the singular subject of "... turns chunked prefill off": ``extraArgs`` in the spec, "an extra vLLM
    argument" on the CLI."""


SPEC_BATCH_LIMIT_NAMES = BatchLimitNames("maxNumBatchedTokens", "maxModelLen", "extraArgs")
"""Field names of ``spec.engine`` (the LLMServe model's messages)."""
WORKER_BATCH_LIMIT_NAMES = BatchLimitNames("--max-num-batched-tokens", "--max-model-len", "an extra vLLM argument")
"""Flag names of ``fulcrum worker`` (``fulcrum.worker.vllm_args.WorkerConfig``'s messages)."""


def chunked_prefill_off_problem(max_num_batched_tokens: int, max_model_len: int | None, extra_args: Sequence[str],
                                names: BatchLimitNames, *, tokens_unset: bool = False) -> str | None:
    """Why vLLM would refuse to start with this token budget, or None: with chunked prefill off
    (:func:`chunked_prefill`), vLLM's ``SchedulerConfig`` requires ``max_num_batched_tokens >= max_model_len`` (a
    whole prompt must fit one step). The one copy of the rule, used by the LLMServe model (``spec.engine``) and by
    ``fulcrum worker`` (``WorkerConfig``).

    Args:
        max_num_batched_tokens: per-step token budget, tokens.
        max_model_len: context length cap, tokens; None = the model's own, unknown here (nothing is checked).
        extra_args: the extra vLLM arguments, as passed.
        names: the vocabulary of the message (:data:`SPEC_BATCH_LIMIT_NAMES` or :data:`WORKER_BATCH_LIMIT_NAMES`).
        tokens_unset: say "(unset)" after the budget (the spec field was left out and its default applies).
    """
    if max_model_len is None or max_num_batched_tokens >= max_model_len or chunked_prefill(extra_args):
        return None
    tokens = f"{names.tokens} {max_num_batched_tokens}" + (" (unset)" if tokens_unset else "")
    return (f"{tokens} is below {names.max_model_len} {max_model_len} while {names.extra_args} turns chunked prefill "
            f"off: vLLM then requires max_num_batched_tokens >= max_model_len (raise {names.tokens}, lower "
            f"{names.max_model_len}, or keep chunked prefill)")


class EngineSpec(_Model):
    """The inference engine of every worker."""

    kind: EngineKind = Field(
        default=EngineKind.VLLM,
        description="`vllm`: pools run `fulcrum worker` (real vLLM) in `image` with TP GPUs each; `sim`: pools run "
        "`fulcrum sim-worker` (an emulator timed by spec.profile) in the Fulcrum image, without GPUs.",
    )
    image: str = Field(default="ghcr.io/fulcrum-llm/worker:0.1.0", min_length=1, description="Worker image (vLLM with NIXL); unused for kind `sim`.")
    # declared before extra_args, whose validator reads them
    max_num_seqs: Annotated[int, Field(ge=1, le=MAX_NUM_SEQS_LIMIT), BeforeValidator(_number_only)] | None = Field(
        default=None,
        description=f"Most requests one engine runs at once (vLLM `--max-num-seqs`); unset = {DEFAULT_MAX_NUM_SEQS}. "
        "Each instance registers it as its concurrency limit (the router's load estimates use it), and the planner "
        "counts on at most this many requests per decode or unified instance (beside DOPD eq. 14's CUDA-graph cap). "
        "Passed to the sim-worker too when set.",
    )
    max_num_batched_tokens: Annotated[int, Field(ge=1, le=MAX_NUM_BATCHED_TOKENS_LIMIT), BeforeValidator(_number_only)] | None = Field(
        default=None,
        description=f"Tokens one engine step computes, prompt chunks and decodes together (vLLM "
        f"`--max-num-batched-tokens`); unset = {DEFAULT_MAX_NUM_BATCHED_TOKENS}. At least maxNumSeqs (vLLM requires "
        "it). Fulcrum's engines run with chunked prefill (vLLM's default), so it may be below maxModelLen; with "
        "chunked prefill turned off in extraArgs (--no-enable-chunked-prefill) it must be at least maxModelLen. "
        "Passed to the sim-worker too when set.",
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="Extra arguments appended verbatim: to `vllm serve` (after `--`) for kind `vllm`, to "
        "`fulcrum sim-worker` for kind `sim` (e.g. [--time-scale, \"0.1\"]). A flag Fulcrum sets itself is refused; "
        "so is --disable-log-stats for kind `vllm` (the worker's drain and the router read vLLM's request gauges, "
        "which it turns off).",
    )
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="CPU and memory requests/limits of each worker container.")
    max_model_len: Int = Field(default=8192, ge=16, le=2_097_152, description="Maximum context length in tokens (prompt + output).")
    block_size: Int = Field(default=16, ge=1, le=1024, description="KV cache block size in tokens.")

    @field_validator("extra_args")
    @classmethod
    def _extra_args_leave_fulcrums_flags_alone(cls, extra_args: list[str], info: ValidationInfo) -> list[str]:
        """Refuse an item that repeats a flag Fulcrum sets (:data:`VLLM_MANAGED_FLAGS`, or
        :data:`SIM_WORKER_MANAGED_FLAGS` for kind ``sim``), a flag of :data:`VLLM_REFUSED_FLAGS` (kind ``vllm``), or
        one that is malformed (:func:`malformed_extra_arg`)."""
        sim = info.data.get("kind") is EngineKind.SIM
        managed = SIM_WORKER_MANAGED_FLAGS if sim else VLLM_MANAGED_FLAGS
        problems: list[str] = []
        for i, arg in enumerate(extra_args):
            bad = malformed_extra_arg(extra_args, i)
            flag = None if bad else extra_arg_flag(arg, managed)
            if flag is not None and managed[flag].startswith("spec.engine."):  # a field decides it: point there
                bad = f"{arg!r} sets {flag}: set {managed[flag]} instead (Fulcrum passes it to the engine)"
            elif flag is not None and flag.startswith("--no-"):
                bad = (f"{arg!r} turns off --{flag[5:]}, which Fulcrum always turns on ({managed[flag]})")
            elif flag is not None:
                bad = (f"{arg!r} sets {flag}, which Fulcrum sets itself from {managed[flag]} (the engine would "
                       "silently keep the last value)")
            refused = None if bad or sim else extra_arg_flag(arg, VLLM_REFUSED_FLAGS)
            if refused is not None:
                shown = repr(arg) + ("" if arg.split("=", 1)[0] == refused else f" (= {refused})")
                bad = f"{shown} is refused: {VLLM_REFUSED_FLAGS[refused]}"
            if bad:
                problems.append(bad)
        if problems:
            raise ValueError("; ".join(problems))
        return extra_args

    @model_validator(mode="after")
    def _batch_limits_fit(self) -> "EngineSpec":
        """vLLM's own checks of its scheduler limits (``SchedulerConfig``), up front instead of a crash-looping
        engine: ``--max-num-batched-tokens`` at least ``--max-num-seqs``, and at least ``--max-model-len`` when
        chunked prefill is off (it is on unless ``extraArgs`` turns it off: vLLM's default, which Fulcrum keeps)."""
        seqs = self.max_num_seqs if self.max_num_seqs is not None else DEFAULT_MAX_NUM_SEQS
        tokens = self.max_num_batched_tokens if self.max_num_batched_tokens is not None else DEFAULT_MAX_NUM_BATCHED_TOKENS
        tokens_shown = f"maxNumBatchedTokens {tokens}" + ("" if self.max_num_batched_tokens is not None else " (unset)")
        if tokens < seqs:
            seqs_shown = f"maxNumSeqs {seqs}" + ("" if self.max_num_seqs is not None else " (unset)")
            raise ValueError(f"{tokens_shown} is below {seqs_shown}: vLLM requires max_num_batched_tokens >= "
                             f"max_num_seqs")
        if self.kind is EngineKind.VLLM:
            problem = chunked_prefill_off_problem(tokens, self.max_model_len, self.extra_args, SPEC_BATCH_LIMIT_NAMES,
                                                  tokens_unset=self.max_num_batched_tokens is None)
            if problem:
                raise ValueError(problem)
        return self


class GPUSpec(_Model):
    """The accelerator type of the pools. Defaults describe an NVIDIA H100 SXM 80 GB."""

    type: str = Field(
        default="H100", min_length=1, max_length=253,
        description="GPU type; the node-selector value of placement.gpuTypeLabel when that is set (engine kind "
        "`vllm`), and then a label value (at most 63 alphanumeric characters, '-', '_' or '.', starting and ending "
        "with an alphanumeric one).",
    )
    memory_gib: Float = Field(default=80.0, gt=0, le=4096, alias="memoryGiB", description="Memory per GPU in GiB.")
    hbm_bandwidth_gbps: Float = Field(default=3350.0, gt=0, alias="hbmBandwidthGBps", description="HBM bandwidth per GPU in GB/s.")
    gpus_per_node: Int = Field(default=8, ge=1, le=64, alias="gpusPerNode", description="GPUs per node; bounds TP.")


class SLOSpec(_Model):
    """Latency SLOs at a percentile (DOPD §VI uses TTFT < 2 s and TPOT < 80 ms at P90)."""

    ttft_ms: Float = Field(default=2000.0, gt=0, description="Time-to-first-token target in ms.")
    tpot_ms: Float = Field(default=80.0, gt=0, description="Time-per-output-token target in ms.")
    percentile: Float = Field(default=90.0, gt=0, le=100, description="Percentile at which both targets must hold, e.g. 90.")


MAX_ARIMA_ORDER = 8
"""The largest term of ``spec.scaling.forecaster.order``. ARIMA's fit grows fast with p + q: on the default
64-interval window one fit took 0.3 s at (8, 0, 8), 2.6 s at (16, 0, 16) and 44 s at (32, 0, 32) (a planner
interval stalls); the orders that forecast serving load are small (DOPD, docs/forecasting.md)."""
ArimaOrderTerm = Annotated[int, Field(ge=0, le=MAX_ARIMA_ORDER), BeforeValidator(_number_only)]


class ForecasterSpec(_Model):
    """Load forecaster settings (DOPD §V-D, Alg. 2 lines 5–9)."""

    method: ForecasterMethod = Field(
        default=ForecasterMethod.SELECT,
        description="Forecasting method per series. The default `select` chooses per series, by a rolling one-step "
        "backtest, among ARIMA, exponential smoothing and the baselines, and keeps the last value unless another "
        "beats it on the trailing window; it beat `arima` in geometric-mean MAPE on the bundled traces "
        "(docs/forecasting.md).",
    )
    order: tuple[ArimaOrderTerm, ArimaOrderTerm, ArimaOrderTerm] = Field(
        default=(0, 1, 1),
        description="ARIMA order (p, d, q), each at most "
        f"{MAX_ARIMA_ORDER}. The default (0, 1, 1) is exponential smoothing in ARIMA form; it beat "
        "(2, 0, 1) and the last value on the Azure code and Mooncake traces (docs/forecasting.md).",
    )
    window: Int = Field(default=64, ge=4, le=10_000, description="Intervals of history the model is fitted on (N of the O(N·(p+q)²) refit).")
    refit_error: Float = Field(default=0.25, gt=0, le=10, description="Refit when the recent mean absolute percentage error exceeds this (0.25 = 25%).")
    prediction_level: Float = Field(default=0.9, gt=0.5, lt=1.0, description="Level of the upper prediction bound used for proactive scaling.")
    moving_average_window: Int = Field(default=5, ge=1, le=10_000, description="Intervals averaged by the moving-average baseline.")
    season_length: Int = Field(default=144, ge=2, le=100_000, description="Season in intervals for seasonal-naive (144 × 10 min = 1 day).")


MAX_GPUS_LIMIT = 65_536
"""The largest ``spec.scaling.minGPUs`` and ``maxGPUs`` (a GPU budget beyond any one cluster; it bounds the
planner's arithmetic and the CRD's ``maximum``)."""
MAX_INSTANCES_LIMIT = 4_096
"""The largest ``spec.scaling.replicas`` and initial instance count of a pool."""


class ScalingSpec(_Model):
    """Limits and cadence of the planner loop."""

    min_gpus: Int = Field(default=1, ge=0, le=MAX_GPUS_LIMIT, alias="minGPUs", description=f"Fewest GPUs the deployment may use; at most {MAX_GPUS_LIMIT}.")
    max_gpus: Int = Field(default=64, ge=1, le=MAX_GPUS_LIMIT, alias="maxGPUs", description=f"Most GPUs the deployment may use (the GPU budget); at most {MAX_GPUS_LIMIT}.")
    interval_seconds: Float = Field(default=60.0, ge=1, le=86_400, description="Planner interval T in seconds.")
    pod_startup_seconds: Float = Field(default=120.0, ge=0, le=3_600, description="Time from scale-out to a ready instance; the forecast horizon adds it.")
    cooldown_seconds: Float = Field(default=300.0, ge=0, le=86_400, description="Minimum time between scale-ins of a pool.")
    max_step: Int = Field(default=8, ge=1, le=1024, description="Most instances added or removed per pool per interval.")
    tp_prefill: Annotated[int, Field(ge=1, le=64), BeforeValidator(_number_only)] | None = Field(default=None, description="Fixed TP of prefill instances; chosen by the planner (eq. 16 + memory) when unset.")
    tp_decode: Annotated[int, Field(ge=1, le=64), BeforeValidator(_number_only)] | None = Field(default=None, description="Fixed TP of decode instances; chosen by the planner (eqs. 11–14) when unset.")
    tp_unified: Annotated[int, Field(ge=1, le=64), BeforeValidator(_number_only)] | None = Field(default=None, description="Fixed TP of unified instances; chosen by the planner when unset.")
    initial_prefill: Int = Field(default=1, ge=0, le=MAX_INSTANCES_LIMIT, description=f"Prefill instances at start (and for policy `static`); at most {MAX_INSTANCES_LIMIT}. The start (and the static plan) is cut to maxGPUs at the planned TPs; a start below minGPUs is topped up by the planner's first interval (static keeps it).")
    initial_decode: Int = Field(default=1, ge=0, le=MAX_INSTANCES_LIMIT, description=f"Decode instances at start (and for policy `static`); at most {MAX_INSTANCES_LIMIT}. The start (and the static plan) is cut to maxGPUs at the planned TPs; a start below minGPUs is topped up by the planner's first interval (static keeps it).")
    initial_unified: Int = Field(default=1, ge=0, le=MAX_INSTANCES_LIMIT, description=f"Unified instances at start in Unified mode (and for policy `static`); at most {MAX_INSTANCES_LIMIT}. The start (and the static plan) is cut to maxGPUs at the planned TPs; a start below minGPUs is topped up by the planner's first interval (static keeps it).")
    forecaster: ForecasterSpec = Field(default_factory=ForecasterSpec, description="Load forecaster settings.")
    replica_owner: ReplicaOwner = Field(
        default=ReplicaOwner.OPERATOR,
        description="Who sets the total instance count: `Operator` (the planner; `replicas` is ignored) or `External` "
        "(an HPA/KEDA writes `replicas` through the scale subresource; the operator splits it by the planned ratio).",
    )
    replicas: Annotated[int, Field(ge=0, le=MAX_INSTANCES_LIMIT), BeforeValidator(_number_only)] | None = Field(
        default=None,
        description="Total worker instances, all pools together; obeyed only when replicaOwner is External (required "
        "then). An instance uses 1 to gpu.gpusPerNode GPUs, so replicas <= maxGPUs and replicas × gpusPerNode >= minGPUs.",
    )
    drain_timeout_seconds: Int = Field(
        default=300, ge=0, le=86_400,
        description="Longest wait for a scaled-in instance's in-flight requests to finish before it is deleted; pods get "
        "this plus 30 s of termination grace.",
    )
    planner: PlannerName = Field(
        default=PlannerName.FULCRUM,
        description="The planner run every interval: `fulcrum` (default), `dopd` (DOPD Alg. 2 as published), `static` "
        "(the initial counts), `dynamo-sla` or `dynamo-load` (Dynamo's planners); `fulcrum replay --compare` compares them.",
    )

    @model_validator(mode="after")
    def _min_le_max(self) -> "ScalingSpec":
        if self.min_gpus > self.max_gpus:
            raise ValueError(f"minGPUs ({self.min_gpus}) must be <= maxGPUs ({self.max_gpus})")
        if self.replica_owner is ReplicaOwner.EXTERNAL and self.replicas is None:
            raise ValueError("replicaOwner External requires replicas")
        if self.replicas is not None and self.replicas > self.max_gpus:
            raise ValueError(f"replicas ({self.replicas}) exceeds maxGPUs ({self.max_gpus}): an instance uses >= 1 GPU")
        return self


class ProfileRef(_Model):
    """Where the performance profile comes from: a built-in name, a file, or a ConfigMap."""

    name: str | None = Field(default=None, description="Built-in profile name (see `fulcrum.ratio.profiles`), e.g. dopd-llama70b-fp8-h100.")
    path: str | None = Field(default=None, description="Path of a YAML/JSON/CSV profile file (replay and tests).")
    config_map: str | None = Field(default=None, description="ConfigMap holding `profile.yaml` (in-cluster).")

    @model_validator(mode="after")
    def _exactly_one(self) -> "ProfileRef":
        given = [k for k in ("name", "path", "config_map") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"set exactly one of name, path, configMap (got {given or 'none'})")
        return self


class RouterSpec(_Model):
    """Router settings; the operator writes them into the router ConfigMap."""

    policy: RouterPolicy = Field(default=RouterPolicy.DISAGGREGATED, description="Per-request routing policy.")
    replicas: Int = Field(default=1, ge=1, le=64, description="Router replicas.")
    prefill_queue: Literal["direct", "nats"] = Field(default="direct", description="`nats` sends prefill jobs through a JetStream work queue (DOPD §V-C).")
    rescheduling: StrictBool = Field(default=False, description="ARES decode rescheduling (ARES §5.2, Alg. 1): every second the router moves one running decode request from an overloaded to an underloaded decode instance (a recompute migration; the client's stream does not break).")
    role_reassignment: StrictBool = Field(default=False, description="Role reassignment (BanaServe Alg. 1 with a role flip): the router shifts `both` (unified) instances between prefill and decode duty from measured utilisation, with hysteresis.")
    prefix_pull: StrictBool = Field(default=False, description="Load-aware dispatch over a shared KV store (BanaServe §4.2, §4.4.2; policy `load_aware` only): a request goes to the least-loaded instance, which pulls the prompt's cached prefix over NIXL from the instance holding it when that is cheaper than recomputing it. The workers' NIXL connector runs with `bidirectional_kv_xfer`.")


class Toleration(_Model):
    """A Kubernetes pod toleration (core/v1 Toleration), copied onto every worker pod."""

    key: OptionalLabelKey | None = Field(
        default=None,
        description="Taint key the toleration applies to: a label key (an optional DNS-1123 subdomain prefix of at most "
        "253 characters and `/`, then a name of 1 to 63 alphanumeric characters, '-', '_' or '.', starting and ending "
        "with an alphanumeric one); unset or empty with operator Exists = every taint.",
    )
    operator: Literal["Exists", "Equal"] | None = Field(default=None, description="`Exists` or `Equal` (the Kubernetes default).")
    value: LabelValue | None = Field(
        default=None,
        description="Taint value to match with operator Equal: a label value (empty, or at most 63 alphanumeric "
        "characters, '-', '_' or '.', starting and ending with an alphanumeric one); empty with operator Exists.",
    )
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(default=None, description="Taint effect to match; unset = all.")
    toleration_seconds: Int | None = Field(default=None, description="How long a NoExecute taint is tolerated, seconds; unset = forever. Only with effect NoExecute.")

    @model_validator(mode="after")
    def _as_kubernetes_validates(self) -> "Toleration":
        # the rules of Kubernetes' ValidateTolerations (the API server rejects the pod template otherwise); its label
        # rules (a non-empty key a label key, with Equal the value a label value) are the types of key and value: a
        # label value is empty or a name, so asking it whatever the operator adds nothing for Exists, which wants ""
        if not self.key and self.operator != "Exists":
            raise ValueError("operator must be Exists when key is empty (a toleration of every taint)")
        if self.operator == "Exists" and self.value:
            raise ValueError("value must be empty when operator is Exists")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("effect must be NoExecute when tolerationSeconds is set")
        return self


class Affinity(_Model):
    """Kubernetes pod affinity (core/v1 Affinity) for the worker pods; each member is passed through unchanged
    and validated by the API server when the Deployment is applied."""

    node_affinity: dict[str, Any] | None = Field(default=None, description="core/v1 NodeAffinity, e.g. requiredDuringSchedulingIgnoredDuringExecution.")
    pod_affinity: dict[str, Any] | None = Field(default=None, description="core/v1 PodAffinity.")
    pod_anti_affinity: dict[str, Any] | None = Field(default=None, description="core/v1 PodAntiAffinity.")


class PlacementSpec(_Model):
    """Where worker pods may run. The router pods get none of it (they need no GPU)."""

    node_selector: Annotated[dict[str, LabelValue], AfterValidator(_check_label_keys)] = Field(
        default_factory=dict, max_length=64,
        description="Node labels every worker pod requires: at most 64, each key a label key (an optional DNS-1123 "
        "subdomain prefix of at most 253 characters and `/`, then a name of 1 to 63 alphanumeric characters, '-', '_' "
        "or '.', starting and ending with an alphanumeric one), each value empty or such a name, as Kubernetes requires "
        "of a pod's nodeSelector.",
    )
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64, description="Taints the worker pods tolerate (e.g. nvidia.com/gpu:NoSchedule); at most 64, which bounds the cost of the CRD's CEL rules on each.")
    affinity: Affinity = Field(default_factory=Affinity, description="Node and pod affinity of the worker pods.")
    gpu_type_label: OptionalLabelKey = Field(
        default="",
        description="Node label whose value must equal gpu.type (e.g. nvidia.com/gpu.product, or your own): a label "
        "key, and gpu.type must then be a label value; \"\" = no automatic GPU-type selector. Ignored for engine kind "
        "`sim` (its pods get no GPU-type selector, so gpu.type need not be a label value; this field must still be a "
        "label key).",
    )


class ConnectorsSpec(_Model):
    """Endpoints of the optional connectors (DOPD §V-C)."""

    etcd: str = Field(
        default="",
        description="etcd endpoint host:port of the instance registry (workers register with a lease, the router "
        "watches); \"\" = the router reads the pool Services' EndpointSlices instead.",
    )
    nats: str = Field(
        default="",
        description="NATS URL (nats://host:4222) of the JetStream prefill queue when router.prefillQueue is `nats`; "
        "\"\" = the operator's own (its --nats-url, the Helm chart's bundled NATS), and without one the operator "
        "reports the LLMServe Degraded (InvalidSpec).",
    )


class LLMServeSpec(_Model):
    """What to serve, on which GPUs, under which SLOs and limits."""

    model: ModelSpec = Field(description="The served model.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="The inference engine of every worker.")
    gpu: GPUSpec = Field(default_factory=GPUSpec, description="The accelerator of the pools.")
    slo: SLOSpec = Field(default_factory=SLOSpec, description="Latency targets at a percentile.")
    mode: Mode = Field(
        default=Mode.DISAGGREGATED,
        description="`Disaggregated` (prefill and decode pools), `Unified` (one pool of kv_both instances) or `Auto` "
        "(the planner picks whichever needs fewer GPUs; all three pools exist).",
    )
    scaling: ScalingSpec = Field(default_factory=ScalingSpec, description="Limits, cadence and replica ownership of the planner loop.")
    profile: ProfileRef = Field(
        default_factory=lambda: ProfileRef(name="dopd-llama70b-fp8-h100"),
        description="The performance profile the planner (and sim workers) use.",
    )
    router: RouterSpec = Field(default_factory=RouterSpec, description="Router settings.")
    placement: PlacementSpec = Field(default_factory=PlacementSpec, description="Node selection for the worker pods.")
    connectors: ConnectorsSpec = Field(default_factory=ConnectorsSpec, description="etcd and NATS endpoints (empty = not used).")

    @model_validator(mode="after")
    def _replicas_and_connectors(self) -> "LLMServeSpec":
        sc = self.scaling
        if sc.replicas is not None and sc.replicas * self.gpu.gpus_per_node < sc.min_gpus:
            raise ValueError(
                f"scaling.replicas ({sc.replicas}) × gpu.gpusPerNode ({self.gpu.gpus_per_node}) is below "
                f"scaling.minGPUs ({sc.min_gpus})"
            )
        if self.router.prefix_pull and self.router.policy is not RouterPolicy.LOAD_AWARE:
            raise ValueError(f"router.prefixPull requires router.policy load_aware, not {self.router.policy.value}")
        if self.mode is Mode.UNIFIED and self.scaling.planner in DISAGGREGATED_ONLY_PLANNERS:
            raise ValueError(
                f"scaling.planner {self.scaling.planner.value} plans prefill and decode pools only, and mode Unified "
                f"deploys a unified pool only, so no worker would run: use mode Disaggregated or Auto, or planner "
                f"fulcrum or static"
            )
        if self.router.policy in _COLOCATING_POLICIES and self.mode is not Mode.UNIFIED:
            raise ValueError(
                f"router.policy {self.router.policy.value} runs every request on one instance and never on a prefill "
                f"instance, so mode {self.mode.value} would leave its prefill pool idle: use disaggregated, split or "
                f"load_aware, or mode Unified"
            )
        return self

    @model_validator(mode="after")
    def _gpu_type_is_a_label_value(self) -> "LLMServeSpec":
        # placement.gpuTypeLabel puts gpu.type into the vllm worker pods' nodeSelector (operator/controller/
        # resources.py); a sim worker gets no GPU-type selector, so its gpu.type need not be a label value
        label = self.placement.gpu_type_label
        used = label and self.engine.kind is not EngineKind.SIM
        problems = _label_value_problems(self.gpu.type) if used else []
        if problems:
            raise ValueError(
                f"gpu.type {self.gpu.type!r} is not a valid label value, which placement.gpuTypeLabel ({label}) "
                f"requires: {'; '.join(problems)}"
            )
        return self

    @model_validator(mode="after")
    def _tp_fits(self) -> "LLMServeSpec":
        for field in ("tp_prefill", "tp_decode", "tp_unified"):
            tp = getattr(self.scaling, field)
            if tp is None:
                continue
            if tp > self.gpu.gpus_per_node:
                raise ValueError(f"scaling.{to_camel(field)} ({tp}) exceeds gpu.gpusPerNode ({self.gpu.gpus_per_node})")
            if tp > self.scaling.max_gpus:
                raise ValueError(f"scaling.{to_camel(field)} ({tp}) exceeds scaling.maxGPUs ({self.scaling.max_gpus})")
        return self


class ObjectMeta(_Model):
    """The subset of Kubernetes metadata Fulcrum reads."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="allow", frozen=True)

    name: str = Field(
        default="llmserve", min_length=1, max_length=55, pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$",
        description="A DNS-1035 label of at most 55 characters, so that the Services `<name>-prefill`, "
        "`<name>-decode`, `<name>-unified` and `<name>-router` are valid names too.",
    )
    namespace: str = Field(default="default", min_length=1, max_length=63)


class LLMServe(_Model):
    """The whole resource as written in ``llmserve.yaml``."""

    api_version: Literal["fulcrum.dev/v1alpha1"] = Field(default="fulcrum.dev/v1alpha1")
    kind: Literal["LLMServe"] = Field(default="LLMServe")
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: LLMServeSpec


@functools.cache
def _wire_names() -> dict[str, frozenset[str]]:
    """Python field name → its camelCase names on the wire, over every model of the resource (for hints)."""
    out: dict[str, set[str]] = {}
    todo: list[type[BaseModel]] = [LLMServe]
    seen: set[type[BaseModel]] = set()
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for name, info in model.model_fields.items():
            out.setdefault(name, set()).add(info.alias or name)
            for arg in _model_args(info.annotation):
                todo.append(arg)
    return {name: frozenset(aliases) for name, aliases in out.items()}


def _model_args(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in getattr(annotation, "__args__", ()) for m in _model_args(a)]


def _error_message(e: Any) -> str:
    if e["type"] == "extra_forbidden" and e["loc"]:
        key = str(e["loc"][-1])
        wire = _wire_names().get(key, frozenset()) - {key}
        if len(wire) == 1:
            return f"unknown field {key!r}: fields are camelCase, did you mean {next(iter(wire))!r}?"
        return f"unknown field {key!r}"
    return str(e["msg"])


def _format_validation_error(err: ValidationError, root: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not str(p).startswith("function-after"))
        path = ".".join(part for part in (root, loc) if part)  # no stray leading dot when root is ""
        lines.append(f"{path}: {_error_message(e)}")
    return "invalid LLMServe: " + "; ".join(lines)


def _nullable(annotation: Any) -> bool:
    """Whether a field of this annotation takes None (``X | None``): a CRD field with ``nullable: true``."""
    return annotation is None or type(None) in getattr(annotation, "__args__", ())


def _prune_nulls(model: type[BaseModel], data: Any) -> Any:
    """``data`` without the null members the API server prunes: a ``null`` for a field that is not nullable in the
    CRD is dropped (then defaulted, as a missing field is), recursively through nested objects and lists of objects.
    Null members of maps and null list items are kept (the model refuses them, as the schema does)."""
    if isinstance(data, list):
        return [_prune_nulls(model, item) for item in data]
    if not isinstance(data, dict):
        return data
    fields = {info.alias or name: info for name, info in model.model_fields.items()}
    out: dict[Any, Any] = {}
    for key, value in data.items():
        info = fields.get(key)
        if info is None:  # unknown: the model reports it
            out[key] = value
        elif value is None:
            if _nullable(info.annotation):
                out[key] = value
        else:
            nested = _model_args(info.annotation)
            out[key] = _prune_nulls(nested[0], value) if len(nested) == 1 else value
    return out


def parse_llmserve(data: Any) -> LLMServe:
    """Validate a mapping (a parsed YAML/JSON document) into an :class:`LLMServe`.

    A bare spec (a mapping with ``model`` at the top) is accepted too. Keys are the camelCase names only (what
    the API server keeps); a snake_case key is an unknown field. Numbers and booleans must be numbers and booleans
    (no ``"8"``, no ``"yes"``), as in the CRD schema. A ``null`` for a spec field that is not nullable (``mode:``
    left empty in YAML) is dropped and the field defaulted, as the API server prunes and defaults it.

    Raises:
        SpecError: the document is not a mapping, or any field is invalid; the message names each
            offending field by its path, e.g. ``spec.slo.ttftMs: Input should be greater than 0``.
    """
    if not isinstance(data, dict):
        raise SpecError(f"invalid LLMServe: expected a mapping, got {type(data).__name__}")
    if "spec" not in data and "model" in data:
        data = {"spec": data}
    if isinstance(data.get("spec"), dict):
        # the API server prunes a null for a field that is not nullable in the CRD, then defaults it: `mode:` or
        # `scaling:` left empty in YAML means the default there, so here too
        data = {**data, "spec": _prune_nulls(LLMServeSpec, data["spec"])}
    try:
        # the camelCase names only (pydantic >= 2.11, pyproject.toml): Python code keeps the field names
        return LLMServe.model_validate(data, by_alias=True, by_name=False)
    except ValidationError as err:
        raise SpecError(_format_validation_error(err, root="")[:4000]) from err


def load_llmserve(path: str | Path) -> LLMServe:
    """Read and validate an ``LLMServe`` YAML or JSON file: one document (``---`` around it allowed).

    Raises:
        SpecError: the file is missing, unreadable, not UTF-8, empty, not one YAML/JSON document (or nested deeper
            than the parser goes), or the resource is invalid; every message starts with the file's path.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as err:
        raise SpecError(f"cannot read LLMServe file {p}: {err.strerror or err}") from err
    except UnicodeDecodeError as err:
        raise SpecError(f"{p}: not UTF-8 text ({err.reason} at byte {err.start})") from err
    try:
        documents = [d for d in safe_yaml(text, documents=True) if d is not None]  # a stray `---` adds an empty one
    except yaml.YAMLError as err:
        where, what = yaml_problem(err)
        raise SpecError(f"{p}{where}: not valid YAML: {what}") from err
    except RecursionError as err:
        raise SpecError(f"{p}: not valid YAML: nested too deeply") from err
    if not documents:
        raise SpecError(f"{p}: empty file: no LLMServe in it")
    if len(documents) > 1:
        raise SpecError(f"{p}: {len(documents)} YAML documents: give one LLMServe per file")
    data = documents[0]
    try:
        return parse_llmserve(data)
    except SpecError as err:
        raise SpecError(f"{p}: {err}") from err
    except RecursionError as err:
        raise SpecError(f"{p}: invalid LLMServe: nested too deeply") from err
