"""``profile_steps`` (the offline mode of the step latency table) against a FAKE engine: an aiohttp app that
answers ``/v1/models``, streams ``/v1/completions`` and serves a scheduler table whose mixed bucket gains a step
only from the prompt of the try the test chooses. The real engine runs in
tests/integration/test_slo_scheduler_vllm.py; here the rerun, the decode caps and the checks are pinned down."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from fakes.interrupt import interrupt_when
from fulcrum.errors import FulcrumError, ProfileError
from fulcrum.worker.latency_table import StepLatencyTable
from fulcrum.worker.step_profiler import (
    StepLog,
    StepProfileStopped,
    _mixed_steps,
    profile_steps,
    stream_completion,
    table_from_metrics_text,
)


@dataclass
class FakeEngine:
    """FAKE engine state: what the client asked for, and when the mixed step "ran"."""

    max_model_len: int = 1000
    mixed_on_try: int = 1
    hang_after_prompts: int | None = None  # decodes sent after this many prompts never stream (a hung engine)
    fail_after_prompts: int | None = None  # prompts sent after this many answer HTTP 500 (an engine error)
    unmixed_after_prompts: int | None = None  # prompts after this many prefill alone: no mixed step recorded
    failing_metrics_reads: set[int] = field(default_factory=set)  # these metrics reads (1 = the first) answer 500
    scheduler: bool = True  # False: /metrics serves an engine's metrics without the scheduler's (fulcrum sim-worker)
    decode_requests: list[dict[str, Any]] = field(default_factory=list)
    prompts: int = 0
    hung: int = 0
    metrics_reads: int = 0

    def metrics(self) -> str:
        if not self.scheduler:
            return 'vllm:num_requests_running{model_name="tiny"} 0.0\n'
        lines = ['fulcrum_scheduler_step_table_seconds{prefill_tokens="0",context_tokens="64",decodes="2"} 0.002',
                 'fulcrum_scheduler_step_table_samples{prefill_tokens="0",context_tokens="64",decodes="2"} 10']
        mixing = self.prompts if self.unmixed_after_prompts is None else min(self.prompts, self.unmixed_after_prompts)
        mixed = max(0, mixing - self.mixed_on_try + 1)
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
        if (body["max_tokens"] == 1 and engine.fail_after_prompts is not None
                and engine.prompts >= engine.fail_after_prompts):
            return web.Response(status=500, text="boom")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = json.dumps({"choices": [{"text": "x"}]})
        if body["max_tokens"] == 1:  # the prompt
            engine.prompts += 1
            await resp.write(f"data: {chunk}\n\ndata: [DONE]\n\n".encode())
            return resp
        engine.decode_requests.append(body)
        if engine.hang_after_prompts is not None and engine.prompts >= engine.hang_after_prompts:
            engine.hung += 1
            await asyncio.sleep(3600)  # cancelled when the client goes away (handler_cancellation)
        for _ in range(body["max_tokens"] // body.get("stream_interval", 1) + 1):  # until cancelled, or the cap
            await resp.write(f"data: {chunk}\n\n".encode())
            await asyncio.sleep(0.002)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def metrics(_: web.Request) -> web.Response:
        engine.metrics_reads += 1
        if engine.metrics_reads in engine.failing_metrics_reads:
            return web.Response(status=500, text="metrics down")
        return web.Response(text=engine.metrics())

    app = web.Application()
    app.add_routes([web.get("/v1/models", models), web.post("/v1/completions", completions), web.get("/metrics", metrics)])
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
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
                                           r"\(decode caps \[240, 480, 936\] tokens\)") as err:
        profile(engine, retries=2)
    assert engine.prompts == 3
    # what to change is a flag the command has (before: "raise retries, --retries, or decode_tokens", no such flag)
    assert "Is the engine overloaded (raise --retries: each rerun doubles the decode cap), or " \
           "--max-num-batched-tokens below 258 (the prompt was chunked)?" in str(err.value)
    assert "decode_tokens" not in str(err.value)


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


# ------------------------------------------------------------------------------------------------ hung engines, Ctrl-C
def test_a_composition_the_engine_never_answers_is_abandoned_after_its_budget_and_the_run_goes_on() -> None:
    import time

    engine = FakeEngine(hang_after_prompts=1)  # the first composition is measured, then the decodes hang
    log, warnings = StepLog(), list[str]()
    t0 = time.monotonic()
    # before: no budget, the first hung composition waited the whole timeout_s, then the run failed
    table = profile(engine, contexts=[64, 128, 256], point_timeout_s=1.0, stop_after_timeouts=0, log=log,
                    warn=warnings.append)
    assert time.monotonic() - t0 < 10
    assert engine.hung == 4  # 2 compositions × 2 decodes, each cancelled after the budget
    assert log.measured == [(64, 2, 256)] and log.stopped is None
    assert [(comp, why) for comp, why in log.abandoned] == [
        ((128, 2, 256), "budget of 1 s spent (--point-timeout-s)"),
        ((256, 2, 256), "budget of 1 s spent (--point-timeout-s)")]
    assert warnings == ["composition 256 beside 2 decodes (context 128): budget of 1 s spent (--point-timeout-s); "
                        "abandoned", "composition 256 beside 2 decodes (context 256): budget of 1 s spent "
                        "(--point-timeout-s); abandoned"]
    assert _mixed_steps(table, 2, 256) == 1  # what the engine recorded is still read back


def test_compositions_failed_by_timeout_in_a_row_stop_the_run_and_a_measured_one_restarts_the_count() -> None:
    engine = FakeEngine(hang_after_prompts=1)
    log = StepLog()
    with pytest.raises(StepProfileStopped, match=r"^the engine stopped answering \(2 composition\(s\) in a row failed "
                                                 r"by timeout, the last 256 beside 2 decodes \(context 256\): budget"):
        profile(engine, contexts=[64, 128, 256, 512], point_timeout_s=1.0, stop_after_timeouts=2, log=log)
    assert log.measured == [(64, 2, 256)] and len(log.abandoned) == 2
    assert log.stopped is not None and log.stopped.startswith("the engine stopped answering")
    assert log.not_measured == [(128, 2, 256), (256, 2, 256), (512, 2, 256)]
    assert len(engine.decode_requests) == 2 + 2 + 2  # nothing was sent for context 512
    assert log.partial_note() == (
        f"PARTIAL: {log.stopped}; 1 of 4 compositions measured, not measured: 256 beside 2 decodes (context 128), "
        "256 beside 2 decodes (context 256), 256 beside 2 decodes (context 512)")


def test_a_request_timeout_is_a_timeout_and_by_default_the_first_one_stops_the_run_as_it_always_failed_it() -> None:
    engine = FakeEngine(hang_after_prompts=0)
    with pytest.raises(StepProfileStopped, match=r"1 composition\(s\) in a row failed by timeout, the last 256 beside "
                                                 r"2 decodes \(context 64\): .*did not (stream|finish) within") as err:
        profile(engine, timeout_s=0.5)
    assert isinstance(err.value, FulcrumError)


@pytest.mark.parametrize(("kwargs", "match"), [
    # named by the flags of fulcrum profile, which checks them only here (before: by parameter names, and again by
    # the command with the flag names)
    ({"point_timeout_s": 0.0}, "^--point-timeout-s must be a positive number of seconds, got 0.0$"),
    ({"point_timeout_s": float("inf")}, "^--point-timeout-s must be a positive number of seconds, got inf$"),
    ({"timeout_s": float("nan")}, "^--request-timeout-s must be a positive number of seconds, got nan$"),
    ({"timeout_s": 0.0, "point_timeout_s": 0.0}, "^--request-timeout-s must be"),
    ({"stop_after_timeouts": -1}, "^--stop-after-timeouts must be >= 0, got -1$"),
    ({"retries": -1}, "^--retries must be >= 0, got -1$"),
])
def test_a_bad_budget_is_rejected_before_any_request(kwargs: dict[str, Any], match: str) -> None:
    engine = FakeEngine()
    with pytest.raises(ValueError, match=match):
        profile(engine, **kwargs)
    assert engine.decode_requests == [] and engine.prompts == 0


STEP_FLAGS = ["--model", "tiny", "--tp", "1", "--step-prefill", "256", "--step-decodes", "2", "--no-progress"]


async def _step_cli(engine: FakeEngine, out: Path, *extra: str) -> int:
    from fulcrum.cli import main

    async with serve(engine) as url:
        return await asyncio.to_thread(main, ["profile", "--url", url, "--scheduler-metrics", f"{url}/metrics",
                                              *STEP_FLAGS, "--step-table", str(out), *extra])


def _interrupt_on_composition(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """Ctrl-C in the step profiler: its ``n``-th composition try raises KeyboardInterrupt (as a SIGINT does where
    Python delivers it; the CLI runs in a worker thread here, where no signal arrives).

    asyncio lets a KeyboardInterrupt raised in a task leave the event loop at once and also stores it on the task,
    where nothing reads it; such a task logs "Task exception was never retrieved" with its traceback when the cyclic
    GC frees it, at any later moment, and on Python 3.11.7 that inside another ``ast.parse`` crashed pytest (see
    test_a_simulated_ctrl_c_leaves_no_task_that_logs_a_traceback_when_the_gc_frees_it). So the exception is read
    once the task is done: asyncio.run's shutdown (cancelling the run's main task) runs the callback."""
    from fulcrum.worker import step_profiler

    real = step_profiler._profile_composition
    calls = {"n": 0}

    async def composition(*args: Any, **kwargs: Any) -> bool:
        calls["n"] += 1
        if calls["n"] >= n:
            task = asyncio.current_task()
            assert task is not None
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            raise KeyboardInterrupt
        return await real(*args, **kwargs)

    monkeypatch.setattr(step_profiler, "_profile_composition", composition)


@pytest.mark.asyncio
async def test_a_complete_cli_run_writes_the_table_as_before_and_no_partial_file(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "t.json"
    rc = await _step_cli(FakeEngine(), out, "--step-contexts", "64,128")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 0, err
    assert err == [f"wrote {out}: 2 step buckets measured"]
    assert list(json.loads(out.read_text())) == ["version", "alpha", "minPrefillTokens", "entries"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]


@pytest.mark.asyncio
async def test_a_complete_table_whose_write_fails_midway_leaves_the_older_file_whole_and_no_temporary_file(
        tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch, spare_tmpdir: Path) -> None:
    folder = tmp_path / "out"
    folder.mkdir()
    out = folder / "t.json"
    out.write_text('{"old": "table"}')
    real_write = Path.write_text

    def write_text(self: Path, data: str, *args: Any, **kwargs: Any) -> int:
        if self.parent == folder:  # the disk fills up halfway through the file
            real_write(self, data[: len(data) // 2], *args, **kwargs)
            raise OSError(28, "No space left on device")
        return real_write(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    rc = await _step_cli(FakeEngine(), out, "--step-contexts", "64")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    saved = list(spare_tmpdir.glob("fulcrum-step-table-*.json"))
    assert len(saved) == 1
    assert err == [f"fulcrum profile: error: --step-table {out}: cannot write (No space left on device); saved to "
                   f"{saved[0]} instead"]
    assert out.read_text() == '{"old": "table"}'
    # before: table.save left its half-written .t.json.tmp beside the table
    assert sorted(p.name for p in folder.iterdir()) == ["t.json"]
    assert _mixed_steps(StepLatencyTable.load(saved[0]), 2, 256) == 1


@pytest.mark.asyncio
async def test_a_complete_table_is_written_byte_for_byte_as_the_table_saves_itself(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "t.json"
    assert await _step_cli(FakeEngine(), out, "--step-contexts", "64") == 0, capsys.readouterr().err
    table = StepLatencyTable.load(out)
    table.save(tmp_path / "again.json")
    assert out.read_bytes() == (tmp_path / "again.json").read_bytes()


@pytest.mark.asyncio
async def test_ctrl_c_writes_what_the_engine_recorded_as_a_partial_step_table_and_exits_130(
        tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = FakeEngine()
    _interrupt_on_composition(monkeypatch, 2)  # the first composition is measured
    out = tmp_path / "t.json"
    out.write_text('{"old": "table"}')
    rc = await _step_cli(engine, out, "--step-contexts", "64,128,256")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 130, err
    partial = tmp_path / "t.partial.json"
    note = ("PARTIAL: interrupted (Ctrl-C); 1 of 3 compositions measured, not measured: 256 beside 2 decodes "
            "(context 128), 256 beside 2 decodes (context 256)")
    assert err == [f"fulcrum profile: interrupted: interrupted (Ctrl-C); partial step table written to {partial} "
                   f"(2 step buckets); {note}"]
    assert out.read_text() == '{"old": "table"}'  # an older table is not replaced by a partial one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json", "t.partial.json"]  # no temporary file left
    table = StepLatencyTable.load(partial)  # the loader takes it: the marker keys are ignored
    assert _mixed_steps(table, 2, 256) == 1 and len(table) == 2
    data = json.loads(partial.read_text())
    assert data["partial"] is True and data["stopped"] == "interrupted (Ctrl-C)"
    assert data["note"] == note
    assert data["notMeasured"] == [{"prefillTokens": 256, "decodes": 2, "contextTokens": 128},
                                   {"prefillTokens": 256, "decodes": 2, "contextTokens": 256}]
    assert data["entries"] == table.to_dict()["entries"]


@pytest.mark.asyncio
async def test_ctrl_c_before_any_composition_was_sent_says_nothing_was_kept_and_why(
        tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from fulcrum.worker import step_profiler

    async def probe(*_: Any, **__: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(step_profiler, "probe_endpoint", probe)
    rc = await _step_cli(FakeEngine(), tmp_path / "t.json", "--step-contexts", "64")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 130
    assert err == ["fulcrum profile: interrupted: interrupted (Ctrl-C); nothing kept: no composition was sent"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.asyncio
async def test_a_simulated_ctrl_c_leaves_no_task_that_logs_a_traceback_when_the_gc_frees_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The KeyboardInterrupt that ``_interrupt_on_composition`` raises in a task leaves the event loop at once and
    stays stored on the task, unread: freed later by the cyclic GC, the task logged "Task exception was never
    retrieved" with its traceback, whose formatting calls ``ast.parse`` on Python 3.11. When that collection ran
    inside another ``ast.parse`` (pytest's assertion rewriter importing hypothesis at the terminal summary), the
    outer one failed with "SystemError: AST constructor recursion depth mismatch" (CPython gh-106905, 3.11.7)."""
    import gc

    gc.collect()  # what earlier tests left is not this test's
    _interrupt_on_composition(monkeypatch, 2)
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        assert await _step_cli(FakeEngine(), tmp_path / "t.json", "--step-contexts", "64,128") == 130
        gc.collect()
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


