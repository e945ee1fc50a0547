"""The remaining-length predictor (ARES §4): E[L − g | L > g] per model and ISL bucket, refreshed online."""

from __future__ import annotations

import random

import numpy as np
import pytest

from fulcrum.routing.remaining_length import (
    ExcessWindow,
    HiddenStateLengthPredictor,
    RemainingLength,
    RemainingLengthPredictor,
)


def fed(lengths, *, prompt=100, model="m", **kwargs) -> RemainingLengthPredictor:
    p = RemainingLengthPredictor(**kwargs)
    for n in lengths:
        p.observe(model, prompt, n)
    return p


def test_the_conditional_mean_and_median_match_hand_computed_values():
    lengths = [10, 20, 30, 100]
    mean = fed(lengths, min_samples=1)
    med = fed(lengths, min_samples=1, statistic="median")
    assert mean.predict_remaining("m", 100, 0) == 40  # (10 + 20 + 30 + 100) / 4
    assert mean.predict_remaining("m", 100, 15) == 35  # (20 + 30 + 100) / 3 − 15
    assert med.predict_remaining("m", 100, 15) == 15  # median(20, 30, 100) − 15
    assert mean.predict_remaining("m", 100, 25) == 40  # (30 + 100) / 2 − 25
    assert med.predict_remaining("m", 100, 25) == 40  # median of two is their mean
    assert mean.predict_remaining("m", 100, 30) == 70  # only the 100 is left


def test_estimates_equal_a_brute_force_computation_on_random_lengths():
    rng = random.Random(3)
    lengths = [int(rng.paretovariate(1.5) * 20) for _ in range(3000)]
    p = fed(lengths, window=4096, min_samples=1)
    arr = np.array(lengths[-4096:])
    for g in (0, 5, 16, 64, 256):
        tail = arr[arr > g]
        assert p.estimate("m", 100, g) == pytest.approx(float(np.mean(tail - g)))
    pm = fed(lengths, window=4096, min_samples=1, statistic="median")
    for g in (0, 16, 64):
        tail = arr[arr > g]
        assert pm.estimate("m", 100, g) == pytest.approx(float(np.median(tail - g)))


def test_a_heavy_tail_makes_the_remaining_length_grow_with_the_tokens_already_generated():
    rng = random.Random(1)
    # Pareto(α = 1.8, x_m = 30): past x_m the mean residual life is g / (α − 1), growing linearly with g
    pareto = fed([int(rng.paretovariate(1.8) * 30) for _ in range(4000)], window=4096)
    r = [pareto.predict_remaining("m", 100, g) for g in (64, 128, 256)]
    assert r == sorted(r) and r[-1] > 2.5 * r[0]
    assert r[0] == pytest.approx(64 / 0.8, rel=0.25)
    # a memoryless (geometric) length: the remaining length stays about the same whatever g
    geo = fed([int(rng.expovariate(1 / 200)) + 1 for _ in range(4000)], window=4096)
    flat = [geo.predict_remaining("m", 100, g) for g in (0, 64, 256)]
    assert max(flat) / min(flat) < 1.2


def test_isl_buckets_are_kept_apart_and_a_thin_bucket_falls_back_to_the_model_window():
    p = RemainingLengthPredictor(min_samples=8)
    for _ in range(50):
        p.observe("m", 40, 10)  # short prompts (bucket < 64): 10-token answers
        p.observe("m", 3000, 500)  # long prompts (bucket 2048..4095): 500-token answers
    assert p.predict_remaining("m", 40, 0) == 10
    assert p.predict_remaining("m", 3000, 0) == 500
    # ISL 300's bucket is empty: the whole model window (mean of 10s and 500s) answers
    assert p.predict_remaining("m", 300, 0) == 255
    # at g = 10 no short answer is left anywhere: every estimate comes from the long answers
    assert p.predict_remaining("m", 40, 10) == 490


def test_models_are_learnt_separately_and_an_unseen_model_gets_the_cap_or_the_prior():
    p = RemainingLengthPredictor(prior_tokens=300)
    for _ in range(40):
        p.observe("small", 100, 20)
    assert p.predict_remaining("small", 100, 0) == 20
    assert p.predict_remaining("other", 100, 0) == 300
    assert p.predict_remaining("other", 100, 10, max_tokens=64) == 54


