"""``fulcrum profile``: measure a running OpenAI-compatible engine and write a :class:`PerformanceProfile`.

Three parts, kept apart so the middle one is testable without a server (STYLE.md §3):

1. **Measurement** (async, aiohttp): :func:`probe_endpoint` reads what the endpoint reports about itself
   (``/v1/models``: ``max_model_len``; ``/metrics``: vLLM's ``vllm:cache_config_info`` labels ``block_size``,
   ``num_gpu_blocks``, ``cache_dtype``, ``gpu_memory_utilization``, ``kv_cache_memory_bytes``); then
   :func:`measure` runs

   - a **TTFT sweep** over ISL: one request at a time, ``max_tokens=1``, streamed; TTFT = time from sending to
     the first streamed token. Prompts are lists of token ids of exactly ISL tokens, built from the endpoint's
     own ``/tokenize`` (a distinct numbered prefix per request, so no prefix-cache hit shortens a prefill);
   - a **TPOT grid** over (batch, context): ``batch`` concurrent streamed requests with ``ignore_eos`` and
     ``decode_tokens`` output tokens each, prompts of ``context − decode_tokens/2`` tokens (so the mean
     context during decoding is ``context``); TPOT = the engine's own mean inter-token latency over the batch
     (delta of vLLM's ``vllm:inter_token_latency_seconds`` sum/count over the steady window — from the moment every
     request of the batch has its first token to the moment the first one finishes — engine-side timestamps), or,
     where the endpoint has no such metric, the client-side time per token inside the steady window, from the
     moment the last request got its first token to the moment the first request finished (:func:`steady_tpot`).

   Each point is measured ``repeats`` times; a failed attempt is retried ``retries`` times with a back-off;
   a point whose every repeat failed is reported and skipped, never a crash; a point the engine cannot run
   at all (prompt + output beyond ``max_model_len``, or a 400 naming the context length) is dropped with a
   warning and not retried. Each point has a wall-clock budget (``point_timeout_s``): when it is spent the
   point is abandoned (kept with the repeats it measured, else skipped); after ``stop_after_timeouts`` points
   in a row failed by timeout the run stops (the engine stopped answering), the points left marked as not
   measured. Points are recorded in a :class:`MeasureLog` as they finish, so a run interrupted (Ctrl-C) keeps
   them (:meth:`MeasureLog.measurements`). This answers the complaint DESIGN.md records about Dynamo's profiler (heavy,
   crashes on missing data).

2. **Assembly** (pure, no I/O): :func:`assemble_profile` turns :class:`Measurements` and
   :class:`MemoryFacts` into a :class:`~fulcrum.ratio.profile.PerformanceProfile` (medians in seconds; the
   decode grid cut to its largest complete sub-grid; a non-decreasing envelope where noise made a latency
   fall as load grows, each raise noted); :func:`resolve_memory` decides each memory fact from flags, the
   model folder and the endpoint, recording where each came from.

3. **Rendering**: :func:`profile_document` (the YAML mapping ``load_profile`` reads, plus a ``measurement``
   section with every sample, spread, failure and note), :func:`render_configmap` (a ``v1`` ConfigMap with
   key ``profile.yaml``, what ``LLMServe.spec.profile.configMap`` names).

Sources: DOPD §V-D (Alg. 2 "Initialize INTERP" from profiled TTFT(ISL) and TPOT(batch, context) tables);
memory facts are eqs. (11)–(14) of DOPD §IV-B.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

try:
    import aiohttp
except ImportError:  # pragma: no cover - the `worker` extra is not installed: measuring needs it, the rest does not
    aiohttp = None  # type: ignore[assignment]

from fulcrum.errors import ProfileError
from fulcrum.ratio.profile import DecodeTable, PerformanceProfile, PrefillTable

__all__ = [
    "GPU_PRESETS",
    "ProfileGrid",
    "PointResult",
    "EndpointFacts",
    "Measurements",
    "MeasureLog",
    "MemoryFacts",
    "ResolvedMemory",
    "AssembledProfile",
    "parse_cache_config_info",
    "endpoint_facts",
    "steady_tpot",
    "model_dir_facts",
    "resolve_memory",
    "assemble_profile",
    "profile_document",
    "partial_note",
    "partial_line",
    "point_name",
    "render_profile_yaml",
    "dump_yaml",
    "render_configmap",
    "probe_endpoint",
    "measure",
]

GiB = float(1 << 30)

def _need_aiohttp() -> None:
    if aiohttp is None:
        raise ProfileError("measuring an endpoint needs aiohttp: pip install 'fulcrum[worker]'")


GPU_PRESETS: dict[str, tuple[float, float]] = {
    "H100": (80.0, 3350.0),
    "H200": (141.0, 4800.0),
    "A100-80GB": (80.0, 2039.0),
    "A100-40GB": (40.0, 1555.0),
    "L40S": (48.0, 864.0),
}
"""Nominal (memory GiB, HBM bandwidth GB/s) per GPU of the ``--gpu`` shortcut (vendor data sheets, SXM parts);
``--gpu-memory-gib`` and ``--hbm-bandwidth-gbps`` override them."""

FILLER_TEXT = (
    "The operator watches the serving fleet and balances prefill against decode capacity. Each request "
    "brings a prompt, the engine computes its key value cache, and then tokens stream back one by one. "
)
"""Text the prompts are made of (tokenized once by the endpoint, then tiled to any length)."""

_CONTEXT_WORDS = ("maximum context length", "max_model_len", "context length", "too long")


# --------------------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class ProfileGrid:
    """What to measure and how hard to try.

    Attributes:
        isl: prompt lengths of the TTFT sweep, tokens, strictly increasing, at least 2.
        batch: concurrent requests of the TPOT grid, strictly increasing, at least 2.
        context: mean context lengths of the TPOT grid, tokens, strictly increasing, at least 2.
        repeats: measurements per point (median taken), >= 1.
        decode_tokens: output tokens per request in the TPOT grid, >= 4 (fewer leave no steady window).
        retries: extra attempts after a failed measurement, >= 0.
        retry_backoff_s: pause before retry k is ``k · retry_backoff_s`` seconds.
        request_timeout_s: limit for one request (TTFT) or one whole batch (TPOT), seconds.
        warmup: unrecorded requests before measuring (first requests pay one-off start-up costs).
        point_timeout_s: wall-clock budget of one point (all its repeats and retries), seconds; None =
            ``(repeats + 1) × request_timeout_s`` (:attr:`point_budget_s`).
        stop_after_timeouts: stop the run after this many points in a row failed by timeout or a refused
            connection (a dead engine; 0 = never).
    """

    isl: tuple[int, ...]
    batch: tuple[int, ...]
    context: tuple[int, ...]
    repeats: int = 3
    decode_tokens: int = 64
    retries: int = 2
    retry_backoff_s: float = 0.5
    request_timeout_s: float = 300.0
    warmup: int = 1
    point_timeout_s: float | None = None
    stop_after_timeouts: int = 3

    def __post_init__(self) -> None:
        for axis in ("isl", "batch", "context"):
            xs = getattr(self, axis)
            if len(xs) < 2:
                raise ProfileError(f"--{axis}: need at least 2 points to interpolate, got {list(xs)}")
            if any(x < 1 for x in xs):
                raise ProfileError(f"--{axis}: every value must be a positive integer, got {list(xs)}")
            if any(b <= a for a, b in zip(xs, xs[1:])):
                raise ProfileError(f"--{axis}: values must be strictly increasing, got {list(xs)}")
        if self.repeats < 1:
            raise ProfileError(f"--repeats must be >= 1, got {self.repeats}")
        if self.decode_tokens < 4:
            raise ProfileError(f"--decode-tokens must be >= 4, got {self.decode_tokens}")
        if self.retries < 0 or self.warmup < 0:
            raise ProfileError("--retries and --warmup must be >= 0")
        if not (self.request_timeout_s > 0 and self.retry_backoff_s >= 0):
            raise ProfileError("--request-timeout-s must be > 0 and --retry-backoff-s >= 0")
        if self.point_timeout_s is not None and not (math.isfinite(self.point_timeout_s) and self.point_timeout_s > 0):
            raise ProfileError(f"--point-timeout-s must be a positive number of seconds, got {self.point_timeout_s}")
        if self.stop_after_timeouts < 0:
            raise ProfileError(f"--stop-after-timeouts must be >= 0, got {self.stop_after_timeouts}")

    @property
    def point_budget_s(self) -> float:
        """Wall-clock budget of one point, seconds: ``point_timeout_s``, else ``(repeats + 1) × request_timeout_s``
        (every repeat may use its whole request timeout once, plus one retry's worth)."""
        if self.point_timeout_s is not None:
            return self.point_timeout_s
        return (self.repeats + 1) * self.request_timeout_s

    def keys(self) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        """Every point of the run in measuring order: (prefill keys ``(isl,)``, decode keys ``(batch, context)``)."""
        return [(i,) for i in self.isl], [(b, c) for b in self.batch for c in self.context]

    @property
    def total_points(self) -> int:
        """Number of measurements (points × repeats) the sweep makes, for the progress bar."""
        return (len(self.isl) + len(self.batch) * len(self.context)) * self.repeats


# --------------------------------------------------------------------------------------------- results
def point_name(kind: str, key: Sequence[int]) -> str:
    """A point as messages name it: ``prefill ISL 128`` (key ``(isl,)``), ``decode batch 8 context 1024`` (key
    ``(batch, context)``); any other key as ``<kind> <values>``."""
    if kind == "prefill" and len(key) == 1:
        return f"prefill ISL {key[0]}"
    if kind == "decode" and len(key) == 2:
        return f"decode batch {key[0]} context {key[1]}"
    return f"{kind} {' '.join(str(k) for k in key)}"


@dataclass(frozen=True)
class PointResult:
    """One measured point.

    Attributes:
        kind: ``"prefill"`` (key = (isl,)) or ``"decode"`` (key = (batch, context)).
        key: the point's coordinates, tokens / requests.
        samples: one latency per successful repeat, seconds (TTFT, or TPOT per token).
        failures: one line per failed attempt (retried ones included).
        dropped: why the point could not be measured at all (None when it was attempted).
        timed_out: no repeat succeeded and the point failed by timeout (its budget spent, or every failed
            attempt a timeout): what a hung engine looks like.
        attempted: False for a point the run never reached (interrupted, or stopped because the engine stopped
            answering; ``dropped`` says which).
    """

    kind: str
    key: tuple[int, ...]
    samples: tuple[float, ...] = ()
    failures: tuple[str, ...] = ()
    dropped: str | None = None
    timed_out: bool = False
    attempted: bool = True

    @property
    def ok(self) -> bool:
        """Whether at least one repeat succeeded."""
        return bool(self.samples)

    @property
    def name(self) -> str:
        """The point as messages name it (:func:`point_name`)."""
        return point_name(self.kind, self.key)

    @property
    def median(self) -> float:
        """Median latency in seconds. Raises ``ValueError`` when no repeat succeeded."""
        if not self.samples:
            raise ValueError(f"{self.name} has no samples")
        return float(statistics.median(self.samples))

    def summary(self) -> dict[str, Any]:
        """Plain mapping: key, samples (ms), median and min/max (ms), failures, dropped reason."""
        out: dict[str, Any] = {"key": list(self.key)}
        if self.samples:
            ms = [s * 1e3 for s in self.samples]
            out.update(medianMs=round(self.median * 1e3, 4), minMs=round(min(ms), 4), maxMs=round(max(ms), 4),
                       samplesMs=[round(v, 4) for v in ms])
        if self.failures:
            out["failures"] = list(self.failures)
        if self.dropped:
            out["dropped"] = self.dropped
        return out


@dataclass(frozen=True)
class EndpointFacts:
    """What the endpoint reports about itself (None where it reports nothing).

    Attributes:
        max_model_len: longest prompt + output, tokens (``/v1/models``, vLLM's extension field).
        block_size: KV block, tokens (``vllm:cache_config_info``).
        num_gpu_blocks: KV blocks per worker (``vllm:cache_config_info``).
        cache_dtype: KV cache dtype label, e.g. ``auto`` or ``fp8``.
        gpu_memory_utilization: fraction of GPU memory vLLM may use.
        kv_cache_memory_bytes: KV cache size per worker when the engine was told one, bytes.
        labels: every ``vllm:cache_config_info`` label as reported.
    """

    max_model_len: int | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    cache_dtype: str | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def kv_capacity_tokens(self) -> int | None:
        """KV capacity of one instance, tokens: ``num_gpu_blocks × block_size`` (None when not reported)."""
        if self.block_size and self.num_gpu_blocks:
            return self.block_size * self.num_gpu_blocks
        return None


@dataclass(frozen=True)
class Measurements:
    """Everything one profiling run measured.

    Attributes:
        tp: tensor-parallel size of the measured engine (a label: ``--tp``).
        prefill: one :class:`PointResult` per requested ISL, in ISL order.
        decode: one :class:`PointResult` per requested (batch, context), row-major.
        endpoint: what the endpoint reported (:class:`EndpointFacts`).
        warnings: lines printed during the run (dropped and failed points).
        decode_tokens: output tokens per request of the TPOT grid.
        stopped: why the run ended before its last point (``interrupted (Ctrl-C)``, ``the engine stopped
            answering ...``); None for a complete run. The points it never reached have ``attempted`` False.
    """

    tp: int
    prefill: tuple[PointResult, ...]
    decode: tuple[PointResult, ...]
    endpoint: EndpointFacts = field(default_factory=EndpointFacts)
    warnings: tuple[str, ...] = ()
    decode_tokens: int = 0
    stopped: str | None = None

    @property
    def unmeasured(self) -> tuple[PointResult, ...]:
        """The points the run never reached (empty for a complete run)."""
        return tuple(p for p in (*self.prefill, *self.decode) if not p.attempted)

    @property
    def not_measured(self) -> tuple[PointResult, ...]:
        """The points with no measured repeat: never reached, abandoned (every attempt failed, or the point's
        budget spent first) or dropped (beyond ``max_model_len``)."""
        return tuple(p for p in (*self.prefill, *self.decode) if not p.ok)


@dataclass
class MeasureLog:
    """What a run has measured so far, filled by :func:`measure` as points finish, so that a run that is
    interrupted (``KeyboardInterrupt`` out of ``asyncio.run``) keeps what it measured.

    Attributes:
        endpoint: what the endpoint reported (None until probed).
        prefill, decode: the finished points, in measuring order.
        warnings: lines printed so far.
        current: the point being measured, with the repeats it has measured so far (None between points).
    """

    endpoint: EndpointFacts | None = None
    prefill: list[PointResult] = field(default_factory=list)
    decode: list[PointResult] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    current: PointResult | None = None

    def measurements(self, tp: int, grid: ProfileGrid, stopped: str | None = None) -> Measurements:
        """The run so far as :class:`Measurements`: every point of ``grid``, those not finished marked not
        measured (``attempted`` False, ``dropped`` = ``not measured: <stopped>``); the point in progress is kept
        when at least one of its repeats was measured. ``stopped``: why the run ended early (None: it did not)."""
        done = {(p.kind, p.key): p for p in (*self.prefill, *self.decode)}
        cur = self.current
        if cur is not None and cur.samples and (cur.kind, cur.key) not in done:
            done[(cur.kind, cur.key)] = replace(
                cur, failures=(*cur.failures, f"run ended ({stopped or 'stopped'}) after {len(cur.samples)} of "
                                              f"{grid.repeats} repeat(s)"))
        why = f"not measured: {stopped or 'run ended early'}"

        def fill(kind: str, keys: list[tuple[int, ...]]) -> tuple[PointResult, ...]:
            return tuple(done.get((kind, k)) or PointResult(kind, k, dropped=why, attempted=False) for k in keys)

        pre, dec = grid.keys()
        return Measurements(tp=tp, prefill=fill("prefill", pre), decode=fill("decode", dec),
                            endpoint=self.endpoint or EndpointFacts(), warnings=tuple(self.warnings),
                            decode_tokens=grid.decode_tokens, stopped=stopped)


@dataclass(frozen=True)
class MemoryFacts:
    """Memory facts of eqs. (11)–(14) as far as they are known (None = unknown).

    Attributes: gpu_type; gpu_memory_gib (GiB per GPU); hbm_bandwidth_gbps (GB/s per GPU); weight_bytes (whole
    model, bytes); kv_bytes_per_token (whole model, all layers, bytes); activation_reserve_gib (GiB per GPU);
    cuda_graph_max_batch (requests).
    """

    gpu_type: str | None = None
    gpu_memory_gib: float | None = None
    hbm_bandwidth_gbps: float | None = None
    weight_bytes: float | None = None
    kv_bytes_per_token: float | None = None
    activation_reserve_gib: float | None = None
    cuda_graph_max_batch: int | None = None


@dataclass(frozen=True)
class ResolvedMemory:
    """Complete memory facts and, per field name, where the value came from (``flag``, ``model dir``, ...)."""

    facts: MemoryFacts
    sources: Mapping[str, str]


@dataclass(frozen=True)
class AssembledProfile:
    """A profile built from measurements, with notes on every adjustment made (dropped rows, raised points)."""

    profile: PerformanceProfile
    notes: tuple[str, ...]


# --------------------------------------------------------------------------------------------- pure: facts
def parse_cache_config_info(metrics_text: str) -> dict[str, str]:
    """Labels of the first ``vllm:cache_config_info`` sample in a Prometheus text exposition ({} if absent).

    Parsed line by line (tolerant of whatever else the exposition holds); values are the raw label strings.
    """
    from prometheus_client.parser import text_string_to_metric_families

    for line in metrics_text.splitlines():
        if not line.startswith("vllm:cache_config_info"):
            continue
        try:
            for family in text_string_to_metric_families(line + "\n"):
                for sample in family.samples:
                    return dict(sample.labels)
        except ValueError:
            continue
    return {}


def _int_or_none(v: Any) -> int | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return int(f) if math.isfinite(f) and f > 0 else None


def _float_or_none(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) and f > 0 else None


def endpoint_facts(models_body: Any, model: str, cache_labels: Mapping[str, str]) -> EndpointFacts:
    """Facts from a ``/v1/models`` body and ``vllm:cache_config_info`` labels.

    Raises:
        ProfileError: the endpoint does not serve ``model`` (the message lists what it serves).
    """
    data = models_body.get("data") if isinstance(models_body, dict) else None
    entries = [e for e in data if isinstance(e, dict)] if isinstance(data, list) else []
    served = [str(e.get("id")) for e in entries]
    entry = next((e for e in entries if e.get("id") == model), None)
    if entry is None:
        raise ProfileError(f"the endpoint does not serve model {model!r} (it serves {served or 'nothing'}); "
                           "pass --model with the served model name")
    return EndpointFacts(
        max_model_len=_int_or_none(entry.get("max_model_len")),
        block_size=_int_or_none(cache_labels.get("block_size")),
        num_gpu_blocks=_int_or_none(cache_labels.get("num_gpu_blocks")),
        cache_dtype=cache_labels.get("cache_dtype"),
        gpu_memory_utilization=_float_or_none(cache_labels.get("gpu_memory_utilization")),
        kv_cache_memory_bytes=_int_or_none(cache_labels.get("kv_cache_memory_bytes")),
        labels=dict(cache_labels),
    )


_DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "half": 2, "bfloat16": 2, "bf16": 2,
                "float8": 1, "fp8": 1, "int8": 1}


