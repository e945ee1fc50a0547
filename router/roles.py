"""Role reassignment in the live router: a duty (prefill or decode) for every ``both`` instance, re-evaluated each
second with BanaServe's Algorithm 1 as a role flip (BanaServe §4.3; ``fulcrum.rebalancing.role_reassignment``). The
book of duties and the utilisations are :mod:`fulcrum.rebalancing.duties`, shared with ``fulcrum replay``'s
simulated router; this module adds the router's metrics and log.

With router config ``roles.enabled``, each available instance registered with role ``both`` (a ``kv_both`` pool)
holds a duty. The policies see it as the instance's role (:meth:`RoleBalancer.apply`): a prefill-duty instance
is shown as ``prefill`` (it takes prefill legs and split A legs, no whole requests and no decode legs), a
decode-duty one as ``decode`` (decode legs and whole requests, which DOPD §V-E lets a decode instance prefill
itself). So ``disaggregated``, ``split``, ``load_aware`` with ``disaggregate``, and every other policy follow the
duties without a change of their own. A new instance takes the duty with fewer instances (ties: decode, the duty
that can also serve whole requests).

**Utilisation** (BanaServe eq. 32, U = compute + memory ∈ [0, 2]) is measured by the router itself from its own
accounting (:func:`~fulcrum.rebalancing.duties.prefill_utilisation`,
:func:`~fulcrum.rebalancing.duties.decode_utilisation`), with ``roles.ttft_slo_s`` as the TTFT SLO.

Every ``roles.interval_s`` :meth:`RoleBalancer.step` calls
:func:`~fulcrum.rebalancing.role_reassignment.plan_role_change` with the bounds ``min_prefill`` … ``max_decode``,
``delta``, ``cooldown_s`` and ``dwell_s``: at most one flip per cooldown, none back within the dwell time, and
only a flip that narrows the gap. A decode instance taking prefill duty keeps its in-flight decodes (they finish
there; with ``migrate_on_flip`` and rescheduling enabled the router moves them to decode instances). Metrics:
``fulcrum_router_instance_duty{instance,duty}`` and ``fulcrum_router_role_changes_total{to_duty}``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from fulcrum.rebalancing.duties import DutyBook, decode_utilisation, prefill_utilisation
from fulcrum.rebalancing.role_reassignment import (
    Duty,
    RoleBalanceConfig,
    RoleBounds,
    RoleChange,
)
from fulcrum.router.config import RolesSection
from fulcrum.router.metrics import RouterMetrics
from fulcrum.routing.base import InstanceView

__all__ = ["RoleBalancer", "prefill_utilisation", "decode_utilisation"]

log = logging.getLogger(__name__)


class RoleBalancer:
    """Duties of ``both`` instances and the flips between them (module doc): the shared
    :class:`~fulcrum.rebalancing.duties.DutyBook`, its duties exported as metrics and its flips counted and logged.

    Args:
        metrics: where duties and flips are exported.

    Attributes:
        book: the duties, the flips made and the hysteresis state.
    """

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics
        self.book = DutyBook(on_assign=self._export)

    @property
    def duties(self) -> dict[str, Duty]:
        """Instance id → its duty."""
        return self.book.duties

    @property
    def changes(self) -> list[RoleChange]:
        """Every flip made, newest last (bounded to the last 1,000)."""
        return self.book.changes

    def _export(self, iid: str, duty: Duty | None) -> None:
        for d in ("prefill", "decode"):
            if duty is None:
                try:
                    self.metrics.instance_duty.remove(iid, d)
                except KeyError:
                    pass
            else:
                self.metrics.instance_duty.labels(iid, d).set(1.0 if d == duty else 0.0)

    def sync(self, views: Sequence[InstanceView]) -> None:
        """Give new ``both`` instances a duty and forget removed ones (:meth:`DutyBook.sync`)."""
        self.book.sync(views)

    def apply(self, views: Sequence[InstanceView]) -> list[InstanceView]:
        """The views with each ``both`` instance's role replaced by its duty (what the policies get)."""
        return self.book.apply(views)

    def step(self, views: Sequence[InstanceView], oldest_wait_s: Mapping[str, float], section: RolesSection,
             now: float, on_flip: Callable[[RoleChange], None] | None = None) -> RoleChange | None:
        """One evaluation with ``section``'s bounds and thresholds: plan and apply at most one flip (None when
        nothing changes)."""
        bounds = RoleBounds(section.min_prefill, section.max_prefill, section.min_decode, section.max_decode)
        cfg = RoleBalanceConfig(delta=section.delta, cooldown_s=section.cooldown_s, dwell_s=section.dwell_s)
        change = self.book.step(views, oldest_wait_s, section.ttft_slo_s, bounds, cfg, now,
                                decode_slo_batch=section.decode_slo_batch)
        if change is None:
            return None
        self.metrics.child(self.metrics.role_changes, change.to_duty).inc()
        log.info("instance %s takes %s duty: %s", change.instance, change.to_duty, change.reason)
        if on_flip is not None:
            on_flip(change)
        return change
