"""The sim-worker's HTTP surface (aiohttp test servers on 127.0.0.1): OpenAI answers, errors, metrics, timing that
follows the profile, client aborts, and the NIXL kv_transfer_params protocol between two sim-workers — directly
and through the real router with the disaggregated and split policies, where every run must give the colocated
tokens."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")
pytest_asyncio = pytest.importorskip("pytest_asyncio")

from aiohttp.test_utils import TestClient, TestServer  # noqa: E402

from fakes.fake_policy import FakePolicy  # noqa: E402
from fakes.sse_client import answer_text, parse_stream  # noqa: E402
from fulcrum.ratio.profiles import builtin_profile  # noqa: E402
from fulcrum.router.app import create_app, default_policy_factory  # noqa: E402
from fulcrum.router.config import parse_config  # noqa: E402
from fulcrum.worker.sim_engine import SimEngineConfig, greedy_token  # noqa: E402
from fulcrum.worker.sim_server import SimServerSettings, SimWorker, create_sim_app  # noqa: E402

pytestmark = pytest.mark.asyncio

PROFILE = builtin_profile("splitwise-llama2-70b-h100")
MODEL = "sim-model"
BS = 16


def expected(prompt: list[int], n: int) -> str:
    seq = list(prompt)
    for _ in range(n):
        seq.append(greedy_token(seq))
    return bytes(seq[len(prompt):]).decode()


def tokens_of(text: str) -> list[int]:
    return list(text.encode())


class Sim:
    def __init__(self, worker: SimWorker, client: TestClient[Any, Any]) -> None:
        self.worker = worker
        self.client = client

    @property
    def url(self) -> str:
        return str(self.client.make_url("")).rstrip("/")

    def metric(self, name: str, **labels: str) -> float:
        v = self.worker.metrics.registry.get_sample_value(name, {"model_name": MODEL, **labels})
        return 0.0 if v is None else v


@pytest_asyncio.fixture
async def sim():
    made: list[Sim] = []

    async def make(engine_id: str = "w0", time_scale: float = 0.01, kv_capacity_tokens: int = 50_000,
                   max_model_len: int = 4096, **settings: Any) -> Sim:
        worker = SimWorker(PROFILE, SimEngineConfig(tp=2, kv_capacity_tokens=kv_capacity_tokens, block_size=BS,
                                                    time_scale=time_scale),
                           SimServerSettings(model=MODEL, engine_id=engine_id, max_model_len=max_model_len,
                                             **settings))
        client: TestClient[Any, Any] = TestClient(TestServer(create_sim_app(worker), handler_cancellation=True))
        await client.start_server()
        s = Sim(worker, client)
        made.append(s)
        return s

    yield make
    for s in made:
        await s.client.close()


# ------------------------------------------------------------------------------------------------ the API
@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stream", [False, True])
async def test_completions_stream_or_not_give_the_greedy_tokens_and_usage(sim, chat: bool, stream: bool) -> None:
    s = await sim()
    if chat:
        msgs = [{"role": "user", "content": "hello"}]
        body: dict[str, Any] = {"model": MODEL, "messages": msgs, "max_tokens": 12}
        prompt = tokens_of("<|user|>hello\n<|assistant|>")
        path = "/v1/chat/completions"
    else:
        body = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 12}
        prompt = tokens_of("the quick brown fox")
        path = "/v1/completions"
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    r = await s.client.post(path, json=body)
    assert r.status == 200, await r.text()
    if stream:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        text, usage, chunks, done_once = parse_stream(await r.read())
        assert done_once
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    else:
        data = await r.json()
        text, usage = answer_text(data), data["usage"]
        assert data["choices"][0]["finish_reason"] == "length"
    assert text == expected(prompt, 12)
    assert usage == {"prompt_tokens": len(prompt), "completion_tokens": 12, "total_tokens": len(prompt) + 12}


async def test_token_ids_logprobs_and_stop_strings_are_answered_like_vllm(sim) -> None:
    s = await sim()
    prompt = tokens_of("abc")
    full = expected(prompt, 30)
    r = await s.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 30, "return_token_ids": True,
                                                     "logprobs": 0})
    data = await r.json()
    ch = data["choices"][0]
    assert ch["token_ids"] == tokens_of(full) and ch["prompt_token_ids"] == prompt
    assert "".join(ch["logprobs"]["tokens"]) == full and ch["logprobs"]["text_offset"][:2] == [0, 1]
    stop = full[10:12]
    r = await s.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 30, "stop": [stop],
                                                     "ignore_eos": True})
    data = await r.json()
    ch = data["choices"][0]
    assert (ch["text"], ch["finish_reason"], ch["stop_reason"]) == (full[:full.index(stop)], "stop", stop)
    await asyncio.sleep(0.05)
    assert s.worker.busy == 0 and s.worker.engine.free_blocks == s.worker.engine.config.num_blocks


@pytest.mark.parametrize("body,status,needle", [
    ({"prompt": "x" * 4000, "max_tokens": 200}, 400, "maximum context length is 4096 tokens"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens must be a positive integer"),
    ({"prompt": "hi", "max_tokens": "3"}, 400, "max_tokens must be a positive integer"),
    ({"prompt": [1, 2, 999]}, 400, "out of vocabulary"),
    ({"prompt": ""}, 400, "prompt must be"),
    ({"prompt": "hi", "n": 2}, 400, "n = 1"),
    ({"prompt": "hi", "model": "other"}, 404, "does not exist"),
    ({"prompt": "hi", "kv_transfer_params": {"do_remote_prefill": True}}, 400, "remote_host"),
    ({"prompt": "hi", "kv_transfer_params": 5}, 400, "kv_transfer_params must be an object"),
    ({"prompt": [[1, 2], [3]]}, 400, "batched prompts (2) are not supported"),
    ({"prompt": ["a", "b"]}, 400, "batched prompts (2) are not supported"),
    ({"prompt": "hi", "stream": "maybe"}, 400, "stream: Input should be a valid boolean, got 'maybe'"),
    ({"prompt": "hi", "echo": "yes"}, 400, "without best_of or echo"),
    ({"prompt": "hi", "echo": "maybe"}, 400, "echo: Input should be a valid boolean, got 'maybe'"),
    ({"prompt": "hi", "n": 0}, 400, "n must be at least 1, got 0."),
    ({"prompt": "hi", "n": "x"}, 400, "n: Input should be a valid integer, got 'x'"),
    ({"prompt": "hi", "logprobs": 21}, 400, "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    ({"prompt": "hi", "logprobs": -1}, 400, "`logprobs` must be a positive value."),  # vLLM's CompletionRequest
    ({"prompt": "hi", "logprobs": "x"}, 400, "logprobs: Input should be a valid integer, got 'x'"),
    ({"prompt": "hi", "stop": 5}, 400, "stop must be a string or a list of strings, got 5"),
    ({"prompt": "hi", "stop": ["ab", None]}, 400, "stop must be a string or a list of strings, got ['ab', None]"),
    ({"prompt": "hi", "model": 5}, 400, "model: Input should be a valid string, got 5"),
])
async def test_bad_requests_get_a_4xx_with_the_reason(sim, body: dict[str, Any], status: int, needle: str) -> None:
    s = await sim()
    r = await s.client.post("/v1/completions", json=body)
    assert r.status == status
    assert needle in (await r.json())["error"]["message"]


async def test_logprobs_up_to_vllms_max_of_20_are_answered(sim) -> None:
    s = await sim()
    r = await s.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 20})
    assert r.status == 200
    lp = (await r.json())["choices"][0]["logprobs"]
    assert lp["tokens"] == list(expected(tokens_of("hi"), 2)) and lp["top_logprobs"] is not None


CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("body,needle", [
    ({"messages": [{"role": "user", "content": "x" * 5000}]},  # no max_tokens: the prompt alone is too long
     "This model's maximum context length is 4096 tokens. However, you requested 5022 tokens in the messages, "
     "Please reduce the length of the messages."),
    ({"messages": [{"role": "user", "content": "x" * 4074}]},  # exactly max_model_len: no room for one token
     "However, you requested 4096 tokens in the messages"),
    ({"messages": [{"content": "hi"}], "max_tokens": 2}, "messages[0].role: a string is required, got None"),
    ({"messages": [{"role": 5, "content": "hi"}], "max_tokens": 2}, "messages[0].role: a string is required, got 5"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "model": ["x"]},
     "model: Input should be a valid string, got ['x']"),
    # logprobs / top_logprobs: vLLM's ChatCompletionRequest.check_logprobs, then pydantic, then max_logprobs (20)
    ({**CHAT, "top_logprobs": 3}, "when using `top_logprobs`, `logprobs` must be set to true."),
    ({**CHAT, "top_logprobs": 3, "logprobs": False}, "when using `top_logprobs`, `logprobs` must be set to true."),
    ({**CHAT, "top_logprobs": -1, "logprobs": 0}, "when using `top_logprobs`, `logprobs` must be set to true."),
    ({**CHAT, "top_logprobs": -2, "logprobs": True}, "`top_logprobs` must be a positive value or -1."),
    ({**CHAT, "top_logprobs": "3", "logprobs": True}, "`top_logprobs` must be an integer."),
    ({**CHAT, "top_logprobs": 2.5, "logprobs": True}, "top_logprobs: Input should be a valid integer, got 2.5"),
    ({**CHAT, "logprobs": "maybe"}, "logprobs: Input should be a valid boolean, got 'maybe'"),
    ({**CHAT, "logprobs": 2}, "logprobs: Input should be a valid boolean, got 2"),
    ({**CHAT, "top_logprobs": 21, "logprobs": True},
     "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    ({**CHAT, "top_logprobs": -1, "logprobs": True},  # -1: the whole vocabulary, 256 byte tokens
     "Requested sample logprobs of 256, which is greater than max allowed: 20"),
])
async def test_bad_chat_requests_get_400_with_vllms_reason(sim, body: dict[str, Any], needle: str) -> None:
    s = await sim()
    r = await s.client.post("/v1/chat/completions", json=body)
    assert r.status == 400
    assert needle in (await r.json())["error"]["message"]


@pytest.mark.parametrize("lp", [None, 0, 2])
async def test_streamed_completion_chunks_carry_each_tokens_logprobs(sim, lp: int | None) -> None:
    """Like vLLM's streamed ``text_completion`` chunks: each token's chunk has its ``logprobs`` (``text_offset``
    from the answer's start), and they add up to what the whole answer gives; none when none are asked for."""
    s = await sim()
    prompt = tokens_of("abc")
    full = expected(prompt, 6)
    extra = {} if lp is None else {"logprobs": lp}
    r = await s.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "stream": True, **extra})
    assert r.status == 200, await r.text()
    text, _, chunks, _ = parse_stream(await r.read())
    per_token = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["text"]]
    assert text == full and len(per_token) == 6
    if lp is None:
        assert per_token == [None] * 6
        return
    assert [p["tokens"] for p in per_token] == [[c] for c in full]
    assert [p["text_offset"] for p in per_token] == [[i] for i in range(6)]
    assert all(p["token_logprobs"] == [0.0] for p in per_token)
    assert [p["top_logprobs"] for p in per_token] == ([None] * 6 if lp == 0 else [[{c: 0.0}] for c in full])
    whole = await s.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, **extra})
    lps = (await whole.json())["choices"][0]["logprobs"]
    assert lps["tokens"] == [t for p in per_token for t in p["tokens"]]
    assert lps["text_offset"] == [o for p in per_token for o in p["text_offset"]]