def _dtype_bytes(name: str | None) -> int | None:
    if not name:
        return None
    n = name.lower()
    for key, size in _DTYPE_BYTES.items():
        if n.startswith(key):
            return size
    return None


def model_dir_facts(model_dir: Path, cache_dtype: str | None = None) -> tuple[float, float, str]:
    """(weight bytes, KV bytes per token, how) from a local Hugging Face model folder.

    Weights: the total size of ``*.safetensors`` (else ``*.bin``) files. KV bytes per token:
    ``2 (K and V) × num_hidden_layers × num_key_value_heads × head_dim × dtype bytes`` from ``config.json``
    (``head_dim`` defaults to ``hidden_size / num_attention_heads``; dtype: the KV cache dtype when the engine
    reports one other than ``auto``, else the model's ``torch_dtype``/``dtype``).

    Raises:
        ProfileError: no ``config.json``, no weight files, or a config without the attention shape.
    """
    cfg_path = model_dir / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ProfileError(f"--model-path {model_dir}: cannot read config.json: {err}") from err
    cfg = cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg
    files = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    if not files:
        raise ProfileError(f"--model-path {model_dir}: no *.safetensors or *.bin weight files")
    weight_bytes = float(sum(f.stat().st_size for f in files))
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as err:
        raise ProfileError(f"--model-path {model_dir}: config.json lacks the attention shape ({err})") from err
    kv_dtype = cache_dtype if cache_dtype and cache_dtype != "auto" else None
    size = _dtype_bytes(kv_dtype) or _dtype_bytes(str(cfg.get("torch_dtype") or cfg.get("dtype") or "")) or 2
    kv = float(2 * layers * kv_heads * head_dim * size)
    how = f"2 × {layers} layers × {kv_heads} KV heads × {head_dim} head dim × {size} B"
    return weight_bytes, kv, how


