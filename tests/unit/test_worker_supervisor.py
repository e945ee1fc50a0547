"""The worker supervisor (fulcrum.worker.supervisor) against a FAKE engine: a small Python HTTP server run as the
child process instead of vLLM.

The fake engine (``FAKE_ENGINE`` below, written to a temporary file) speaks the part of vLLM's HTTP surface the
supervisor uses: ``/health`` (503 until ``FAKE_READY_AFTER_S``), ``/v1/models``, ``/metrics`` (vLLM's gauge names,
counting its in-flight requests) and ``POST /v1/completions`` (answers after ``FAKE_REQUEST_S``). It can exit on
its own (``FAKE_EXIT_AFTER_S``, code ``FAKE_EXIT_CODE``, or killed by signal ``FAKE_EXIT_SIGNAL``) or ignore
SIGTERM (``FAKE_IGNORE_TERM``). It is a test fake, not an engine: the real engine is exercised in
tests/integration/test_worker_vllm.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fulcrum.router.registry import InstanceRecord
from fulcrum.worker.supervisor import Supervisor, SupervisorSettings, kv_capacity_tokens, parse_engine_load

FAKE_ENGINE = r'''
import json, os, signal, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
started = time.monotonic()
ready_after = float(os.environ.get("FAKE_READY_AFTER_S", "0"))
request_s = float(os.environ.get("FAKE_REQUEST_S", "0"))
in_flight = 0
lock = threading.Lock()
events = os.environ.get("FAKE_EVENTS")

def note(text):
    if events:
        with open(events, "a") as f:
            f.write(f"{time.time():.3f} {text}\n")

if os.environ.get("FAKE_IGNORE_TERM") == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    def on_term(signum, frame):
        note("SIGTERM")
        os._exit(0)
    signal.signal(signal.SIGTERM, on_term)

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def send(self, status, body, ctype="application/json"):
        data = body.encode()
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        ready = time.monotonic() - started >= ready_after
        if self.path == "/health":
            self.send(200 if ready else 503, "")
        elif self.path == "/v1/models":
            self.send(200, json.dumps({"object": "list", "data": [{"id": "fake"}] if ready else []}))
        elif self.path == "/metrics":
            text = ("# TYPE vllm:num_requests_running gauge\n"
                    f'vllm:num_requests_running{{engine="0",model_name="fake"}} {in_flight}\n'
                    "# TYPE vllm:num_requests_waiting gauge\n"
                    'vllm:num_requests_waiting{engine="0",model_name="fake"} 0\n'
                    "# TYPE vllm:cache_config_info gauge\n"
                    'vllm:cache_config_info{block_size="32",num_gpu_blocks="100"} 1.0\n')
            self.send(200, text, "text/plain; version=0.0.4")
        else:
            self.send(404, "{}")

    def do_POST(self):
        global in_flight
        self.rfile.read(int(self.headers.get("content-length", "0")))
        with lock:
            in_flight += 1
        note("request start")
        time.sleep(request_s)
        with lock:
            in_flight -= 1
        note("request end")
        self.send(200, json.dumps({"choices": [{"text": "fake"}]}))

exit_after = os.environ.get("FAKE_EXIT_AFTER_S")
if exit_after:
    def die():
        time.sleep(float(exit_after))
        if os.environ.get("FAKE_EXIT_SIGNAL"):
            os.kill(os.getpid(), int(os.environ["FAKE_EXIT_SIGNAL"]))
        os._exit(int(os.environ.get("FAKE_EXIT_CODE", "3")))
    threading.Thread(target=die, daemon=True).start()
note("argv " + json.dumps(sys.argv[1:]))
ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FakeRegistration:
    """Records when the supervisor starts and stops the registration (a fake of EtcdRegistration)."""

    def __init__(self, record: InstanceRecord, log: list[tuple[str, float]]) -> None:
        self.record = record
        self.log = log

    async def start(self) -> bool:
        self.log.append(("start", time.monotonic()))
        return True

    async def stop(self) -> None:
        self.log.append(("stop", time.monotonic()))


class Fake:
    """One supervisor run over the fake engine, with its ports, environment and registration log."""

    def __init__(self, tmp_path: Path, **env: str) -> None:
        self.script = tmp_path / "fake_engine.py"
        self.script.write_text(FAKE_ENGINE)
        self.port = free_port()
        self.health_port = free_port()
        self.events = tmp_path / "events.txt"
        self.env = {**os.environ, "FAKE_EVENTS": str(self.events), **env}
        self.registrations: list[tuple[str, float]] = []
        self.record = InstanceRecord(id="fake-0", url=f"http://127.0.0.1:{self.port}")

    def supervisor(self, **settings: Any) -> Supervisor:
        s = SupervisorSettings(engine_url=f"http://127.0.0.1:{self.port}", health_host="127.0.0.1",
                               health_port=self.health_port, poll_interval_s=0.05, drain_poll_s=0.05,
                               drain_settle_s=0.1, kill_grace_s=settings.pop("kill_grace_s", 2.0), **settings)
        return Supervisor([sys.executable, str(self.script), "--port", str(self.port)], self.env, s,
                          record=self.record, registration=lambda r: FakeRegistration(r, self.registrations))

    def event_lines(self) -> list[str]:
        return [line.split(" ", 1)[1] for line in self.events.read_text().splitlines()] if self.events.exists() else []


async def health(fake: Fake) -> int:
    try:
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{fake.health_port}/health") as r:
            return r.status
    except aiohttp.ClientError:
        return 0


async def wait_for(sup: Supervisor, state: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sup.state != state:
        assert time.monotonic() < deadline, f"supervisor still {sup.state}, not {state}"
        await asyncio.sleep(0.02)


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout=25))


def test_engine_metrics_give_the_queue_and_the_kv_capacity() -> None:
    text = ('vllm:num_requests_running{engine="0"} 2\nvllm:num_requests_running{engine="1"} 1\n'
            'vllm:num_requests_waiting{engine="0"} 4\n'
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1.0\n')
    load = parse_engine_load(text)
    assert (load.running, load.waiting, load.total) == (3, 4, 7)
    assert kv_capacity_tokens(text) == 16_000
    assert kv_capacity_tokens("vllm:num_requests_running 1\n") == 0
    with pytest.raises(ValueError, match="vllm:num_requests_waiting"):
        parse_engine_load("vllm:num_requests_running 1\n")


def test_readiness_is_503_until_the_engine_serves_and_registration_waits_for_it(tmp_path: Path) -> None:
    fake = Fake(tmp_path, FAKE_READY_AFTER_S="0.8")

    async def scenario() -> None:
        sup = fake.supervisor()
        task = asyncio.create_task(sup.run())
        deadline = time.monotonic() + 5
        while await health(fake) == 0 and time.monotonic() < deadline:  # the readiness server is up at once
            await asyncio.sleep(0.02)
        assert sup.state == "starting" and await health(fake) == 503
        assert fake.registrations == []
        await wait_for(sup, "serving")
        assert await health(fake) == 200
        assert [e for e, _ in fake.registrations] == ["start"]
        assert sup.record is not None and sup.record.kv_capacity_tokens == 100 * 32  # from vllm:cache_config_info
        sup.request_stop()
        assert await task == 0

    run(scenario())


def test_stop_drains_the_in_flight_request_before_stopping_the_engine(tmp_path: Path) -> None:
    fake = Fake(tmp_path, FAKE_REQUEST_S="1.5")

    async def scenario() -> None:
        sup = fake.supervisor()
        task = asyncio.create_task(sup.run())
        await wait_for(sup, "serving")
        async with aiohttp.ClientSession() as http:
            request = asyncio.create_task(http.post(f"http://127.0.0.1:{fake.port}/v1/completions", json={}))
            await asyncio.sleep(0.3)
            stop_at = time.monotonic()
            sup.request_stop()
            await wait_for(sup, "draining")
            assert await health(fake) == 503  # readiness drops at once
            code = await task
            finished_at = time.monotonic()
            response = await request
            assert response.status == 200 and (await response.json())["choices"][0]["text"] == "fake"
            response.release()
        assert code == 0
        assert finished_at - stop_at >= 1.0  # the 1.5 s request (0.3 s in) was waited for
        kinds = [e for e, _ in fake.registrations]
        assert kinds == ["start", "stop"] and fake.registrations[1][1] < stop_at + 0.5  # deregistered first
        assert fake.event_lines()[-3:] == ["request start", "request end", "SIGTERM"]

    run(scenario())


def test_drain_gives_up_after_its_timeout_and_says_what_was_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake = Fake(tmp_path, FAKE_REQUEST_S="20")

    async def scenario() -> None:
        sup = fake.supervisor(drain_timeout_s=0.5)
        task = asyncio.create_task(sup.run())
        await wait_for(sup, "serving")
        async with aiohttp.ClientSession() as http:
            request = asyncio.create_task(http.post(f"http://127.0.0.1:{fake.port}/v1/completions", json={}))
            await asyncio.sleep(0.3)
            started = time.monotonic()
            sup.request_stop()
            assert await task == 0
            assert time.monotonic() - started < 5
            with pytest.raises(aiohttp.ClientError):  # the engine was stopped under it
                await request

    with caplog.at_level(logging.WARNING, logger="fulcrum.worker.supervisor"):
        run(scenario())
    assert "drain timeout" in caplog.text and "1 running, 0 waiting" in caplog.text


def test_an_engine_that_exits_on_its_own_makes_the_worker_exit_non_zero_and_deregister(tmp_path: Path) -> None:
    fake = Fake(tmp_path, FAKE_EXIT_AFTER_S="0.8", FAKE_EXIT_CODE="3")

    async def scenario() -> None:
        sup = fake.supervisor()
        assert await sup.run() == 3
        assert [e for e, _ in fake.registrations] == ["start", "stop"]

    run(scenario())


def test_an_engine_killed_by_a_signal_is_named_and_the_worker_exits_128_plus_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fake = Fake(tmp_path, FAKE_EXIT_AFTER_S="0.8", FAKE_EXIT_SIGNAL=str(int(signal.SIGKILL)))

    async def scenario() -> None:
        assert await fake.supervisor().run() == 137  # 128 + SIGKILL, as a shell reports it
        assert [e for e, _ in fake.registrations] == ["start", "stop"]

    with caplog.at_level(logging.ERROR, logger="fulcrum.worker.supervisor"):
        run(scenario())
    assert "killed while serving by SIGKILL" in caplog.text and "OOM killer" in caplog.text


def test_an_engine_that_dies_during_start_up_fails_the_worker(tmp_path: Path) -> None:
    fake = Fake(tmp_path, FAKE_READY_AFTER_S="30", FAKE_EXIT_AFTER_S="0.3", FAKE_EXIT_CODE="0")

    async def scenario() -> None:
        assert await fake.supervisor().run() == 1  # even a clean exit is a failure: the engine should serve
        assert fake.registrations == []

    run(scenario())


def test_an_engine_that_never_becomes_ready_is_stopped_after_the_start_up_timeout(tmp_path: Path) -> None:
    fake = Fake(tmp_path, FAKE_READY_AFTER_S="30")

    async def scenario() -> None:
        sup = fake.supervisor(startup_timeout_s=0.5)
        assert await sup.run() == 1
        assert sup.child_pid is not None
        with pytest.raises(ProcessLookupError):
            os.killpg(sup.child_pid, 0)

    run(scenario())


def test_an_engine_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    fake = Fake(tmp_path, FAKE_IGNORE_TERM="1")

    async def scenario() -> None:
        sup = fake.supervisor(kill_grace_s=0.5)
        task = asyncio.create_task(sup.run())
        await wait_for(sup, "serving")
        started = time.monotonic()
        sup.request_stop()
        assert await task == 0
        assert 0.4 < time.monotonic() - started < 5
        assert sup.child_pid is not None
        with pytest.raises(ProcessLookupError):
            os.killpg(sup.child_pid, 0)

    run(scenario())


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except OSError:
        return 0


def test_fulcrum_worker_runs_the_vllm_command_serves_with_etcd_down_and_exits_0_on_sigterm(tmp_path: Path) -> None:
    """The CLI end to end, with the fake engine standing in for ``--vllm-python``: the child gets vLLM's argv and
    the NIXL/SLO environment; an unreachable etcd is logged, not fatal; SIGTERM → drained exit 0."""
    fake = Fake(tmp_path)
    python = tmp_path / "fake-python"
    python.write_text(f"#!{sys.executable}\nimport runpy, sys\nsys.argv = [{str(fake.script)!r}] + sys.argv[1:]\n"
                      f"runpy.run_path({str(fake.script)!r}, run_name='__main__')\n")
    python.chmod(0o755)
    nixl_port, dead_etcd = free_port(), free_port()
    env = {**fake.env, "POD_NAME": "w-0", "POD_IP": "127.0.0.1", "FULCRUM_LLMSERVE": "demo"}
    cmd = [sys.executable, "-m", "fulcrum", "worker", "--vllm-python", str(python), "--model", "m",
           "--port", str(fake.port), "--health-port", str(fake.health_port), "--nixl-port", str(nixl_port),
           "--etcd", f"127.0.0.1:{dead_etcd}", "--device", "cpu", "--tpot-slo-ms", "50", "--", "--enforce-eager"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60  # a fresh interpreter importing fulcrum on 2 busy cores takes a while
        while _get(f"http://127.0.0.1:{fake.health_port}/health") != 200:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "worker not ready"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert "etcd at 127.0.0.1" in out and "retrying" in out  # etcd down: logged, retried, not fatal
    argv = json.loads(next(line for line in fake.event_lines() if line.startswith("argv "))[5:])
    assert argv[:2] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_buffer_device"] == "cpu"
    assert argv[-1] == "--enforce-eager"
    assert fake.event_lines()[-1] == "SIGTERM"
