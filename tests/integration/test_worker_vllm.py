"""``fulcrum worker`` end to end: the supervisor in this environment, real vLLM CPU engines from ``.venv-vllm``
(``--vllm-python``), the tiny model of tiny_model.py, and a real etcd.

- one worker (role both, ``--scheduler vllm``): starts, registers in etcd (the record names its URL, role, NIXL
  channel and the KV capacity read from the engine), serves a completion, and on SIGTERM turns unready,
  deregisters at once, finishes an in-flight streaming request to the last token, stops the engine, exits 0;
- two workers, ``--role prefill`` (NIXL ``kv_producer``) and ``--role decode`` (``kv_consumer``): a request
  disaggregated by hand as tests/integration/test_vllm_pd.py does (A: ``max_tokens=1`` with
  ``kv_transfer_params={"do_remote_decode": true}``; B: the prompt with A's ``kv_transfer_params``) gives the
  same greedy tokens as the colocated run, and B's KV came over NIXL.

Opt-in (starts real engines): ``flock /tmp/fulcrum-vllm.lock pytest -m vllm tests/integration/test_worker_vllm.py``.
At most two engines run at a time; every engine is stopped when the test ends, also on failure.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aetcd", reason="aetcd is not installed (pip install aetcd)")

from fulcrum.router.registry import InstanceRecord  # noqa: E402
from fulcrum.router.registry_etcd import EtcdRegistry  # noqa: E402
from fulcrum.worker.supervisor import group_members, process_group_alive  # noqa: E402

from .engines import (  # noqa: E402
    BLOCK_SIZE,
    build_tiny_model,
    free_port,
    post_json,
    post_stream,
    skip_unless_vllm,
    venv_python,
)
from .servers import EtcdServer, etcd_server  # noqa: E402,F401  (etcd_server is a fixture)

pytestmark = pytest.mark.vllm

NS = "tests"
GREEDY: dict[str, Any] = {"model": "tiny", "temperature": 0, "ignore_eos": True, "return_token_ids": True}


class Worker:
    """One ``fulcrum worker`` process (its engine child runs in its own process group)."""

    def __init__(self, name: str, role: str, cpu: int, work: Path, model: Path, etcd: str, llmserve: str) -> None:
        self.name, self.role, self.cpu = name, role, cpu
        self.work, self.model, self.etcd, self.llmserve = work, model, etcd, llmserve
        self.port, self.health_port, self.nixl_port = free_port(), free_port(), free_port()
        self.log_path = work / f"worker-{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Worker:
        cmd = [sys.executable, "-m", "fulcrum", "worker", "--vllm-python", str(venv_python()),
               "--scheduler", "vllm", "--device", "cpu", "--model", str(self.model), "--served-model-name", "tiny",
               "--host", "127.0.0.1", "--port", str(self.port), "--health-port", str(self.health_port),
               "--nixl-port", str(self.nixl_port), "--role", self.role, "--pool", "cpu-tp1",
               "--block-size", str(BLOCK_SIZE), "--max-model-len", "1024", "--max-num-seqs", "16",
               "--etcd", self.etcd, "--namespace", NS, "--llmserve", self.llmserve, "--drain-timeout-s", "120",
               "--", "--dtype", "float32", "--enforce-eager"]
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(POD_NAME=self.name, POD_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_CPU_OMP_THREADS_BIND=str(self.cpu % (os.cpu_count() or 1)),
                   VLLM_CACHE_ROOT=str(self.work / "vllm-cache"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        with open(self.log_path, "wb") as log:  # cwd outside the repository: see docs/vllm-cpu.md, Troubleshooting
            self.proc = subprocess.Popen(cmd, cwd=self.work, env=env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def readiness(self) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/health", timeout=3) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as err:
            return int(err.code)
        except OSError:
            return 0

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while self.readiness() != 200:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {self.name} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def engine_pid(self) -> int | None:
        match = re.search(r"engine started, pid (\d+)", self.log_path.read_text(errors="replace"))
        return int(match.group(1)) if match else None

    def terminate(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float = 120.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        """Make sure nothing is left: the worker, then its engine's process group. Idempotent."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        pid = self.engine_pid()
        if pid is not None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def registered(endpoint: str, llmserve: str) -> list[InstanceRecord]:
    async def read() -> list[InstanceRecord]:
        registry = EtcdRegistry(endpoint, NS, llmserve)
        try:
            return await registry.snapshot()
        finally:
            await registry.close()

    return asyncio.run(read())


def group_left(pid: int, wait_s: float = 10.0) -> list[tuple[int, str, int]]:
    """The processes of group ``pid`` still running (not zombies) after up to ``wait_s`` seconds, as
    ``(pid, state, parent pid)``; [] when none is. A zombie (exited, not yet reaped by its parent, which need not be
    the supervisor when the supervisor is not PID 1) holds no memory, GPU or port: it is not the engine running
    (``fulcrum.worker.supervisor.process_group_alive``)."""
    deadline = time.monotonic() + wait_s
    while process_group_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [m for m in group_members(pid) or [] if m[1] not in ("Z", "X")]


