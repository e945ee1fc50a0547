"""The operator's Kubernetes adapter, :class:`fulcrum.controller.objects.ApiObjects`, against a FAKE Kubernetes API
at the HTTP layer (tests/fakes/fake_kube_api.py): what goes over the wire.

Tested here: the request shapes (server-side apply with field manager and ``force``, the status subresource's
merge patch, Events posted, the drain's pod annotation under its own field manager without ``force``), the
hash-based idempotence of the apply and the revert of a hand-edited replica count as the API reports it, retries of
409/5xx, 404 and 409 handling, and a smoke run of the whole kopf operator. The Controller's logic is tested on
:class:`~fulcrum.controller.objects.InMemoryObjects` (tests/unit/test_controller_handlers.py); the same scenarios on
a real API server in e2e/test_local_*.py.

Every Kubernetes call goes through the real ``kubernetes`` client over HTTP to the fake. Prometheus is faked at the
query-client seam (canned PromQL answers).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

pytest.importorskip("kopf")
pytest.importorskip("kubernetes")

from kubernetes import config as kconfig

from fakes.fake_kube_api import FakeKubeApi
from fulcrum.controller.apply import DRAIN_FIELD_MANAGER, KubeApiError, KubeClient
from fulcrum.controller.drain import DELETION_COST_ANNOTATION
from fulcrum.controller.handlers import Controller, ControllerSettings, register
from fulcrum.controller.metrics import OperatorMetrics
from fulcrum.controller.objects import ApiObjects, KubeObjects

pytestmark = pytest.mark.asyncio

NS = "default"
NAME = "llama"


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
    """FAKE Prometheus query client: ``rate`` requests/s of 1,000-token prompts and 150-token answers."""

    def __init__(self, rate: float, interval_s: float = 10.0) -> None:
        self.rate, self.interval_s = rate, interval_s

    def custom_query(self, query: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        n = self.rate * self.interval_s

        def one(v: float) -> list[dict[str, Any]]:
            return [{"metric": {}, "value": [0, str(v)]}]

        if "_bucket" in query:
            return []
        if "requests_admitted" in query or "input_tokens_count" in query or "predicted_output_tokens_count" in query:
            return one(n)
        if "input_tokens_sum" in query:
            return one(n * 1000.0)
        if "predicted_output_tokens_sum" in query:
            return one(n * 150.0)
        return one(0.0)


@pytest.fixture
def api() -> Iterator[FakeKubeApi]:
    a = FakeKubeApi().start()
    yield a
    a.stop()


@pytest.fixture
def kube(api: FakeKubeApi, tmp_path: Any) -> KubeClient:
    client = kconfig.new_client_from_config(config_file=str(api.kubeconfig(tmp_path / "kubeconfig")))
    return KubeClient(client, backoff_s=0.001, max_backoff_s=0.002, sleep=lambda s: None)


def make_controller(kube: KubeClient, prom: Any = None) -> Controller:
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    clock = [1_000_000.0]
    return Controller(ApiObjects(kube), ControllerSettings(image="fulcrum:test", prometheus_url="http://prom.invalid"),
                      metrics=OperatorMetrics(), prometheus=(lambda _u: prom) if prom is not None else None,
                      clock=lambda: clock[0], now=lambda: t0 + timedelta(seconds=clock[0] - 1_000_000.0))


def seed(api: FakeKubeApi, body: dict[str, Any] | None = None) -> dict[str, Any]:
    return api.put("llmserves", copy.deepcopy(body or llmserve()))


def live(api: FakeKubeApi) -> dict[str, Any]:
    got = api.get("llmserves", NS, NAME)
    assert got is not None
    return got


def child_writes(api: FakeKubeApi) -> list[str]:
    return [f"{r.method} {r.path}" for r in api.writes() if "/llmserves/" not in r.path]


def events(api: FakeKubeApi, reason: str | None = None) -> list[dict[str, Any]]:
    return [e for e in api.list("events", NS) if reason is None or e["reason"] == reason]


async def test_api_objects_is_the_kube_objects_seam(kube: KubeClient) -> None:
    assert isinstance(ApiObjects(kube), KubeObjects)


async def test_a_reconcile_server_side_applies_every_object_and_merge_patches_the_status(
        api: FakeKubeApi, kube: KubeClient) -> None:
    seed(api)
    c = make_controller(kube)
    assert await c.reconcile(live(api)) is True
    assert {d["metadata"]["name"] for d in api.list("deployments", NS)} == {"llama-prefill", "llama-decode",
                                                                            "llama-router"}
    applies = [r for r in api.requests if r.method == "PATCH" and "/llmserves/" not in r.path]
    assert len(applies) == 10
    assert all(r.query == {"fieldManager": "fulcrum-operator", "force": "true"} for r in applies)
    assert all(r.content_type.startswith("application/apply-patch+yaml") for r in applies)
    dep = api.get("deployments", NS, "llama-prefill")
    assert dep is not None and dep["metadata"]["ownerReferences"][0]["uid"] == live(api)["metadata"]["uid"]
    status = [r for r in api.requests if r.method == "PATCH" and "/llmserves/" in r.path]
    assert [r.path for r in status] == [f"/apis/fulcrum.dev/v1alpha1/namespaces/{NS}/llmserves/{NAME}/status"]
    assert status[0].content_type.startswith("application/merge-patch+json") and "pools" in status[0].body["status"]
    assert live(api)["status"]["pools"]["prefill"] == {"ready": 1, "desired": 1, "tp": 1}


async def test_a_second_reconcile_of_the_same_spec_writes_no_object(api: FakeKubeApi, kube: KubeClient) -> None:
    seed(api)
    c = make_controller(kube)
    await c.reconcile(live(api))
    first = len(child_writes(api))
    objects = c.objects
    assert isinstance(objects, ApiObjects)
    writes_before = objects.applier.writes
    await c.reconcile(live(api))
    assert first == 10 and len(child_writes(api)) == first
    assert objects.applier.writes == writes_before


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
    assert reverted[0]["involvedObject"]["kind"] == "LLMServe" and reverted[0]["metadata"]["name"].startswith("llama.")
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


async def test_a_mode_switch_deletes_only_the_objects_the_operator_applied(api: FakeKubeApi, kube: KubeClient) -> None:
    seed(api, llmserve(profile={"name": "splitwise-llama2-70b-h100"}))
    c = make_controller(kube)
    await c.reconcile(live(api))
    labels = {"fulcrum.dev/llmserve": NAME}  # someone else's Deployment, with the same label
    api.put("deployments", {"apiVersion": "apps/v1", "kind": "Deployment",
                            "metadata": {"name": "llama-sidecar", "namespace": NS, "labels": labels},
                            "spec": {"replicas": 1}})
    body = live(api)
    body["spec"]["mode"] = "Unified"
    body["metadata"]["generation"] = 2
    api.put("llmserves", body)
    await c.reconcile(live(api))
    assert {d["metadata"]["name"] for d in api.list("deployments", NS)} == {"llama-unified", "llama-router",
                                                                            "llama-sidecar"}
    deletes = [r for r in api.requests if r.method == "DELETE"]
    assert sorted(r.path.rsplit("/", 1)[1] for r in deletes) == ["llama-decode", "llama-decode", "llama-prefill",
                                                                 "llama-prefill"]  # Deployments and Services
    assert all(r.body["propagationPolicy"] == "Background" and r.status == 200 for r in deletes)


async def test_a_status_write_for_a_gone_llmserve_is_false_and_other_failures_raise(
        api: FakeKubeApi, kube: KubeClient) -> None:
    objects = ApiObjects(kube)
    assert objects.write_status(NS, NAME, {"replicas": 1}) is False  # 404: gone
    seed(api)
    assert objects.write_status(NS, NAME, {"replicas": 1}) is True and live(api)["status"] == {"replicas": 1}
    api.fail("PATCH", "/llmserves/", 403)
    with pytest.raises(KubeApiError) as err:
        objects.write_status(NS, NAME, {"replicas": 2})
    assert err.value.status == 403


async def test_the_drains_pod_annotation_never_forces_and_a_gone_pod_is_false(
        api: FakeKubeApi, kube: KubeClient) -> None:
    api.put("pods", {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p0", "namespace": NS}})
    objects = ApiObjects(kube)
    assert objects.annotate_pod(NS, "p0", {DELETION_COST_ANNOTATION: "-1000000"}) is True
    req = [r for r in api.requests if r.method == "PATCH"][-1]
    assert req.query == {"fieldManager": DRAIN_FIELD_MANAGER} and req.content_type.startswith("application/apply-patch")
    assert req.body == {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "p0", "namespace": NS, "annotations": {DELETION_COST_ANNOTATION: "-1000000"}}}
    pod = api.get("pods", NS, "p0")
    assert pod is not None and pod["metadata"]["annotations"][DELETION_COST_ANNOTATION] == "-1000000"
    api.fail("PATCH", "/pods/gone", 404)
    assert objects.annotate_pod(NS, "gone", {DELETION_COST_ANNOTATION: "-1000000"}) is False
    api.fail("PATCH", "/pods/p0", 409, times=5)  # a conflict with another manager: retried, then raised
    with pytest.raises(KubeApiError) as err:
        objects.annotate_pod(NS, "p0", {DELETION_COST_ANNOTATION: "0"})
    assert err.value.status == 409


async def test_a_kopf_operator_run_reconciles_and_runs_an_interval_against_the_fake_api(
        api: FakeKubeApi, kube: KubeClient, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Smoke run of the whole kopf operator (discovery, list, watch, handlers, daemon) for a few seconds."""
    import kopf

    body = llmserve()
    body["spec"]["scaling"]["intervalSeconds"] = 1
    seed(api, body)
    monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path / "kopf-kubeconfig")))
    c = make_controller(kube, FakePrometheus(rate=20.0))
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
    assert events(api, "ScaledOut")
