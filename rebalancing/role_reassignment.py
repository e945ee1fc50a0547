"""Role reassignment: shift a ``kv_both`` instance between prefill and decode duty from measured utilisation
(BanaServe §4.3, Algorithm 1, with a role flip in place of layer migration; DESIGN principle 2).

Within a pool of same-TP instances that all run vLLM with ``kv_role: kv_both``, whether an instance prefills or
decodes is the router's choice. BanaServe balances prefill and decode devices by migrating layers or KV heads
between them (Alg. 1); Fulcrum moves a whole instance from one duty to the other instead, which needs no weight
movement: the instance stops taking new work of its old duty, finishes (or hands off, by the decode
rescheduling handoff) what it holds, and takes the other duty. The effective P/D ratio then follows the load
within seconds, inside the bounds the operator's plan sets (minimum and maximum instances per duty).

Utilisation (BanaServe eq. 32): ``U_d = C_d / C_max + M_d / M_max`` ∈ [0, 2] — compute plus memory. The caller
measures it (for a prefill instance: busy fraction plus prefill-queue pressure; for a decode instance: step
time over the TPOT SLO plus KV-cache use; see ``fulcrum.replay.roles`` and ``docs/router.md``).

Alg. 1 classifies devices with ``load[d] − min(load) > δ`` (overloaded) and ``max(load) − load[d] > δ``
(underloaded), then moves work from an overloaded to an underloaded device while the gap is at least δ. Here
the devices that can be exchanged are whole duties, so the comparison is between the duties' mean utilisations
``Ū_P`` and ``Ū_D``: when ``Ū_P − Ū_D > δ`` the least-utilised decode instance becomes a prefill instance (and
symmetrically). Hysteresis, so that nothing oscillates:

- the flip must shrink the gap: after it, ``|Ū_P' − Ū_D'| < |Ū_P − Ū_D|`` with the load of the duty spread over
  one instance more or less (``Ū·n/(n±1)``, Dynamo's N/(N−1) check);
- at most one flip per ``cooldown_s`` in the pool, and an instance flipped within ``dwell_s`` is not flipped back;
- the bounds: never fewer than ``min_*`` nor more than ``max_*`` instances on a duty.

Pure: no I/O, no clock (the caller passes ``now_s``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["Duty", "InstanceUtilisation", "RoleBounds", "RoleBalanceConfig", "RoleChange", "plan_role_change"]

Duty = Literal["prefill", "decode"]


@dataclass(frozen=True, slots=True)
class InstanceUtilisation:
    """One instance's measured state.

    Attributes:
        id: instance id.
        duty: "prefill" or "decode" (its current role).
        utilisation: U_d of BanaServe eq. 32, compute + memory, in [0, 2].
        tp: tensor-parallel size (only instances of one TP are exchanged).
        accepting: False when draining or unhealthy (neither counted nor flipped).
    """

    id: str
    duty: Duty
    utilisation: float
    tp: int = 1
    accepting: bool = True


@dataclass(frozen=True)
class RoleBounds:
    """Instances per duty the plan allows (the operator's plan: its P and D counts, widened by the spec)."""

    min_prefill: int = 1
    max_prefill: int = 1_000_000
    min_decode: int = 1
    max_decode: int = 1_000_000

    def __post_init__(self) -> None:
        if self.min_prefill < 0 or self.min_decode < 0:
            raise ValueError("minimum instances per duty must be >= 0")
        if self.max_prefill < self.min_prefill or self.max_decode < self.min_decode:
            raise ValueError("maximum instances per duty must be >= the minimum")


@dataclass(frozen=True)
class RoleBalanceConfig:
    """Thresholds of the role balancer.

    Attributes:
        delta: δ of BanaServe Alg. 1, the utilisation gap (on the 0–2 scale of eq. 32) that triggers a flip.
            0.5 by default: on the shifting Azure code→conversation trace (``benchmarks/bench_role_reassignment.py``)
            δ = 0.3 flipped 113 times in 40 min, δ = 0.5 12 times, with better SLO attainment (0.884 vs 0.864).
        cooldown_s: least time between two flips in the pool, seconds.
        dwell_s: least time an instance keeps a duty after a flip, seconds.

    Raises:
        ValueError: ``delta`` not a positive finite number, ``cooldown_s`` or ``dwell_s`` negative or NaN.
    """

    delta: float = 0.5
    cooldown_s: float = 10.0
    dwell_s: float = 60.0

    def __post_init__(self) -> None:
        if not (self.delta > 0 and math.isfinite(self.delta)):
            raise ValueError(f"delta must be positive, got {self.delta!r}")
        if not (self.cooldown_s >= 0 and self.dwell_s >= 0):  # NaN too: it turned the hysteresis off or froze it
            raise ValueError("cooldown_s and dwell_s must be >= 0")


@dataclass(frozen=True)
class RoleChange:
    """One instance to move to the other duty.

    Attributes:
        instance: its id. to_duty: the new duty.
        prefill_utilisation / decode_utilisation: Ū_P and Ū_D that triggered it.
        reason: one line for logs and metrics.
    """

    instance: str
    to_duty: Duty
    prefill_utilisation: float
    decode_utilisation: float
    reason: str


def _spread(u: float, n: int) -> float:
    """Mean utilisation of a duty of ``n`` instances at mean ``u`` once one of them leaves: u·n/(n − 1); +inf for
    the last one (its load would have no instance left, so that flip never shrinks the gap)."""
    return u * n / (n - 1) if n > 1 else math.inf


def plan_role_change(
    instances: Sequence[InstanceUtilisation],
    bounds: RoleBounds = RoleBounds(),
    config: RoleBalanceConfig = RoleBalanceConfig(),
    *,
    now_s: float = 0.0,
    last_change_s: float = -math.inf,
    flipped_at_s: Mapping[str, float] | None = None,
) -> RoleChange | None:
    """The one flip that balances prefill and decode utilisation, or None (BanaServe Alg. 1, adapted).

    Args:
        instances: every instance of the pool (one TP; others are ignored: the TP of the majority is used).
        bounds: instances per duty the plan allows.
        config: thresholds.
        now_s: the caller's clock, seconds; ``last_change_s``: time of the pool's last flip;
        flipped_at_s: instance id → time of its last flip.

    Returns:
        A :class:`RoleChange`, or None when the duties are within δ (or a utilisation is NaN), the bounds forbid
        it, the flip would not shrink the gap (always so for the last instance of a duty, whatever ``min_*``
        allows), or the cooldown/dwell time has not passed.
    """
    if now_s - last_change_s < config.cooldown_s:
        return None
    live = [i for i in instances if i.accepting]
    if not live:
        return None
    tps = [i.tp for i in live]
    tp = max(set(tps), key=tps.count)
    live = [i for i in live if i.tp == tp]
    pre = [i for i in live if i.duty == "prefill"]
    dec = [i for i in live if i.duty == "decode"]
    if not pre or not dec:
        return None
    u_p = sum(i.utilisation for i in pre) / len(pre)
    u_d = sum(i.utilisation for i in dec) / len(dec)
    gap = u_p - u_d
    if not abs(gap) > config.delta:  # within δ, or a utilisation that is not a number (NaN): no information
        return None
    flipped = flipped_at_s or {}
    if gap > 0:  # prefill is the hot duty: a decode instance helps it
        if len(dec) - 1 < bounds.min_decode or len(pre) + 1 > bounds.max_prefill:
            return None
        give, to_duty, n_give, n_take = dec, "prefill", len(dec), len(pre)
        u_take_after, u_give_after = u_p * n_take / (n_take + 1), _spread(u_d, n_give)
    else:
        if len(pre) - 1 < bounds.min_prefill or len(dec) + 1 > bounds.max_decode:
            return None
        give, to_duty, n_give, n_take = pre, "decode", len(pre), len(dec)
        u_take_after, u_give_after = u_d * n_take / (n_take + 1), _spread(u_p, n_give)
    if abs(u_take_after - u_give_after) >= abs(gap):
        return None  # the flip would overshoot: the other duty would be as hot as this one is now
    candidates = [i for i in give if now_s - flipped.get(i.id, -math.inf) >= config.dwell_s]
    if not candidates:
        return None
    pick = min(candidates, key=lambda i: (i.utilisation, i.id))
    return RoleChange(
        instance=pick.id, to_duty=to_duty, prefill_utilisation=u_p, decode_utilisation=u_d,  # type: ignore[arg-type]
        reason=f"Ū_P={u_p:.2f} Ū_D={u_d:.2f} gap {abs(gap):.2f} > δ={config.delta:.2f}; "
               f"after: {u_take_after:.2f} vs {u_give_after:.2f}",
    )