def chat_logprob(c: str, top: int) -> dict[str, Any]:
    """The logprobs entry of one greedy token in OpenAI's chat shape: certain (0.0), itself its only candidate."""
    entry: dict[str, Any] = {"token": c, "logprob": 0.0, "bytes": list(c.encode())}
    return {**entry, "top_logprobs": [entry] if top > 0 else []}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("top", [0, 3])
async def test_chat_logprobs_are_answered_per_token_in_openais_chat_shape(sim, stream: bool, top: int) -> None:
    s = await sim()
    prompt = tokens_of("<|user|>hi\n<|assistant|>")
    full = expected(prompt, 8)
    stop = full[5:7]  # the token completing the stop string has its entry too, as in vLLM (token_ids keep it)
    body = {**CHAT, "max_tokens": 8, "logprobs": True, "top_logprobs": top, "stop": stop, "stream": stream}
    r = await s.client.post("/v1/chat/completions", json=body)
    assert r.status == 200, await r.text()
    if stream:
        text, _, chunks, done_once = parse_stream(await r.read())
        choices = [c["choices"][0] for c in chunks]
        assert done_once and choices[0]["delta"].get("role") == "assistant" and choices[0]["logprobs"] is None
        assert choices[-1]["finish_reason"] == "stop" and choices[-1]["logprobs"] is None
        per_token = [c["logprobs"]["content"] for c in choices[1:-1]]
        assert all(len(entries) == 1 for entries in per_token)  # one chunk per token, each with its entry
        content = [e for entries in per_token for e in entries]
    else:
        data = await r.json()
        text = answer_text(data)
        content = data["choices"][0]["logprobs"]["content"]
    assert text == full[:5]
    assert content == [chat_logprob(c, top) for c in full[:7]]


