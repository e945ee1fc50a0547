"""Failures on FAKE engines: ejection and retry, slow and dead instances, client disconnects abort upstream work."""

from __future__ import annotations

import asyncio
import io

import pytest

aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("pytest_asyncio")

from fakes.fake_engine import FakeEngineSettings  # noqa: E402
from fakes.fake_policy import FakePolicy  # noqa: E402
from fakes.sse_client import parse_stream  # noqa: E402

pytestmark = pytest.mark.asyncio

BODY = {"prompt": [5, 6, 7, 8], "max_tokens": 4}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def until(cond, timeout=3.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(0.01)


def ejections(h, iid, cause):
    line = f'fulcrum_router_ejections_total{{cause="{cause}",instance="{iid}"}}'
    for row in h.state.metrics.exposition().decode().splitlines():
        if row.startswith(line):
            return float(row.rsplit(" ", 1)[1])
    return 0.0


async def test_a_refusing_instance_is_ejected_and_the_request_retried_elsewhere(router_harness):
    h = await router_harness()
    await h.engine("e0").stop()
    for _ in range(6):
        r = await h.client.post("/v1/completions", json=BODY)
        assert r.status == 200
    assert ejections(h, "e0", "connect") == 1.0
    assert h.engine("e1").finished == 6
    # after the ejection the policy sees e0 unhealthy and stops choosing it
    assert not [v for v in h.policy.seen[-1] if v.id == "e0"][0].healthy


async def test_consecutive_5xx_eject_after_the_configured_count_and_each_is_retried(router_harness):
    h = await router_harness(config={"eject_after_failures": 2})
    h.engine("e0").mode = "error500"
    statuses = [(await h.client.post("/v1/completions", json=BODY)).status for _ in range(6)]
    assert statuses == [200] * 6
    assert ejections(h, "e0", "status") == 1.0


async def test_a_hung_instance_times_out_is_ejected_and_its_work_aborted(router_harness):
    h = await router_harness(config={"timeouts": {"first_token_s": 0.3, "request_s": 0.3, "connect_s": 1}})
    h.engine("e0").mode = "hang"
    for stream in (True, False):
        h.policy._turn = iter(range(0, 100, 2))  # both requests start on e0
        r = await h.client.post("/v1/completions", json=dict(BODY, stream=stream))
        assert r.status == 200
        if stream:
            _, _, _, done = parse_stream(await r.read())
            assert done
        h.state.pool.state("e0").ejected_until = 0.0  # let the second request try e0 again
    assert ejections(h, "e0", "timeout") == 2.0
    await until(lambda: h.engine("e0").aborted == 2 and not h.engine("e0").active)


async def test_an_instance_dying_mid_stream_ends_the_stream_with_an_error_and_the_router_lives_on(router_harness):
    h = await router_harness(n=2, policy=FakePolicy("colocated"))
    h.engine("e0").mode = "die_mid_stream"
    h.engine("e0").die_after_tokens = 3
    r = await h.client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 10, "stream": True})
    assert r.status == 200
    raw = await r.read()
    text, _, chunks, done = parse_stream(raw)
    assert done and len(text) == 3
    assert chunks[-1]["error"]["type"] == "upstream_error"
    assert ejections(h, "e0", "broken") == 1.0
    # the next requests are served by the surviving instance
    for _ in range(3):
        assert (await h.client.post("/v1/completions", json=BODY)).status == 200
    assert h.router_inflight() == 0


async def test_a_dead_worker_does_not_take_the_router_down(router_harness):
    h = await router_harness(n=3)
    await h.engine("e1").stop()
    h.engine("e2").mode = "die_mid_stream"
    results = await asyncio.gather(*(h.client.post("/v1/completions", json=BODY) for _ in range(30)))
    assert all(r.status in (200, 502) for r in results)
    assert sum(r.status == 200 for r in results) >= 20
    assert (await h.client.get("/health")).status == 200
    assert h.router_inflight() == 0


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_disconnect_aborts_the_upstream_request(router_harness, stream):
    h = await router_harness(n=1, settings=FakeEngineSettings(token_delay_s=0.02))
    eng = h.engine("e0")
    url = str(h.client.make_url("/v1/completions"))
    async with aiohttp.ClientSession() as s:
        if stream:
            async with s.post(url, json={"prompt": [1, 2], "max_tokens": 500, "stream": True}) as r:
                await r.content.readline()  # the first event arrived: the engine is generating
        else:
            with pytest.raises(asyncio.TimeoutError):
                async with s.post(url, json={"prompt": [1, 2], "max_tokens": 500},
                                  timeout=aiohttp.ClientTimeout(total=0.3)) as r:
                    await r.read()
    await until(lambda: eng.aborted == 1 and not eng.active and h.router_inflight() == 0)
    assert eng.finished == 0
    assert h.router_tokens() == (0, 0)
    assert b"fulcrum_router_client_aborts_total 1.0" in h.state.metrics.exposition()


