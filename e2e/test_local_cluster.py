"""The local cluster (e2e/local: real kube-apiserver, controller-manager and scheduler v1.28.0, plus the process
node agent) runs plain workloads the way a kubelet would, and then Fulcrum itself: the operator reconciles
examples/llmserve-sim.yaml into prefill, decode and router pods that serve a completion through the router's
Service.

Run from the repository root: ``python -m pytest e2e/test_local_cluster.py -v``. Skips (with the reason) only
when the Kubernetes binaries or etcd are absent. See docs/e2e.md.
"""

from __future__ import annotations

import json
import sys
import textwrap
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from local.cluster import ManagedProcess, app_etcd as start_app_etcd, free_port
from local.node_agent import CANNOT_RUN, CONFIG_ERROR
from local.probes import wait as _wait, kget as _get

pytestmark = [pytest.mark.local_cluster, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "llmserve-sim.yaml"


def _need_agent(cluster: Any) -> None:
    if cluster.agent is None or cluster.proxies is None:
        pytest.skip("needs the local cluster's process node agent and Service proxies (not a KUBECONFIG cluster)")


def _http(url: str, body: dict[str, Any] | None = None, timeout: float = 10.0) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (a loopback proxy of this test)
        return int(resp.status), resp.read()


WEB = """
apiVersion: v1
kind: ConfigMap
metadata: {name: site}
data: {hello.txt: "hello from a ConfigMap volume\\n"}
---
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
        command: [python, -m, http.server, "8080", --bind, "$(POD_IP)", --directory, /srv/site]
        env: [{name: POD_IP, valueFrom: {fieldRef: {fieldPath: status.podIP}}}]
        ports: [{name: http, containerPort: 8080}]
        readinessProbe: {httpGet: {path: /hello.txt, port: http}, periodSeconds: 1}
        livenessProbe: {tcpSocket: {port: http}, periodSeconds: 5}
        volumeMounts: [{name: site, mountPath: /srv/site, readOnly: true}]
      volumes: [{name: site, configMap: {name: site}}]
---
apiVersion: v1
kind: Service
metadata: {name: web}
spec: {selector: {app: web}, ports: [{name: http, port: 80, targetPort: http}]}
"""


def test_a_deployment_becomes_ready_and_its_service_proxy_serves_the_configmap_volume(
        local_cluster: Any, local_namespace: str) -> None:
    _need_agent(local_cluster)
    ns = local_namespace
    local_cluster.kubectl("apply", "-n", ns, "-f", "-", input_text=WEB)
    local_cluster.kubectl("rollout", "status", "deployment/web", "-n", ns, "--timeout=120s", timeout=130)
    pods = _get(local_cluster, "pods", ns)["items"]
    assert len(pods) == 2
    ips = {p["status"]["podIP"] for p in pods}
    assert len(ips) == 2 and all(ip.startswith("127.") for ip in ips), ips
    for p in pods:
        conds = {c["type"]: c["status"] for c in p["status"]["conditions"]}
        assert conds == {"PodScheduled": "True", "Initialized": "True", "ContainersReady": "True", "Ready": "True"}
        assert p["status"]["phase"] == "Running"
        assert p["status"]["containerStatuses"][0]["ready"] is True
    ip = local_cluster.proxies.address(ns, "web", timeout_s=10)
    _wait("both pods behind the Service proxy", lambda: len(local_cluster.proxies.backends(ns, "web")[80]) == 2)
    answers = {_http(f"http://{ip}:80/hello.txt")[1] for _ in range(4)}
    assert answers == {b"hello from a ConfigMap volume\n"}


def _pod(name: str, script: str, **spec: Any) -> str:
    doc = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
           "spec": {"containers": [{"name": "main", "image": "python:3.11-slim",
                                    "command": [sys.executable, "-c", textwrap.dedent(script)]}], **spec}}
    return yaml.safe_dump(doc)