@pytest.mark.parametrize("extra,answered", [
    ({}, False),
    ({"top_logprobs": 0}, False),  # 0 needs no logprobs: true (vLLM tests top_logprobs > 0 or == -1)
    ({"top_logprobs": 3, "logprobs": "false"}, False),  # vLLM's validator tests the raw value's truth: passes
    ({"logprobs": "yes"}, True),  # pydantic's lax boolean; top_logprobs defaults to 0
    ({"logprobs": True, "top_logprobs": 20}, True),
    ({"logprobs": 1, "top_logprobs": 3.0}, True),
    ({"logprobs": True, "top_logprobs": None}, True),
])
async def test_chat_logprobs_are_read_as_vllms_request_model_reads_them(sim, extra: dict[str, Any],
                                                                       answered: bool) -> None:
    s = await sim()
    r = await s.client.post("/v1/chat/completions", json={**CHAT, **extra})
    assert r.status == 200, await r.text()
    lp = (await r.json())["choices"][0]["logprobs"]
    if not answered:
        assert lp is None
    else:
        top = int(extra.get("top_logprobs") or 0)
        assert lp == {"content": [chat_logprob(c, top) for c in expected(tokens_of("<|user|>hi\n<|assistant|>"), 2)]}


async def test_stream_reads_a_boolean_as_vllms_request_models_do(sim) -> None:
    s = await sim()
    r = await s.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": "yes"})
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    r = await s.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": 0})
    assert r.status == 200 and (await r.json())["object"] == "text_completion"


