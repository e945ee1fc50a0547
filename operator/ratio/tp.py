"""Tensor-parallel size choice for P- and D-instances: DOPD §IV-C, eq. (16), and §IV-B (memory).

- Prefill (eq. 16): T_prefill(ISL, TP) = C(ISL)/S(TP) + τ(TP). More TP shortens a prefill only while the
  speed-up beats the communication term, and it always costs more GPUs. Fulcrum picks, among the measured TPs
  whose instance holds the weights plus one maximum-length prompt's KV, the one with the least GPU-seconds per
  request E[T_prefill]·TP whose prefill at the SLO percentile meets the TTFT SLO; if none meets it, the fastest.
- Decode (eqs. 11–14): the measured TP with the highest decode throughput per GPU cc_d/(t_d·TP) at a batch
  that meets the TPOT SLO; ties go to the smaller TP (fewer GPUs per step of scaling).
"""

from __future__ import annotations

from collections.abc import Iterable

from fulcrum.errors import PlanningError
from fulcrum.ratio.capacity import DecodeCapacity, decode_capacity
from fulcrum.ratio.lengths import LengthDistribution
from fulcrum.ratio.profile import GiB, PerformanceProfile

__all__ = ["choose_decode_tp", "choose_prefill_tp"]


def _candidates(available: Iterable[int], fixed: int | None, max_tp: int, phase: str, name: str) -> list[int]:
    avail = sorted(available)
    if fixed is not None:
        if fixed not in avail:
            raise PlanningError(f"profile {name!r} has no {phase} measurements for TP={fixed} (has {tuple(avail)})")
        return [fixed]
    out = [tp for tp in avail if tp <= max_tp]
    if not out:
        raise PlanningError(f"profile {name!r}: no {phase} TP ≤ {max_tp} GPUs per node (has {tuple(avail)})")
    return out


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
) -> DecodeCapacity:
    """The D-instance TP and its capacity (see module doc); ``max_num_seqs``: the engine's ``--max-num-seqs``, a
    bound on cc_d (:func:`fulcrum.ratio.capacity.decode_capacity`).

    Raises:
        PlanningError: no candidate TP holds the model weights and one request's KV cache at this context, or
            ``fixed`` is not in the profile.
    """
    best: DecodeCapacity | None = None
    tps = _candidates(profile.decode_tps, fixed, max_tp, "decode", profile.name)
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
) -> int:
    """The P-instance TP by eq. (16) plus memory (see module doc).

    Raises:
        PlanningError: no candidate TP holds the weights plus one prompt's KV, or ``fixed`` is unknown.
    """
    cands = _candidates(profile.prefill_tps, fixed, max_tp, "prefill", profile.name)
    need_tokens = min(float(max_model_len), isl.quantile(0.99))
    fits = [tp for tp in cands if profile.kv_capacity_tokens(tp) >= need_tokens]
    if not fits:
        if fixed is not None:
            return fixed  # the user chose it; the plan notes the memory risk
        raise PlanningError(
            f"profile {profile.name!r}: no prefill TP ≤ {max_tp} holds the weights plus a {need_tokens:.0f}-token prompt"
        )
    tail_isl = isl.quantile(q)

    def cost(tp: int) -> tuple[bool, float, float]:
        tail = profile.ttft(tail_isl, tp)
        gpu_s = isl.expect(lambda x: profile.ttft(x, tp)) * tp
        return (tail > ttft_slo_s, gpu_s if tail <= ttft_slo_s else tail, tp)

    return min(fits, key=cost)