@pytest.mark.asyncio
async def test_a_second_ctrl_c_while_the_partial_table_is_written_aborts_and_leaves_no_file(
        tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _interrupt_on_composition(monkeypatch, 2)
    real_replace = Path.replace

    def replace(self: Path, target: Any) -> Any:
        if self.name.startswith(".t.partial.json"):
            raise KeyboardInterrupt
        return real_replace(self, target)

    monkeypatch.setattr(Path, "replace", replace)
    rc = await _step_cli(FakeEngine(), tmp_path / "t.json", "--step-contexts", "64,128")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 130
    assert err == ["interrupted"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.asyncio
async def test_an_engine_that_stops_answering_stops_the_cli_run_and_keeps_what_it_recorded(
        tmp_path: Path, capsys: Any) -> None:
    import time

    engine = FakeEngine(hang_after_prompts=1)
    out = tmp_path / "t.json"
    t0 = time.monotonic()
    # before: the first hung composition waited the whole --request-timeout-s (20 s), then exit 2, nothing kept
    rc = await _step_cli(engine, out, "--step-contexts", "64,128,256,512", "--request-timeout-s", "20",
                         "--point-timeout-s", "1", "--stop-after-timeouts", "2")
    took = time.monotonic() - t0
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1, err
    assert took < 10, took
    partial = tmp_path / "t.partial.json"
    stopped = ("the engine stopped answering (2 composition(s) in a row failed by timeout, the last 256 beside 2 "
               "decodes (context 256): budget of 1 s spent (--point-timeout-s))")
    assert err[-1] == (f"fulcrum profile: error: {stopped}; partial step table written to {partial} (2 step buckets); "
                       f"PARTIAL: {stopped}; 1 of 4 compositions measured, not measured: 256 beside 2 decodes "
                       "(context 128), 256 beside 2 decodes (context 256), 256 beside 2 decodes (context 512)")
    assert err[:-1] == [
        "fulcrum profile: warning: composition 256 beside 2 decodes (context 128): budget of 1 s spent "
        "(--point-timeout-s); abandoned",
        "fulcrum profile: warning: composition 256 beside 2 decodes (context 256): budget of 1 s spent "
        "(--point-timeout-s); abandoned",
        f"fulcrum profile: warning: {stopped}; stopping"]
    assert not out.exists()
    assert _mixed_steps(StepLatencyTable.load(partial), 2, 256) == 1
    assert json.loads(partial.read_text())["stopped"] == stopped


@pytest.mark.asyncio
async def test_compositions_abandoned_without_stopping_are_named_when_the_complete_table_is_written(
        tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "t.json"
    rc = await _step_cli(FakeEngine(hang_after_prompts=1), out, "--step-contexts", "64,128",
                         "--point-timeout-s", "1", "--stop-after-timeouts", "0")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 0, err
    assert err[-1] == (f"wrote {out}: 2 step buckets measured; 1 of 2 compositions abandoned by timeout, their mixed "
                       "steps may be missing")
    assert "partial" not in json.loads(out.read_text())


@pytest.mark.parametrize(("flags", "match"), [
    (["--point-timeout-s", "0"], "--point-timeout-s must be a positive number of seconds, got 0.0"),
    (["--request-timeout-s", "nan"], "--request-timeout-s must be a positive number of seconds, got nan"),
    (["--request-timeout-s", "-1"], "--request-timeout-s must be a positive number of seconds, got -1.0"),
    (["--point-timeout-s", "inf"], "--point-timeout-s must be a positive number of seconds, got inf"),
    (["--stop-after-timeouts", "-1"], "--stop-after-timeouts must be >= 0, got -1"),
    (["--retries", "-1"], "--retries must be >= 0, got -1"),  # before: ignored, the run went on
])
def test_the_step_table_mode_checks_its_budget_flags_before_measuring(tmp_path: Path, capsys: Any,
                                                                      flags: list[str], match: str) -> None:
    from fulcrum.cli import main

    rc = main(["profile", "--url", "http://127.0.0.1:9", "--scheduler-metrics", "http://127.0.0.1:9/metrics",
               *STEP_FLAGS, "--step-table", str(tmp_path / "t.json"), *flags])
    assert rc == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"fulcrum profile: error: {match}"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.asyncio
async def test_a_real_sigint_mid_run_keeps_the_recorded_step_table_and_exits_130(tmp_path: Path) -> None:
    engine = FakeEngine(hang_after_prompts=1)  # the run waits on the second composition until interrupted
    out = tmp_path / "t.json"
    async with serve(engine) as url:
        rc, err = await interrupt_when(["profile", "--url", url, "--scheduler-metrics", f"{url}/metrics", *STEP_FLAGS,
                                        "--step-contexts", "64,128,256", "--step-table", str(out)],
                                       lambda: engine.hung, "the hung composition")
    assert rc == 130, err
    assert "Traceback" not in err
    partial = tmp_path / "t.partial.json"
    assert err.strip().splitlines()[-1].startswith(
        f"fulcrum profile: interrupted: interrupted (Ctrl-C); partial step table written to {partial} (2 step "
        "buckets); PARTIAL: interrupted (Ctrl-C); 1 of 3 compositions measured")
    assert _mixed_steps(StepLatencyTable.load(partial), 2, 256) == 1
    assert not out.exists()


# ------------------------------------------------------------------------- other failures mid-run, and --retries
def test_a_composition_that_fails_otherwise_ends_the_run_with_its_error_and_the_log_names_it() -> None:
    engine = FakeEngine(fail_after_prompts=1)  # the first composition is measured, the second prompt answers 500
    log = StepLog()
    with pytest.raises(FulcrumError, match="answered HTTP 500: boom") as err:
        profile(engine, contexts=[64, 128, 256], log=log)
    assert not isinstance(err.value, StepProfileStopped)
    assert log.sent and log.measured == [(64, 2, 256)] and log.abandoned == []
    # before: stopped stayed None, and nothing said which composition failed
    assert log.stopped is not None and log.stopped.startswith("composition 256 beside 2 decodes (context 128) "
                                                              "failed: http://127.0.0.1:")
    assert log.stopped.endswith("answered HTTP 500: boom")
    assert log.not_measured == [(128, 2, 256), (256, 2, 256)]


@pytest.mark.asyncio
async def test_an_http_error_mid_run_keeps_what_the_engine_recorded_and_exits_1(tmp_path: Path, capsys: Any) -> None:
    engine = FakeEngine(fail_after_prompts=1)
    out = tmp_path / "t.json"
    out.write_text('{"old": "table"}')
    # before: exit 2, one line "fulcrum profile: error: http://... answered HTTP 500: boom", nothing kept
    rc = await _step_cli(engine, out, "--step-contexts", "64,128,256")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1, err
    assert len(err) == 1, err
    partial = tmp_path / "t.partial.json"
    data = json.loads(partial.read_text())
    stopped = data["stopped"]
    assert stopped.startswith("composition 256 beside 2 decodes (context 128) failed: http://127.0.0.1:")
    assert stopped.endswith("answered HTTP 500: boom")
    note = (f"PARTIAL: {stopped}; 1 of 3 compositions measured, not measured: 256 beside 2 decodes (context 128), "
            "256 beside 2 decodes (context 256)")
    assert err == [f"fulcrum profile: error: {stopped}; partial step table written to {partial} (2 step buckets); "
                   f"{note}"]
    assert data["partial"] is True and data["note"] == note
    assert data["notMeasured"] == [{"prefillTokens": 256, "decodes": 2, "contextTokens": 128},
                                   {"prefillTokens": 256, "decodes": 2, "contextTokens": 256}]
    assert _mixed_steps(StepLatencyTable.load(partial), 2, 256) == 1
    assert out.read_text() == '{"old": "table"}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json", "t.partial.json"]
    assert engine.prompts == 1  # nothing more was sent after the failure


@pytest.mark.asyncio
async def test_no_mixed_step_after_the_reruns_of_retries_keeps_what_the_engine_recorded_and_exits_1(
        tmp_path: Path, capsys: Any) -> None:
    engine = FakeEngine(unmixed_after_prompts=1)  # the second composition never gets its mixed step
    out = tmp_path / "t.json"
    # before: --retries was ignored (always 4 reruns: 5 tries), then exit 2 and nothing kept
    rc = await _step_cli(engine, out, "--step-contexts", "64,128", "--retries", "1")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1, err
    assert engine.prompts == 1 + 2  # the first composition, then 2 tries of the second
    assert [r["max_tokens"] for r in engine.decode_requests] == [256] * 2 + [256] * 2 + [512] * 2
    partial = tmp_path / "t.partial.json"
    stopped = ("composition 256 beside 2 decodes (context 128) failed: the 256-token prompt did not prefill beside "
               "the 2 decodes (context 128) in 2 tries (decode caps [256, 512] tokens): the engine's table has no "
               "such step.")
    assert len(err) == 1 and err[0].startswith(f"fulcrum profile: error: {stopped}")
    assert f"; partial step table written to {partial} (2 step buckets); PARTIAL: {stopped}" in err[0]
    assert err[0].endswith("; 1 of 2 compositions measured, not measured: 256 beside 2 decodes (context 128)")
    data = json.loads(partial.read_text())
    assert data["stopped"].startswith(stopped) and data["partial"] is True
    assert not out.exists()


@pytest.mark.asyncio
async def test_without_retries_the_step_table_mode_still_reruns_a_composition_4_times(tmp_path: Path,
                                                                                       capsys: Any) -> None:
    engine = FakeEngine(unmixed_after_prompts=0)  # no composition ever gets its mixed step
    rc = await _step_cli(engine, tmp_path / "t.json", "--step-contexts", "128")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1, err  # before: 2, nothing kept
    assert engine.prompts == 5  # today's default kept: 4 reruns, not the profile mode's 2
    assert [r["max_tokens"] for r in engine.decode_requests] == [256] * 2 + [512] * 2 + [872] * 6
    assert "in 5 tries (decode caps [256, 512, 872, 872, 872] tokens)" in err[0]
    assert f"partial step table written to {tmp_path / 't.partial.json'} (1 step buckets)" in err[0]


@pytest.mark.asyncio
async def test_retries_0_tries_a_composition_once(tmp_path: Path, capsys: Any) -> None:
    engine = FakeEngine(mixed_on_try=2)  # the first try misses the mixed step, a rerun would find it
    rc = await _step_cli(engine, tmp_path / "t.json", "--step-contexts", "64", "--retries", "0")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1, err  # before: the rerun measured it (exit 0): --retries 0 was ignored
    assert engine.prompts == 1
    assert "in 1 tries (decode caps [256] tokens)" in err[0]


@pytest.mark.asyncio
async def test_a_table_that_cannot_be_read_after_the_last_composition_is_kept_when_a_second_read_works(
        tmp_path: Path, capsys: Any) -> None:
    # the endpoint probe, the scheduler's metrics checked before anything is sent, before and after the composition,
    # then the final read fails (the re-read works)
    engine = FakeEngine(failing_metrics_reads={5})
    out = tmp_path / "t.json"
    rc = await _step_cli(engine, out, "--step-contexts", "64")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1, err  # before: exit 2, nothing kept
    partial = tmp_path / "t.partial.json"
    stopped = f"{engine_url_of(err[0])}/metrics answered HTTP 500"
    assert err == [f"fulcrum profile: error: {stopped}; partial step table written to {partial} (2 step buckets); "
                   f"PARTIAL: {stopped}; 1 of 1 compositions measured"]
    assert _mixed_steps(StepLatencyTable.load(partial), 2, 256) == 1
    assert not out.exists()


def engine_url_of(line: str) -> str:
    """The fake engine's base URL, as a message names it (its port is chosen at random)."""
    start = line.index("http://127.0.0.1:")
    end = line.index("/", start + len("http://"))
    return line[start:end]


@pytest.mark.parametrize(("argv", "match"), [
    (["--url", "http://127.0.0.1:9", "--scheduler-metrics", "http://127.0.0.1:9/metrics"], "http://127.0.0.1:9"),
])
def test_an_unreachable_engine_is_still_an_error_before_anything_is_sent(
        tmp_path: Path, capsys: Any, argv: list[str], match: str) -> None:
    from fulcrum.cli import main

    rc = main(["profile", *argv, *STEP_FLAGS, "--step-table", str(tmp_path / "t.json"), "--step-contexts", "64",
               "--request-timeout-s", "5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("fulcrum profile: error: ") and match in err[0]
    assert "partial" not in err[0] and "nothing kept" not in err[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.asyncio
async def test_a_model_the_engine_does_not_serve_is_still_an_error_before_anything_is_sent(
        tmp_path: Path, capsys: Any) -> None:
    from fulcrum.cli import main

    engine = FakeEngine()
    async with serve(engine) as url:
        rc = await asyncio.to_thread(main, ["profile", "--url", url, "--scheduler-metrics", f"{url}/metrics",
                                            *STEP_FLAGS, "--model", "other", "--step-table", str(tmp_path / "t.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("fulcrum profile: error: ") and "does not serve model 'other'" in err[0]
    assert list(tmp_path.iterdir()) == [] and engine.prompts == 0 and engine.decode_requests == []


@pytest.mark.asyncio
async def test_unreachable_scheduler_metrics_are_an_error_before_anything_is_sent(tmp_path: Path, capsys: Any) -> None:
    # a wrong --scheduler-metrics is bad input (exit 2, as documented), not "composition ... failed" (exit 1)
    from fulcrum.cli import main

    engine = FakeEngine()
    async with serve(engine) as url:
        rc = await asyncio.to_thread(main, ["profile", "--url", url, "--scheduler-metrics", "http://127.0.0.1:9/metrics",
                                            *STEP_FLAGS, "--step-contexts", "64", "--step-table",
                                            str(tmp_path / "t.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and "cannot read the scheduler metrics at http://127.0.0.1:9/metrics" in err[0]
    assert "partial" not in err[0] and "composition" not in err[0]
    assert list(tmp_path.iterdir()) == [] and engine.prompts == 0 and engine.decode_requests == []


@pytest.mark.parametrize(("flags", "retries"), [([], 2), (["--retries", "0"], 0), (["--retries", "5"], 5)])
def test_the_profile_mode_keeps_its_retries_default_of_2(monkeypatch: pytest.MonkeyPatch, capsys: Any,
                                                          tmp_path: Path, flags: list[str], retries: int) -> None:
    from fulcrum.cli import main
    from fulcrum.commands import profile as command

    grids: list[Any] = []

    async def measure(*args: Any, **_: Any) -> Any:
        grids.append(args[3])
        raise KeyboardInterrupt  # the run ends here: nothing measured

    monkeypatch.setattr(command, "measure", measure)
    rc = main(["profile", "--url", "http://127.0.0.1:9", "--model", "m", "--tp", "1", "--gpu", "H100",
               "--weight-gib", "1", "--no-progress", "--out", str(tmp_path / "p.yaml"), *flags])
    assert rc == 130, capsys.readouterr().err
    assert [g.retries for g in grids] == [retries]


@pytest.mark.asyncio
async def test_an_engine_without_the_schedulers_metrics_is_one_line_before_anything_is_sent(
        tmp_path: Path, capsys: Any) -> None:
    # e.g. fulcrum sim-worker, whose /metrics has vLLM's names only: before, every composition was sent (and against
    # the sim answered HTTP 400: its vocabulary is 0..255), then the run failed with no mixed step
    from fulcrum.cli import main

    engine = FakeEngine(scheduler=False)
    async with serve(engine) as url:
        rc = await asyncio.to_thread(main, ["profile", "--url", url, "--scheduler-metrics", f"{url}/metrics",
                                            *STEP_FLAGS, "--step-contexts", "64", "--step-table",
                                            str(tmp_path / "t.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err == [f"fulcrum profile: error: {url}/metrics serves no fulcrum_scheduler_* metrics: the step table needs "
                   "an engine running --scheduler-cls fulcrum.worker.slo_scheduler.SLOAwareScheduler with "
                   "FULCRUM_SCHEDULER_METRICS_PORT, and --scheduler-metrics at that port (fulcrum sim-worker has no "
                   "such scheduler)"]
    assert list(tmp_path.iterdir()) == [] and engine.prompts == 0 and engine.decode_requests == []
