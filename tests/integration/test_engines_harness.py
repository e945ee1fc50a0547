"""The vLLM engine harness itself: a start-up that stalls is restarted once (FAKE engine: a Python script in place
of vLLM's server, so this runs without vLLM)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from .engines import Engine, EngineSpec

# First run: write the marker and hang without serving (the stall). Second run: serve /health.
FAKE_SERVER = """
import http.server, pathlib, sys, time
marker = pathlib.Path(sys.argv[2])
if not marker.exists():
    marker.write_text("stalled once")
    print("Detected attention backend(s) ['CPU_ATTN']", flush=True)
    time.sleep(3600)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


class FakeEngine(Engine):
    """FAKE: the harness's process handling around a script that stalls on its first start."""

    def __init__(self, workdir: Path, script: str) -> None:
        super().__init__(EngineSpec("F"), workdir / "no-model", workdir)
        self.script = script

    def command(self) -> list[str]:
        return [sys.executable, "-c", self.script, str(self.port), str(self.workdir / "stalled-once")]


def test_a_stalled_start_up_is_restarted_once_and_its_log_kept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    engine = FakeEngine(tmp_path, FAKE_SERVER).start()
    try:
        assert engine.wait_ready_or_restart(first_timeout_s=2.0, timeout_s=20.0) < 20.0
        assert engine.healthy()
    finally:
        engine.stop()
    stalled = tmp_path / "engine-F.log.stalled"
    assert "CPU_ATTN" in stalled.read_text()
    assert "engine F stalled in start-up for 2 s; restarting it once" in capsys.readouterr().err


def test_an_engine_that_stalls_twice_or_exits_still_fails(tmp_path: Path) -> None:
    always_stalls = "import time; print('stuck', flush=True); time.sleep(3600)"
    engine = FakeEngine(tmp_path, always_stalls).start()
    try:
        with pytest.raises(RuntimeError, match="not ready after 1 s"):
            engine.wait_ready_or_restart(first_timeout_s=1.0, timeout_s=1.0)
    finally:
        engine.stop()
    exits = FakeEngine(tmp_path / "x", "import sys; sys.exit(3)").start()
    with pytest.raises(RuntimeError, match="exited during start-up"):
        exits.wait_ready_or_restart(first_timeout_s=5.0, timeout_s=5.0)
    assert not (tmp_path / "x" / "engine-F.log.stalled").exists()
