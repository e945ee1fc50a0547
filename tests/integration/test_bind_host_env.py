"""``fulcrum sim-worker --host 0.0.0.0`` listens on ``$FULCRUM_BIND_HOST`` alone when it is set: the e2e process
node agent gives each pod a loopback address of its own that way (docs/e2e.md), and two pods' equal ports must
not clash."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def test_a_wildcard_host_listens_only_on_the_bind_host_from_the_environment(tmp_path: Path) -> None:
    host = "127.0.77.7"
    port = _free_port(host)
    env = {**os.environ, "FULCRUM_BIND_HOST": host}
    with (tmp_path / "sim.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fulcrum", "sim-worker", "--profile", "splitwise-llama2-70b-h100", "--tp", "2",
             "--host", "0.0.0.0", "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=2) as r:  # noqa: S310
                    assert r.status == 200
                    break
            except OSError:
                assert proc.poll() is None, (tmp_path / "sim.log").read_text()
                assert time.monotonic() < deadline, "sim-worker did not answer on the bind host in 60 s"
                time.sleep(0.3)
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
            pass  # the wildcard was narrowed: nothing listens on the other loopback addresses
    finally:
        proc.terminate()
        proc.wait(30)
