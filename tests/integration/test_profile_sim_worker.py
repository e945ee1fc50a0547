"""``fulcrum profile`` against a ``fulcrum sim-worker`` process timed by a built-in profile: the measured profile
gives back the source profile's TTFT and TPOT (a round trip through two real processes and HTTP), and ``fulcrum
plan`` accepts it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from fulcrum.cli import main as fulcrum
from fulcrum.ratio.profile import load_profile
from fulcrum.ratio.profiles import builtin_profile

from .servers import free_port

SOURCE = "splitwise-llama2-70b-h100"
TP = 2


def wait_health(url: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"{url} not healthy within {timeout_s} s")


def test_fulcrum_profile_measures_back_the_profile_a_sim_worker_emulates(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (tmp_path / "sim.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fulcrum", "sim-worker", "--profile", SOURCE, "--tp", str(TP), "--model", "sim",
             "--host", "127.0.0.1", "--port", str(port)],
            env={**os.environ, "POD_NAME": "sim-0"}, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_health(url)
        out = tmp_path / "measured.yaml"
        rc = fulcrum(["profile", "--url", url, "--model", "sim", "--tp", str(TP), "--isl", "256,1024,2048",
                      "--batch", "1,8", "--context", "256,1024", "--repeats", "2", "--decode-tokens", "32",
                      "--gpu", "H100", "--weight-gib", "130", "--kv-bytes-per-token", "327680", "--out", str(out),
                      "--no-progress"])
        assert rc == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    measured, source = load_profile(out), builtin_profile(SOURCE)
    for isl in (256, 1024, 2048):
        # TTFT includes one HTTP round trip and the first SSE event (a few ms on loopback)
        assert abs(measured.ttft(isl, TP) - source.ttft(isl, TP)) <= 0.10 * source.ttft(isl, TP) + 0.015, isl
    for batch in (1, 8):
        for context in (256, 1024):
            # TPOT is the engine's own inter-token latency (vllm:inter_token_latency_seconds) over the steady window
            # (all requests decoding); within the 10% the sim-worker promises (measured: 1.000 on a quiet machine;
            # before the steady window, CI saw +5 to +11% at batch 8, context 1024 from the batch's own prefills)
            assert abs(measured.tpot(batch, context, TP) / source.tpot(batch, context, TP) - 1) <= 0.10, (batch, context)
    assert fulcrum(["plan", "--profile", str(out), "--isl", "1000", "--osl", "150", "--rate", "5"]) == 0
