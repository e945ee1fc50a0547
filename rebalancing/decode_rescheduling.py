"""Decode rescheduling: move one running decode request from an overloaded to an underloaded decode instance
(ARES §5.2, Algorithm 1).

Pure planning: the caller (the router's rescheduling loop, or the simulator in ``benchmarks/bench_rescheduling.py``)
collects each decode instance's running requests with their current token counts N(r) and predicted remaining
output lengths N̂(r) (ARES §4; :mod:`fulcrum.routing.remaining_length`), calls :func:`plan_migration` about once
a second (Alg. 1 line 3), and executes the returned :class:`Migration` through the handoff protocol (the client's
stream never breaks: engine B continues from the prompt plus the tokens generated so far with A's KV).

The model (ARES §5.2, "Aligning execution time and token load"): an instance's load is the number of tokens in its
running batch, ``N_i = Σ_r N(r)`` — both the decode step time (KV reads) and the KV memory grow linearly with it.
The future load ``N̂_i(t)`` after ``t`` more decode steps is ``Σ_{r: N̂(r) > t} (N(r) + t)``: each request grows
by one token per step until its predicted end, then leaves. The objective is the time-weighted variance of the
loads across instances (eq. 4), ``σ̂² = σ₀² + Σ_{t ∈ H} β_t · Var({N̂_i(t)})``, with ``β_t = γ^(t/h)`` at the
horizon's sample points ``t = h, 2h, …, H`` (a geometric discount of the further future, which Alg. 1 leaves
open).

Algorithm 1, phase by phase:

1. **Classification** (lines 11–16): the weighted workload ``w_i = Σ_t β_t · N̂_i(t)`` (t from 0); overloaded
   ``O = {i : w_i > (1 + θ)·w̄}``; underloaded ``U = {i : N_i(0) < (1 + θ)·w̄}`` as the paper writes it,
   narrowed to targets lighter than the source (``w_t < w_s``): moving work to a heavier instance never reduces
   the variance.
2. **Candidates** (lines 17–22): requests of a source whose predicted remaining tokens exceed the migration
   cost in decode steps, ``N̂(r) > C_mig / T_exec`` (KV bytes over link bandwidth, plus a fixed overhead, over
   the source's step time), and that fit the target's KV memory in the near future,
   ``N_t(0) + N(r) + N̂(r) ≤ C_mem`` (the paper's line 21 writes ``N_t + N̂(r)``; the request's current KV moves
   too, so it is counted). A migration by **recompute** (``recompute_tokens_per_s``: the live router's, since
   vLLM cannot export a running request's KV) also stalls the target: its prefill of the context delays each of
   the target's ``b_t`` running decodes by about C_mig, so the filter there is
   ``N̂(r) > C_mig · (1 + b_t) / T_exec`` (Fulcrum's extension; ARES moves the KV over the link, which
   stalls no batch). Without it, replay measured ARES by recompute 2–8 SLO points below no rescheduling on
   the unified example's ``both`` instances (docs/rebalancing.md).
3. **Selection** (lines 24–31): the candidate that most reduces σ̂² is chosen.

Hysteresis (so nothing ping-pongs; not in the paper, which relies on its 1-s period): a migration must reduce
σ̂² by at least ``min_gain`` (relative), a request is never moved twice within ``request_cooldown_s``, and an
instance that just received a migration is not a source within ``instance_cooldown_s``.

Everything is in tokens, seconds and bytes; no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "DecodeRequestLoad",
    "DecodeInstanceLoad",
    "ReschedulingConfig",
    "Migration",
    "future_loads",
    "weighted_variance",
    "plan_migration",
]


@dataclass(frozen=True, slots=True)
class DecodeRequestLoad:
    """One running decode request as the rescheduler sees it.

    Attributes:
        id: the request's id (any hashable string).
        tokens: N(r), tokens in its KV cache now (prompt + generated), tokens.
        predicted_remaining: N̂(r), predicted output tokens still to generate (ARES §4), tokens (>= 0; +inf
            allowed: it never ends within the horizon).

    Raises:
        ValueError: ``predicted_remaining`` is NaN (it would drop the request from every filter's comparison).
    """

    id: str
    tokens: int
    predicted_remaining: float

    def __post_init__(self) -> None:
        if math.isnan(self.predicted_remaining):
            raise ValueError(f"request {self.id!r}: predicted_remaining must be a number of tokens >= 0, got NaN; "
                             "pass the predictor's estimate (or the horizon for an unknown length)")


@dataclass(frozen=True, slots=True)
class DecodeInstanceLoad:
    """One decode instance's state (ARES Alg. 1 "Collect States").

    Attributes:
        id: the instance's id.
        requests: its running decode requests.
        kv_capacity_tokens: C_mem, the KV cache capacity, tokens (+inf when unknown; 0 or less: never a target).
        step_time_s: T_exec, the current decode step time, seconds (> 0).
        accepting: False for an instance that is draining or unhealthy: never a target.
        batch: b_t, requests in its running batch, when the caller knows more of them than ``requests`` lists
            (the live router folds work it does not track into one pinned entry); None: ``len(requests)``.

    Raises:
        ValueError: ``step_time_s`` not > 0 (0 divided Alg. 1 line 20's cost, NaN turned its filter off) or
            ``kv_capacity_tokens`` NaN (it turned line 21's memory filter off).
    """

    id: str
    requests: tuple[DecodeRequestLoad, ...]
    kv_capacity_tokens: float
    step_time_s: float
    accepting: bool = True
    batch: int | None = None

    def __post_init__(self) -> None:
        if not self.step_time_s > 0:
            raise ValueError(f"instance {self.id!r}: step_time_s must be > 0 seconds, got {self.step_time_s!r}; "
                             "pass the measured decode step time, or a default one while none is measured")
        if math.isnan(self.kv_capacity_tokens):
            raise ValueError(f"instance {self.id!r}: kv_capacity_tokens must be a number of tokens, got NaN; "
                             "pass math.inf when the capacity is unknown")

    @property
    def batch_size(self) -> int:
        """b_t: requests in the running batch (``batch``, else the requests listed)."""
        return len(self.requests) if self.batch is None else max(self.batch, 0)

    @property
    def tokens(self) -> int:
        """N_i(B_i,0): tokens in the running batch now."""
        return sum(r.tokens for r in self.requests)


@dataclass(frozen=True)
class ReschedulingConfig:
    """Parameters of Algorithm 1.

    Attributes:
        theta: θ of lines 15–16, relative margin over the mean weighted workload.
        horizon_steps: H, prediction horizon in decode steps.
        horizon_points: sample points of the horizon (t = H/points, 2H/points, …, H); each costs O(requests).
        discount: γ, the weight of the horizon's last point relative to its first (β_t = γ^(t/H)).
        kv_bytes_per_token: KV cache bytes per token (the model's; the profile's ``kv_bytes_per_token``).
        link_gbps: KV transfer bandwidth, GB/s.
        transfer_overhead_s: fixed cost of one migration (handshake, re-admission), seconds.
        min_gain: least relative reduction of σ̂² that justifies a migration (hysteresis).
        request_cooldown_s: a migrated request is not moved again within this time, seconds.
        instance_cooldown_s: an instance that received a migration is not a source within this time, seconds.
        recompute_tokens_per_s: None (ARES: the KV moves over the link) or the target's prefill throughput,
            tokens/s, for a migration that recomputes the context on the target instead (the live router's,
            vLLM 0.32 cannot export a running request's KV): C_mig is then tokens over it.

    Raises:
        ValueError: a parameter outside its range (NaN included); the message names it.
    """

    theta: float = 0.1
    horizon_steps: int = 512
    horizon_points: int = 8
    discount: float = 0.5
    kv_bytes_per_token: float = 327_680.0  # Llama-2-70B bf16, GQA 8 KV heads: 80 layers × 2 × 8 × 128 × 2 B
    link_gbps: float = 25.0
    transfer_overhead_s: float = 0.005
    min_gain: float = 0.02
    request_cooldown_s: float = 10.0
    instance_cooldown_s: float = 2.0
    recompute_tokens_per_s: float | None = None

    def __post_init__(self) -> None:
        if not (self.theta >= 0 and math.isfinite(self.theta)):
            raise ValueError(f"theta must be >= 0, got {self.theta!r}")
        if self.horizon_steps < 1 or self.horizon_points < 1:
            raise ValueError("horizon_steps and horizon_points must be >= 1")
        if not (0 < self.discount <= 1):
            raise ValueError(f"discount must be in (0, 1], got {self.discount!r}")
        if not (self.kv_bytes_per_token > 0 and self.link_gbps > 0 and self.transfer_overhead_s >= 0):
            raise ValueError("kv_bytes_per_token and link_gbps must be > 0, transfer_overhead_s >= 0")
        if not (0 <= self.min_gain < 1):
            raise ValueError(f"min_gain must be in [0, 1), got {self.min_gain!r}")
        for name in ("request_cooldown_s", "instance_cooldown_s"):
            if not getattr(self, name) >= 0:  # NaN too: it turned the hysteresis off, or rescheduling altogether
                raise ValueError(f"{name} must be a number of seconds >= 0, got {getattr(self, name)!r}")
        if self.recompute_tokens_per_s is not None and not self.recompute_tokens_per_s > 0:
            raise ValueError(f"recompute_tokens_per_s must be > 0 or None, got {self.recompute_tokens_per_s!r}")

    def times(self) -> np.ndarray:
        """The horizon's sample points t (decode steps), shape (points + 1,), starting at 0."""
        return np.linspace(0.0, float(self.horizon_steps), self.horizon_points + 1)

    def weights(self) -> np.ndarray:
        """β_t at :meth:`times`: 1 at t = 0, then γ^(t/H) (eq. 4)."""
        t = self.times()
        return np.power(self.discount, t / self.horizon_steps)

    def migration_seconds(self, tokens: float) -> float:
        """C_mig: seconds to move ``tokens`` tokens of KV cache — over the link, or, with
        ``recompute_tokens_per_s``, by recomputing them on the target."""
        if self.recompute_tokens_per_s is not None:
            return tokens / self.recompute_tokens_per_s + self.transfer_overhead_s
        return tokens * self.kv_bytes_per_token / (self.link_gbps * 1e9) + self.transfer_overhead_s


@dataclass(frozen=True)
class Migration:
    """The chosen move (Alg. 1 line 10 executes it through the router's handoff).

    Attributes:
        request_id, source, target: what moves where.
        tokens: KV tokens moved.
        cost_s: C_mig, seconds.
        variance_before / variance_after: σ̂² (eq. 4) without and with the move, tokens².
        reason: one line for logs and metrics.
    """

    request_id: str
    source: str
    target: str
    tokens: int
    cost_s: float
    variance_before: float
    variance_after: float
    reason: str = field(default="")

    @property
    def gain(self) -> float:
        """Relative reduction of σ̂²."""
        return 1.0 - self.variance_after / self.variance_before if self.variance_before > 0 else 0.0


def _request_profile(r: DecodeRequestLoad, t: np.ndarray) -> np.ndarray:
    """A request's token load at the sample points: N(r) + t while t < N̂(r), else 0."""
    return np.where(t < r.predicted_remaining, r.tokens + t, 0.0)


def future_loads(instances: Sequence[DecodeInstanceLoad], config: ReschedulingConfig) -> np.ndarray:
    """N̂_i(t) for every instance and sample point; shape (instances, points + 1), tokens."""
    t = config.times()
    out = np.zeros((len(instances), t.size))
    for i, inst in enumerate(instances):
        for r in inst.requests:
            out[i] += _request_profile(r, t)
    return out


def weighted_variance(loads: np.ndarray, weights: np.ndarray) -> float:
    """σ̂² of eq. (4): Σ_t β_t · Var_i(N̂_i(t)) over the sample points (t = 0 has β = 1: σ₀²), tokens²."""
    if loads.shape[0] < 2:
        return 0.0
    return float(np.dot(weights, loads.var(axis=0)))


def plan_migration(
    instances: Sequence[DecodeInstanceLoad],
    config: ReschedulingConfig = ReschedulingConfig(),
    *,
    now_s: float = 0.0,
    last_moved_s: Mapping[str, float] | None = None,
    last_received_s: Mapping[str, float] | None = None,
) -> Migration | None:
    """ARES Algorithm 1, one period: the single migration that most reduces σ̂², or None.

    Args:
        instances: every decode instance (draining ones with ``accepting=False``; they can still be sources).
        config: parameters.
        now_s: the caller's clock, seconds (only compared with the two maps below).
        last_moved_s: request id → time it was last migrated (request cooldown).
        last_received_s: instance id → time it last received a migration (instance cooldown).

    Returns:
        The best :class:`Migration`, or None when no instance is overloaded, no candidate passes the cost and
        memory filters, or the best gain is below ``min_gain``.

    Complexity: O(|O|·R·|U|·points), as the paper's §5.2 analysis (R = requests per instance).
    """
    n = len(instances)
    if n < 2:
        return None
    moved = last_moved_s or {}
    received = last_received_s or {}
    t = config.times()
    beta = config.weights()
    loads = future_loads(instances, config)
    base = weighted_variance(loads, beta)
    if base <= 0:
        return None
    # Phase 1: classification (lines 11-16)
    w = loads @ beta
    w_mean = float(w.mean())
    now_tokens = loads[:, 0]
    over = [i for i in range(n) if w[i] > (1 + config.theta) * w_mean
            and now_s - received.get(instances[i].id, -math.inf) >= config.instance_cooldown_s]
    if not over:
        return None
    under = [j for j in range(n) if instances[j].accepting and now_tokens[j] < (1 + config.theta) * w_mean]
    best: Migration | None = None
    best_var = base * (1.0 - config.min_gain)
    mean_t = loads.mean(axis=0)
    var0 = loads.var(axis=0)
    k = float(n)
    for s in sorted(over, key=lambda i: -w[i]):
        src = instances[s]
        for r in src.requests:
            if now_s - moved.get(r.id, -math.inf) < config.request_cooldown_s:
                continue
            cost = config.migration_seconds(r.tokens)
            cost_steps = cost / src.step_time_s
            # Phase 2, line 20: enough remaining work to repay the move, in decode steps of the source
            if r.predicted_remaining <= cost_steps:
                continue
            prof = _request_profile(r, t)
            for d in under:
                if d == s or w[d] >= w[s]:
                    continue
                dst = instances[d]
                # A recompute stalls the target's running batch for about C_mig (module doc, phase 2)
                if config.recompute_tokens_per_s is not None and \
                        r.predicted_remaining <= cost_steps * (1 + dst.batch_size):
                    continue
                # Phase 2, line 21: memory safety on the target (its KV now + the request's KV and growth)
                if now_tokens[d] + r.tokens + r.predicted_remaining > dst.kv_capacity_tokens:
                    continue
                # Phase 3: the variance after the move, from the per-point loads (O(points), not O(n))
                ls, ld = loads[s] - prof, loads[d] + prof
                var_t = var0 + ((ls - mean_t) ** 2 - (loads[s] - mean_t) ** 2
                                + (ld - mean_t) ** 2 - (loads[d] - mean_t) ** 2) / k
                v = float(np.dot(beta, var_t))
                if v < best_var:
                    best_var = v
                    best = Migration(
                        request_id=r.id, source=src.id, target=dst.id, tokens=r.tokens, cost_s=cost,
                        variance_before=base, variance_after=v,
                        reason=f"w={w[s]:.0f} > (1+θ)·w̄={(1 + config.theta) * w_mean:.0f}; "
                               f"σ̂² {base:.3g} → {v:.3g}",
                    )
    return best
