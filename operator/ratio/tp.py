"""Tensor-parallel size choice for P- and D-instances: DOPD §IV-C, eq. (16), and §IV-B (memory).

- Prefill (eq. 16): T_prefill(ISL, TP) = C(ISL)/S(TP) + τ(TP). More TP shortens a prefill only while the
  speed-up beats the communication term, and it always costs more GPUs. Fulcrum picks, among the measured TPs
  whose instance holds the weights plus one maximum-length prompt's KV, the one with the least GPU-seconds per
  request E[T_prefill]·TP whose prefill at the SLO percentile meets the TTFT SLO; if none meets it, the fastest.
- Decode (eqs. 11–14): the measured TP with the highest decode throughput per GPU cc_d/(t_d·TP) at a batch
  that meets the TPOT SLO; ties go to the smaller TP (fewer GPUs per step of scaling).
- Every role (prefill, decode, unified): a TP is a candidate only if its KV cache holds one sequence of
  ``maxModelLen`` tokens, V_mem/M_token ≥ maxModelLen (DOPD eq. 11: V_mem = M_gpu·TP − M_model − M'·TP bytes,
  M_token bytes of KV per token; :meth:`~fulcrum.ratio.profile.PerformanceProfile.kv_capacity_tokens`). vLLM
  refuses to start otherwise ("The model's max seq len (X) is larger than the maximum number of tokens that can
  be stored in KV cache (Y)"), so a plan with such a TP would crash-loop its pods. When no TP up to ``max_tp``
  fits, or a TP the user fixed (``spec.scaling.tpPrefill``/``tpDecode``/``tpUnified``) does not, the choice
  raises :class:`~fulcrum.errors.PlanningError` naming the numbers and the fix (:func:`fits_max_model_len`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from fulcrum.errors import PlanningError
from fulcrum.ratio.capacity import DecodeCapacity, decode_capacity
from fulcrum.ratio.lengths import LengthDistribution
from fulcrum.ratio.profile import GiB, PerformanceProfile

__all__ = ["check_fixed_tp", "choose_decode_tp", "choose_prefill_tp", "fits_max_model_len", "tp_candidates"]


def _fmt_tokens(tokens: float) -> str:
    return f"{math.floor(tokens):,}"


def _fix(have: float, other: str) -> str:
    """The fixes of a maxModelLen the KV cache (``have`` tokens) cannot hold: lower it to ``have``, or ``other``."""
    if have >= 1:
        return f"Lower spec.engine.maxModelLen to at most {_fmt_tokens(have)} or {other}"
    return f"The weights leave no KV cache there, so lowering spec.engine.maxModelLen cannot help: {other}"


def check_fixed_tp(profile: PerformanceProfile, tp: int, max_model_len: int, field: str,
                   available: Iterable[int] | None = None) -> None:
    """Check that a TP the user fixed (``field``, e.g. ``spec.scaling.tpPrefill``) holds one ``max_model_len``-token
    sequence in its KV cache: ``profile.kv_capacity_tokens(tp) >= max_model_len`` (tokens; DOPD eq. 11, V_mem/M_token).
    ``available``: the TPs the profile measures for this role (for the hint; every measured TP when None).

    Raises:
        PlanningError: it does not (vLLM would refuse to start, so the pods would crash-loop); the message names
            ``field``, both token counts, the KV cache ``max_model_len`` needs in GiB, and the smallest measured TP
            that would hold it, if any.
    """
    have = profile.kv_capacity_tokens(tp)
    if have >= max_model_len:
        return
    need_gib = max_model_len * profile.kv_bytes_per_token / GiB
    measured = sorted(available if available is not None else set(profile.prefill_tps) | set(profile.decode_tps))
    larger = [t for t in measured if profile.kv_capacity_tokens(t) >= max_model_len]
    shown = ", ".join(map(str, measured))
    hint = (f"set {field} to a TP that holds it (TP {larger[0]} does)" if larger else
            f"use a profile that measures a larger TP (none it measures for this role, TP {shown}, holds it)")
    raise PlanningError(
        f"{field}={tp} cannot serve maxModelLen {max_model_len:,} tokens: one such sequence needs {need_gib:.1f} GiB of "
        f"KV cache, but a TP-{tp} instance of profile {profile.name!r} holds only {_fmt_tokens(have)} tokens "
        f"(weights {profile.weight_bytes / 1e9:.1f} GB on {tp} × {profile.gpu_memory_gib:g} GiB GPUs); vLLM would "
        f"refuse to start and the pods would crash-loop. {_fix(have, hint)}"
    )


def fits_max_model_len(profile: PerformanceProfile, tps: Iterable[int], max_model_len: int, *, phase: str,
                       max_tp: int) -> list[int]:
    """The TPs of ``tps`` (candidates of one role, ``phase``: "prefill", "decode" or "unified", all ≤ ``max_tp``)
    whose KV cache holds one ``max_model_len``-token sequence: ``profile.kv_capacity_tokens(tp) >= max_model_len``
    (tokens; DOPD eq. 11: V_mem = M_gpu·TP − M_model − M'·TP bytes over M_token = ``kv_bytes_per_token``).

    Raises:
        PlanningError: none does; the message names the KV cache ``max_model_len`` needs (GiB), what the largest
            candidate holds (tokens) and the fix (lower ``spec.engine.maxModelLen`` or allow a larger TP).
    """
    cands = sorted(tps)
    out = [tp for tp in cands if profile.kv_capacity_tokens(tp) >= max_model_len]
    if out:
        return out
    need_gib = max_model_len * profile.kv_bytes_per_token / GiB
    largest = cands[-1] if cands else 0
    have = profile.kv_capacity_tokens(largest) if cands else 0.0
    raise PlanningError(
        f"profile {profile.name!r}: maxModelLen {max_model_len:,} tokens needs {need_gib:.1f} GiB of KV cache for one "
        f"sequence; the largest {phase} TP ≤ {max_tp} the profile measures (TP {largest}) holds only "
        f"{_fmt_tokens(have)} tokens (weights {profile.weight_bytes / 1e9:.1f} GB on {profile.gpu_memory_gib:g} GiB "
        f"GPUs), and vLLM refuses to start when one sequence does not fit. "
        f"{_fix(have, 'allow a larger TP (spec.gpu.gpusPerNode, or a profile that measures one)')}"
    )


def tp_candidates(profile: PerformanceProfile, available: Iterable[int], fixed: int | None, max_tp: int, phase: str,
                  max_model_len: int, field: str) -> list[int]:
    """The TPs of one role every planner chooses from: ``fixed`` alone (it must be measured and hold
    ``max_model_len``), else the measured TPs ≤ ``max_tp`` (``spec.gpu.gpusPerNode``: an instance is one pod) that
    hold ``max_model_len`` tokens of KV cache (:func:`fits_max_model_len`, DOPD eq. 11), smallest first.

    Args:
        profile: the performance profile.
        available: the TPs the profile measures for the role (GPUs per instance).
        fixed: the TP the spec pins (``field``), or None.
        max_tp: the largest TP, GPUs.
        phase: ``"prefill"``, ``"decode"`` or ``"unified"`` (for messages).
        max_model_len: ``spec.engine.maxModelLen``, tokens.
        field: the spec field ``fixed`` came from, named in errors.

    Raises:
        PlanningError: ``fixed`` is not measured or does not hold ``max_model_len`` (:func:`check_fixed_tp`); no
            measured TP is ≤ ``max_tp``; none of those holds ``max_model_len`` (:func:`fits_max_model_len`).
    """
    name = profile.name
    avail = sorted(available)
    if fixed is not None:
        if fixed not in avail:
            raise PlanningError(f"profile {name!r} has no {phase} measurements for TP={fixed} (has {tuple(avail)})")
        check_fixed_tp(profile, fixed, max_model_len, field, avail)
        return [fixed]
    out = [tp for tp in avail if tp <= max_tp]
    if not out:
        raise PlanningError(f"profile {name!r}: no {phase} TP ≤ {max_tp} GPUs per node (has {tuple(avail)})")
    return fits_max_model_len(profile, out, max_model_len, phase=phase, max_tp=max_tp)


def choose_decode_tp(
    profile: PerformanceProfile,
    mean_isl: float,
    mean_osl: float,
    tpot_slo_s: float,
    *,
    fixed: int | None = None,
    max_tp: int = 8,
    bandwidth_utilisation: float = 0.6,
    graph_headroom: float = 0.9,
    max_num_seqs: int | None = None,
    max_model_len: int = 8192,
    fixed_field: str = "spec.scaling.tpDecode",
) -> DecodeCapacity:
    """The D-instance TP and its capacity (see module doc); ``max_num_seqs``: the engine's ``--max-num-seqs``, a
    bound on cc_d (:func:`fulcrum.ratio.capacity.decode_capacity`); ``max_model_len``: the engine's
    ``--max-model-len``, tokens, which one instance's KV cache must hold (module doc); ``fixed_field``: where
    ``fixed`` came from, for the error message.

    Raises:
        PlanningError: no candidate TP ≤ ``max_tp`` holds one ``max_model_len``-token sequence in its KV cache
            (:func:`fits_max_model_len`), ``fixed`` does not (:func:`check_fixed_tp`), none holds the model
            weights and one request's KV cache at this context, or ``fixed`` is not in the profile.
    """
    best: DecodeCapacity | None = None
    tps = tp_candidates(profile, profile.decode_tps, fixed, max_tp, "decode", max_model_len, fixed_field)
    for tp in tps:
        cap = decode_capacity(
            profile, tp, mean_isl, mean_osl, tpot_slo_s,
            bandwidth_utilisation=bandwidth_utilisation, graph_headroom=graph_headroom, max_num_seqs=max_num_seqs,
        )
        if cap.cc < 1:
            continue
        if best is None or cap.tokens_per_s_per_gpu > best.tokens_per_s_per_gpu * 1.000001:
            best = cap
    if best is None:  # every candidate was skipped; ``cap`` is the last one's (the context is the same for all)
        context = cap.context_tokens
        raise PlanningError(
            f"profile {profile.name!r}: the model's weights ({profile.weight_bytes / 1e9:.1f} GB) leave no KV memory "
            f"for one request of {context:.0f} tokens' context ({context * profile.kv_bytes_per_token / GiB:.1f} GiB "
            f"of KV cache) at any decode TP the profile measures ({', '.join(map(str, tps))}; at most {max_tp}) on "
            f"{profile.gpu_memory_gib:g} GiB GPUs"
        )
    return best


def choose_prefill_tp(
    profile: PerformanceProfile,
    isl: LengthDistribution,
    ttft_slo_s: float,
    q: float,
    *,
    fixed: int | None = None,
    max_tp: int = 8,
    max_model_len: int = 8192,
    fixed_field: str = "spec.scaling.tpPrefill",
) -> int:
    """The P-instance TP by eq. (16) plus memory (see module doc): only TPs whose KV cache holds one
    ``max_model_len``-token sequence (tokens; the engine's ``--max-model-len``) are candidates. ``fixed_field``:
    where ``fixed`` came from, for the error message.

    Raises:
        PlanningError: no candidate TP ≤ ``max_tp`` holds the weights plus one ``max_model_len``-token sequence's KV
            (:func:`fits_max_model_len`), ``fixed`` does not (:func:`check_fixed_tp`), or ``fixed`` is unknown.
    """
    fits = tp_candidates(profile, profile.prefill_tps, fixed, max_tp, "prefill", max_model_len, fixed_field)
    tail_isl = isl.quantile(q)

    def cost(tp: int) -> tuple[bool, float, float]:
        tail = profile.ttft(tail_isl, tp)
        gpu_s = isl.expect(lambda x: profile.ttft(x, tp)) * tp
        return (tail > ttft_slo_s, gpu_s if tail <= ttft_slo_s else tail, tp)

    return min(fits, key=cost)
