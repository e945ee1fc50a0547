"""Duties of ``both`` instances: which of a ``kv_both`` pool's instances prefill and which decode, measured and
flipped with BanaServe's Algorithm 1 (§4.3, eq. 32; :func:`~fulcrum.rebalancing.role_reassignment.plan_role_change`).

One book, two drivers: the live router (``fulcrum.router.roles.RoleBalancer``, which adds its metrics) and the
simulated router of ``fulcrum replay`` (``fulcrum.replay.roles``). Both keep a :class:`DutyBook`, show every
routing policy each ``both`` instance with its duty as the instance's role (:meth:`DutyBook.apply`: a prefill-duty
instance is shown as ``prefill`` — prefill legs and split A legs, no whole requests, no decode legs — a decode-duty
one as ``decode`` — decode legs and whole requests, which DOPD §V-E lets a decode instance prefill itself), and
call :meth:`DutyBook.step` once per period. A new instance takes the duty with fewer instances (ties: decode, the
duty that can also serve whole requests).

**Utilisation** (BanaServe eq. 32, U = compute + memory ∈ [0, 2]), from the router's own accounting of an
instance (:class:`~fulcrum.routing.base.InstanceView`):

- prefill duty: compute = prompt tokens dispatched and not yet prefilled over the engine's
  ``max_num_batched_tokens`` (the share of one step's token budget the queue fills, clipped to 1); memory = the
  oldest such prefill's wait so far over the TTFT SLO (clipped to 1);
- decode duty: compute = requests in flight over the batch at which the instance's TPOT reaches the SLO (the
  plan's ``RoutingParams.decode_concurrency``, at most ``max_num_seqs``; ``max_num_seqs`` when not planned);
  memory = KV tokens held over ``kv_capacity_tokens`` (the engine's scraped ``kv_cache_usage_perc`` when the
  capacity is unknown, 0 when neither is known).

The decode side's C_max is the SLO's batch, not the engine's: a decode step slows with its batch, and past the
SLO batch every request in it misses TPOT while ``max_num_seqs`` (256, the CUDA-graph cap) is far off. Measured
on ``examples/llmserve-unified-70b-a100.yaml`` with ``roleReassignment`` (``fulcrum replay --policy fulcrum``, A100
TP 4, SLO batch 88 of 256): counted over ``max_num_seqs`` a decode instance at its TPOT limit read 0.34 + its KV
share, prefill duty won every flip, and role reassignment *cost* attainment on the Azure conversation trace
(95.8% without it, 92.2% with it: TPOT 96.8% → 92.3%); counted over the SLO batch it reached 99.2%, and on the
code trace 68.0% (39.1% without, 67.7% before), at the same GPU-hours.

Pure: no I/O, no clock (the caller passes ``now``).
"""

from __future__ import annotations

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
from fulcrum.routing.base import InstanceView

__all__ = ["DutyBook", "decode_utilisation", "prefill_utilisation"]


def _clip01(x: float) -> float:
    return min(max(x, 0.0), 1.0)


def prefill_utilisation(view: InstanceView, oldest_wait_s: float, ttft_slo_s: float) -> float:
    """U of a prefill-duty instance (module doc): queued prompt tokens over the step budget + the oldest queued
    prefill's wait (seconds) over the TTFT SLO (seconds), each clipped to [0, 1]; in [0, 2]."""
    compute = _clip01(view.queued_prefill_tokens / max(view.max_num_batched_tokens, 1))
    return compute + _clip01(oldest_wait_s / ttft_slo_s)


def decode_utilisation(view: InstanceView, slo_batch: int | None = None) -> float:
    """U of a decode-duty instance (module doc): in-flight requests over ``slo_batch`` (the most requests one
    instance decodes within the TPOT SLO; None or above ``max_num_seqs``: ``max_num_seqs``) + KV tokens over the
    KV capacity (else the scraped KV usage, else 0), each clipped to [0, 1]; in [0, 2]."""
    limit = view.max_num_seqs if slo_batch is None else min(slo_batch, view.max_num_seqs)
    compute = _clip01(view.inflight / max(limit, 1))
    if view.kv_capacity_tokens > 0:
        memory = _clip01(view.running_tokens / view.kv_capacity_tokens)
    elif not math.isnan(view.memory_utilisation):
        memory = _clip01(view.memory_utilisation)
    else:
        memory = 0.0
    return compute + memory


