"""BanaServe's load-aware dispatch over a shared KV store, on two real vLLM CPU engines: instance B runs a request
whose prompt's cached prefix is pulled from instance A (a partial prefix: B computes the rest), and the answer is
the greedy answer A gives alone.

Both engines run NixlConnector ``kv_both`` with ``kv_connector_extra_config.bidirectional_kv_xfer: true`` (the
vLLM 0.32 path that loads a partial prefix: a request carrying ``do_remote_decode`` with the holder's
``remote_block_ids``; without it a partial prefix sent as ``do_remote_prefill`` trips the decode side's
``num_decode_blocks <= len(prefill_group)`` assertion, DESIGN). The router runs in-process with
``kv_connector.partial_prefix: true`` and :class:`PullTestPolicy`, a test double that colocates on B and plans a
pull of the prompt's block-aligned prefix from A (the real ``load_aware`` policy plans the same thing from load
and its prefix index; its unit tests cover that choice). Opt-in:
``flock /tmp/fulcrum-vllm.lock pytest -m vllm tests/integration/test_kv_store_vllm.py``.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")
pytest_asyncio = pytest.importorskip("pytest_asyncio")

from aiohttp.test_utils import TestClient, TestServer  # noqa: E402

from fakes.sse_client import answer_text, parse_stream  # noqa: E402
from fulcrum.router.app import ROUTER, create_app  # noqa: E402
from fulcrum.router.config import parse_config  # noqa: E402
from fulcrum.routing.base import InstanceView, PolicyCapabilities, RequestInfo, RouteDecision  # noqa: E402
from fulcrum.routing.prefix import PrefixPull  # noqa: E402

from .engines import BLOCK_SIZE, Engine, EngineSpec, engine_pair, post_json, skip_unless_vllm  # noqa: E402

pytestmark = pytest.mark.vllm

SHARED = "def quicksort(items):\n    if len(items) <= 1:\n        return items\n    pivot = items[0]\n" * 3
N = 24


class PullTestPolicy:
    """TEST DOUBLE policy: colocate on B and plan a pull of the prompt's block-aligned prefix (below P) from A."""

    name = "pull-test-double"

    def __init__(self) -> None:
        self.pulls: dict[str, PrefixPull] = {}
        self.capabilities = PolicyCapabilities(take_prefix_pull=self.take_prefix_pull)

    def route(self, req: RequestInfo, instances: Sequence[InstanceView], now: float) -> RouteDecision:
        tokens = (req.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
        self.pulls[req.request_id] = PrefixPull("A", "B", tokens, 0)
        return RouteDecision("colocated", "B", split_token=req.prompt_tokens + req.max_tokens, reason="pull test")

    def take_prefix_pull(self, request_id: str) -> PrefixPull | None:
        return self.pulls.pop(request_id, None)

    def on_start(self, req: RequestInfo, decision: RouteDecision, now: float) -> None:
        return None

    def on_finish(self, request_id: str, now: float) -> None:
        return None


def spec(name: str, cpu: int) -> EngineSpec:
    kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
          "kv_connector_extra_config": {"bidirectional_kv_xfer": True}}
    return EngineSpec(name, cpu=cpu, kv_role=None, extra_args=("--kv-transfer-config", json.dumps(kv)))


@pytest.fixture(scope="module")
def engines(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    skip_unless_vllm(request.config)
    with engine_pair(tmp_path_factory.mktemp("vllm-kv-store"), spec("A", 0), spec("B", 1)) as pair:
        yield pair


@pytest_asyncio.fixture
async def client(engines: tuple[Engine, Engine]) -> AsyncIterator[TestClient[Any, Any]]:
    a, b = engines
    config = parse_config({
        "model": "tiny", "kv_block_size": BLOCK_SIZE, "max_retries": 0,
        "instances": [{"id": "A", "url": a.url, "role": "both"}, {"id": "B", "url": b.url, "role": "both"}],
        "timeouts": {"connect_s": 5, "first_token_s": 60, "idle_s": 60, "request_s": 120},
        "kv_connector": {"partial_prefix": True, "prefill_tokens_per_s": 100.0},  # CPU prefill: pulls pay
    })
    app = create_app(config, policy_factory=lambda name, params: PullTestPolicy(), health_checks=False)
    c: TestClient[Any, Any] = TestClient(TestServer(app, handler_cancellation=True))
    await c.start_server()
    try:
        yield c
    finally:
        await c.close()


def external_tokens(engine: Engine) -> float:
    """``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}``: prompt tokens loaded from another engine."""
    with urllib.request.urlopen(engine.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(v) for v in re.findall(
        r'^vllm:prompt_tokens_by_source_total\{[^}]*source="external_kv_transfer"[^}]*\} (\S+)$', text, re.M))


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
async def test_a_prefix_pulled_from_its_holder_gives_the_answer_the_holder_gives_alone(client, engines, stream):
    a, b = engines
    # each case its own prefix: B must not hold it already (a local prefix-cache hit leaves nothing to pull)
    prompt = f"# variant {'stream' if stream else 'whole'}\n" + SHARED + "# done\n"
    status, ref = post_json(a.url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": N,
                                                         "temperature": 0, "ignore_eos": True})
    assert status == 200, ref  # also leaves the prompt's blocks in A's prefix cache
    p = int(ref["usage"]["prompt_tokens"])
    assert p > 2 * BLOCK_SIZE
    before = external_tokens(b)
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": N, "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    resp = await client.post("/v1/completions", json=body)
    raw = await resp.read()
    assert resp.status == 200, raw[:500]
    if stream:
        text, usage, _, done = parse_stream(raw)
        assert done and usage is not None
    else:
        data = json.loads(raw)
        text, usage = answer_text(data), data["usage"]
        assert "kv_transfer_params" not in data
    assert text == ref["choices"][0]["text"]
    assert usage["prompt_tokens"] == p and usage["completion_tokens"] == N
    metrics = client.app[ROUTER].metrics.registry  # type: ignore[index]
    assert (metrics.get_sample_value("fulcrum_router_prefix_pulls_total", {"outcome": "pulled"}) or 0) >= 1
    deadline = time.monotonic() + 5
    while external_tokens(b) - before <= 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    pulled = external_tokens(b) - before
    assert 0 < pulled <= (p - 1) // BLOCK_SIZE * BLOCK_SIZE  # B loaded the prefix, not the whole prompt
    assert a.alive() and b.alive() and b.healthy()
