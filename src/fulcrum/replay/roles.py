"""Role reassignment in the simulated cluster: BanaServe Alg. 1 with a role flip
(``fulcrum.rebalancing.role_reassignment``) adapted to the simulator's two hooks.

- :class:`SimulatedDuties` — what the live router does (router config ``roles``, ``spec.router.roleReassignment``):
  a duty for each instance of a unified (``kv_both``) pool, kept in the router's own
  :class:`~fulcrum.rebalancing.duties.DutyBook`, with the bounds the operator writes from the plan
  (:func:`~fulcrum.target.plan_role_bounds`). ``fulcrum replay`` uses it.
- :func:`role_balancer` — the simulator's own :data:`~fulcrum.simulator.RoleBalancer`: whole P and D instances
  flipped from the simulator's measured compute and memory utilisation (:class:`~fulcrum.simulator.RoleView`);
  the closure keeps the hysteresis state (last flip, per-instance dwell) between ticks. The live system never
  flips a P or D instance; ``benchmarks/bench_role_reassignment.py`` measures the rule with it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from fulcrum.rebalancing.duties import DutyBook
from fulcrum.rebalancing.role_reassignment import (
    InstanceUtilisation,
    RoleBalanceConfig,
    RoleBounds,
    plan_role_change,
)
from fulcrum.routing.base import InstanceView
from fulcrum.simulator import RoleBalancer, RoleView
from fulcrum.target import ClusterTarget, plan_role_bounds

__all__ = ["SimulatedDuties", "role_balancer"]


class SimulatedDuties:
    """The router's role reassignment for :class:`~fulcrum.simulator.Simulation` (its ``duties`` hook): the
    router's :class:`~fulcrum.rebalancing.duties.DutyBook` with the router config the operator writes for
    ``spec.router.roleReassignment`` (``fulcrum.controller.resources``): the TTFT SLO, the default δ, cooldown and
    dwell time, the bounds :func:`~fulcrum.target.plan_role_bounds` gives for the target in force, and its plan's
    SLO decode batch (``RoutingParams.decode_concurrency``, a decode-duty instance's full compute).

    Args:
        ttft_slo_s: the TTFT SLO, seconds (a prefill-duty instance's memory pressure is its oldest wait over it).
        config: δ, cooldown and dwell time (the router's defaults).
        migrate_on_flip: the router config's ``roles.migrate_on_flip`` (off, as the operator writes it).

    Attributes:
        book: the duties and the flips made (``book.changes``).
    """

    def __init__(self, ttft_slo_s: float, config: RoleBalanceConfig = RoleBalanceConfig(),
                 migrate_on_flip: bool = False) -> None:
        if not (ttft_slo_s > 0 and math.isfinite(ttft_slo_s)):
            raise ValueError(f"ttft_slo_s must be positive and finite, got {ttft_slo_s!r}")
        self.book = DutyBook()
        self.ttft_slo_s = ttft_slo_s
        self.config = config
        self.migrate_on_flip = migrate_on_flip

    def apply(self, views: Sequence[InstanceView]) -> list[InstanceView]:
        """``views`` with each ``both`` instance's role replaced by its duty."""
        return self.book.apply(views)

    def step(self, now: float, views: Sequence[InstanceView], oldest_wait_s: Mapping[str, float],
             target: ClusterTarget) -> tuple[str, str] | None:
        """One period: the flip made as (instance id, new duty), or None."""
        planned = plan_role_bounds(target)
        bounds = RoleBounds(*planned) if planned is not None else RoleBounds()
        change = self.book.step(views, oldest_wait_s, self.ttft_slo_s, bounds, self.config, now,
                                decode_slo_batch=target.routing.decode_concurrency)
        return None if change is None else (change.instance, change.to_duty)


def role_balancer(config: RoleBalanceConfig = RoleBalanceConfig(), bounds: RoleBounds = RoleBounds()) -> RoleBalancer:
    """A simulator role balancer: at each tick, at most one flip chosen by :func:`plan_role_change`."""
    last_change = -math.inf
    flipped: dict[str, float] = {}

    def balance(now: float, views: Sequence[RoleView]) -> list[tuple[int, str]]:
        nonlocal last_change
        change = plan_role_change(
            [InstanceUtilisation(str(v.iid), "prefill" if v.role == "prefill" else "decode", v.utilisation, v.tp)
             for v in views],
            bounds, config, now_s=now, last_change_s=last_change, flipped_at_s=flipped,
        )
        if change is None:
            return []
        last_change = now
        flipped[change.instance] = now
        return [(int(change.instance), change.to_duty)]

    return balance