def resolve_memory(flags: MemoryFacts, endpoint: EndpointFacts, tp: int,
                   model_dir: tuple[float, float, str] | None = None) -> ResolvedMemory:
    """Decide every memory fact; precedence: flag > model folder > endpoint > default.

    - ``kv_bytes_per_token``: flag; else the model folder's config; else, when the engine reports
      ``kv_cache_memory_bytes`` and its KV capacity, ``kv_cache_memory_bytes × tp / capacity tokens``.
    - ``weight_bytes``: flag; else the model folder's weight files.
    - ``activation_reserve_gib`` (M' of eq. 11): flag; else, when the engine reports its KV capacity C
      (``num_gpu_blocks × block_size``), the M' that makes eq. (11) give C:
      ``M_gpu − (C · M_token + M_model) / (tp · GiB)`` (so the planner sees the engine's real capacity);
      else 4 GiB.
    - ``cuda_graph_max_batch`` (cc_g of eq. 14): flag; else 512 (vLLM's largest default capture size).
    - GPU type, memory and bandwidth: flags only (an HTTP endpoint does not report them; ``--gpu`` presets).

    Raises:
        ProfileError: a fact without which the profile cannot exist is unknown (names the flag to pass).
    """
    src: dict[str, str] = {}
    f = flags
    for name in ("gpu_type", "gpu_memory_gib", "hbm_bandwidth_gbps"):
        if getattr(f, name) is not None:
            src[name] = "flag"
    weight = f.weight_bytes
    kv = f.kv_bytes_per_token
    if weight is not None:
        src["weight_bytes"] = "flag"
    elif model_dir is not None:
        weight, src["weight_bytes"] = model_dir[0], "model dir (weight file sizes)"
    if kv is not None:
        src["kv_bytes_per_token"] = "flag"
    elif model_dir is not None:
        kv, src["kv_bytes_per_token"] = model_dir[1], f"model dir config.json ({model_dir[2]})"
    elif endpoint.kv_cache_memory_bytes and endpoint.kv_capacity_tokens:
        kv = endpoint.kv_cache_memory_bytes * tp / endpoint.kv_capacity_tokens
        src["kv_bytes_per_token"] = "endpoint (kv_cache_memory_bytes × tp / (num_gpu_blocks × block_size))"
    missing = [flag for flag, v in (("--gpu-memory-gib (or --gpu)", f.gpu_memory_gib),
                                    ("--hbm-bandwidth-gbps (or --gpu)", f.hbm_bandwidth_gbps),
                                    ("--weight-gib (or --model-path)", weight),
                                    ("--kv-bytes-per-token (or --model-path)", kv)) if v is None]
    if missing:
        raise ProfileError(f"memory facts unknown: pass {', '.join(missing)}")
    assert f.gpu_memory_gib is not None and weight is not None and kv is not None
    reserve = f.activation_reserve_gib
    if reserve is not None:
        src["activation_reserve_gib"] = "flag"
    else:
        cap = endpoint.kv_capacity_tokens
        calibrated = f.gpu_memory_gib - (cap * kv + weight) / (tp * GiB) if cap else None
        if calibrated is not None and calibrated >= 0:
            reserve = calibrated
            src["activation_reserve_gib"] = (f"calibrated so eq. (11) gives the engine's KV capacity "
                                             f"({cap} tokens = num_gpu_blocks × block_size)")
        else:
            reserve = 4.0
            src["activation_reserve_gib"] = "default 4 GiB" + (
                f" (calibration from the engine's {cap}-token KV capacity gave a negative reserve)" if cap else "")
    cc = f.cuda_graph_max_batch
    src["cuda_graph_max_batch"] = "flag" if cc is not None else "default 512"
    facts = replace(f, weight_bytes=weight, kv_bytes_per_token=kv, activation_reserve_gib=reserve,
                    cuda_graph_max_batch=cc if cc is not None else 512, gpu_type=f.gpu_type or "")
    return ResolvedMemory(facts, src)