async def test_echo_and_add_generation_prompt_read_booleans_as_vllms_request_models_do(sim) -> None:
    s = await sim()
    r = await s.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "echo": "false"})
    assert r.status == 200  # "false" is False to pydantic, not a truthy string
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    usage = {}
    for agp in (None, True, "no", 0):
        body = chat if agp is None else {**chat, "add_generation_prompt": agp}
        r = await s.client.post("/v1/chat/completions", json=body)
        assert r.status == 200
        usage[agp] = (await r.json())["usage"]["prompt_tokens"]
    assert usage[None] == usage[True] > usage["no"] == usage[0]  # the default adds the assistant header
    r = await s.client.post("/v1/chat/completions", json={**chat, "add_generation_prompt": "maybe"})
    assert r.status == 400
    assert "add_generation_prompt: Input should be a valid boolean" in (await r.json())["error"]["message"]


async def test_a_body_that_is_not_json_gets_400(sim) -> None:
    s = await sim()
    r = await s.client.post("/v1/completions", data=b"{nope")
    assert r.status == 400 and "not JSON" in (await r.json())["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
                                  "/fulcrum/kv/pull"])
@pytest.mark.parametrize("data", [b"[" * 100_000, b'{"a":' * 50_000])
async def test_a_body_nested_too_deeply_for_the_json_parser_gets_400_not_500(sim, path: str, data: bytes) -> None:
    s = await sim()
    r = await s.client.post(path, data=data)
    assert r.status == 400
    assert (await r.json())["error"]["message"] == "body is not JSON: nested too deeply"
    r = await s.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})  # still serving
    assert r.status == 200 and (await r.json())["choices"][0]["text"] == expected(tokens_of("hi"), 2)


