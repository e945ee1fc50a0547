"""The operator's Kubernetes adapter against a FAKE Kubernetes API at the HTTP layer (tests/fakes/fake_kube_api.py).

What is tested here is what the adapter does in Kubernetes: objects applied, replicas reverted, Events, status
conditions, metrics, the drain protocol through the router ConfigMap and pod-deletion cost, kopf wiring. The
control loop's own rules (hold when blind, the external replica owner, drain before scale-in, the planner the spec
names) are tested on the in-memory cluster (tests/unit/test_control_loop.py).

The handler methods of :class:`fulcrum.controller.handlers.Controller` are called directly (the kopf wrappers
only forward to them; ``test_kopf_*`` checks the wiring); every Kubernetes call goes through the real
``kubernetes`` client over HTTP to the fake. Prometheus is faked at the query-client seam (canned PromQL
answers) except where it is down (a real closed port). Time is injected: no test sleeps.
"""

from __future__ import annotations

import asyncio
import copy
import socket
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

pytest.importorskip("kopf")
pytest.importorskip("kubernetes")

from kubernetes import config as kconfig

from fakes.fake_kube_api import FakeKubeApi
from fulcrum.controller.apply import KubeClient
from fulcrum.cluster import Cluster, ObservationError
from fulcrum.controller.handlers import Controller, ControllerSettings, KubernetesCluster, register
from fulcrum.target import Pool
from fulcrum.controller.metrics import OperatorMetrics
from fulcrum.controller.observe import ALL_QUERIES

pytestmark = pytest.mark.asyncio

NS = "default"
NAME = "llama"
POD_LABELS = {"app.kubernetes.io/name": "fulcrum", "fulcrum.dev/llmserve": NAME,
              "app.kubernetes.io/component": "worker"}


def llmserve(**spec_over: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"name": "tiny"},
        "engine": {"kind": "sim"},
        "mode": "Disaggregated",
        "scaling": {"intervalSeconds": 10, "cooldownSeconds": 0, "podStartupSeconds": 0, "maxStep": 4,
                    "drainTimeoutSeconds": 30},
        "profile": {"name": "dopd-llama70b-fp8-h100"},
    }
    spec.update(spec_over)
    return {"apiVersion": "fulcrum.dev/v1alpha1", "kind": "LLMServe",
            "metadata": {"name": NAME, "namespace": NS, "generation": 1}, "spec": spec}


class FakePrometheus:
    """FAKE Prometheus query client: canned answers per series (requests/s, tokens)."""

    def __init__(self, rate: float, isl: float = 1000.0, osl: float = 150.0, interval_s: float = 10.0) -> None:
        self.rate, self.isl, self.osl, self.interval_s = rate, isl, osl, interval_s
        self.queries: list[str] = []

    def custom_query(self, query: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        self.queries.append(query)
        n = self.rate * self.interval_s

        def one(v: float) -> list[dict[str, Any]]:
            return [{"metric": {}, "value": [0, str(v)]}]

        if "_bucket" in query:
            return []
        if "requests_admitted" in query or "input_tokens_count" in query or "predicted_output_tokens_count" in query:
            return one(n)
        if "input_tokens_sum" in query:
            return one(n * self.isl)
        if "output_tokens_count" in query:
            return one(0.0)
        if "predicted_output_tokens_sum" in query:
            return one(n * self.osl)
        return one(0.0)


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def api() -> Iterator[FakeKubeApi]:
    a = FakeKubeApi().start()
    yield a
    a.stop()


@pytest.fixture
def kube(api: FakeKubeApi, tmp_path: Any) -> KubeClient:
    client = kconfig.new_client_from_config(config_file=str(api.kubeconfig(tmp_path / "kubeconfig")))
    return KubeClient(client, backoff_s=0.001, max_backoff_s=0.002, sleep=lambda s: None)


def make_controller(kube: KubeClient, prom: Any = None, *, url: str | None = "http://prom.invalid",
                    clock: Clock | None = None, sleep: Any = None) -> Controller:
    clock = clock or Clock()
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)

    async def no_sleep(s: float) -> None:
        clock.t += s
        await asyncio.sleep(0)

    return Controller(kube, ControllerSettings(image="fulcrum:test", prometheus_url=url, drain_poll_s=1.0),
                      metrics=OperatorMetrics(), prometheus=(lambda _u: prom) if prom is not None else None,
                      clock=clock, monotonic=clock, sleep=sleep or no_sleep,
                      now=lambda: t0 + timedelta(seconds=clock.t - 1_000_000.0))


