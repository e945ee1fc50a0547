"""The sim-worker's engine model on its own (pure, virtual time): timing follows the profile, batching respects
the token budget, concurrency and KV limits, and a full KV cache preempts (recompute) like vLLM."""

from __future__ import annotations

import pytest

from fulcrum.ratio.profiles import builtin_profile
from fulcrum.ratio.step_cost import nearest_tp
from fulcrum.worker.sim_engine import SimEngine, SimEngineConfig, StepOutput, greedy_token

PROFILE = builtin_profile("splitwise-llama2-70b-h100")


def engine(**kw: object) -> SimEngine:
    cfg = dict(tp=2, kv_capacity_tokens=int(PROFILE.kv_capacity_tokens(2)))
    cfg.update(kw)
    return SimEngine(PROFILE, SimEngineConfig(**cfg))  # type: ignore[arg-type]


def run(e: SimEngine, until_idle: bool = True, max_steps: int = 100_000) -> tuple[float, list[StepOutput], dict[str, list[float]]]:
    """Step in virtual time; returns (end time, steps, token times per request)."""
    t = 0.0
    steps: list[StepOutput] = []
    times: dict[str, list[float]] = {}
    for _ in range(max_steps):
        out = e.step(t)
        if out is None:
            break
        t += out.duration
        steps.append(out)
        for o in out.outputs:
            times.setdefault(o.request_id, []).append(t)
    return t, steps, times


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 31 + 7 * i) % 200 + 32 for i in range(n)]


@pytest.mark.parametrize("isl", [100, 512, 2048, 6000])
def test_the_first_token_of_a_lone_request_comes_after_the_profiles_ttft(isl: int) -> None:
    e = engine()
    e.add_request("r", prompt(isl), 4, now=0.0)
    _, _, times = run(e)
    assert times["r"][0] == pytest.approx(PROFILE.ttft(isl, 2), rel=0.10)


def test_a_prompt_longer_than_the_token_budget_is_chunked_and_still_costs_the_profiles_ttft() -> None:
    e = engine(max_num_batched_tokens=1024)
    e.add_request("r", prompt(5000), 2, now=0.0)
    _, steps, times = run(e)
    assert [s.num_prefill_tokens for s in steps[:5]] == [1024, 1024, 1024, 1024, 904]
    assert times["r"][0] == pytest.approx(PROFILE.ttft(5000, 2), rel=0.10)


@pytest.mark.parametrize("n,isl", [(1, 1000), (8, 1000), (32, 1000), (128, 200)])
def test_a_batch_of_n_decodes_takes_the_profiles_tpot_per_token(n: int, isl: int) -> None:
    e = engine(max_num_batched_tokens=32768)  # one prefill step for all, then n decode together
    for i in range(n):
        e.add_request(f"r{i}", prompt(isl, i), 50, now=0.0)
    _, steps, times = run(e)
    assert len(steps) == 50 and all(s.num_decodes == n and s.num_prefill_tokens == 0 for s in steps[1:])
    mean_context = isl + 25  # contexts grow from isl + 1 to isl + 49 over the decode steps
    for i in range(n):
        t = times[f"r{i}"]
        tpot = (t[-1] - t[0]) / (len(t) - 1)
        assert tpot == pytest.approx(PROFILE.tpot(n, mean_context, 2), rel=0.10)


def test_time_scale_multiplies_every_step() -> None:
    a, b = engine(), engine(time_scale=0.01)
    for e in (a, b):
        e.add_request("r", prompt(700), 10, now=0.0)
    ta, _, _ = run(a)
    tb, _, _ = run(b)
    assert tb == pytest.approx(ta * 0.01, rel=1e-9)


def test_a_mixed_step_costs_its_prefill_plus_its_decode() -> None:
    e = engine()
    e.add_request("old", prompt(200), 10, now=0.0)
    e.step(0.0)  # the old request's prefill
    e.add_request("new", prompt(1000, 1), 10, now=0.0)
    out = e.step(0.0)
    assert out is not None and out.num_decodes == 1 and out.num_prefill_tokens == 1000
    assert out.prefill_seconds == pytest.approx(PROFILE.ttft(1000, 2))
    assert out.decode_seconds == pytest.approx(PROFILE.tpot(1, 201, 2))
    assert out.duration == pytest.approx(out.prefill_seconds + out.decode_seconds)


def test_every_step_respects_the_token_budget_and_the_concurrency_limit() -> None:
    e = engine(max_num_batched_tokens=2048, max_num_seqs=16)
    for i in range(60):
        e.add_request(f"r{i}", prompt(300 + 37 * i, i), 20, now=0.0)
    _, steps, times = run(e)
    assert all(sum(s.scheduled.values()) <= 2048 for s in steps)
    assert all(len(s.scheduled) <= 16 for s in steps)
    assert max(sum(s.scheduled.values()) for s in steps) == 2048  # the budget is used, not just respected
    assert all(len(times[f"r{i}"]) == 20 for i in range(60))
    assert e.num_running == 0 and e.num_waiting == 0 and e.free_blocks == e.config.num_blocks


