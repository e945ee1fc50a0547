"""The step latency table of Libra's local scheduler (§4.2, Alg. 2): buckets, interpolation, budget, online
refinement, files, seeding; and the pure parts of the vLLM scheduler around it (settings, decode-first order,
the table read back from metrics)."""

from __future__ import annotations

import json
import math

import pytest

from fulcrum.errors import FulcrumError, ProfileError
from fulcrum.worker.latency_table import PREFILL_GRID, StepKey, StepLatencyTable, snap
from fulcrum.worker.slo_scheduler import (
    SchedulerMetrics,
    SchedulerSettings,
    StepPlanner,
    partition_decodes_first,
)
from fulcrum.worker.step_profiler import synthetic_prompt, table_from_metrics_text


def linear_table(base: float = 0.010, per_token: float = 1e-5, decodes: int = 8, context: int = 512) -> StepLatencyTable:
    """A table measured on a step time of ``base + per_token * p`` seconds at (context, decodes)."""
    table = StepLatencyTable()
    for p in (0, 64, 256, 1024, 4096):
        table.record(p, context, decodes, base + per_token * p)
    return table


# ---------------------------------------------------------------------------------------------- buckets
def test_coordinates_snap_to_the_nearest_grid_point_in_log_space() -> None:
    assert snap(0, PREFILL_GRID) == 0
    assert snap(1, PREFILL_GRID) == 16
    assert snap(22, PREFILL_GRID) == 16  # log2 22 = 4.46: nearer 16 than 32
    assert snap(23, PREFILL_GRID) == 32
    assert snap(10**9, PREFILL_GRID) == PREFILL_GRID[-1]
    assert StepLatencyTable.key_for(300, 500, 7) == StepKey(256, 512, 8)


def test_an_empty_table_predicts_nothing_and_does_not_limit_prefill() -> None:
    table = StepLatencyTable()
    assert table.predict(100, 100, 4) is None
    assert table.prefill_budget(4, 100, 0.05, 2048) == 2048


# ---------------------------------------------------------------------------------------------- prediction
def test_prediction_interpolates_linearly_between_measured_buckets() -> None:
    table = linear_table()
    assert table.predict(256, 512, 8) == pytest.approx(0.01256)
    assert table.predict(640, 512, 8) == pytest.approx(0.01 + 1e-5 * 640)  # between 256 and 1024
    assert table.predict(8192, 512, 8) == pytest.approx(0.01 + 1e-5 * 8192)  # extrapolated with the last slope


def test_prediction_uses_the_mean_prefill_tokens_of_a_bucket_as_its_position() -> None:
    table = StepLatencyTable()
    table.record(0, 512, 8, 0.010)
    table.record(300, 512, 8, 0.013)  # bucket 256, but measured at 300 tokens
    assert table.predict(300, 512, 8) == pytest.approx(0.013)
    assert table.predict(150, 512, 8) == pytest.approx(0.0115)


def test_prediction_never_falls_as_prefill_tokens_grow_even_over_noisy_measurements() -> None:
    """Isotonic regression: the 64- and 256-token buckets violate the order and are pooled (mean 0.025 s)."""
    table = StepLatencyTable()
    for p, s in ((0, 0.010), (64, 0.030), (256, 0.020), (1024, 0.040)):  # 256 measured faster than 64
        table.record(p, 512, 8, s)
    values = [table.predict(p, 512, 8) for p in range(0, 3000, 7)]
    assert all(b >= a for a, b in zip(values, values[1:]))
    assert table.predict(64, 512, 8) == table.predict(256, 512, 8) == pytest.approx(0.025)  # pooled violators


def test_a_missing_slice_borrows_the_nearest_measured_one_preferring_the_slower() -> None:
    table = StepLatencyTable()
    table.record(0, 512, 4, 0.010)
    table.record(0, 512, 16, 0.020)
    assert table.predict(0, 512, 8) == pytest.approx(0.020)  # 4 and 16 are equally far from 8: take 16
    assert table.predict(0, 512, 5) == pytest.approx(0.010)


