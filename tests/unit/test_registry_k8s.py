"""The Kubernetes instance registry against a FAKE Kubernetes API server (aiohttp on 127.0.0.1).

The fake serves ``GET /apis/discovery.k8s.io/v1/namespaces/<ns>/endpointslices`` as a list (with a
resourceVersion) and, with ``?watch=true``, as a stream of watch events the test pushes; it can be switched
"down" (500 answers, open watches cut). The real ``kubernetes`` client talks to it through a
``kubernetes.client.Configuration(host=...)``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("kubernetes")
pytest_asyncio = pytest.importorskip("pytest_asyncio")
web = pytest.importorskip("aiohttp.web")

import kubernetes  # noqa: E402

from fulcrum.router.config import parse_config  # noqa: E402
from fulcrum.router.registry_k8s import KubernetesRegistry, KubernetesRegistryError, records_from_slice  # noqa: E402

pytestmark = pytest.mark.asyncio

NS = "serving"
SELECTOR = "fulcrum.dev/llmserve=llama"


def endpoint_slice(name: str, pods: dict[str, bool | None], *, role: str = "decode", pool: str | None = "decode-tp2",
                   tp: str = "2", port_name: str = "http", port: int = 8000, rv: str = "1") -> dict[str, Any]:
    """An EndpointSlice object as the API serves it; ``pods`` maps pod name → ready (None = condition absent)."""
    labels = {"kubernetes.io/service-name": f"svc-{name}", "fulcrum.dev/llmserve": "llama",
              "fulcrum.dev/role": role, "fulcrum.dev/tp": tp}
    if pool is not None:
        labels["fulcrum.dev/pool"] = pool
    endpoints = []
    for i, (pod, ready) in enumerate(pods.items()):
        ep: dict[str, Any] = {"addresses": [f"10.0.{len(name)}.{i + 1}"], "targetRef": {"kind": "Pod", "name": pod},
                              "conditions": {} if ready is None else {"ready": ready}}
        endpoints.append(ep)
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": name, "namespace": NS, "labels": labels, "resourceVersion": rv},
            "ports": [{"name": port_name, "port": port, "protocol": "TCP"}], "endpoints": endpoints}


class FakeKubeAPI:
    """A FAKE Kubernetes API: EndpointSlice list and watch in one namespace, driven by the test."""

    def __init__(self) -> None:
        self.items: dict[str, dict[str, Any]] = {}
        self.rv = 1
        self.down = False
        self.watch_ends_at_once = False
        self.watch_always_gone = False
        self.lists = 0
        self.watches = 0
        self.selectors: list[str] = []
        self._subscribers: list[asyncio.Queue[dict[str, Any] | None]] = []
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices", self._handle)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        self.cut_watches()
        assert self.runner is not None
        await self.runner.cleanup()

    def configuration(self) -> Any:
        cfg = kubernetes.client.Configuration(host=f"http://127.0.0.1:{self.port}")
        cfg.retries = 0  # let failures reach the registry at once (its own backoff retries)
        return cfg

    def put(self, obj: dict[str, Any], kind: str | None = None) -> None:
        """Create or replace an object and send the event to open watches (``kind`` overrides the event type)."""
        self.rv += 1
        obj = json.loads(json.dumps(obj))
        if isinstance(obj.get("metadata"), dict):
            obj["metadata"]["resourceVersion"] = str(self.rv)
        name = obj.get("metadata", {}).get("name", f"bad-{self.rv}")
        event = kind or ("MODIFIED" if name in self.items else "ADDED")
        self.items[name] = obj
        self._send({"type": event, "object": obj})

    def delete(self, name: str) -> None:
        self.rv += 1
        obj = self.items.pop(name)
        self._send({"type": "DELETED", "object": obj})

    def send_raw(self, event: dict[str, Any]) -> None:
        self._send(event)

    def cut_watches(self) -> None:
        for q in self._subscribers:
            q.put_nowait(None)

    def _send(self, event: dict[str, Any]) -> None:
        for q in self._subscribers:
            q.put_nowait(event)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if self.down:
            return web.json_response({"kind": "Status", "code": 500, "message": "fake API is down"}, status=500)
        self.selectors.append(request.query.get("labelSelector", ""))
        if request.query.get("watch") != "true":
            self.lists += 1
            return web.json_response({"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                                      "metadata": {"resourceVersion": str(self.rv)},
                                      "items": list(self.items.values())})
        self.watches += 1
        if self.watch_ends_at_once:  # an API server (or a proxy before it) that closes each watch at once
            return web.Response(body=b"", content_type="application/json")
        if self.watch_always_gone:  # every watch answered 410 at once, even from a fresh list's version
            gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old"}}
            return web.Response(body=json.dumps(gone).encode() + b"\n", content_type="application/json")
        q: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._subscribers.append(q)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        try:
            while (event := await q.get()) is not None:
                await resp.write(json.dumps(event).encode() + b"\n")
        finally:
            self._subscribers.remove(q)
        return resp


@pytest_asyncio.fixture
async def api():
    fake = FakeKubeAPI()
    await fake.start()
    yield fake
    await fake.stop()


class Follower:
    """Consumes ``registry.watch()`` in a task like the router does, keeping every list yielded (as ids)."""

    def __init__(self, registry: KubernetesRegistry) -> None:
        self.registry = registry
        self.seen: list[list[Any]] = []
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for records in self.registry.watch():
            self.seen.append(records)

    @property
    def last(self) -> list[Any]:
        return self.seen[-1] if self.seen else []

    async def stop(self) -> None:
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task
        await self.registry.close()


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def make_registry(api: FakeKubeAPI, **kw: Any) -> KubernetesRegistry:
    return KubernetesRegistry(NS, SELECTOR, configuration=api.configuration(), backoff_initial_s=0.02,
                              backoff_max_s=0.05, request_timeout_s=2.0, watch_timeout_s=30, **kw)


async def test_a_snapshot_lists_ready_endpoints_with_role_pool_and_tp_from_the_labels(api):
    api.put(endpoint_slice("decode", {"d-0": True, "d-1": False, "d-2": None}))
    api.put(endpoint_slice("prefill", {"p-0": True}, role="prefill", pool=None, tp="4", port=9000))
    reg = make_registry(api)
    try:
        got = await reg.snapshot()
    finally:
        await reg.close()
    assert [r.id for r in got] == ["d-0", "d-2", "p-0"]  # d-1 is not ready; absent condition means ready
    d0, _, p0 = got
    assert (d0.role, d0.pool, d0.tp, d0.url) == ("decode", "decode-tp2", 2, "http://10.0.6.1:8000")
    assert (p0.role, p0.pool, p0.tp, p0.url) == ("prefill", "svc-prefill", 4, "http://10.0.7.1:9000")
    assert api.selectors == [SELECTOR]


async def test_endpoints_appear_become_not_ready_and_disappear_through_the_watch(api):
    api.put(endpoint_slice("decode", {"d-0": True}))
    f = Follower(make_registry(api))
    try:
        await until(lambda: [r.id for r in f.last] == ["d-0"])
        await until(lambda: api.watches == 1)
        api.put(endpoint_slice("decode", {"d-0": True, "d-1": True}))  # a new pod is ready
        await until(lambda: [r.id for r in f.last] == ["d-0", "d-1"])
        api.put(endpoint_slice("prefill", {"p-0": True}, role="prefill", pool="prefill-tp1", tp="1"))
        await until(lambda: [r.id for r in f.last] == ["d-0", "d-1", "p-0"])
        assert f.last[2].role == "prefill" and f.last[2].pool == "prefill-tp1"
        api.put(endpoint_slice("decode", {"d-0": False, "d-1": True}))  # d-0 fails its readiness probe
        await until(lambda: [r.id for r in f.last] == ["d-1", "p-0"])
        api.delete("prefill")  # the prefill Service goes
        await until(lambda: [r.id for r in f.last] == ["d-1"])
        n = len(f.seen)
        api.send_raw({"type": "BOOKMARK", "object": {"kind": "EndpointSlice", "metadata": {"resourceVersion": "99"}}})
        api.put(endpoint_slice("decode", {"d-0": False, "d-1": True}))  # no change in ready endpoints
        await asyncio.sleep(0.2)
        assert len(f.seen) == n  # only changes are yielded
        assert api.lists == 1  # everything came through one watch
    finally:
        await f.stop()


async def test_malformed_slices_and_events_are_skipped_without_failing_the_watch(api):
    api.put(endpoint_slice("good", {"g-0": True}))
    api.put(endpoint_slice("noport", {"x-0": True}, port_name="metrics"))
    api.put(endpoint_slice("badrole", {"x-1": True}, role="kv_producer"))
    api.put(endpoint_slice("badtp", {"x-2": True}, tp="two"))
    api.items["noname"] = {"kind": "EndpointSlice", "metadata": {}, "endpoints": "nope"}
    f = Follower(make_registry(api))
    try:
        await until(lambda: [r.id for r in f.last] == ["g-0"])
        await until(lambda: api.watches == 1)
        api.send_raw({"type": "ADDED", "object": "not an object"})
        api.send_raw({"type": "ADDED", "object": {"metadata": {"name": "weird"}, "ports": 5, "endpoints": [7]}})
        api.put(endpoint_slice("good", {"g-0": True, "g-1": True}))
        await until(lambda: [r.id for r in f.last] == ["g-0", "g-1"])
        api.put(endpoint_slice("good", {"g-0": True}, tp="-1"))  # overwritten with garbage: its endpoints go
        await until(lambda: f.last == [])
        assert api.lists == 1 and api.watches == 1
    finally:
        await f.stop()
    with pytest.raises(ValueError, match="no port named"):
        records_from_slice(endpoint_slice("s", {"a": True}), port_name="grpc")


async def test_while_the_api_is_down_the_last_list_is_kept_and_it_resyncs_when_back(api):
    api.put(endpoint_slice("decode", {"d-0": True, "d-1": True}))
    reg = make_registry(api)
    f = Follower(reg)
    try:
        await until(lambda: [r.id for r in f.last] == ["d-0", "d-1"])
        await until(lambda: api.watches == 1)
        api.down = True
        api.cut_watches()
        await until(lambda: api.lists == 1 and not api._subscribers)
        await asyncio.sleep(0.3)  # several failed relists with backoff
        assert [r.id for r in f.last] == ["d-0", "d-1"] and len(f.seen) == 1 and not f.task.done()
        with pytest.raises(KubernetesRegistryError, match="could not be listed"):
            await reg.snapshot()
        api.items["decode"] = endpoint_slice("decode", {"d-1": True, "d-2": True})  # changed while down
        api.down = False
        await until(lambda: [r.id for r in f.last] == ["d-1", "d-2"])
        await until(lambda: api.watches == 2)
        api.put(endpoint_slice("decode", {"d-2": True}))  # and watched again
        await until(lambda: [r.id for r in f.last] == ["d-2"])
    finally:
        await f.stop()


async def test_an_expired_resource_version_relists(api):
    api.put(endpoint_slice("decode", {"d-0": True}))
    f = Follower(make_registry(api))
    try:
        await until(lambda: api.watches == 1 and len(f.seen) == 1)
        api.items["decode"] = endpoint_slice("decode", {"d-5": True})
        api.send_raw({"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old"}})
        await until(lambda: [r.id for r in f.last] == ["d-5"])
        assert api.lists == 2
    finally:
        await f.stop()


async def test_watches_that_end_at_once_are_reopened_with_backoff_not_in_a_tight_loop(api):
    api.put(endpoint_slice("decode", {"d-0": True}))
    api.watch_ends_at_once = True
    f = Follower(make_registry(api))  # backoff 0.02 s doubling to 0.05 s
    try:
        await until(lambda: len(f.seen) == 1 and api.watches >= 1)
        start = api.watches
        await asyncio.sleep(0.5)
        assert api.watches - start <= 25, api.watches - start  # at most one per initial backoff delay
        api.watch_ends_at_once = False
        api.cut_watches()
        await until(lambda: len(api._subscribers) == 1, timeout=2.0)
        api.put(endpoint_slice("decode", {"d-0": True, "d-1": True}))  # a working watch again: events flow
        await until(lambda: [r.id for r in f.last] == ["d-0", "d-1"])
    finally:
        await f.stop()


async def test_a_410_on_every_watch_relists_with_backoff_not_in_a_tight_loop(api):
    api.put(endpoint_slice("decode", {"d-0": True}))
    api.watch_always_gone = True
    f = Follower(make_registry(api))  # backoff 0.02 s doubling to 0.05 s
    try:
        await until(lambda: len(f.seen) == 1 and api.lists >= 1)
        start = api.lists
        await asyncio.sleep(0.5)
        assert api.lists - start <= 25, api.lists - start  # at most one relist per initial backoff delay
        api.watch_always_gone = False
        await until(lambda: len(api._subscribers) == 1, timeout=2.0)
        api.put(endpoint_slice("decode", {"d-0": True, "d-1": True}))
        await until(lambda: [r.id for r in f.last] == ["d-0", "d-1"])
    finally:
        await f.stop()


async def test_an_unreachable_api_never_raises_into_the_watcher():
    cfg = kubernetes.client.Configuration(host="http://127.0.0.1:9")  # nothing listens on the discard port
    cfg.retries = 0
    reg = KubernetesRegistry(NS, SELECTOR, configuration=cfg, backoff_initial_s=0.01, backoff_max_s=0.02,
                             request_timeout_s=1.0)
    f = Follower(reg)
    await asyncio.sleep(0.2)
    assert f.seen == [] and not f.task.done()
    await f.stop()


async def test_registry_kubernetes_is_configured_from_the_router_config():
    cfg = parse_config({"registry": "kubernetes",
                        "kubernetes": {"namespace": NS, "label_selector": SELECTOR, "port_name": "api"}})
    assert cfg.kubernetes.namespace == NS and cfg.kubernetes.port_name == "api"
    assert cfg.kubernetes.role_label == "fulcrum.dev/role"
