"""Performance profiles: measured TTFT(ISL, TP) and TPOT(batch, context, TP) tables of one model on one GPU.

Every latency the planner and the simulator need comes from a :class:`PerformanceProfile` (DESIGN,
principle 4; DOPD §V-D "Initialize INTERP" in Alg. 2). A profile holds, per tensor-parallel size:

- a **prefill table**: ISL (tokens) → single-request prefill latency (seconds, batch of one);
- a **decode table**: a grid batch (concurrent requests) × context length (tokens) → time of one decode
  step for the whole batch (seconds; the TPOT every request in the batch sees);

plus the memory facts of eqs. (11)–(14): weight bytes, KV bytes per token, activation reserve M', GPU
memory and HBM bandwidth, and the engine's CUDA-graph batch cap cc_g.

Interpolation and extrapolation (documented contract):

- prefill inside the table: piecewise-linear in ISL. Outside it: the table's end value plus the change
  of a non-negative least-squares fit ``T(x) = τ + κ1·x + κ2·x²`` (DOPD eqs. 2–5: linear projections
  plus quadratic attention), so the curve stays continuous and grows quadratically for long prompts.
- decode inside the grid: bilinear in (batch, context). Outside it: linear extrapolation along each axis
  through the two nearest grid lines, floored at the nearest measured value scaled down no further than
  the table's own minimum (decode never gets faster than the fastest measured step).
- TP not in the profile: :class:`~fulcrum.errors.ProfileError`. The planner only chooses measured TPs.

Batched prefill (DOPD Alg. 1 groups short prompts): a batch of prompts costs the prefill time of its
total tokens minus the attention cross-terms that separate sequences do not compute,
``T(Σx) − κ2·((Σx)² − Σx²)``, and never less than its longest member alone.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from scipy.optimize import nnls

from fulcrum.csv_records import CsvRecords
from fulcrum.errors import ProfileError, as_float, clipped, number_problem, safe_yaml, yaml_problem
from fulcrum.target import ClusterTarget

__all__ = ["PrefillTable", "DecodeTable", "PerformanceProfile", "load_profile", "profile_from_dict",
           "recompute_tokens_per_s"]

GiB = float(1 << 30)


def _check_increasing(name: str, xs: Sequence[float]) -> None:
    """An axis (ISL, batch or context): at least one point, every point > 0 (no prompt, batch or context of 0 or
    fewer tokens or requests), strictly increasing."""
    if len(xs) == 0:
        raise ProfileError(f"{name}: no points")
    for x in xs:
        if not x > 0:
            raise ProfileError(f"{name}: every point must be > 0, got {x:g}")
    for a, b in zip(xs, xs[1:]):
        if not b > a:
            raise ProfileError(f"{name}: axis must be strictly increasing, got {a} then {b}")


def _check_finite_positive(name: str, values: Sequence[float]) -> None:
    for v in values:
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ProfileError(f"{name}: every latency must be a finite positive number, got {v!r}")


def _check_non_decreasing(name: str, xs: Sequence[float], ys: Sequence[float]) -> None:
    for i in range(1, len(ys)):
        if ys[i] < ys[i - 1] * (1 - 1e-9):
            raise ProfileError(
                f"{name}: latency must not decrease as load grows, but {xs[i - 1]} → {ys[i - 1]:.6g} s "
                f"and {xs[i]} → {ys[i]:.6g} s"
            )


@dataclass(frozen=True)
class PrefillTable:
    """Prefill latency of one request vs its ISL, at one TP.

    Attributes:
        isl: prompt lengths in tokens, strictly increasing, shape (n,), n >= 1.
        seconds: prefill latency in seconds (batch of one), non-decreasing, shape (n,).
    """

    isl: tuple[float, ...]
    seconds: tuple[float, ...]
    _fit: tuple[float, float, float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.isl) != len(self.seconds):
            raise ProfileError(f"prefill table: {len(self.isl)} ISL points but {len(self.seconds)} latencies")
        _check_increasing("prefill table ISL", self.isl)
        _check_finite_positive("prefill table", self.seconds)
        _check_non_decreasing("prefill table", self.isl, self.seconds)
        object.__setattr__(self, "_fit", self._fit_quadratic())

    def _fit_quadratic(self) -> tuple[float, float, float]:
        x = np.asarray(self.isl, dtype=float)
        y = np.asarray(self.seconds, dtype=float)
        if len(x) == 1:
            return (0.0, y[0] / x[0], 0.0)
        a = np.column_stack([np.ones_like(x), x, x * x])
        coef, _ = nnls(a, y)
        tau, k1, k2 = (float(c) for c in coef)
        if k1 == 0.0 and k2 == 0.0:  # flat table: keep a linear slope so longer prompts never get cheaper
            k1 = max(y[-1] - y[0], 0.0) / max(x[-1] - x[0], 1.0)
        return (tau, k1, k2)

    @property
    def quadratic(self) -> tuple[float, float, float]:
        """(τ s, κ1 s/token, κ2 s/token²) of the NNLS fit ``τ + κ1·x + κ2·x²`` (DOPD eq. 5)."""
        return self._fit

    def _q(self, x: float) -> float:
        tau, k1, k2 = self._fit
        return tau + k1 * x + k2 * x * x

    def __call__(self, isl: float) -> float:
        """Prefill latency in seconds of one prompt of ``isl`` tokens (see module doc for extrapolation)."""
        x = max(float(isl), 0.0)
        xs, ys = self.isl, self.seconds
        if x >= xs[-1]:
            return ys[-1] + (self._q(x) - self._q(xs[-1]))
        if x <= xs[0]:
            return max(ys[0] + (self._q(x) - self._q(xs[0])), ys[0] * 0.05, 1e-6)
        j = bisect.bisect_right(xs, x)
        x0, x1, y0, y1 = xs[j - 1], xs[j], ys[j - 1], ys[j]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    def batch(self, isls: Sequence[float]) -> float:
        """Latency in seconds of one prefill batch holding prompts of the given lengths (tokens)."""
        if not isls:
            return 0.0
        total = float(sum(isls))
        k2 = self._fit[2]
        cross = k2 * (total * total - sum(float(x) * float(x) for x in isls))
        return max(self(total) - cross, max(self(x) for x in isls))


@dataclass(frozen=True)
class DecodeTable:
    """Decode step latency vs (batch, context length), at one TP.

    Attributes:
        batch: concurrent requests in the step, strictly increasing, shape (nb,).
        context: mean context length in tokens (prompt + generated so far), strictly increasing, shape (nc,).
        seconds: step latency in seconds, shape (nb, nc) as nested tuples, non-decreasing along both axes.
    """

    batch: tuple[float, ...]
    context: tuple[float, ...]
    seconds: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        _check_increasing("decode table batch", self.batch)
        _check_increasing("decode table context", self.context)
        if len(self.seconds) != len(self.batch) or any(len(r) != len(self.context) for r in self.seconds):
            raise ProfileError(
                f"decode table: expected {len(self.batch)}×{len(self.context)} latencies (batch × context), "
                f"got {len(self.seconds)} rows of {[len(r) for r in self.seconds]}"
            )
        for bi, row in enumerate(self.seconds):
            _check_finite_positive("decode table", row)
            _check_non_decreasing(f"decode table at batch {self.batch[bi]}", self.context, row)
        for ci in range(len(self.context)):
            col = [row[ci] for row in self.seconds]
            _check_non_decreasing(f"decode table at context {self.context[ci]}", self.batch, col)

    @staticmethod
    def _axis(xs: Sequence[float], x: float) -> tuple[int, int, float]:
        """Indices (i0, i1) and weight w so that value = (1-w)·v[i0] + w·v[i1] (w may leave [0,1] above)."""
        n = len(xs)
        if n == 1:
            return 0, 0, 0.0
        if x <= xs[0]:
            return 0, 0, 0.0  # below the table: the first measured line (conservative)
        if x >= xs[-1]:
            i0, i1 = n - 2, n - 1  # above: linear extrapolation through the last two lines
        else:
            i1 = bisect.bisect_right(xs, x)
            i0 = i1 - 1
        return i0, i1, (x - xs[i0]) / (xs[i1] - xs[i0])

    def __call__(self, batch: float, context: float) -> float:
        """Time in seconds of one decode step of ``batch`` requests at mean ``context`` tokens."""
        b = max(float(batch), 1.0)
        c = max(float(context), 1.0)
        b0, b1, wb = self._axis(self.batch, b)
        c0, c1, wc = self._axis(self.context, c)
        s = self.seconds

        def at(bi: int) -> float:
            return (1 - wc) * s[bi][c0] + wc * s[bi][c1]

        value = (1 - wb) * at(b0) + wb * at(b1)
        return max(value, s[0][0])


@dataclass(frozen=True)
class PerformanceProfile:
    """Measured performance of one model on one GPU type, per tensor-parallel size.

    Attributes:
        name: profile id, e.g. ``dopd-llama70b-fp8-h100``.
        model: model name.
        gpu_type: GPU type, e.g. ``H100``.
        gpu_memory_gib: memory per GPU, GiB (M_gpu of eq. 11).
        hbm_bandwidth_gbps: HBM bandwidth per GPU, GB/s (BW of eq. 12).
        weight_bytes: model weights, bytes, whole model (M_model of eq. 11).
        kv_bytes_per_token: KV cache bytes per token, whole model across all layers (M_token of eq. 13).
        activation_reserve_gib: per-GPU reserve for activations, CUDA graphs and runtime, GiB (M' of eq. 11).
        cuda_graph_max_batch: largest decode batch the engine captures, cc_g of eq. 14.
        prefill: TP → :class:`PrefillTable`.
        decode: TP → :class:`DecodeTable`.
        source: where the numbers come from (paper table, data file, profiling run).
    """

    name: str
    model: str
    gpu_type: str
    gpu_memory_gib: float
    hbm_bandwidth_gbps: float
    weight_bytes: float
    kv_bytes_per_token: float
    activation_reserve_gib: float
    cuda_graph_max_batch: int
    prefill: dict[int, PrefillTable]
    decode: dict[int, DecodeTable]
    source: str = ""

    def __post_init__(self) -> None:
        for attr in ("gpu_memory_gib", "hbm_bandwidth_gbps", "weight_bytes", "kv_bytes_per_token"):
            v = getattr(self, attr)
            if not (math.isfinite(v) and v > 0):
                raise ProfileError(f"profile {self.name!r}: {attr} must be a finite positive number, got {v!r}")
        if not (math.isfinite(self.activation_reserve_gib) and self.activation_reserve_gib >= 0):
            raise ProfileError(f"profile {self.name!r}: activation_reserve_gib must be >= 0")
        if self.cuda_graph_max_batch < 1:
            raise ProfileError(f"profile {self.name!r}: cuda_graph_max_batch must be >= 1")
        if not self.prefill:
            raise ProfileError(f"profile {self.name!r}: no prefill table")
        if not self.decode:
            raise ProfileError(f"profile {self.name!r}: no decode table")

    @property
    def prefill_tps(self) -> tuple[int, ...]:
        """Tensor-parallel sizes with a prefill table, ascending."""
        return tuple(sorted(self.prefill))

    @property
    def decode_tps(self) -> tuple[int, ...]:
        """Tensor-parallel sizes with a decode table, ascending."""
        return tuple(sorted(self.decode))

    def _prefill_table(self, tp: int) -> PrefillTable:
        try:
            return self.prefill[tp]
        except KeyError:
            raise ProfileError(f"profile {self.name!r} has no prefill table for TP={tp} (has {self.prefill_tps})") from None

    def _decode_table(self, tp: int) -> DecodeTable:
        try:
            return self.decode[tp]
        except KeyError:
            raise ProfileError(f"profile {self.name!r} has no decode table for TP={tp} (has {self.decode_tps})") from None

    def ttft(self, isl: float, tp: int) -> float:
        """Prefill latency (s) of one prompt of ``isl`` tokens on a TP-``tp`` instance: TTFT without queueing."""
        return self._prefill_table(tp)(isl)

    def prefill_tokens_per_s(self, tp: int, tokens: int = 2048) -> float:
        """Prefill throughput of a TP-``tp`` instance, tokens/s: ``tokens`` over the TTFT of a prompt that long
        (what recomputing a prefix or a migrated context costs per token). A TP without a prefill table borrows
        the nearest measured one (ties: the smaller, slower one), as the simulator times the prefill of a
        decode-capable instance (:func:`~fulcrum.ratio.step_cost.nearest_tp`).

        Raises:
            ProfileError: the profile has no prefill table at all.
        """
        from fulcrum.ratio.step_cost import nearest_tp  # step_cost imports this module for its annotations only

        return tokens / max(self.ttft(tokens, nearest_tp(self.prefill_tps, tp)), 1e-6)

    def prefill_batch_time(self, isls: Sequence[float], tp: int) -> float:
        """Latency (s) of one prefill batch of prompts with these lengths (tokens) on TP ``tp``."""
        return self._prefill_table(tp).batch(isls)

    def tpot(self, batch: float, context: float, tp: int) -> float:
        """Decode step time (s) for ``batch`` requests at mean ``context`` tokens on TP ``tp``."""
        return self._decode_table(tp)(batch, context)

    def kv_capacity_tokens(self, tp: int) -> float:
        """KV cache capacity in tokens of one TP-``tp`` instance: V_mem / M_token (eq. 11).

        Returns 0 when the weights do not fit.
        """
        v_mem = (self.gpu_memory_gib - self.activation_reserve_gib) * tp * GiB - self.weight_bytes
        return max(v_mem, 0.0) / self.kv_bytes_per_token

    def kv_transfer_seconds(self, tokens: float, bandwidth_gbps: float) -> float:
        """Time (s) to move the KV cache of ``tokens`` tokens over a link of ``bandwidth_gbps`` GB/s."""
        return tokens * self.kv_bytes_per_token / (bandwidth_gbps * 1e9)

    def to_dict(self) -> dict[str, Any]:
        """The profile as the plain mapping :func:`profile_from_dict` reads (latencies in ms)."""
        return {
            "name": self.name,
            "model": self.model,
            "source": self.source,
            "gpu": {"type": self.gpu_type, "memoryGiB": self.gpu_memory_gib, "hbmBandwidthGBps": self.hbm_bandwidth_gbps},
            "weightBytes": self.weight_bytes,
            "kvBytesPerToken": self.kv_bytes_per_token,
            "activationReserveGiB": self.activation_reserve_gib,
            "cudaGraphMaxBatch": self.cuda_graph_max_batch,
            "prefill": [
                {"tp": tp, "isl": list(t.isl), "ttftMs": [s * 1e3 for s in t.seconds]} for tp, t in sorted(self.prefill.items())
            ],
            "decode": [
                {
                    "tp": tp,
                    "batch": list(t.batch),
                    "context": list(t.context),
                    "tpotMs": [[s * 1e3 for s in row] for row in t.seconds],
                }
                for tp, t in sorted(self.decode.items())
            ],
        }


_MAX_TP = 64
"""The largest tensor-parallel size a profile table may have: the bound of an ``LLMServe``'s ``scaling.tpPrefill``,
``tpDecode`` and ``tpUnified`` (``fulcrum.api.llmserve.ScalingSpec``)."""


def _req(d: dict[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise ProfileError(f"{where}: missing field {key!r}")
    return d[key]


def _num(v: Any, where: str, *, text: bool = False) -> float:
    """A finite number. ``text``: ``v`` is a CSV cell, whose numbers are text (``"20"``); otherwise ``v`` comes
    from YAML or JSON, where a string is refused (a quoted number: ``ttftMs: "20"``; a plain ``72.0e9`` is read as a
    number, :func:`fulcrum.errors.safe_yaml`). A bool is refused either way."""
    problem = number_problem(v, text=text)
    if problem is not None:
        raise ProfileError(f"{where}: {problem}")
    try:
        f = as_float(v)  # an integer beyond float range: ±inf, refused below
    except (TypeError, ValueError):
        raise ProfileError(f"{where}: expected a number, got {clipped(repr(v))}") from None
    if not math.isfinite(f):
        raise ProfileError(f"{where}: expected a finite number, got {clipped(repr(v))}")
    return f


def _text(d: dict[str, Any], key: str, default: str, where: str) -> str:
    """The string field ``key`` of ``d``; ``default`` when it is absent or empty (YAML's ``key:`` with no value). A
    list, a mapping, a number or a boolean where a name belongs is refused, not written out as ``"[1, 2]"``."""
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, str):
        hint = " (quote it to mean the text)" if isinstance(v, (bool, int, float)) else ""
        raise ProfileError(f"{where}: expected a string, got {type(v).__name__} {clipped(repr(v))}{hint}")
    return v


def _whole(v: Any, where: str, *, text: bool = False) -> int:
    """A count (TP, a batch cap): a finite number with no fraction, as an int (``text``: as :func:`_num`)."""
    f = _num(v, where, text=text)
    if not f.is_integer():
        raise ProfileError(f"{where}: expected a whole number, got {clipped(repr(v))}")
    return int(f)


def _at_least(v: Any, where: str, low: float, *, strict: bool = False) -> float:
    """A scalar field's number (:func:`_num`) that must be ``> low`` (``strict``) or ``>= low``: checked here, at the
    file's key, rather than by :class:`PerformanceProfile`, whose message knows neither the file nor the key."""
    f = _num(v, where)
    if f < low or (strict and f == low):
        raise ProfileError(f"{where}: expected a number {'>' if strict else '>='} {low:g}, got {clipped(repr(v))}")
    return f


def _tp(v: Any, where: str, *, text: bool = False) -> int:
    tp = _whole(v, where, text=text)
    if not 1 <= tp <= _MAX_TP:
        raise ProfileError(f"{where}: a TP must be from 1 to {_MAX_TP}, got {tp}")
    return tp


def _tables(d: dict[str, Any], key: str, origin: str) -> list[tuple[str, dict[str, Any], int]]:
    """The ``prefill`` or ``decode`` list: (where, entry, TP) per table, at least one, each entry a mapping, each TP
    once. An empty list or a key with no value (``prefill:``) is refused here, naming the file and the key."""
    entries = _req(d, key, origin)
    if entries is None or entries == []:
        fields = "tp, isl, ttftMs" if key == "prefill" else "tp, batch, context, tpotMs"
        got = "null (the key has no value)" if entries is None else "an empty list"
        raise ProfileError(f"{origin}: {key}: expected a list of at least one table ({fields}), got {got}")
    if not isinstance(entries, list):
        raise ProfileError(f"{origin}: {key}: expected a list of tables, got {type(entries).__name__}")
    out: list[tuple[str, dict[str, Any], int]] = []
    seen: dict[int, str] = {}
    for i, entry in enumerate(entries):
        where = f"{origin}: {key}[{i}]"
        if not isinstance(entry, dict):
            raise ProfileError(f"{where}: expected a mapping, got {type(entry).__name__}")
        tp = _tp(_req(entry, "tp", where), f"{where}.tp")
        if tp in seen:
            raise ProfileError(f"{where}: a second table for TP={tp} (the first is {seen[tp]})")
        seen[tp] = f"{key}[{i}]"
        out.append((where, entry, tp))
    return out


def _nums(vs: Any, where: str) -> tuple[float, ...]:
    if not isinstance(vs, (list, tuple)):
        raise ProfileError(f"{where}: expected a list of numbers, got {type(vs).__name__}")
    return tuple(_num(v, f"{where}[{i}]") for i, v in enumerate(vs))


def profile_from_dict(d: Any, *, origin: str = "profile") -> PerformanceProfile:
    """Build a profile from the mapping format (YAML/JSON). Latencies are in milliseconds.

    Format::

        name: str; model: str; source: str
        gpu: {type: str, memoryGiB: float, hbmBandwidthGBps: float}
        weightBytes: float; kvBytesPerToken: float; activationReserveGiB: float; cudaGraphMaxBatch: int
        prefill: [{tp: int, isl: [tokens...], ttftMs: [ms...]}]
        decode:  [{tp: int, batch: [n...], context: [tokens...], tpotMs: [[ms per context] per batch]}]

    Raises:
        ProfileError: a field is missing or of the wrong type (a count with a fraction, a boolean or a quoted
            number such as ``"20"`` for a number, :func:`_num`), ``prefill`` or ``decode`` holds no table, or a field is
            out of range (memory, bandwidth, weight or KV bytes <= 0, a negative activation reserve, a graph batch cap
            below 1), a TP is outside 1..:data:`_MAX_TP` or has two tables, or a table is empty, non-monotone, ragged
            or has an axis point <= 0.
    """
    if d is None:  # an empty YAML document (or JSON null)
        raise ProfileError(f"{origin}: holds no profile fields (empty, only comments, or null): expected a mapping "
                           "with name, gpu, prefill, decode, ...")
    if not isinstance(d, dict):
        raise ProfileError(f"{origin}: expected a mapping at the top level, got {type(d).__name__}")
    return _build_profile(d, origin, origin)


def _build_profile(d: dict[str, Any], origin: str, fields: str) -> PerformanceProfile:
    """:func:`profile_from_dict` of a mapping: the tables (``prefill``, ``decode``) named against ``origin`` in an
    error, every other field against ``fields`` — the same file, except for a CSV profile, whose scalar fields come
    from its ``.meta.yaml`` (that file is where the user must add or fix them). A profile's default name is
    ``origin``."""
    gpu = _req(d, "gpu", fields)
    if not isinstance(gpu, dict):
        raise ProfileError(f"{fields}: gpu: expected a mapping, got {type(gpu).__name__}")
    prefill: dict[int, PrefillTable] = {}
    for where, entry, tp in _tables(d, "prefill", origin):
        isl = _nums(_req(entry, "isl", where), f"{where}.isl")
        ms = _nums(_req(entry, "ttftMs", where), f"{where}.ttftMs")
        try:
            prefill[tp] = PrefillTable(isl, tuple(v / 1e3 for v in ms))
        except ProfileError as err:
            raise ProfileError(f"{where} (TP={tp}): {err}") from None
    decode: dict[int, DecodeTable] = {}
    for where, entry, tp in _tables(d, "decode", origin):
        batch = _nums(_req(entry, "batch", where), f"{where}.batch")
        context = _nums(_req(entry, "context", where), f"{where}.context")
        rows = _req(entry, "tpotMs", where)
        if not isinstance(rows, list):
            raise ProfileError(f"{where}.tpotMs: expected a list of rows")
        grid = tuple(tuple(v / 1e3 for v in _nums(r, f"{where}.tpotMs[{j}]")) for j, r in enumerate(rows))
        try:
            decode[tp] = DecodeTable(batch, context, grid)
        except ProfileError as err:
            raise ProfileError(f"{where} (TP={tp}): {err}") from None
    graph_batch = _whole(d.get("cudaGraphMaxBatch", 512), f"{fields}: cudaGraphMaxBatch")
    if graph_batch < 1:
        raise ProfileError(f"{fields}: cudaGraphMaxBatch: expected a whole number >= 1, got {graph_batch}")
    return PerformanceProfile(
        name=_text(d, "name", origin, f"{fields}: name"),
        model=_text(d, "model", "", f"{fields}: model"),
        gpu_type=_text(gpu, "type", "", f"{fields}: gpu.type"),
        gpu_memory_gib=_at_least(_req(gpu, "memoryGiB", f"{fields}: gpu"), f"{fields}: gpu.memoryGiB", 0, strict=True),
        hbm_bandwidth_gbps=_at_least(_req(gpu, "hbmBandwidthGBps", f"{fields}: gpu"), f"{fields}: gpu.hbmBandwidthGBps",
                                     0, strict=True),
        weight_bytes=_at_least(_req(d, "weightBytes", fields), f"{fields}: weightBytes", 0, strict=True),
        kv_bytes_per_token=_at_least(_req(d, "kvBytesPerToken", fields), f"{fields}: kvBytesPerToken", 0, strict=True),
        activation_reserve_gib=_at_least(d.get("activationReserveGiB", 4.0), f"{fields}: activationReserveGiB", 0),
        cuda_graph_max_batch=graph_batch,
        prefill=prefill,
        decode=decode,
        source=_text(d, "source", "", f"{fields}: source"),
    )


def _from_csv(path: Path, meta: Any, meta_path: Path) -> PerformanceProfile:
    """CSV rows ``kind,tp,isl,batch,context,ms`` (kind = prefill|decode); metadata from a sibling YAML.

    The CSV holds the tables (a UTF-8 byte-order mark is allowed); ``meta``, the mapping read from ``meta_path``
    (``<name>.meta.yaml`` beside it), holds the scalar fields. A point given twice is an error, not the later one.
    """
    if meta is None:  # an empty YAML file, or only comments
        raise ProfileError(f"{meta_path}: holds no fields (empty or only comments): expected a mapping of the "
                           "profile's scalar fields")
    if not isinstance(meta, dict):
        raise ProfileError(f"{meta_path}: expected a mapping of the profile's scalar fields, got {type(meta).__name__}")
    for table in ("prefill", "decode"):  # the CSV's rows would replace them without a word
        if table in meta:
            raise ProfileError(f"{meta_path}: {table}: a CSV profile's tables are the rows of {path.name}, not a "
                               "field of its .meta.yaml (remove it, or load the profile as YAML)")
    pre: dict[int, dict[float, tuple[float, int]]] = {}  # TP → ISL → (ms, line)
    dec: dict[int, dict[tuple[float, float], tuple[float, int]]] = {}  # TP → (batch, context) → (ms, line)
    with path.open(newline="", encoding="utf-8-sig") as f:
        records = CsvRecords(f, path, ProfileError)
        need = {"kind", "tp", "isl", "batch", "context", "ms"}
        header = next(records, None)
        if header is None:
            raise ProfileError(f"{path}: the file is empty (a CSV profile needs the columns {sorted(need)})")
        if not need <= set(header):
            raise ProfileError(f"{path}: CSV needs columns {sorted(need)}, got {header}")
        for record in records:
            if not record:  # a blank line
                continue
            # as csv.DictReader: a short record's missing cells are None, cells past the header's are ignored
            row = dict(zip(header, record)) | dict.fromkeys(header[len(record):])
            n = records.end_line
            if any(v is not None and ("\n" in v or "\r" in v) for k, v in row.items() if k in need):
                raise records.unterminated(f"on to line {n}")
            where = f"{path}:{n}"
            tp = _tp(row["tp"], f"{where} tp", text=True)
            ms = _num(row["ms"], f"{where} ms", text=True)
            if row["kind"] == "prefill":
                isl = _num(row["isl"], f"{where} isl", text=True)
                _add_point(pre.setdefault(tp, {}), isl, (ms, n), f"{where}: prefill point TP={tp}, isl {isl:g}")
            elif row["kind"] == "decode":
                key = (_num(row["batch"], f"{where} batch", text=True),
                       _num(row["context"], f"{where} context", text=True))
                what = f"{where}: decode point TP={tp}, batch {key[0]:g}, context {key[1]:g}"
                _add_point(dec.setdefault(tp, {}), key, (ms, n), what)
            else:
                raise ProfileError(f"{where}: kind must be prefill or decode, got {row['kind']!r}")
    for table, points in (("prefill", pre), ("decode", dec)):  # not the mapping format's "got an empty list"
        if not points:
            raise ProfileError(f"{path}: {table}: no {table} rows (kind={table}): a profile needs at least one "
                               f"{table} point")
    d = dict(meta)
    d["prefill"] = [{"tp": tp, "isl": sorted(p), "ttftMs": [p[k][0] for k in sorted(p)]}
                    for tp, p in sorted(pre.items())]
    d["decode"] = []
    for tp, cells in sorted(dec.items()):
        batches = sorted({b for b, _ in cells})
        contexts = sorted({c for _, c in cells})
        missing = [(b, c) for b in batches for c in contexts if (b, c) not in cells]
        if missing:
            raise ProfileError(f"{path}: decode grid for TP={tp} is missing points (batch, context) {missing[:5]}")
        d["decode"].append(
            {"tp": tp, "batch": batches, "context": contexts,
             "tpotMs": [[cells[(b, c)][0] for c in contexts] for b in batches]}
        )
    return _build_profile(d, str(path), str(meta_path))


def _add_point(points: dict[Any, tuple[float, int]], key: Any, value: tuple[float, int], what: str) -> None:
    """Add a CSV point ``key`` → (ms, line); a key already there is an error naming both lines."""
    if key in points:
        raise ProfileError(f"{what} is given twice (first on line {points[key][1]})")
    points[key] = value


def load_profile(path: str | Path) -> PerformanceProfile:
    """Load a profile from YAML, JSON or CSV (CSV needs ``<stem>.meta.yaml`` beside it).

    Raises:
        ProfileError: unreadable file, unknown extension, or invalid content (the message names it).
    """
    p = Path(path)
    if p.is_dir():
        raise ProfileError(f"{p} is a directory, not a profile file")
    if not p.is_file():
        raise ProfileError(f"profile file not found: {p}")
    suffix = p.suffix.lower()
    yaml_file = p  # the YAML file being parsed, named in a YAML error (a CSV profile's .meta.yaml)
    try:
        if suffix in (".yaml", ".yml", ".json"):
            text = p.read_text(encoding="utf-8")
            if not text.strip():
                raise ProfileError(f"{p}: the file is empty (expected a mapping of the profile's fields)")
        if suffix in (".yaml", ".yml"):
            return profile_from_dict(safe_yaml(text), origin=str(p))
        if suffix == ".json":
            try:
                data = json.loads(text)
            except ValueError as err:  # not JSON, not UTF-8, or an integer of more digits than Python converts
                raise ProfileError(f"{p}: cannot parse: {' '.join(str(err).split())}") from err
            return profile_from_dict(data, origin=str(p))
        if suffix == ".csv":
            meta_path = p.with_name(p.stem + ".meta.yaml")
            if not meta_path.is_file():
                raise ProfileError(f"{p}: CSV profiles need their scalar fields in {meta_path.name} beside them")
            yaml_file = meta_path
            try:
                meta_text = meta_path.read_text(encoding="utf-8")
            except UnicodeDecodeError as err:  # the .meta.yaml's bytes, not the CSV's
                raise ProfileError(f"{meta_path}: cannot parse: {' '.join(str(err).split())}") from err
            return _from_csv(p, safe_yaml(meta_text), meta_path)
    except yaml.YAMLError as err:  # one line: file:line:column and the problem, not YAML's caret diagram
        where, what = yaml_problem(err)
        raise ProfileError(f"{yaml_file}{where}: not valid YAML: {what}") from err
    except RecursionError as err:  # YAML or JSON nested deeper than Python's parsers go
        raise ProfileError(f"{yaml_file}: cannot parse: nested too deeply") from err
    except UnicodeDecodeError as err:
        raise ProfileError(f"{p}: cannot parse: {' '.join(str(err).split())}") from err
    except OSError as err:  # no permission to read, an I/O error
        raise ProfileError(f"{err.filename or p}: cannot read: {err.strerror or err}") from err
    raise ProfileError(f"{p}: unknown profile format {suffix!r} (use .yaml, .json or .csv)")


def recompute_tokens_per_s(profile: PerformanceProfile, target: ClusterTarget) -> float:
    """What recomputing a context costs under ``target``, tokens/s to 0.1, as the operator writes it into the
    router's config (``rescheduling.recompute_tokens_per_s``, ``kv_connector.prefill_tokens_per_s``) and
    ``fulcrum replay`` prices its migrations: :meth:`PerformanceProfile.prefill_tokens_per_s` of the unified pool's
    TP when it has instances, else the prefill pool's.

    Raises:
        ProfileError: the profile has no prefill table at all.
    """
    tp = target.unified.tp if target.unified.replicas else target.prefill.tp
    return round(profile.prefill_tokens_per_s(tp), 1)
