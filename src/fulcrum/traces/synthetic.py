"""Synthetic request traces, generated deterministically by a seeded function (no file).

- ``synthetic-burst-steady`` (:func:`burst_then_steady`): one hour; for the first 30 minutes a base load of
  1.5 req/s with a 3-minute burst to 8 req/s every 8 minutes (the minute-to-minute swings of the Azure code
  trace, but regular), then 30 minutes of a steady 5 req/s (the Azure conversation trace's level). A planner
  that sizes for the bursts must shrink again when the load turns predictable; one sized for the mean misses
  the bursts. Arrivals are Poisson at the piecewise-constant rate; prompt and output lengths are log-normal
  (medians 800 and 180 tokens, means ≈ 1,100 and 230 — close to the Azure conversation trace's 1,155 and 211),
  clipped to [16, 3,000] and [8, 1,000] tokens so they fit a 4,096-token context.

Pure: the same seed gives the same requests on every platform (``random.Random`` is specified to be
reproducible across versions for ``random()``-based draws).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from fulcrum.workload import Request

__all__ = ["SYNTHETIC_TRACES", "burst_then_steady", "synthetic_trace"]


def _rate_burst_steady(t: float) -> float:
    """Requests/s at ``t`` seconds of ``synthetic-burst-steady``."""
    if t < 1800.0:
        phase = t % 480.0
        return 8.0 if 120.0 <= phase < 300.0 else 1.5
    return 5.0


def burst_then_steady(seed: int = 13, duration_s: float = 3600.0) -> tuple[Request, ...]:
    """The ``synthetic-burst-steady`` trace (see the module doc): requests sorted by arrival, the first at 0 s.

    Arrivals by thinning a Poisson process of rate 8 req/s (the peak) to :func:`_rate_burst_steady`.

    Raises:
        ValueError: ``duration_s`` is not positive and finite.
    """
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s must be positive and finite, got {duration_s}")
    rng = random.Random(seed)
    peak = 8.0
    t = 0.0
    out: list[Request] = []
    while True:
        t += rng.expovariate(peak)
        if t >= duration_s:
            break
        keep = rng.random() < _rate_burst_steady(t) / peak
        isl = min(max(int(round(rng.lognormvariate(math.log(800.0), 0.8))), 16), 3000)
        osl = min(max(int(round(rng.lognormvariate(math.log(180.0), 0.7))), 8), 1000)
        if keep:
            out.append(Request(arrival_s=t, isl=isl, osl=osl))
    if not out:
        raise ValueError("the synthetic trace drew no request")
    t0 = out[0].arrival_s
    return tuple(Request(arrival_s=r.arrival_s - t0, isl=r.isl, osl=r.osl) for r in out)


SYNTHETIC_TRACES: dict[str, Callable[..., tuple[Request, ...]]] = {
    "synthetic-burst-steady": burst_then_steady,
}
"""Synthetic trace name → its generator (called with no argument for the default seed, or with ``seed=N``),
selectable by ``fulcrum replay --trace NAME [--seed N]``."""


def synthetic_trace(name: str, seed: int | None = None) -> tuple[Request, ...]:
    """The requests of the synthetic trace ``name``, drawn with ``seed`` (None: the trace's default seed, the one
    the shipped results and tests use). Other seeds draw other arrivals and lengths from the same rates and
    distributions: a result that holds only at the default seed is luck of the draw (docs/replay.md).

    Raises:
        KeyError: ``name`` is not a synthetic trace.
    """
    gen = SYNTHETIC_TRACES[name]
    return gen() if seed is None else gen(seed=seed)