@pytest.fixture(scope="module")
def work(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    skip_unless_vllm(request.config)
    work = tmp_path_factory.mktemp("worker-vllm")
    return work, build_tiny_model(work / "tiny-model")


@pytest.fixture()
def workers() -> Iterator[list[Worker]]:
    """Workers a test starts; all are stopped (and their engines killed) when it ends."""
    started: list[Worker] = []
    try:
        yield started
    finally:
        for w in started:
            w.kill()


def test_a_worker_registers_serves_and_on_sigterm_drains_a_stream_before_exiting_0(
    work: tuple[Path, Path], etcd_server: EtcdServer, workers: list[Worker]
) -> None:
    workdir, model = work
    w = Worker("w-single", "both", 0, workdir, model, etcd_server.endpoint, "single").start()
    workers.append(w)
    w.wait_ready()

    [record] = registered(etcd_server.endpoint, "single")
    assert (record.id, record.url, record.role, record.pool, record.model) == (
        "w-single", w.url, "both", "cpu-tp1", "tiny")
    assert (record.nixl_host, record.nixl_port, record.max_concurrency) == ("127.0.0.1", w.nixl_port, 16)
    assert record.kv_capacity_tokens > 0 and record.kv_capacity_tokens % BLOCK_SIZE == 0

    status, body = post_json(w.url + "/v1/completions", {**GREEDY, "prompt": "def main():", "max_tokens": 8})
    assert status == 200 and len(body["choices"][0]["token_ids"]) == 8

    n_tokens = 600
    tokens: list[int] = []
    first_event = threading.Event()
    errors: list[BaseException] = []

    def stream() -> None:
        try:
            body = {**GREEDY, "prompt": "import os\n", "max_tokens": n_tokens, "stream": True}
            for event in post_stream(w.url + "/v1/completions", body, timeout_s=300):
                if event["choices"]:
                    tokens.extend(event["choices"][0]["token_ids"] or [])
                first_event.set()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            first_event.set()

    client = threading.Thread(target=stream)
    client.start()
    assert first_event.wait(60) and not errors, errors
    w.terminate()
    deadline = time.monotonic() + 10
    while registered(etcd_server.endpoint, "single"):  # the lease is revoked at once, not after its TTL
        assert time.monotonic() < deadline, "still registered 10 s after SIGTERM"
        time.sleep(0.1)
    still_streaming = client.is_alive()
    assert w.readiness() in (503, 0)  # unready while draining (0: already gone)
    client.join(timeout=300)
    assert not errors, errors
    assert len(tokens) == n_tokens, f"stream cut short at {len(tokens)} of {n_tokens} tokens"
    assert w.wait(timeout_s=120) == 0, w.log_tail()
    assert still_streaming, "the stream ended before the worker was deregistered: the test proved nothing"
    pid = w.engine_pid()
    assert pid is not None and group_left(pid) == []
    log = w.log_path.read_text(errors="replace")
    assert "deregistered; draining" in log and "drained in" in log


def test_prefill_and_decode_workers_give_the_colocated_greedy_output_over_nixl(
    work: tuple[Path, Path], etcd_server: EtcdServer, workers: list[Worker]
) -> None:
    workdir, model = work
    a = Worker("w-prefill", "prefill", 0, workdir, model, etcd_server.endpoint, "pd").start()
    b = Worker("w-decode", "decode", 1, workdir, model, etcd_server.endpoint, "pd").start()
    workers.extend([a, b])
    a.wait_ready()
    b.wait_ready()
    roles = {r.id: (r.role, r.url, r.nixl_port) for r in registered(etcd_server.endpoint, "pd")}
    assert roles == {"w-prefill": ("prefill", a.url, a.nixl_port), "w-decode": ("decode", b.url, b.nixl_port)}

    for seed, n_prompt in ((1, 9), (2, 45), (3, 64)):
        prompt = [(seed * 7919 + i * 104729) % 1997 + 3 for i in range(n_prompt)]
        status, ref = post_json(a.url + "/v1/completions", {**GREEDY, "prompt": prompt, "max_tokens": 24})
        assert status == 200, ref
        status, first = post_json(a.url + "/v1/completions", {**GREEDY, "prompt": prompt, "max_tokens": 1,
                                                               "kv_transfer_params": {"do_remote_decode": True}})
        assert status == 200, first
        kv = first["kv_transfer_params"]
        assert (kv["remote_port"], kv["remote_num_tokens"]) == (a.nixl_port, n_prompt)
        status, rest = post_json(b.url + "/v1/completions", {**GREEDY, "prompt": prompt, "max_tokens": 24,
                                                              "kv_transfer_params": kv})
        assert status == 200, rest
        assert rest["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]

    with urllib.request.urlopen(b.url + "/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    pulled = re.search(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="external_kv_transfer"[^}]*\} (\S+)$',
                       metrics, re.M)
    assert pulled and float(pulled.group(1)) > 0, "the decode worker computed the prompts itself"

    for w in (a, b):
        w.terminate()
    assert (a.wait(), b.wait()) == (0, 0), a.log_tail() + "\n" + b.log_tail()
    assert registered(etcd_server.endpoint, "pd") == []