# ---------------------------------------------------------------------------------------------- budget
def test_budget_is_the_largest_prefill_whose_predicted_step_meets_the_slo() -> None:
    table = linear_table()
    m = table.prefill_budget(8, 512, 0.015, 8192)  # 0.010 + 1e-5·M <= 0.015 → M = 500
    assert m == 500
    assert table.predict(m, 512, 8) <= 0.015 < table.predict(m + 1, 512, 8)


def test_budget_is_capped_by_the_engine_limit() -> None:
    assert linear_table().prefill_budget(8, 512, 1.0, 2048) == 2048


def test_budget_falls_to_the_floor_when_decodes_alone_break_the_slo_so_prefills_never_starve() -> None:
    table = StepLatencyTable(min_prefill_tokens=32)
    for p in (0, 256):
        table.record(p, 512, 8, 0.2 + p * 1e-4)
    assert table.prefill_budget(8, 512, 0.05, 8192) == 32
    assert table.prefill_budget(8, 512, 0.05, 10) == 10  # the floor never exceeds the engine limit


def test_a_step_without_decodes_gets_the_whole_engine_budget() -> None:
    assert linear_table().prefill_budget(0, 0, 0.001, 4096) == 4096


def test_budget_rejects_a_non_positive_slo() -> None:
    with pytest.raises(ValueError, match="slo_s"):
        linear_table().prefill_budget(8, 512, 0.0, 100)


# ---------------------------------------------------------------------------------------------- online update
def test_measurements_refine_a_bucket_by_exponential_averaging() -> None:
    table = StepLatencyTable(alpha=0.5)
    table.record(256, 512, 8, 0.020)
    entry = table.record(256, 512, 8, 0.040)
    assert entry.seconds == pytest.approx(0.030)
    assert entry.samples == 2
    for _ in range(20):
        table.record(256, 512, 8, 0.010)
    assert table.predict(256, 512, 8) == pytest.approx(0.010, rel=1e-3)


def test_the_budget_shrinks_once_steps_are_measured_slower() -> None:
    table = linear_table()
    before = table.prefill_budget(8, 512, 0.015, 8192)
    for _ in range(10):
        table.record(256, 512, 8, 0.030)
    assert table.prefill_budget(8, 512, 0.015, 8192) < before


def test_recording_rejects_negative_or_non_finite_values() -> None:
    with pytest.raises(ValueError, match="seconds"):
        StepLatencyTable().record(1, 1, 1, math.nan)
    with pytest.raises(ValueError, match="prefill_tokens"):
        StepLatencyTable().record(-1, 1, 1, 0.1)


# ---------------------------------------------------------------------------------------------- files
@pytest.mark.parametrize("name", ["table.json", "table.yaml"])
def test_a_saved_table_loads_back_with_the_same_predictions(tmp_path, name) -> None:
    table = linear_table()
    table.record(100, 128, 2, 0.005)
    table.save(tmp_path / name)
    again = StepLatencyTable.load(tmp_path / name)
    assert [e for e in again] == [e for e in table]
    assert again.prefill_budget(8, 512, 0.015, 8192) == table.prefill_budget(8, 512, 0.015, 8192)


def test_a_malformed_table_file_is_a_profile_error_naming_the_file(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="bad.json"):
        StepLatencyTable.load(bad)
    bad.write_text(json.dumps({"version": 1, "entries": [{"prefillTokens": 1, "contextTokens": 1}]}))
    with pytest.raises(ProfileError, match="decodes"):
        StepLatencyTable.load(bad)
    with pytest.raises(ProfileError, match="cannot read"):
        StepLatencyTable.load(tmp_path / "missing.json")



@pytest.mark.parametrize(("name", "text", "message"), [
    ("t.json", "", r"^step table \S*t\.json: the file is empty$"),
    ("t.yaml", " \n", r"^step table \S*t\.yaml: the file is empty$"),
    ("t.yaml", "# later\n", r"t\.yaml: holds no table \(empty, only comments, or null\)"),
    ("t.json", "null", r"t\.json: holds no table"),
])
def test_an_empty_table_file_says_so_in_plain_words(tmp_path, name, text, message) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(ProfileError, match=message) as info:
        StepLatencyTable.load(tmp_path / name)
    assert "NoneType" not in str(info.value) and "Expecting value" not in str(info.value)