def seed(api: FakeKubeApi, body: dict[str, Any] | None = None) -> dict[str, Any]:
    return api.put("llmserves", copy.deepcopy(body or llmserve()))


def live(api: FakeKubeApi) -> dict[str, Any]:
    got = api.get("llmserves", NS, NAME)
    assert got is not None
    return got


def cond(body: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in body["status"]["conditions"] if c["type"] == type_)


def child_writes(api: FakeKubeApi) -> list[str]:
    return [f"{r.method} {r.path}" for r in api.writes() if "/llmserves/" not in r.path]


def events(api: FakeKubeApi, reason: str | None = None) -> list[dict[str, Any]]:
    return [e for e in api.list("events", NS) if reason is None or e["reason"] == reason]


async def test_a_new_llmserve_gets_its_pools_router_and_a_ready_status(api: FakeKubeApi, kube: KubeClient) -> None:
    seed(api)
    c = make_controller(kube)
    assert await c.reconcile(live(api)) is True
    names = {d["metadata"]["name"] for d in api.list("deployments", NS)}
    assert names == {"llama-prefill", "llama-decode", "llama-router"}
    assert {s["metadata"]["name"] for s in api.list("configmaps", NS)} == {"llama-router"}
    applies = [r for r in api.requests if r.method == "PATCH" and "/deployments/" in r.path]
    assert applies and all(r.query == {"fieldManager": "fulcrum-operator", "force": "true"} for r in applies)
    assert all(r.content_type.startswith("application/apply-patch+yaml") for r in applies)
    dep = api.get("deployments", NS, "llama-prefill")
    assert dep is not None and dep["metadata"]["ownerReferences"][0]["kind"] == "LLMServe"
    st = live(api)["status"]
    assert st["pools"]["prefill"] == {"ready": 1, "desired": 1, "tp": 1}
    assert st["observedGeneration"] == 1 and st["replicas"] == 2
    assert "fulcrum.dev/llmserve=llama" in st["selector"]
    assert cond(live(api), "Ready")["status"] == "True"
    assert cond(live(api), "ForecastReady")["status"] == "False"


async def test_a_second_reconcile_of_the_same_spec_writes_no_object(api: FakeKubeApi, kube: KubeClient) -> None:
    seed(api)
    c = make_controller(kube)
    await c.reconcile(live(api))
    first = len(child_writes(api))
    writes_before = c.applier.writes
    await c.reconcile(live(api))
    assert first == 10 and len(child_writes(api)) == first
    assert c.applier.writes == writes_before


async def test_a_hand_edit_of_pool_replicas_is_reverted_at_the_next_pass_with_one_event(
        api: FakeKubeApi, kube: KubeClient) -> None:
    seed(api)
    c = make_controller(kube)
    await c.reconcile(live(api))
    dep = api.get("deployments", NS, "llama-decode")
    assert dep is not None
    dep["spec"]["replicas"] = 7
    api.put("deployments", dep)
    await c.reconcile(live(api))
    assert api.get("deployments", NS, "llama-decode")["spec"]["replicas"] == 1  # type: ignore[index]
    reverted = events(api, "ReplicasReverted")
    assert len(reverted) == 1 and "7" in reverted[0]["message"]
    await c.reconcile(live(api))
    assert len(events(api, "ReplicasReverted")) == 1


async def test_conflicts_and_server_errors_are_retried_until_the_apply_succeeds(
        api: FakeKubeApi, kube: KubeClient) -> None:
    seed(api)
    api.fail("PATCH", "/deployments/llama-decode", 409, times=2)
    api.fail("GET", "/services/", 503, times=1)
    api.fail("PATCH", "/configmaps/", 500, times=1)
    c = make_controller(kube)
    assert await c.reconcile(live(api)) is True
    assert api.get("deployments", NS, "llama-decode") is not None
    assert kube.retries == 4
    statuses = [r.status for r in api.requests if "/deployments/llama-decode" in r.path and r.method == "PATCH"]
    assert statuses == [409, 409, 200]


async def test_an_invalid_spec_is_reported_as_degraded_and_nothing_is_applied(
        api: FakeKubeApi, kube: KubeClient) -> None:
    seed(api, llmserve(slo={"ttftMs": -5}))
    c = make_controller(kube)
    assert await c.reconcile(live(api)) is False
    assert child_writes(api) == []
    d = cond(live(api), "Degraded")
    assert d["status"] == "True" and d["reason"] == "InvalidSpec" and "ttftMs" in d["message"]
    assert cond(live(api), "Ready")["status"] == "False"
    assert len(events(api, "InvalidSpec")) == 1