TERM_SCRIPT = """
import signal, sys, time
def term(*_):
    open("/out/term", "w").write(repr(time.time()))
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
open("/out/started", "w").write("1")
while True:
    time.sleep(0.1)
"""


def test_deleting_a_pod_runs_prestop_then_sigterm_within_the_grace_period(
        local_cluster: Any, local_namespace: str, tmp_path: Path) -> None:
    _need_agent(local_cluster)
    out = tmp_path / "out"
    out.mkdir()
    manifest = _pod("graceful", TERM_SCRIPT, terminationGracePeriodSeconds=30,
                    volumes=[{"name": "out", "hostPath": {"path": str(out)}}])
    doc = yaml.safe_load(manifest)
    doc["spec"]["containers"][0]["volumeMounts"] = [{"name": "out", "mountPath": "/out"}]
    doc["spec"]["containers"][0]["lifecycle"] = {
        "preStop": {"exec": {"command": [sys.executable, "-c",
                                         "import time; open('/out/prestop', 'w').write(repr(time.time()))"]}}}
    local_cluster.kubectl("apply", "-n", local_namespace, "-f", "-", input_text=yaml.safe_dump(doc))
    _wait("the container started", lambda: (out / "started").exists())
    t0 = time.monotonic()
    local_cluster.kubectl("delete", "pod", "graceful", "-n", local_namespace, "--wait=true", "--timeout=60s",
                          timeout=70)
    elapsed = time.monotonic() - t0
    assert (out / "prestop").exists() and (out / "term").exists()
    assert float((out / "prestop").read_text()) <= float((out / "term").read_text())
    assert elapsed < 15, f"a SIGTERM-handling pod took {elapsed:.1f} s to go (grace 30 s)"
    assert not _get(local_cluster, "pod", local_namespace, "graceful")


def test_a_pod_that_ignores_sigterm_is_killed_after_its_grace_period(
        local_cluster: Any, local_namespace: str) -> None:
    _need_agent(local_cluster)
    script = ("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\n"
              "while True: time.sleep(0.1)\n")
    local_cluster.kubectl("apply", "-n", local_namespace, "-f", "-",
                          input_text=_pod("stubborn", script, terminationGracePeriodSeconds=3))
    _wait("Running", lambda: _get(local_cluster, "pod", local_namespace, "stubborn")["status"]["phase"] == "Running")
    t0 = time.monotonic()
    local_cluster.kubectl("delete", "pod", "stubborn", "-n", local_namespace, "--wait=true", "--timeout=60s",
                          timeout=70)
    elapsed = time.monotonic() - t0
    assert 2.5 <= elapsed < 15, f"deletion took {elapsed:.1f} s with a 3 s grace period"


def test_a_pod_whose_image_cannot_run_as_a_process_stays_waiting_with_the_reason(
        local_cluster: Any, local_namespace: str) -> None:
    _need_agent(local_cluster)
    doc = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "gpu-engine"},
           "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.6.3",
                                    "command": ["vllm", "serve", "Qwen/Qwen2.5-0.5B-Instruct"],
                                    "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
    local_cluster.kubectl("apply", "-n", local_namespace, "-f", "-", input_text=yaml.safe_dump(doc))

    def waiting() -> dict[str, Any] | None:
        st = _get(local_cluster, "pod", local_namespace, "gpu-engine").get("status") or {}
        cs = (st.get("containerStatuses") or [{}])[0]
        w = (cs.get("state") or {}).get("waiting") or {}
        return st if w.get("reason") == CANNOT_RUN else None

    st = _wait(f"the {CANNOT_RUN} reason", waiting, timeout_s=60)
    assert st["phase"] == "Pending"
    message = st["containerStatuses"][0]["state"]["waiting"]["message"]
    assert "'vllm'" in message and "vllm/vllm-openai:v0.6.3" in message
    assert st["containerStatuses"][0]["ready"] is False


