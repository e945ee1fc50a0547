"""The Pareto verdict of a comparison (fulcrum.replay.pareto): who dominates a planner on attainment and GPU-hours."""

from __future__ import annotations

import math

import pytest

from fulcrum.replay.pareto import Score, dominates, pareto_verdict
from fulcrum.replay.result import PolicyRun, PolicySummary


def _run(name: str, attainment: float, gpu_hours: float) -> PolicyRun:
    return PolicyRun(name, PolicySummary(attainment, 0.0, 0.0, gpu_hours, 0.5, 0.05, 1.0, 1.0, 100, 0))


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (Score(0.99, 5.0), Score(0.97, 8.0), True),  # better on both
        (Score(0.97, 5.0), Score(0.97, 8.0), True),  # same attainment, fewer GPU-hours
        (Score(0.99, 8.0), Score(0.97, 8.0), True),  # same GPU-hours, higher attainment
        (Score(0.97, 8.0), Score(0.97, 8.0), False),  # a tie dominates nothing
        (Score(0.99, 8.5), Score(0.97, 8.0), False),  # better attainment bought with GPU-hours: a trade-off
        (Score(0.95, 5.0), Score(0.97, 8.0), False),  # cheaper but worse
        (Score(math.nan, 1.0), Score(0.97, 8.0), False),  # no scored request
        (Score(0.99, 1.0), Score(math.nan, 8.0), False),
    ],
)
def test_dominates_needs_no_worse_on_both_and_better_on_one(a: Score, b: Score, expected: bool) -> None:
    assert dominates(a, b) is expected


def test_the_verdict_names_every_dominating_policy_in_order_and_says_so_in_one_line() -> None:
    runs = [_run("fulcrum", 0.967, 7.97), _run("dopd", 0.11, 4.58), _run("static-best", 0.989, 5.70),
            _run("dynamo-sla", 0.967, 7.96)]
    v = pareto_verdict(runs)
    assert v is not None and v.dominated
    assert v.dominated_by == ("static-best", "dynamo-sla")
    assert v.line() == ("Pareto: fulcrum (96.7% / 7.97 GPU-h) is dominated by static-best (98.9% / 5.70), "
                        "dynamo-sla (96.7% / 7.96)")
    assert v.as_json() == {"policy": "fulcrum", "dominated": True, "dominated_by": ["static-best", "dynamo-sla"]}


def test_a_planner_on_the_front_is_not_dominated() -> None:
    runs = [_run("fulcrum", 0.987, 7.35), _run("dopd", 0.527, 5.46), _run("static-best", 1.0, 9.33)]
    v = pareto_verdict(runs)
    assert v is not None and not v.dominated and v.dominated_by == ()
    assert v.line() == "Pareto: fulcrum (98.7% / 7.35 GPU-h) is not dominated on SLO attainment and GPU-hours"
    assert v.as_json() == {"policy": "fulcrum", "dominated": False, "dominated_by": []}


def test_no_verdict_without_the_judged_policy() -> None:
    assert pareto_verdict([_run("dopd", 0.5, 1.0)]) is None
    assert pareto_verdict([_run("dopd", 0.5, 1.0), _run("static", 0.4, 1.0)], policy="dopd") is not None