async def test_tokenize_models_health_and_metrics_speak_vllms_names(sim) -> None:
    s = await sim()
    r = await s.client.post("/tokenize", json={"prompt": "héllo"})
    assert (await r.json()) == {"count": 6, "max_model_len": 4096, "tokens": tokens_of("héllo")}
    r = await s.client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert (await r.json())["tokens"] == tokens_of("<|user|>hi\n<|assistant|>")
    models = await (await s.client.get("/v1/models")).json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 4096
    assert (await s.client.get("/health")).status == 200
    await s.client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5})
    text = await (await s.client.get("/metrics")).text()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:request_time_per_output_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_prompt_tokens_count",
                 "vllm:request_generation_tokens_count"):
        assert f'{name}{{model_name="{MODEL}"}}' in text, name
    assert s.metric("vllm:generation_tokens_total") == 5 and s.metric("vllm:prompt_tokens_total") == 5
    s.worker.start_draining()
    assert (await s.client.get("/health")).status == 503


# ------------------------------------------------------------------------------------------------ timing
async def test_at_low_load_measured_ttft_and_tpot_track_the_profile(sim) -> None:
    scale = 1.0  # the profile's own time: HTTP overhead (a few ms) stays well inside 10%
    s = await sim(time_scale=scale)
    isl, n = 1000, 24
    prompt = [(5 * i) % 200 + 32 for i in range(isl)]
    t0 = time.monotonic()
    r = await s.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "stream": True})
    times: list[float] = []
    async for line in r.content:
        if line.startswith(b"data: {") and b'"text": ""' not in line:
            times.append(time.monotonic())
    assert len(times) == n
    ttft = times[0] - t0
    tpot = (times[-1] - times[0]) / (n - 1)
    assert ttft == pytest.approx(scale * PROFILE.ttft(isl, 2), rel=0.10)
    assert tpot == pytest.approx(scale * PROFILE.tpot(1, isl + n / 2, 2), rel=0.10)
    # the server's own histograms agree
    assert s.metric("vllm:time_to_first_token_seconds_sum") == pytest.approx(scale * PROFILE.ttft(isl, 2), rel=0.10)
    assert s.metric("vllm:request_time_per_output_token_seconds_sum") == pytest.approx(tpot, rel=0.10)


async def test_a_client_that_goes_away_aborts_its_request_and_frees_its_kv(sim) -> None:
    s = await sim(time_scale=1.0)
    r = await s.client.post("/v1/completions", json={"prompt": "x" * 500, "max_tokens": 2000, "stream": True})
    await r.content.readline()  # the first token arrived: it runs
    assert s.worker.engine.num_running == 1
    r.close()
    for _ in range(100):
        if s.worker.busy == 0:
            break
        await asyncio.sleep(0.02)
    assert s.worker.busy == 0 and s.worker.engine.free_blocks == s.worker.engine.config.num_blocks


async def test_a_remote_decode_client_that_goes_away_during_its_last_step_frees_the_held_kv(sim) -> None:
    s = await sim(time_scale=1.0)  # the 3000-token prefill step sleeps its profile time (the TTFT)
    w = s.worker
    total = w.engine.config.num_blocks
    task = asyncio.create_task(s.client.post("/v1/completions", json={
        "prompt": "x" * 3000, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}))
    for _ in range(400):
        if w.engine.num_held:
            break
        await asyncio.sleep(0.005)
    # the engine finished the request and holds its KV; the handler still waits for the step's time to pass
    assert w.engine.num_held == 1 and w.engine.num_running == 0 and w.engine.free_blocks == total - 3000 // BS - 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):
        if w.engine.num_held == 0 and not w._streams:
            break
        await asyncio.sleep(0.02)
    # nobody got the kv_transfer_params, so nobody can pull it: freed at once, no 480 s timer left behind
    assert w.engine.num_held == 0 and w.engine.free_blocks == total
    assert w._release == {} and w.busy == 0


