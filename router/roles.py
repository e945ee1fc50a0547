"""Role reassignment in the live router: a duty (prefill or decode) for every ``both`` instance, re-evaluated each
second with BanaServe's Algorithm 1 as a role flip (BanaServe §4.3; ``fulcrum.rebalancing.role_reassignment``).

With router config ``roles.enabled``, each available instance registered with role ``both`` (a ``kv_both`` pool)
holds a duty. The policies see it as the instance's role (:meth:`RoleBalancer.apply`): a prefill-duty instance
is shown as ``prefill`` (it takes prefill legs and split A legs, no whole requests and no decode legs), a
decode-duty one as ``decode`` (decode legs and whole requests, which DOPD §V-E lets a decode instance prefill
itself). So ``disaggregated``, ``split``, ``load_aware`` with ``disaggregate``, and every other policy follow the
duties without a change of their own. A new instance takes the duty with fewer instances (ties: decode, the duty
that can also serve whole requests).

**Utilisation** (BanaServe eq. 32, U = compute + memory ∈ [0, 2]), measured by the router itself:

- prefill duty: compute = prompt tokens dispatched and not yet prefilled over the engine's
  ``max_num_batched_tokens`` (the share of one step's token budget the queue fills, clipped to 1); memory = the
  oldest such prefill's wait so far over the TTFT SLO ``roles.ttft_slo_s`` (clipped to 1);
- decode duty: compute = requests in flight over ``max_concurrency`` (the batch slots taken); memory = KV tokens
  held over ``kv_capacity_tokens`` (the engine's scraped ``kv_cache_usage_perc`` when the capacity is unknown, 0
  when neither is known).

Every ``roles.interval_s`` :meth:`RoleBalancer.step` calls
:func:`~fulcrum.rebalancing.role_reassignment.plan_role_change` with the bounds ``min_prefill`` … ``max_decode``,
``delta``, ``cooldown_s`` and ``dwell_s``: at most one flip per cooldown, none back within the dwell time, and
only a flip that narrows the gap. A decode instance taking prefill duty keeps its in-flight decodes (they finish
there; with ``migrate_on_flip`` and rescheduling enabled the router moves them to decode instances). Metrics:
``fulcrum_router_instance_duty{instance,duty}`` and ``fulcrum_router_role_changes_total{to_duty}``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from fulcrum.rebalancing.role_reassignment import (
    Duty,
    InstanceUtilisation,
    RoleBalanceConfig,
    RoleBounds,
    RoleChange,
    plan_role_change,
)
from fulcrum.router.config import RolesSection
from fulcrum.router.metrics import RouterMetrics
from fulcrum.routing.base import InstanceView

__all__ = ["RoleBalancer", "prefill_utilisation", "decode_utilisation"]

log = logging.getLogger(__name__)


def _clip01(x: float) -> float:
    return min(max(x, 0.0), 1.0)


def prefill_utilisation(view: InstanceView, oldest_wait_s: float, ttft_slo_s: float) -> float:
    """U of a prefill-duty instance (module doc): queued prompt tokens over the step budget + oldest wait over the
    TTFT SLO, each clipped to [0, 1]; in [0, 2]."""
    compute = _clip01(view.queued_prefill_tokens / max(view.max_num_batched_tokens, 1))
    return compute + _clip01(oldest_wait_s / ttft_slo_s)


def decode_utilisation(view: InstanceView) -> float:
    """U of a decode-duty instance (module doc): in-flight requests over the concurrency limit + KV tokens over the
    KV capacity (else the scraped KV usage, else 0), each clipped to [0, 1]; in [0, 2]."""
    compute = _clip01(view.inflight / max(view.max_num_seqs, 1))
    if view.kv_capacity_tokens > 0:
        memory = _clip01(view.running_tokens / view.kv_capacity_tokens)
    elif not math.isnan(view.memory_utilisation):
        memory = _clip01(view.memory_utilisation)
    else:
        memory = 0.0
    return compute + memory


class RoleBalancer:
    """Duties of ``both`` instances and the flips between them (module doc).

    Args:
        metrics: where duties and flips are exported.
    """

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics
        self.duties: dict[str, Duty] = {}
        self.flipped_at_s: dict[str, float] = {}
        self.last_change_s = -math.inf
        self.changes: list[RoleChange] = []
        """Every flip made, newest last (bounded to the last 1,000)."""

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
        """Give new ``both`` instances a duty (the duty with fewer instances; ties: decode) and forget removed ones."""
        both = sorted(v.id for v in views if v.role == "both")
        for gone in set(self.duties) - set(both):
            del self.duties[gone]
            self.flipped_at_s.pop(gone, None)
            self._export(gone, None)
        for iid in both:
            if iid not in self.duties:
                n_p = sum(1 for d in self.duties.values() if d == "prefill")
                n_d = len(self.duties) - n_p
                self.duties[iid] = "prefill" if n_p < n_d else "decode"
                self._export(iid, self.duties[iid])

    def apply(self, views: Sequence[InstanceView]) -> list[InstanceView]:
        """The views with each ``both`` instance's role replaced by its duty (what the policies get)."""
        self.sync(views)
        return [replace(v, role=self.duties[v.id]) if v.role == "both" and v.id in self.duties else v for v in views]

    def utilisations(self, views: Sequence[InstanceView], oldest_wait_s: Mapping[str, float],
                     section: RolesSection) -> list[InstanceUtilisation]:
        """U per ``both`` instance under its duty (module doc); draining or unhealthy ones as not accepting."""
        out = []
        for v in views:
            duty = self.duties.get(v.id)
            if v.role != "both" or duty is None:
                continue
            u = (prefill_utilisation(v, oldest_wait_s.get(v.id, 0.0), section.ttft_slo_s) if duty == "prefill"
                 else decode_utilisation(v))
            out.append(InstanceUtilisation(v.id, duty, u, v.tp, accepting=v.available))
        return out

    def step(self, views: Sequence[InstanceView], oldest_wait_s: Mapping[str, float], section: RolesSection,
             now: float, on_flip: Callable[[RoleChange], None] | None = None) -> RoleChange | None:
        """One evaluation: plan and apply at most one flip (None when nothing changes)."""
        self.sync(views)
        utils = self.utilisations(views, oldest_wait_s, section)
        bounds = RoleBounds(section.min_prefill, section.max_prefill, section.min_decode, section.max_decode)
        cfg = RoleBalanceConfig(delta=section.delta, cooldown_s=section.cooldown_s, dwell_s=section.dwell_s)
        change = plan_role_change(utils, bounds, cfg, now_s=now, last_change_s=self.last_change_s,
                                  flipped_at_s=self.flipped_at_s)
        if change is None:
            return None
        self.duties[change.instance] = change.to_duty
        self.flipped_at_s[change.instance] = now
        self.last_change_s = now
        self.changes.append(change)
        del self.changes[:-1000]
        self._export(change.instance, change.to_duty)
        self.metrics.child(self.metrics.role_changes, change.to_duty).inc()
        log.info("instance %s takes %s duty: %s", change.instance, change.to_duty, change.reason)
        if on_flip is not None:
            on_flip(change)
        return change
