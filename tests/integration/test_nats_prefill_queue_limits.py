"""Edges of the NATS prefill queue against a real nats-server (tests/integration/servers.py; skips when absent):
a job over the server's max_payload, concurrent worker connects.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest

pytest.importorskip("nats", reason="nats-py is not installed (pip install nats-py)")

from fulcrum.router.prefill_queue import (  # noqa: E402
    NatsPrefillQueue,
    PrefillJobError,
    PrefillQueueError,
    PrefillWorker,
)

from integration.servers import NatsServer, nats_server  # noqa: E402,F401  (nats_server is a fixture)


def test_a_job_over_max_payload_fails_at_once_naming_the_sizes_and_the_setting(nats_server: NatsServer) -> None:
    async def scenario() -> None:
        queue = NatsPrefillQueue(nats_server.url, stream="T_BIG", subject_prefix="test.big")
        try:
            started = time.monotonic()
            with pytest.raises(PrefillQueueError) as caught:
                await queue.submit({"path": "/v1/completions", "body": {"prompt": "x" * 2_000_000}}, timeout_s=10)
            assert time.monotonic() - started < 2
            message = str(caught.value)
            assert "max_payload" in message and "1048576" in message, message
            assert queue.waiting == 0
        finally:
            await queue.close()

    asyncio.run(scenario())


def test_concurrent_connects_of_one_worker_open_one_connection(nats_server: NatsServer) -> None:
    def connections() -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{nats_server.monitor_port}/connz", timeout=2) as resp:
            return sum(1 for c in json.load(resp).get("connections", []) if "w2-twice" in (c.get("name") or ""))

    async def scenario() -> None:
        worker = PrefillWorker(nats_server.url, stream="T_TWICE", subject_prefix="test.twice", worker_id="w2-twice")
        try:
            await asyncio.gather(worker.connect(), worker.connect())
            await asyncio.sleep(0.2)
            assert await asyncio.to_thread(connections) == 1
        finally:
            await worker.close()
        await asyncio.sleep(0.2)
        assert await asyncio.to_thread(connections) == 0

    asyncio.run(scenario())


def test_a_reply_over_max_payload_reaches_the_router_as_a_clear_error_not_a_timeout(nats_server: NatsServer) -> None:
    layout = {"stream": "T_BIGREPLY", "subject_prefix": "test.bigreply"}

    async def huge(job: dict[str, object]) -> dict[str, object]:
        return {"status": 200, "body": {"text": "y" * 2_000_000}}

    async def scenario() -> None:
        queue = NatsPrefillQueue(nats_server.url, **layout)
        worker = PrefillWorker(nats_server.url, **layout, fetch_timeout_s=0.3)
        task = asyncio.create_task(worker.run(huge))
        try:
            started = time.monotonic()
            with pytest.raises(PrefillJobError, match="max_payload"):
                await queue.submit({"n": 1}, timeout_s=8)
            assert time.monotonic() - started < 4
        finally:
            await worker.close()
            await task
            await queue.close()

    asyncio.run(scenario())
