"""A drain the API refuses part-way, run by the operator's Controller on
:class:`~fulcrum.controller.objects.InMemoryObjects`: its victims go back into the router's rotation and keep no
drained pod-deletion cost (FAKE Prometheus and pod ``/metrics``; no HTTP, no sleeping)."""

from __future__ import annotations

import asyncio
import copy
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import yaml

pytest.importorskip("kopf")

from fulcrum.controller.apply import KubeApiError
from fulcrum.controller.drain import DELETION_COST_ANNOTATION
from fulcrum.controller.handlers import Controller, ControllerSettings
from fulcrum.controller.metrics import OperatorMetrics
from fulcrum.controller.objects import InMemoryObjects

pytestmark = pytest.mark.asyncio

NS, NAME = "default", "llama"
KEY = f"{NS}/{NAME}"


def _body() -> dict[str, Any]:
    return {"apiVersion": "fulcrum.dev/v1alpha1", "kind": "LLMServe",
            "metadata": {"name": NAME, "namespace": NS, "generation": 1},
            "spec": {"model": {"name": "tiny"}, "engine": {"kind": "sim"}, "mode": "Disaggregated",
                     "scaling": {"intervalSeconds": 10, "cooldownSeconds": 0, "podStartupSeconds": 0, "maxStep": 4,
                                 "drainTimeoutSeconds": 30},
                     "profile": {"name": "dopd-llama70b-fp8-h100"}}}