async def test_load_scales_out_with_an_event_and_the_numbers_in_status_and_metrics(
        api: FakeKubeApi, kube: KubeClient) -> None:
    seed(api)
    prom = FakePrometheus(rate=20.0)
    clock = Clock()
    c = make_controller(kube, prom, clock=clock)
    await c.reconcile(live(api))
    clock.t += 10
    assert await c.interval(live(api)) is True
    st = live(api)["status"]
    assert st["pools"]["prefill"]["desired"] > 1
    assert st["pools"]["prefill"]["desired"] == api.get("deployments", NS, "llama-prefill")["spec"]["replicas"]  # type: ignore[index]
    assert st["forecast"]["rate"] >= 0 and st["plan"]["ratio"] > 0
    assert st["lastObservation"]["rate"] == pytest.approx(20.0)
    outs = events(api, "ScaledOut")
    assert outs and all("→" in e["message"] for e in outs)
    assert cond(live(api), "Degraded")["status"] == "False"
    m = c.metrics.registry
    assert m.get_sample_value("fulcrum_operator_planned_instances", {"llmserve": "default/llama", "pool": "prefill"}) \
        == st["pools"]["prefill"]["desired"]
    assert m.get_sample_value("fulcrum_operator_scale_events_total",
                              {"llmserve": "default/llama", "pool": "prefill", "direction": "out"}) == 1.0
    assert any("fulcrum_router_requests_admitted_total" in q for q in prom.queries)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_prometheus_down_holds_the_pools_and_reports_degraded_once(api: FakeKubeApi, kube: KubeClient) -> None:
    seed(api)
    clock = Clock()
    c = make_controller(kube, FakePrometheus(rate=20.0), clock=clock)
    await c.reconcile(live(api))
    clock.t += 10
    await c.interval(live(api))
    before = {p: v["desired"] for p, v in live(api)["status"]["pools"].items()}
    down = make_controller(kube, None, url=f"http://127.0.0.1:{_closed_port()}", clock=clock)
    for _ in range(4):  # more than the scale-in window: blind intervals never scale in
        clock.t += 10
        await down.interval(live(api))
    st = live(api)["status"]
    assert {p: v["desired"] for p, v in st["pools"].items()} == before
    d = cond(live(api), "Degraded")
    assert d["status"] == "True" and d["reason"] == "ObservationUnavailable" and "Prometheus" in d["message"]
    assert len(events(api, "ObservationUnavailable")) == 1
    assert events(api, "ScaledIn") == []


async def _scale_out_to(api: FakeKubeApi, c: Controller, clock: Clock, prom: FakePrometheus) -> dict[str, Any]:
    await c.reconcile(live(api))
    clock.t += 10
    await c.interval(live(api))
    return live(api)["status"]["pools"]


async def _scale_in(api: FakeKubeApi, kube: KubeClient, *, requests_finish: bool) -> tuple[int, int, int, list[str]]:
    """Scale out under load, give the pods loads, drop the load until a scale-in; (mark, n, new n, victims)."""
    seed(api)
    prom = FakePrometheus(rate=20.0)
    clock = Clock()
    c = make_controller(kube, prom, clock=clock)
    pools = await _scale_out_to(api, c, clock, prom)
    n = pools["prefill"]["desired"]
    assert n >= 3
    labels = {**POD_LABELS, "fulcrum.dev/pool": "prefill"}
    for i in range(n):
        api.add_pod(f"llama-prefill-{i}", labels, running=5.0, waiting=1.0)
    api.pod_loads["llama-prefill-1"] = (0.0, 0.0)  # the idle one
    api.pod_loads["llama-prefill-2"] = (1.0, 0.0)  # almost idle: drained, and waited for
    prom.rate = 0.05
    mark = len(api.requests)

    async def sleep(s: float) -> None:  # while the operator waits, the in-flight requests finish (or not)
        clock.t += s
        if requests_finish:
            for pod in api.pod_loads:
                api.pod_loads[pod] = (0.0, 0.0)

    c.sleep = sleep
    for _ in range(6):
        clock.t += 10
        await c.interval(live(api))
        await c.settle("default/llama")  # drains run in the background; this one has ended
        if events(api, "ScaledIn"):
            break
    ins = events(api, "ScaledIn")
    assert ins, "expected a scale-in"
    new_n = live(api)["status"]["pools"]["prefill"]["desired"]
    assert new_n < n
    pods = {p["metadata"]["name"] for p in api.list("pods", NS)}
    removed = {f"llama-prefill-{i}" for i in range(n)} - pods
    loads = {"llama-prefill-1": 0.0, "llama-prefill-2": 1.0}
    expected = sorted((f"llama-prefill-{i}" for i in range(n)), key=lambda p: (loads.get(p, 6.0), p))[: n - new_n]
    assert removed == set(expected) and {"llama-prefill-1", "llama-prefill-2"} <= removed
    return mark, n, new_n, expected


