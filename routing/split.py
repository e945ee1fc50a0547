"""Libra's global request scheduler: split each request at the token that balances two instances
(Libra §4.1, Algorithm 1; Insight 1: "maximizing the throughput of a disaggregated serving system requires
balancing the throughput of its stages").

Per request of P prompt tokens and predicted D output tokens (L = P + D):

1. **Pair.** The two instances with the least predicted busy time (the execution predictor's virtual queues;
   ties → fewer in-flight requests and queued prompt passes → round-robin): A, which may prefill (role
   "prefill"/"both"), runs α = tokens 1..s; B ≠ A, which may decode (role "decode"/"both"), runs β = s+1..L.
2. **Cold start** (Alg. 1 lines 1–2): without timing data (no performance profile), pure disaggregation,
   φ = P/L. (Libra seeds its clocks from the first request; here the profile is the offline data, so the
   predictor has timing from the start and an idle pair is already balanced by the search.)
3. **Bounded binary search** (lines 3–10): φ starts at P/L (pure disaggregation) in [lo, hi] = [0, 1] narrowed by
   A's role (a "prefill" A cannot decode: φ ≤ P/L; B, "decode" or "both", may prefill what A leaves of the
   prompt, as a decode instance prefills the prompts it runs locally, DOPD §V-E). Each probe splits at
   s = ⌈φ·L⌉, asks the predictor for T_A and T_B — the instants at which each would have drained all its work
   including its micro-request (:meth:`fulcrum.routing.predictor.InstancePredictor.probe`, O(log n)) — stops when
   |T_A − T_B| ≤ ε, and otherwise moves φ up when A finishes first and down when B does. At most K probes; the
   best-balanced probe is kept (Alg. 1 keeps the last; the best is never worse).
4. **Decision.** s ≥ L → colocated on A; s = 0 → colocated on B; s = P → disaggregated; s > P → split with
   ``handoff_after = k = s − P`` (A prefills and decodes k tokens, then hands off its KV cache); 0 < s < P →
   split inside the prompt only when both instances report ``supports_partial_prefix`` (the router config's
   ``kv_connector.partial_prefix`` or the instance's label; the router then runs A's head prefill and B's
   partial-prefix load, ``fulcrum.router.app._run_partial_split``), otherwise the nearest
   safe split s = P with reason "safe-split" (vLLM's decode engine must never be sent a prompt whose KV the
   transferred blocks do not cover). With ``kv_block_tokens`` > 0, a handoff at which P + k − 1 is a multiple of
   the block size is moved one token later (that exact boundary trips the decode engine's block check).

``on_start`` commits the decision's micro-requests to the virtual queues (Alg. 1 line 11, COMMIT); ``on_finish``
takes what is left of them off (the request ended before its predicted length). Every decision's reason starts
with one word the router counts: balanced, bounded, cold-start, safe-split, single-instance, role-bound;
:attr:`SplitPolicy.reasons` counts them too.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fulcrum.ratio.profile import PerformanceProfile, profile_from_dict
from fulcrum.ratio.profiles import builtin_profile
from fulcrum.routing.base import NO_CAPABILITIES, InstanceView, NoInstanceError, RequestInfo, RouteDecision
from fulcrum.routing.predictor import ExecutionPredictor, InstancePredictor, split_micro_requests, split_parts

__all__ = ["SplitPolicy", "SplitSearch", "search_split_point", "resolve_profile_param"]


def resolve_profile_param(profile: PerformanceProfile | str | Mapping[str, Any] | None) -> PerformanceProfile | None:
    """A profile given as an object, a built-in profile name, or the mapping format of
    :func:`fulcrum.ratio.profile.profile_from_dict` (e.g. inline in the router config). Files are the
    caller's to read.

    Raises:
        fulcrum.errors.ProfileError: unknown built-in name or invalid mapping.
        TypeError: any other type.
    """
    if profile is None or isinstance(profile, PerformanceProfile):
        return profile
    if isinstance(profile, str):
        return builtin_profile(profile)
    if isinstance(profile, Mapping):
        return profile_from_dict(dict(profile), origin="router config profile")
    raise TypeError(f"profile must be a PerformanceProfile, a built-in profile name or a mapping, got {type(profile).__name__}")


def _rotating_min(loaded: list[tuple[tuple[float, float], InstanceView]], turn: int) -> InstanceView | None:
    if not loaded:
        return None
    low = min(x[0] for x in loaded)
    tied = [x[1] for x in loaded if x[0] == low]
    return tied[turn % len(tied)]


@dataclass(frozen=True, slots=True)
class SplitSearch:
    """Outcome of :func:`search_split_point`.

    Attributes:
        split_token: s of the best-balanced probe, tokens (0..L).
        finish_a_s: T_A there: when A would drain, s (absolute).
        finish_b_s: T_B there, s (absolute).
        probes: probes made (≤ K).
        balanced: |T_A − T_B| ≤ ε was reached.
    """

    split_token: int
    finish_a_s: float
    finish_b_s: float
    probes: int
    balanced: bool


def search_split_point(
    prompt_tokens: int,
    output_tokens: int,
    a: InstancePredictor,
    b: InstancePredictor,
    now: float,
    *,
    max_probes: int = 6,
    epsilon_s: float = 0.005,
    lo: float = 0.0,
    hi: float = 1.0,
) -> SplitSearch:
    """Libra Alg. 1 lines 3–10: bounded binary search of φ ∈ [lo, hi] balancing A's and B's drain times.

    Starts at φ = P/L (pure disaggregation, clipped to [lo, hi]); each probe splits at s = ⌈φ·L⌉
    (:func:`~fulcrum.routing.predictor.split_micro_requests`), predicts T_A and T_B with A's and B's
    :meth:`~fulcrum.routing.predictor.InstancePredictor.probe` (a side with no micro-request keeps its current drain
    time), stops once |T_A − T_B| ≤ ``epsilon_s``, and otherwise raises φ when A drains first, lowers it when B
    does. Returns the best-balanced of the ≤ ``max_probes`` probes. P = ``prompt_tokens``,
    D = max(``output_tokens``, 1), L = P + D. Pure: the predictors are only probed.

    Raises:
        ValueError: ``max_probes < 1`` or not 0 ≤ lo ≤ hi ≤ 1.
    """
    if max_probes < 1 or not (0.0 <= lo <= hi <= 1.0):
        raise ValueError(f"need max_probes >= 1 and 0 <= lo <= hi <= 1, got {max_probes}, [{lo}, {hi}]")
    p = max(int(prompt_tokens), 0)
    d = max(int(output_tokens), 1)
    total = p + d
    if p == 0:  # nothing to split: everything is decode, on A
        t_a = a.snapshot(now).finish_s(0, 0, d)
        return SplitSearch(total, t_a, now + b.busy_s(now), 1, False)
    phi = min(max(p / total, lo), hi)
    snap_a, snap_b = a.snapshot(now), b.snapshot(now)
    idle_a, idle_b = now + snap_a.busy, now + snap_b.busy
    best = SplitSearch(p, math.inf, -math.inf, 0, False)
    best_gap = math.inf
    probes = 0
    while probes < max_probes:
        s = min(max(math.ceil(phi * total - 1e-9), 0), total)
        alpha, beta = split_parts(p, d, s)
        t_a = snap_a.finish_s(*alpha) if alpha is not None else idle_a
        t_b = snap_b.finish_s(*beta) if beta is not None else idle_b
        probes += 1
        gap = abs(t_a - t_b)
        if gap < best_gap:
            best_gap = gap
            best = SplitSearch(s, t_a, t_b, probes, gap <= epsilon_s)
        if gap <= epsilon_s:
            break
        if t_a < t_b:
            lo = phi
        else:
            hi = phi
        phi = (lo + hi) / 2.0
    return SplitSearch(best.split_token, best.finish_a_s, best.finish_b_s, probes, best.balanced)


class SplitPolicy:
    """Libra Alg. 1 (module doc).

    Args:
        profile: timing data for the execution predictor (object, built-in name, or mapping); None = always the
            cold-start path (pure disaggregation).
        max_probes: K, probes of the binary search (Libra: 6), ≥ 1.
        epsilon_s: ε, |T_A − T_B| at which the search stops, s (default 5 ms: below one decode step).
        kv_block_tokens: KV block size for the handoff-boundary nudge, tokens (0 = off).

    Raises:
        ValueError: ``max_probes < 1``, negative ``epsilon_s`` or ``kv_block_tokens``.
    """

    name = "split"
    capabilities = NO_CAPABILITIES

    def __init__(
        self,
        *,
        profile: PerformanceProfile | str | Mapping[str, Any] | None = None,
        max_probes: int = 6,
        epsilon_s: float = 0.005,
        kv_block_tokens: int = 0,
    ) -> None:
        if max_probes < 1 or not (epsilon_s >= 0.0) or kv_block_tokens < 0:
            raise ValueError("max_probes must be >= 1, epsilon_s >= 0 and kv_block_tokens >= 0")
        self.max_probes = int(max_probes)
        self.epsilon_s = float(epsilon_s)
        self.kv_block_tokens = int(kv_block_tokens)
        self.predictor = ExecutionPredictor(resolve_profile_param(profile))
        self.reasons: Counter[str] = Counter()
        self._views: dict[str, InstanceView] = {}
        self._placed: dict[str, list[str]] = {}  # request id -> instances holding its micro-requests
        self._turn = 0
        self.max_tracked = 1_000_000

    # -- pair choice -------------------------------------------------------------------------------------------

    def _predictor(self, inst: InstanceView) -> InstancePredictor | None:
        return self.predictor.instance(inst.id, inst.tp, inst.max_num_batched_tokens, inst.max_num_seqs)

    def _pair(
        self, instances: Sequence[InstanceView], now: float
    ) -> tuple[InstanceView | None, InstanceView | None, dict[str, InstancePredictor | None]]:
        """(A, B, predictors): the least-loaded prefill-capable instance and the least-loaded other
        decode-capable one, by predicted busy time, then in-flight requests and queued prompt passes; equally
        loaded instances take turns. Also remembers each view for ``on_start``."""
        get = self.predictor.instance
        views = self._views
        preds: dict[str, InstancePredictor | None] = {}
        loaded: list[tuple[tuple[float, float], InstanceView]] = []
        for i in instances:
            views[i.id] = i
            if not (i.healthy and not i.draining):
                continue
            pred = preds[i.id] = get(i.id, i.tp, i.max_num_batched_tokens, i.max_num_seqs)
            busy = pred.busy_s(now) if pred is not None else 0.0
            loaded.append(((busy, i.inflight + i.queued_prefill_tokens / max(i.max_num_batched_tokens, 1)), i))
        turn = self._turn
        self._turn += 1
        a = _rotating_min([x for x in loaded if x[1].role != "decode"], turn)
        b = _rotating_min([x for x in loaded if x[1].role != "prefill" and x[1] is not a], turn)
        return a, b, preds

    # -- route -------------------------------------------------------------------------------------------------

    def _decide(self, req: RequestInfo, a: InstanceView, b: InstanceView, s: int, reason: str) -> RouteDecision:
        p = req.prompt_tokens
        d = max(req.predicted_output_tokens, 1)
        total = p + d
        if s >= total:
            return RouteDecision(kind="colocated", first=a.id, split_token=p + req.max_tokens, reason=reason)
        if s <= 0:
            return RouteDecision(kind="colocated", first=b.id, split_token=p + req.max_tokens, reason=reason)
        if s == p:
            return RouteDecision(kind="disaggregated", first=a.id, second=b.id, split_token=p, phi=p / total, reason=reason)
        return RouteDecision(
            kind="split", first=a.id, second=b.id, split_token=s, handoff_after=max(s - p, 0), phi=s / total,
            reason=reason,
        )

    def route(self, req: RequestInfo, instances: Sequence[InstanceView], now: float) -> RouteDecision:
        """Choose the pair and the split point of one request (module doc). No side effect on the queues.

        Raises:
            NoInstanceError: no available instance may decode the request.
        """
        a, b, preds = self._pair(instances, now)
        p = req.prompt_tokens
        d = max(req.predicted_output_tokens, 1)
        total = p + d
        if b is None:
            if a is not None and a.role == "both":
                b = a
            else:
                raise NoInstanceError("split: no available instance with role 'decode' or 'both'")
        if a is None or a is b:
            return self._count(RouteDecision(
                kind="colocated", first=b.id, split_token=p + req.max_tokens,
                reason="single-instance: no second instance to split with",
            ))
        pa, pb = preds.get(a.id), preds.get(b.id)
        if pa is None or pb is None or p <= 0:
            why = "empty prompt" if p <= 0 else "no performance profile"
            return self._count(self._decide(req, a, b, p, f"cold-start: {why}; pure disaggregation"))
        lo = 0.0  # B may decode, so it may prefill the rest of the prompt (s < P needs partial-prefix support)
        hi = 1.0 if a.role == "both" else p / total
        s, reason = self._search(req, pa, pb, lo, hi, now)
        partial_ok = a.supports_partial_prefix and b.supports_partial_prefix
        if 0 < s < p and not partial_ok:
            reason = f"safe-split: s={s} < P={p} needs partial-prefix KV support; using s=P ({reason})"
            s = p
        k = s - p
        if self.kv_block_tokens and 0 < k < d and (p + k - 1) % self.kv_block_tokens == 0:
            s = s + 1 if k + 1 < d else s - 1
            reason += f"; moved off a KV block boundary to s={s}"
        return self._count(self._decide(req, a, b, s, reason))

    def _search(
        self, req: RequestInfo, pa: InstancePredictor, pb: InstancePredictor, lo: float, hi: float, now: float
    ) -> tuple[int, str]:
        """Libra Alg. 1 lines 3–10 on the pair's predictors; returns (s, reason)."""
        total = req.prompt_tokens + max(req.predicted_output_tokens, 1)
        if hi - lo <= 0.0:
            s = min(max(math.ceil(lo * total - 1e-9), 0), total)
            return s, f"role-bound: only s={s} is allowed by the roles"
        r = search_split_point(
            req.prompt_tokens, req.predicted_output_tokens, pa, pb, now,
            max_probes=self.max_probes, epsilon_s=self.epsilon_s, lo=lo, hi=hi,
        )
        word = "balanced" if r.balanced else "bounded"
        return r.split_token, (
            f"{word}: s={r.split_token} phi={r.split_token / total:.3f} T_A-now={r.finish_a_s - now:.3f}s "
            f"T_B-now={r.finish_b_s - now:.3f}s after {r.probes} probes"
        )

    def _count(self, decision: RouteDecision) -> RouteDecision:
        self.reasons[decision.reason.split(":", 1)[0].split(" ", 1)[0]] += 1
        return decision

    # -- notifications -----------------------------------------------------------------------------------------

    def on_start(self, req: RequestInfo, decision: RouteDecision, now: float) -> None:
        """Commit the decision's micro-requests to the virtual queues of its instances (Alg. 1 line 11)."""
        p = req.prompt_tokens
        d = max(req.predicted_output_tokens, 1)
        if decision.kind == "colocated":
            parts = [(decision.first, split_micro_requests(p, d, p + d)[0])]
        else:
            alpha, beta = split_micro_requests(p, d, decision.split_token)
            parts = [(decision.first, alpha), (decision.second or "", beta)]
        placed: list[str] = []
        for inst_id, micro in parts:
            view = self._views.get(inst_id)
            if micro is None or view is None:
                continue
            pred = self._predictor(view)
            if pred is None:
                continue
            pred.commit(req.request_id, micro, now)
            placed.append(inst_id)
        if placed:
            self._placed[req.request_id] = placed
            if len(self._placed) > self.max_tracked:  # finish notifications lost: forget the oldest
                del self._placed[next(iter(self._placed))]

    def on_finish(self, request_id: str, now: float) -> None:
        """Take what is left of the request's micro-requests off the virtual queues."""
        for inst_id in self._placed.pop(request_id, ()):
            pred = self.predictor.get(inst_id)
            if pred is not None:
                pred.finish(request_id, now)
