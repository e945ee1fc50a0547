"""The supervisor's drain when deregistration itself takes time (a prefill puller waits up to 60 s for the jobs in
hand; an etcd revoke can wait on a slow etcd): a second stop request that arrives meanwhile still cuts the drain
short, and ``drain_timeout_s`` bounds the whole drain, deregistration included. The fake engine and helpers are
those of tests/unit/test_worker_supervisor.py."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from fulcrum.router.registry import InstanceRecord
from fulcrum.worker.supervisor import Supervisor, SupervisorSettings

sys.path.insert(0, str(Path(__file__).parent))
from test_worker_supervisor import Fake, run, wait_for  # noqa: E402


class SlowStopRegistration:
    """A registration whose ``stop()`` takes ``stop_s`` seconds (a prefill puller finishing its jobs in hand)."""

    def __init__(self, record: InstanceRecord, stop_s: float, log: list[str]) -> None:
        self.record = record
        self.stop_s = stop_s
        self.log = log

    async def start(self) -> bool:
        self.log.append("start")
        return True

    async def stop(self) -> None:
        self.log.append("stop begins")
        await asyncio.sleep(self.stop_s)
        self.log.append("stop ends")


def slow_supervisor(fake: Fake, stop_s: float, log: list[str], **settings: float) -> Supervisor:
    s = SupervisorSettings(engine_url=f"http://127.0.0.1:{fake.port}", health_host="127.0.0.1",
                           health_port=fake.health_port, poll_interval_s=0.05, drain_poll_s=0.05,
                           drain_settle_s=0.1, kill_grace_s=2.0, **settings)
    return Supervisor([sys.executable, str(fake.script), "--port", str(fake.port)], fake.env, s,
                      record=fake.record, registration=lambda r: SlowStopRegistration(r, stop_s, log))


def test_a_second_stop_request_during_a_slow_deregistration_still_cuts_the_drain_short(tmp_path: Path) -> None:
    fake = Fake(tmp_path, FAKE_REQUEST_S="20")
    log: list[str] = []

    async def scenario() -> None:
        sup = slow_supervisor(fake, 1.0, log, drain_timeout_s=15.0)
        task = asyncio.create_task(sup.run())
        await wait_for(sup, "serving")
        async with aiohttp.ClientSession() as http:
            request = asyncio.create_task(http.post(f"http://127.0.0.1:{fake.port}/v1/completions", json={}))
            await asyncio.sleep(0.3)
            started = time.monotonic()
            sup.request_stop()
            await wait_for(sup, "draining")
            await asyncio.sleep(0.3)
            assert log[-1] == "stop begins"  # the second request arrives while deregistering
            sup.request_stop()
            assert await task == 0
            took = time.monotonic() - started
            request.cancel()
        assert took < 6.0, f"the drain ran {took:.1f} s: the second stop request was forgotten"

    run(scenario())


def test_the_drain_timeout_counts_the_time_deregistration_takes(tmp_path: Path) -> None:
    fake = Fake(tmp_path, FAKE_REQUEST_S="20")
    log: list[str] = []

    async def scenario() -> None:
        sup = slow_supervisor(fake, 2.0, log, drain_timeout_s=2.0)
        task = asyncio.create_task(sup.run())
        await wait_for(sup, "serving")
        async with aiohttp.ClientSession() as http:
            request = asyncio.create_task(http.post(f"http://127.0.0.1:{fake.port}/v1/completions", json={}))
            await asyncio.sleep(0.3)
            started = time.monotonic()
            sup.request_stop()
            assert await task == 0
            took = time.monotonic() - started
            request.cancel()
        assert log == ["start", "stop begins", "stop ends"]
        # 2 s of deregistration + the 2 s drain would be >= 4 s: past drain timeout + kill grace the kubelet kills
        assert took < 3.6, f"stop took {took:.1f} s with a 2 s drain timeout"

    run(scenario())


ORPHANING_ENGINE = r'''
import os, signal, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port = int(sys.argv[sys.argv.index("--port") + 1])
if os.fork() == 0:  # a process of the engine's group (vLLM's engine core, a GPU worker): exits soon after SIGTERM
    signal.signal(signal.SIGTERM, lambda *a: (time.sleep(0.3), os._exit(0)))
    while True:
        time.sleep(1)
signal.signal(signal.SIGTERM, lambda *a: os._exit(0))  # the API server exits first: its child is orphaned
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        body = {"/v1/models": '{"data": [{"id": "m"}]}',
                "/metrics": "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"}.get(self.path, "")
        self.send_response(200); self.send_header("content-length", str(len(body))); self.end_headers()
        self.wfile.write(body.encode())
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''

AS_PID_1 = r'''
import asyncio, ctypes, logging, socket, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
assert ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER: orphans come to us
from fulcrum.worker.supervisor import Supervisor, SupervisorSettings
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
async def main():
    sup = Supervisor([sys.executable, sys.argv[1], "--port", str(port)], {}, SupervisorSettings(
        engine_url=f"http://127.0.0.1:{port}", health_port=0, poll_interval_s=0.05, drain_poll_s=0.05,
        drain_settle_s=0.0, kill_grace_s=5.0))
    task = asyncio.create_task(sup.run())
    while sup.state != "serving":
        await asyncio.sleep(0.05)
    started = time.monotonic()
    sup.request_stop()
    print("exit", await task, "stop_s", round(time.monotonic() - started, 2))
asyncio.run(main())
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_CHILD_SUBREAPER and /proc are Linux's")
def test_as_pid_1_the_orphaned_processes_of_a_stopped_engine_do_not_hold_the_stop_for_the_kill_grace(
        tmp_path: Path) -> None:
    """In the worker container the supervisor is PID 1: an engine process whose parent exited first is re-parented
    to it and, once it exits, stays a zombie of the group until reaped. The stop must not wait ``kill_grace_s`` for
    it (nor call it "still running"); the supervisor reaps it."""
    engine, script = tmp_path / "engine.py", tmp_path / "as_pid_1.py"
    engine.write_text(ORPHANING_ENGINE)
    script.write_text(AS_PID_1)
    out = subprocess.run([sys.executable, str(script), str(engine)], capture_output=True, text=True, timeout=60).stdout
    last = out.strip().splitlines()[-1].split()
    assert last[:2] == ["exit", "0"], out
    assert float(last[3]) < 3.0 and "still running" not in out, out


NO_STATS_ENGINE = r'''
import os, signal, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port = int(sys.argv[sys.argv.index("--port") + 1])
signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
class H(BaseHTTPRequestHandler):  # vLLM with --disable-log-stats: /metrics has no vllm:num_requests_* gauges
    def log_message(self, *a): pass
    def do_GET(self):
        body = {"/v1/models": '{"data": [{"id": "m"}]}', "/metrics": "# no stat loggers\n"}.get(self.path, "")
        self.send_response(200); self.send_header("content-length", str(len(body))); self.end_headers()
        self.wfile.write(body.encode())
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def test_an_engine_without_request_gauges_is_named_once_at_start_and_once_in_the_drain(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """vLLM started with ``--disable-log-stats`` has no ``vllm:num_requests_*``: the drain cannot see its end and
    runs to its timeout. Said once when the engine is ready, with the likely cause, and once in the drain, not at
    every poll (600 lines in a default 300 s drain)."""
    fake = Fake(tmp_path)
    engine = tmp_path / "no_stats_engine.py"
    engine.write_text(NO_STATS_ENGINE)

    async def scenario() -> None:
        s = SupervisorSettings(engine_url=f"http://127.0.0.1:{fake.port}", health_host="127.0.0.1",
                               health_port=fake.health_port, poll_interval_s=0.05, drain_poll_s=0.05,
                               drain_settle_s=0.0, kill_grace_s=2.0, drain_timeout_s=1.0)
        sup = Supervisor([sys.executable, str(engine), "--port", str(fake.port)], fake.env, s, record=fake.record)
        task = asyncio.create_task(sup.run())
        await wait_for(sup, "serving")
        sup.request_stop()
        assert await task == 0

    with caplog.at_level(logging.WARNING, logger="fulcrum.worker.supervisor"):
        run(scenario())
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("cannot read the engine's load" in w for w in warnings) == 1, warnings
    assert any("--disable-log-stats" in w and "drain" in w for w in warnings), warnings
    assert any("drain timeout" in w for w in warnings), warnings


@pytest.mark.parametrize("name", ["drain_timeout_s", "drain_settle_s", "kill_grace_s"])
def test_settings_refuse_nan_where_a_time_belongs(name: str) -> None:
    """NaN passed ``< 0``: a NaN drain timeout never ended the drain, a NaN kill grace skipped the SIGTERM wait."""
    with pytest.raises(ValueError, match=name):
        SupervisorSettings(**{name: float("nan")})