def test_a_full_kv_cache_preempts_the_newest_request_which_recomputes_and_gives_the_same_tokens() -> None:
    # 4 requests of 100 + 60 tokens need 40 blocks of 16; the cache has 30: someone must be preempted
    small = engine(kv_capacity_tokens=30 * 16)
    big = engine()
    for e in (small, big):
        for i in range(4):
            e.add_request(f"r{i}", prompt(100, i), 60, now=0.0)
    _, steps, _ = run(small)
    preempted = [rid for s in steps for rid in s.preempted]
    assert preempted and preempted[0] == "r3"  # the last admitted goes first, as in vLLM
    assert small.num_preemptions == len(preempted)
    # the recompute is a prefill of prompt + generated tokens
    resumed = next(s for s in steps if s.scheduled.get("r3", 0) > 100)
    assert resumed.num_prefill_tokens >= resumed.scheduled["r3"] > 100
    outs_small = [o for s in steps for o in s.outputs]
    _, steps_big, _ = run(big)
    outs_big = [o for s in steps_big for o in s.outputs]
    by = lambda outs, r: [o.token for o in outs if o.request_id == r]  # noqa: E731
    assert all(by(outs_small, f"r{i}") == by(outs_big, f"r{i}") for i in range(4))
    assert small.free_blocks == small.config.num_blocks


def test_tokens_are_the_greedy_continuation_of_the_whole_sequence() -> None:
    e = engine()
    p = prompt(40)
    e.add_request("r", p, 12, now=0.0)
    _, steps, _ = run(e)
    got = [o.token for s in steps for o in s.outputs]
    seq = list(p)
    for _ in range(12):
        seq.append(greedy_token(seq))
    assert got == seq[40:]


def test_a_request_with_transferred_kv_computes_only_its_last_token_and_continues_the_same_sequence() -> None:
    a, b = engine(), engine()
    p = prompt(300)
    a.add_request("a", p, 5, now=0.0, keep_kv=True)
    _, _, _ = run(a)
    held = a.held_kv("a")
    assert held is not None and len(held.tokens) == 300 + 5 - 1
    assert len(held.block_ids) == -(-len(held.tokens) // 16)
    assert a.free_blocks == a.config.num_blocks - len(held.block_ids)
    k = 4
    gen = list(held.tokens[300:]) + []  # the first 4 generated tokens
    assert len(gen) == k
    b.add_request("b", p + gen, 10, now=0.0, computed_tokens=len(held.tokens), ready_at=0.5)
    assert b.step(0.0) is None and b.next_ready_at() == 0.5  # waits for its transfer
    out = b.step(0.5)
    assert out is not None and out.scheduled == {"b": 1}
    assert a.take_kv("a") is not None and a.free_blocks == a.config.num_blocks
    seq = p + gen
    want = []
    for _ in range(10):
        want.append(greedy_token(seq))
        seq.append(want[-1])
    rest = [o.token for o in out.outputs]
    while (o2 := b.step(1.0)) is not None:
        rest += [o.token for o in o2.outputs]
    assert rest == want


def test_aborting_frees_the_blocks_and_bad_requests_are_refused() -> None:
    e = engine(kv_capacity_tokens=64 * 16)
    e.add_request("r", prompt(100), 10, now=0.0)
    e.step(0.0)
    assert e.free_blocks < 64
    assert e.abort("r") and not e.abort("r")
    assert e.free_blocks == 64
    with pytest.raises(ValueError, match="more than the 64"):
        e.add_request("huge", prompt(1000), 100, now=0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        e.add_request("zero", prompt(10), 0, now=0.0)
    e.add_request("x", prompt(10), 1, now=0.0)
    with pytest.raises(ValueError, match="already in use"):
        e.add_request("x", prompt(10), 1, now=0.0)


def test_an_unmeasured_tp_is_timed_by_the_nearest_measured_table() -> None:
    dopd = builtin_profile("dopd-llama70b-fp8-h100")  # prefill at TP 1 only, decode at TP 2 only
    e = SimEngine(dopd, SimEngineConfig(tp=2, kv_capacity_tokens=100_000))
    assert (e.prefill_tp, e.decode_tp) == (1, 2)
    assert nearest_tp((2, 4, 8), 3) == 2 and nearest_tp((2, 4, 8), 6) == 4 and nearest_tp((2, 4, 8), 16) == 8
