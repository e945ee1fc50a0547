"""The router's prefill legs through the NATS JetStream prefill queue (DOPD §V-C), against a REAL nats-server.

The engines are FAKE (tests/fakes/fake_engine.py: a pure function of the token sequence, KV kept per transfer and
loaded by engine id), so identical text with every KV loaded and none mismatched means each job ran on some
prefill engine and the decode engine continued on that engine's KV. The prefill pullers are the real
``fulcrum.router.prefill_queue`` code: in-process tasks (``run_prefill_worker``) or, where one must die mid-job,
a separate process (``python -m fulcrum.router.prefill_queue``) killed with SIGKILL.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

pytest.importorskip("nats", reason="nats-py is not installed (pip install nats-py)")
pytest.importorskip("aiohttp")

from aiohttp.test_utils import TestClient, TestServer  # noqa: E402

from fakes.fake_engine import FakeCluster, FakeEngine, FakeEngineSettings, fake_chat_ids, fake_encode, fake_next_token  # noqa: E402
from fakes.fake_policy import FakePolicy  # noqa: E402
from fakes.sse_client import answer_text, parse_stream  # noqa: E402
from fulcrum.router.app import ROUTER, create_app  # noqa: E402
from fulcrum.router.config import parse_config  # noqa: E402
from fulcrum.routing.base import Policy  # noqa: E402
from fulcrum.routing.disaggregated import DisaggregatedPolicy  # noqa: E402
from fulcrum.router.prefill_queue import NatsPrefillQueue, run_prefill_worker  # noqa: E402

from .servers import NatsServer, free_port, nats_server  # noqa: E402,F401  (nats_server is a fixture)

pytestmark = pytest.mark.asyncio

BS = 16


def expected(prompt_ids: list[int], n: int) -> str:
    seq = list(prompt_ids)
    for _ in range(n):
        seq.append(fake_next_token(seq))
    return bytes(seq[len(prompt_ids):]).decode()


class Setup:
    """Fake engines p0, p1 (role prefill) and d0 (decode) in one cluster, a router over them, and pullers."""

    def __init__(self, nats: NatsServer, test: str) -> None:
        self.nats = nats
        self.layout = {"stream": f"R_{test.upper()}", "subject_prefix": f"router.{test}"}
        self.cluster = FakeCluster()
        self.engines: dict[str, FakeEngine] = {}
        self.client: TestClient[Any, Any] | None = None
        self.stops: list[asyncio.Event] = []
        self.pullers: list[asyncio.Task[None]] = []

    async def start(self, policy: Policy, *, queue: dict[str, Any] | None = None,
                    prefill_delay_s: float = 0.0) -> "Setup":
        for iid in ("p0", "p1", "d0"):
            settings = FakeEngineSettings(block_size=BS, prefill_delay_s=prefill_delay_s if iid != "d0" else 0.0)
            eng = FakeEngine(settings, self.cluster, engine_id=iid)
            await eng.start()
            self.engines[iid] = eng
        cfg = {
            "model": "fake-model", "kv_block_size": BS,
            "instances": [{"id": "p0", "url": self.engines["p0"].url, "role": "prefill"},
                          {"id": "p1", "url": self.engines["p1"].url, "role": "prefill"},
                          {"id": "d0", "url": self.engines["d0"].url, "role": "decode"}],
            "timeouts": {"connect_s": 1.0, "first_token_s": 20.0, "idle_s": 20.0, "request_s": 30.0},
            "max_retries": 0,
            "prefill_queue": {"kind": "nats", "url": self.nats.url, **self.layout, "timeout_s": 15.0,
                              "ack_wait_s": 1.0, "depth_interval_s": 0.1, **(queue or {})},
        }
        app = create_app(parse_config(cfg), policy_factory=lambda name, params: policy, health_checks=False)
        self.client = TestClient(TestServer(app, handler_cancellation=True))
        await self.client.start_server()
        return self

    def puller(self, iid: str, **kwargs: Any) -> None:
        """A prefill puller in this process for engine ``iid``."""
        stop = asyncio.Event()
        self.stops.append(stop)
        self.pullers.append(asyncio.create_task(run_prefill_worker(
            self.nats.url, self.engines[iid].url, **self.layout, ack_wait_s=1.0, worker_id=iid, stop=stop,
            **kwargs)))

    async def metric(self, name: str) -> float:
        assert self.client is not None
        text = await (await self.client.get("/metrics")).text()
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    async def close(self) -> None:
        for s in self.stops:
            s.set()
        await asyncio.gather(*self.pullers)
        if self.client is not None:
            await self.client.close()
        for e in self.engines.values():
            await e.stop()


@pytest_asyncio.fixture
async def nats_router(nats_server: NatsServer, request: pytest.FixtureRequest) -> AsyncIterator[Setup]:
    s = Setup(nats_server, request.node.name.split("[")[0].removeprefix("test_")[:40])
    yield s
    await s.close()


async def ask(s: Setup, body: dict[str, Any], stream: bool) -> tuple[int, str, dict[str, Any] | None]:
    assert s.client is not None
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    req = dict(body, stream=stream)
    if stream:
        req["stream_options"] = {"include_usage": True}
    r = await s.client.post(path, json=req)
    if r.status != 200:
        return r.status, await r.text(), None
    if stream:
        text, usage, _, done_once = parse_stream(await r.read())
        assert done_once
        return 200, text, usage
    data = await r.json()
    return 200, answer_text(data), data["usage"]


async def test_disaggregated_requests_through_the_queue_give_the_direct_tokens_and_use_both_pullers(nats_router: Setup) -> None:
    s = await nats_router.start(DisaggregatedPolicy(), prefill_delay_s=0.05)
    s.puller("p0", concurrency=1)
    s.puller("p1", concurrency=1)
    prompts = [f"request number {i}: the quick brown fox jumps over the lazy dog" for i in range(8)]
    bodies = [{"prompt": p, "max_tokens": 12} for p in prompts[:6]]
    bodies += [{"messages": [{"role": "user", "content": p}], "max_tokens": 12} for p in prompts[6:]]
    results = await asyncio.gather(*(ask(s, b, stream=i % 2 == 0) for i, b in enumerate(bodies)))
    for body, (status, text, usage) in zip(bodies, results):
        assert status == 200, text
        ids = fake_encode(body["prompt"]) if "prompt" in body else fake_chat_ids(body["messages"])
        assert text == expected(ids, 12)
        assert usage is not None and usage["completion_tokens"] == 12 and usage["prompt_tokens"] == len(ids)
    p0, p1, d0 = s.engines["p0"], s.engines["p1"], s.engines["d0"]
    # every prefill ran once on some puller's engine, with max_tokens 1 and do_remote_decode; both pullers worked
    assert len(p0.requests) + len(p1.requests) == 8
    assert p0.requests and p1.requests
    for r in p0.requests + p1.requests:
        assert r["max_tokens"] == 1 and r["stream"] is False and r["kv_transfer_params"]["do_remote_decode"] is True
    # the decode engine continued every request on transferred KV
    assert d0.kv_loads == 8 and d0.kv_mismatches == 0 and not d0.crashed
    assert await s.metric('fulcrum_router_prefill_jobs_total{outcome="ok"}') == 8
    assert await s.metric("fulcrum_router_prefill_jobs_waiting") == 0


async def test_a_split_a_leg_goes_through_the_queue_and_b_continues_on_its_kv(nats_router: Setup) -> None:
    s = await nats_router.start(FakePolicy("split", 3, pair=("p0", "d0")))
    s.puller("p1")  # the only puller: the job runs on p1 although the policy chose p0
    prompt = [(7 * i + 3) % 200 + 32 for i in range(40)]
    for stream in (False, True):
        status, text, usage = await ask(s, {"prompt": prompt, "max_tokens": 20}, stream)
        assert status == 200, text
        assert text == expected(prompt, 20)
        assert usage == {"prompt_tokens": 40, "completion_tokens": 20, "total_tokens": 60}
    p0, p1, d0 = s.engines["p0"], s.engines["p1"], s.engines["d0"]
    assert p0.requests == [] and len(p1.requests) == 2
    assert all(r["max_tokens"] == 4 for r in p1.requests)  # k + 1 tokens on A
    assert d0.kv_loads == 2 and d0.kv_mismatches == 0
    assert all(len(r["prompt"]) == 43 for r in d0.requests)  # B continues from prompt + k tokens


async def test_the_queue_depth_metric_counts_jobs_no_puller_has_taken(nats_router: Setup) -> None:
    s = await nats_router.start(DisaggregatedPolicy())
    requests = [asyncio.create_task(ask(s, {"prompt": f"waiting {i} for a prefill worker", "max_tokens": 4}, False))
                for i in range(3)]
    deadline = time.monotonic() + 5
    while await s.metric("fulcrum_router_prefill_queue_depth") != 3:
        assert time.monotonic() < deadline, "the depth gauge never showed the 3 waiting jobs"
        await asyncio.sleep(0.05)
    assert await s.metric("fulcrum_router_prefill_jobs_waiting") == 3
    s.puller("p0")  # a prefill instance appears: it simply starts pulling, no router change
    results = await asyncio.gather(*requests)
    assert [r[0] for r in results] == [200, 200, 200]
    deadline = time.monotonic() + 5
    while await s.metric("fulcrum_router_prefill_queue_depth") != 0:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)


async def test_without_a_puller_the_router_answers_503_with_the_reason_after_the_timeout(nats_router: Setup) -> None:
    s = await nats_router.start(DisaggregatedPolicy(), queue={"timeout_s": 1.0})
    started = time.monotonic()
    status, text, _ = await ask(s, {"prompt": "nobody will prefill this prompt", "max_tokens": 4}, False)
    elapsed = time.monotonic() - started
    assert status == 503
    assert "no prefill worker replied within 1 s" in text and "service_unavailable" in text
    assert 0.9 < elapsed < 5.0, elapsed
    assert await s.metric('fulcrum_router_prefill_jobs_total{outcome="timeout"}') == 1
    assert all(not e.requests for e in s.engines.values())  # nothing ran anywhere
    # the job was withdrawn: a puller that starts now does not prefill it for nobody
    q = NatsPrefillQueue(s.nats.url, **s.layout, ack_wait_s=1.0)
    assert await q.depth() == 0
    await q.close()


async def test_on_timeout_direct_falls_back_to_the_chosen_prefill_instance_over_http(nats_router: Setup) -> None:
    s = await nats_router.start(DisaggregatedPolicy(), queue={"timeout_s": 0.5, "on_timeout": "direct"})
    prompt = "no puller, so the router prefills over http"
    status, text, _ = await ask(s, {"prompt": prompt, "max_tokens": 6}, True)
    assert status == 200 and text == expected(fake_encode(prompt), 6)
    assert len(s.engines["p0"].requests) + len(s.engines["p1"].requests) == 1
    assert s.engines["d0"].kv_loads == 1 and s.engines["d0"].kv_mismatches == 0
    assert await s.metric('fulcrum_router_prefill_jobs_total{outcome="direct"}') == 1


async def test_a_job_whose_puller_dies_mid_prefill_is_redelivered_and_the_request_completes(nats_router: Setup) -> None:
    s = await nats_router.start(FakePolicy("disaggregated", pair=("p0", "d0")))
    s.engines["p0"].settings.prefill_delay_s = 30.0  # the doomed puller's engine: the job is in hand for long
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fulcrum.router.prefill_queue", "--nats", s.nats.url, "--engine", s.engines["p0"].url,
        "--stream", s.layout["stream"], "--subject-prefix", s.layout["subject_prefix"], "--ack-wait-s", "1",
        "--concurrency", "1", "--worker-id", "doomed", "--log-level", "warning",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )
    prompt = "the puller holding this job will be killed"
    try:
        request = asyncio.create_task(ask(s, {"prompt": prompt, "max_tokens": 8}, True))
        deadline = time.monotonic() + 20
        while not s.engines["p0"].active:  # the doomed puller took the job and its engine is prefilling
            assert time.monotonic() < deadline, "the subprocess puller never took the job"
            assert not request.done(), request
            await asyncio.sleep(0.02)
        proc.kill()  # dies holding the job: no reply, no ack, no more heartbeats
        await proc.wait()
        killed = time.monotonic()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    s.puller("p1")
    status, text, _ = await asyncio.wait_for(request, 15)
    assert status == 200, text
    assert text == expected(fake_encode(prompt), 8)
    assert time.monotonic() - killed < 6.0  # redelivered after ack_wait (1 s), not after the router's timeout
    assert len(s.engines["p1"].requests) == 1  # the survivor ran the redelivered job
    assert s.engines["d0"].kv_loads == 1 and s.engines["d0"].kv_mismatches == 0
    st = s.client.app[ROUTER] if s.client is not None else None
    assert st is not None and st.pool is not None and sum(st.pool.state(i).inflight for i in st.pool.ids()) == 0


async def test_an_unreachable_nats_is_a_503_naming_the_prefill_queue(nats_router: Setup) -> None:
    nats_router.nats = type("Nowhere", (), {"url": f"nats://127.0.0.1:{free_port()}"})()  # type: ignore[assignment]
    s = await nats_router.start(DisaggregatedPolicy(), queue={"connect_timeout_s": 0.5, "timeout_s": 2.0})
    status, text, _ = await ask(s, {"prompt": "no nats server here", "max_tokens": 4}, False)
    assert status == 503 and "the prefill queue is unavailable" in text and "cannot connect to NATS" in text
    assert await s.metric('fulcrum_router_prefill_jobs_total{outcome="unavailable"}') == 1
    assert all(not e.requests for e in s.engines.values())


async def test_a_config_reload_switches_prefill_legs_between_direct_and_the_queue_live(nats_router: Setup) -> None:
    s = await nats_router.start(DisaggregatedPolicy(), queue={"kind": "direct"})
    assert s.client is not None
    st = s.client.app[ROUTER]
    prefills = lambda: len(s.engines["p0"].requests) + len(s.engines["p1"].requests)  # noqa: E731

    assert (await ask(s, {"prompt": "first, over http", "max_tokens": 3}, False))[0] == 200
    assert prefills() == 1 and await s.metric('fulcrum_router_prefill_jobs_total{outcome="ok"}') == 0

    st.apply_config(st.config.model_copy(update={"prefill_queue": st.config.prefill_queue.model_copy(update={"kind": "nats"})}))
    s.puller("p0")
    status, text, _ = await ask(s, {"prompt": "then through the queue", "max_tokens": 3}, False)
    assert status == 200 and text == expected(fake_encode("then through the queue"), 3)
    assert prefills() == 2 and await s.metric('fulcrum_router_prefill_jobs_total{outcome="ok"}') == 1

    st.apply_config(st.config.model_copy(update={"prefill_queue": st.config.prefill_queue.model_copy(update={"kind": "direct"})}))
    assert (await ask(s, {"prompt": "and over http again", "max_tokens": 3}, False))[0] == 200
    assert prefills() == 3 and await s.metric('fulcrum_router_prefill_jobs_total{outcome="ok"}') == 1
    assert s.engines["d0"].kv_loads == 3 and s.engines["d0"].kv_mismatches == 0


async def test_a_puller_whose_engine_fails_leaves_the_job_to_another_and_pauses_until_healthy(
    nats_router: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="fulcrum.router.prefill_queue")
    s = await nats_router.start(FakePolicy("disaggregated", pair=("p0", "d0")))
    sick = s.engines["p0"]
    port = sick.port
    await sick.stop()  # connections refused, /health fails
    s.puller("p0", ready_interval_s=0.1, wait_for_engine=False)
    await asyncio.sleep(0.3)  # the sick puller is pulling alone
    request = asyncio.create_task(ask(s, {"prompt": "the first engine is failing", "max_tokens": 5}, False))
    deadline = time.monotonic() + 10
    while not any("pausing until the engine is healthy" in m for m in caplog.messages):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    s.puller("p1")
    status, text, _ = await asyncio.wait_for(request, 15)
    assert status == 200 and text == expected(fake_encode("the first engine is failing"), 5)
    failures = [m for m in caplog.messages if m.startswith("prefill worker p0: job") and "failed on delivery" in m]
    assert len(failures) == 1, failures  # the sick puller did not take the job again
    assert len(s.engines["p1"].requests) == 1

    # healthy again: the paused puller resumes; with the other puller gone it serves the next request
    await sick.start(port)
    s.stops[1].set()
    await s.pullers[1]
    status, _, _ = await ask(s, {"prompt": "served by the recovered engine", "max_tokens": 5}, False)
    assert status == 200 and len(sick.requests) == 1
