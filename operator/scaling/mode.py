"""Auto mode: when to move between Disaggregated and Unified serving, and how (make-before-break).

Each tick the planner plans the forecast load both ways (:func:`fulcrum.ratio.planner.plan_disaggregated`,
:func:`~fulcrum.ratio.planner.plan_unified`). Picking the cheaper plan every tick — as ``plan()`` does for one
decision — made Auto flip every few minutes on a load where the two modes cost about the same (issue 13). A
switch is not free: the new pools are provisioned for a whole pod start-up before they serve, and the pools of
the old mode drain after. :func:`decide_mode` therefore switches only when

- over the last ``agree_ticks`` ticks the other mode's plan was never dearer than the serving mode's (or the
  serving mode's plan is infeasible and the other's is not), and it saves GPUs by one of two measures: the
  *tick saving*, the least of the ticks' savings (GPUs of the serving plan − GPUs of the other plan), or the
  *held saving*, the GPUs each mode would hold over those ticks — the largest of its plans there, what the
  scaling policy's stabilisation window keeps (:mod:`fulcrum.scaling.policy`) — the serving mode's minus the
  other's. Plan noise cannot trigger either. The tick saving alone kept Auto Disaggregated through the
  synthetic trace's steady half: its Disaggregated plan flapped 4/6/8 GPUs with the interval's ISL (a need of
  0.93–1.07 decode instances), so Unified's steady 4 was seldom cheaper five ticks running, while the pools
  held the 8 (issue 13). The held saving alone delayed the Azure conversation trace's switch by four minutes,
  where a Unified plan of 6 GPUs in the window counted against the steady 4;
- the saving is a real share (``min_saving_fraction``, 30%) of the serving plan (tick saving) or of what the
  serving mode holds (held saving), whichever measure gives the larger share: the two plans come from two models
  (:func:`fulcrum.ratio.planner.plan_disaggregated`, :func:`~fulcrum.ratio.planner.plan_unified`) whose
  errors differ, and a near-tie switched on lost to staying put;
- the expected saving (that measure's) over the horizon pays for the switch: ``saving · horizon_s > G_new · t_startup``,
  G_new = GPUs of the other plan, t_startup = pod start-up (the GPU-seconds the new pools are held before
  serving);
- the serving mode has served for at least ``min_dwell_s`` (hysteresis);
- there is no SLO pressure (a backlog or a missed SLO makes both plans grow with the backlog, not the load);
- both deployments fit ``maxGPUs`` at once (make-before-break needs room for both);
- the caller's last check agrees (``confirm``: the ``fulcrum`` planner asks whether the other mode is still
  the cheaper one at the highest rate planned for over the horizon, so a lull in a bursty load does not move
  it to the mode that serves the next burst worse).

A switch then runs **make-before-break**: phase ``start`` provisions the new mode's pools while the old ones
keep serving and may not shrink (phase ``starting`` each tick after); when every instance of the new pools is
ready, phase ``cut-over`` empties the old pools (they drain: in-flight requests finish) and new requests go to
the new mode. Ready serving capacity therefore never drops during a switch. The router (and the simulator)
keeps sending new requests down the old mode's path as long as the old pools are in the target.

Pure: no I/O, no clock (the caller passes ``now_s``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

__all__ = ["ModeName", "ModePhase", "ModeSwitchSettings", "ModeState", "ModeDecision", "decide_mode", "other_mode"]

ModeName = Literal["Disaggregated", "Unified"]
"""A serving mode (the values of :class:`fulcrum.api.llmserve.Mode` that can serve)."""
ModePhase = Literal["steady", "start", "starting", "cut-over"]
"""Where a tick leaves the switch: none under way, started now, new pools still starting, old pools emptied now."""


def other_mode(mode: ModeName) -> ModeName:
    """The mode Auto would switch to from ``mode``."""
    return "Unified" if mode == "Disaggregated" else "Disaggregated"


@dataclass(frozen=True)
class ModeSwitchSettings:
    """Tunables of the Auto-mode switch, each with the reason for its default.

    Attributes:
        agree_ticks: consecutive ticks whose plans must all find the other mode cheaper (5: plan noise of a
            steady load lasts a tick or two; a real change of the load mix lasts longer).
        min_dwell_s: least time a mode serves before the next switch, seconds (900: five pod start-ups of the
            shipped specs; a switch that pays back its start-up within a quarter hour is still allowed).
        horizon_s: how long the saving is counted over when weighed against the start-up cost, seconds (900:
            the dwell, the least time the new mode will then serve).
        min_saving_fraction: least saving, as a share of the serving plan's GPUs, worth a switch (0.3: the two
            modes' plans come from different models whose errors do not cancel; on the Azure conversation trace
            a Unified plan 25% cheaper than the Disaggregated one served at 2% more GPU-hours once switched to,
            issue 13).
    """

    agree_ticks: int = 5
    min_dwell_s: float = 900.0
    horizon_s: float = 900.0
    min_saving_fraction: float = 0.3

    def __post_init__(self) -> None:
        if self.agree_ticks < 1:
            raise ValueError(f"agree_ticks must be >= 1, got {self.agree_ticks}")
        if not (self.min_dwell_s >= 0 and self.horizon_s > 0 and math.isfinite(self.horizon_s)):
            raise ValueError(f"bad dwell/horizon: {self.min_dwell_s}, {self.horizon_s}")
        if not 0.0 <= self.min_saving_fraction < 1.0:
            raise ValueError(f"min_saving_fraction must be in [0, 1), got {self.min_saving_fraction}")


@dataclass(frozen=True)
class ModeState:
    """What the switch remembers between ticks.

    Attributes:
        serving: the mode new requests are routed by.
        since_s: when ``serving`` began to serve (the last cut-over; the start for the initial mode), seconds.
        switching_to: the mode whose pools are starting (make-before-break under way), or None.
        started_s: when the switch under way began, seconds (NaN when none).
        savings: GPUs the other mode's plan would save, one per recent tick, newest last (+inf: the serving
            plan is infeasible and the other's is not; −inf: the other plan is infeasible).
        plans: (GPUs of the serving mode's plan, GPUs of the other mode's plan), one per recent tick, newest
            last (the held GPUs of the module doc are the largest of each over the last ``agree_ticks``).
    """

    serving: ModeName
    since_s: float = 0.0
    switching_to: ModeName | None = None
    started_s: float = math.nan
    savings: tuple[float, ...] = field(default_factory=tuple)
    plans: tuple[tuple[int, int], ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class ModeDecision:
    """One tick of the switch: the new state, the phase and why."""

    state: ModeState
    phase: ModePhase
    reason: str


def _saving(gpus: Mapping[ModeName, int], feasible: Mapping[ModeName, bool], serving: ModeName) -> float:
    other = other_mode(serving)
    if feasible[serving] and not feasible[other]:
        return -math.inf
    if feasible[other] and not feasible[serving]:
        return math.inf
    return float(gpus[serving] - gpus[other])


def _share(saving: float, of: float) -> float:
    """``saving`` GPUs as a share of ``of`` GPUs (+inf for a positive saving of nothing, 0 for none)."""
    if of > 0:
        return saving / of
    return math.inf if saving > 0 else 0.0


def decide_mode(
    state: ModeState,
    *,
    now_s: float,
    gpus: Mapping[ModeName, int],
    feasible: Mapping[ModeName, bool],
    new_pools_ready: bool,
    pressure: bool,
    room: bool,
    startup_s: float,
    settings: ModeSwitchSettings = ModeSwitchSettings(),
    confirm: Callable[[ModeName], tuple[bool, str]] | None = None,
) -> ModeDecision:
    """Advance the Auto-mode switch by one tick (see the module doc).

    Args:
        state: the switch's memory; a new one is returned in the decision.
        now_s: time of this tick, seconds.
        gpus: GPUs each mode's plan needs for the forecast load.
        feasible: whether each mode's plan meets the SLOs within the budget.
        new_pools_ready: every instance of the pools of ``state.switching_to`` is ready (ignored when no switch
            is under way).
        pressure: the last interval missed the SLO with work queued, or a backlog is building.
        room: the serving pools and the other mode's plan fit ``maxGPUs`` together.
        startup_s: pod start-up, seconds (the cost side: GPU-seconds held before serving).
        settings: tunables.
        confirm: a last check, called with the serving mode only when every other condition for a switch holds
            (the planner's: is the other mode still the cheaper one at the peak load of the horizon?); returns
            (go, reason). None: no such check.

    Returns:
        The decision: phase ``steady`` (serve ``state.serving`` only), ``start`` / ``starting`` (keep serving
        the old mode, whose pools may not shrink, while the new mode's start), or ``cut-over`` (empty the old
        pools now; ``state.serving`` is the new mode).
    """
    if state.switching_to is not None:
        to = state.switching_to
        if new_pools_ready:
            new = ModeState(serving=to, since_s=now_s)
            return ModeDecision(new, "cut-over", f"{to} pools ready: {state.serving} pools drain")
        return ModeDecision(state, "starting", f"{to} pools starting; {state.serving} keeps serving")
    saving = _saving(gpus, feasible, state.serving)
    other = other_mode(state.serving)
    k = settings.agree_ticks
    recent = (state.savings + (saving,))[-k:]
    plans = (state.plans + ((gpus[state.serving], gpus[other]),))[-k:]
    st = replace(state, savings=recent, plans=plans)
    if len(recent) < k or min(recent) < 0:
        return ModeDecision(st, "steady", f"{state.serving}: {other} not cheaper over {k} ticks")
    # The saving, as the larger share of the two measures (module doc): the least saving of a tick, of the
    # serving plan's GPUs now; the held saving, of the GPUs the serving mode would hold. +inf while the serving
    # plan is infeasible and the other's is not in every tick.
    held_serving = max(s for s, _ in plans)
    tick_saving = (min(recent), float(gpus[state.serving]))
    held_saving = (float(held_serving - max(o for _, o in plans)), float(held_serving))
    gain, of = max(tick_saving, held_saving, key=lambda m: _share(*m))
    if gain <= 0:
        return ModeDecision(st, "steady", f"{state.serving}: {other} not cheaper over {k} ticks")
    share = _share(gain, of)
    if share < settings.min_saving_fraction:
        return ModeDecision(
            st, "steady",
            f"{state.serving}: {other} saves {share:.0%} of its GPUs < {settings.min_saving_fraction:.0%}")
    dwell = now_s - state.since_s
    if dwell < settings.min_dwell_s:
        return ModeDecision(st, "steady", f"{state.serving}: in mode {dwell:.0f} s < dwell {settings.min_dwell_s:.0f} s")
    if pressure:
        return ModeDecision(st, "steady", f"{state.serving}: SLO pressure, no mode switch now")
    if not room:
        return ModeDecision(st, "steady", f"{state.serving}: no GPU room to start {other} beside it")
    benefit = gain * settings.horizon_s
    cost = gpus[other] * startup_s
    if benefit <= cost:
        return ModeDecision(
            st, "steady", f"{state.serving}: saving {benefit:.0f} GPU·s over {settings.horizon_s:.0f} s ≤ start-up {cost:.0f}"
        )
    if confirm is not None:
        go, why = confirm(state.serving)
        if not go:
            return ModeDecision(st, "steady", f"{state.serving}: {why}")
    new = ModeState(serving=state.serving, since_s=state.since_s, switching_to=other, started_s=now_s)
    return ModeDecision(new, "start", f"switch {state.serving}→{other}: saves {gain:g} GPUs (≥ {cost:.0f} GPU·s start-up)")
