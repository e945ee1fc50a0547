"""One step-cost model (issue 12, item 2): ``fulcrum.ratio.step_cost.StepCost`` prices engine steps from a profile,
and the simulator, the sim-worker's engine, the router's execution predictor and the latency table's priors give
the same step times for the same profile and inputs."""

from __future__ import annotations


import pytest

from fulcrum.errors import ProfileError
from fulcrum.ratio.profiles import builtin_profile
from fulcrum.ratio.step_cost import StepCost, nearest_tp
from fulcrum.routing.predictor import ExecutionPredictor, MicroRequest, simulate_virtual_batches
from fulcrum.simulator.instances import EngineInstance, Instance, PrefillInstance, SimRequest
from fulcrum.simulator.kernel import Kernel
from fulcrum.worker.latency_table import StepKey, StepLatencyTable
from fulcrum.worker.sim_engine import SimEngine, SimEngineConfig

SPLITWISE = builtin_profile("splitwise-llama2-70b-h100")  # prefill and decode at TP 2, 4, 8
DOPD = builtin_profile("dopd-llama70b-fp8-h100")  # prefill at TP 1 only, decode at TP 2 only

# (profile, TP) grid: measured TPs, plus DOPD's TP 2 whose prefill table is borrowed from TP 1
CASES = [(SPLITWISE, 2), (SPLITWISE, 4), (SPLITWISE, 8), (DOPD, 2)]
PROMPTS = (0, 16, 300, 2048)  # tokens of a prompt started in the step (0: none)
DECODES = (0, 1, 8, 32)  # requests decoding in the step
CONTEXTS = (128, 1024, 4096)  # their mean context, tokens


def grid() -> list[tuple[int, int, int]]:
    return [(p, d, c) for p in PROMPTS for d in DECODES for c in CONTEXTS if p or d]


# -- the model itself ------------------------------------------------------------------------------------------


def test_the_model_reads_the_profile_tables_it_cites():
    for profile, tp in CASES:
        cost = StepCost.from_profile(profile, tp)
        ptp = nearest_tp(profile.prefill_tps, tp)
        for x in (1, 200, 2048, 100_000):
            assert cost.prefill_s(x) == profile.ttft(x, ptp)
        assert cost.prefill_batch_s([100, 900, 2000]) == profile.prefill_batch_time([100, 900, 2000], ptp)
        for b in (1, 7, 64):
            for c in (10, 1500, 50_000):
                assert cost.decode_step_s(b, c) == profile.tpot(b, c, tp)


def test_chunks_of_one_prompt_add_up_to_its_prefill_time():
    cost = StepCost.from_profile(SPLITWISE, 4)
    first = cost.prefill_part_s([(0, 700)])
    rest = cost.prefill_part_s([(700, 600)]) + cost.prefill_part_s([(1300, 748)])
    assert first == cost.prefill_s(700)
    assert first + rest == pytest.approx(cost.prefill_s(2048), rel=1e-12)
    assert cost.prefill_chunk_s(500, 0) == 0.0 and cost.prefill_part_s([]) == 0.0


def test_a_tp_rule_raises_or_borrows_as_named():
    with pytest.raises(ProfileError, match="TP=2"):
        StepCost.from_profile(DOPD, 2, prefill_tp_rule="exact")
    with pytest.raises(ProfileError, match="TP=1"):
        StepCost.from_profile(DOPD, 1, decode_tp_rule="exact")
    with pytest.raises(ProfileError):
        StepCost.from_profile(SPLITWISE, 0)
    borrowed = StepCost.from_profile(DOPD, 2)
    assert (borrowed.prefill_tp, borrowed.decode_tp, borrowed.prefill_scale) == (1, 2, 1.0)
    assert StepCost.from_profile(SPLITWISE, 3).decode_tp == 2  # a tie goes to the smaller, slower TP
    scaled = StepCost.from_profile(DOPD, 2, scale_borrowed_prefill=True)
    assert scaled.prefill_scale == 0.5
    assert scaled.prefill_s(1000) == pytest.approx(0.5 * DOPD.ttft(1000, 1))
    _, k1, k2 = DOPD.prefill[1].quadratic
    assert scaled.prefill_fit_marginal_s(300) == pytest.approx(0.5 * (k1 * 300 + k2 * 300 * 300))


def test_a_decode_run_is_the_sum_of_its_steps_under_either_decode_model():
    for model in ("table", "linear"):
        cost = StepCost.from_profile(SPLITWISE, 4).with_model(decode_model=model, pass_intercept="per_part")
        run = cost.decode_run_s(6, 6 * 1000, 40)
        assert run == pytest.approx(sum(cost.decode_step_s(6, 1000 + j) for j in range(40)), rel=1e-9)
    with pytest.raises(ValueError, match="linear"):
        StepCost.from_profile(SPLITWISE, 4).decode_request_s(1000, 5)