async def test_a_request_waiting_for_kv_blocks_does_not_spin_the_engine_loop(sim) -> None:
    s = await sim(kv_capacity_tokens=64, max_model_len=64)  # 4 blocks of 16 tokens
    w = s.worker
    calls = [0]
    step = w.engine.step

    def counting(now: float) -> Any:
        calls[0] += 1
        return step(now)

    w.engine.step = counting  # type: ignore[method-assign]
    r = await s.client.post("/v1/completions", json={"prompt": [65] * 48, "max_tokens": 1,
                                                     "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status == 200
    kvp = (await r.json())["kv_transfer_params"]
    assert w.engine.num_held == 1 and w.engine.free_blocks == 1  # A holds 3 of the 4 blocks, unpulled
    b = asyncio.create_task(s.client.post("/v1/completions", json={"prompt": [66] * 40, "max_tokens": 1}))
    for _ in range(100):
        if w.engine.num_waiting:
            break
        await asyncio.sleep(0.01)
    assert w.engine.num_waiting == 1  # B needs 3 blocks: it waits at the head of the queue
    c0 = calls[0]
    await asyncio.sleep(0.5)
    assert calls[0] - c0 < 50  # the loop sleeps until blocks are freed (it spun ~100k steps in 0.5 s)
    assert w.engine.num_waiting == 1 and not b.done()
    r = await s.client.post("/fulcrum/kv/pull", json={"request_id": kvp["remote_request_id"], "engine_id": "w0"})
    assert r.status == 200 and len((await r.json())["block_ids"]) == 3
    rb = await asyncio.wait_for(b, 5.0)  # the freed blocks wake the loop: B runs
    assert rb.status == 200 and (await rb.json())["choices"][0]["text"] == expected([66] * 40, 1)
    assert w.engine.free_blocks == 4 and w.busy == 0


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("prompt,stop_at", [
    ("hi", [(5, 8)]),  # "qvk" of "dqjbzqvkhpmzsjyy": its first two characters come a token before the match
    ("hi", [(3, 4), (6, 10)]),  # the shorter stop matches first; holdback is the longest stop's length - 1
    ("the quick brown fox", [(9, 11), (2, 7)]),  # the later-listed stop matches earlier in the text
    ("the quick brown fox", []),  # a stop string that never matches: the held-back tail comes with the end
])
async def test_a_streamed_answer_never_shows_the_start_of_a_stop_string(sim, chat: bool, prompt: str,
                                                                       stop_at: list[tuple[int, int]]) -> None:
    s = await sim()
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base: dict[str, Any] = {"max_tokens": 16}
    if chat:
        base["messages"] = [{"role": "user", "content": prompt}]
        ids = tokens_of(f"<|user|>{prompt}\n<|assistant|>")
    else:
        base["prompt"] = prompt
        ids = tokens_of(prompt)
    full = expected(ids, 16)
    stops = [full[a:b] for a, b in stop_at] or ["@#never!"]
    body = {**base, "stop": stops}
    r = await s.client.post(path, json=body)
    whole = await r.json()
    text = answer_text(whole)
    ch = whole["choices"][0]
    if stop_at:
        first = min(stops, key=full.find)
        assert (text, ch["finish_reason"], ch["stop_reason"]) == (full[:full.find(first)], "stop", first)
    else:
        assert (text, ch["finish_reason"]) == (full, "length")
    r = await s.client.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True},
                                        "return_token_ids": True})
    streamed, usage, chunks, done_once = parse_stream(await r.read())
    assert done_once and streamed == text
    assert usage == whole["usage"]
    choices = [c for chunk in chunks for c in chunk["choices"]]
    assert [t for c in choices for t in c.get("token_ids", [])] == tokens_of(full)[:usage["completion_tokens"]]
    assert (choices[-1]["finish_reason"], choices[-1]["stop_reason"]) == (ch["finish_reason"], ch["stop_reason"])
    shown = ""
    for c in choices:  # no prefix of the stream ever holds a stop string's beginning past the answer
        shown += c["text"] if "text" in c else c["delta"].get("content") or ""
        assert text.startswith(shown)


# ------------------------------------------------------------------------------------------------ KV transfer
async def prefill_on(a: Sim, prompt: list[int], k: int) -> dict[str, Any]:
    r = await a.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": k + 1, "return_token_ids": True,
                                                     "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status == 200
    return dict(await r.json())