class DutyBook:
    """The duty of every ``both`` instance, the flips made and the hysteresis state between periods (module doc).

    Args:
        on_assign: called with (instance id, duty) whenever an instance takes a duty, and (instance id, None) when
            it is forgotten (the router exports duties as a metric); None: nothing.

    Attributes:
        duties: instance id → its duty.
        flipped_at_s: instance id → time of its last flip, seconds (the dwell rule).
        last_change_s: time of the pool's last flip, seconds (the cooldown rule).
        changes: every flip made, newest last (bounded to the last 1,000).
    """

    def __init__(self, on_assign: Callable[[str, Duty | None], None] | None = None) -> None:
        self.duties: dict[str, Duty] = {}
        self.flipped_at_s: dict[str, float] = {}
        self.last_change_s = -math.inf
        self.changes: list[RoleChange] = []
        self._on_assign = on_assign

    def _assigned(self, iid: str, duty: Duty | None) -> None:
        if self._on_assign is not None:
            self._on_assign(iid, duty)

    def sync(self, views: Sequence[InstanceView]) -> None:
        """Give new ``both`` instances a duty (the duty with fewer instances; ties: decode) and forget removed ones."""
        both = sorted(v.id for v in views if v.role == "both")
        for gone in set(self.duties) - set(both):
            del self.duties[gone]
            self.flipped_at_s.pop(gone, None)
            self._assigned(gone, None)
        for iid in both:
            if iid not in self.duties:
                n_p = sum(1 for d in self.duties.values() if d == "prefill")
                n_d = len(self.duties) - n_p
                self.duties[iid] = "prefill" if n_p < n_d else "decode"
                self._assigned(iid, self.duties[iid])

    def apply(self, views: Sequence[InstanceView]) -> list[InstanceView]:
        """The views with each ``both`` instance's role replaced by its duty (what the policies get)."""
        self.sync(views)
        return [replace(v, role=self.duties[v.id]) if v.role == "both" and v.id in self.duties else v for v in views]

    def utilisations(self, views: Sequence[InstanceView], oldest_wait_s: Mapping[str, float],
                     ttft_slo_s: float, decode_slo_batch: int | None = None) -> list[InstanceUtilisation]:
        """U per ``both`` instance under its duty (module doc); draining or unhealthy ones as not accepting.

        Args:
            views: the instances as registered (``both`` ones unchanged by :meth:`apply`).
            oldest_wait_s: instance id → how long its oldest prompt not yet prefilled has waited, seconds.
            ttft_slo_s: the TTFT SLO, seconds.
            decode_slo_batch: the batch at which a decode-duty instance's TPOT reaches the SLO (the plan's
                ``RoutingParams.decode_concurrency``), requests; None: ``max_num_seqs``.
        """
        out = []
        for v in views:
            duty = self.duties.get(v.id)
            if v.role != "both" or duty is None:
                continue
            u = (prefill_utilisation(v, oldest_wait_s.get(v.id, 0.0), ttft_slo_s) if duty == "prefill"
                 else decode_utilisation(v, decode_slo_batch))
            out.append(InstanceUtilisation(v.id, duty, u, v.tp, accepting=v.available))
        return out

    def step(self, views: Sequence[InstanceView], oldest_wait_s: Mapping[str, float], ttft_slo_s: float,
             bounds: RoleBounds, config: RoleBalanceConfig, now: float,
             decode_slo_batch: int | None = None) -> RoleChange | None:
        """One period: plan (BanaServe Alg. 1 with a role flip) and apply at most one flip (``decode_slo_batch``:
        :meth:`utilisations`).

        Returns:
            The flip made, or None when nothing changes (see :func:`plan_role_change`).
        """
        self.sync(views)
        utils = self.utilisations(views, oldest_wait_s, ttft_slo_s, decode_slo_batch)
        change = plan_role_change(utils, bounds, config, now_s=now, last_change_s=self.last_change_s,
                                  flipped_at_s=self.flipped_at_s)
        if change is None:
            return None
        self.duties[change.instance] = change.to_duty
        self.flipped_at_s[change.instance] = now
        self.last_change_s = now
        self.changes.append(change)
        del self.changes[:-1000]
        self._assigned(change.instance, change.to_duty)
        return change