def test_the_predictors_named_choices_stay_within_their_documented_bound():
    """per_pass + linear differs from the default by at most ttft(0) per mixed step plus the decode fit's error,
    on the decode grid the profile measured (outside it the fit extrapolates where the table clamps)."""
    for profile, tp in CASES:
        default = StepCost.from_profile(profile, tp)
        pred = default.with_model(decode_model="linear", pass_intercept="per_pass")
        fit = pred.decode_fit
        assert fit is not None and fit.max_rel_error < 0.1
        table = default.decode_table
        for p in PROMPTS:
            for d in (int(b) for b in table.batch):
                for c in table.context:
                    chunks = [(0, p)] if p else []
                    a, b = default.step_s(chunks, d, c), pred.step_s(chunks, d, c)
                    bound = default.prefill_fixed_s + fit.max_rel_error * default.decode_step_s(d, c) + 1e-12
                    assert abs(a - b) <= bound, (profile.name, tp, p, d, c, a, b)
            if p:  # a prompt alone: the same up to the prefill table's departure from its quadratic fit
                assert pred.step_s([(0, p)], 0, 0.0) == pytest.approx(default.step_s([(0, p)], 0, 0.0), rel=1e-9)
    # DOPD measured batches 104..248 only: at batch 1 the table clamps to its first line, the fit goes below it
    dopd = StepCost.from_profile(DOPD, 2)
    assert dopd.with_model(decode_model="linear", pass_intercept="per_pass").decode_step_s(1, 4096) < 0.5 * (
        dopd.decode_step_s(1, 4096)
    )


# -- the four users ------------------------------------------------------------------------------------------------


class FakeHost:
    """A fake of the simulator's cluster: records first-token and finish times."""

    def __init__(self) -> None:
        self.first: dict[int, float] = {}
        self.finish: dict[int, float] = {}

    def on_first_token(self, r: SimRequest, t: float) -> None:
        self.first[r.idx] = t

    def on_finish(self, r: SimRequest, t: float) -> None:
        self.finish[r.idx] = t

    def on_prefill_done(self, inst: PrefillInstance, batch: list[SimRequest]) -> None:
        pass

    def on_instance_drained(self, inst: Instance) -> None:
        pass

    def on_migrate_out(self, r: SimRequest, inst: EngineInstance, t: float) -> None:
        pass


def simulator_step(profile, tp: int, p: int, d: int, c: int) -> float:
    """The simulator engine's first step: d requests whose KV arrived (context c, one token left to generate) and
    a prompt of p tokens started beside them. The step ends at the new prompt's first token, or at the decoders'
    finish when there is no prompt."""
    kernel, host = Kernel(), FakeHost()
    eng = EngineInstance(host, kernel, 0, "decode", tp, profile, max_batch=1024, chunk_tokens=1 << 20,
                         max_span_steps=None, provisioned_at=0.0, ready_at=0.0)
    eng.capacity = 1e12  # the step's price, not the KV cache, is under test
    for i in range(d):
        r = SimRequest(i, 0.0, c - 1, 2)
        r.generated, r.kv_ready, r.first_token = 1, True, 0.0
        eng.offer(r)
    if p:
        eng.offer(SimRequest(d, 0.0, p, 2))
    while kernel.step():
        if (d in host.first) if p else len(host.finish) == d:
            break
    return host.first[d] if p else host.finish[0]


def sim_engine_step(profile, tp: int, p: int, d: int, c: int) -> float:
    """The sim-worker engine's step with the same work: a warm-up step brings d requests to context c decoding."""
    eng = SimEngine(profile, SimEngineConfig(tp=tp, kv_capacity_tokens=1 << 22, max_num_seqs=1024,
                                             max_num_batched_tokens=1 << 20))
    for i in range(d):
        eng.add_request(f"d{i}", [7] * (c - 1), 8, now=0.0, computed_tokens=c - 2)
    if d:
        warm = eng.step(0.0)
        assert warm is not None and warm.num_decodes == 0
    if p:
        eng.add_request("p", [7] * p, 8, now=0.0)
    out = eng.step(0.0)
    assert out is not None and out.num_decodes == d and out.num_prefill_tokens == p
    return out.duration


@pytest.mark.parametrize(("profile", "tp"), CASES, ids=lambda v: getattr(v, "name", v))
def test_simulator_and_sim_worker_time_every_step_alike(profile, tp):
    cost = StepCost.from_profile(profile, tp)
    for p, d, c in grid():
        expected = cost.step_s([(0, p)] if p else [], d, c)
        assert simulator_step(profile, tp, p, d, c) == expected, (p, d, c)
        assert sim_engine_step(profile, tp, p, d, c) == expected, (p, d, c)


