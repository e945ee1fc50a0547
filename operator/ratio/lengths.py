"""Heterogeneous request lengths: DOPD eqs. (6)–(8).

Prefill cost is convex in ISL (eq. 5: linear projections plus quadratic attention), so by Jensen (eq. 8)
E[C(ISL)] ≥ C(E[ISL]): a plan made from the mean length under-provisions prefill for mixed workloads. Fulcrum
plans from the forecast length *distribution*: quantiles are turned into a discrete distribution whose
expectation of any cost function is a weighted sum (eq. 6 evaluated numerically, with the profile's measured
prefill curve as C).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["LengthDistribution"]


@dataclass(frozen=True)
class LengthDistribution:
    """A discrete length distribution: support points (tokens) and probabilities summing to 1.

    Attributes:
        points: lengths in tokens, non-decreasing, shape (k,).
        weights: probabilities, shape (k,), sum 1.
    """

    points: tuple[float, ...]
    weights: tuple[float, ...]

    @classmethod
    def point(cls, length: float) -> "LengthDistribution":
        """All mass at one length (the mean-only view DOPD Alg. 2 takes)."""
        return cls((max(float(length), 1.0),), (1.0,))

    @classmethod
    def from_quantiles(
        cls, levels: Sequence[float], values: Sequence[float], mean: float | None = None
    ) -> "LengthDistribution":
        """Build from quantile ``values`` at ``levels`` (0 < level < 1, increasing).

        Each quantile stands for the probability mass between the midpoints to its neighbours (the first
        from 0, the last to 1). When ``mean`` is given, the points are rescaled so the distribution's mean
        equals it (the quantiles describe the shape, the mean forecast the level). Falls back to a point mass
        at ``mean`` when the quantiles are missing, non-finite or of the wrong length.
        """
        ok = (
            len(levels) == len(values) > 0
            and all(math.isfinite(v) and v >= 0 for v in values)
            and all(0 < lv < 1 for lv in levels)
        )
        if not ok:
            return cls.point(mean if mean is not None and math.isfinite(mean) and mean > 0 else 1.0)
        vals = [max(float(v), 1.0) for v in values]
        for i in range(1, len(vals)):  # enforce monotone quantiles
            vals[i] = max(vals[i], vals[i - 1])
        edges = [0.0] + [(levels[i] + levels[i + 1]) / 2 for i in range(len(levels) - 1)] + [1.0]
        weights = [edges[i + 1] - edges[i] for i in range(len(levels))]
        dist = cls(tuple(vals), tuple(weights))
        if mean is not None and math.isfinite(mean) and mean > 0:
            scale = mean / dist.mean()
            dist = cls(tuple(max(v * scale, 1.0) for v in vals), tuple(weights))
        return dist

    def expect(self, fn: Callable[[float], float]) -> float:
        """E[fn(L)] = Σ w_i · fn(x_i)  (eq. 6 with the profile's cost curve as fn)."""
        return sum(w * fn(x) for x, w in zip(self.points, self.weights))

    def mean(self) -> float:
        """E[L], tokens."""
        return self.expect(lambda x: x)

    def second_moment(self) -> float:
        """E[L²] = Var(L) + E[L]², tokens² (eq. 7)."""
        return self.expect(lambda x: x * x)

    def quantile(self, q: float) -> float:
        """Smallest support point whose cumulative probability reaches ``q``."""
        acc = 0.0
        for x, w in zip(self.points, self.weights):
            acc += w
            if acc >= q - 1e-12:
                return x
        return self.points[-1]
