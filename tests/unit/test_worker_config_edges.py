"""Edge inputs of the worker's pure parts: the vLLM argument builder, the step latency table and the SLO-aware
scheduler's settings and planner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fulcrum.errors import FulcrumError, ProfileError, SpecError
from fulcrum.worker.latency_table import StepLatencyTable
from fulcrum.worker.slo_scheduler import SchedulerSettings, StepPlanner
from fulcrum.worker.vllm_args import WorkerConfig


# ---------------------------------------------------------------------------------------------- vllm_args
def test_a_token_budget_below_the_sequence_limit_is_refused_as_vllm_would_refuse_it() -> None:
    """vLLM's SchedulerConfig: "max_num_batched_tokens (128) must be greater than or equal to max_num_seqs (256)";
    the engine would exit at start and the pod crash-loop."""
    with pytest.raises(SpecError, match=r"--max-num-batched-tokens 128 is below --max-num-seqs 256"):
        WorkerConfig(model="m", max_num_batched_tokens=128)
    with pytest.raises(SpecError, match=r"--max-num-batched-tokens 8 is below --max-num-seqs 9"):
        WorkerConfig(model="m", max_num_seqs=9, max_num_batched_tokens=8)
    assert WorkerConfig(model="m", max_num_seqs=8, max_num_batched_tokens=8).max_num_batched_tokens == 8


@pytest.mark.parametrize("slo", [float("inf"), float("nan"), 1e-322])
def test_a_tpot_slo_the_scheduler_cannot_use_is_refused(slo: float) -> None:
    """inf reaches the engine as FULCRUM_TPOT_SLO_MS=inf (refused there, at start); 1e-322 ms is 0 s."""
    with pytest.raises(SpecError, match="--tpot-slo-ms"):
        WorkerConfig(model="m", tpot_slo_ms=slo)


# ---------------------------------------------------------------------------------------------- settings
def test_an_slo_that_rounds_to_zero_seconds_is_refused_at_start_not_at_the_first_step() -> None:
    with pytest.raises(FulcrumError, match="FULCRUM_TPOT_SLO_MS"):
        SchedulerSettings.from_env({"FULCRUM_TPOT_SLO_MS": "1e-322"})
    assert SchedulerSettings.from_env({"FULCRUM_TPOT_SLO_MS": "0.001"}).tpot_slo_s == pytest.approx(1e-6)


# ---------------------------------------------------------------------------------------------- the table
def _file(tmp_path: Path, entries: list[dict[str, float]]) -> Path:
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"version": 1, "entries": entries}))
    return path


def test_a_mean_position_outside_its_bucket_is_refused_naming_the_entry(tmp_path: Path) -> None:
    """A bucket's meanPrefillTokens is the mean of its steps' prefill tokens, so it lies in the bucket. One that
    does not (a hand-edited file) predicted billions of seconds beside 10-20 ms measurements, or divided by 0."""
    path = _file(tmp_path, [
        {"prefillTokens": 16, "contextTokens": 64, "decodes": 4, "seconds": 0.01, "meanPrefillTokens": 5000},
        {"prefillTokens": 1024, "contextTokens": 64, "decodes": 4, "seconds": 0.02, "meanPrefillTokens": 1000},
    ])
    with pytest.raises(ProfileError, match=r"entries\[0\].*meanPrefillTokens 5000.*bucket 16"):
        StepLatencyTable.load(path)
    path = _file(tmp_path, [
        {"prefillTokens": 16, "contextTokens": 64, "decodes": 4, "seconds": 0.01, "meanPrefillTokens": 1e12},
    ])
    with pytest.raises(ProfileError, match=r"meanPrefillTokens"):
        StepLatencyTable.load(path)


def test_a_table_fulcrum_recorded_still_loads_with_its_mean_positions(tmp_path: Path) -> None:
    table = StepLatencyTable()
    for p in (0, 17, 22, 23, 300, 1500, 90_000, 1_000_000):  # near the bucket edges and past the last point
        table.record(p, 512, 8, 0.01 + 1e-6 * p)
        table.record(p + 1, 512, 8, 0.01 + 1e-6 * p)
    table.save(tmp_path / "t.json")
    loaded = StepLatencyTable.load(tmp_path / "t.json")
    assert [e.mean_prefill_tokens for e in loaded] == [e.mean_prefill_tokens for e in table]


def test_predictions_stay_positive_and_monotone_outside_the_measured_points() -> None:
    table = StepLatencyTable()
    table.record(256, 512, 8, 0.02)
    table.record(1024, 512, 8, 0.015)  # noisy: faster with more prefill
    table.record(0, 4096, 64, 0.0)  # a zero-time measurement
    for p in (0, 1, 255, 257, 10**6):
        v = table.predict(p, 512, 8)
        assert v is not None and v > 0
    values = [table.predict(p, 512, 8) for p in (0, 100, 256, 700, 1024, 5000)]
    assert all(b >= a for a, b in zip(values, values[1:]))
    assert table.prefill_budget(64, 4096, 0.05, 8192) == 8192  # no evidence of cost: the engine's budget


def test_the_planner_keeps_the_floor_when_decodes_fill_the_engine_budget() -> None:
    table = StepLatencyTable()
    table.record(0, 512, 256, 0.5)
    plan = StepPlanner(table, 0.05, 0.8).plan([512] * 256, 256, 256)  # decodes take the whole engine budget
    assert plan.prefill_budget == 0 and plan.token_budget == 256
    plan = StepPlanner(table, 0.05, 0.8).plan([], 0, 8192)  # an empty queue
    assert (plan.decodes, plan.prefill_budget, plan.token_budget) == (0, 8192, 8192)


def test_a_metrics_port_past_65535_is_refused_naming_the_variable() -> None:
    """It was accepted, and the engine core then died at start with ``OverflowError: bind(): port must be
    0-65535`` (not the OSError the scheduler reports and carries on from), naming no variable."""
    with pytest.raises(FulcrumError, match=r"FULCRUM_SCHEDULER_METRICS_PORT must be in 1\.\.65535, got '70000'"):
        SchedulerSettings.from_env({"FULCRUM_SCHEDULER_METRICS_PORT": "70000"})
    assert SchedulerSettings.from_env({"FULCRUM_SCHEDULER_METRICS_PORT": "65535"}).metrics_port == 65535