def test_a_pod_waits_for_a_missing_configmap_and_starts_once_it_exists(local_cluster: Any, local_namespace: str) -> None:
    _need_agent(local_cluster)
    ns = local_namespace
    doc = yaml.safe_load(_pod("patient", "import os, time\nprint(os.environ['GREETING'], flush=True)\ntime.sleep(3600)"))
    doc["spec"]["containers"][0]["env"] = [
        {"name": "GREETING", "valueFrom": {"configMapKeyRef": {"name": "later", "key": "greeting"}}}]
    local_cluster.kubectl("apply", "-n", ns, "-f", "-", input_text=yaml.safe_dump(doc))

    def reason() -> str:
        cs = ((_get(local_cluster, "pod", ns, "patient").get("status") or {}).get("containerStatuses") or [{}])[0]
        return str(((cs.get("state") or {}).get("waiting") or {}).get("reason") or "")

    _wait("CreateContainerConfigError", lambda: reason() == CONFIG_ERROR, timeout_s=60)
    local_cluster.kubectl("create", "configmap", "later", "-n", ns, "--from-literal=greeting=hello-later")
    _wait("Running", lambda: _get(local_cluster, "pod", ns, "patient")["status"]["phase"] == "Running", timeout_s=60)
    log = local_cluster.runner(ns, "patient").log_path("main")
    _wait("the greeting in the container's log", lambda: "hello-later" in log.read_text(), timeout_s=30)


def test_a_crashing_container_is_restarted_and_a_failing_liveness_probe_restarts_its_container(
        local_cluster: Any, local_namespace: str) -> None:
    _need_agent(local_cluster)
    ns = local_namespace
    local_cluster.kubectl("apply", "-n", ns, "-f", "-", input_text=_pod("crasher", "import sys; sys.exit(3)"))
    live = yaml.safe_load(_pod("unhealthy", "import time\nwhile True: time.sleep(1)"))
    live["spec"]["containers"][0]["livenessProbe"] = {"exec": {"command": ["false"]}, "periodSeconds": 1,
                                                      "failureThreshold": 2}
    live["spec"]["terminationGracePeriodSeconds"] = 2
    local_cluster.kubectl("apply", "-n", ns, "-f", "-", input_text=yaml.safe_dump(live))

    def restarted(name: str) -> dict[str, Any] | None:
        cs = ((_get(local_cluster, "pod", ns, name).get("status") or {}).get("containerStatuses") or [{}])[0]
        return cs if cs.get("restartCount", 0) >= 1 and cs.get("lastState") else None

    crashed = _wait("the crashing container restarted", lambda: restarted("crasher"), timeout_s=60)
    assert crashed["lastState"]["terminated"]["exitCode"] == 3
    assert crashed["lastState"]["terminated"]["reason"] == "Error"
    killed = _wait("the unhealthy container restarted", lambda: restarted("unhealthy"), timeout_s=60)
    assert killed["lastState"]["terminated"]["reason"] == "LivenessProbeFailed"