def test_a_chunked_prompt_costs_the_same_steps_in_the_simulator_and_the_sim_worker():
    for profile, tp in CASES:
        kernel, host = Kernel(), FakeHost()
        eng = EngineInstance(host, kernel, 0, "unified", tp, profile, max_batch=8, chunk_tokens=512,
                             max_span_steps=None, provisioned_at=0.0, ready_at=0.0)
        eng.offer(SimRequest(0, 0.0, 2000, 2))
        while 0 not in host.first and kernel.step():
            pass
        worker = SimEngine(profile, SimEngineConfig(tp=tp, kv_capacity_tokens=1 << 20, max_num_batched_tokens=512))
        worker.add_request("p", [7] * 2000, 2, now=0.0)
        steps = [worker.step(0.0) for _ in range(4)]
        cost = StepCost.from_profile(profile, tp)
        chunks = [(0, 512), (512, 512), (1024, 512), (1536, 464)]
        expected = sum(cost.step_s([ch], 0, 0.0) for ch in chunks)
        assert host.first[0] == pytest.approx(expected, rel=1e-12)
        assert sum(s.duration for s in steps if s is not None) == pytest.approx(expected, rel=1e-12)
        assert expected == pytest.approx(cost.prefill_s(2000), rel=1e-9)


def test_a_prefill_instance_prices_its_batch_with_the_model():
    for profile, tp in ((SPLITWISE, 4), (DOPD, 1)):
        kernel = Kernel()
        inst = PrefillInstance(FakeHost(), kernel, 0, tp, profile, 0.0, 0.0)
        batch = [SimRequest(i, 0.0, isl, 1) for i, isl in enumerate((40, 700, 3000))]
        assert inst.start(batch) == StepCost.from_profile(profile, tp).prefill_batch_s([40, 700, 3000])
    with pytest.raises(ProfileError):
        PrefillInstance(FakeHost(), Kernel(), 0, 2, DOPD, 0.0, 0.0)  # a P pool needs its own TP measured


@pytest.mark.parametrize(("profile", "tp"), [(SPLITWISE, 2), (SPLITWISE, 4), (SPLITWISE, 8)])
def test_latency_table_priors_are_the_models_step_times(profile, tp):
    table = StepLatencyTable()
    table.seed_from_profile(profile, tp, max_prefill_tokens=4096, max_context_tokens=4096, max_decodes=32)
    cost = StepCost.from_profile(profile, tp)
    checked = 0
    for p in (0, 16, 256, 2048):
        for d in (0, 1, 8, 32):
            for c in ((0,) if d == 0 else (128, 1024, 4096)):
                if p == 0 and d == 0:
                    continue
                entry = table.entry(StepKey(p, c, d))
                assert entry is not None and entry.seconds == cost.step_s([(0, p)] if p else [], d, c), (p, c, d)
                checked += 1
    assert checked == 39
    with pytest.raises(ProfileError, match="TP=2"):
        StepLatencyTable().seed_from_profile(DOPD, 2)  # priors need both tables measured at the TP


@pytest.mark.parametrize(("profile", "tp"), CASES, ids=lambda v: getattr(v, "name", v))
def test_the_predictor_uses_the_same_model_with_its_named_choices(profile, tp):
    costs = ExecutionPredictor(profile).costs(tp)
    assert costs is not None and (costs.decode_model, costs.pass_intercept) == ("linear", "per_pass")
    default = StepCost.from_profile(profile, tp)
    assert (costs.prefill_tp, costs.decode_tp) == (default.prefill_tp, default.decode_tp)
    same = costs.with_model(decode_model="table", pass_intercept="per_part")
    for p, d, c in grid():
        chunks = [(0, p)] if p else []
        assert same.step_s(chunks, d, c) == default.step_s(chunks, d, c) == simulator_step(profile, tp, p, d, c)
    # a prompt alone on an idle instance: the probe's time to drain is the simulator's prefill-only step
    pred = ExecutionPredictor(profile).instance("i", tp=tp)
    assert pred is not None
    for p in (16, 300, 2048):
        probe = pred.probe(MicroRequest(p, 0, 0), now=0.0)
        assert probe.added_s == pytest.approx(simulator_step(profile, tp, p, 0, 128), rel=1e-9)
    # the reference virtual-batch simulation runs under either set of choices; the default one is the simulator's
    run = simulate_virtual_batches([MicroRequest(300, 0, 0)], same, max_num_batched_tokens=8192, max_num_seqs=8)
    assert run.seconds == default.step_s([(0, 300)], 0, 0.0)
