"""The NATS prefill queue end to end with real processes: ``fulcrum router`` (``prefill_queue: nats``, the
``disaggregated`` policy), a real nats-server with JetStream, and two ``fulcrum sim-worker`` processes — a prefill
worker that pulls the LLMServe's prefill jobs (``--nats``) and a decode worker. The answer equals the colocated one,
every prefill went through the queue, and a SIGTERM'd prefill worker stops pulling."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("nats", reason="nats-py is not installed (pip install nats-py)")

from .servers import NatsServer, free_port, nats_server  # noqa: E402,F401  (nats_server is a fixture)

NS, LLMSERVE, MODEL = "tests", "queued", "sim-model"


def spawn(args: list[str], log: Path, pod: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "POD_NAME": pod, "POD_IP": "127.0.0.1", "POD_NAMESPACE": NS}
    with log.open("w") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-m", "fulcrum", *args], env=env, stdout=out,
                                stderr=subprocess.STDOUT)


def sim_worker(port: int, role: str, log: Path, pod: str, nats: str | None) -> subprocess.Popen[bytes]:
    args = ["sim-worker", "--profile", "splitwise-llama2-70b-h100", "--tp", "2", "--model", MODEL, "--host",
            "127.0.0.1", "--port", str(port), "--role", role, "--time-scale", "0.05", "--llmserve", LLMSERVE,
            "--drain-timeout-s", "10"]
    if nats:
        args += ["--nats", nats]
    return spawn(args, log, pod)


async def wait_http(session: aiohttp.ClientSession, url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            async with session.get(url) as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise AssertionError(f"{url} did not answer 200 within {timeout_s} s")


async def wait_available(session: aiohttp.ClientSession, url: str, n: int, timeout_s: float = 60) -> None:
    """Wait until the router's ``/health`` counts ``n`` available instances (healthy, not ejected, not draining)."""
    deadline = time.monotonic() + timeout_s
    seen = None
    while time.monotonic() < deadline:
        async with session.get(url) as r:
            seen = await r.json()
        if seen["available"] >= n:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"the router at {url} counted {seen} instead of {n} available instances in {timeout_s} s")


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_prefill_jobs_flow_through_nats_to_a_pulling_sim_worker(nats_server: NatsServer, tmp_path: Path) -> None:
    pp, dp, rp = free_port(), free_port(), free_port()
    config = {
        "model": MODEL, "kv_block_size": 16, "token_count": "estimate",
        "policy": {"name": "disaggregated", "params": {}},
        "registry": "static",
        "instances": [
            {"id": "p0", "url": f"http://127.0.0.1:{pp}", "role": "prefill"},
            {"id": "d0", "url": f"http://127.0.0.1:{dp}", "role": "decode"},
        ],
        "prefill_queue": {"kind": "nats", "url": nats_server.url, "stream": f"PREFILL_{NS.upper()}_{LLMSERVE.upper()}",
                          "subject_prefix": f"fulcrum.prefill.{NS}.{LLMSERVE}", "timeout_s": 5.0},
    }
    cfg_file = tmp_path / "router.yaml"
    cfg_file.write_text(yaml.safe_dump(config))
    procs = [
        sim_worker(pp, "prefill", tmp_path / "p0.log", "p0", nats_server.url),
        sim_worker(dp, "decode", tmp_path / "d0.log", "d0", None),
        spawn(["router", "--config", str(cfg_file), "--host", "127.0.0.1", "--port", str(rp)], tmp_path / "router.log",
              "router-0"),
    ]
    body = {"model": MODEL, "prompt": "def fibonacci(n):\n    " * 6, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}

    async def scenario() -> None:
        async with aiohttp.ClientSession() as s:
            for port in (pp, dp, rp):
                await wait_http(s, f"http://127.0.0.1:{port}/health")
            # the router probed the workers when it started, maybe before they listened, and ejected them:
            # wait until its own probes (every health_interval_s) have admitted both
            await wait_available(s, f"http://127.0.0.1:{rp}/health", 2)
            # the colocated answer, straight from the decode worker
            async with s.post(f"http://127.0.0.1:{dp}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                colocated = (await r.json())["choices"][0]["text"]
            texts = []
            for _ in range(4):
                async with s.post(f"http://127.0.0.1:{rp}/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    out = await r.json()
                    texts.append(out["choices"][0]["text"])
                    assert out["usage"]["completion_tokens"] == 12
            assert texts == [colocated] * 4
            async with s.get(f"http://127.0.0.1:{rp}/metrics") as r:
                router_metrics = await r.text()
            assert metric(router_metrics, "fulcrum_router_prefill_jobs_total", outcome="ok") == 4
            async with s.get(f"http://127.0.0.1:{dp}/metrics") as r:
                decode_metrics = await r.text()
            assert metric(decode_metrics, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 0

            # SIGTERM the prefill worker: it stops pulling, so the next prefill finds no worker (503 with the reason)
            procs[0].send_signal(signal.SIGTERM)
            assert procs[0].wait(timeout=30) == 0
            async with s.post(f"http://127.0.0.1:{rp}/v1/completions", json=body) as r:
                assert r.status == 503
                assert re.search("prefill", await r.text())

    try:
        asyncio.run(scenario())
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
