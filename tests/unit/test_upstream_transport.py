"""The upstream pool over its transport seam: membership, accounting and health in the pool, the wire in a FAKE
transport; the queued transport's prefill legs over a FAKE prefill queue."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("pytest_asyncio")

from fulcrum.router.config import PrefillQueueConfig, parse_config  # noqa: E402
from fulcrum.router.errors import NoHealthyInstance  # noqa: E402
from fulcrum.router.metrics import RouterMetrics  # noqa: E402
from fulcrum.router.registry import InstanceRecord  # noqa: E402
from fulcrum.router.transport import QueuedTransport, is_prefill_leg  # noqa: E402
from fulcrum.router.upstream import Deadline, UpstreamFailure, UpstreamPool  # noqa: E402

pytestmark = pytest.mark.asyncio

KV = {"do_remote_decode": True, "do_remote_prefill": False}


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class FakeResponse:
    """A FAKE engine answer as a transport yields it."""

    def __init__(self, status: int, raw: bytes) -> None:
        self.status = status
        self._raw = raw
        self.closed = False
        self.content = self

    async def read(self) -> bytes:
        return self._raw

    async def iter_any(self):
        yield self._raw

    def close(self) -> None:
        self.closed = True


class FakeTransport:
    """A FAKE :class:`fulcrum.router.upstream.Transport`: answers scripted per URL (an ``UpstreamFailure`` to raise,
    or ``(status, raw)``), every call recorded."""

    def __init__(self) -> None:
        self.answers: dict[str, object] = {}
        self.calls: list[tuple[str, str, object, Deadline, bool | None]] = []
        self.closed = False

    def _answer(self, url: str) -> tuple[int, bytes]:
        got = self.answers.get(url, (200, b'{"ok": true}'))
        if isinstance(got, BaseException):
            raise got
        return got  # type: ignore[return-value]

    @asynccontextmanager
    async def open(self, iid, base, path, body, deadline):
        self.calls.append(("open", base + path, body, deadline, None))
        status, raw = self._answer(base + path)
        yield FakeResponse(status, raw)

    async def post(self, iid, base, path, body, deadline, *, queueable):
        self.calls.append(("post", base + path, body, deadline, queueable))
        status, raw = self._answer(base + path)
        return status, raw, None

    async def get(self, iid, base, path, deadline):
        self.calls.append(("get", base + path, None, deadline, None))
        return self._answer(base + path)

    async def close(self) -> None:
        self.closed = True


def make_pool(transport, **config) -> tuple[UpstreamPool, Clock, RouterMetrics]:
    clock = Clock()
    metrics = RouterMetrics()
    pool = UpstreamPool(transport, parse_config(config), metrics, clock)
    pool.set_records([InstanceRecord(id="e0", url="http://e0"), InstanceRecord(id="e1", url="http://e1")])
    return pool, clock, metrics


def metric(metrics: RouterMetrics, line: str) -> float:
    for row in metrics.exposition().decode().splitlines():
        if row.startswith(line + " "):
            return float(row.rsplit(" ", 1)[1])
    return 0.0


async def test_post_json_goes_through_the_transport_with_the_whole_call_deadline_and_parses_the_answer():
    t = FakeTransport()
    pool, _, _ = make_pool(t, timeouts={"connect_s": 0.5, "request_s": 30})
    assert await pool.post_json("e0", "/tokenize", {"prompt": "x"}) == (200, b'{"ok": true}', {"ok": True})
    kind, url, body, deadline, queueable = t.calls[0]
    assert (kind, url, body, queueable) == ("post", "http://e0/tokenize", {"prompt": "x"}, True)
    assert deadline == Deadline(0.5, 30.0)
    await pool.post_json("e0", "/tokenize", {}, total_s=2.0, queueable=False)
    assert t.calls[1][3] == Deadline(0.5, 2.0) and t.calls[1][4] is False


async def test_a_connect_failure_from_the_transport_ejects_the_instance_at_once():
    t = FakeTransport()
    pool, clock, metrics = make_pool(t, eject_base_s=5)
    t.answers["http://e0/v1/completions"] = UpstreamFailure("e0", "connect", "refused")
    with pytest.raises(UpstreamFailure):
        await pool.fetch("e0", "/v1/completions", b"{}")
    assert pool.available_ids() == ["e1"]
    assert pool.state("e0").ejected_until == clock.t + 5
    assert metric(metrics, 'fulcrum_router_ejections_total{cause="connect",instance="e0"}') == 1.0
    assert metric(metrics, 'fulcrum_router_upstream_errors_total{cause="connect"}') == 1.0


async def test_5xx_failures_eject_after_the_configured_count_and_a_success_resets_the_count():
    t = FakeTransport()
    pool, _, _ = make_pool(t, eject_after_failures=2)
    url = "http://e0/v1/completions"
    t.answers[url] = UpstreamFailure("e0", "status", "boom", 500)
    with pytest.raises(UpstreamFailure):
        await pool.fetch("e0", "/v1/completions", {})
    t.answers[url] = (200, b"{}")
    await pool.fetch("e0", "/v1/completions", {})
    assert pool.state("e0").consecutive_failures == 0
    t.answers[url] = UpstreamFailure("e0", "status", "boom", 500)
    for _ in range(2):
        with pytest.raises(UpstreamFailure):
            await pool.fetch("e0", "/v1/completions", {})
    assert "e0" not in pool.available_ids()


async def test_a_failure_that_is_not_the_instances_fault_is_not_held_against_it():
    t = FakeTransport()
    pool, _, metrics = make_pool(t, eject_after_failures=1)
    t.answers["http://e0/v1/completions"] = UpstreamFailure("e0", "status", "every worker failed", 502,
                                                            instance_fault=False)
    with pytest.raises(UpstreamFailure):
        await pool.fetch("e0", "/v1/completions", {})
    assert pool.state("e0").consecutive_failures == 0 and pool.available_ids() == ["e0", "e1"]
    assert metric(metrics, 'fulcrum_router_upstream_errors_total{cause="status"}') == 0.0


async def test_a_200_answer_that_is_not_json_is_a_broken_instance():
    t = FakeTransport()
    pool, _, _ = make_pool(t)
    t.answers["http://e0/tokenize"] = (200, b"<html>")
    with pytest.raises(UpstreamFailure) as err:
        await pool.post_json("e0", "/tokenize", {})
    assert err.value.cause == "broken" and "e0" not in pool.available_ids()


async def test_open_streams_through_the_transport_and_a_failure_raised_while_reading_is_recorded():
    t = FakeTransport()
    pool, _, _ = make_pool(t, timeouts={"connect_s": 1, "first_token_s": 3, "idle_s": 7})
    async with pool.open("e0", "/v1/completions", {"stream": True}, stream=True) as resp:
        assert resp.status == 200 and [c async for c in resp.content.iter_any()] == [b'{"ok": true}']
    assert t.calls[0][3] == Deadline(1.0, None, 7.0)
    with pytest.raises(UpstreamFailure):
        async with pool.open("e1", "/v1/completions", {}, stream=True):
            raise UpstreamFailure("e1", "broken", "cut mid-stream")
    assert "e1" not in pool.available_ids()


async def test_a_streams_socket_read_limit_is_a_backstop_never_shorter_than_the_first_token_wait():
    # vLLM sends a stream's headers at once: with the socket limit at idle_s, a first token slower than idle_s
    # (but within first_token_s) killed the stream; the relay enforces both limits itself
    t = FakeTransport()
    pool, _, _ = make_pool(t, timeouts={"connect_s": 1, "first_token_s": 10, "idle_s": 2})
    async with pool.open("e0", "/v1/completions", {"stream": True}, stream=True):
        pass
    assert t.calls[0][3] == Deadline(1.0, None, 10.0)


async def test_a_socket_read_timeout_over_http_is_a_timeout_not_a_broken_instance():
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from fulcrum.router.transport import HttpTransport, new_session

    async def silent(request):  # headers at once, then nothing
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(5)
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", silent)
    server = TestServer(app)
    await server.start_server()
    http = HttpTransport(new_session(4))
    try:
        with pytest.raises(UpstreamFailure) as err:
            async with http.open("e0", str(server.make_url("")), "/v1/completions", {}, Deadline(1.0, None, 0.2)) as resp:
                await resp.read()
        assert err.value.cause == "timeout"
    finally:
        await http.close()
        await server.close()


async def test_probes_read_health_and_utilisation_through_the_transport():
    t = FakeTransport()
    pool, _, _ = make_pool(t)
    pool.set_records([InstanceRecord(id="e0", url="http://e0", max_concurrency=4), InstanceRecord(id="e1", url="http://e1")])
    t.answers["http://e0/metrics"] = (200, b'vllm:num_requests_running{m="x"} 2\nvllm:kv_cache_usage_perc 0.25\n')
    t.answers["http://e1/health"] = (503, b"")
    await pool.probe_all()
    e0, e1 = pool.state("e0"), pool.state("e1")
    assert e0.healthy and e0.compute_utilisation == 0.5 and e0.memory_utilisation == 0.25
    assert not e1.healthy and pool.available_ids() == ["e0"]
    t.answers["http://e1/health"] = UpstreamFailure("e1", "connect", "refused")
    assert await pool.probe("e1") is False  # a probe never raises


async def test_accounting_tracks_queued_and_running_tokens_and_the_oldest_prefill_wait():
    pool, clock, _ = make_pool(FakeTransport())
    a = pool.acquire("e0", 100, 100)
    clock.t += 2
    b = pool.acquire("e0", 50, 50)
    st = pool.state("e0")
    assert (st.inflight, st.queued_prefill_tokens) == (2, 150)
    assert pool.oldest_prefill_wait() == {"e0": 2.0}
    a.first_token()
    a.add_tokens(3)
    assert (st.queued_prefill_tokens, st.running_tokens) == (50, 103)
    assert pool.oldest_prefill_wait() == {"e0": 0.0}
    a.release()
    b.release()
    assert (st.inflight, st.queued_prefill_tokens, st.running_tokens) == (0, 0, 0)
    assert pool.oldest_prefill_wait() == {}


# ------------------------------------------------------------------------------------------ queued transport
class FakePrefillQueue:
    """A FAKE prefill queue: ``submit`` answers the scripted reply or raises the scripted error."""

    def __init__(self, reply=None, error: BaseException | None = None) -> None:
        self.reply = reply
        self.error = error
        self.jobs: list[dict] = []
        self.closed = False
        self.waiting = 0

    async def submit(self, job, timeout_s):
        self.jobs.append(job)
        if self.error is not None:
            raise self.error
        return self.reply

    async def close(self) -> None:
        self.closed = True


def queued(queue: FakePrefillQueue, registered=lambda iid: True, **cfg) -> tuple[QueuedTransport, FakeTransport, RouterMetrics]:
    direct, metrics = FakeTransport(), RouterMetrics()
    t = QueuedTransport(direct, metrics, Clock(), registered, queue_factory=lambda c: queue)
    t.use_queue(PrefillQueueConfig(kind="nats", **cfg))
    return t, direct, metrics


PREFILL = {"prompt": "p", "max_tokens": 1, "kv_transfer_params": KV}
D = Deadline(1.0, 10.0)


async def test_a_queueable_prefill_leg_is_a_job_on_the_queue_and_its_reply_is_the_engines_answer():
    q = FakePrefillQueue(reply={"status": 200, "body": {"kv_transfer_params": {"remote_block_ids": [1]}}})
    t, direct, metrics = queued(q)
    status, raw, data = await t.post("e0", "http://e0", "/v1/completions", PREFILL, D, queueable=True)
    assert status == 200 and data == {"kv_transfer_params": {"remote_block_ids": [1]}} and json.loads(raw) == data
    assert q.jobs == [{"path": "/v1/completions", "body": PREFILL}] and direct.calls == []
    assert metric(metrics, 'fulcrum_router_prefill_jobs_total{outcome="ok"}') == 1.0


async def test_other_calls_and_calls_that_may_not_queue_go_direct():
    q = FakePrefillQueue(reply={"status": 200, "body": {}})
    t, direct, _ = queued(q)
    await t.post("e0", "http://e0", "/v1/completions", {"prompt": "p"}, D, queueable=True)  # not a prefill leg
    await t.post("e0", "http://e0", "/v1/completions", PREFILL, D, queueable=False)  # a prefix pull
    await t.post("e0", "http://e0", "/v1/completions", json.dumps(PREFILL).encode(), D, queueable=True)  # as sent
    async with t.open("e0", "http://e0", "/v1/completions", PREFILL, D):
        pass
    assert q.jobs == [] and [c[0] for c in direct.calls] == ["post", "post", "post", "open"]
    assert is_prefill_leg("/v1/chat/completions", PREFILL) and not is_prefill_leg("/tokenize", PREFILL)


async def test_a_job_failed_on_every_worker_is_a_failure_not_held_against_the_chosen_instance():
    from fulcrum.router.prefill_queue import PrefillJobError

    t, _, metrics = queued(FakePrefillQueue(error=PrefillJobError("engine said no")))
    with pytest.raises(UpstreamFailure) as err:
        await t.post("e0", "http://e0", "/v1/completions", PREFILL, D, queueable=True)
    assert err.value.cause == "status" and err.value.instance_fault is False
    assert metric(metrics, 'fulcrum_router_prefill_jobs_total{outcome="failed"}') == 1.0


async def test_a_job_refused_as_malformed_is_a_failure_the_router_does_not_retry():
    from fulcrum.router.prefill_queue import InvalidPrefillJobError

    t, _, metrics = queued(FakePrefillQueue(error=InvalidPrefillJobError("job 7: invalid prefill job: body missing")))
    with pytest.raises(UpstreamFailure, match="refused by the worker as malformed: job 7") as err:
        await t.post("e0", "http://e0", "/v1/completions", PREFILL, D, queueable=True)
    assert err.value.status == 502 and err.value.instance_fault is False and err.value.retryable is False
    assert metric(metrics, 'fulcrum_router_prefill_jobs_total{outcome="failed"}') == 1.0


async def test_no_reply_in_time_is_a_503_or_with_on_timeout_direct_the_leg_over_http_while_registered():
    from fulcrum.router.prefill_queue import PrefillTimeoutError

    t, direct, metrics = queued(FakePrefillQueue(error=PrefillTimeoutError("late")), timeout_s=3)
    with pytest.raises(NoHealthyInstance, match="no prefill worker replied within 3 s"):
        await t.post("e0", "http://e0", "/v1/completions", PREFILL, D, queueable=True)
    assert direct.calls == [] and metric(metrics, 'fulcrum_router_prefill_jobs_total{outcome="timeout"}') == 1.0

    t, direct, metrics = queued(FakePrefillQueue(error=PrefillTimeoutError("late")), on_timeout="direct")
    assert (await t.post("e0", "http://e0", "/v1/completions", PREFILL, D, queueable=True))[0] == 200
    assert [c[1] for c in direct.calls] == ["http://e0/v1/completions"]
    assert metric(metrics, 'fulcrum_router_prefill_jobs_total{outcome="direct"}') == 1.0

    t, direct, _ = queued(FakePrefillQueue(error=PrefillTimeoutError("late")), registered=lambda iid: False,
                          on_timeout="direct")
    with pytest.raises(NoHealthyInstance):
        await t.post("e0", "http://e0", "/v1/completions", PREFILL, D, queueable=True)
    assert direct.calls == []


async def test_switching_queues_returns_the_old_one_and_close_closes_the_queue_and_the_direct_transport():
    q = FakePrefillQueue()
    t, direct, _ = queued(q)
    assert t.queue is q
    assert t.use_queue(PrefillQueueConfig(kind="direct")) is q and t.queue is None
    t.use_queue(PrefillQueueConfig(kind="nats"))
    await t.close()
    assert q.closed and direct.closed