async def test_scale_in_drains_the_least_loaded_pods_before_lowering_replicas(api: FakeKubeApi, kube: KubeClient) -> None:
    mark, n, new_n, expected = await _scale_in(api, kube, requests_finish=True)
    # order: router config lists the victims, then the deletion cost, then replicas drop, then the list is cleared
    log = [r for r in api.requests[mark:] if r.method == "PATCH" and r.status < 300]
    cm = [i for i, r in enumerate(log) if "/configmaps/llama-router" in r.path]
    cost = [i for i, r in enumerate(log) if "/pods/" in r.path]
    scale = [i for i, r in enumerate(log) if "/deployments/llama-prefill" in r.path]
    assert cm and cost and scale
    marked = max(i for i in cm if i < cost[0])
    assert marked < cost[0] < scale[-1] < cm[-1]
    assert "draining:\n" + "".join(f"- {p}\n" for p in sorted(expected)) in log[marked].body["data"]["router.yaml"]
    assert "draining" not in log[cm[-1]].body["data"]["router.yaml"]
    assert all(r.query.get("fieldManager") == "fulcrum-operator-drain" and "force" not in r.query
               for r in (log[i] for i in cost))
    assert live(api)["status"]["draining"] == []
    assert cond(live(api), "Degraded")["status"] == "False"


async def test_a_restarted_operator_converges_from_status_without_rewriting(api: FakeKubeApi, kube: KubeClient) -> None:
    seed(api)
    clock = Clock()
    c = make_controller(kube, FakePrometheus(rate=20.0), clock=clock)
    pools = await _scale_out_to(api, c, clock, FakePrometheus(rate=20.0))
    writes = len(child_writes(api))
    restarted = make_controller(kube, FakePrometheus(rate=20.0), clock=clock)
    await restarted.reconcile(live(api))
    assert len(child_writes(api)) == writes
    assert {p: (v["desired"], v["tp"]) for p, v in live(api)["status"]["pools"].items()} == \
        {p: (v["desired"], v["tp"]) for p, v in pools.items()}
    t = restarted.runtimes["default/llama"].loop.current
    assert t.prefill.replicas == pools["prefill"]["desired"] and t.decode.replicas == pools["decode"]["desired"]


async def test_a_deleted_llmserve_ends_its_loop_cleanly(api: FakeKubeApi, kube: KubeClient) -> None:
    seed(api)
    clock = Clock()
    c = make_controller(kube, FakePrometheus(rate=1.0), clock=clock)
    await c.reconcile(live(api))
    body = live(api)
    with api._lock:
        del api.objects[("llmserves", NS, NAME)]
    clock.t += 10
    assert await c.interval(body) is False
    assert await c.deleted(body) == []  # every child is owned by the LLMServe: the garbage collector takes them
    assert "default/llama" not in c.runtimes
    cm = api.get("configmaps", NS, "llama-router")
    assert cm is not None
    cm["metadata"]["ownerReferences"] = []
    api.put("configmaps", cm)
    assert await c.deleted(body) == ["ConfigMap/llama-router"]


async def test_kopf_registry_holds_the_change_daemon_and_delete_handlers(kube: KubeClient) -> None:
    import kopf

    registry = kopf.OperatorRegistry()
    register(registry, make_controller(kube))
    ids = {h.id for h in registry._spawning.get_all_handlers()} | {h.id for h in registry._changing.get_all_handlers()}
    assert {"control-loop", "reconcile", "forget"} <= ids


async def test_a_drain_that_times_out_is_reported_and_the_scale_in_still_happens(
        api: FakeKubeApi, kube: KubeClient) -> None:
    _, n, new_n, expected = await _scale_in(api, kube, requests_finish=False)
    timeouts = events(api, "DrainTimeout")
    assert len(timeouts) == 1 and timeouts[0]["type"] == "Warning"
    d = cond(live(api), "Degraded")
    assert d["status"] == "True" and "drain timed out" in d["message"]
    assert new_n < n