async def test_a_client_disconnect_during_a_split_aborts_engine_a(router_harness):
    h = await router_harness(policy=FakePolicy("split", 50, pair=("e0", "e1")),
                             settings=FakeEngineSettings(token_delay_s=0.02))
    url = str(h.client.make_url("/v1/completions"))
    async with aiohttp.ClientSession() as s:
        with pytest.raises(asyncio.TimeoutError):
            async with s.post(url, json={"prompt": [1, 2], "max_tokens": 200, "stream": True},
                              timeout=aiohttp.ClientTimeout(total=0.3)) as r:
                await r.read()
    await until(lambda: h.engine("e0").aborted == 1 and h.engines_active() == 0 and h.router_inflight() == 0)
    assert h.engine("e1").started == 0


async def test_ejection_backs_off_exponentially_and_a_passing_probe_readmits(router_harness):
    clock = Clock()
    h = await router_harness(clock=clock, config={"eject_base_s": 1.0, "eject_max_s": 3.0})
    pool = h.state.pool
    pool.eject("e0", "test")
    assert pool.state("e0").ejected_until == clock.t + 1.0
    clock.t += 1.0
    pool.eject("e0", "test")
    assert pool.state("e0").ejected_until == clock.t + 2.0
    clock.t += 2.0
    pool.eject("e0", "test")
    assert pool.state("e0").ejected_until == clock.t + 3.0  # capped
    assert "e0" not in pool.available_ids()
    h.engine("e0").healthy = False
    clock.t += 3.0
    assert not await pool.probe("e0")  # still failing its health check: stays out
    assert "e0" not in pool.available_ids()
    h.engine("e0").healthy = True
    clock.t += 10.0
    assert await pool.probe("e0")
    assert "e0" in pool.available_ids()
    assert pool.state("e0").compute_utilisation == 0.0  # scraped from the fake's /metrics


async def test_the_policy_is_told_when_each_request_starts_and_finishes(router_harness):
    h = await router_harness()
    for _ in range(3):
        await h.client.post("/v1/completions", json=BODY)
    assert len(h.policy.started) == 3
    assert [rid for rid, _ in h.policy.started] == h.policy.finished


async def test_a_policy_that_raises_does_not_fail_the_request(router_harness):
    class Broken(FakePolicy):
        def route(self, req, instances, now):
            raise RuntimeError("bug in a policy")

    h = await router_harness(policy=Broken())
    r = await h.client.post("/v1/completions", json=BODY)
    assert r.status == 200
    assert b'reason="policy-error"' in h.state.metrics.exposition()


async def test_a_failure_that_is_not_retryable_is_a_502_at_once_not_routed_again(router_harness, monkeypatch):
    # a prefill job every worker refuses as malformed (InvalidPrefillJobError → retryable False): another route
    # would resubmit the same job, so the router answers at once instead of spending max_retries
    from fulcrum.router.upstream import UpstreamFailure

    h = await router_harness()
    calls: list[str] = []

    async def refuse(iid, base, path, body, deadline, *, queueable=False):
        calls.append(iid)
        raise UpstreamFailure(iid, "status", "prefill job refused by the worker as malformed: body missing", 502,
                              instance_fault=False, retryable=False)

    monkeypatch.setattr(h.state.pool.transport, "post", refuse)
    monkeypatch.setattr(h.state.pool.transport, "open", None)  # a route through open() would fail loudly
    r = await h.client.post("/v1/completions", json=dict(BODY, stream=False))
    assert r.status == 502
    assert "refused by the worker as malformed" in (await r.json())["error"]["message"]
    assert len(calls) == 1
    assert h.engine("e0").finished == h.engine("e1").finished == 0


def metric(h, line):
    """The value of one exposition line (``name{labels}``), 0 when absent."""
    for row in h.state.metrics.exposition().decode().splitlines():
        if row.startswith(line + " "):
            return float(row.rsplit(" ", 1)[1])
    return 0.0


def responses(h, status, endpoint="completions"):
    return metric(h, f'fulcrum_router_responses_total{{endpoint="{endpoint}",status="{status}"}}')


async def drop_from_registry(h, *ids):
    """Once engine A (e0) is working on the request, the registry drops ``ids`` (their pods went away)."""
    await until(lambda: h.engine("e0").active)
    records = await h.state.registry.snapshot()
    h.state.registry.replace([r for r in records if r.id not in ids])
    await until(lambda: not any(i in h.state.pool for i in ids))


