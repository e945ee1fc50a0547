"""Role reassignment in the simulated cluster: BanaServe Alg. 1 with a role flip
(``fulcrum.rebalancing.role_reassignment``) adapted to the simulator's :data:`~fulcrum.simulator.RoleBalancer`
hook. The simulator measures each instance's compute and memory utilisation (:class:`~fulcrum.simulator.RoleView`);
this closure keeps the hysteresis state (last flip, per-instance dwell) between ticks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from fulcrum.rebalancing.role_reassignment import (
    InstanceUtilisation,
    RoleBalanceConfig,
    RoleBounds,
    plan_role_change,
)
from fulcrum.simulator import RoleBalancer, RoleView

__all__ = ["role_balancer"]


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