def test_the_scheduler_uses_both_process_nodes_and_their_gpu_capacity(local_cluster: Any, local_namespace: str) -> None:
    _need_agent(local_cluster)
    ns = local_namespace
    nodes = {n["metadata"]["name"]: n for n in json.loads(local_cluster.kubectl("get", "nodes", "-o", "json"))["items"]}
    assert len(nodes) >= 2, "the session cluster has two process nodes"
    gpus = {int(n["status"]["allocatable"]["nvidia.com/gpu"]) for n in nodes.values()}
    assert len(gpus) == 1
    per_node = gpus.pop()
    fits, too_big = (yaml.safe_load(_pod(name, "import time\ntime.sleep(3600)")) for name in ("fits", "too-big"))
    fits["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": str(per_node)}}
    too_big["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": str(per_node + 1)}}
    local_cluster.kubectl("apply", "-n", ns, "-f", "-", input_text=yaml.safe_dump_all([fits, too_big]))
    spread = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "spread"}, "spec": {
        "replicas": 2, "selector": {"matchLabels": {"app": "spread"}}, "template": {
            "metadata": {"labels": {"app": "spread"}}, "spec": {
                "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                               "whenUnsatisfiable": "DoNotSchedule",
                                               "labelSelector": {"matchLabels": {"app": "spread"}}}],
                "containers": [{"name": "main", "image": "python:3.11-slim",
                                "command": ["python", "-c", "import time; time.sleep(3600)"]}]}}}}
    local_cluster.kubectl("apply", "-n", ns, "-f", "-", input_text=yaml.safe_dump(spread))
    local_cluster.kubectl("rollout", "status", "deployment/spread", "-n", ns, "--timeout=60s", timeout=70)
    pods = [p for p in _get(local_cluster, "pods", ns)["items"] if p["metadata"]["name"].startswith("spread-")]
    assert len({p["spec"]["nodeName"] for p in pods}) == 2
    _wait("the fitting GPU pod Running", lambda: _get(local_cluster, "pod", ns, "fits")["status"]["phase"] == "Running")

    def unschedulable() -> bool:
        conds = (_get(local_cluster, "pod", ns, "too-big").get("status") or {}).get("conditions") or []
        return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conds)

    _wait("the oversized GPU pod Unschedulable", unschedulable, timeout_s=30)


IDENTITY_SCRIPT = """
import json, os, socket, ssl, urllib.error, urllib.request
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
ns = open(sa + "/namespace").read()
ctx = ssl.create_default_context(cafile=sa + "/ca.crt")
url = (f"https://{os.environ['KUBERNETES_SERVICE_HOST']}:{os.environ['KUBERNETES_SERVICE_PORT']}"
       f"/api/v1/namespaces/{ns}/secrets")
req = urllib.request.Request(url, headers={"Authorization": "Bearer " + open(sa + "/token").read()})
try:
    urllib.request.urlopen(req, context=ctx)
    code, msg = 200, ""
except urllib.error.HTTPError as err:
    code, msg = err.code, json.loads(err.read())["message"]
version = json.load(urllib.request.urlopen("https://kubernetes.default.svc/version", context=ctx))["gitVersion"]
print(json.dumps({"namespace": ns, "code": code, "message": msg, "version": version,
                  "svc": socket.gethostbyname(f"named.{ns}.svc.cluster.local"),
                  "short": socket.gethostbyname("named")}))
"""


def test_a_pod_reaches_the_api_as_its_service_account_and_services_by_name(
        local_cluster: Any, local_namespace: str) -> None:
    _need_agent(local_cluster)
    ns = local_namespace
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "named"},
           "spec": {"selector": {"app": "none"}, "ports": [{"port": 7000}]}}
    local_cluster.kubectl("apply", "-n", ns, "-f", "-", input_text=yaml.safe_dump(svc))
    svc_ip = local_cluster.proxies.address(ns, "named", timeout_s=10)
    _wait("the default ServiceAccount", lambda: _get(local_cluster, "serviceaccount", ns, "default"))
    local_cluster.kubectl("apply", "-n", ns, "-f", "-",
                          input_text=_pod("whoami", IDENTITY_SCRIPT, restartPolicy="Never"))
    _wait("Succeeded", lambda: (_get(local_cluster, "pod", ns, "whoami").get("status") or {}).get("phase")
          in ("Succeeded", "Failed"), timeout_s=60)
    assert _get(local_cluster, "pod", ns, "whoami")["status"]["phase"] == "Succeeded"
    runner = local_cluster.runner(ns, "whoami")
    lines = [ln for ln in runner.log_path("main").read_text().splitlines() if ln.startswith("{")]
    seen = json.loads(lines[-1])
    assert seen["namespace"] == ns
    assert seen["code"] == 403 and f"system:serviceaccount:{ns}:default" in seen["message"]
    assert seen["svc"] == seen["short"] == svc_ip
    assert seen["version"] == "v1.28.0"  # kubernetes.default.svc:443, the API server through its Service proxy


