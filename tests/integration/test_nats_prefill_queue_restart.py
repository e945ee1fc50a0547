"""The NATS prefill queue across a nats-server restart (memory storage: the stream is gone afterwards).

A real nats-server (tests/integration/servers.py; skips when the binary is absent) is restarted under a connected
router and worker: both must set the stream and the consumer up again, so jobs flow once NATS is back instead of
failing with "no response from stream" for ever.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("nats", reason="nats-py is not installed (pip install nats-py)")

import nats  # noqa: E402

from fulcrum.router.prefill_queue import NatsPrefillQueue, PrefillWorker  # noqa: E402

from integration.servers import NatsServer, find_binary  # noqa: E402


@pytest.fixture
def nats_restartable(tmp_path: Path) -> Iterator[NatsServer]:
    """A nats-server of this test only (it gets restarted); always stopped."""
    binary = find_binary("nats-server", "FULCRUM_NATS_SERVER_BIN")
    if binary is None:
        pytest.skip("nats-server binary not found: run scripts/install-servers.sh")
    server = NatsServer(binary, tmp_path)
    try:
        server.start()
        yield server
    finally:
        server.stop()


async def _echo(job: dict[str, Any]) -> dict[str, Any]:
    return {"n": job["n"]}


def test_router_and_worker_set_the_stream_up_again_after_a_nats_restart(nats_restartable: NatsServer) -> None:
    layout = {"stream": "T_RESTART", "subject_prefix": "test.restart"}

    async def scenario() -> None:
        queue = NatsPrefillQueue(nats_restartable.url, **layout)
        worker = PrefillWorker(nats_restartable.url, **layout, fetch_timeout_s=0.3)
        task = asyncio.create_task(worker.run(_echo))
        try:
            assert await queue.submit({"n": 1}, timeout_s=10) == {"n": 1}
            nats_restartable.stop()
            nats_restartable.start()  # memory storage: the stream and the consumer are gone
            started = time.monotonic()
            assert await queue.submit({"n": 2}, timeout_s=15) == {"n": 2}
            assert time.monotonic() - started < 10
        finally:
            await worker.close()
            await task
            await queue.close()

    asyncio.run(scenario())


def test_a_worker_alone_sets_the_stream_up_again_after_a_nats_restart(nats_restartable: NatsServer) -> None:
    layout = {"stream": "T_RESTART_W", "subject_prefix": "test.restartw"}

    async def scenario() -> None:
        worker = PrefillWorker(nats_restartable.url, **layout, fetch_timeout_s=0.3)
        task = asyncio.create_task(worker.run(_echo))
        try:
            while worker._sub is None:  # connected, the stream set up
                await asyncio.sleep(0.02)
            nats_restartable.stop()
            nats_restartable.start()
            nc = await nats.connect(nats_restartable.url)
            try:
                js = nc.jetstream()
                deadline = time.monotonic() + 10
                while True:  # the worker's reconnection brings the stream and its consumer back
                    try:
                        await js.consumer_info(layout["stream"], "prefill-workers")
                        break
                    except nats.js.errors.NotFoundError:
                        assert time.monotonic() < deadline, "stream/consumer not set up again within 10 s"
                        await asyncio.sleep(0.1)
            finally:
                await nc.close()
        finally:
            await worker.close()
            await task

    asyncio.run(scenario())


def test_a_job_waiting_in_the_queue_when_nats_restarts_is_republished_and_answered(
        nats_restartable: NatsServer) -> None:
    layout = {"stream": "T_RESTART_J", "subject_prefix": "test.restartj"}

    async def scenario() -> None:
        queue = NatsPrefillQueue(nats_restartable.url, **layout)
        await queue.connect()
        submit = asyncio.create_task(queue.submit({"n": 7}, timeout_s=25))
        deadline = time.monotonic() + 5
        while await queue.depth() < 1:  # published, no worker yet: it waits in the (memory) stream
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        nats_restartable.stop()
        nats_restartable.start()  # the job is gone with the stream
        restarted = time.monotonic()
        worker = PrefillWorker(nats_restartable.url, **layout, fetch_timeout_s=0.3)
        task = asyncio.create_task(worker.run(_echo))
        try:
            assert await asyncio.wait_for(submit, 20) == {"n": 7}
            assert time.monotonic() - restarted < 10  # republished after the reconnection, not timed out
        finally:
            await worker.close()
            await task
            await queue.close()

    asyncio.run(scenario())
