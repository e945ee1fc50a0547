"""``fulcrum sim-worker`` as a real process against a real etcd on 127.0.0.1: it registers its InstanceRecord under
the LLMServe's prefix, and on SIGTERM it fails /health, deregisters at once, finishes the stream in flight and
exits 0."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("aetcd", reason="aetcd is not installed (pip install aetcd)")
aiohttp = pytest.importorskip("aiohttp")

import aetcd  # noqa: E402

from fulcrum.router.registry import InstanceRecord, instance_key  # noqa: E402

from .servers import EtcdServer, etcd_server, free_port  # noqa: E402,F401  (etcd_server is a fixture)

NS = "tests"
LLMSERVE = "sim"


async def etcd_get(endpoint: str, key: str) -> bytes | None:
    host, port = endpoint.rsplit(":", 1)
    client = aetcd.Client(host=host, port=int(port))
    try:
        got = await client.get(key.encode())
        return None if got is None else bytes(got.value)
    finally:
        await client.close()


async def wait_for(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_a_sim_worker_registers_deregisters_on_sigterm_and_finishes_the_stream_in_flight(
        etcd_server: EtcdServer, tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "POD_NAME": "sim-0", "POD_IP": "127.0.0.1", "POD_NAMESPACE": NS}
    log = (tmp_path / "sim.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "fulcrum", "sim-worker", "--profile", "splitwise-llama2-70b-h100", "--tp", "2",
         "--model", "sim-model", "--host", "127.0.0.1", "--port", str(port), "--role", "decode", "--pool",
         "decode-tp2", "--etcd", etcd_server.endpoint, "--llmserve", LLMSERVE, "--drain-timeout-s", "30"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    key = instance_key(NS, LLMSERVE, "sim-0")
    url = f"http://127.0.0.1:{port}"

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            async def healthy() -> bool:
                try:
                    async with session.get(url + "/health") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False

            await wait_for(healthy, 60, "the sim-worker to serve")
            await wait_for(lambda: _present(etcd_server.endpoint, key), 10, "the registration")
            record = InstanceRecord.from_json(await etcd_get(etcd_server.endpoint, key) or b"{}")
            assert (record.id, record.url, record.role, record.pool, record.tp) == \
                ("sim-0", url, "decode", "decode-tp2", 2)
            assert (record.nixl_host, record.nixl_port, record.model) == ("127.0.0.1", port, "sim-model")
            assert record.kv_capacity_tokens > 0 and record.max_concurrency == 256

            # a 60-token stream at the profile's own speed (~38 ms a token): SIGTERM after its first token
            async with session.post(url + "/v1/completions", json={
                    "prompt": "drain me", "max_tokens": 60, "stream": True}) as r:
                assert r.status == 200
                first = await r.content.readline()
                assert first.startswith(b"data: {")
                proc.send_signal(signal.SIGTERM)
                await wait_for(lambda: _absent(etcd_server.endpoint, key), 5, "the key to go")
                async with session.get(url + "/health") as h:
                    assert h.status == 503  # readiness drops while the stream still runs
                rest = await r.read()
            events = [e for e in (first + rest).split(b"\n\n") if e.strip()]
            assert events[-1] == b"data: [DONE]"
            texts = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]]
            assert len("".join(texts)) == 60

    try:
        asyncio.run(scenario())
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert "drained" in (tmp_path / "sim.log").read_text()


async def _present(endpoint: str, key: str) -> bool:
    return await etcd_get(endpoint, key) is not None


async def _absent(endpoint: str, key: str) -> bool:
    return await etcd_get(endpoint, key) is None
