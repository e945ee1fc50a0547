"""EndpointSlices on the local cluster: with ``FULCRUM_E2E_NETNS=1`` the session's cluster runs in a network
namespace of its own and pods get ``10.244.<a>.<b>`` addresses (e2e/local/netns.py), which the API accepts in
EndpointSlices — so the EndpointSlice controller fills them, and Fulcrum's router can use its Kubernetes registry
(no etcd). Without the variable these tests skip (pod IPs are loopback addresses then; docs/e2e.md).

Run: ``FULCRUM_E2E_NETNS=1 python -m pytest e2e/test_local_netns.py -v -s`` (root).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from local.audit import calls_of, summarise
from local.cluster import ManagedProcess, free_port
from local.probes import wait as _wait, kget as _get

pytestmark = [pytest.mark.local_cluster, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[1]


def _need_netns(cluster: Any) -> None:
    if getattr(cluster, "pod_prefix", "127.0").startswith("127.") or cluster.agent is None:
        pytest.skip("pod IPs are loopback addresses: set FULCRUM_E2E_NETNS=1 (a network namespace of the cluster's own)")


WEB = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: web}
spec:
  replicas: 2
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      containers:
      - name: web
        image: python:3.11-slim
        command: [python, -m, http.server, "8080", --bind, "$(POD_IP)"]
        env: [{name: POD_IP, valueFrom: {fieldRef: {fieldPath: status.podIP}}}]
        ports: [{name: http, containerPort: 8080}]
        readinessProbe: {tcpSocket: {port: http}, periodSeconds: 1}
---
apiVersion: v1
kind: Service
metadata: {name: web}
spec: {selector: {app: web}, ports: [{name: http, port: 80, targetPort: http}]}
"""


def test_endpointslices_hold_the_ready_pod_ips(local_cluster: Any, local_namespace: str) -> None:
    _need_netns(local_cluster)
    ns = local_namespace
    local_cluster.kubectl("apply", "-n", ns, "-f", "-", input_text=WEB)
    local_cluster.kubectl("rollout", "status", "deployment/web", "-n", ns, "--timeout=120s", timeout=130)
    ips = {p["status"]["podIP"] for p in _get(local_cluster, "pods", ns, selector="app=web")["items"]}
    assert len(ips) == 2 and all(ip.startswith("10.244.") for ip in ips), ips

    def sliced() -> set[str] | None:
        got = {a for s in _get(local_cluster, "endpointslices", ns, selector="kubernetes.io/service-name=web")["items"]
               for e in s.get("endpoints") or [] if (e.get("conditions") or {}).get("ready") for a in e["addresses"]}
        return got if got == ips else None

    _wait("the EndpointSlice controller writing both pod IPs", sliced, timeout_s=60)
    ep = _get(local_cluster, "endpoints", ns, "web")
    assert {a["ip"] for s in ep.get("subsets") or [] for a in s.get("addresses") or []} == ips


@pytest.fixture
def operator_without_etcd(local_cluster: Any, local_namespace: str, tmp_path: Path) -> Iterator[ManagedProcess]:
    """``fulcrum operator`` (a local process) with no etcd: LLMServes get the router's Kubernetes registry."""
    _need_netns(local_cluster)
    local_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    local_cluster.kubectl("wait", "--for=condition=Established", "crd/llmserves.fulcrum.dev", "--timeout=60s")
    proc = ManagedProcess("operator", [
        sys.executable, "-m", "fulcrum", "operator", "--namespace", local_namespace, "--log-format", "text",
        "--kubeconfig", str(local_cluster.kubeconfig), "--metrics-port", str(free_port()),
        "--liveness-port", str(free_port()), "--image", "ghcr.io/fulcrum-llm/fulcrum:local", "--etcd-endpoint", ""],
        tmp_path / "operator.log")
    proc.start()
    try:
        yield proc
    finally:
        proc.stop(30)
        print(f"----- operator log ({proc.log}) -----\n{proc.tail(3000)}")


def test_the_router_finds_the_sim_workers_through_endpointslices(
        local_cluster: Any, local_namespace: str, operator_without_etcd: ManagedProcess) -> None:
    _need_netns(local_cluster)
    ns = local_namespace
    doc = yaml.safe_load((REPO / "examples" / "llmserve-sim.yaml").read_text())
    doc["metadata"] = {"name": "sim", "namespace": ns}
    local_cluster.kubectl("apply", "-f", "-", input_text=yaml.safe_dump(doc))
    t0 = time.monotonic()
    for pool in ("prefill", "decode", "router"):
        _wait(f"Deployment sim-{pool} ready", lambda pool=pool: (_get(local_cluster, "deployment", ns, f"sim-{pool}")
                                                                .get("status") or {}).get("readyReplicas"),
              timeout_s=240, every_s=1.0)
    cm = _get(local_cluster, "configmap", ns, "sim-router")
    assert "registry: kubernetes" in next(iter(cm["data"].values())), cm["data"]
    router_ip = local_cluster.proxies.address(ns, "sim-router", timeout_s=10)
    body = json.dumps({"model": doc["spec"]["model"]["servedName"], "prompt": "hello " * 50, "max_tokens": 8}).encode()

    def complete() -> tuple[int, bytes] | None:
        req = urllib.request.Request(f"http://{router_ip}:8000/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:  # noqa: S310 (the router's Service proxy)
                return int(r.status), r.read()
        except OSError:
            return None

    status, reply = _wait("a completion routed by EndpointSlices", complete, timeout_s=120, every_s=2.0)
    assert status == 200 and json.loads(reply)["usage"]["completion_tokens"] == 8
    print(f"router (registry: kubernetes) served a completion {time.monotonic() - t0:.1f} s after the apply")
    # the router read the slices as the ServiceAccount the operator made for it, under the Role it made, never refused
    user = f"system:serviceaccount:{ns}:sim-router"
    calls = calls_of(local_cluster.control_plane.audit_log, user)
    table = summarise(calls)
    print(f"{user}: " + "; ".join(f"{k} {dict(v)}" for k, v in table.items()))
    assert not [c for c in calls if c.code == 403], table
    assert any(k.endswith("discovery.k8s.io/endpointslices") for k in table), table
