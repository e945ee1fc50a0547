"""The operator's handler LOGIC on :class:`fulcrum.controller.objects.InMemoryObjects` (no HTTP, no API server).

What is tested here is what :class:`fulcrum.controller.handlers.Controller` decides: the objects and target a
reconcile applies, the status fields, conditions and Events of an interval, which pods a drain picks and when it
lowers the replicas, what a spec change (during a drain too), an operator restart, a deletion and an API failure
do. The control loop's own rules (hold when blind, the external replica owner, drain before scale-in, the
planner the spec names) are tested on the in-memory cluster (tests/unit/test_control_loop.py); what the
Kubernetes adapter does over HTTP (request shapes, server-side apply, idempotence, retries, 404/409, the kopf
operator as a whole) in tests/unit/test_controller_api_objects.py; the same scenarios on a real API server in
e2e/test_local_*.py.

The handler methods are called directly (the kopf wrappers only forward to them; ``test_kopf_*`` checks the
wiring). Pod ``/metrics`` are served by the controller's injected ``fetch`` from :class:`PodMetrics`;
Prometheus is faked at the query-client seam (canned PromQL answers) except where it is down (a real closed
port). Time is injected: no test sleeps.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import socket
from datetime import datetime, timedelta, timezone
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import yaml

pytest.importorskip("kopf")

from fulcrum.cluster import Cluster, ObservationError
from fulcrum.controller.apply import KubeApiError
from fulcrum.controller.drain import DELETION_COST_ANNOTATION, DRAINED_DELETION_COST
from fulcrum.controller.handlers import Controller, ControllerSettings, KubernetesCluster, register
from fulcrum.controller.metrics import OperatorMetrics
from fulcrum.controller.objects import InMemoryObjects, KubeObjects
from fulcrum.controller.observe import ALL_QUERIES
from fulcrum.target import Pool

pytestmark = pytest.mark.asyncio

NS = "default"
NAME = "llama"
KEY = f"{NS}/{NAME}"
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


class PodMetrics:
    """FAKE pod ``/metrics``: the controller's ``fetch`` answers a vLLM-like page for a worker pod added here (by
    its IP), with ``vllm:num_requests_running``/``waiting`` from :attr:`loads`, and for a router pod its
    ``fulcrum_router_instance_draining`` of every worker (1 for those its ``sees`` returns)."""

    def __init__(self) -> None:
        self.loads: dict[str, tuple[float, float]] = {}
        self._by_ip: dict[str, str] = {}
        self._routers: dict[str, Callable[[], Iterable[str]]] = {}
        self.fetched: list[str] = []

    def add_router(self, objs: InMemoryObjects, name: str, sees: Callable[[], Iterable[str]]) -> None:
        ip = f"10.0.1.{len(self._routers) + 1}"
        self._routers[ip] = sees
        objs.put({"apiVersion": "v1", "kind": "Pod",
                  "metadata": {"name": name, "namespace": NS,
                               "labels": {"fulcrum.dev/llmserve": NAME, "app.kubernetes.io/component": "router"}},
                  "spec": {"containers": [{"name": "router", "ports": [{"name": "http", "containerPort": 8080}]}]},
                  "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}})

    def add_pod(self, objs: InMemoryObjects, name: str, pool: str, *, running: float = 0.0, waiting: float = 0.0,
                ready: bool = True) -> None:
        ip = f"10.0.0.{len(self._by_ip) + 1}"
        self._by_ip[ip] = name
        self.loads[name] = (running, waiting)
        objs.put({"apiVersion": "v1", "kind": "Pod",
                  "metadata": {"name": name, "namespace": NS, "labels": {**POD_LABELS, "fulcrum.dev/pool": pool},
                               "annotations": {}},
                  "spec": {"containers": [{"name": "worker", "ports": [{"name": "http", "containerPort": 8000}]}]},
                  "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}})

    def idle(self) -> None:
        """Every in-flight request finishes."""
        for pod in self.loads:
            self.loads[pod] = (0.0, 0.0)

    async def fetch(self, url: str, timeout_s: float) -> str:
        self.fetched.append(url)
        ip = url.split("//", 1)[1].split(":", 1)[0]
        if ip in self._routers:
            seen = set(self._routers[ip]())
            return "# TYPE fulcrum_router_instance_draining gauge\n" + "".join(
                f'fulcrum_router_instance_draining{{instance="{p}"}} {int(p in seen)}\n' for p in self.loads)
        if ip not in self._by_ip:
            raise OSError(f"GET {url}: connection refused")
        running, waiting = self.loads[self._by_ip[ip]]
        return (f'vllm:num_requests_running{{model_name="m"}} {running}\n'
                f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n')


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def objs() -> InMemoryObjects:
    return InMemoryObjects()


def make_controller(objs: KubeObjects, prom: Any = None, *, url: str | None = "http://prom.invalid",
                    clock: Clock | None = None, pods: PodMetrics | None = None, **settings: Any) -> Controller:
    clock = clock or Clock()
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)

    async def no_sleep(s: float) -> None:
        clock.t += s
        await asyncio.sleep(0)

    return Controller(objs, ControllerSettings(image="fulcrum:test", prometheus_url=url, drain_poll_s=1.0, **settings),
                      metrics=OperatorMetrics(), prometheus=(lambda _u: prom) if prom is not None else None,
                      clock=clock, monotonic=clock, sleep=no_sleep, fetch=(pods or PodMetrics()).fetch,
                      now=lambda: t0 + timedelta(seconds=clock.t - 1_000_000.0))


def seed(objs: InMemoryObjects, body: dict[str, Any] | None = None) -> dict[str, Any]:
    return objs.put(copy.deepcopy(body or llmserve()))


def live(objs: InMemoryObjects) -> dict[str, Any]:
    got = objs.get("fulcrum.dev/v1alpha1", "LLMServe", NS, NAME)
    assert got is not None
    return got


def replicas(objs: InMemoryObjects, pool: str) -> int:
    return int(objs.objects[("Deployment", NS, f"{NAME}-{pool}")]["spec"]["replicas"])


def cond(body: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in body["status"]["conditions"] if c["type"] == type_)


def router_yaml(objs: InMemoryObjects) -> str:
    return str(objs.objects[("ConfigMap", NS, f"{NAME}-router")]["data"]["router.yaml"])


def names(objs: InMemoryObjects, kind: str) -> set[str]:
    return {name for (k, ns, name) in objs.objects if k == kind and ns == NS}


async def test_a_new_llmserve_gets_its_pools_router_and_a_ready_status(objs: InMemoryObjects) -> None:
    seed(objs)
    c = make_controller(objs)
    assert await c.reconcile(live(objs)) is True
    assert names(objs, "Deployment") == {"llama-prefill", "llama-decode", "llama-router"}
    assert names(objs, "ConfigMap") == {"llama-router"}
    owner = objs.objects[("Deployment", NS, "llama-prefill")]["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "LLMServe" and owner["uid"] == live(objs)["metadata"]["uid"]
    st = live(objs)["status"]
    assert st["pools"]["prefill"] == {"ready": 1, "desired": 1, "tp": 1}
    assert st["observedGeneration"] == 1 and st["replicas"] == 2
    assert "fulcrum.dev/llmserve=llama" in st["selector"]
    assert cond(live(objs), "Ready")["status"] == "True"
    assert cond(live(objs), "ForecastReady")["status"] == "False"


async def test_a_hand_edit_of_pool_replicas_is_reverted_with_one_event_per_revert(objs: InMemoryObjects) -> None:
    seed(objs)
    c = make_controller(objs)
    await c.reconcile(live(objs))
    objs.objects[("Deployment", NS, "llama-decode")]["spec"]["replicas"] = 7
    await c.reconcile(live(objs))
    assert replicas(objs, "decode") == 1
    reverted = objs.by_reason("ReplicasReverted")
    assert len(reverted) == 1 and reverted[0]["type"] == "Warning" and "7" in reverted[0]["message"]
    await c.reconcile(live(objs))
    assert len(objs.by_reason("ReplicasReverted")) == 1


async def test_an_invalid_spec_is_reported_as_degraded_and_nothing_is_applied(objs: InMemoryObjects) -> None:
    seed(objs, llmserve(slo={"ttftMs": -5}))
    c = make_controller(objs)
    assert await c.reconcile(live(objs)) is False
    assert objs.writes == 0 and names(objs, "Deployment") == set()
    d = cond(live(objs), "Degraded")
    assert d["status"] == "True" and d["reason"] == "InvalidSpec" and "ttftMs" in d["message"]
    assert cond(live(objs), "Ready")["status"] == "False"
    assert len(objs.by_reason("InvalidSpec")) == 1


async def test_load_scales_out_with_an_event_and_the_numbers_in_status_and_metrics(objs: InMemoryObjects) -> None:
    seed(objs)
    prom = FakePrometheus(rate=20.0)
    clock = Clock()
    c = make_controller(objs, prom, clock=clock)
    await c.reconcile(live(objs))
    clock.t += 10
    assert await c.interval(live(objs)) is True
    st = live(objs)["status"]
    assert st["pools"]["prefill"]["desired"] > 1
    assert st["pools"]["prefill"]["desired"] == replicas(objs, "prefill")
    assert st["forecast"]["rate"] >= 0 and st["plan"]["ratio"] > 0
    assert st["lastObservation"]["rate"] == pytest.approx(20.0)
    outs = objs.by_reason("ScaledOut")
    assert outs and all("→" in e["message"] and e["involvedObject"]["name"] == NAME for e in outs)
    assert cond(live(objs), "Degraded")["status"] == "False"
    m = c.metrics.registry
    assert m.get_sample_value("fulcrum_operator_planned_instances", {"llmserve": KEY, "pool": "prefill"}) \
        == st["pools"]["prefill"]["desired"]
    assert m.get_sample_value("fulcrum_operator_scale_events_total",
                              {"llmserve": KEY, "pool": "prefill", "direction": "out"}) == 1.0
    assert any("fulcrum_router_requests_admitted_total" in q for q in prom.queries)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_prometheus_down_holds_the_pools_and_reports_degraded_once(objs: InMemoryObjects) -> None:
    seed(objs)
    clock = Clock()
    c = make_controller(objs, FakePrometheus(rate=20.0), clock=clock)
    await c.reconcile(live(objs))
    clock.t += 10
    await c.interval(live(objs))
    before = {p: v["desired"] for p, v in live(objs)["status"]["pools"].items()}
    down = make_controller(objs, None, url=f"http://127.0.0.1:{_closed_port()}", clock=clock)
    for _ in range(4):  # more than the scale-in window: blind intervals never scale in
        clock.t += 10
        await down.interval(live(objs))
    st = live(objs)["status"]
    assert {p: v["desired"] for p, v in st["pools"].items()} == before
    d = cond(live(objs), "Degraded")
    assert d["status"] == "True" and d["reason"] == "ObservationUnavailable" and "Prometheus" in d["message"]
    assert len(objs.by_reason("ObservationUnavailable")) == 1
    assert objs.by_reason("ScaledIn") == []


async def _scale_out_to(objs: InMemoryObjects, c: Controller, clock: Clock) -> dict[str, Any]:
    await c.reconcile(live(objs))
    clock.t += 10
    await c.interval(live(objs))
    return dict(live(objs)["status"]["pools"])


def _deletion_cost(objs: InMemoryObjects, pod: str) -> int:
    return int(objs.objects[("Pod", NS, pod)]["metadata"]["annotations"].get(DELETION_COST_ANNOTATION, "0"))


async def _scale_in(objs: InMemoryObjects, *, requests_finish: bool, router_lags: bool = False,
                    pods: PodMetrics | None = None) -> tuple[Controller, int, int, list[str]]:
    """Scale out under load, give the pods loads, drop the load until a scale-in; (controller, n, new n, victims).
    One router replica reports the draining list of the router ConfigMap (or, lagging, none of it)."""
    seed(objs)
    prom = FakePrometheus(rate=20.0)
    clock = Clock()
    pods = pods or PodMetrics()
    c = make_controller(objs, prom, clock=clock, pods=pods)
    n = (await _scale_out_to(objs, c, clock))["prefill"]["desired"]
    assert n >= 3
    for i in range(n):
        pods.add_pod(objs, f"llama-prefill-{i}", "prefill", running=5.0, waiting=1.0)
    pods.add_router(objs, "llama-router-0",
                    (lambda: ()) if router_lags else (lambda: yaml.safe_load(router_yaml(objs)).get("draining") or ()))
    pods.loads["llama-prefill-1"] = (0.0, 0.0)  # the idle one
    pods.loads["llama-prefill-2"] = (1.0, 0.0)  # almost idle: drained, and waited for
    prom.rate = 0.05

    async def sleep(s: float) -> None:  # while the operator waits, the in-flight requests finish (or not)
        clock.t += s
        if requests_finish:
            pods.idle()

    c.sleep = sleep
    for _ in range(6):
        clock.t += 10
        await c.interval(live(objs))
        await c.settle(KEY)  # drains run in the background; this one has ended
        if objs.by_reason("ScaledIn"):
            break
    assert objs.by_reason("ScaledIn"), "expected a scale-in"
    new_n = live(objs)["status"]["pools"]["prefill"]["desired"]
    assert new_n < n and replicas(objs, "prefill") == new_n
    loads = {"llama-prefill-1": 0.0, "llama-prefill-2": 1.0}
    expected = sorted((f"llama-prefill-{i}" for i in range(n)), key=lambda p: (loads.get(p, 6.0), p))[: n - new_n]
    costs = {f"llama-prefill-{i}": _deletion_cost(objs, f"llama-prefill-{i}") for i in range(n)}
    assert {p for p, cost in costs.items() if cost == DRAINED_DELETION_COST} == set(expected)
    assert {"llama-prefill-1", "llama-prefill-2"} <= set(expected)
    return c, n, new_n, expected


async def test_scale_in_drains_the_least_loaded_pods_before_lowering_replicas(objs: InMemoryObjects) -> None:
    _, n, new_n, expected = await _scale_in(objs, requests_finish=True)
    assert "draining" not in router_yaml(objs)  # unmarked once the replicas dropped
    assert live(objs)["status"]["draining"] == []
    assert cond(live(objs), "Degraded")["status"] == "False"
    ins = [e for e in objs.by_reason("ScaledIn") if e["message"].startswith("prefill:")]
    assert len(ins) == 1 and f"{n}→{new_n}" in ins[0]["message"] and all(p in ins[0]["message"] for p in expected)


async def test_a_drain_waits_for_every_router_to_report_its_victims_draining(objs: InMemoryObjects) -> None:
    pods = PodMetrics()
    await _scale_in(objs, requests_finish=True, pods=pods)  # its router reloads at once: confirmed
    assert objs.by_reason("DrainUnconfirmed") == []
    assert "http://10.0.1.1:8080/metrics" in pods.fetched  # the router replica was asked


async def test_a_router_that_never_reloads_is_named_in_a_warning_and_the_scale_in_goes_on(
        objs: InMemoryObjects) -> None:
    _, n, new_n, expected = await _scale_in(objs, requests_finish=True, router_lags=True)
    lag = objs.by_reason("DrainUnconfirmed")
    assert len(lag) >= 1 and lag[0]["type"] == "Warning" and "llama-router-0" in lag[0]["message"]
    assert new_n < n and replicas(objs, "prefill") == new_n


async def test_a_drain_that_times_out_is_reported_and_the_scale_in_still_happens(objs: InMemoryObjects) -> None:
    _, n, new_n, _ = await _scale_in(objs, requests_finish=False)
    timeouts = objs.by_reason("DrainTimeout")
    assert len(timeouts) == 1 and timeouts[0]["type"] == "Warning"
    d = cond(live(objs), "Degraded")
    assert d["status"] == "True" and "drain timed out" in d["message"]
    assert new_n < n


async def test_a_restarted_operator_converges_from_status_without_rewriting(objs: InMemoryObjects) -> None:
    seed(objs)
    clock = Clock()
    c = make_controller(objs, FakePrometheus(rate=20.0), clock=clock)
    pools = await _scale_out_to(objs, c, clock)
    writes = objs.writes
    restarted = make_controller(objs, FakePrometheus(rate=20.0), clock=clock)
    await restarted.reconcile(live(objs))
    assert objs.writes == writes
    assert {p: (v["desired"], v["tp"]) for p, v in live(objs)["status"]["pools"].items()} == \
        {p: (v["desired"], v["tp"]) for p, v in pools.items()}
    t = restarted.runtimes[KEY].loop.current
    assert t.prefill.replicas == pools["prefill"]["desired"] and t.decode.replicas == pools["decode"]["desired"]


async def test_a_deleted_llmserve_ends_its_loop_cleanly(objs: InMemoryObjects) -> None:
    seed(objs)
    clock = Clock()
    c = make_controller(objs, FakePrometheus(rate=1.0), clock=clock)
    await c.reconcile(live(objs))
    body = live(objs)
    del objs.objects[("LLMServe", NS, NAME)]
    clock.t += 10
    assert await c.interval(body) is False
    assert await c.deleted(body) == []  # every child is owned by the LLMServe: the garbage collector takes them
    assert KEY not in c.runtimes
    objs.objects[("ConfigMap", NS, "llama-router")]["metadata"]["ownerReferences"] = []
    assert await c.deleted(body) == ["ConfigMap/llama-router"]
    objs.fail["list"] = KubeApiError(503, "down")
    assert await c.deleted(body) == []  # a failing API only skips the check


async def test_kopf_registry_holds_the_change_daemon_and_delete_handlers(objs: InMemoryObjects) -> None:
    import kopf

    registry = kopf.OperatorRegistry()
    register(registry, make_controller(objs))
    ids = {h.id for h in registry._spawning.get_all_handlers()} | {h.id for h in registry._changing.get_all_handlers()}
    assert {"control-loop", "reconcile", "forget"} <= ids


async def test_an_unreachable_tpot_target_is_reported_once_and_the_plan_stays_under_the_gpu_cap(
        objs: InMemoryObjects) -> None:
    body = llmserve(slo={"ttftMs": 5000, "tpotMs": 80})
    body["spec"]["scaling"].update(maxGPUs=32)
    body["spec"]["engine"] = {**body["spec"].get("engine", {}), "maxModelLen": 16384}  # 12k prompts fit the context
    seed(objs, body)
    # 12,000-token prompts, 1,000 output tokens: one request's decode step on Table I's TP=2 is ~80.2 ms
    prom = FakePrometheus(rate=0.5, isl=12000.0, osl=1000.0)
    clock = Clock()
    c = make_controller(objs, prom, clock=clock)
    await c.reconcile(live(objs))
    for _ in range(2):
        clock.t += 10
        await c.interval(live(objs))
    st = live(objs)["status"]
    feasible = cond(live(objs), "SLOFeasible")
    assert feasible["status"] == "False" and feasible["reason"] == "TPOTInfeasible"
    assert "TPOT target 80 ms cannot be met" in feasible["message"]
    assert st["plan"]["sloInfeasible"][0]["metric"] == "tpot" and st["plan"]["sloInfeasible"][0]["bestSeconds"] > 0.08
    assert st["plan"]["gpus"] < 32
    warnings = objs.by_reason("SLOInfeasible")
    assert len(warnings) == 1 and warnings[0]["type"] == "Warning" and "maxGPUs=32" in warnings[0]["message"]
    prom.isl, prom.osl = 1000.0, 150.0  # the long prompts are gone: in reach again, once the forecast follows
    for _ in range(30):
        clock.t += 10
        await c.interval(live(objs))
        if cond(live(objs), "SLOFeasible")["status"] == "True":
            break
    assert cond(live(objs), "SLOFeasible")["reason"] == "Feasible"
    assert len(objs.by_reason("SLOFeasible")) == 1 and len(objs.by_reason("SLOInfeasible")) == 1


async def test_an_external_replica_owner_gets_its_total_split_by_the_planned_ratio(objs: InMemoryObjects) -> None:
    body = llmserve()
    body["spec"]["scaling"].update(replicaOwner="External", replicas=5)
    seed(objs, body)
    clock = Clock()
    c = make_controller(objs, FakePrometheus(rate=20.0), clock=clock)
    await c.reconcile(live(objs))
    p, d = replicas(objs, "prefill"), replicas(objs, "decode")
    assert p + d == 5 and p >= 1 and d >= 1
    clock.t += 10
    await c.interval(live(objs))  # heavy load: the total stays the external one
    pools = live(objs)["status"]["pools"]
    assert pools["prefill"]["desired"] + pools["decode"]["desired"] >= 5  # a pool that shrinks drains first
    await c.settle(KEY)  # the drain wrote the status when it ended
    pools = live(objs)["status"]["pools"]
    assert pools["prefill"]["desired"] + pools["decode"]["desired"] == 5
    assert live(objs)["status"]["plan"]["ratio"] > 1  # the split follows the planned P/D ratio
    assert pools["prefill"]["desired"] >= pools["decode"]["desired"]


async def test_a_switch_to_unified_mode_replaces_the_pools_and_deletes_the_old_ones(objs: InMemoryObjects) -> None:
    seed(objs, llmserve(profile={"name": "splitwise-llama2-70b-h100"}))
    c = make_controller(objs)
    await c.reconcile(live(objs))
    body = live(objs)
    body["spec"]["mode"] = "Unified"
    body["metadata"]["generation"] = 2
    objs.put(body)
    await c.reconcile(live(objs))
    assert names(objs, "Deployment") == {"llama-unified", "llama-router"}
    assert names(objs, "Service") == {"llama-unified", "llama-router"}
    st = live(objs)["status"]
    assert st["pools"]["unified"]["desired"] >= 1
    assert st["pools"]["prefill"]["desired"] == st["pools"]["decode"]["desired"] == 0
    assert st["observedGeneration"] == 2


@pytest.mark.parametrize("argv, message", [
    (["--prometheus-url", "prometheus:9090"], "must start with http"),
    (["--kubeconfig", "/nonexistent/kubeconfig"], "no such file"),
    (["--metrics-port", "70000"], "must be in 0..65535"),
])
async def test_fulcrum_operator_rejects_bad_flags_with_one_line_and_exit_2(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from fulcrum.cli import main

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    assert main(["operator", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    # nothing configured: kopf's root handler, bound to this test's stderr, broke every later INFO record once
    # that stream was closed ("--- Logging error --- I/O operation on closed file" in CI's output)
    assert (root.handlers, root.level) == (handlers, level)


async def test_operator_wide_connectors_fill_an_empty_spec_and_never_override_one(objs: InMemoryObjects) -> None:
    import yaml

    seed(objs)
    c = make_controller(objs, url=None, default_etcd="etcd.fulcrum:2379", default_nats="nats://nats:4222")
    assert await c.reconcile(live(objs)) is True
    router = yaml.safe_load(router_yaml(objs))
    assert router["registry"] == "etcd" and router["etcd"]["endpoint"] == "etcd.fulcrum:2379"
    prefill = objs.objects[("Deployment", NS, "llama-prefill")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert prefill[prefill.index("--etcd") + 1] == "etcd.fulcrum:2379"
    # the spec's own connector wins
    body = llmserve()
    body["spec"]["connectors"] = {"etcd": "my-etcd:2379"}
    assert c._parse(body).spec.connectors.etcd == "my-etcd:2379"


async def test_a_nats_prefill_queue_may_take_the_operators_nats_and_without_any_is_an_invalid_spec(
        objs: InMemoryObjects) -> None:
    # the chart's bundled NATS (--nats-url) serves a spec that asks for the queue without a URL of its own; the
    # CRD once refused such a spec, so the operator-wide default could never be used
    import yaml

    body = llmserve()
    body["spec"]["router"] = {**body["spec"].get("router", {}), "prefillQueue": "nats"}
    seed(objs, body)
    c = make_controller(objs, url=None, default_nats="nats://nats.fulcrum:4222")
    assert await c.reconcile(live(objs)) is True
    router = yaml.safe_load(router_yaml(objs))
    assert router["prefill_queue"]["kind"] == "nats" and router["prefill_queue"]["url"] == "nats://nats.fulcrum:4222"
    prefill = objs.objects[("Deployment", NS, "llama-prefill")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert prefill[prefill.index("--nats") + 1] == "nats://nats.fulcrum:4222"

    bare = InMemoryObjects()
    seed(bare, body)
    lone = make_controller(bare, url=None)  # no URL in the spec, none given to the operator
    assert await lone.reconcile(live(bare)) is False
    assert names(bare, "Deployment") == set()
    d = cond(live(bare), "Degraded")
    assert d["reason"] == "InvalidSpec" and "router.prefillQueue nats needs a NATS URL" in d["message"]
    assert "--nats-url" in d["message"]


async def test_an_operator_restart_forecasts_from_the_history_prometheus_kept(objs: InMemoryObjects) -> None:
    seed(objs)
    clock = Clock()
    cold = make_controller(objs, FakePrometheus(rate=20.0), clock=clock)  # no range queries: starts cold
    await cold.reconcile(live(objs))
    clock.t += 10
    await cold.interval(live(objs))
    assert cond(live(objs), "ForecastReady")["status"] == "False"

    prom = FakePrometheusWithHistory(rate=20.0)
    restarted = make_controller(objs, prom, clock=clock)  # a new operator process: a new loop, no history
    clock.t += 10
    await restarted.interval(live(objs))
    assert cond(live(objs), "ForecastReady")["status"] == "True"
    start, end, step = prom.ranges[0]
    assert (end, step) == (clock.t - 10, "10s") and end - start == 10 * 63  # 64 intervals, the newest a step ago
    n = len(prom.ranges)
    assert 1 < n <= len(ALL_QUERIES)  # one range query per template, for all 64 intervals at once
    clock.t += 10
    await restarted.interval(live(objs))
    assert len(prom.ranges) == n  # warmed once per loop, not every interval


async def _drain_in_flight(objs: InMemoryObjects) -> tuple[Controller, FakePrometheus, Clock, PodMetrics, int]:
    """Scale out under load with busy pods, drop the load until a prefill drain starts; the clock stands still
    while the drain polls, so it stays in flight until the test frees the pods or the plan stops it."""
    seed(objs)
    prom = FakePrometheus(rate=20.0)
    clock = Clock()
    pods = PodMetrics()
    c = make_controller(objs, prom, clock=clock, pods=pods)
    n = (await _scale_out_to(objs, c, clock))["prefill"]["desired"]
    for i in range(n):
        pods.add_pod(objs, f"llama-prefill-{i}", "prefill", running=5.0, waiting=1.0)

    async def sleep(s: float) -> None:
        await asyncio.sleep(0.002)

    c.sleep = sleep
    prom.rate = 0.05
    rt = c.runtimes[KEY]
    for _ in range(6):
        clock.t += 10
        await c.interval(live(objs))
        if Pool.PREFILL in rt.drains:
            break
    assert Pool.PREFILL in rt.drains, "expected a prefill drain"
    for _ in range(10_000):  # let it mark its pods: until the router's config lists them
        marked = [p for p in rt.draining if p.startswith("llama-prefill-")]
        if marked and all(f"- {p}" in router_yaml(objs) for p in marked):
            break
        await asyncio.sleep(0.002)
    else:
        pytest.fail("the drain never marked its pods")
    return c, prom, clock, pods, n


async def test_a_drain_runs_in_the_background_and_the_loop_goes_on(objs: InMemoryObjects) -> None:
    c, prom, clock, pods, n = await _drain_in_flight(objs)
    rt = c.runtimes[KEY]
    assert replicas(objs, "prefill") == n  # not lowered while its pods are busy
    victims = [p for p in rt.draining if p.startswith("llama-prefill-")]
    assert victims and all(f"- {p}" in router_yaml(objs) for p in victims)
    clock.t += 10
    assert await c.interval(live(objs)) is True  # the next interval runs during the drain
    st = live(objs)["status"]
    assert set(victims) <= set(st["draining"]) and cond(live(objs), "Progressing")["reason"] == "Draining"
    assert st["pools"]["prefill"]["desired"] == n and replicas(objs, "prefill") == n
    pods.idle()  # the in-flight requests finish: the drain ends by itself and says so
    await c.settle(KEY)
    assert replicas(objs, "prefill") < n and objs.by_reason("ScaledIn")
    st = live(objs)["status"]
    assert st["pools"]["prefill"]["desired"] == replicas(objs, "prefill")
    assert not [p for p in st["draining"] if p in victims]


async def test_a_burst_during_a_drain_stops_it_and_the_pods_serve_again(objs: InMemoryObjects) -> None:
    c, prom, clock, _, n = await _drain_in_flight(objs)
    rt = c.runtimes[KEY]
    victims = [p for p in rt.draining if p.startswith("llama-prefill-")]
    assert victims
    prom.rate = 40.0
    clock.t += 10
    await c.interval(live(objs))
    assert Pool.PREFILL not in rt.drains
    assert any("prefill" in e["message"] for e in objs.by_reason("DrainCancelled"))
    assert not any(f"- {p}" in router_yaml(objs) for p in victims)  # back in the router's rotation
    assert replicas(objs, "prefill") >= n
    assert not [p for p in live(objs)["status"]["draining"] if p in victims]
    assert not [e for e in objs.by_reason("ScaledIn") if e["message"].startswith("prefill")]
    await c.deleted(live(objs))  # whatever still drains is cancelled with the LLMServe
    assert not rt.drains


async def test_a_spec_change_during_a_drain_does_not_scale_the_pool_in(objs: InMemoryObjects) -> None:
    c, _, _, pods, n = await _drain_in_flight(objs)
    body = live(objs)
    body["spec"]["slo"] = {"ttftMs": 3000, "tpotMs": 80}
    body["metadata"]["generation"] = 2
    objs.put(body)
    assert await c.reconcile(live(objs)) is True
    assert replicas(objs, "prefill") == n
    assert Pool.PREFILL in c.runtimes[KEY].drains  # the drain goes on under the new spec
    pods.idle()
    await c.settle(KEY)
    assert replicas(objs, "prefill") < n


async def test_a_drain_that_fails_is_logged_and_reported_and_the_pool_keeps_its_replicas(
        objs: InMemoryObjects, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import fulcrum.controller.handlers as handlers

    async def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("a bug in the drain")

    monkeypatch.setattr(handlers, "drain_pool", broken)
    seed(objs)
    prom = FakePrometheus(rate=20.0)
    clock = Clock()
    c = make_controller(objs, prom, clock=clock)
    n = (await _scale_out_to(objs, c, clock))["prefill"]["desired"]
    prom.rate = 0.05
    for _ in range(6):
        clock.t += 10
        await c.interval(live(objs))
        await c.settle(KEY)
        if "drain failed" in cond(live(objs), "Degraded")["message"]:
            break
    d = cond(live(objs), "Degraded")
    assert d["status"] == "True" and "drain failed: RuntimeError: a bug in the drain" in d["message"]
    assert replicas(objs, "prefill") == n
    assert "drain of prefill failed unexpectedly" in caplog.text


async def test_the_kubernetes_cluster_is_a_cluster_over_the_deployments_and_prometheus(objs: InMemoryObjects) -> None:
    seed(objs)
    c = make_controller(objs, FakePrometheus(rate=20.0))
    await c.reconcile(live(objs))
    rt = c.runtimes[KEY]
    cluster = KubernetesCluster(c, rt, live(objs), asyncio.get_running_loop())
    assert isinstance(cluster, Cluster) and isinstance(objs, KubeObjects)
    ready = await asyncio.to_thread(cluster.ready)
    assert ready.prefill == objs.objects[("Deployment", NS, "llama-prefill")]["status"]["readyReplicas"]
    obs = await asyncio.to_thread(cluster.observe, 10.0)
    assert obs.rate_rps == pytest.approx(20.0) and obs.ready == ready
    bigger = rt.applied.with_replicas(Pool.PREFILL, rt.applied.prefill.replicas + 2)
    await asyncio.to_thread(cluster.apply, bigger, "test: two more")
    assert replicas(objs, "prefill") == bigger.prefill.replicas
    assert cluster.draining() == {}
    blind = KubernetesCluster(make_controller(objs, url=None), rt, live(objs), asyncio.get_running_loop())
    rt.observer = None
    with pytest.raises(ObservationError, match="no Prometheus configured"):
        blind.observe(10.0)


async def test_an_api_failing_during_an_intervals_apply_raises_from_the_interval_and_the_next_one_applies(
        objs: InMemoryObjects) -> None:
    seed(objs)
    clock = Clock()
    c = make_controller(objs, FakePrometheus(rate=20.0), clock=clock)
    await c.reconcile(live(objs))
    before = replicas(objs, "prefill")
    objs.fail["apply_all"] = KubeApiError(500, "injected")
    clock.t += 10
    with pytest.raises(KubeApiError):
        await c.interval(live(objs))  # raised in the interval's thread, re-raised here (the daemon logs it)
    assert replicas(objs, "prefill") == before
    del objs.fail["apply_all"]
    clock.t += 10
    assert await c.interval(live(objs)) is True
    assert replicas(objs, "prefill") > before


async def test_a_failing_event_post_is_logged_and_the_interval_goes_on(
        objs: InMemoryObjects, caplog: pytest.LogCaptureFixture) -> None:
    seed(objs)
    clock = Clock()
    c = make_controller(objs, FakePrometheus(rate=20.0), clock=clock)
    await c.reconcile(live(objs))
    objs.fail["post_event"] = KubeApiError(403, "forbidden")
    clock.t += 10
    assert await c.interval(live(objs)) is True
    assert live(objs)["status"]["pools"]["prefill"]["desired"] > 1 and objs.events == []
    assert "could not post event ScaledOut" in caplog.text


# What a real API server answers for a pod template it refuses (here: a node-affinity key that is no label key;
# placement.affinity passes the spec's own checks unchanged).
_BAD_AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
    {"matchExpressions": [{"key": "bad key!", "operator": "In", "values": ["x"]}]}]}}}
_REJECTED = KubeApiError(
    422, 'Deployment.apps "llama-prefill" is invalid: spec.template.spec.affinity.nodeAffinity.'
         "requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].key: "
         'Invalid value: "bad key!": name part must consist of alphanumeric characters',
    "/apis/apps/v1/namespaces/default/deployments/llama-prefill")


def _with_generation(body: dict[str, Any], generation: int) -> dict[str, Any]:
    body = copy.deepcopy(body)
    body["metadata"]["generation"] = generation
    return body


def _errors(c: Controller) -> float:
    return float(c.metrics.reconcile_errors._value.get())


async def test_an_apply_the_api_server_rejects_is_degraded_once_per_generation_and_not_retried(
        objs: InMemoryObjects) -> None:
    seed(objs, llmserve(placement={"affinity": _BAD_AFFINITY}))
    clock = Clock()
    c = make_controller(objs, FakePrometheus(rate=20.0), clock=clock)
    objs.fail["apply_all"] = _REJECTED
    assert await c.reconcile(live(objs)) is False  # returned, not raised: kopf does not retry the same objects
    d = cond(live(objs), "Degraded")
    assert d["status"] == "True" and d["reason"] == "ApplyRejected"
    assert 'Deployment.apps "llama-prefill" is invalid' in d["message"] and "422" in d["message"]
    assert "generation 1" in d["message"]
    assert live(objs)["status"]["observedGeneration"] == 1
    (event,) = objs.by_reason("ApplyRejected")
    assert event["type"] == "Warning" and "bad key!" in event["message"]
    assert _errors(c) == 1
    # the same generation again (a resume), and the daemon's interval: still reported, no second Event, no raise
    assert await c.reconcile(live(objs)) is False
    clock.t += 10
    assert await c.interval(live(objs)) is True
    assert cond(live(objs), "Degraded")["reason"] == "ApplyRejected"
    assert len(objs.by_reason("ApplyRejected")) == 1
    # a new generation is tried at once: rejected again → its own Event; accepted → Degraded clears
    body = _with_generation(live(objs), 2)
    objs.put(body)
    assert await c.reconcile(live(objs)) is False
    assert len(objs.by_reason("ApplyRejected")) == 2 and "generation 2" in objs.by_reason("ApplyRejected")[1]["message"]
    del objs.fail["apply_all"]
    objs.put(_with_generation(live(objs), 3))
    assert await c.reconcile(live(objs)) is True
    assert cond(live(objs), "Degraded")["status"] == "False"
    assert names(objs, "Deployment") == {"llama-prefill", "llama-decode", "llama-router"}


async def test_an_interval_whose_apply_is_rejected_reports_it_and_the_next_accepted_one_clears_it(
        objs: InMemoryObjects) -> None:
    seed(objs)
    clock = Clock()
    c = make_controller(objs, FakePrometheus(rate=20.0), clock=clock)
    assert await c.reconcile(live(objs)) is True
    objs.fail["apply_all"] = _REJECTED
    clock.t += 10
    assert await c.interval(live(objs)) is True  # not raised to the daemon
    assert cond(live(objs), "Degraded")["reason"] == "ApplyRejected"
    assert len(objs.by_reason("ApplyRejected")) == 1
    clock.t += 10
    assert await c.interval(live(objs)) is True
    assert len(objs.by_reason("ApplyRejected")) == 1
    del objs.fail["apply_all"]
    clock.t += 10
    assert await c.interval(live(objs)) is True
    assert cond(live(objs), "Degraded")["reason"] != "ApplyRejected"


@pytest.mark.parametrize("status", [0, 401, 408, 409, 429, 500, 503])
async def test_api_failures_that_are_not_a_rejection_still_raise_for_a_retry(objs: InMemoryObjects, status: int) -> None:
    seed(objs)
    c = make_controller(objs)
    objs.fail["apply_all"] = KubeApiError(status, "injected")
    with pytest.raises(KubeApiError):
        await c.reconcile(live(objs))
    assert objs.by_reason("ApplyRejected") == []


async def test_the_kopf_change_handler_retries_a_failing_api_but_not_a_rejected_apply(objs: InMemoryObjects) -> None:
    import kopf

    registry = kopf.OperatorRegistry()
    c = make_controller(objs)
    register(registry, c)
    (on_change,) = {h.fn for h in registry._changing.get_all_handlers() if h.id == "reconcile"}
    seed(objs)
    objs.fail["apply_all"] = _REJECTED
    await on_change(body=live(objs))  # no TemporaryError: kopf would retry it every 10 s forever
    assert cond(live(objs), "Degraded")["reason"] == "ApplyRejected"
    objs.fail["apply_all"] = KubeApiError(503, "down")
    with pytest.raises(kopf.TemporaryError):
        await on_change(body=live(objs))


async def test_a_prompt_beyond_the_context_holds_the_pools_and_reports_degraded(objs: InMemoryObjects) -> None:
    body = llmserve()
    seed(objs, body)
    prom = FakePrometheus(rate=20.0)
    clock = Clock()
    c = make_controller(objs, prom, clock=clock)
    await c.reconcile(live(objs))
    clock.t += 10
    await c.interval(live(objs))
    before = {p: v["desired"] for p, v in live(objs)["status"]["pools"].items()}
    prom.isl = 300_000.0  # beyond maxModelLen 8192: the observer rejects it
    for _ in range(3):
        clock.t += 10
        assert await c.interval(live(objs))
    assert {p: v["desired"] for p, v in live(objs)["status"]["pools"].items()} == before
    d = cond(live(objs), "Degraded")
    assert d["status"] == "True" and d["reason"] == "ObservationUnavailable"
    assert "exceeds maxModelLen 8192" in d["message"]


async def test_a_planning_error_holds_the_pools_and_reports_degraded_instead_of_failing_the_interval(
        objs: InMemoryObjects, monkeypatch: pytest.MonkeyPatch) -> None:
    import fulcrum.scaling.fulcrum as fulcrum_planner
    from fulcrum.errors import PlanningError

    seed(objs, llmserve())
    prom = FakePrometheus(rate=20.0)
    clock = Clock()
    c = make_controller(objs, prom, clock=clock)
    await c.reconcile(live(objs))
    clock.t += 10
    await c.interval(live(objs))
    before = {p: v["desired"] for p, v in live(objs)["status"]["pools"].items()}

    # every planned TP holds maxModelLen (checked when the planner is built), so no observed prompt can make the
    # plan fail for memory any more; a planning error mid-run is made by the planner itself here
    def refuse(*args: object, **kwargs: object) -> object:
        raise PlanningError("profile 'p': no prefill TP holds the forecast prompt")

    monkeypatch.setattr(fulcrum_planner, "plan", refuse)
    monkeypatch.setattr(fulcrum_planner, "plan_modes", refuse)
    for _ in range(3):
        clock.t += 10
        assert await c.interval(live(objs))
    assert {p: v["desired"] for p, v in live(objs)["status"]["pools"].items()} == before
    d = cond(live(objs), "Degraded")
    assert d["status"] == "True" and d["reason"] == "PlanningFailed" and d["message"].startswith("planning failed: ")
    assert "no prefill TP holds the forecast prompt" in d["message"]
    events = objs.by_reason("PlanningFailed")
    assert len(events) == 1 and events[0]["type"] == "Warning"


async def test_a_max_model_len_no_planned_tp_holds_is_an_invalid_spec_before_any_pod(objs: InMemoryObjects) -> None:
    # vLLM refuses to start when one maxModelLen sequence does not fit its KV cache: the pods would crash-loop
    body = llmserve()
    body["spec"]["engine"] = {**body["spec"]["engine"], "maxModelLen": 2_000_000}
    seed(objs, body)
    c = make_controller(objs)
    assert await c.reconcile(live(objs)) is False
    assert names(objs, "Deployment") == set()
    d = cond(live(objs), "Degraded")
    assert d["status"] == "True" and d["reason"] == "InvalidSpec"
    assert "maxModelLen 2,000,000 tokens" in d["message"] and "spec.engine.maxModelLen" in d["message"]
    assert len(objs.by_reason("InvalidSpec")) == 1


async def test_extra_args_that_override_the_planners_tp_are_an_invalid_spec_naming_the_flag(objs: InMemoryObjects) -> None:
    seed(objs, llmserve(engine={"kind": "vllm", "extraArgs": ["--tensor-parallel-size", "8"]}))
    c = make_controller(objs)
    assert await c.reconcile(live(objs)) is False
    assert objs.writes == 0 and names(objs, "Deployment") == set()
    d = cond(live(objs), "Degraded")
    assert d["reason"] == "InvalidSpec" and "spec.engine.extraArgs" in d["message"]
    assert "--tensor-parallel-size" in d["message"] and "planner's TP" in d["message"]
    assert len(objs.by_reason("InvalidSpec")) == 1


@pytest.mark.parametrize("kind", ["vllm", "sim"])
async def test_engine_batch_limits_reach_the_worker_flags_and_unset_ones_change_nothing(
        objs: InMemoryObjects, kind: str) -> None:
    import argparse

    from fulcrum.commands import sim_worker, worker

    seed(objs, llmserve(engine={"kind": kind, "maxNumSeqs": 64, "maxNumBatchedTokens": 2048}))
    c = make_controller(objs)
    assert await c.reconcile(live(objs)) is True
    args = objs.objects[("Deployment", NS, "llama-decode")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "64"
    assert args[args.index("--max-num-batched-tokens") + 1] == "2048"
    # the worker's own parser reads them (fulcrum worker → WorkerConfig → vLLM's argv; sim-worker → its engine)
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    (worker if kind == "vllm" else sim_worker).add_parser(sub)
    parsed = parser.parse_args(args)
    assert (parsed.max_num_seqs, parsed.max_num_batched_tokens) == (64, 2048)

    unset = InMemoryObjects()
    seed(unset, llmserve(engine={"kind": kind}))
    assert await make_controller(unset).reconcile(live(unset)) is True
    plain = unset.objects[("Deployment", NS, "llama-decode")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--max-num-seqs" not in plain and "--max-num-batched-tokens" not in plain


@pytest.mark.parametrize(("engine", "words"), [
    ({"kind": "vllm", "extraArgs": ["--no-enable-prefix-caching"]}, ["--no-enable-prefix-caching"]),
    ({"kind": "vllm", "extraArgs": ["--max-num-seqs", "8"]}, ["--max-num-seqs", "spec.engine.maxNumSeqs"]),
    ({"kind": "vllm", "maxNumSeqs": 512, "maxNumBatchedTokens": 256}, ["maxNumBatchedTokens 256", "maxNumSeqs 512"]),
])
async def test_engine_settings_vllm_would_refuse_are_an_invalid_spec_naming_them(
        objs: InMemoryObjects, engine: dict[str, Any], words: list[str]) -> None:
    seed(objs, llmserve(engine=engine))
    c = make_controller(objs)
    assert await c.reconcile(live(objs)) is False
    assert objs.writes == 0 and names(objs, "Deployment") == set()
    d = cond(live(objs), "Degraded")
    assert d["reason"] == "InvalidSpec" and "spec.engine" in d["message"]
    assert all(w in d["message"] for w in words), d["message"]


def profile_configmap(objs: InMemoryObjects, text: Any, name: str = "my-profile") -> None:
    objs.put({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": NS},
              "data": {"profile.yaml": text}})


def configmap_profile_yaml(**over: Any) -> str:
    from fulcrum.ratio.profiles import builtin_profile

    d = builtin_profile("dopd-llama70b-fp8-h100").to_dict()
    d.update(over)
    return yaml.safe_dump(d)


async def test_a_profile_configmap_loads_and_keeps_its_default_name(objs: InMemoryObjects) -> None:
    profile_configmap(objs, configmap_profile_yaml(name=None))
    seed(objs, llmserve(profile={"configMap": "my-profile"}))
    c = make_controller(objs)
    assert await c.reconcile(live(objs)) is True
    assert c.runtimes[KEY].profile.name == "configmap/my-profile"  # the router's inline copy carries this name


CM = r"^profile ConfigMap default/my-profile key profile\.yaml"  # where every message starts


@pytest.mark.parametrize(("text", "message"), [
    pytest.param("name: x\ngpu: {type: H100\nweightBytes: 1\n",
                 CM + r":3:\d+: not valid YAML: while parsing a flow mapping, expected ',' or '}', but got ",
                 id="yaml-syntax"),
    pytest.param("name: x\n  gpu: : y\n", CM + r":2:\d+: not valid YAML: mapping values are not allowed here$",
                 id="yaml-mapping-values"),
    pytest.param("a: 1\n---\nb: 2\n",
                 CM + r":2:1: not valid YAML: expected a single document in the stream, but found another document$",
                 id="two-documents"),
    pytest.param("[" * 100_000, CM + r": not valid YAML: nested too deeply$", id="nested-too-deeply"),
    pytest.param("measured: 2024-13-45\n", CM + r": not valid YAML: month must be in 1\.\.12$", id="bad-timestamp"),
    pytest.param("", CM + r": holds no profile \(empty or only comments\)", id="empty"),
    pytest.param("# to do\n", CM + r": holds no profile", id="comments"),
    pytest.param("- 1\n- 2\n", CM + r": expected a mapping of the profile's fields, got list$", id="a-list"),
    pytest.param("just text\n", CM + r": expected a mapping of the profile's fields, got str$", id="a-string"),
    pytest.param(configmap_profile_yaml(weightBytes=True), CM + r": weightBytes: expected a number, got True$",
                 id="bad-field"),
])
async def test_an_unreadable_profile_configmap_is_an_invalid_spec_naming_the_configmap_key_and_problem(
        objs: InMemoryObjects, text: str, message: str) -> None:
    import re

    profile_configmap(objs, text)
    seed(objs, llmserve(profile={"configMap": "my-profile"}))
    c = make_controller(objs)
    assert await c.reconcile(live(objs)) is False
    assert objs.writes == 0 and names(objs, "Deployment") == set()
    d = cond(live(objs), "Degraded")
    assert d["status"] == "True" and d["reason"] == "InvalidSpec"
    assert re.search(message, d["message"]) and "\n" not in d["message"], d["message"]
    assert cond(live(objs), "Ready")["status"] == "False"
    events = objs.by_reason("InvalidSpec")
    assert len(events) == 1 and events[0]["type"] == "Warning" and events[0]["message"] == d["message"]
    # the daemon's interval says the same and goes on (no traceback, no second Event for this generation)
    assert await c.interval(live(objs)) is True
    assert cond(live(objs), "Degraded")["message"] == d["message"]
    assert len(objs.by_reason("InvalidSpec")) == 1


@pytest.mark.parametrize(("data", "message"), [
    pytest.param(None, r"^profile ConfigMap default/my-profile not found$", id="no-configmap"),
    pytest.param({"other.yaml": "a: 1"},
                 r"^profile ConfigMap default/my-profile has no key profile\.yaml: put the profile's YAML there$",
                 id="no-key"),
])
async def test_a_missing_profile_configmap_or_key_is_an_invalid_spec_naming_them(
        objs: InMemoryObjects, data: dict[str, str] | None, message: str) -> None:
    import re

    if data is not None:
        objs.put({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "my-profile", "namespace": NS},
                  "data": data})
    seed(objs, llmserve(profile={"configMap": "my-profile"}))
    c = make_controller(objs)
    assert await c.reconcile(live(objs)) is False
    d = cond(live(objs), "Degraded")
    assert d["reason"] == "InvalidSpec" and re.search(message, d["message"]), d["message"]


async def test_an_llmserve_invalid_from_the_start_gets_one_invalid_spec_event_per_generation(
        objs: InMemoryObjects) -> None:
    """It never gets a runtime, where the Event's generation was kept: every interval posted one more."""
    seed(objs, llmserve(slo={"ttftMs": -5}))
    c = make_controller(objs)
    assert await c.reconcile(live(objs)) is False
    for _ in range(3):
        assert await c.interval(live(objs)) is True
    assert len(objs.by_reason("InvalidSpec")) == 1
    body = live(objs)
    body["metadata"]["generation"] = 2
    body["spec"]["slo"] = {"ttftMs": -6}
    objs.put(body)
    assert await c.reconcile(live(objs)) is False
    await c.interval(live(objs))
    events = objs.by_reason("InvalidSpec")
    assert len(events) == 2 and "ttftMs" in events[1]["message"]