ENTRY = '{"prefillTokens": 16, "contextTokens": 64, "decodes": 1, "seconds": 0.01'  # the closing brace left off


@pytest.mark.parametrize(("text", "message"), [
    pytest.param('{"version": 1, "alpha": ' + "9" * 400 + "}", r"t\.json: alpha must be in \(0, 1\]",
                 id="alpha-beyond-float"),
    pytest.param('{"version": 1, "minPrefillTokens": 1e400}',
                 r"t\.json: minPrefillTokens must be a whole number >= 0, got inf", id="floor-infinite"),
    pytest.param('{"version": 1, "entries": [' + ENTRY + ', "samples": 1e400}]}',
                 r"entries\[0\]: samples must be a whole number >= 0, got inf", id="samples-infinite"),
    pytest.param('{"version": 1, "entries": [' + ENTRY.replace("0.01", "9" * 400) + "}]}",
                 r"entries\[0\]: seconds must be a finite number", id="seconds-beyond-float"),
    pytest.param('{"version": 1, "entries": [' + ENTRY.replace("0.01", "-" + "9" * 400) + "}]}",
                 r"entries\[0\]: seconds must be a finite number >= 0, got -9{39}…$", id="seconds-below-float"),
    pytest.param('{"version": 1, "minPrefillTokens": -' + "9" * 400 + "}",
                 r"t\.json: minPrefillTokens must be a whole number >= 0, got -9{39}…$", id="floor-below-float"),
    pytest.param("[" * 100_000 + "]" * 100_000, r"t\.json: not valid JSON: nested too deeply", id="nested-too-deeply"),
])
def test_numbers_and_nesting_past_what_python_holds_are_a_profile_error_naming_the_file(
        tmp_path, text, message) -> None:
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(ProfileError, match=message):
        StepLatencyTable.load(path)


YAML_ENTRY = "{prefillTokens: 16, contextTokens: 64, decodes: 1, seconds: 0.01, samples: 1}"


@pytest.mark.parametrize(("name", "text", "message"), [
    # a bool read as 1.0 by float(): YAML's true/yes, JSON's true; the profile loader's words ("expected a number")
    pytest.param("t.yaml", "entries:\n- " + YAML_ENTRY.replace("0.01", "true") + "\n",
                 r"t\.yaml: entries\[0\]: seconds: expected a number, got True$", id="seconds-yaml-true"),
    pytest.param("t.yaml", "entries:\n- " + YAML_ENTRY.replace("0.01", "yes") + "\n",
                 r"t\.yaml: entries\[0\]: seconds: expected a number, got True$", id="seconds-yaml-yes"),
    pytest.param("t.json", '{"entries": [' + ENTRY.replace("16", "true") + "}]}",
                 r"t\.json: entries\[0\]: prefillTokens: expected a number, got True$", id="prefill-json-true"),
    pytest.param("t.json", '{"entries": [' + ENTRY + ', "samples": false}]}',
                 r"t\.json: entries\[0\]: samples: expected a number, got False$", id="samples-false"),
    pytest.param("t.json", '{"alpha": true}', r"t\.json: alpha: expected a number, got True$", id="alpha-true"),
    pytest.param("t.yaml", "minPrefillTokens: yes\n", r"t\.yaml: minPrefillTokens: expected a number, got True$",
                 id="floor-yes"),
    pytest.param("t.json", '{"version": true}', r"t\.json: unknown version True \(expected 1\)$", id="version-true"),
    # a string where a number belongs: the file says text (the table's writers never quote a number)
    pytest.param("t.json", '{"entries": [' + ENTRY.replace("0.01", '"0.5"') + "}]}",
                 r"t\.json: entries\[0\]: seconds: expected a number, got '0\.5' \(a string: write the number "
                 r"without quotes\)$", id="seconds-string"),
    pytest.param("t.yaml", "entries:\n- " + YAML_ENTRY.replace("64", "'64'") + "\n",
                 r"t\.yaml: entries\[0\]: contextTokens: expected a number, got '64' \(a string", id="context-string"),
    pytest.param("t.json", '{"alpha": "0.5"}', r"t\.json: alpha: expected a number, got '0\.5' \(a string",
                 id="alpha-string"),
    pytest.param("t.json", '{"minPrefillTokens": "16"}', r"t\.json: minPrefillTokens: expected a number, got '16'",
                 id="floor-string"),
    pytest.param("t.yaml", "entries:\n- " + YAML_ENTRY.replace("decodes: 1", "decodes:") + "\n",
                 r"t\.yaml: entries\[0\]: decodes: expected a number, got None$", id="decodes-null"),
])
def test_a_bool_or_a_string_where_a_number_belongs_is_refused_naming_the_file_and_key(tmp_path, name, text,
                                                                                       message) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ProfileError, match=r"^step table \S+" + message):
        StepLatencyTable.load(path)