class Prometheus:
    """FAKE Prometheus: ``rate`` requests/s of 1,000-token prompts and 150-token answers."""

    rate = 20.0

    def custom_query(self, query: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        n = self.rate * 10.0
        v = 0.0
        if "_bucket" in query:
            return []
        if "requests_admitted" in query or "input_tokens_count" in query or "predicted_output_tokens_count" in query:
            v = n
        elif "input_tokens_sum" in query:
            v = n * 1000.0
        elif "predicted_output_tokens_sum" in query:
            v = n * 150.0
        return [{"metric": {}, "value": [0, str(v)]}]


async def test_a_drain_whose_pod_annotation_is_refused_puts_its_victims_back_into_the_routers_rotation() -> None:
    objs = InMemoryObjects()
    objs.put(copy.deepcopy(_body()))
    prom, t = Prometheus(), [1_000_000.0]
    ips: dict[str, str] = {}

    async def fetch(url: str, timeout_s: float) -> str:  # every worker pod idle
        ip = url.split("//", 1)[1].split(":", 1)[0]
        if ip not in ips:
            raise OSError("connection refused")
        return 'vllm:num_requests_running{model_name="m"} 0\nvllm:num_requests_waiting{model_name="m"} 0\n'

    async def sleep(s: float) -> None:
        t[0] += s
        await asyncio.sleep(0)

    c = Controller(objs, ControllerSettings(image="fulcrum:test", prometheus_url="http://prom.invalid", drain_poll_s=1.0),
                   metrics=OperatorMetrics(), prometheus=lambda _u: prom, clock=lambda: t[0], monotonic=lambda: t[0],
                   sleep=sleep, fetch=fetch,
                   now=lambda: datetime(2026, 1, 1, tzinfo=timezone.utc) + timedelta(seconds=t[0] - 1_000_000.0))

    def body() -> dict[str, Any]:
        got = objs.get("fulcrum.dev/v1alpha1", "LLMServe", NS, NAME)
        assert got is not None
        return got

    await c.reconcile(body())
    t[0] += 10
    await c.interval(body())
    n = int(objs.objects[("Deployment", NS, "llama-prefill")]["spec"]["replicas"])
    assert n >= 3
    for i in range(n):
        ips[f"10.0.0.{i + 1}"] = name = f"llama-prefill-{i}"
        objs.put({"apiVersion": "v1", "kind": "Pod",
                  "metadata": {"name": name, "namespace": NS, "annotations": {},
                               "labels": {"fulcrum.dev/llmserve": NAME, "fulcrum.dev/pool": "prefill"}},
                  "status": {"podIP": f"10.0.0.{i + 1}", "conditions": [{"type": "Ready", "status": "True"}]}})
    refused = {"n": 0}
    annotate = objs.annotate_pod

    def annotate_pod(namespace: str, name: str, annotations: Any) -> bool:
        if annotations.get(DELETION_COST_ANNOTATION) != "0":  # the drained cost: the 2nd pod is refused
            refused["n"] += 1
            if refused["n"] == 2:
                raise KubeApiError(409, "conflict with field manager other-tool", f"/api/v1/namespaces/{NS}/pods/{name}")
        return annotate(namespace, name, annotations)

    objs.annotate_pod = annotate_pod  # type: ignore[method-assign]
    prom.rate = 0.05
    for _ in range(6):
        t[0] += 10
        await c.interval(body())
        await c.settle(KEY)
        if refused["n"] >= 2:
            break
    assert refused["n"] >= 2, "expected a drain to reach the pod-deletion cost"
    router = yaml.safe_load(objs.objects[("ConfigMap", NS, "llama-router")]["data"]["router.yaml"])
    assert not router.get("draining"), router.get("draining")  # before: the victims stayed out of the rotation
    assert not c.runtimes[KEY].draining
    costs = {p: (objs.objects[("Pod", NS, p)]["metadata"]["annotations"]).get(DELETION_COST_ANNOTATION, "0")
             for p in (f"llama-prefill-{i}" for i in range(n))}
    assert set(costs.values()) == {"0"}, costs  # before: one serving pod kept the cost -1000000
    assert int(objs.objects[("Deployment", NS, "llama-prefill")]["spec"]["replicas"]) == n
    t[0] += 10
    await c.interval(body())
    d = next(x for x in body()["status"]["conditions"] if x["type"] == "Degraded")
    assert d["status"] == "True" and "drain failed" in d["message"]
    await c.settle(KEY)  # that interval's drain (the API accepts it now) ends


async def test_a_drain_that_ends_after_an_invalid_spec_keeps_its_verdict_and_generation() -> None:
    objs = InMemoryObjects()
    objs.put(copy.deepcopy(_body()))
    prom, t = Prometheus(), [1_000_000.0]
    loads: dict[str, float] = {}
    ips: dict[str, str] = {}

    async def fetch(url: str, timeout_s: float) -> str:
        ip = url.split("//", 1)[1].split(":", 1)[0]
        if ip not in ips:
            raise OSError("connection refused")
        return f'vllm:num_requests_running{{model_name="m"}} {loads[ips[ip]]}\n'

    async def sleep(s: float) -> None:  # the clock stands still while the drain polls: it waits for the test
        await asyncio.sleep(0.002)

    c = Controller(objs, ControllerSettings(image="fulcrum:test", prometheus_url="http://prom.invalid", drain_poll_s=1.0),
                   metrics=OperatorMetrics(), prometheus=lambda _u: prom, clock=lambda: t[0], monotonic=lambda: t[0],
                   sleep=sleep, fetch=fetch,
                   now=lambda: datetime(2026, 1, 1, tzinfo=timezone.utc) + timedelta(seconds=t[0] - 1_000_000.0))

    def body() -> dict[str, Any]:
        got = objs.get("fulcrum.dev/v1alpha1", "LLMServe", NS, NAME)
        assert got is not None
        return got

    await c.reconcile(body())
    t[0] += 10
    await c.interval(body())
    n = int(objs.objects[("Deployment", NS, "llama-prefill")]["spec"]["replicas"])
    for i in range(n):
        ips[f"10.0.0.{i + 1}"] = name = f"llama-prefill-{i}"
        loads[name] = 3.0
        objs.put({"apiVersion": "v1", "kind": "Pod",
                  "metadata": {"name": name, "namespace": NS, "annotations": {},
                               "labels": {"fulcrum.dev/llmserve": NAME, "fulcrum.dev/pool": "prefill"}},
                  "status": {"podIP": f"10.0.0.{i + 1}", "conditions": [{"type": "Ready", "status": "True"}]}})
    prom.rate = 0.05
    rt = c.runtimes[KEY]
    for _ in range(6):
        t[0] += 10
        await c.interval(body())
        if rt.drains:
            break
    assert rt.drains, "expected a drain"
    bad = body()
    bad["spec"]["engine"] = {"kind": "vllm", "extraArgs": ["--tensor-parallel-size", "8"]}
    bad["metadata"]["generation"] = 2
    objs.put(bad)
    assert await c.reconcile(body()) is False
    assert body()["status"]["observedGeneration"] == 2
    before = next(x for x in body()["status"]["conditions"] if x["type"] == "Degraded")
    assert before["reason"] == "InvalidSpec"
    for p in loads:
        loads[p] = 0.0
    await c.settle(KEY)  # the drain of generation 1 ends and writes the status
    st = body()["status"]
    assert st["pools"]["prefill"]["desired"] < n  # what the drain did is reported
    after = next(x for x in st["conditions"] if x["type"] == "Degraded")
    assert after == before  # before: Degraded flipped to False/AsExpected until the next interval said InvalidSpec again
    assert st["observedGeneration"] == 2  # before: back to 1
    assert next(x for x in st["conditions"] if x["type"] == "Ready")["reason"] == "InvalidSpec"
