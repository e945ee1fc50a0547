"""Which policies of a comparison dominate a planner on SLO attainment and GPU-hours (issue 13's criterion).

Policy *a* dominates policy *b* when it serves at least *b*'s SLO attainment with no more GPU-hours, and is
strictly better on one of the two. A planner is on the Pareto front of a comparison when no other policy of it
dominates it; ``fulcrum replay --compare`` prints the verdict for ``fulcrum`` under its table (and ``--json``
adds it), and ``benchmarks/bench_pareto.py`` collects it over every shipped example and bundled trace.

The numbers compared are the policies' own, unrounded: a table shows 0.1 points and 0.01 GPU-hours, so two
rows that read the same can still order.

Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from fulcrum.replay.result import PolicyRun, PolicySummary

__all__ = ["ParetoVerdict", "Score", "dominates", "dominators", "pareto_verdict"]


class Score(NamedTuple):
    """The two numbers a comparison is judged on: SLO attainment (0..1, higher is better) and GPU-hours (lower)."""

    slo_attainment: float
    gpu_hours: float

    @classmethod
    def of(cls, summary: PolicySummary) -> Score:
        """A policy summary's score."""
        return cls(summary.slo_attainment, summary.gpu_hours)


def dominates(a: Score, b: Score) -> bool:
    """Whether ``a`` dominates ``b``: SLO attainment ≥ b's and GPU-hours ≤ b's, one of them strictly.

    NaN anywhere (no scored request) dominates nothing and is dominated by nothing.
    """
    if any(math.isnan(x) for x in (*a, *b)):
        return False
    no_worse = a.slo_attainment >= b.slo_attainment and a.gpu_hours <= b.gpu_hours
    better = a.slo_attainment > b.slo_attainment or a.gpu_hours < b.gpu_hours
    return no_worse and better


def dominators(scores: Mapping[str, Score], judged: str) -> list[str]:
    """The names in ``scores`` (policy → score) whose score dominates ``judged``'s, in the mapping's order.

    Raises:
        KeyError: ``judged`` is not in ``scores``.
    """
    mine = scores[judged]
    return [name for name, s in scores.items() if name != judged and dominates(s, mine)]


@dataclass(frozen=True)
class ParetoVerdict:
    """Whether ``policy`` is dominated in a comparison.

    Attributes:
        policy: the policy judged (``fulcrum``).
        dominated_by: the policies that dominate it, in the comparison's order (empty: on the Pareto front).
        slo_attainment, gpu_hours: the judged policy's numbers (0..1, GPU-hours).
        others: for each dominating policy, its score.
    """

    policy: str
    dominated_by: tuple[str, ...]
    slo_attainment: float
    gpu_hours: float
    others: tuple[Score, ...]

    @property
    def dominated(self) -> bool:
        """Whether any policy of the comparison dominates ``policy``."""
        return bool(self.dominated_by)

    def line(self) -> str:
        """One line for the comparison's text output, e.g. ``Pareto: fulcrum (96.7% / 7.97 GPU-h) is dominated
        by static-best (98.9% / 5.70)``."""
        mine = f"{self.policy} ({self.slo_attainment:.1%} / {self.gpu_hours:.2f} GPU-h)"
        if not self.dominated:
            return f"Pareto: {mine} is not dominated on SLO attainment and GPU-hours"
        by = ", ".join(f"{n} ({a:.1%} / {g:.2f})" for n, (a, g) in zip(self.dominated_by, self.others, strict=True))
        return f"Pareto: {mine} is dominated by {by}"

    def as_json(self) -> dict[str, object]:
        """``{"policy", "dominated", "dominated_by"}`` for ``--json``."""
        return {"policy": self.policy, "dominated": self.dominated, "dominated_by": list(self.dominated_by)}


def pareto_verdict(runs: Sequence[PolicyRun], policy: str = "fulcrum") -> ParetoVerdict | None:
    """The verdict for ``policy`` among ``runs`` (every other run is a candidate; the names are unique, as
    :func:`fulcrum.replay.table.check_runs` requires of a comparison), or None when ``policy`` did not run."""
    scores = {r.policy: Score.of(r.summary) for r in runs}
    if policy not in scores:
        return None
    winners = dominators(scores, policy)
    return ParetoVerdict(
        policy=policy,
        dominated_by=tuple(winners),
        slo_attainment=scores[policy].slo_attainment,
        gpu_hours=scores[policy].gpu_hours,
        others=tuple(scores[n] for n in winners),
    )
