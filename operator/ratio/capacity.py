"""D-instance concurrency from GPU memory and bandwidth: DOPD §IV-B, eqs. (11)–(14).

For a decode instance of tensor-parallel size TP serving requests of mean lengths ISL/OSL:

- eq. (11)  V_mem = (M_gpu − M') · TP − M_model               KV bytes the instance can hold
- eq. (12)  V_BW  = t_d^SLO · α · TP · BW                     KV bytes one SLO-bounded step can read
- eq. (13)  cc_d  = min(V_mem, V_BW) / ((ISL + OSL/2) · M_token)
- eq. (14)  cc_d  = min(cc_d, cc_g), with headroom: cc_g · h (DOPD suggests h = 0.9 for bursts)

Fulcrum adds one check the paper leaves to profiling: the largest batch whose *measured* step time at context
ISL + OSL/2 still meets the TPOT SLO (``cc_slo``), found by bisection on the profile's decode table.

Eq. (13) sizes memory for the *mean* context; the KV cache of a decode instance holds a *random* sum of contexts.
:func:`kv_instances_needed` sizes for a quantile of it instead (Fulcrum's addition, issue 13): with Poisson
arrivals the requests in decode form an M/G/∞ population of mean L = λ·E[OSL]·t_d (Little's law), so the
tokens it holds are compound-Poisson, mean L·m1 and variance L·m2, where m1 and m2 are the first two moments of
one in-flight request's context (ISL + tokens generated so far) sampled over its time in decode
(:func:`kv_context_moments`). Overflowing the cache is not a gentle slowdown: vLLM preempts the newest request and
recomputes it later, which lengthens every step and the queue (the simulator does the same), so the planner's
level (``PlannerSettings.kv_occupancy_quantile``, 0.95) sits above a P90 SLO's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

from fulcrum.ratio.lengths import LengthDistribution
from fulcrum.ratio.profile import GiB, PerformanceProfile

__all__ = ["DecodeCapacity", "decode_capacity", "kv_context_moments", "kv_instances_needed", "slo_batch_limit"]


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
        cc: the D-instance concurrency cc_d = min of the above (≥ 1 when one request's KV fits, else 0).
        step_s: profiled decode step time t_d at batch ``cc`` and ``context_tokens``, seconds.
        limited_by: which bound set ``cc``: "memory" | "bandwidth" | "cuda_graph" | "tpot_slo" | "max_num_seqs"
            (the engine's ``--max-num-seqs``, LLMServe ``spec.engine.maxNumSeqs``) | "given".
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
    max_num_seqs: int | None = None,
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
        max_num_seqs: the engine's ``--max-num-seqs`` (requests one engine runs at once), a bound on cc_d beside
            eqs. (11)–(14): an engine admits no more whatever its memory, bandwidth or CUDA graphs allow. None: no
            such bound (eq. 14's CUDA-graph cap alone, as in DOPD).

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
    engine_cap = math.inf if max_num_seqs is None else float(max(int(max_num_seqs), 1))
    upper = int(math.floor(min(cc_mem, cc_bw, cc_graph, engine_cap)))
    cc_slo = slo_batch_limit(profile, tp, context, tpot_slo_s, max(upper, 1))
    # in a tie the first bound named wins: cc_slo is searched below the others, so it equals them when it does not bind
    bounds = {"memory": cc_mem, "bandwidth": cc_bw, "cuda_graph": float(cc_graph)}
    if max_num_seqs is not None:
        bounds["max_num_seqs"] = engine_cap
    bounds["tpot_slo"] = float(cc_slo)
    limited_by = min(bounds, key=lambda k: bounds[k])
    if override_cc is not None:
        cc = max(int(round(override_cc)), 1)
        limited_by = "given"
    elif cc_mem < 1.0:
        cc = 0  # the weights leave no KV memory, or less than one request's KV at this context: vLLM would refuse it
    else:
        # A batch of one is always allowed when one request's KV fits: a TPOT SLO tighter than the
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


def kv_context_moments(isl: LengthDistribution, osl: LengthDistribution) -> tuple[float, float]:
    """First two moments (tokens, tokens²) of the KV context of one request in decode, time-weighted.

    A request of prompt x and output o spends o steps in decode with context x + k at step k, so over its time
    there its context has E = x + o/2 and E[c²] = x² + x·o + o²/3; a random in-flight request is drawn with
    weight o (longer outputs stay longer). With ISL and OSL independent:
    m1 = E[x] + E[o²]/(2E[o]) and m2 = E[x²] + E[x]·E[o²]/E[o] + E[o³]/(3E[o]).
    Returns (0, 0) when the mean output length is not positive.
    """
    eo = osl.mean()
    if eo <= 0:
        return 0.0, 0.0
    eo2 = osl.second_moment()
    eo3 = osl.expect(lambda o: o * o * o)
    ex = isl.mean()
    ex2 = isl.second_moment()
    return ex + eo2 / (2.0 * eo), ex2 + ex * eo2 / eo + eo3 / (3.0 * eo)


def kv_instances_needed(in_flight: float, m1: float, m2: float, capacity_tokens: float, quantile: float) -> float:
    """Decode instances (continuous) whose KV caches hold the ``quantile`` of a compound-Poisson KV demand.

    Each of n instances serves in_flight/n = y requests on average; its cache holds y·m1 tokens on average with
    variance y·m2 (module doc). The largest y with y·m1 + z·√(y·m2) ≤ ``capacity_tokens`` (z the standard normal
    ``quantile``) is y* = s², s = (−z√m2 + √(z²·m2 + 4·m1·C)) / (2·m1); the need is in_flight / y*.

    Args:
        in_flight: mean requests in decode over the pool, L = λ·E[OSL]·t_d.
        m1, m2: :func:`kv_context_moments`, tokens and tokens².
        capacity_tokens: one instance's KV cache, tokens (eq. 11 / M_token).
        quantile: level of the KV demand the caches must hold, in (0, 1); a level below 0.5 counts as the
            median (z is clipped at 0: never less than the mean demand).

    Returns:
        Instances needed (≥ 0; 0 when nothing is in flight, ``inf`` when the cache holds no tokens).

    Raises:
        ValueError: ``quantile`` outside (0, 1).
    """
    if not 0.0 < quantile < 1.0:
        raise ValueError(f"quantile must lie in (0, 1), got {quantile}")
    if in_flight <= 0 or m1 <= 0:
        return 0.0
    if capacity_tokens <= 0:
        return math.inf
    z = max(NormalDist().inv_cdf(quantile), 0.0)
    root = (-z * math.sqrt(m2) + math.sqrt(z * z * m2 + 4.0 * m1 * capacity_tokens)) / (2.0 * m1)
    return in_flight / (root * root)