@pytest.mark.parametrize("kind", ["disaggregated", "split"])
async def test_an_instance_leaving_the_registry_mid_request_is_routed_around(router_harness, kind):
    # the policy chose (e0, e1); e1 leaves the registry while e0 works on the request: B's leg finds it gone,
    # which is not e1's fault (nothing recorded against it) and is routed again like a failed connection
    h = await router_harness(n=3, policy=FakePolicy(kind, 2, pair=("e0", "e1")),
                             settings=FakeEngineSettings(prefill_delay_s=0.3))
    post = asyncio.create_task(h.client.post("/v1/completions", json=BODY))
    await drop_from_registry(h, "e1")
    r = await post
    assert r.status == 200, await r.text()
    assert len((await r.json())["choices"][0]["text"]) == 4
    assert h.engine("e1").started == 0
    assert len(h.policy.started) == 2  # routed again
    assert responses(h, "200") == 1.0
    assert metric(h, 'fulcrum_router_retries_total{stage="before-stream"}') == 1.0
    assert metric(h, 'fulcrum_router_upstream_errors_total{cause="connect"}') == 0.0
    assert h.router_inflight() == 0 and h.router_tokens() == (0, 0)


@pytest.mark.parametrize("stream", [True, False])
async def test_with_no_instance_left_in_the_registry_the_answer_is_a_502_with_the_reason(router_harness, stream):
    h = await router_harness(n=2, policy=FakePolicy("disaggregated", pair=("e0", "e1")),
                             settings=FakeEngineSettings(prefill_delay_s=0.3))
    post = asyncio.create_task(h.client.post("/v1/completions", json=dict(BODY, stream=stream)))
    await drop_from_registry(h, "e0", "e1")
    r = await post
    assert r.status == 502  # nothing was streamed: an error status, never a bare 500
    err = (await r.json())["error"]
    assert err["type"] == "upstream_error" and "e1 is no longer registered" in err["message"]
    assert responses(h, "502") == 1.0 and responses(h, "500") == 0.0


async def test_a_router_bug_is_a_502_in_openai_shape_not_a_bare_500(router_harness, monkeypatch):
    import fulcrum.router.app as app_module

    async def broken(pool, ex, iid, sink):
        raise RuntimeError("a bug in an executor")

    h = await router_harness()
    monkeypatch.setattr(app_module, "run_colocated", broken)
    r = await h.client.post("/v1/completions", json=BODY)
    assert r.status == 502 and r.content_type == "application/json"
    assert (await r.json())["error"]["type"] == "upstream_error"
    assert responses(h, "502") == 1.0
    assert len(h.policy.finished) == 1

    async def broken_mid_stream(pool, ex, iid, sink):
        await sink.send(b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n')
        raise RuntimeError("a bug after the first event")

    monkeypatch.setattr(app_module, "run_colocated", broken_mid_stream)
    r = await h.client.post("/v1/completions", json=dict(BODY, stream=True))
    assert r.status == 200
    text, _, chunks, done = parse_stream(await r.read())
    assert text == "a" and done
    assert chunks[-1]["error"]["type"] == "upstream_error"
    assert responses(h, "502") == 2.0


async def test_b_refusing_after_a_streamed_its_tokens_sends_b_message_and_counts_the_response(router_harness):
    # a split streams A's k tokens, then B answers 400 (here: its context is too small for the request)
    h = await router_harness(policy=FakePolicy("split", 3, pair=("e0", "e1")))
    h.engine("e1").settings = FakeEngineSettings(max_model_len=8)
    r = await h.client.post("/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 10, "stream": True})
    assert r.status == 200
    text, _, chunks, done = parse_stream(await r.read())
    assert len(text) == 3 and done
    err = chunks[-1]["error"]
    assert "maximum context length is 8 tokens" in err["message"]
    assert err["code"] == 400 and err["type"] == "invalid_request_error"
    assert responses(h, "400") == 1.0
    assert h.router_inflight() == 0
    # not streamed: B's 400 is relayed as is
    r = await h.client.post("/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 10})
    assert r.status == 400
    assert "maximum context length is 8 tokens" in (await r.json())["error"]["message"]
    assert responses(h, "400") == 2.0


@pytest.mark.parametrize("n, retried", [(1, 0.0), (2, 1.0)])
async def test_only_retries_actually_sent_are_counted(router_harness, n, retried):
    # max_retries 2, every instance answers 500: each is tried once; a retry that finds no instance left is none
    h = await router_harness(n=n, config={"max_retries": 2})
    for e in h.engines:
        e.mode = "error500"
    r = await h.client.post("/v1/completions", json=BODY)
    assert r.status == 502
    assert len(h.policy.started) == n
    assert metric(h, 'fulcrum_router_retries_total{stage="before-stream"}') == retried


async def test_a_body_over_the_limit_is_a_413_in_openai_shape_and_counted(router_harness):
    limit = 64 * 1024 * 1024  # the router's documented limit (docs/router.md)
    h = await router_harness()
    big = b'{"prompt": "' + b"a" * limit + b'"}'
    r = await h.client.post("/v1/completions", data=io.BytesIO(big), headers={"Content-Type": "application/json"})
    assert r.status == 413 and r.content_type == "application/json"
    err = (await r.json())["error"]
    assert err["type"] == "invalid_request_error" and str(limit) in err["message"]
    assert responses(h, "413") == 1.0
    assert h.engine("e0").started == h.engine("e1").started == 0
    assert (await h.client.post("/v1/completions", json=BODY)).status == 200