# --- Fulcrum on the local cluster ------------------------------------------------------------------------


@pytest.fixture
def app_etcd(local_cluster: Any, tmp_path: Path) -> Iterator[str]:
    """An etcd for Fulcrum's instance registry (the router's ``registry: etcd``), apart from the cluster's."""
    _need_agent(local_cluster)
    with start_app_etcd(tmp_path / "app-etcd") as url:
        yield url


@pytest.fixture
def operator(local_cluster: Any, local_namespace: str, app_etcd: str, tmp_path: Path) -> Iterator[ManagedProcess]:
    """``fulcrum operator`` as a local process watching the test's namespace with the admin's credentials."""
    _need_agent(local_cluster)
    local_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    local_cluster.kubectl("wait", "--for=condition=Established", "crd/llmserves.fulcrum.dev", "--timeout=60s")
    proc = ManagedProcess("operator", [
        sys.executable, "-m", "fulcrum", "operator", "--namespace", local_namespace, "--log-format", "text",
        "--kubeconfig", str(local_cluster.kubeconfig), "--metrics-port", str(free_port()),
        "--liveness-port", str(free_port()), "--image", "ghcr.io/fulcrum-llm/fulcrum:local",
        "--etcd-endpoint", app_etcd], tmp_path / "operator.log")
    proc.start()
    try:
        yield proc
    finally:
        proc.stop(30)
        print(f"----- operator log ({proc.log}) -----\n{proc.tail(4000)}")


def test_the_operator_runs_the_sim_llmserve_and_the_router_serves_a_completion(
        local_cluster: Any, local_namespace: str, operator: ManagedProcess) -> None:
    _need_agent(local_cluster)
    _serve_the_sim_example(local_cluster, local_namespace, operator.alive)


def _serve_the_sim_example(local_cluster: Any, ns: str, operator_alive: Callable[[], bool]) -> None:
    """Apply examples/llmserve-sim.yaml in ``ns``; its three Deployments get Ready, the router's Service proxy
    answers a completion with 200, the LLMServe turns Ready."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["namespace"] = ns
    name = doc["metadata"]["name"]
    local_cluster.kubectl("apply", "-f", "-", input_text=yaml.safe_dump(doc))
    for pool in ("prefill", "decode", "router"):
        _wait(f"Deployment {name}-{pool} ready",
              lambda pool=pool: (_get(local_cluster, "deployment", ns, f"{name}-{pool}").get("status") or {})
              .get("readyReplicas"), timeout_s=240, every_s=1.0)
        assert operator_alive(), "the operator exited"
    pods = _get(local_cluster, "pods", ns)["items"]
    roles = {p["metadata"]["labels"].get("fulcrum.dev/pool") or p["metadata"]["labels"].get("app.kubernetes.io/component")
             for p in pods}
    assert roles >= {"prefill", "decode", "router"}
    assert all(p["status"]["phase"] == "Running" for p in pods)
    router_ip = local_cluster.proxies.address(ns, f"{name}-router", timeout_s=10)
    model = doc["spec"]["model"]["servedName"]

    def complete() -> tuple[int, bytes] | None:
        try:
            return _http(f"http://{router_ip}:8000/v1/completions",
                         {"model": model, "prompt": "hello " * 50, "max_tokens": 8}, timeout=30)
        except OSError:
            return None

    status, body = _wait("a completion through the router's Service", complete, timeout_s=120, every_s=2.0)
    assert status == 200
    reply = json.loads(body)
    assert reply["choices"] and reply["usage"]["completion_tokens"] == 8
    _wait("LLMServe Ready", lambda: any(c["type"] == "Ready" and c["status"] == "True" for c in
                                        (_get(local_cluster, "llmserve", ns, name).get("status") or {})
                                        .get("conditions") or []), timeout_s=120, every_s=2.0)
