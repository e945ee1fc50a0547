"""The handoff's block-coverage guard, as pure functions, at every block boundary (DESIGN, vLLM CPU notes)."""

from __future__ import annotations

import pytest

from fulcrum.router.handoff import (
    blocks_needed,
    handoff_is_safe,
    plan_handoff,
    predicted_covered_tokens,
    remote_block_count,
    remote_token_count,
    text_cut,
    Cut,
    choose_cut,
)


def test_blocks_needed_rounds_up_to_whole_blocks():
    assert [blocks_needed(n, 16) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError):
        blocks_needed(-1, 16)
    with pytest.raises(ValueError):
        blocks_needed(4, 0)


@pytest.mark.parametrize("bs", [1, 2, 4, 16, 128])
def test_handing_off_all_k_tokens_is_unsafe_exactly_when_prompt_plus_k_minus_1_is_a_block_multiple(bs):
    # DESIGN: all k tokens trip the decode engine's assertion when (P + k - 1) is a multiple of the block size
    for p in range(1, 3 * bs + 3):
        for k in range(1, 3 * bs + 3):
            unsafe = (p + k - 1) % bs == 0
            assert handoff_is_safe(p, k, bs) is (not unsafe), (p, k, bs)


@pytest.mark.parametrize("bs", [1, 16])
def test_plain_disaggregation_is_always_safe(bs):
    assert all(handoff_is_safe(p, 0, bs) for p in range(0, 5 * bs))


@pytest.mark.parametrize("bs", [2, 16, 64])
def test_the_plan_never_hands_off_an_unsafe_prompt_and_moves_k_by_at_most_one(bs):
    for p in range(1, 3 * bs + 2):
        for k in range(0, 3 * bs + 2):
            plan = plan_handoff(p, k, bs, max_tokens=None)
            assert not plan.colocated
            assert handoff_is_safe(p, plan.k, bs), (p, k, plan)
            assert plan.k in (k, k - 1)
            assert plan.adjusted is (plan.k != k)
            # B's prompt of P + k' tokens fits in the blocks A transfers
            assert blocks_needed(p + plan.k, bs) <= blocks_needed(predicted_covered_tokens(p, plan.k), bs)


def test_block_size_one_leaves_only_plain_disaggregation():
    assert plan_handoff(10, 5, 1, None).k == 0


def test_a_handoff_at_or_past_the_clients_cap_runs_colocated_on_a():
    assert plan_handoff(20, 9, 16, max_tokens=10).colocated
    assert not plan_handoff(20, 8, 16, max_tokens=10).colocated


def test_the_check_after_a_uses_the_blocks_a_actually_returned():
    # 40 tokens need 3 blocks of 16: 2 returned blocks are not enough whatever the prediction says
    assert not handoff_is_safe(38, 2, 16, remote_blocks=2)
    assert handoff_is_safe(38, 2, 16, remote_blocks=3)
    # and at the exact boundary: 32 tokens fill 2 blocks, 33 need a third
    assert handoff_is_safe(30, 2, 16, remote_blocks=2)
    assert not handoff_is_safe(30, 3, 16, remote_blocks=2)
    # fewer blocks than A sent is as wrong: B would take A's last blocks for the start of its prompt
    assert not handoff_is_safe(10, 0, 16, remote_blocks=2)


def test_remote_block_count_reads_flat_and_per_group_block_lists():
    assert remote_block_count({"remote_block_ids": [4, 5, 6]}) == 3
    assert remote_block_count({"remote_block_ids": [[1, 2, 3], [7, 8]]}) == 2
    assert remote_block_count({"remote_block_ids": None}) is None
    assert remote_block_count(None) is None


def test_negative_inputs_are_refused():
    with pytest.raises(ValueError):
        plan_handoff(-1, 2, 16, None)
    with pytest.raises(ValueError):
        plan_handoff(3, -2, 16, None)


def test_the_kv_must_hold_every_prompt_token_but_the_last_which_b_recomputes():
    # vLLM CPU 0.32 answers remote_num_tokens = P + k after max_tokens = k + 1
    assert handoff_is_safe(11, 22, 32, remote_blocks=2, remote_tokens=33)
    assert handoff_is_safe(11, 22, 32, remote_blocks=2, remote_tokens=32)
    assert not handoff_is_safe(11, 22, 32, remote_blocks=2, remote_tokens=31)
    assert remote_token_count({"remote_num_tokens": 33}) == 33
    assert remote_token_count({"remote_num_tokens": True}) is None
    assert remote_token_count({}) is None


def test_the_text_cut_drops_the_last_tokens_own_string():
    assert text_cut("hello world", ["hel", "lo", " world"], 2) == "hello"
    # A's (k+1)-th token decodes alone to U+FFFD (part of a character): no exact cut
    assert text_cut("abé", ["a", "b", "\ufffd", "\ufffd"], 3) is None
    assert text_cut("abé", ["a", "b", "\ufffd", "\ufffd"], 2) is None
    # token k ends inside a character: the text before the cut ends in U+FFFD
    assert text_cut("a\ufffdx", ["a", "\ufffd", "x"], 2) is None
    # the text does not end with the token's own string (a tokenizer whose tokens decode differently alone)
    assert text_cut("the cat", ["the", "cat"], 1) is None
    assert text_cut("abc", None, 1) is None
    assert text_cut("abc", ["a"], 1) is None
    assert text_cut("abc", ["a", "b", "c"], 0) is None


def test_the_cut_is_the_policys_k_when_everything_is_clean_and_fits():
    assert choose_cut("abcd", ["a", "b", "c", "d"], 3, 10, 16, 1, 13) == Cut(3, "abc", True)


def test_a_cut_that_would_fall_inside_a_character_hands_off_the_prompt_alone_on_the_same_kv():
    # tokens 3 and 4 are the two bytes of "é": no cut after token 1, 2 or 3 drops whole characters only
    assert choose_cut("abé", ["a", "b", "\ufffd", "\ufffd"], 3, 10, 16, 1, 13) == Cut(0, "", True)
    # token k is the first byte of "é": moving the cut back only drops more of it
    assert choose_cut("aéc", ["a", "\ufffd", "\ufffd", "c"], 2, 10, 16, 1, 12) == Cut(0, "", True)
    # a character split across tokens before the cut is fine (where summed text offsets would drift)
    assert choose_cut("éab", ["\ufffd", "\ufffd", "a", "b"], 3, 10, 16, 1, 13) == Cut(3, "éa", True)


def test_when_no_prompt_fits_the_transferred_blocks_b_recomputes_without_the_kv():
    # A reports 3 blocks of 16 (bogus for 16 + 3 tokens): no cut fits, the largest clean cut runs without KV
    assert choose_cut("abcd", ["a", "b", "c", "d"], 3, 16, 16, 3, 19) == Cut(3, "abc", False)
    assert choose_cut("a\ufffd", ["a", "\ufffd"], 1, 16, 16, 3, 17) == Cut(0, "", False)
