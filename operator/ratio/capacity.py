"""D-instance concurrency from GPU memory and bandwidth: DOPD §IV-B, eqs. (11)–(14).

For a decode instance of tensor-parallel size TP serving requests of mean lengths ISL/OSL:

- eq. (11)  V_mem = (M_gpu − M') · TP − M_model               KV bytes the instance can hold
- eq. (12)  V_BW  = t_d^SLO · α · TP · BW                     KV bytes one SLO-bounded step can read
- eq. (13)  cc_d  = min(V_mem, V_BW) / ((ISL + OSL/2) · M_token)
- eq. (14)  cc_d  = min(cc_d, cc_g), with headroom: cc_g · h (DOPD suggests h = 0.9 for bursts)

Fulcrum adds one check the paper leaves to profiling: the largest batch whose *measured* step time at context
ISL + OSL/2 still meets the TPOT SLO (``cc_slo``), found by bisection on the profile's decode table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fulcrum.ratio.profile import GiB, PerformanceProfile

__all__ = ["DecodeCapacity", "decode_capacity", "slo_batch_limit"]


@dataclass(frozen=True)
class DecodeCapacity:
    """How many requests one D-instance sustains, and why.

    Attributes:
        tp: tensor-parallel size of the instance.
        context_tokens: mean context per request, ISL + OSL/2, tokens (eq. 13's denominator).
        v_mem_bytes: KV bytes the instance holds, eq. (11).
        v_bw_bytes: KV bytes one step may read within the TPOT SLO, eq. (12).
        cc_mem: concurrency allowed by memory, V_mem / (context · M_token).
        cc_bw: concurrency allowed by bandwidth, V_BW / (context · M_token).
        cc_graph: CUDA-graph cap with headroom, ⌊cc_g · h⌋, eq. (14).
        cc_slo: largest batch whose profiled step time meets the TPOT SLO.
        cc: the D-instance concurrency cc_d = min of the above (≥ 1 when the weights fit, else 0).
        step_s: profiled decode step time t_d at batch ``cc`` and ``context_tokens``, seconds.
        limited_by: which bound set ``cc``: "memory" | "bandwidth" | "cuda_graph" | "tpot_slo".
    """

    tp: int
    context_tokens: float
    v_mem_bytes: float
    v_bw_bytes: float
    cc_mem: float
    cc_bw: float
    cc_graph: int
    cc_slo: int
    cc: int
    step_s: float
    limited_by: str

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """Decode throughput per GPU at full batch: cc / (t_d · TP), tokens/s."""
        if self.cc <= 0 or self.step_s <= 0:
            return 0.0
        return self.cc / (self.step_s * self.tp)


def slo_batch_limit(profile: PerformanceProfile, tp: int, context: float, tpot_slo_s: float, upper: int) -> int:
    """Largest batch b in [1, upper] with profiled step time tpot(b, context, tp) ≤ ``tpot_slo_s``.

    The decode table is non-decreasing in batch, so bisection is exact. Returns 0 when even a batch of one
    misses the SLO.
    """
    if upper < 1 or profile.tpot(1, context, tp) > tpot_slo_s:
        return 0
    lo, hi = 1, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if profile.tpot(mid, context, tp) <= tpot_slo_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


def decode_capacity(
    profile: PerformanceProfile,
    tp: int,
    mean_isl: float,
    mean_osl: float,
    tpot_slo_s: float,
    *,
    bandwidth_utilisation: float = 0.6,
    graph_headroom: float = 0.9,
    override_cc: float | None = None,
) -> DecodeCapacity:
    """D-instance concurrency cc_d by DOPD eqs. (11)–(14) plus the profiled TPOT check.

    Args:
        profile: performance profile with a decode table for ``tp``.
        tp: tensor-parallel size of the D-instance.
        mean_isl: mean prompt length, tokens (> 0).
        mean_osl: mean output length, tokens (> 0).
        tpot_slo_s: TPOT SLO t_d^SLO, seconds.
        bandwidth_utilisation: α of eq. (12) (DOPD: 0.6 "is considered excellent").
        graph_headroom: fraction of cc_g usable, eq. (14) with DOPD's 0.9 burst headroom.
        override_cc: a measured D capacity to use instead (e.g. DOPD §VI-A3's 235); the bounds are still reported.

    Raises:
        ProfileError: the profile has no decode table for ``tp``.
    """
    isl = max(float(mean_isl), 1.0)
    osl = max(float(mean_osl), 1.0)
    context = isl + osl / 2.0
    per_req = context * profile.kv_bytes_per_token
    v_mem = max((profile.gpu_memory_gib - profile.activation_reserve_gib) * tp * GiB - profile.weight_bytes, 0.0)
    v_bw = tpot_slo_s * bandwidth_utilisation * tp * profile.hbm_bandwidth_gbps * 1e9
    cc_mem = v_mem / per_req
    cc_bw = v_bw / per_req
    cc_graph = max(int(math.floor(profile.cuda_graph_max_batch * graph_headroom)), 1)
    upper = int(math.floor(min(cc_mem, cc_bw, cc_graph)))
    cc_slo = slo_batch_limit(profile, tp, context, tpot_slo_s, max(upper, 1))
    bounds = {"memory": cc_mem, "bandwidth": cc_bw, "cuda_graph": float(cc_graph), "tpot_slo": float(cc_slo)}
    limited_by = min(bounds, key=lambda k: bounds[k])
    if override_cc is not None:
        cc = max(int(round(override_cc)), 1)
        limited_by = "given"
    elif v_mem <= 0:
        cc = 0
    else:
        # A batch of one is always allowed when the weights fit: a TPOT SLO tighter than the
        # hardware's single-request step cannot be met by any count, and the plan reports it.
        cc = max(int(math.floor(min(bounds.values()))), 1)
    step = profile.tpot(max(cc, 1), context, tp)
    return DecodeCapacity(
        tp=tp,
        context_tokens=context,
        v_mem_bytes=v_mem,
        v_bw_bytes=v_bw,
        cc_mem=cc_mem,
        cc_bw=cc_bw,
        cc_graph=cc_graph,
        cc_slo=cc_slo,
        cc=cc,
        step_s=step,
        limited_by=limited_by,
    )