async def test_a_kopf_operator_run_reconciles_and_runs_an_interval_against_the_fake_api(
        api: FakeKubeApi, kube: KubeClient, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Smoke run of the whole kopf operator (discovery, list, watch, handlers, daemon) for a few seconds."""
    import kopf

    body = llmserve()
    body["spec"]["scaling"]["intervalSeconds"] = 1
    seed(api, body)
    monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path / "kopf-kubeconfig")))
    clock = Clock()
    c = make_controller(kube, FakePrometheus(rate=20.0), clock=clock)
    registry = kopf.OperatorRegistry()
    register(registry, c)
    stop = asyncio.Event()
    task = asyncio.create_task(kopf.operator(registry=registry, namespaces=[NS], standalone=True, stop_flag=stop))
    try:
        for _ in range(100):
            await asyncio.sleep(0.1)
            st = (api.get("llmserves", NS, NAME) or {}).get("status") or {}
            if "lastObservation" in st:
                break
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
    st = live(api)["status"]
    assert {d["metadata"]["name"] for d in api.list("deployments", NS)} >= {"llama-prefill", "llama-decode"}
    assert "lastObservation" in st and st["pools"]["prefill"]["desired"] > 1


async def test_an_unreachable_tpot_target_is_reported_once_and_the_plan_stays_under_the_gpu_cap(
        api: FakeKubeApi, kube: KubeClient) -> None:
    body = llmserve(slo={"ttftMs": 5000, "tpotMs": 80})
    body["spec"]["scaling"].update(maxGPUs=32)
    seed(api, body)
    # 12,000-token prompts, 1,000 output tokens: one request's decode step on Table I's TP=2 is ~80.2 ms
    prom = FakePrometheus(rate=0.5, isl=12000.0, osl=1000.0)
    clock = Clock()
    c = make_controller(kube, prom, clock=clock)
    await c.reconcile(live(api))
    for _ in range(2):
        clock.t += 10
        await c.interval(live(api))
    st = live(api)["status"]
    feasible = cond(live(api), "SLOFeasible")
    assert feasible["status"] == "False" and feasible["reason"] == "TPOTInfeasible"
    assert "TPOT target 80 ms cannot be met" in feasible["message"]
    assert st["plan"]["sloInfeasible"][0]["metric"] == "tpot" and st["plan"]["sloInfeasible"][0]["bestSeconds"] > 0.08
    assert st["plan"]["gpus"] < 32
    warnings = events(api, "SLOInfeasible")
    assert len(warnings) == 1 and warnings[0]["type"] == "Warning" and "maxGPUs=32" in warnings[0]["message"]
    prom.isl, prom.osl = 1000.0, 150.0  # the long prompts are gone: in reach again, once the forecast follows
    for _ in range(30):
        clock.t += 10
        await c.interval(live(api))
        if cond(live(api), "SLOFeasible")["status"] == "True":
            break
    assert cond(live(api), "SLOFeasible")["reason"] == "Feasible"
    assert len(events(api, "SLOFeasible")) == 1 and len(events(api, "SLOInfeasible")) == 1


async def test_an_external_replica_owner_gets_its_total_split_by_the_planned_ratio(
        api: FakeKubeApi, kube: KubeClient) -> None:
    body = llmserve()
    body["spec"]["scaling"].update(replicaOwner="External", replicas=5)
    seed(api, body)
    clock = Clock()
    c = make_controller(kube, FakePrometheus(rate=20.0), clock=clock)
    await c.reconcile(live(api))
    p, d = (api.get("deployments", NS, f"llama-{x}")["spec"]["replicas"] for x in ("prefill", "decode"))  # type: ignore[index]
    assert p + d == 5 and p >= 1 and d >= 1
    clock.t += 10
    await c.interval(live(api))  # heavy load: the total stays the external one
    pools = live(api)["status"]["pools"]
    assert pools["prefill"]["desired"] + pools["decode"]["desired"] >= 5  # a pool that shrinks drains first
    await c.settle("default/llama")  # the drain wrote the status when it ended
    pools = live(api)["status"]["pools"]
    assert pools["prefill"]["desired"] + pools["decode"]["desired"] == 5
    assert live(api)["status"]["plan"]["ratio"] > 1  # the split follows the planned P/D ratio
    assert pools["prefill"]["desired"] >= pools["decode"]["desired"]


async def test_a_switch_to_unified_mode_replaces_the_pools_and_deletes_the_old_ones(
        api: FakeKubeApi, kube: KubeClient) -> None:
    seed(api, llmserve(profile={"name": "splitwise-llama2-70b-h100"}))
    c = make_controller(kube)
    await c.reconcile(live(api))
    body = live(api)
    body["spec"]["mode"] = "Unified"
    body["metadata"]["generation"] = 2
    api.put("llmserves", body)
    await c.reconcile(live(api))
    names = {d["metadata"]["name"] for d in api.list("deployments", NS)}
    assert names == {"llama-unified", "llama-router"}
    assert {s["metadata"]["name"] for s in api.list("services", NS)} == {"llama-unified", "llama-router"}
    assert live(api)["status"]["pools"]["unified"]["desired"] >= 1
    assert live(api)["status"]["pools"]["prefill"]["desired"] == live(api)["status"]["pools"]["decode"]["desired"] == 0
    assert live(api)["status"]["observedGeneration"] == 2


@pytest.mark.parametrize("argv, message", [
    (["--prometheus-url", "prometheus:9090"], "must start with http"),
    (["--kubeconfig", "/nonexistent/kubeconfig"], "no such file"),
    (["--metrics-port", "70000"], "must be in 0..65535"),
])
async def test_fulcrum_operator_rejects_bad_flags_with_one_line_and_exit_2(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from fulcrum.cli import main

    assert main(["operator", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


async def test_operator_wide_connectors_fill_an_empty_spec_and_never_override_one(
        api: FakeKubeApi, kube: KubeClient) -> None:
    import yaml

    seed(api)
    c = Controller(kube, ControllerSettings(image="fulcrum:test", prometheus_url=None, drain_poll_s=1.0,
                                            default_etcd="etcd.fulcrum:2379", default_nats="nats://nats:4222"),
                   metrics=OperatorMetrics())
    assert await c.reconcile(live(api)) is True
    router = yaml.safe_load(api.get("configmaps", NS, "llama-router")["data"]["router.yaml"])
    assert router["registry"] == "etcd" and router["etcd"]["endpoint"] == "etcd.fulcrum:2379"
    prefill = api.get("deployments", NS, "llama-prefill")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert prefill[prefill.index("--etcd") + 1] == "etcd.fulcrum:2379"
    # the spec's own connector wins
    body = llmserve()
    body["spec"]["connectors"] = {"etcd": "my-etcd:2379"}
    assert c._parse(body).spec.connectors.etcd == "my-etcd:2379"


class FakePrometheusWithHistory(FakePrometheus):
    """FAKE Prometheus that also answers range queries: the same load in every past interval."""

    def __init__(self, rate: float, **kw: Any) -> None:
        super().__init__(rate, **kw)
        self.ranges: list[tuple[float, float, str]] = []

    def custom_query_range(self, query: str, start_time: datetime, end_time: datetime, step: str,
                           params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        self.ranges.append((start_time.timestamp(), end_time.timestamp(), step))
        answer = self.custom_query(query)
        if not answer:
            return []
        t0, t1, dt = start_time.timestamp(), end_time.timestamp(), float(step.removesuffix("s"))
        times = [t0 + k * dt for k in range(int(round((t1 - t0) / dt)) + 1)]
        return [{"metric": answer[0]["metric"], "values": [[t, answer[0]["value"][1]] for t in times]}]


async def test_an_operator_restart_forecasts_from_the_history_prometheus_kept(api: FakeKubeApi, kube: KubeClient) -> None:
    seed(api)
    clock = Clock()
    cold = make_controller(kube, FakePrometheus(rate=20.0), clock=clock)  # no range queries: starts cold
    await cold.reconcile(live(api))
    clock.t += 10
    await cold.interval(live(api))
    assert cond(live(api), "ForecastReady")["status"] == "False"

    prom = FakePrometheusWithHistory(rate=20.0)
    restarted = make_controller(kube, prom, clock=clock)  # a new operator process: a new loop, no history
    clock.t += 10
    await restarted.interval(live(api))
    assert cond(live(api), "ForecastReady")["status"] == "True"
    start, end, step = prom.ranges[0]
    assert (end, step) == (clock.t - 10, "10s") and end - start == 10 * 63  # 64 intervals, the newest a step ago
    n = len(prom.ranges)
    assert 1 < n <= len(ALL_QUERIES)  # one range query per template, for all 64 intervals at once
    clock.t += 10
    await restarted.interval(live(api))
    assert len(prom.ranges) == n  # warmed once per loop, not every interval


async def _drain_in_flight(api: FakeKubeApi, kube: KubeClient) -> tuple[Controller, FakePrometheus, Clock, int]:
    """Scale out under load with busy pods, drop the load until a prefill drain starts; the clock stands still
    while the drain polls, so it stays in flight until the test frees the pods or the plan stops it."""
    seed(api)
    prom = FakePrometheus(rate=20.0)
    clock = Clock()
    c = make_controller(kube, prom, clock=clock)
    n = (await _scale_out_to(api, c, clock, prom))["prefill"]["desired"]
    for i in range(n):
        api.add_pod(f"llama-prefill-{i}", {**POD_LABELS, "fulcrum.dev/pool": "prefill"}, running=5.0, waiting=1.0)

    async def sleep(s: float) -> None:
        await asyncio.sleep(0.002)

    c.sleep = sleep
    prom.rate = 0.05
    rt = c.runtimes["default/llama"]
    for _ in range(6):
        clock.t += 10
        await c.interval(live(api))
        if "prefill" in rt.drains:
            break
    assert "prefill" in rt.drains, "expected a prefill drain"
    # let it mark its pods: until the router's config lists them (the API writes run in threads; on a busy machine
    # a fixed 40 ms was sometimes too short)
    deadline = time.monotonic() + 30
    while not ((marked := [p for p in rt.draining if p.startswith("llama-prefill-")])
               and all(f"- {p}" in _router_yaml(api) for p in marked)):
        assert time.monotonic() < deadline, "the drain never marked its pods"
        await asyncio.sleep(0.002)
    return c, prom, clock, n


def _router_yaml(api: FakeKubeApi) -> str:
    return api.get("configmaps", NS, "llama-router")["data"]["router.yaml"]  # type: ignore[index,no-any-return]


async def test_a_drain_runs_in_the_background_and_the_loop_goes_on(api: FakeKubeApi, kube: KubeClient) -> None:
    c, prom, clock, n = await _drain_in_flight(api, kube)
    rt = c.runtimes["default/llama"]
    dep = lambda: api.get("deployments", NS, "llama-prefill")["spec"]["replicas"]  # type: ignore[index]  # noqa: E731
    assert dep() == n  # not lowered while its pods are busy
    victims = [p for p in rt.draining if p.startswith("llama-prefill-")]
    assert victims and all(f"- {p}" in _router_yaml(api) for p in victims)
    clock.t += 10
    assert await c.interval(live(api)) is True  # the next interval runs during the drain
    st = live(api)["status"]
    assert set(victims) <= set(st["draining"]) and cond(live(api), "Progressing")["reason"] == "Draining"
    assert st["pools"]["prefill"]["desired"] == n and dep() == n
    for pod in api.pod_loads:  # the in-flight requests finish: the drain ends by itself and says so
        api.pod_loads[pod] = (0.0, 0.0)
    await c.settle("default/llama")
    assert dep() < n and events(api, "ScaledIn")
    st = live(api)["status"]
    assert st["pools"]["prefill"]["desired"] == dep() and not [p for p in st["draining"] if p in victims]


async def test_a_burst_during_a_drain_stops_it_and_the_pods_serve_again(api: FakeKubeApi, kube: KubeClient) -> None:
    c, prom, clock, n = await _drain_in_flight(api, kube)
    rt = c.runtimes["default/llama"]
    victims = [p for p in rt.draining if p.startswith("llama-prefill-")]
    assert victims
    prom.rate = 40.0
    clock.t += 10
    await c.interval(live(api))
    assert "prefill" not in rt.drains
    assert any("prefill" in e["message"] for e in events(api, "DrainCancelled"))
    assert not any(f"- {p}" in _router_yaml(api) for p in victims)  # back in the router's rotation
    assert api.get("deployments", NS, "llama-prefill")["spec"]["replicas"] >= n  # type: ignore[index]
    assert not [p for p in live(api)["status"]["draining"] if p in victims]
    assert not [e for e in events(api, "ScaledIn") if e["message"].startswith("prefill")]
    await c.deleted(live(api))  # whatever still drains is cancelled with the LLMServe
    assert not rt.drains


async def test_a_spec_change_during_a_drain_does_not_scale_the_pool_in(api: FakeKubeApi, kube: KubeClient) -> None:
    c, prom, clock, n = await _drain_in_flight(api, kube)
    body = live(api)
    body["spec"]["slo"] = {"ttftMs": 3000, "tpotMs": 80}
    body["metadata"]["generation"] = 2
    api.put("llmserves", body)
    assert await c.reconcile(live(api)) is True
    assert api.get("deployments", NS, "llama-prefill")["spec"]["replicas"] == n  # type: ignore[index]
    assert "prefill" in c.runtimes["default/llama"].drains  # the drain goes on under the new spec
    for pod in api.pod_loads:
        api.pod_loads[pod] = (0.0, 0.0)
    await c.settle("default/llama")
    assert api.get("deployments", NS, "llama-prefill")["spec"]["replicas"] < n  # type: ignore[index]


async def test_a_drain_that_fails_is_logged_and_reported_and_the_pool_keeps_its_replicas(
        api: FakeKubeApi, kube: KubeClient, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import fulcrum.controller.handlers as handlers

    async def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("a bug in the drain")

    monkeypatch.setattr(handlers, "drain_pool", broken)
    seed(api)
    prom = FakePrometheus(rate=20.0)
    clock = Clock()
    c = make_controller(kube, prom, clock=clock)
    n = (await _scale_out_to(api, c, clock, prom))["prefill"]["desired"]
    prom.rate = 0.05
    for _ in range(6):
        clock.t += 10
        await c.interval(live(api))
        await c.settle("default/llama")
        if "drain failed" in cond(live(api), "Degraded")["message"]:
            break
    d = cond(live(api), "Degraded")
    assert d["status"] == "True" and "drain failed: RuntimeError: a bug in the drain" in d["message"]
    assert api.get("deployments", NS, "llama-prefill")["spec"]["replicas"] == n  # type: ignore[index]
    assert "drain of prefill failed unexpectedly" in caplog.text


async def test_the_kubernetes_adapter_is_a_cluster_over_the_deployments_and_prometheus(
        api: FakeKubeApi, kube: KubeClient) -> None:
    seed(api)
    prom = FakePrometheus(rate=20.0)
    clock = Clock()
    c = make_controller(kube, prom, clock=clock)
    await c.reconcile(live(api))
    rt = c.runtimes[f"{NS}/{NAME}"]
    cluster = KubernetesCluster(c, rt, live(api), asyncio.get_running_loop())
    assert isinstance(cluster, Cluster)
    ready = await asyncio.to_thread(cluster.ready)
    assert ready.prefill == api.get("deployments", NS, "llama-prefill")["status"]["readyReplicas"]  # type: ignore[index]
    obs = await asyncio.to_thread(cluster.observe, 10.0)
    assert obs.rate_rps == pytest.approx(20.0) and obs.ready == ready
    bigger = rt.applied.with_replicas(Pool.PREFILL, rt.applied.prefill.replicas + 2)
    await asyncio.to_thread(cluster.apply, bigger, "test: two more")
    assert api.get("deployments", NS, "llama-prefill")["spec"]["replicas"] == bigger.prefill.replicas  # type: ignore[index]
    assert cluster.draining() == {}
    blind = KubernetesCluster(make_controller(kube, url=None), rt, live(api), asyncio.get_running_loop())
    rt.observer = None
    with pytest.raises(ObservationError, match="no Prometheus configured"):
        blind.observe(10.0)


async def test_an_api_failing_during_an_intervals_apply_raises_from_the_interval_and_the_next_one_applies(
        api: FakeKubeApi, kube: KubeClient) -> None:
    from fulcrum.controller.apply import KubeApiError

    seed(api)
    clock = Clock()
    c = make_controller(kube, FakePrometheus(rate=20.0), clock=clock)
    await c.reconcile(live(api))
    before = api.get("deployments", NS, "llama-prefill")["spec"]["replicas"]  # type: ignore[index]
    api.fail("PATCH", "/deployments/llama-prefill", 500, times=5)  # all five attempts of the client
    clock.t += 10
    with pytest.raises(KubeApiError):
        await c.interval(live(api))  # raised in the interval's thread, re-raised here (the daemon logs it)
    assert api.get("deployments", NS, "llama-prefill")["spec"]["replicas"] == before  # type: ignore[index]
    clock.t += 10
    assert await c.interval(live(api)) is True
    assert api.get("deployments", NS, "llama-prefill")["spec"]["replicas"] > before  # type: ignore[index]
