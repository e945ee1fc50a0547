"""Decode rescheduling in the simulated cluster: ARES Alg. 1 (``fulcrum.rebalancing.decode_rescheduling``) adapted
to the simulator's :data:`~fulcrum.simulator.Rescheduler` hook.

The simulator sits below the router in the layers, so it cannot call the router's planner itself; this module
(above both) joins them. A remaining-length predictor maps (ISL, generated tokens) to the predicted remaining
output tokens N̂(r) (ARES §4); three are used by ``benchmarks/bench_rescheduling.py``:

- ``oracle``: the true remaining length (the simulator knows each request's OSL) — ARES-Oracle;
- a conditional estimate E[L − g | L > g] learnt online from finished requests
  (``fulcrum.routing.remaining_length``) — ARES with a predictor;
- ``current``: no prediction (N̂ = the horizon: every request is assumed to run on), so only the current token
  load decides — the paper's "vLLM + rescheduling" baseline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fulcrum.ratio.profile import PerformanceProfile
from fulcrum.rebalancing.decode_rescheduling import (
    DecodeInstanceLoad,
    DecodeRequestLoad,
    ReschedulingConfig,
    plan_migration,
)
from fulcrum.simulator import DecodeInstanceView, DecodeRequestView, Rescheduler

__all__ = ["RemainingPredictor", "oracle_remaining", "current_only", "learned_remaining", "ares_rescheduler"]

RemainingPredictor = Callable[[DecodeRequestView], float]
"""(a decoding request) → predicted remaining output tokens N̂(r) >= 0."""


def oracle_remaining(r: DecodeRequestView) -> float:
    """The true remaining output tokens (ARES-Oracle; only a simulator can know them)."""
    return float(max(r.osl - r.generated, 0))


def current_only(horizon_steps: int) -> RemainingPredictor:
    """No prediction: every request is assumed to outlive the horizon, so only current loads differ."""

    def predict(_: DecodeRequestView) -> float:
        return float(horizon_steps + 1)

    return predict


def learned_remaining(model: str = "model") -> tuple[RemainingPredictor, Callable[[int, int], None]]:
    """ARES with a predictor learnt online, as the live router runs it: ``E[L − g | L > g]`` per ISL bucket
    (:class:`fulcrum.routing.remaining_length.RemainingLengthPredictor`, its prior until enough requests
    finished), fed every request that finishes (``router/rescheduler.py``: ``observe_finished``).

    Returns:
        (the predictor, the feed): pass the feed as ``Simulation(on_finished=...)``; it takes (ISL, OSL), tokens.
    """
    from fulcrum.routing.remaining_length import RemainingLengthPredictor

    learnt = RemainingLengthPredictor()

    def predict(r: DecodeRequestView) -> float:
        return float(learnt.predict_remaining(model, r.isl, r.generated))

    def feed(isl: int, osl: int) -> None:
        learnt.observe(model, isl, osl)

    return predict, feed


def ares_rescheduler(
    predictor: RemainingPredictor,
    config: ReschedulingConfig = ReschedulingConfig(),
    *,
    profile: PerformanceProfile | None = None,
    link_gbps: float | None = None,
    recompute_tokens_per_s: Callable[[], float] | None = None,
    max_per_tick: int = 1,
) -> Rescheduler:
    """A simulator rescheduler running ARES Alg. 1 once per tick (up to ``max_per_tick`` migrations, each
    planned on the state the previous one leaves).

    Args:
        predictor: N̂(r) for each decoding request.
        config: Alg. 1 parameters; ``kv_bytes_per_token`` and ``link_gbps`` are taken from ``profile`` and
            ``link_gbps`` when given, so the migration cost matches the simulated transfer.
        profile: the simulated model's profile (its KV bytes per token).
        link_gbps: the simulated KV link, GB/s (``SimConfig.kv_link_gbps``).
        recompute_tokens_per_s: for a simulator that migrates by recompute (``SimConfig.migration``), the
            target's prefill throughput now, tokens/s, asked at every tick (the live router's cost filter, whose
            value the operator rewrites with each target): Alg. 1's C_mig is then (P + g) over it.
        max_per_tick: migrations per tick (the paper executes one per period).

    The hysteresis state (request and instance cooldowns) lives in the returned closure.
    """
    import dataclasses

    if profile is not None:
        config = dataclasses.replace(config, kv_bytes_per_token=float(profile.kv_bytes_per_token))
    if link_gbps is not None:
        config = dataclasses.replace(config, link_gbps=float(link_gbps))
    last_moved: dict[str, float] = {}
    last_received: dict[str, float] = {}

    def reschedule(now: float, views: Sequence[DecodeInstanceView]) -> list[tuple[int, int]]:
        cfg = config
        if recompute_tokens_per_s is not None:
            cfg = dataclasses.replace(config, recompute_tokens_per_s=recompute_tokens_per_s())
        loads = [
            DecodeInstanceLoad(
                id=str(v.iid),
                requests=tuple(DecodeRequestLoad(str(r.idx), r.isl + r.generated, predictor(r)) for r in v.requests),
                kv_capacity_tokens=v.kv_capacity_tokens, step_time_s=v.step_time_s, accepting=v.accepting,
            )
            for v in views
        ]
        out: list[tuple[int, int]] = []
        for _ in range(max_per_tick):
            m = plan_migration(loads, cfg, now_s=now, last_moved_s=last_moved, last_received_s=last_received)
            if m is None:
                break
            out.append((int(m.request_id), int(m.target)))
            last_moved[m.request_id] = now
            last_received[m.target] = now
            req = next(r for i in loads if i.id == m.source for r in i.requests if r.id == m.request_id)
            loads = [
                dataclasses.replace(i, requests=tuple(r for r in i.requests if r.id != m.request_id)) if i.id == m.source
                else dataclasses.replace(i, requests=i.requests + (req,)) if i.id == m.target
                else i
                for i in loads
            ]
        return out

    return reschedule