@pytest.mark.parametrize("k", [0, 1, 3, 16])
async def test_a_handoff_after_k_tokens_pulls_the_kv_from_the_other_worker_and_continues_identically(sim, k) -> None:
    a, b = await sim("wa"), await sim("wb")
    prompt = [(7 * i + 3) % 200 + 32 for i in range(30)]  # P + k − 1 is a block multiple at k = 3
    data = await prefill_on(a, prompt, k)
    kv = data["kv_transfer_params"]
    assert kv["remote_engine_id"] == "wa" and kv["remote_num_tokens"] == 30 + k
    assert len(kv["remote_block_ids"]) == -(-(30 + k) // BS)
    assert kv["remote_port"] == a.client.port and kv["do_remote_prefill"] is True
    assert a.worker.engine.num_held == 1
    gen = data["choices"][0]["token_ids"][:k]
    r = await b.client.post("/v1/completions", json={"prompt": prompt + gen, "max_tokens": 10, "kv_transfer_params": kv})
    assert r.status == 200, await r.text()
    assert tokens_of((await r.json())["choices"][0]["text"]) == tokens_of(expected(prompt, 10 + k))[k:]
    assert a.worker.engine.num_held == 0 and a.worker.engine.free_blocks == a.worker.engine.config.num_blocks
    assert b.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 30 + k - 1
    assert b.metric("vllm:nixl_num_failed_transfers_total") == 0


async def test_a_prompt_the_transferred_kv_does_not_cover_gets_400_with_the_reason(sim) -> None:
    a, b = await sim("wa"), await sim("wb")
    prompt = [(3 * i) % 100 + 40 for i in range(32)]
    data = await prefill_on(a, prompt, 2)
    kv = data["kv_transfer_params"]
    gen = data["choices"][0]["token_ids"]
    # all 3 generated tokens: the KV holds P + 2, the prompt needs P + 2 before its last token — one too many
    r = await b.client.post("/v1/completions", json={"prompt": prompt + gen + [65], "max_tokens": 4,
                                                     "kv_transfer_params": kv})
    assert r.status == 400
    assert "needs" in (msg := (await r.json())["error"]["message"]) and "vLLM" in msg
    # fewer blocks than the prompt needs
    data = await prefill_on(a, prompt, 2)
    kv = dict(data["kv_transfer_params"], remote_block_ids=data["kv_transfer_params"]["remote_block_ids"][:1])
    r = await b.client.post("/v1/completions", json={"prompt": prompt + gen[:2], "max_tokens": 4, "kv_transfer_params": kv})
    assert r.status == 400 and "KV blocks" in (await r.json())["error"]["message"]
    assert a.worker.engine.num_held == 0  # the refused pulls still freed A's blocks


async def test_a_failed_pull_recomputes_the_prompt_and_counts_the_failure(sim) -> None:
    a, b = await sim("wa"), await sim("wb")
    prompt = tokens_of("recompute me please")
    kv = (await prefill_on(a, prompt, 0))["kv_transfer_params"]
    assert a.worker.take_kv(kv["remote_request_id"], "wa") is not None  # someone else pulled it already
    r = await b.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "kv_transfer_params": kv})
    assert r.status == 200 and (await r.json())["choices"][0]["text"] == expected(prompt, 6)
    assert b.metric("vllm:nixl_num_failed_transfers_total") == 1
    assert b.metric("vllm:prompt_tokens_by_source_total", source="local_compute") == len(prompt)


async def test_the_kv_transfer_time_from_the_profile_delays_the_decode_side(sim) -> None:
    # 300 tokens × 327,680 B/token at 0.5 GB/s = 0.197 s of transfer (time_scale 1)
    a, b = await sim("wa", time_scale=0.01), await sim("wb", time_scale=1.0, kv_transfer_gbps=0.5)
    prompt = [(11 * i) % 90 + 33 for i in range(300)]
    kv = (await prefill_on(a, prompt, 0))["kv_transfer_params"]
    t0 = time.monotonic()
    r = await b.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "kv_transfer_params": kv})
    took = time.monotonic() - t0
    assert r.status == 200
    xfer = PROFILE.kv_transfer_seconds(300, 0.5)
    assert xfer == pytest.approx(0.197, rel=0.01)
    assert xfer <= took <= xfer + PROFILE.ttft(300, 2) * 0.2 + 0.05  # transfer, then one tiny step
    assert b.metric("vllm:nixl_xfer_time_seconds_sum") == pytest.approx(xfer)