def test_a_yaml_syntax_error_in_a_table_is_one_line_with_its_line_and_column(tmp_path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("version: 1\nentries:\n- {prefillTokens: 16, seconds: [0.01\n")
    with pytest.raises(ProfileError) as info:
        StepLatencyTable.load(path)
    assert "\n" not in str(info.value)
    assert str(info.value).startswith(f"step table {path}:4:1: not valid YAML: while parsing a flow sequence")


@pytest.mark.parametrize("name", ["table.json", "table.yaml"])
def test_every_table_fulcrum_writes_loads_back(splitwise, tmp_path, name) -> None:
    """The step tables the repo writes itself — recorded steps, priors seeded from a profile, the table read back
    from the scheduler's metrics (``fulcrum profile --step-table``) — hold numbers only, so the loader's refusal of
    bools and strings refuses none of them."""
    from prometheus_client import generate_latest

    seeded = StepLatencyTable(min_prefill_tokens=0)
    seeded.seed_from_profile(splitwise, 8, max_prefill_tokens=1024, max_context_tokens=1024, max_decodes=8)
    seeded.record(100, 128, 2, 0.005)
    planner = StepPlanner(linear_table(), tpot_slo_s=None)
    from_metrics = table_from_metrics_text(generate_latest(SchedulerMetrics(planner).registry).decode())
    for table in (linear_table(), seeded, from_metrics):
        table.save(tmp_path / name)
        again = StepLatencyTable.load(tmp_path / name)
        assert [e for e in again] == [e for e in table]
        assert (again.alpha, again.min_prefill_tokens) == (table.alpha, table.min_prefill_tokens)


# ---------------------------------------------------------------------------------------------- seeding
def test_seeding_from_a_profile_fills_priors_that_measurements_replace(splitwise) -> None:
    table = StepLatencyTable()
    added = table.seed_from_profile(splitwise, 8, max_prefill_tokens=4096, max_context_tokens=4096, max_decodes=64)
    assert added > 100 and table.measured_entries == 0
    prior = table.predict(1024, 1024, 32)
    assert prior == pytest.approx(splitwise.tpot(32, 1024, 8) + splitwise.ttft(1024, 8))
    budget = table.prefill_budget(32, 1024, 0.1, 8192)
    assert splitwise.tpot(32, 1024, 8) + splitwise.ttft(budget, 8) <= 0.1 + 1e-9
    entry = table.record(1024, 1024, 32, 0.05)
    assert entry.seconds == 0.05 and entry.samples == 1  # the first measurement replaces the prior
    assert table.seed_from_profile(splitwise, 8, max_prefill_tokens=4096, max_context_tokens=4096, max_decodes=64) == 0


def test_seeding_needs_both_tables_at_the_tp(table_i) -> None:
    with pytest.raises(ProfileError, match="TP=2"):
        StepLatencyTable().seed_from_profile(table_i, 2)


# ---------------------------------------------------------------------------------------------- scheduler core
def test_scheduler_settings_come_from_the_environment() -> None:
    s = SchedulerSettings.from_env({"FULCRUM_TPOT_SLO_MS": "50", "FULCRUM_STEP_TABLE": "/x/t.json",
                                    "FULCRUM_SCHEDULER_METRICS_PORT": "9400"})
    assert (s.tpot_slo_s, str(s.table_path), s.metrics_port, s.min_prefill_tokens) == (0.05, "/x/t.json", 9400, 16)
    assert SchedulerSettings.from_env({"FULCRUM_TPOT_SLO_MS": ""}).tpot_slo_s is None
    with pytest.raises(FulcrumError, match="FULCRUM_TPOT_SLO_MS must be > 0"):
        SchedulerSettings.from_env({"FULCRUM_TPOT_SLO_MS": "0"})
    with pytest.raises(FulcrumError, match="FULCRUM_SCHEDULER_METRICS_PORT must be an integer"):
        SchedulerSettings.from_env({"FULCRUM_SCHEDULER_METRICS_PORT": "x"})


def test_decodes_move_ahead_of_prefill_chunks_keeping_their_order() -> None:
    running = ["p1", "d1", "p2", "d2", "d3"]
    assert partition_decodes_first(running, lambda r: r.startswith("d")) == ["d1", "d2", "d3", "p1", "p2"]


def test_planner_budget_is_decode_tokens_plus_m_and_never_above_the_engine_limit() -> None:
    planner = StepPlanner(linear_table(), tpot_slo_s=0.015)
    plan = planner.plan([500, 524] * 4, decode_tokens=8, engine_max_tokens=8192)
    assert (plan.decodes, plan.mean_context, plan.prefill_budget, plan.token_budget) == (8, 512, 500, 508)
    assert planner.plan([512] * 8, 8, engine_max_tokens=300).token_budget == 300
    unlimited = StepPlanner(linear_table(), tpot_slo_s=None).plan([512] * 8, 8, 8192)
    assert unlimited.prefill_budget is None and unlimited.token_budget == 8192


def test_the_table_read_back_from_the_scheduler_metrics_equals_the_recorded_one() -> None:
    from prometheus_client import generate_latest

    planner = StepPlanner(linear_table(), tpot_slo_s=None)
    planner.record(100, 128, 2, 0.005)
    metrics = SchedulerMetrics(planner)
    text = generate_latest(metrics.registry).decode()
    assert 'fulcrum_scheduler_table_entries 6.0' in text
    again = table_from_metrics_text(text)
    assert [e for e in again] == [e for e in planner.table]
    with pytest.raises(FulcrumError, match="no fulcrum_scheduler_step_table"):
        table_from_metrics_text("# nothing here\n")


def test_synthetic_prompts_have_exactly_the_asked_length() -> None:
    import random

    prompt = synthetic_prompt(37, random.Random(1))
    assert len(prompt) == 37 and all(100 <= t <= 1000 for t in prompt)


# ---------------------------------------------------------------------------------------------- the vLLM glue
class FakeRequest:
    """TEST DOUBLE of vLLM's ``Request``: the attributes the scheduler reads."""

    def __init__(self, request_id: str, prompt: int, computed: int, output: int = 0) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = prompt
        self.num_tokens = prompt + output
        self.num_computed_tokens = computed
        self.spec_token_ids: list[int] = []


class FakeOutput:
    def __init__(self, scheduled: dict[str, int]) -> None:
        self.num_scheduled_tokens = scheduled


class FakeVllmScheduler:
    """TEST DOUBLE of vLLM's ``Scheduler``: walks ``running`` in order with one token budget, like vLLM."""

    def __init__(self, *args, **kwargs) -> None:
        self.running: list[FakeRequest] = kwargs["running"]
        self.requests = {r.request_id: r for r in self.running}
        self.max_num_scheduled_tokens = 2048
        self.scheduler_config = type("Cfg", (), {"enable_chunked_prefill": True})()
        self.budgets_seen: list[int] = []
        self.orders_seen: list[list[str]] = []
        self.shut_down = False
        self.busy = True

    def schedule(self) -> FakeOutput:
        self.budgets_seen.append(self.max_num_scheduled_tokens)
        self.orders_seen.append([r.request_id for r in self.running])
        budget, scheduled = self.max_num_scheduled_tokens, {}
        for r in self.running:
            if budget <= 0:
                break
            n = min(r.num_tokens - r.num_computed_tokens, budget)
            scheduled[r.request_id] = n
            budget -= n
        return FakeOutput(scheduled)

    def update_from_output(self, scheduler_output, model_runner_output):
        return {"ok": model_runner_output}

    def has_requests(self) -> bool:
        return self.busy

    def shutdown(self) -> None:
        self.shut_down = True


def make_fake_scheduler(monkeypatch, tmp_path, slo_ms: str | None):
    from fulcrum.worker.slo_scheduler import _SLOAwareMixin

    table = linear_table(decodes=2, context=512)  # 0.010 + 1e-5·p s at 2 decodes, context 512
    table.save(tmp_path / "table.json")
    monkeypatch.setenv("FULCRUM_STEP_TABLE", str(tmp_path / "table.json"))
    if slo_ms is None:
        monkeypatch.delenv("FULCRUM_TPOT_SLO_MS", raising=False)
    else:
        monkeypatch.setenv("FULCRUM_TPOT_SLO_MS", slo_ms)
    monkeypatch.setenv("FULCRUM_SCHEDULER_SLO_HEADROOM", "1")  # plan to the whole SLO: round numbers below
    monkeypatch.delenv("FULCRUM_SCHEDULER_METRICS_PORT", raising=False)
    cls = type("SLOAwareOnFake", (_SLOAwareMixin, FakeVllmScheduler), {})
    running = [FakeRequest("long", prompt=1500, computed=0), FakeRequest("d1", 500, 524, 25),
               FakeRequest("d2", 500, 500, 1)]
    return cls(running=running)


def test_with_an_slo_decodes_run_first_and_prefill_gets_only_its_budget(monkeypatch, tmp_path) -> None:
    sched = make_fake_scheduler(monkeypatch, tmp_path, slo_ms="15")
    out = sched.schedule()
    assert sched.orders_seen[-1] == ["d1", "d2", "long"]  # Alg. 2 line 2
    # 2 decodes at mean context 512: M = 500 (0.010 + 1e-5·M <= 0.015); token budget 2 + 500
    assert sched.budgets_seen[-1] == 502
    assert out.num_scheduled_tokens == {"d1": 1, "d2": 1, "long": 500}
    assert sched.max_num_scheduled_tokens == 2048  # restored after the step
    assert sched._fulcrum_metrics.budget.collect()[0].samples[0].value == 500
    assert sched.update_from_output(out, "model-output") == {"ok": "model-output"}
    recorded = sched._fulcrum_planner.table.entry(StepLatencyTable.key_for(500, 512, 2))
    assert recorded is not None and recorded.samples == 1  # the measured step went into the table
    assert StepLatencyTable.load(tmp_path / "table.json").entry(recorded.key) is None  # busy: not saved yet
    sched.shutdown()
    assert sched.shut_down and StepLatencyTable.load(tmp_path / "table.json").entry(recorded.key).samples == 1


def test_every_executed_step_gets_a_line_in_the_step_log(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("FULCRUM_STEP_LOG", str(tmp_path / "steps.jsonl"))
    sched = make_fake_scheduler(monkeypatch, tmp_path, slo_ms="15")
    for _ in range(3):
        sched.update_from_output(sched.schedule(), None)
    sched.shutdown()
    lines = [json.loads(x) for x in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert len(lines) == 3
    assert {k: lines[0][k] for k in ("prefill", "decodes", "context", "budget")} == {
        "prefill": 500, "decodes": 2, "context": 512.0, "budget": 500}
    assert lines[0]["predicted"] == pytest.approx(0.015) and lines[0]["seconds"] >= 0


def test_the_table_is_saved_when_the_engine_runs_out_of_requests(monkeypatch, tmp_path) -> None:
    sched = make_fake_scheduler(monkeypatch, tmp_path, slo_ms="15")
    sched.update_from_output(sched.schedule(), None)
    sched.busy = False
    sched.update_from_output(sched.schedule(), None)
    saved = StepLatencyTable.load(tmp_path / "table.json")
    assert saved.measured_entries == sched._fulcrum_planner.table.measured_entries == 6


def test_without_an_slo_the_base_scheduler_runs_untouched_but_steps_are_recorded(monkeypatch, tmp_path) -> None:
    sched = make_fake_scheduler(monkeypatch, tmp_path, slo_ms=None)
    out = sched.schedule()
    assert sched.orders_seen[-1] == ["long", "d1", "d2"] and sched.budgets_seen[-1] == 2048
    assert out.num_scheduled_tokens == {"long": 1500, "d1": 1, "d2": 1}
    sched.update_from_output(out, None)
    entry = sched._fulcrum_planner.table.entry(StepLatencyTable.key_for(1500, 512, 2))
    assert entry is not None and entry.samples == 1 and entry.mean_prefill_tokens == 1500


def test_the_scheduler_class_path_imports_without_vllm() -> None:
    import importlib
    import sys

    from fulcrum.vllm_plugin import SCHEDULER_CLS

    module_name, _, cls_name = SCHEDULER_CLS.rpartition(".")
    module = importlib.import_module(module_name)
    assert cls_name in module.__all__
    assert "vllm" not in sys.modules or hasattr(sys.modules["vllm"], "__version__")


def test_a_slice_with_only_decode_steps_borrows_the_prefill_cost_of_the_nearest_measured_slice() -> None:
    table = linear_table(base=0.010, per_token=1e-5, decodes=8, context=512)
    table.record(0, 1024, 8, 0.020)  # a new context: only decode-only steps measured there
    assert table.predict(0, 1024, 8) == pytest.approx(0.020)
    assert table.predict(1000, 1024, 8) == pytest.approx(0.020 + 1e-5 * 1000)
    assert table.prefill_budget(8, 1024, 0.025, 8192) == 500


def test_the_slo_headroom_plans_steps_below_the_slo_and_is_read_from_the_environment() -> None:
    full = StepPlanner(linear_table(), tpot_slo_s=0.015).plan([512] * 8, 8, 8192)
    tight = StepPlanner(linear_table(), tpot_slo_s=0.015, headroom=0.8).plan([512] * 8, 8, 8192)
    assert tight.prefill_budget is not None and full.prefill_budget is not None
    assert tight.prefill_budget < full.prefill_budget
    assert SchedulerSettings.from_env({}).slo_headroom == 0.8
    assert SchedulerSettings.from_env({"FULCRUM_SCHEDULER_SLO_HEADROOM": "0.5"}).slo_headroom == 0.5
    with pytest.raises(FulcrumError, match="HEADROOM"):
        SchedulerSettings.from_env({"FULCRUM_SCHEDULER_SLO_HEADROOM": "1.5"})
    with pytest.raises(ValueError, match="headroom"):
        StepPlanner(linear_table(), tpot_slo_s=0.015, headroom=0.0)


def test_an_exponent_number_yaml_reads_as_text_is_taken_as_the_number(tmp_path) -> None:
    # YAML 1.1 (PyYAML) reads 5e-3 and 1e-2 unquoted as text: a hand-written table must not be refused for them
    path = tmp_path / "t.yaml"
    path.write_text("entries:\n- " + YAML_ENTRY.replace("0.01", "5e-3") + "\nalpha: 1e-1\n")
    table = StepLatencyTable.load(path)
    assert table.to_dict()["entries"][0]["seconds"] == pytest.approx(5e-3)
    path.write_text("entries:\n- " + YAML_ENTRY.replace("0.01", "lots") + "\n")  # text that is no number: no hint
    with pytest.raises(ProfileError, match=r"seconds: expected a number, got 'lots'$"):
        StepLatencyTable.load(path)