# --------------------------------------------------------------------------------------------- pure: assembly
def _envelope(values: list[float]) -> list[float]:
    """Running maximum: the smallest non-decreasing sequence at or above ``values``."""
    out: list[float] = []
    for v in values:
        out.append(max(v, out[-1]) if out else v)
    return out


def _complete_grid(cells: Mapping[tuple[int, int], float], batches: list[int], contexts: list[int],
                   notes: list[str]) -> tuple[list[int], list[int]]:
    """Drop whole batch rows or context columns until every remaining (batch, context) cell is measured.

    Greedy: each step drops the row or column with the largest share of missing cells (ties: the larger
    value, which is the likelier to be unmeasurable). Each drop is noted.
    """
    bs, cs = list(batches), list(contexts)
    while bs and cs:
        miss_b = {b: sum((b, c) not in cells for c in cs) / len(cs) for b in bs}
        miss_c = {c: sum((b, c) not in cells for b in bs) / len(bs) for c in cs}
        worst_b = max(bs, key=lambda b: (miss_b[b], b))
        worst_c = max(cs, key=lambda c: (miss_c[c], c))
        if miss_b[worst_b] == 0 and miss_c[worst_c] == 0:
            break
        if miss_b[worst_b] >= miss_c[worst_c]:
            bs.remove(worst_b)
            notes.append(f"decode: batch {worst_b} dropped ({miss_b[worst_b]:.0%} of its contexts unmeasured)")
        else:
            cs.remove(worst_c)
            notes.append(f"decode: context {worst_c} dropped ({miss_c[worst_c]:.0%} of its batches unmeasured)")
    return bs, cs


