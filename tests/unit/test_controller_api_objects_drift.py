"""The drain's pod annotation over HTTP (fulcrum.controller.objects.ApiObjects.annotate_pod) against a FAKE
Kubernetes API (tests/fakes/fake_kube_api.py): a victim pod deleted while its pool drains."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("kubernetes")

from kubernetes import config as kconfig

from fakes.fake_kube_api import FakeKubeApi
from fulcrum.controller.apply import KubeApiError, KubeClient
from fulcrum.controller.drain import DELETION_COST_ANNOTATION
from fulcrum.controller.objects import ApiObjects

NS = "default"
COST = {DELETION_COST_ANNOTATION: "-1000000"}


@pytest.fixture
def api() -> Iterator[FakeKubeApi]:
    a = FakeKubeApi().start()
    yield a
    a.stop()


@pytest.fixture
def objects(api: FakeKubeApi, tmp_path: Any) -> ApiObjects:
    client = kconfig.new_client_from_config(config_file=str(api.kubeconfig(tmp_path / "kubeconfig")))
    return ApiObjects(KubeClient(client, backoff_s=0.001, max_backoff_s=0.002, sleep=lambda s: None))


def test_annotating_a_pod_deleted_meanwhile_is_false_not_an_error(api: FakeKubeApi, objects: ApiObjects) -> None:
    # A server-side apply of a missing object creates it: for a Pod of annotations only, a real API server answers
    # 422 `Pod "x" is invalid: spec.containers: Required value` (kube-apiserver 1.28), never 404.
    api.fail("PATCH", "/pods/llama-decode-gone", 422)
    assert objects.annotate_pod(NS, "llama-decode-gone", COST) is False
    assert api.get("pods", NS, "llama-decode-gone") is None


def test_a_pod_that_exists_and_refuses_the_annotation_still_raises(api: FakeKubeApi, objects: ApiObjects) -> None:
    api.put("pods", {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p0", "namespace": NS}})
    api.fail("PATCH", "/pods/p0", 422)
    with pytest.raises(KubeApiError) as err:
        objects.annotate_pod(NS, "p0", COST)
    assert err.value.status == 422


# --- hand edits that keep the desired-hash annotation ------------------------------------------------------------


def _built() -> list[dict[str, Any]]:
    from fulcrum.api.llmserve import parse_llmserve
    from fulcrum.controller.resources import build_objects, initial_target

    serve = parse_llmserve({"apiVersion": "fulcrum.dev/v1alpha1", "kind": "LLMServe",
                            "metadata": {"name": "llama", "namespace": NS},
                            "spec": {"model": {"name": "tiny"}, "engine": {"kind": "sim"}, "mode": "Disaggregated",
                                     "profile": {"name": "dopd-llama70b-fp8-h100"}}})
    return build_objects(serve, initial_target(serve), uid="uid-llama", image="fulcrum:test")


def test_a_hand_edit_that_keeps_the_hash_annotation_is_taken_back(api: FakeKubeApi, objects: ApiObjects) -> None:
    objects.apply_all(_built())
    cm = api.get("configmaps", NS, "llama-router")
    assert cm is not None
    cm["data"]["router.yaml"] = "policy: {kind: round-robin}\n"  # kubectl edit keeps the annotations
    api.put("configmaps", cm)
    dep = api.get("deployments", NS, "llama-decode")
    assert dep is not None
    dep["spec"]["template"]["spec"]["containers"][0]["image"] = "someone/else:latest"
    api.put("deployments", dep)
    report = objects.apply_all(_built())
    assert sorted(report.written) == ["ConfigMap/llama-router", "Deployment/llama-decode"]
    assert report.reverted == []  # not a replica count
    want = {(o["kind"], o["metadata"]["name"]): o for o in _built()}
    assert api.get("configmaps", NS, "llama-router")["data"] == want[("ConfigMap", "llama-router")]["data"]  # type: ignore[index]
    live = api.get("deployments", NS, "llama-decode")
    assert live is not None and live["spec"]["template"] == want[("Deployment", "llama-decode")]["spec"]["template"]


def test_what_the_api_server_adds_or_leaves_out_is_no_edit(api: FakeKubeApi, objects: ApiObjects) -> None:
    objects.apply_all(_built())
    svc = api.get("services", NS, "llama-decode")
    assert svc is not None and svc["spec"]["publishNotReadyAddresses"] is False
    del svc["spec"]["publishNotReadyAddresses"]  # a real API server omits a false boolean (kube-apiserver 1.28)
    svc["spec"]["clusterIP"] = "None"
    svc["spec"]["sessionAffinity"] = "None"  # defaults filled in
    api.put("services", svc)
    dep = api.get("deployments", NS, "llama-prefill")
    assert dep is not None
    dep["metadata"]["annotations"]["deployment.kubernetes.io/revision"] = "3"
    dep["spec"]["template"]["metadata"]["annotations"]["kubectl.kubernetes.io/restartedAt"] = "2026-01-01T00:00:00Z"
    dep["spec"]["progressDeadlineSeconds"] = 600
    api.put("deployments", dep)
    report = objects.apply_all(_built())
    assert report.written == [] and len(report.unchanged) == len(_built())


def test_a_quantity_the_api_server_rewrote_in_its_canonical_form_is_no_edit(api: FakeKubeApi, objects: ApiObjects) -> None:
    from fulcrum.controller.apply import drift

    want = {"spec": {"containers": [{"resources": {"requests": {"cpu": "0.5", "memory": "1.5Gi"},
                                                   "limits": {"cpu": 2, "memory": "1e3"}}}]}}
    canonical = {"spec": {"containers": [{"resources": {"requests": {"cpu": "500m", "memory": "1536Mi"},
                                                        "limits": {"cpu": "2", "memory": "1k"}}}]}}
    assert drift(want, canonical) == []  # what kube-apiserver stores for these (resource.Quantity's canonical form)
    edited = {"spec": {"containers": [{"resources": {"requests": {"cpu": "600m", "memory": "1536Mi"},
                                                     "limits": {"cpu": "2", "memory": "1k"}}}]}}
    assert drift(want, edited) == [".spec.containers[0].resources.requests.cpu"]