def test_the_answer_is_capped_by_max_tokens_and_zero_once_the_cap_is_reached():
    p = fed([1000] * 40)
    assert p.predict_remaining("m", 100, 0, max_tokens=128) == 128
    assert p.predict_remaining("m", 100, 100, max_tokens=128) == 28
    assert p.predict_remaining("m", 100, 128, max_tokens=128) == 0
    assert p.predict_remaining("m", 100, -5) == 1000  # a negative count is read as 0


def test_past_the_observed_tail_the_estimate_is_the_excess_over_a_high_threshold():
    lengths = list(range(1, 101))
    p = fed(lengths, min_samples=10)
    # 10 values above 90: their mean excess over 90 is 5.5; beyond 100 an exponential tail keeps it
    assert p.estimate("m", 100, 500) == pytest.approx(5.5)
    assert p.predict_remaining("m", 100, 500) == 6
    assert p.predict_remaining("m", 100, 95) == 6  # 5 values above 95 (< min_samples): the same tail rule


def test_the_sliding_window_follows_a_shift_in_the_output_lengths():
    p = fed([50] * 200, window=64, min_samples=4)
    assert p.predict_remaining("m", 100, 0) == 50
    for _ in range(4 * 64):  # a full model window (4 × the bucket window) of the new regime
        p.observe("m", 100, 400)
    assert p.predict_remaining("m", 100, 0) == 400


def test_excess_window_counts_and_evicts_in_arrival_order():
    w = ExcessWindow(3)
    for v in (5, 1, 9, 7):
        w.add(v)
    assert len(w) == 3 and w.count_above(0) == 3  # 5 was evicted first
    assert w.excess(0, "mean") == pytest.approx(17 / 3)
    assert w.excess(8, "mean") == pytest.approx(1.0)
    assert w.excess(9, "median") is None
    assert w.tail_threshold(1) == 7.0


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        RemainingLengthPredictor(statistic="mode")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RemainingLengthPredictor(bucket_edges=(64, 32))
    with pytest.raises(ValueError):
        RemainingLengthPredictor(min_samples=0)
    with pytest.raises(ValueError):
        ExcessWindow(0)


class _FakeMlp:
    """A FAKE stand-in for an ARES hidden-state predictor: a fixed linear read-out, to check the interface shape."""

    model = "m"
    hidden_size = 4

    def predict_remaining(self, hidden_states: np.ndarray) -> np.ndarray:
        if hidden_states.ndim != 2 or hidden_states.shape[1] != self.hidden_size:
            raise ValueError("expected (batch, hidden_size)")
        return np.maximum(hidden_states.sum(axis=1), 0.0).astype(np.float32)


def test_the_statistical_predictor_and_a_hidden_state_predictor_fit_their_protocols():
    assert isinstance(RemainingLengthPredictor(), RemainingLength)
    mlp = _FakeMlp()
    assert isinstance(mlp, HiddenStateLengthPredictor)
    out = mlp.predict_remaining(np.ones((3, 4), dtype=np.float32))
    assert out.shape == (3,) and float(out[0]) == 4.0


def test_a_thin_window_answers_with_the_excess_over_g_of_what_it_has_not_over_its_shortest_length():
    """Fewer observations than ``min_samples`` in the whole window: g is not past the observed tail, so the
    memoryless-tail rule (excess over the window's shortest length) must not answer. One 100-token answer used
    to predict 1 remaining token for a fresh request, five answers of 190–230 tokens 25 (their mean excess over
    190)."""
    one = fed([100])  # min_samples 16
    assert one.predict_remaining("m", 100, 0) == 100
    assert one.predict_remaining("m", 100, 50) == 50
    five = fed([190, 200, 210, 220, 230])
    assert five.predict_remaining("m", 100, 0) == 210
    assert five.predict_remaining("m", 100, 100) == 110
    assert five.predict_remaining("m", 100, 189) == 21  # every observation is above g = 189
    assert fed([190, 200, 210, 220, 230], statistic="median").predict_remaining("m", 100, 0) == 210
    # from the shortest length on, the memoryless tail answers as before: the excess over it
    for g in (190, 205, 500):
        assert five.estimate("m", 100, g) == pytest.approx((200 + 210 + 220 + 230) / 4 - 190)