def assemble_profile(measured: Measurements, memory: MemoryFacts, *, name: str, model: str,
                     source: str) -> AssembledProfile:
    """Build the profile from measurements (pure).

    Prefill table: the median TTFT of every ISL with at least one successful repeat. Decode table: the median
    TPOT of every measured (batch, context), cut to the largest complete grid (:func:`_complete_grid`). Where
    noise made a latency fall as load grows, the table takes the running maximum (an upper envelope: never
    optimistic), and each raised point is noted with its size. Both tables are filed under ``measured.tp``.

    Raises:
        ProfileError: fewer than 2 usable ISLs, or fewer than 2 batches or 2 contexts in the complete decode
            grid (the message says which points failed and why); or memory facts missing.
    """
    notes: list[str] = []
    pre = [p for p in measured.prefill if p.ok]
    if len(pre) < 2:
        raise ProfileError(f"prefill: only {len(pre)} ISL point(s) measured, need at least 2; "
                           f"{_why(measured.prefill)}")
    isl = [p.key[0] for p in pre]
    ttft = _envelope([p.median for p in pre])
    for p, v in zip(pre, ttft):
        if v > p.median:
            notes.append(f"prefill: ISL {p.key[0]} raised from {p.median * 1e3:.3f} to {v * 1e3:.3f} ms "
                         "(measured faster than a shorter prompt)")
    cells = {(p.key[0], p.key[1]): p.median for p in measured.decode if p.ok}
    batches = sorted({p.key[0] for p in measured.decode})
    contexts = sorted({p.key[1] for p in measured.decode})
    bs, cs = _complete_grid(cells, batches, contexts, notes)
    if len(bs) < 2 or len(cs) < 2:
        raise ProfileError(f"decode: the complete measured grid has {len(bs)} batch(es) × {len(cs)} context(s), "
                           f"need at least 2 × 2; {_why(measured.decode)}")
    grid = [_envelope([cells[(b, c)] for c in cs]) for b in bs]
    for ci in range(len(cs)):
        col = _envelope([row[ci] for row in grid])
        for bi in range(len(bs)):
            grid[bi][ci] = col[bi]
    for bi, b in enumerate(bs):
        for ci, c in enumerate(cs):
            if grid[bi][ci] > cells[(b, c)]:
                notes.append(f"decode: batch {b} context {c} raised from {cells[(b, c)] * 1e3:.3f} to "
                             f"{grid[bi][ci] * 1e3:.3f} ms (measured faster than a lighter load)")
    m = memory
    if None in (m.gpu_memory_gib, m.hbm_bandwidth_gbps, m.weight_bytes, m.kv_bytes_per_token,
                m.activation_reserve_gib, m.cuda_graph_max_batch):
        raise ProfileError("memory facts incomplete; resolve them with resolve_memory first")
    tp = measured.tp
    profile = PerformanceProfile(
        name=name, model=model, gpu_type=m.gpu_type or "",
        gpu_memory_gib=float(m.gpu_memory_gib or 0), hbm_bandwidth_gbps=float(m.hbm_bandwidth_gbps or 0),
        weight_bytes=float(m.weight_bytes or 0), kv_bytes_per_token=float(m.kv_bytes_per_token or 0),
        activation_reserve_gib=float(m.activation_reserve_gib or 0), cuda_graph_max_batch=int(m.cuda_graph_max_batch or 0),
        prefill={tp: PrefillTable(tuple(float(x) for x in isl), tuple(ttft))},
        decode={tp: DecodeTable(tuple(float(b) for b in bs), tuple(float(c) for c in cs),
                                tuple(tuple(r) for r in grid))},
        source=source,
    )
    return AssembledProfile(profile, tuple(notes))


def _why(points: Sequence[PointResult]) -> str:
    bad = [p for p in points if not p.ok]
    if not bad:
        return "no points requested"
    parts = []
    for p in bad[:4]:
        reason = p.dropped or (p.failures[-1] if p.failures else "no result")
        parts.append(f"{p.name}: {reason}")
    more = f" (+{len(bad) - 4} more)" if len(bad) > 4 else ""
    return "failed: " + "; ".join(parts) + more


# --------------------------------------------------------------------------------------------- rendering
def profile_document(assembled: AssembledProfile, measured: Measurements, memory: ResolvedMemory,
                     url: str) -> dict[str, Any]:
    """The YAML mapping: ``PerformanceProfile.to_dict()`` plus a ``measurement`` section (ignored by the loader)
    holding the endpoint, the endpoint's reported facts, where each memory fact came from, every point's
    samples/median/min/max (ms) and failures, and the notes of :func:`assemble_profile`."""
    doc: dict[str, Any] = assembled.profile.to_dict()
    for table, key in (("prefill", "ttftMs"), ("decode", "tpotMs")):
        for entry in doc[table]:
            entry[key] = _sig(entry[key])
    e = measured.endpoint
    doc["measurement"] = {
        "tool": "fulcrum profile",
        "url": url,
        "tp": measured.tp,
        "decodeTokens": measured.decode_tokens,
        "endpoint": {k: v for k, v in (("maxModelLen", e.max_model_len), ("blockSize", e.block_size),
                                       ("numGpuBlocks", e.num_gpu_blocks), ("cacheDtype", e.cache_dtype),
                                       ("kvCapacityTokens", e.kv_capacity_tokens)) if v is not None},
        "memorySources": dict(memory.sources),
        "prefill": [p.summary() for p in measured.prefill],
        "decode": [p.summary() for p in measured.decode],
        "notes": list(assembled.notes),
        "warnings": list(measured.warnings),
    }
    if measured.stopped:
        # a run that ended early: marked here (the loader ignores this section) and in ``source`` (which it keeps)
        doc["measurement"]["partial"] = True
        doc["measurement"]["stopped"] = measured.stopped
        doc["measurement"]["notMeasured"] = {  # never reached, and reached but abandoned or dropped
            kind: [list(p.key) for p in points if not p.ok]
            for kind, points in (("prefill", measured.prefill), ("decode", measured.decode))
        }
    return doc