# ------------------------------------------------------------------------------------------------ via the router
async def router_over(a: Sim, b: Sim, policy: Any, roles: tuple[str, str] = ("prefill", "decode")) -> TestClient[Any, Any]:
    cfg = parse_config({
        "model": MODEL, "kv_block_size": BS,
        "instances": [{"id": "wa", "url": a.url, "role": roles[0]}, {"id": "wb", "url": b.url, "role": roles[1]}],
        "policy": policy if isinstance(policy, dict) else {"name": "round_robin"},
        "timeouts": {"connect_s": 1.0, "first_token_s": 10.0, "idle_s": 10.0, "request_s": 30.0, "health_s": 1.0},
    })
    factory = default_policy_factory if isinstance(policy, dict) else (lambda name, params: policy)
    client: TestClient[Any, Any] = TestClient(TestServer(create_app(cfg, policy_factory=factory, health_checks=False),
                                                         handler_cancellation=True))
    await client.start_server()
    return client


async def ask(client: TestClient[Any, Any], body: dict[str, Any], stream: bool) -> tuple[str, dict[str, Any]]:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    req = dict(body, stream=stream)
    if stream:
        req["stream_options"] = {"include_usage": True}
    r = await client.post(path, json=req)
    assert r.status == 200, await r.text()
    if stream:
        text, usage, _, done_once = parse_stream(await r.read())
        assert done_once and usage is not None
        return text, usage
    data = await r.json()
    return answer_text(data), data["usage"]


PROMPT = [(7 * i + 3) % 200 + 32 for i in range(30)]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body", [
    {"prompt": PROMPT, "max_tokens": 24},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
     "max_tokens": 9},
])
async def test_through_the_router_the_disaggregated_policy_gives_the_colocated_tokens(sim, body, stream) -> None:
    a, b = await sim("wa"), await sim("wb")
    colocated, cu = await ask(a.client, body, stream)
    router = await router_over(a, b, {"name": "disaggregated", "params": {"ultra_short_tokens": 0}})
    try:
        text, usage = await ask(router, body, stream)
    finally:
        await router.close()
    assert text == colocated and usage == cu
    assert b.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == cu["prompt_tokens"] - 1
    assert b.metric("vllm:nixl_num_failed_transfers_total") == 0
    assert a.worker.engine.num_held == 0


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("k", [1, 2, 3, 5, 17])
async def test_through_the_router_a_split_after_k_tokens_gives_the_colocated_tokens(sim, k, stream) -> None:
    a, b = await sim("wa"), await sim("wb")
    body = {"prompt": PROMPT, "max_tokens": 24}
    colocated, cu = await ask(a.client, body, stream)
    router = await router_over(a, b, FakePolicy("split", k, pair=("wa", "wb")))
    try:
        text, usage = await ask(router, body, stream)
    finally:
        await router.close()
    assert text == colocated and usage == cu
    moved = b.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    assert moved >= 30 + k - 2  # B continued on A's KV from (nearly) all k tokens (the guard may move k by one)
    assert b.metric("vllm:nixl_num_failed_transfers_total") == 0 and a.worker.engine.num_held == 0


async def test_through_the_router_libras_split_policy_gives_the_colocated_tokens(sim) -> None:
    a, b = await sim("wa"), await sim("wb")
    bodies = [{"prompt": [(13 * i + j) % 150 + 40 for i in range(20 + 37 * j)], "max_tokens": 8 + 5 * j}
              for j in range(6)]
    want = [await ask(a.client, body, False) for body in bodies]
    router = await router_over(a, b, {"name": "split", "params": {"profile": PROFILE.name, "kv_block_tokens": BS}},
                               roles=("both", "both"))
    try:
        got = await asyncio.gather(*(ask(router, body, True) for body in bodies))
    finally:
        await router.close()
    assert list(got) == want
    pulled = [s.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") for s in (a, b)]
    assert sum(pulled) > 0  # the policy handed requests off (both instances may prefill and decode)
    assert all(s.metric("vllm:nixl_num_failed_transfers_total") == 0 and s.worker.engine.num_held == 0 for s in (a, b))
