"""The NATS JetStream prefill queue against a real nats-server (DOPD §V-C: FIFO queue, P-instances pull).

Each test uses its own stream and subjects on one server per module; ack_wait is 1 s where redelivery is tested.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

pytest.importorskip("nats", reason="nats-py is not installed (pip install nats-py)")

import nats  # noqa: E402
from aiohttp import web  # noqa: E402

from fulcrum.router.prefill_queue import (  # noqa: E402
    JOB_ID_HEADER,
    MSG_ID_HEADER,
    REPLY_TO_HEADER,
    InvalidPrefillJobError,
    NatsPrefillQueue,
    PrefillJobError,
    PrefillQueueError,
    PrefillTimeoutError,
    PrefillWorker,
    run_prefill_worker,
)

from .servers import NatsServer, free_port, nats_server  # noqa: E402,F401  (nats_server is a fixture)


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run an async scenario; fail when it leaves tasks behind."""

    async def main() -> None:
        await scenario()
        await asyncio.sleep(0.01)
        leaked = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert not leaked, f"tasks left running: {leaked}"

    asyncio.run(main())


def names(test: str) -> dict[str, Any]:
    """Stream and subjects of one test (so tests sharing the server do not see each other's jobs)."""
    return {"stream": f"T_{test.upper()}", "subject_prefix": f"test.{test}"}