def partial_line(stopped: str | None, total: int, what: str, missing: Sequence[str], shown: int) -> str:
    """``PARTIAL: <stopped>; <n> of <total> <what> measured, not measured: <the first shown of missing> (+k more)``:
    the one line that marks a partial profile (:func:`partial_note`) or step table
    (:meth:`fulcrum.worker.step_profiler.StepLog.partial_note`). ``missing``: the names of the items not measured."""
    names = ", ".join(missing[:shown]) + (f" (+{len(missing) - shown} more)" if len(missing) > shown else "")
    return (f"PARTIAL: {stopped}; {total - len(missing)} of {total} {what} measured"
            + (f", not measured: {names}" if missing else ""))


def partial_note(measured: Measurements) -> str:
    """One line saying that a run ended early, why, and which points it did not measure (never reached, or
    reached but abandoned or dropped: ``measurement.notMeasured``); "" for a complete run."""
    if not measured.stopped:
        return ""
    return partial_line(measured.stopped, len(measured.prefill) + len(measured.decode), "points",
                        [p.name for p in measured.not_measured], 6)


def _sig(v: Any) -> Any:
    """Round to 6 significant digits (monotone, so a non-decreasing table stays non-decreasing), recursively."""
    if isinstance(v, list):
        return [_sig(x) for x in v]
    return float(f"{v:.6g}")


class _Dumper(yaml.SafeDumper):
    """Safe dumper writing multi-line strings as literal blocks (a readable ``profile.yaml`` in a ConfigMap)."""


def _str_presenter(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str_presenter)


def dump_yaml(obj: Any) -> str:
    """YAML text of ``obj`` (keys in insertion order; multi-line strings as literal blocks)."""
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, default_flow_style=None, width=120, allow_unicode=True)


def render_profile_yaml(doc: Mapping[str, Any]) -> str:
    """YAML text of a profile document (keys in the document's order)."""
    return dump_yaml(dict(doc))


