"""Fulcrum installed by its Helm chart on the local cluster (e2e/local; docs/e2e.md), observed by a real Prometheus:

- the chart (rendered by Helm's engine, tests/helm_render.py) applied with kubectl; the operator runs as a pod
  under the chart's ServiceAccount and RBAC (namespaced mode: a Role in the watched namespace);
- Prometheus (Debian's binary, a host process on 127.0.0.1) discovers the pods through ``kubernetes_sd_configs``
  and scrapes them as the chart's PodMonitor/ServiceMonitor would; the operator observes through it;
- bad LLMServes are rejected by the API server (schema + CEL); one whose Deployments the API server refuses gets
  Degraded/ApplyRejected and an Event; one naming a missing profile ConfigMap gets a
  condition and an Event and nothing is created;
- deleting the LLMServe lets kube-controller-manager's garbage collector remove everything it owned, and the
  node agent stops the pods' processes;
- finally the API server's audit log: every call of the operator's ServiceAccount, none forbidden.

The tests of this module share one install (module fixtures) and run in file order.
Run: ``python -m pytest e2e/test_local_chart.py -v -s`` (``-s`` prints the timings and the verbs list).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from local.audit import calls_of, summarise
from local.chart import REPO, Installed, install, local_values, uninstall
from local.cluster import app_etcd as start_app_etcd
from local.prometheus import (PROMETHEUS_RBAC, LocalPrometheus, PodDiscovery, kubernetes_sd_supported,
                              prometheus_binary, prometheus_config)
from local.probes import wait as _wait, kget as _get

pytestmark = [pytest.mark.local_cluster, pytest.mark.timeout(600)]

EXAMPLE = REPO / "examples" / "llmserve-sim.yaml"
RELEASE = "fulcrum-e2e"  # not "fulcrum": the chart test of test_local_cluster.py installs that one (cluster-scoped RBAC names)
LABEL_LLMSERVE = "fulcrum.dev/llmserve"
OWNED_KINDS = ("deployments.apps", "replicasets.apps", "pods", "services", "configmaps", "serviceaccounts",
               "roles.rbac.authorization.k8s.io", "rolebindings.rbac.authorization.k8s.io")
TIMINGS: dict[str, float] = {}


def _need_agent(cluster: Any) -> None:
    if cluster.agent is None or cluster.proxies is None:
        pytest.skip("needs the local cluster's process node agent (not a KUBECONFIG cluster)")


# --- module fixtures: namespaces, app etcd, Prometheus, the chart ----------------------------------------


@pytest.fixture(scope="module")
def namespaces(local_cluster: Any) -> Iterator[tuple[str, str]]:
    """(the release's namespace, the namespace the operator watches); deleted afterwards."""
    _need_agent(local_cluster)
    if prometheus_binary() is None:
        pytest.skip("prometheus is not installed (scripts/install-servers.sh installs Debian's)")
    suffix = uuid.uuid4().hex[:5]
    release_ns, watched = f"fulcrum-{suffix}", f"serve-{suffix}"
    for ns in (release_ns, watched):
        local_cluster.kubectl("create", "namespace", ns)
    try:
        yield release_ns, watched
    finally:
        for ns in (release_ns, watched):
            local_cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.fixture(scope="module")
def app_etcd_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Fulcrum's instance registry: an etcd host process on 127.0.0.1 (the chart's bundled etcd is off)."""
    with start_app_etcd(tmp_path_factory.mktemp("chart-app-etcd")) as url:
        yield url


@pytest.fixture(scope="module")
def prometheus(local_cluster: Any, namespaces: tuple[str, str],
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPrometheus]:
    """Prometheus on 127.0.0.1 discovering pods with a ServiceAccount token of its own (module doc)."""
    release_ns, watched = namespaces
    d = tmp_path_factory.mktemp("prometheus")
    local_cluster.kubectl("apply", "-f", "-", input_text=PROMETHEUS_RBAC.format(ns=release_ns))
    token = local_cluster.kubectl("create", "token", "prometheus", "-n", release_ns, "--duration=2h").strip()
    token_file = d / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    selector = {"app.kubernetes.io/name": "fulcrum", "app.kubernetes.io/instance": RELEASE,
                "app.kubernetes.io/component": "operator"}
    ca, watch = local_cluster.control_plane.pki / "ca.crt", [release_ns, watched]
    discovery = None
    if not kubernetes_sd_supported():  # Debian's build (module docstring of local.prometheus)
        discovery = PodDiscovery(local_cluster.api_url, ca, token_file, watch)
        discovery.start()
        print(f"{prometheus_binary()} has no kubernetes_sd_configs: http_sd_configs from {discovery.url}")
    cfg = prometheus_config(local_cluster.api_url, ca, token_file, scrape_interval_s=2, operator_selector=selector,
                            namespaces=watch, http_sd_url=discovery.url if discovery else None)
    prom = LocalPrometheus(d, cfg)
    t0 = time.monotonic()
    prom.start()
    TIMINGS["prometheus_ready_s"] = time.monotonic() - t0
    try:
        yield prom
    finally:
        prom.stop()
        if discovery is not None:
            discovery.stop()
        local_cluster.kubectl("delete", "clusterrole,clusterrolebinding", f"{release_ns}-prometheus",
                              "--ignore-not-found", check=False)
        print(f"----- prometheus log ({prom.workdir / 'prometheus.log'}) -----\n{prom.tail(2000)}")


@pytest.fixture(scope="module")
def chart(local_cluster: Any, namespaces: tuple[str, str], app_etcd_url: str,
          prometheus: LocalPrometheus) -> Iterator[Installed]:
    """The chart installed (namespaced mode: the operator watches ``namespaces[1]``); removed afterwards."""
    release_ns, watched = namespaces
    values = local_values(prometheus_url=prometheus.url, etcd_endpoint=app_etcd_url, watch_namespaces=[watched])
    t_install = time.time()
    inst = install(local_cluster, values, release=RELEASE, namespace=release_ns, ready_timeout_s=240)
    inst.timings_s["wall_clock_start"] = t_install
    TIMINGS.update({f"chart_{k}_s": v for k, v in inst.timings_s.items() if k != "wall_clock_start"})
    try:
        yield inst
    finally:
        pods = _get(local_cluster, "pods", release_ns).get("items") or []
        for p in pods:
            runner = local_cluster.runner(release_ns, p["metadata"]["name"])
            if runner is not None:
                print(f"----- {p['metadata']['name']} (operator log) -----\n"
                      + runner.log_path("operator").read_text(errors="replace")[-4000:])
        uninstall(local_cluster, inst)
        print("timings (s): " + json.dumps({k: round(v, 1) for k, v in TIMINGS.items()}))


def _sim_llmserve(ns: str, name: str, **spec: Any) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"] = {"name": name, "namespace": ns}
    doc["spec"]["scaling"]["intervalSeconds"] = 10
    doc["spec"].update(spec)
    return doc


@pytest.fixture(scope="module")
def sim_serve(local_cluster: Any, chart: Installed, namespaces: tuple[str, str]) -> Iterator[dict[str, Any]]:
    """examples/llmserve-sim.yaml (interval 10 s) in the watched namespace, its three Deployments ready."""
    ns = namespaces[1]
    doc = _sim_llmserve(ns, "sim")
    t0 = time.monotonic()
    local_cluster.kubectl("apply", "-f", "-", input_text=yaml.safe_dump(doc))
    for pool in ("prefill", "decode", "router"):
        _wait(f"Deployment sim-{pool} ready",
              lambda pool=pool: (_get(local_cluster, "deployment", ns, f"sim-{pool}").get("status") or {})
              .get("readyReplicas"), timeout_s=240, every_s=1.0)
    TIMINGS["llmserve_pools_ready_s"] = time.monotonic() - t0
    yield _get(local_cluster, "llmserve", ns, "sim")
    local_cluster.kubectl("delete", "llmserve", "sim", "-n", ns, "--ignore-not-found", "--wait=false", check=False)


# --- 1. the chart ------------------------------------------------------------------------------------------


def test_the_chart_installs_and_the_operator_runs_as_a_pod_under_its_service_account(
        local_cluster: Any, chart: Installed, namespaces: tuple[str, str], prometheus: LocalPrometheus) -> None:
    release_ns, watched = namespaces
    pods = _get(local_cluster, "pods", release_ns, selector="app.kubernetes.io/component=operator")["items"]
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    pod = pods[0]
    assert pod["spec"]["serviceAccountName"] == chart.service_account
    assert pod["status"]["phase"] == "Running"
    assert {c["type"]: c["status"] for c in pod["status"]["conditions"]}["Ready"] == "True"
    args = pod["spec"]["containers"][0]["args"]
    assert f"--namespace={watched}" in args and f"--prometheus-url={prometheus.url}" in args
    runner = local_cluster.runner(release_ns, pod["metadata"]["name"])
    assert runner is not None and runner.containers[0].proc is not None
    assert runner.containers[0].proc.poll() is None, "the operator's process is not running"
    # logged in as its ServiceAccount: kopf keeps its liveness in the status of the chart's KopfPeering
    _wait("the operator in the KopfPeering's status", lambda: (_get(local_cluster, "kopfpeering", watched, "fulcrum")
                                                              .get("status") or {}), timeout_s=90)
    pod = _get(local_cluster, "pod", release_ns, pod["metadata"]["name"])
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0, pod["status"]["containerStatuses"]
    # the ServiceMonitor's equivalent: Prometheus scrapes the operator's metrics port
    ip = pod["status"]["podIP"]

    def operator_target_up() -> bool:
        return any(t["labels"].get("job") == "fulcrum-operator" and t["health"] == "up"
                   and t["scrapeUrl"].startswith(f"http://{ip}:9090") for t in prometheus.targets())

    _wait("the operator's metrics target up", operator_target_up, timeout_s=60)
    print(f"chart installed, operator Ready in {chart.timings_s['operator_ready']:.1f} s "
          f"(render {chart.timings_s['render']:.1f} s, CRDs {chart.timings_s['crds']:.1f} s)")


# --- 3. bad input ---------------------------------------------------------------------------------------

# (name, how the valid base is broken, what the API server's message must contain)
BAD: list[tuple[str, Callable[[dict[str, Any]], None], list[str]]] = [
    ("no-model", lambda d: d["spec"].pop("model"), ["spec.model", "Required value"]),
    ("empty-model-name", lambda d: d["spec"]["model"].update(name=""), ["spec.model.name", "at least 1 chars"]),
    ("engine-kind", lambda d: d["spec"]["engine"].update(kind="tpu"), ["spec.engine.kind", "Unsupported value"]),
    ("mode", lambda d: d["spec"].update(mode="Hybrid"), ["spec.mode", "Unsupported value"]),
    ("percentile", lambda d: d["spec"]["slo"].update(percentile=150), ["spec.slo.percentile", "less than or equal to 100"]),
    ("ttft-zero", lambda d: d["spec"]["slo"].update(ttftMs=0), ["spec.slo.ttftMs", "greater than 0"]),
    ("max-model-len", lambda d: d["spec"]["engine"].update(maxModelLen=8), ["spec.engine.maxModelLen", "greater than or equal to 16"]),
    ("min-over-max", lambda d: d["spec"]["scaling"].update(minGPUs=10, maxGPUs=4), ["spec.scaling.minGPUs", "minGPUs must be <= maxGPUs"]),
    ("external-no-replicas", lambda d: d["spec"]["scaling"].update(replicaOwner="External"),
     ["spec.scaling.replicas", "replicaOwner External requires replicas"]),
    ("replicas-over-max", lambda d: d["spec"]["scaling"].update(replicaOwner="External", replicas=20),
     ["spec.scaling.replicas", "replicas must be <= maxGPUs"]),
    ("two-profiles", lambda d: d["spec"].update(profile={"name": "dopd-llama70b-fp8-h100", "configMap": "p"}),
     ["spec.profile", "set exactly one of name, path, configMap"]),
    ("prefix-pull", lambda d: d["spec"]["router"].update(prefixPull=True), ["spec.router.prefixPull", "requires router.policy load_aware"]),
    # (router.prefillQueue nats without connectors.nats is the operator's check, after its --nats-url default)
    ("min-gpus-over-limit", lambda d: d["spec"]["scaling"].update(minGPUs=70_000, maxGPUs=70_000),
     ["spec.scaling.maxGPUs", "less than or equal to 65536"]),
    ("initial-prefill-over-limit", lambda d: d["spec"]["scaling"].update(initialPrefill=5000),
     ["spec.scaling.initialPrefill", "less than or equal to 4096"]),
    ("tp-over-node", lambda d: d["spec"].update(gpu={"gpusPerNode": 2}) or d["spec"]["scaling"].update(tpDecode=4),
     ["spec.scaling.tpDecode", "must be <= gpu.gpusPerNode"]),
    ("router-policy", lambda d: d["spec"]["router"].update(policy="random"), ["spec.router.policy", "Unsupported value"]),
    ("unknown-field", lambda d: d["spec"].update(gpuCount=8), ["spec.gpuCount", "unknown field"]),
    ("max-gpus-string", lambda d: d["spec"]["scaling"].update(maxGPUs="8"), ["spec.scaling.maxGPUs", "must be of type integer"]),
    ("forecaster-order", lambda d: d["spec"]["scaling"].update(forecaster={"order": [-1, 0, 0]}),
     ["spec.scaling.forecaster.order[0]", "greater than or equal to 0"]),
    ("forecaster-order-huge", lambda d: d["spec"]["scaling"].update(forecaster={"order": [2**70, 1, 1]}),
     ["spec.scaling.forecaster.order[0]"]),
    ("dopd-unified", lambda d: d["spec"].update(mode="Unified", scaling={"planner": "dopd"}),
     ["spec.scaling.planner", "need mode Disaggregated or Auto"]),
    ("cpu-quantity", lambda d: d["spec"]["engine"].update(resources={"requests": {"cpu": "lots"}}),
     ["spec.engine.resources.requests.cpu", "should match"]),
    ("toleration-no-key", lambda d: d["spec"].update(placement={"tolerations": [{"effect": "NoSchedule"}]}),
     ["spec.placement.tolerations[0].operator", "operator must be Exists when key is empty"]),
    ("toleration-exists-value", lambda d: d["spec"].update(
        placement={"tolerations": [{"key": "a", "operator": "Exists", "value": "v"}]}),
     ["spec.placement.tolerations[0].value", "value must be empty when operator is Exists"]),
    ("toleration-seconds", lambda d: d["spec"].update(
        placement={"tolerations": [{"key": "a", "effect": "NoSchedule", "tolerationSeconds": 5}]}),
     ["spec.placement.tolerations[0].effect", "effect must be NoExecute when tolerationSeconds is set"]),
    # ValidateTolerations' label rules: a non-empty key is a label key, a value (with Equal) a label value
    ("toleration-key", lambda d: d["spec"].update(placement={"tolerations": [{"key": "bad key!", "operator": "Exists"}]}),
     ["spec.placement.tolerations[0].key", "should match"]),
    ("toleration-key-prefix", lambda d: d["spec"].update(
        placement={"tolerations": [{"key": "Example.com/x", "operator": "Exists"}]}),
     ["spec.placement.tolerations[0].key", "should match"]),
    ("toleration-key-prefix-too-long", lambda d: d["spec"].update(
        placement={"tolerations": [{"key": "p" * 254 + "/x", "operator": "Exists"}]}),
     ["spec.placement.tolerations[0].key", "prefix part of the key (before '/') must be no more than 253 characters"]),
    ("toleration-value", lambda d: d["spec"].update(
        placement={"tolerations": [{"key": "a", "operator": "Equal", "value": "a b"}]}),
     ["spec.placement.tolerations[0].value", "should match"]),
    ("toleration-value-too-long", lambda d: d["spec"].update(
        placement={"tolerations": [{"key": "a", "operator": "Equal", "value": "v" * 64}]}),
     ["spec.placement.tolerations[0].value", "may not be longer than 63"]),
    # Kubernetes' label rules on what becomes the worker pods' nodeSelector (else the operator's apply gets a 422)
    ("selector-value", lambda d: d["spec"].update(placement={"nodeSelector": {"pool": "H100 SXM"}}),
     ["spec.placement.nodeSelector.pool", "should match"]),
    ("selector-value-too-long", lambda d: d["spec"].update(placement={"nodeSelector": {"pool": "v" * 64}}),
     ["spec.placement.nodeSelector.pool", "may not be longer than 63"]),
    ("selector-key", lambda d: d["spec"].update(placement={"nodeSelector": {"bad key!": "x"}}),
     ["spec.placement.nodeSelector", "every key must be a valid label key"]),
    ("selector-key-prefix", lambda d: d["spec"].update(placement={"nodeSelector": {"Example.com/pool": "x"}}),
     ["spec.placement.nodeSelector", "every key must be a valid label key"]),
    ("selector-too-many", lambda d: d["spec"].update(placement={"nodeSelector": {f"k{i}": "v" for i in range(65)}}),
     ["spec.placement.nodeSelector", "must have at most 64 items"]),
    # engine kind vllm: a sim worker gets no GPU-type selector, so its gpu.type need not be a label value
    ("gpu-type-label-value", lambda d: d["spec"].update(gpu={"type": "H100 SXM"}, engine={"kind": "vllm"},
                                                        placement={"gpuTypeLabel": "nvidia.com/gpu.product"}),
     ["spec.gpu.type", "must be a valid label value when placement.gpuTypeLabel is set and engine.kind is vllm"]),
    ("batched-tokens-below-seqs", lambda d: d["spec"]["engine"].update(maxNumSeqs=512, maxNumBatchedTokens=256),
     ["spec.engine", "maxNumBatchedTokens"]),
    ("gpu-type-label-key", lambda d: d["spec"].update(placement={"gpuTypeLabel": "gpu product"}),
     ["spec.placement.gpuTypeLabel", "should match"]),
    ("name-too-long-" + "x" * 42, lambda d: None, ["metadata.name", "55"]),
]


def test_invalid_llmserves_are_rejected_by_the_api_server_naming_the_field(
        local_cluster: Any, chart: Installed, namespaces: tuple[str, str]) -> None:
    ns = namespaces[1]
    messages: dict[str, str] = {}
    t0 = time.monotonic()
    for name, breaks, expected in BAD:
        doc = _sim_llmserve(ns, f"bad-{name}")
        breaks(doc)
        argv = ["kubectl", "--kubeconfig", str(local_cluster.kubeconfig), "apply", "-f", "-"]
        proc = subprocess.run(argv, input=yaml.safe_dump(doc), capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0, f"{name}: accepted: {proc.stdout}"
        messages[name] = proc.stderr.strip()
        for part in expected:
            assert part in proc.stderr, f"{name}: {part!r} not in the API server's message: {proc.stderr}"
    TIMINGS["bad_input_s"] = time.monotonic() - t0
    assert not (_get(local_cluster, "llmserves", ns).get("items") or [])
    print(f"{len(messages)} invalid LLMServes rejected:")
    for name, msg in messages.items():
        print(f"  {name[:24]:24} {msg[:300]}")


def test_tolerations_kubernetes_takes_are_taken_by_the_api_server(
        local_cluster: Any, chart: Installed, namespaces: tuple[str, str]) -> None:
    # the other side of BAD's toleration rows: the patterns and the prefix rule (RE2, null-valued fields) refuse
    # nothing Kubernetes takes on a pod
    tolerations = [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "p" * 253 + "/" + "n" * 63, "operator": "Equal", "value": "v" * 63},
        {"key": "My_Taint.v-2", "value": "A100_80GB.v-2"},
        {"key": "a", "operator": "Equal", "value": ""},
        {"key": "", "operator": "Exists"},
        {"key": None, "operator": "Exists", "value": None},
    ]
    doc = _sim_llmserve(namespaces[1], "good-tolerations", placement={"tolerations": tolerations})
    argv = ["kubectl", "--kubeconfig", str(local_cluster.kubeconfig), "apply", "--dry-run=server", "-f", "-"]
    proc = subprocess.run(argv, input=yaml.safe_dump(doc), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_a_missing_profile_configmap_sets_a_condition_and_an_event_and_creates_nothing(
        local_cluster: Any, chart: Installed, namespaces: tuple[str, str]) -> None:
    ns = namespaces[1]
    doc = _sim_llmserve(ns, "no-profile", profile={"configMap": "does-not-exist"})
    t0 = time.monotonic()
    local_cluster.kubectl("apply", "-f", "-", input_text=yaml.safe_dump(doc))
    try:
        def condition() -> dict[str, Any] | None:
            st = _get(local_cluster, "llmserve", ns, "no-profile").get("status") or {}
            return next((c for c in st.get("conditions") or [] if c["type"] == "Degraded"
                         and c["status"] == "True" and c["reason"] == "InvalidSpec"), None)

        cond = _wait("Degraded/InvalidSpec", condition, timeout_s=120, every_s=1.0)
        assert "does-not-exist" in cond["message"]
        ready = next(c for c in _get(local_cluster, "llmserve", ns, "no-profile")["status"]["conditions"]
                     if c["type"] == "Ready")
        assert ready["status"] == "False" and ready["reason"] == "InvalidSpec"

        def event() -> dict[str, Any] | None:
            evs = _get(local_cluster, "events", ns).get("items") or []
            return next((e for e in evs if e["involvedObject"].get("name") == "no-profile"
                         and e["reason"] == "InvalidSpec"), None)

        ev = _wait("the InvalidSpec Event", event, timeout_s=60)
        assert ev["type"] == "Warning" and "does-not-exist" in ev["message"]
        TIMINGS["missing_profile_s"] = time.monotonic() - t0
        time.sleep(3)  # give a half-done reconcile the chance to show
        for kind in OWNED_KINDS:
            items = _get(local_cluster, kind, ns, selector=f"{LABEL_LLMSERVE}=no-profile").get("items") or []
            assert not items, f"{kind} created for an LLMServe whose profile is missing: " \
                              f"{[i['metadata']['name'] for i in items]}"
        print(f"missing profile: condition {cond['reason']!r} ({cond['message']}); Event {ev['reason']} "
              f"in {TIMINGS['missing_profile_s']:.1f} s")
    finally:
        local_cluster.kubectl("delete", "llmserve", "no-profile", "-n", ns, "--ignore-not-found", check=False)


def test_a_deployment_the_api_server_rejects_sets_apply_rejected_and_an_event(
        local_cluster: Any, chart: Installed, namespaces: tuple[str, str]) -> None:
    # a node-affinity key Kubernetes refuses on a pod template (affinity is passed through to the pods unchecked;
    # a bad nodeSelector key is refused by the CRD itself, see BAD): the API server answers the operator's apply of
    # the worker Deployments with 422, which is the spec's fault and is reported as Degraded/ApplyRejected with a
    # Warning Event, not retried every 10 s in silence
    ns = namespaces[1]
    term = {"matchExpressions": [{"key": "bad key!", "operator": "In", "values": ["x"]}]}
    doc = _sim_llmserve(ns, "rejected", placement={"affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}})
    t0 = time.monotonic()
    local_cluster.kubectl("apply", "-f", "-", input_text=yaml.safe_dump(doc))
    try:
        def condition() -> dict[str, Any] | None:
            st = _get(local_cluster, "llmserve", ns, "rejected").get("status") or {}
            return next((c for c in st.get("conditions") or [] if c["type"] == "Degraded"
                         and c["status"] == "True" and c["reason"] == "ApplyRejected"), None)

        cond = _wait("Degraded/ApplyRejected", condition, timeout_s=120, every_s=1.0)
        assert "422" in cond["message"] and "bad key!" in cond["message"], cond["message"]

        def event() -> dict[str, Any] | None:
            evs = _get(local_cluster, "events", ns).get("items") or []
            return next((e for e in evs if e["involvedObject"].get("name") == "rejected"
                         and e["reason"] == "ApplyRejected"), None)

        ev = _wait("the ApplyRejected Event", event, timeout_s=60)
        assert ev["type"] == "Warning"
        print(f"rejected apply: condition {cond['reason']!r} ({cond['message'][:300]}); Event in "
              f"{time.monotonic() - t0:.1f} s")
    finally:
        local_cluster.kubectl("delete", "llmserve", "rejected", "-n", ns, "--ignore-not-found", check=False)


# --- 2. Prometheus for real -------------------------------------------------------------------------------


def _completions(url: str, model: str, stop: threading.Event, sent: list[int]) -> None:
    body = json.dumps({"model": model, "prompt": "hello " * 40, "max_tokens": 8}).encode()
    while not stop.is_set():
        try:
            req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:  # noqa: S310 (the router's loopback Service proxy)
                sent.append(r.status)
        except OSError:
            sent.append(0)
        stop.wait(1.5)


def test_prometheus_scrapes_the_pods_and_the_operator_observes_through_it(
        local_cluster: Any, chart: Installed, namespaces: tuple[str, str], prometheus: LocalPrometheus,
        sim_serve: dict[str, Any]) -> None:
    ns = namespaces[1]
    pods = _get(local_cluster, "pods", ns, selector=f"{LABEL_LLMSERVE}=sim")["items"]
    ips = {p["metadata"]["name"]: p["status"]["podIP"] for p in pods}
    assert {p["metadata"]["labels"].get("fulcrum.dev/pool") or p["metadata"]["labels"].get("app.kubernetes.io/component")
            for p in pods} >= {"prefill", "decode", "router"}
    t0 = time.monotonic()

    def all_up() -> dict[str, dict[str, Any]] | None:
        up = {t["labels"].get("pod"): t for t in prometheus.targets()
              if t["labels"].get("namespace") == ns and t["health"] == "up"}
        return up if set(ips) <= set(up) else None

    up = _wait("router and sim-worker pods up in Prometheus", all_up, timeout_s=90, every_s=1.0)
    TIMINGS["targets_up_s"] = time.monotonic() - t0
    for pod, ip in ips.items():
        assert up[pod]["scrapeUrl"] == f"http://{ip}:8000/metrics", up[pod]["scrapeUrl"]
    jobs = {up[p]["labels"]["job"] for p in ips}
    assert jobs == {"sim-prefill", "sim-decode", "sim-router"}, jobs

    router_ip = local_cluster.proxies.address(ns, "sim-router", timeout_s=10)
    stop, sent = threading.Event(), list[int]()
    load = threading.Thread(target=_completions, args=(f"http://{router_ip}:8000/v1/completions",
                                                      sim_serve["spec"]["model"]["servedName"], stop, sent),
                            daemon=True)
    load.start()
    try:
        _wait("the router's fulcrum_router_requests_admitted_total in Prometheus",
              lambda: prometheus.query(f'fulcrum_router_requests_admitted_total{{namespace="{ns}",job="sim-router"}}'),
              timeout_s=90, every_s=1.0)

        def observed() -> dict[str, Any] | None:
            st = _get(local_cluster, "llmserve", ns, "sim").get("status") or {}
            obs = st.get("lastObservation") or {}
            return st if obs.get("arrivals", 0) > 0 else None

        st = _wait("status.lastObservation with arrivals", observed, timeout_s=150, every_s=2.0)
        TIMINGS["observed_s"] = time.monotonic() - t0
        # the operator's own fulcrum_operator_forecast_rate (set only after an observation), scraped in turn
        rate = _wait("fulcrum_operator_forecast_rate in Prometheus", lambda: prometheus.query(
            f'fulcrum_operator_forecast_rate{{llmserve="{ns}/sim",quantile="mean"}}'), timeout_s=60, every_s=2.0)
    finally:
        stop.set()
        load.join(35)
    assert any(code == 200 for code in sent), sent
    degraded: dict[str, Any] = next((c for c in st.get("conditions") or [] if c["type"] == "Degraded"), {})
    assert not (degraded.get("status") == "True" and "Prometheus" in degraded.get("message", "")), degraded
    print(f"targets up after {TIMINGS['targets_up_s']:.1f} s; observed after {TIMINGS['observed_s']:.1f} s: "
          f"lastObservation={st['lastObservation']}, forecast={st.get('forecast')}, "
          f"fulcrum_operator_forecast_rate={rate[0]['value'][1]} ({sum(c == 200 for c in sent)} completions)")


# --- 4. deletion -----------------------------------------------------------------------------------------


def test_deleting_the_llmserve_garbage_collects_what_it_owned_and_stops_the_processes(
        local_cluster: Any, chart: Installed, namespaces: tuple[str, str], sim_serve: dict[str, Any]) -> None:
    ns = namespaces[1]
    uid = sim_serve["metadata"]["uid"]
    owned: dict[str, list[str]] = {}
    uids: set[str] = {uid}
    for kind in OWNED_KINDS:  # owned directly (Deployments, Services, …) or through them (ReplicaSets, Pods)
        for obj in _get(local_cluster, kind, ns).get("items") or []:
            owners = {o["uid"] for o in obj["metadata"].get("ownerReferences") or []}
            if owners & uids:
                owned.setdefault(kind, []).append(obj["metadata"]["name"])
                uids.add(obj["metadata"]["uid"])
    assert {"deployments.apps", "replicasets.apps", "pods", "services", "configmaps"} <= set(owned), owned
    pids: dict[str, list[int]] = {}
    for pod in owned["pods"]:
        runner = local_cluster.runner(ns, pod)
        assert runner is not None, pod
        pids[pod] = [c.proc.pid for c in runner.containers if c.proc is not None]
        assert pids[pod], pod
    t0 = time.monotonic()
    local_cluster.kubectl("delete", "llmserve", "sim", "-n", ns, "--wait=true", "--timeout=60s", timeout=70)

    def remaining() -> dict[str, list[str]]:
        left: dict[str, list[str]] = {}
        for kind in OWNED_KINDS:
            for obj in _get(local_cluster, kind, ns).get("items") or []:
                if obj["metadata"]["uid"] in uids:
                    left.setdefault(kind, []).append(obj["metadata"]["name"])
        return left

    _wait("the garbage collector removing every owned object", lambda: not remaining() or None, timeout_s=180,
          every_s=1.0)
    TIMINGS["gc_s"] = time.monotonic() - t0

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        try:  # a zombie is gone for our purpose
            return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
        except OSError:
            return False

    _wait("the pods' runners stopped", lambda: all(local_cluster.runner(ns, p) is None for p in pids) or None,
          timeout_s=60)
    _wait("the pods' processes gone", lambda: not [p for ps in pids.values() for p in ps if alive(p)] or None,
          timeout_s=30)
    TIMINGS["processes_gone_s"] = time.monotonic() - t0
    print(f"deleted: {sum(len(v) for v in owned.values())} owned objects gone in {TIMINGS['gc_s']:.1f} s, "
          f"processes in {TIMINGS['processes_gone_s']:.1f} s: "
          + ", ".join(f"{k.split('.')[0]} {len(v)}" for k, v in owned.items()))


# --- 1b. the audit log ------------------------------------------------------------------------------------


def test_the_operator_service_account_was_never_forbidden(
        local_cluster: Any, chart: Installed, namespaces: tuple[str, str]) -> None:
    release_ns, _ = namespaces
    user = f"system:serviceaccount:{release_ns}:{chart.service_account}"
    log = local_cluster.control_plane.audit_log
    calls = calls_of(log, user)
    assert calls, f"no audited call of {user} in {log}"
    table = summarise(calls)
    print(f"{len(calls)} API calls of {user} (verb group/resource: codes):")
    for what, codes in table.items():
        print(f"  {what:55} " + ", ".join(f"{c}×{n}" for c, n in sorted(codes.items())))
    forbidden = [c for c in calls if c.code == 403]
    assert not forbidden, "forbidden: " + "; ".join(sorted({f"{c.what} {c.namespace}/{c.name}" for c in forbidden}))
    verbs = set(table)
    for need in ("watch fulcrum.dev/llmserves", "patch fulcrum.dev/llmserves/status", "create core/events",
                 "patch apps/deployments"):
        assert need in verbs, f"{need!r} not among the operator's calls: {sorted(verbs)}"