async def wait_until(predicate: Callable[[], Coroutine[Any, Any, bool]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, f"condition not reached within {timeout_s} s"
        await asyncio.sleep(0.02)


async def stop_workers(workers: list[PrefillWorker], tasks: list[asyncio.Task[None]]) -> None:
    await asyncio.gather(*(w.close() for w in workers))
    await asyncio.gather(*tasks)


def test_jobs_are_processed_once_each_across_three_workers(nats_server: NatsServer) -> None:
    done: list[tuple[str, int]] = []

    def handler_for(worker: str) -> Callable[[dict[str, Any]], Coroutine[Any, Any, dict[str, Any]]]:
        async def handler(job: dict[str, Any]) -> dict[str, Any]:
            await asyncio.sleep(0.02)  # a prefill takes a while: the others pull meanwhile
            done.append((worker, job["n"]))
            return {"n": job["n"], "square": job["n"] ** 2, "by": worker}

        return handler

    async def scenario() -> None:
        queue = NatsPrefillQueue(nats_server.url, **names("share"))
        workers = [PrefillWorker(nats_server.url, **names("share"), worker_id=f"w{i}", fetch_timeout_s=0.5)
                   for i in range(3)]
        tasks = [asyncio.create_task(w.run(handler_for(w.worker_id))) for w in workers]
        results = await asyncio.gather(*(queue.submit({"n": n}, timeout_s=20) for n in range(30)))
        assert [r["square"] for r in results] == [n * n for n in range(30)]
        await stop_workers(workers, tasks)
        assert await queue.depth() == 0
        await queue.close()

    run(scenario)
    assert sorted(n for _, n in done) == list(range(30))  # every job exactly once
    per_worker = collections.Counter(w for w, _ in done)
    assert len(per_worker) >= 2, per_worker  # the work was shared


def test_depth_counts_jobs_waiting_for_a_worker(nats_server: NatsServer) -> None:
    async def scenario() -> None:
        queue = NatsPrefillQueue(nats_server.url, **names("depth"))
        await queue.connect()
        assert await queue.depth() == 0
        submits = [asyncio.create_task(queue.submit({"n": n}, timeout_s=20)) for n in range(5)]

        async def depth_is(k: int) -> bool:
            return await queue.depth() == k

        await wait_until(lambda: depth_is(5), 5)

        gate = asyncio.Event()
        started = asyncio.Event()

        async def slow(job: dict[str, Any]) -> dict[str, Any]:
            started.set()
            await gate.wait()
            return {"n": job["n"]}

        worker = PrefillWorker(nats_server.url, **names("depth"), fetch_timeout_s=0.5)
        task = asyncio.create_task(worker.run(slow))
        await asyncio.wait_for(started.wait(), 5)
        assert await queue.depth() == 4  # one job taken (in progress), four still waiting
        gate.set()
        results = await asyncio.gather(*submits)
        assert sorted(r["n"] for r in results) == list(range(5))
        assert await queue.depth() == 0
        await stop_workers([worker], [task])
        await queue.close()

    run(scenario)


def test_a_single_worker_takes_jobs_in_fifo_order(nats_server: NatsServer) -> None:
    order: list[int] = []

    async def scenario() -> None:
        queue = NatsPrefillQueue(nats_server.url, **names("fifo"))
        await queue.connect()
        submits = []
        for n in range(10):  # enqueue one at a time so the publish order is known
            submits.append(asyncio.create_task(queue.submit({"n": n}, timeout_s=20)))

            async def depth_is(k: int = n + 1) -> bool:
                return await queue.depth() == k

            await wait_until(depth_is, 5)

        async def record(job: dict[str, Any]) -> dict[str, Any]:
            order.append(job["n"])
            return {}

        worker = PrefillWorker(nats_server.url, **names("fifo"), fetch_timeout_s=0.5)
        task = asyncio.create_task(worker.run(record))
        await asyncio.gather(*submits)
        await stop_workers([worker], [task])
        await queue.close()

    run(scenario)
    assert order == list(range(10))


def test_submit_times_out_cleanly_when_no_worker_exists(nats_server: NatsServer) -> None:
    async def scenario() -> None:
        queue = NatsPrefillQueue(nats_server.url, **names("lonely"))
        started = time.monotonic()
        with pytest.raises(PrefillTimeoutError):
            await queue.submit({"prompt": "hello"}, timeout_s=0.5)
        elapsed = time.monotonic() - started
        assert 0.4 < elapsed < 2.0, elapsed
        assert await queue.depth() == 0  # the job was withdrawn: a later worker will not prefill it for nobody

        seen: list[dict[str, Any]] = []

        async def record(job: dict[str, Any]) -> dict[str, Any]:
            seen.append(job)
            return {}

        worker = PrefillWorker(nats_server.url, **names("lonely"), fetch_timeout_s=0.3)
        task = asyncio.create_task(worker.run(record))
        assert await queue.submit({"prompt": "again"}, timeout_s=10) == {}
        await stop_workers([worker], [task])
        assert seen == [{"prompt": "again"}]
        await queue.close()

    run(scenario)


_DYING_WORKER = """
import asyncio, sys
from fulcrum.router.prefill_queue import PrefillWorker

async def main():
    worker = PrefillWorker(sys.argv[1], stream=sys.argv[2], subject_prefix=sys.argv[3], ack_wait_s=1.0,
                           worker_id="doomed", fetch_timeout_s=0.5)

    async def hang(job):
        print("got", job["n"], flush=True)
        await asyncio.sleep(3600)

    await worker.run(hang)

asyncio.run(main())
"""


def test_a_job_of_a_worker_that_dies_mid_job_is_redelivered_to_another(nats_server: NatsServer) -> None:
    layout = names("redeliver")

    async def scenario() -> None:
        queue = NatsPrefillQueue(nats_server.url, **layout, ack_wait_s=1.0)
        await queue.connect()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _DYING_WORKER, nats_server.url, layout["stream"], layout["subject_prefix"],
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            submit = asyncio.create_task(queue.submit({"n": 7}, timeout_s=30))
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
            assert line.split() == [b"got", b"7"]
            proc.kill()  # dies holding the job: no ack, no nak, no more heartbeats
            await proc.wait()
            killed = time.monotonic()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

        async def survive(job: dict[str, Any]) -> dict[str, Any]:
            return {"n": job["n"], "by": "survivor"}

        worker = PrefillWorker(nats_server.url, **layout, ack_wait_s=1.0, fetch_timeout_s=0.3)
        task = asyncio.create_task(worker.run(survive))
        assert await asyncio.wait_for(submit, 10) == {"n": 7, "by": "survivor"}
        waited = time.monotonic() - killed
        assert waited < 4.0, waited  # redelivered after ack_wait (1 s), not after the submit's timeout
        await stop_workers([worker], [task])
        await queue.close()

    run(scenario)


def test_a_failing_handler_is_retried_then_reported(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="fulcrum.router.prefill_queue")
    attempts: collections.Counter[str] = collections.Counter()

    async def flaky(job: dict[str, Any]) -> dict[str, Any]:
        attempts[job["kind"]] += 1
        if job["kind"] == "poison" or attempts[job["kind"]] == 1:
            raise RuntimeError(f"boom {job['kind']}")
        return {"kind": job["kind"], "attempt": attempts[job["kind"]]}

    async def scenario() -> None:
        layout = {**names("flaky"), "max_deliver": 3, "ack_wait_s": 5.0}
        queue = NatsPrefillQueue(nats_server.url, **layout)
        worker = PrefillWorker(nats_server.url, **layout, fetch_timeout_s=0.3)
        task = asyncio.create_task(worker.run(flaky))
        # a transient failure: nak'ed, redelivered at once (not after ack_wait), succeeds on the 2nd delivery
        started = time.monotonic()
        assert await queue.submit({"kind": "transient"}, timeout_s=10) == {"kind": "transient", "attempt": 2}
        assert time.monotonic() - started < 2.0
        # a poison job: fails on every delivery; after max_deliver the router gets the error, not a timeout
        with pytest.raises(PrefillJobError, match="boom poison"):
            await queue.submit({"kind": "poison"}, timeout_s=10)
        assert attempts["poison"] == 3
        assert await queue.depth() == 0
        await stop_workers([worker], [task])
        await queue.close()

    run(scenario)
    assert any("redelivering" in m for m in caplog.messages)
    assert any("giving up" in m for m in caplog.messages)


def test_an_unreachable_nats_is_a_prefill_queue_error() -> None:
    async def scenario() -> None:
        queue = NatsPrefillQueue(f"nats://127.0.0.1:{free_port()}", **names("nowhere"), connect_timeout_s=1.0)
        with pytest.raises(PrefillQueueError, match="cannot connect"):
            await queue.submit({"n": 1}, timeout_s=1)
        await queue.close()

    run(scenario)


def test_a_job_longer_than_ack_wait_is_not_redelivered_while_its_worker_lives(nats_server: NatsServer) -> None:
    handled: list[str] = []

    def slow_handler(worker: str) -> Callable[[dict[str, Any]], Coroutine[Any, Any, dict[str, Any]]]:
        async def handler(job: dict[str, Any]) -> dict[str, Any]:
            handled.append(worker)
            await asyncio.sleep(2.5)  # 2.5 × ack_wait: only the in_progress heartbeats keep the job here
            return {"by": worker}

        return handler

    async def scenario() -> None:
        layout = {**names("heartbeat"), "ack_wait_s": 1.0}
        queue = NatsPrefillQueue(nats_server.url, **layout)
        workers = [PrefillWorker(nats_server.url, **layout, worker_id=f"w{i}", fetch_timeout_s=0.3) for i in range(2)]
        tasks = [asyncio.create_task(w.run(slow_handler(w.worker_id))) for w in workers]
        result = await queue.submit({"n": 1}, timeout_s=10)
        await asyncio.sleep(0.5)  # a redelivery, had there been one, would be handled by now
        await stop_workers(workers, tasks)
        assert handled == [result["by"]]
        await queue.close()

    run(scenario)


def test_a_malformed_job_is_answered_at_once_and_never_redelivered(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A job no worker could run (a wrong ``path`` or ``body`` for the engine, not JSON, not an object) gets its
    error reply on its first delivery and is terminated (AckTerm), although ``max_deliver`` is 3: one delivery,
    one reply, no redelivery after a nak or after ``ack_wait``. A valid job after them is served."""
    caplog.set_level(logging.WARNING, logger="fulcrum.router.prefill_queue")
    layout = {**names("malformed"), "ack_wait_s": 1.0, "max_deliver": 3}
    stream, durable = layout["stream"], "prefill-workers"
    engine_calls: list[dict[str, Any]] = []
    valid = {"model": "m", "prompt": "hello", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    answer = {"id": "cmpl-1", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
              "kv_transfer_params": {"remote_engine_id": "e1", "remote_block_ids": [1]}}
    malformed: dict[str, tuple[bytes, str]] = {  # job id: (payload, what the error reply names)
        "body-string": (b'{"path": "/v1/completions", "body": "not an object"}', "body a JSON string"),
        "body-missing": (b'{"path": "/v1/chat/completions"}', "body missing"),
        "path-missing": (b'{"body": {"prompt": "hi"}}', "path missing"),
        "path-list": (b'{"path": ["/v1/completions"], "body": {}}', "path ['/v1/completions']"),
        "path-foreign": (b'{"path": "/admin/shutdown", "body": {}}', "path '/admin/shutdown'"),
        "not-json": (b"\xff{not json", "not JSON"),
        "not-object": (b"[1, 2]", "a JSON array, not an object"),
    }

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({})

    async def completions(request: web.Request) -> web.Response:
        engine_calls.append(await request.json())
        return web.json_response(answer)

    async def scenario() -> None:
        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        queue = NatsPrefillQueue(nats_server.url, **layout)
        await queue.connect()  # creates the stream and the consumer
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        replies: list[tuple[str, dict[str, Any]]] = []
        terminated: list[dict[str, Any]] = []  # JetStream's advisory per terminated message (with its deliveries)

        async def on_reply(msg: Any) -> None:
            replies.append((msg.subject.rsplit(".", 1)[-1], json.loads(msg.data)))

        async def on_terminated(msg: Any) -> None:
            terminated.append(json.loads(msg.data))

        inbox = nc.new_inbox()
        await nc.subscribe(f"{inbox}.*", cb=on_reply)
        await nc.subscribe(f"$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{stream}.{durable}", cb=on_terminated)
        await nc.flush()
        stop = asyncio.Event()
        puller = asyncio.create_task(run_prefill_worker(
            nats_server.url, f"http://127.0.0.1:{port}", **layout, worker_id="w1", stop=stop, ready_interval_s=0.1))
        try:
            for job_id, (payload, _) in malformed.items():  # published as the router publishes a job
                await js.publish(f"{layout['subject_prefix']}.jobs", payload, stream=stream, headers={
                    JOB_ID_HEADER: job_id, REPLY_TO_HEADER: f"{inbox}.{job_id}", MSG_ID_HEADER: job_id})

            async def all_replied() -> bool:
                return len(replies) >= len(malformed)

            await wait_until(all_replied, 10)
            await asyncio.sleep(1.5 * layout["ack_wait_s"])  # a redelivery (nak or ack_wait) would be answered by now
            assert collections.Counter(job_id for job_id, _ in replies) == {job_id: 1 for job_id in malformed}
            info = await js.consumer_info(stream, durable)
            assert info.delivered is not None
            assert info.delivered.consumer_seq == len(malformed)  # one delivery each (a redelivery counts too)
            assert (info.num_redelivered, info.num_ack_pending, info.num_pending) == (0, 0, 0)
            assert sorted(a["deliveries"] for a in terminated) == [1] * len(malformed), terminated
            for job_id, reply in replies:
                assert reply["ok"] is False and reply.get("invalid") is True and reply["job_id"] == job_id, reply
                assert reply["error"].startswith("invalid prefill job: "), reply
                assert malformed[job_id][1] in reply["error"], (job_id, reply["error"])

            # through the router: the error at once, as an InvalidPrefillJobError (a PrefillJobError: 502)
            started = time.monotonic()
            with pytest.raises(InvalidPrefillJobError, match="invalid prefill job: body a JSON array"):
                await queue.submit({"path": "/v1/completions", "body": [valid]}, timeout_s=10)
            assert time.monotonic() - started < layout["ack_wait_s"]

            # a valid job after them is served by the same puller
            reply = await queue.submit({"path": "/v1/completions", "body": valid}, timeout_s=10)
            assert reply == {"status": 200, "body": answer}
            assert engine_calls == [valid]  # the engine saw the valid job only
            info = await js.consumer_info(stream, durable)
            assert info.delivered is not None and info.delivered.consumer_seq == len(malformed) + 2
            assert (info.num_redelivered, info.num_ack_pending, info.num_pending) == (0, 0, 0)
        finally:
            stop.set()
            await asyncio.wait_for(puller, 10)
            await nc.close()
            await queue.close()
            await runner.cleanup()

    run(scenario)
    assert not any("redelivering" in m or "giving up" in m for m in caplog.messages), caplog.messages
    assert sum("answered and terminated" in m for m in caplog.messages) == len(malformed) + 1