def render_configmap(profile_yaml: str, name: str, namespace: str | None = None,
                     labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A ``v1`` ConfigMap holding ``profile_yaml`` under key ``profile.yaml`` (what
    ``LLMServe.spec.profile.configMap`` refers to).

    Raises:
        ProfileError: ``name`` is not a valid Kubernetes object name (RFC 1123 subdomain).
    """
    import re

    if not (len(name) <= 253 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", name)):
        raise ProfileError(f"--configmap {name!r} is not a valid Kubernetes name (lower-case letters, digits, '-', '.')")
    meta: dict[str, Any] = {"name": name,
                            "labels": {"app.kubernetes.io/name": "fulcrum", "fulcrum.dev/profile": "true", **(labels or {})}}
    if namespace:
        meta["namespace"] = namespace
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"profile.yaml": profile_yaml}}


# --------------------------------------------------------------------------------------------- measurement
class _Unmeasurable(Exception):
    """The point cannot be run on this engine at all (context too long): drop it, do not retry."""


class _Failed(Exception):
    """One attempt failed (HTTP error, timeout, broken stream): retry. ``timeout``: the engine did not answer (a
    timeout, or a refused connection: a dead engine), which counts toward ``--stop-after-timeouts``."""

    def __init__(self, msg: str, *, timeout: bool = False) -> None:
        super().__init__(msg)
        self.timeout = timeout


def _unanswered(err: BaseException) -> bool:
    """Whether an attempt's error means the engine did not answer: a timeout, or no connection at all (refused,
    reset before an answer: an engine that died), as opposed to an answer that was wrong (HTTP error, bad JSON)."""
    return isinstance(err, (asyncio.TimeoutError, aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError))


def _is_context_error(status: int, text: str) -> bool:
    low = text.lower()
    return status == 400 and any(w in low for w in _CONTEXT_WORDS)


class _Client:
    """The HTTP side of one run: prompts from ``/tokenize``, streamed completions with chunk timestamps."""

    def __init__(self, session: aiohttp.ClientSession, url: str, model: str, timeout_s: float) -> None:
        self.session = session
        self.url = url.rstrip("/")
        self.model = model
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.filler: list[int] = []
        self.counter = 0

    async def _tokenize(self, text: str, special: bool) -> list[int]:
        body = {"model": self.model, "prompt": text, "add_special_tokens": special}
        try:
            async with self.session.post(self.url + "/tokenize", json=body, timeout=self.timeout) as resp:
                raw = await resp.text()
                if resp.status != 200:
                    raise _Failed(f"/tokenize answered {resp.status}: {raw[:200]}")
                ids = json.loads(raw).get("tokens")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError) as err:
            raise _Failed(f"/tokenize failed: {type(err).__name__}: {err}",
                          timeout=_unanswered(err)) from err
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise _Failed("/tokenize answered without a token list")
        return ids

    async def prompt(self, n: int) -> list[int]:
        """Exactly ``n`` token ids: a numbered prefix (unique per call, so no prefix-cache hit) + tiled filler."""
        if not self.filler:
            self.filler = await self._tokenize(FILLER_TEXT, special=False)
            if not self.filler:
                raise _Failed("/tokenize gave no tokens for the filler text")
        self.counter += 1
        ids = await self._tokenize(f"Request {self.counter} of the profiling run. ", special=True)
        while len(ids) < n:
            ids += self.filler
        return ids[:n]

    async def itl_totals(self) -> tuple[float, float] | None:
        """(sum s, count) of the engine's inter-token-latency histogram from ``/metrics``, or None.

        vLLM's ``vllm:inter_token_latency_seconds`` (older releases: ``vllm:time_per_output_token_seconds``),
        summed over label sets. None when the endpoint has no such metric or ``/metrics`` fails.
        """
        try:
            async with self.session.get(self.url + "/metrics", timeout=self.timeout) as resp:
                if resp.status != 200:
                    return None
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None
        for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
            total = count = 0.0
            found = False
            for line in text.splitlines():
                for suffix, is_sum in (("_sum", True), ("_count", False)):
                    if line.startswith(name + suffix + "{") or line.startswith(name + suffix + " "):
                        try:
                            v = float(line.rsplit(" ", 1)[1])
                        except (IndexError, ValueError):
                            continue
                        found = True
                        if is_sum:
                            total += v
                        else:
                            count += v
            if found:
                return total, count
        return None

    async def stream(self, prompt: list[int], max_tokens: int,
                     on_first: Callable[[], None] | None = None) -> list[tuple[float, int]]:
        """Send one streamed completion; returns (monotonic time, tokens so far) per chunk carrying text.
        ``on_first`` is called once, when the first token arrives.

        Raises:
            _Unmeasurable: a 400 about the context length.
            _Failed: any other HTTP status, a broken stream, a timeout, fewer tokens than asked for, a chunk that
                is not a completion object, or a ``usage.completion_tokens`` above ``max_tokens`` (a count that
                would shrink the measured time per token).
        """
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                "temperature": 0, "ignore_eos": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        marks: list[tuple[float, int]] = []
        try:
            async with self.session.post(self.url + "/v1/completions", json=body, timeout=self.timeout) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    if _is_context_error(resp.status, text):
                        raise _Unmeasurable(f"engine refused: {text[:200]}")
                    raise _Failed(f"HTTP {resp.status}: {text[:200]}")
                n = 0
                async for raw in resp.content:
                    line = raw.decode(errors="replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if not isinstance(event, dict):
                        raise _Failed(f"stream chunk is not a JSON object: {data[:200]}")
                    choices = event.get("choices") or []
                    if not choices:
                        continue
                    if not isinstance(choices[0], dict):
                        raise _Failed(f"stream chunk's choices[0] is not a JSON object: {data[:200]}")
                    usage = event.get("usage") or {}
                    got = usage.get("completion_tokens") if isinstance(usage, dict) else None
                    text_piece = choices[0].get("text")
                    if isinstance(got, int) and got > max_tokens:
                        raise _Failed(f"usage.completion_tokens {got} exceeds max_tokens {max_tokens}")
                    if isinstance(got, int) and got > n:
                        n = got
                    elif text_piece or choices[0].get("token_ids"):
                        n += 1
                    else:
                        continue  # a final chunk with the finish reason only
                    marks.append((time.monotonic(), n))
                    if on_first is not None and len(marks) == 1:
                        on_first()
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
            raise _Failed(f"{type(err).__name__}: {err}", timeout=_unanswered(err)) from err
        if not marks or marks[-1][1] < max_tokens:
            raise _Failed(f"stream ended after {marks[-1][1] if marks else 0} of {max_tokens} tokens")
        return marks


async def probe_endpoint(session: aiohttp.ClientSession, url: str, model: str, timeout_s: float = 30.0) -> EndpointFacts:
    """Read ``/v1/models`` (required) and ``/metrics`` (optional) of the endpoint.

    Raises:
        ProfileError: the endpoint cannot be reached, does not answer ``/v1/models`` within ``timeout_s``
            (seconds), answers it with an error or non-JSON, or does not serve ``model``.
    """
    _need_aiohttp()
    base = url.rstrip("/")
    t = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.get(base + "/v1/models", timeout=t) as resp:
            status = resp.status
            body = await resp.text()
    except asyncio.TimeoutError as err:
        raise ProfileError(f"{base}/v1/models did not answer within {timeout_s:g} s") from err
    except aiohttp.ClientError as err:
        raise ProfileError(f"cannot reach {base}: {type(err).__name__}: {err}") from err
    if status != 200:
        raise ProfileError(f"{base}/v1/models answered HTTP {status}: {body[:200]}")
    try:
        models = json.loads(body)
    except ValueError as err:
        raise ProfileError(f"{base}/v1/models answered non-JSON (is this an OpenAI-compatible engine?): "
                           f"{body[:200]!r}") from err
    labels: dict[str, str] = {}
    try:
        async with session.get(base + "/metrics", timeout=t) as resp:
            if resp.status == 200:
                labels = parse_cache_config_info(await resp.text())
    except (aiohttp.ClientError, asyncio.TimeoutError):
        labels = {}
    return endpoint_facts(models, model, labels)


def steady_tpot(streams: Sequence[Sequence[tuple[float, int]]]) -> float:
    """Decode time per token (seconds) of a batch of streams in their steady window (pure).

    The window runs from the last first-token time to the first last-token time, when every request of the
    batch is decoding. Per stream: (time of its last chunk in the window − time of its first chunk in the
    window) / (tokens between them); the median over the streams is returned. A slope over the window rather
    than single gaps, because a server may deliver several chunks at once (seen with vLLM's CPU engine, whose
    API process forwards a tiny model's tokens in bursts: single gaps then read ~0). A stream with fewer than
    two chunks in the window uses its whole span from first to last chunk instead.

    Raises:
        ValueError: no stream spans two tokens.
    """
    start = max(s[0][0] for s in streams)
    end = min(s[-1][0] for s in streams)
    slopes: list[float] = []
    for s in streams:
        inside = [m for m in s if start <= m[0] <= end]
        a, b = (inside[0], inside[-1]) if len(inside) >= 2 and inside[-1][1] > inside[0][1] else (s[0], s[-1])
        if b[1] > a[1]:
            slopes.append((b[0] - a[0]) / (b[1] - a[1]))
    if not slopes:
        raise ValueError("no stream spans two tokens")
    return max(float(statistics.median(slopes)), 1e-9)


async def measure(url: str, model: str, tp: int, grid: ProfileGrid, *, progress: bool = True,
                  warn: Callable[[str], None] | None = None,
                  session: aiohttp.ClientSession | None = None, log: MeasureLog | None = None) -> Measurements:
    """Run the TTFT sweep and the TPOT grid against the endpoint (see the module doc for the method).

    Returns every point, measured or not; never raises for a failed point. Each point has
    ``grid.point_budget_s`` seconds of wall clock; after ``grid.stop_after_timeouts`` points in a row failed by
    timeout the run stops early (``Measurements.stopped`` says so; the points left are not measured). Pass
    ``log`` (a fresh :class:`MeasureLog`) to keep what was measured when the run is interrupted (the caller
    then calls ``log.measurements(tp, grid, stopped=...)``).

    Raises:
        ProfileError: the endpoint cannot be reached or does not serve ``model`` (from :func:`probe_endpoint`),
            or ``/tokenize`` fails on the warm-up (no prompts can be built).
    """
    _need_aiohttp()
    from tqdm import tqdm

    from fulcrum.cancellation import cancel_and_wait, within

    log = log if log is not None else MeasureLog()

    def say(msg: str) -> None:
        log.warnings.append(msg)
        if warn is not None:
            warn(msg)

    own = session is None
    sess = session or aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    bar = None
    try:
        endpoint = await probe_endpoint(sess, url, model, min(30.0, grid.request_timeout_s))
        log.endpoint = endpoint
        client = _Client(sess, url, model, grid.request_timeout_s)
        limit = endpoint.max_model_len
        for attempt in range(grid.retries + 1):
            try:
                await client.prompt(1)
                break
            except _Failed as err:
                if attempt == grid.retries:
                    raise ProfileError(f"cannot build prompts of exact length: {err} "
                                       "(fulcrum profile needs the engine's /tokenize endpoint)") from err
                await asyncio.sleep(grid.retry_backoff_s * (attempt + 1))
        try:
            for _ in range(grid.warmup):
                await client.stream(await client.prompt(min(grid.isl[0], limit - 4 if limit else grid.isl[0])), 4)
        except _Failed as err:
            say(f"warm-up request failed: {err}")
        except _Unmeasurable as err:
            say(f"warm-up request refused: {err}")
        bar = tqdm(total=grid.total_points, desc="profiling", unit="pt", disable=not progress, leave=False)
        budget = grid.point_budget_s

        async def point(kind: str, key: tuple[int, ...], need: int, once: Callable[[], Any]) -> PointResult:
            if limit is not None and need > limit:
                bar.update(grid.repeats)
                msg = f"{point_name(kind, key)}: needs {need} tokens > max_model_len {limit}; dropped"
                say(msg)
                return PointResult(kind, key, dropped=msg)
            samples: list[float] = []
            failures: list[str] = []
            failed = unanswered = done = 0  # failed attempts, those the engine did not answer, repeats finished

            def note() -> None:  # the point so far, for an interrupted run
                log.current = PointResult(kind, key, tuple(samples), tuple(failures))

            async def repeats() -> PointResult | None:
                nonlocal failed, unanswered, done
                for rep in range(grid.repeats):
                    for attempt in range(grid.retries + 1):
                        if attempt:
                            await asyncio.sleep(grid.retry_backoff_s * attempt)
                        try:
                            samples.append(await once())
                            break
                        except _Unmeasurable as err:
                            say(f"{point_name(kind, key)}: {err}; dropped")
                            return PointResult(kind, key, tuple(samples), tuple(failures), dropped=str(err))
                        except _Failed as err:
                            failures.append(f"attempt {attempt + 1}: {err}")
                            failed += 1
                            unanswered += err.timeout
                        finally:
                            note()
                    else:
                        failures.append(f"repeat {rep + 1}: gave up after {grid.retries + 1} attempts")
                    done += 1
                    bar.update(1)
                return None

            note()
            # the budget runs in its own task, stopped for sure (within) when spent or when this one is
            # cancelled (Ctrl-C): a hung engine costs a point at most ``budget`` seconds
            task = await within(repeats(), budget)
            bar.update(grid.repeats - done)
            if task is not None:
                dropped = task.result()
                if dropped is not None:
                    return dropped
                expired = False
            else:
                expired = True
                failures.append(f"point budget of {budget:g} s spent (--point-timeout-s) after {done} of "
                                f"{grid.repeats} repeat(s); abandoned")
            timed_out = not samples and (expired or 0 < failed == unanswered)
            if not samples:
                last = failures[-1] if expired or len(failures) < 2 else failures[-2]
                say(f"{point_name(kind, key)}: every repeat failed ({last}); skipped")
            elif expired:
                say(f"{point_name(kind, key)}: {failures[-1]}; {len(samples)}/{grid.repeats} repeats measured")
            elif failures:
                say(f"{point_name(kind, key)}: {len(failures)} failed attempt(s), {len(samples)}/{grid.repeats} repeats measured")
            return PointResult(kind, key, tuple(samples), tuple(failures), timed_out=timed_out)

        async def ttft_once(isl: int) -> float:
            prompt = await client.prompt(isl)
            t0 = time.monotonic()
            marks = await client.stream(prompt, 1)
            return max(marks[0][0] - t0, 1e-9)

        async def tpot_once(batch: int, context: int) -> float:
            plen = max(1, context - grid.decode_tokens // 2)
            prompts = [await client.prompt(plen) for _ in range(batch)]
            before = await client.itl_totals()
            started = 0
            all_started = asyncio.Event()

            def first() -> None:
                nonlocal started
                started += 1
                if started == batch:
                    all_started.set()

            tasks = [asyncio.create_task(client.stream(p, grid.decode_tokens, first)) for p in prompts]
            waiter = asyncio.create_task(all_started.wait())
            try:
                # the steady window: every request decoding (the last prefill done) until the first one finishes,
                # so the batch's own prefills do not inflate its decode steps
                await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
                steady_from = steady_to = None
                if all_started.is_set() and not any(t.done() for t in tasks):
                    steady_from = await client.itl_totals()
                    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                    steady_to = await client.itl_totals()
                waiter.cancel()
                results = await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                # a spent point budget or Ctrl-C: no request of this batch outlives it (it would load the next point)
                await cancel_and_wait([waiter, *tasks])
            for r in results:
                if isinstance(r, _Unmeasurable):
                    raise r
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise _Failed(f"{len(errors)} of {batch} requests failed: {errors[0]}",
                              timeout=all(isinstance(e, _Failed) and e.timeout for e in errors))
            after = await client.itl_totals()
            # the engine's own inter-token histogram: engine-side timestamps, immune to bursty delivery; its steady
            # window when the window saw at least one step of the whole batch, else the whole run
            # (a sum that did not grow, or is not finite, is a broken or reset histogram: the client's timing is used)
            for lo, hi in ((steady_from, steady_to), (before, after)):
                if lo is not None and hi is not None and hi[1] - lo[1] >= batch:
                    per_token = (hi[0] - lo[0]) / (hi[1] - lo[1])
                    if math.isfinite(per_token) and per_token > 0:
                        return per_token
            return steady_tpot([r for r in results if not isinstance(r, BaseException)])

        in_a_row = 0
        stopped: str | None = None

        async def run_point(kind: str, key: tuple[int, ...], need: int, once: Callable[[], Any]) -> bool:
            """Measure one point into the log; False when the run must stop (the engine stopped answering)."""
            nonlocal in_a_row, stopped
            result = await point(kind, key, need, once)
            (log.prefill if kind == "prefill" else log.decode).append(result)
            log.current = None
            if result.timed_out:
                in_a_row += 1
            elif not (limit is not None and need > limit):
                in_a_row = 0  # the engine answered (a point dropped before sending anything tells nothing)
            if grid.stop_after_timeouts and in_a_row >= grid.stop_after_timeouts:
                stopped = (f"the engine stopped answering ({in_a_row} points in a row failed by timeout or a refused "
                           f"connection, the last {point_name(kind, key)})")
                say(f"{stopped}; stopping")
                return False
            return True

        async def sweep() -> None:
            for isl in grid.isl:
                if not await run_point("prefill", (isl,), isl + 1, functools.partial(ttft_once, isl)):
                    return
            for b in grid.batch:
                for c in grid.context:
                    need = max(1, c - grid.decode_tokens // 2) + grid.decode_tokens
                    if not await run_point("decode", (b, c), need, functools.partial(tpot_once, b, c)):
                        return

        await sweep()
        return log.measurements(tp, grid, stopped)
    finally:
        if bar is not None:
            bar.close()
        if own:
            await sess.close()
