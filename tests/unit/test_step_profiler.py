"""``profile_steps`` (the offline mode of the step latency table) against a FAKE engine: an aiohttp app that
answers ``/v1/models``, streams ``/v1/completions`` and serves a scheduler table whose mixed bucket gains a step
only from the prompt of the try the test chooses. The real engine runs in
tests/integration/test_slo_scheduler_vllm.py; here the rerun, the decode caps and the checks are pinned down."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from fulcrum.errors import FulcrumError, ProfileError
from fulcrum.worker.latency_table import StepLatencyTable
from fulcrum.worker.step_profiler import _mixed_steps, profile_steps, stream_completion, table_from_metrics_text


@dataclass
class FakeEngine:
    """FAKE engine state: what the client asked for, and when the mixed step "ran"."""

    max_model_len: int = 1000
    mixed_on_try: int = 1
    decode_requests: list[dict[str, Any]] = field(default_factory=list)
    prompts: int = 0

    def metrics(self) -> str:
        lines = ['fulcrum_scheduler_step_table_seconds{prefill_tokens="0",context_tokens="64",decodes="2"} 0.002',
                 'fulcrum_scheduler_step_table_samples{prefill_tokens="0",context_tokens="64",decodes="2"} 10']
        mixed = max(0, self.prompts - self.mixed_on_try + 1)
        if mixed:
            labels = 'prefill_tokens="256",context_tokens="128",decodes="2"'
            lines += [f"fulcrum_scheduler_step_table_seconds{{{labels}}} 0.01",
                      f"fulcrum_scheduler_step_table_samples{{{labels}}} {mixed}"]
        return "\n".join(lines) + "\n"


@asynccontextmanager
async def serve(engine: FakeEngine) -> AsyncIterator[str]:
    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "tiny", "max_model_len": engine.max_model_len}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = json.dumps({"choices": [{"text": "x"}]})
        if body["max_tokens"] == 1:  # the prompt
            engine.prompts += 1
            await resp.write(f"data: {chunk}\n\ndata: [DONE]\n\n".encode())
            return resp
        engine.decode_requests.append(body)
        for _ in range(body["max_tokens"] // body.get("stream_interval", 1) + 1):  # until cancelled, or the cap
            await resp.write(f"data: {chunk}\n\n".encode())
            await asyncio.sleep(0.002)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=engine.metrics())

    app = web.Application()
    app.add_routes([web.get("/v1/models", models), web.post("/v1/completions", completions), web.get("/metrics", metrics)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def profile(engine: FakeEngine, **kwargs: Any) -> StepLatencyTable:
    async def main() -> StepLatencyTable:
        async with serve(engine) as url:
            args: dict[str, Any] = dict(model="tiny", prefill_tokens=[256], decode_counts=[2], contexts=[64],
                                        decode_tokens=240, timeout_s=30.0) | kwargs
            return await profile_steps(url, f"{url}/metrics", **args)

    return asyncio.run(main())


def test_a_composition_whose_mixed_step_is_missing_is_rerun_with_twice_the_cap_up_to_max_model_len() -> None:
    engine = FakeEngine(max_model_len=1000, mixed_on_try=4)
    table = profile(engine)
    # caps 240, 480, then 960 → clamped to max_model_len − context = 936, and 936 again
    assert [r["max_tokens"] for r in engine.decode_requests] == [240] * 2 + [480] * 2 + [936] * 4
    assert all(r["stream_interval"] == 16 and r["stream"] for r in engine.decode_requests)
    assert engine.prompts == 4
    assert _mixed_steps(table, 2, 256) == 1


def test_a_composition_still_missing_after_the_reruns_is_an_error_naming_its_caps() -> None:
    engine = FakeEngine(mixed_on_try=10)
    with pytest.raises(FulcrumError, match=r"256-token prompt did not prefill beside the 2 decodes .* 3 tries "
                                           r"\(decode caps \[240, 480, 936\] tokens\)"):
        profile(engine, retries=2)
    assert engine.prompts == 3


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"prefill_tokens": [2000]}, "max_model_len is 1000 tokens"),
    ({"contexts": [995]}, "max_model_len is 1000 tokens"),
    ({"stream_interval": 0}, "stream_interval must be >= 1"),
    ({"decode_tokens": 4}, "decode_tokens must be >= 8"),
])
def test_compositions_the_engine_cannot_hold_are_rejected_before_any_request(kwargs: dict[str, Any], match: str) -> None:
    engine = FakeEngine()
    with pytest.raises(ValueError, match=match):
        profile(engine, **kwargs)
    assert engine.decode_requests == [] and engine.prompts == 0


def test_an_endpoint_that_does_not_serve_the_model_is_a_profile_error() -> None:
    with pytest.raises(ProfileError, match="does not serve model 'other'"):
        profile(FakeEngine(), model="other")


@pytest.mark.parametrize(("build", "expected"), [
    (lambda t: t.record(256, 128, 2, 0.01), 1),     # the bucket, at any decode context
    (lambda t: t.record(300, 900, 2, 0.01), 1),     # 300 tokens snap to the 256 bucket
    (lambda t: t.record(1024, 128, 2, 0.01), 0),    # another prefill bucket
    (lambda t: t.record(256, 128, 8, 0.01), 0),     # another decode count
])
def test_the_mixed_step_count_reads_the_bucket_of_the_composition(build: Callable[[StepLatencyTable], Any],
                                                                  expected: int) -> None:
    table = StepLatencyTable()
    build(table)
    assert _mixed_steps(table, 2, 256) == expected


def test_an_engine_that_has_not_stepped_yet_reads_as_an_empty_table_only_when_allowed() -> None:
    assert len(table_from_metrics_text("# nothing yet\n", allow_empty=True)) == 0
    with pytest.raises(FulcrumError, match="no fulcrum_scheduler_step_table"):
        table_from_metrics_text("# nothing yet\n")


@pytest.mark.parametrize("chunk", ["[1, 2]", "not json", "null"])
def test_a_stream_chunk_that_is_not_a_json_object_is_a_fulcrum_error_not_a_traceback(chunk: str) -> None:
    async def odd_stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(f"data: {chunk}\n\ndata: [DONE]\n\n".encode())
        return resp

    async def run() -> None:
        app = web.Application()
        app.add_routes([web.post("/v1/completions", odd_stream)])
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            async with aiohttp.ClientSession() as session:
                await stream_completion(session, url, model="tiny", prompt=[1, 2, 3], max_tokens=4)
        finally:
            await runner.cleanup()

    with pytest.raises(FulcrumError, match="not a JSON object|broken stream"):
        asyncio.run(run())
