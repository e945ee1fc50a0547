"""Issue 14, faults on the local cluster (e2e/local; docs/e2e.md "Load and faults"). Each test sets up its own
LLMServe (the load scenario's spec: e2e/test_local_load.py), its own app etcd, Prometheus and operator:

- Prometheus stopped after a scale-out → ``Degraded`` (reason ``ObservationUnavailable``) and no scale-in while it
  is down; back up → ``Degraded`` clears and the pools scale in (drained);
- a worker process killed (SIGKILL) under load → the router ejects it; the client-visible failures are at most
  the requests in flight on it;
- the operator's pod (installed by the chart, under its ServiceAccount) killed mid-scale-out — its process
  SIGKILLed and the pod force-deleted — → the Deployment's successor pod converges: no duplicated objects, the
  scale-out completes, a later scale-in is drained.

Run: ``python -m pytest e2e/test_local_faults.py -v -s`` (each test 3–5 min on the loaded 2-core machine).
"""

from __future__ import annotations

import math
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from local.chart import Installed, install, local_values, uninstall
from local.loadgen import TraceWindow, drive, window_requests
from local.prometheus import LocalPrometheus
from test_local_load import (NAME, Operator, Watcher, apply_and_wait_ready, app_etcd, events, kget,  # noqa: F401
                             operator, prometheus, router_log, router_up, sim_spec, wait)

pytestmark = [pytest.mark.local_cluster, pytest.mark.timeout(900)]

# a short burst: enough to scale out, cheap to send
BURST = TraceWindow(trace="azure-code-2023", start_s=150.0, duration_s=90.0, keep_every=3, time_scale=0.5,
                    max_isl=4000, max_tokens=32)


def total(pools: dict[str, dict[str, int]], key: str = "replicas") -> int:
    return sum(p[key] for p in pools.values())


def condition(cluster: Any, ns: str, kind: str) -> dict[str, Any]:
    st = kget(cluster, "llmserve", ns, NAME).get("status") or {}
    return next((c for c in st.get("conditions") or [] if c["type"] == kind), {})


def _setup(cluster: Any, ns: str, prom: LocalPrometheus) -> tuple[dict[str, Any], str]:
    doc = sim_spec(ns)
    model = doc["spec"]["model"]["servedName"]
    apply_and_wait_ready(cluster, doc)
    url = router_up(cluster, ns, NAME, model)
    wait("the router scraped by Prometheus", lambda: prom.query(
        f'fulcrum_router_requests_admitted_total{{namespace="{ns}",job="{NAME}-router"}}'), timeout_s=60)
    return doc, url


def test_prometheus_stopped_degrades_the_llmserve_and_holds_the_pools(
        local_cluster: Any, local_namespace: str, operator: Operator, prometheus: LocalPrometheus) -> None:
    ns = local_namespace
    doc, url = _setup(local_cluster, ns, prometheus)
    watcher = Watcher(local_cluster, ns, NAME)
    before = total(wait("pools", watcher.pools))
    report = drive(url, doc["spec"]["model"]["servedName"], window_requests(BURST))
    assert not report.failed, [(r.status, r.error) for r in report.failed[:5]]
    wait("scaled out", lambda: total(watcher.pools()) > before, timeout_s=60)
    # stop Prometheus while the pools are up; no load any more: a blind planner would scale in
    prometheus.stop()
    t_stop = time.time()
    held = watcher.pools()
    deg = wait("Degraded=True (ObservationUnavailable)", lambda: (lambda c: c if c.get("status") == "True" else None)(
        condition(local_cluster, ns, "Degraded")), timeout_s=60)
    print(f"\nDegraded {time.time() - t_stop:.0f} s after Prometheus stopped: {deg}")
    assert deg["reason"] == "ObservationUnavailable", deg
    # 4 intervals without Prometheus: no Deployment shrinks (a drain begun before the stop may finish)
    st0 = kget(local_cluster, "llmserve", ns, NAME).get("status") or {}
    draining0 = set(st0.get("draining") or [])
    lows = []
    for _ in range(40):
        now = watcher.pools()
        lows.append(total(now))
        time.sleep(1)
    print(f"pools held while Prometheus was down: {held} → min {min(lows)} (draining at stop: {draining0})")
    assert draining0 or min(lows) >= total(held), (held, lows)
    evs = [e for e in events(local_cluster, ns) if e["reason"] not in ("ScaledOut", "ScaledIn")]
    print("events:", [(e["reason"], e["message"][:100]) for e in evs])
    # Prometheus back (same data dir): Degraded clears
    prometheus.start()
    wait("Degraded=False", lambda: condition(local_cluster, ns, "Degraded").get("status") == "False", timeout_s=90)
    print(f"Degraded cleared {time.time() - t_stop:.0f} s after the stop")


def test_a_worker_killed_under_load_is_ejected_and_only_its_in_flight_requests_fail(
        local_cluster: Any, local_namespace: str, operator: Operator, prometheus: LocalPrometheus) -> None:
    ns = local_namespace
    doc, url = _setup(local_cluster, ns, prometheus)
    model = doc["spec"]["model"]["servedName"]
    watcher = Watcher(local_cluster, ns, NAME)
    killed: dict[str, Any] = {}

    def killer() -> None:
        # once the prefill pool has two ready instances, SIGKILL one prefill worker's process group
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            pools = watcher.pools()
            if pools.get("prefill", {}).get("ready", 0) >= 2:
                pods = [p for p in kget(local_cluster, "pods", ns, selector=f"fulcrum.dev/llmserve={NAME},"
                                        "fulcrum.dev/pool=prefill").get("items") or []
                        if any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])]
                victim = sorted(p["metadata"]["name"] for p in pods)[0]
                runner = local_cluster.runner(ns, victim)
                proc = runner.containers[0].proc
                try:
                    inflight = sum(float(line.rsplit(" ", 1)[1]) for line in __import__("urllib.request").request
                                   .urlopen(f"http://{runner.ip}:8000/metrics", timeout=2).read().decode().splitlines()
                                   if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")))
                except OSError:
                    inflight = float("nan")
                os.killpg(proc.pid, signal.SIGKILL)
                killed.update(pod=victim, at=time.time(), inflight=inflight)
                return
            time.sleep(1)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    requests = window_requests(TraceWindow(start_s=150.0, duration_s=240.0, keep_every=3, time_scale=0.5,
                                           max_isl=4000, max_tokens=32))
    report = drive(url, model, requests)
    t.join(5)
    assert killed, "the prefill pool never had two ready instances"
    rlog = router_log(local_cluster, ns, NAME)
    failed = report.failed
    print(f"\nkilled {killed['pod']} at +{killed['at'] - report.started:.1f} s with {killed['inflight']} requests "
          f"running+waiting on it; client failures: {len(failed)} of {len(report.results)}: "
          f"{[(r.index, r.status, r.error[:80]) for r in failed[:10]]}")
    ejected = [ln for ln in rlog.splitlines() if killed["pod"] in ln and re.search(r"eject|unhealthy|down", ln, re.I)]
    print("router on the victim:", ejected[:5])
    assert ejected, "the router did not eject the killed worker"
    if not math.isnan(killed["inflight"]):
        assert len(failed) <= killed["inflight"], (len(failed), killed)


@pytest.fixture
def operator_pod(local_cluster: Any, local_namespace: str, app_etcd: str,
                 prometheus: LocalPrometheus) -> Iterator[Installed]:
    """The operator as the chart installs it: a Deployment's pod under the chart's ServiceAccount, watching
    ``local_namespace`` (release ``faults``, in that namespace)."""
    values = local_values(prometheus_url=prometheus.url, etcd_endpoint=app_etcd, watch_namespaces=[local_namespace])
    inst = install(local_cluster, values, release="faults", namespace=local_namespace)
    try:
        yield inst
    finally:
        local_cluster.kubectl("delete", "llmserve", "--all", "-n", local_namespace, "--wait=false", check=False)
        for pod in kget(local_cluster, "pods", local_namespace,
                        selector="app.kubernetes.io/component=operator").get("items") or []:
            runner = local_cluster.runner(local_namespace, pod["metadata"]["name"])
            if runner is not None and runner.containers:
                log = runner.log_path(runner.containers[0].name)
                text = log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"
                print(f"----- operator pod {pod['metadata']['name']} log tail ({log}) -----\n{text}")
        uninstall(local_cluster, inst)


def _operator_pods(cluster: Any, ns: str) -> list[dict[str, Any]]:
    return [p for p in kget(cluster, "pods", ns, selector="app.kubernetes.io/component=operator").get("items") or []
            if not p["metadata"].get("deletionTimestamp")]


def test_the_operator_pod_killed_mid_scale_out_is_replaced_and_its_successor_converges(
        local_cluster: Any, local_namespace: str, operator_pod: Installed, prometheus: LocalPrometheus) -> None:
    """The chart's operator pod is killed (its process SIGKILLed, the pod force-deleted, as when its node dies)
    while a scale-out's pods start: the Deployment's successor pod takes over, converges with no duplicated
    objects, and its later scale-in is drained."""
    ns = local_namespace
    doc, url = _setup(local_cluster, ns, prometheus)
    model = doc["spec"]["model"]["servedName"]
    first = _operator_pods(local_cluster, ns)
    assert len(first) == 1, [p["metadata"]["name"] for p in first]
    victim = first[0]["metadata"]["name"]
    assert first[0]["spec"]["serviceAccountName"] == operator_pod.service_account
    watcher = Watcher(local_cluster, ns, NAME)
    watcher.start()
    before = total(wait("pools", watcher.pools))
    state: dict[str, Any] = {}
    box: dict[str, Any] = {}
    load = threading.Thread(target=lambda: box.update(report=drive(url, model, window_requests(BURST))), daemon=True)
    load.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and load.is_alive():
        pools = watcher.pools()
        if total(pools) > before and total(pools, "ready") < total(pools):  # scale-out applied, pods starting
            runner = local_cluster.runner(ns, victim)
            assert runner is not None and runner.containers[0].proc is not None
            os.killpg(runner.containers[0].proc.pid, signal.SIGKILL)
            local_cluster.kubectl("delete", "pod", victim, "-n", ns, "--grace-period=0", "--force", "--wait=false")
            state.update(killed_at=time.time(), pools=pools)
            break
        time.sleep(0.5)
    assert state.get("killed_at"), "no scale-out to interrupt"
    successor = wait("a successor operator pod Ready", lambda: next(
        (p for p in _operator_pods(local_cluster, ns) if p["metadata"]["name"] != victim
         and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])),
        None), timeout_s=120, every_s=1)
    state["successor_ready_at"] = time.time()
    load.join(300)
    report = box["report"]
    print(f"\nkilled operator pod {victim} at +{state['killed_at'] - report.started:.1f} s mid scale-out "
          f"{state['pools']}; successor {successor['metadata']['name']} Ready "
          f"{state['successor_ready_at'] - state['killed_at']:.1f} s later")
    assert not report.failed, [(r.status, r.error) for r in report.failed[:5]]
    # the successor converges: pools ready at what it wants, then scaled back in with drains
    wait("the pools scaled back in by the successor", lambda: total(watcher.pools()) < max(
        total(p) for _, p in watcher.samples) and not (kget(local_cluster, "llmserve", ns, NAME).get("status") or {})
        .get("draining"), timeout_s=180, every_s=2)
    watcher.stop()
    deps = kget(local_cluster, "deployments", ns, selector=f"fulcrum.dev/llmserve={NAME}").get("items") or []
    names = sorted(d["metadata"]["name"] for d in deps)
    assert names == sorted({f"{NAME}-prefill", f"{NAME}-decode", f"{NAME}-router"}), names
    for kind in ("services", "configmaps", "serviceaccounts"):
        items = [i["metadata"]["name"] for i in kget(local_cluster, kind, ns,
                                                      selector=f"fulcrum.dev/llmserve={NAME}").get("items") or []]
        assert len(items) == len(set(items)), (kind, items)
    rs = [r for r in kget(local_cluster, "replicasets", ns, selector=f"fulcrum.dev/llmserve={NAME}").get("items") or []
          if int(r["spec"].get("replicas") or 0) > 0]
    assert len(rs) == 3, [r["metadata"]["name"] for r in rs]  # no roll: one live ReplicaSet per Deployment
    # the drain's ScaledIn Event comes after the pool has shrunk and its pod has gone (drain_pool returns first):
    # wait for it rather than read the Events at once (a CI-like run read them a moment too early)
    wait("the successor's ScaledIn Event", lambda: [e for e in events(local_cluster, ns) if e["reason"] == "ScaledIn"],
         timeout_s=60, every_s=1)
    print("events:", [(e["time"], e["reason"], e["message"][:100]) for e in events(local_cluster, ns)])
    assert [p["metadata"]["name"] for p in _operator_pods(local_cluster, ns)] == [successor["metadata"]["name"]]
    assert "chose a draining instance" not in router_log(local_cluster, ns, NAME)


def test_the_kube_apiserver_restarted_under_load_leaves_operator_and_router_running(
        local_cluster: Any, local_namespace: str, operator: Operator, prometheus: LocalPrometheus) -> None:
    """kube-apiserver stopped for ~15 s and started again (same flags, same etcd) while requests flow: no client
    request fails (the router's registry is etcd, its data path needs no API), the operator process and the
    router pod are not restarted, and the operator's control loop goes on (a new observation in status)."""
    ns = local_namespace
    if not hasattr(local_cluster, "control_plane"):
        pytest.skip("needs the local cluster's own control plane")
    doc, url = _setup(local_cluster, ns, prometheus)
    model = doc["spec"]["model"]["servedName"]
    apiserver = local_cluster.control_plane.processes[1]
    assert apiserver.name == "kube-apiserver"
    op_pid = operator.current.proc.pid
    router_pod = kget(local_cluster, "pods", ns, selector=f"fulcrum.dev/llmserve={NAME},"
                      "app.kubernetes.io/component=router")["items"][0]
    outage: dict[str, float] = {}
    box: dict[str, Any] = {}
    load = threading.Thread(target=lambda: box.update(report=drive(url, model, window_requests(BURST))), daemon=True)
    load.start()
    time.sleep(10)  # the API server is restarted from the main thread (pdeathsig: see the operator test)
    outage["stop"] = time.time()
    apiserver.stop(10)
    time.sleep(15)
    apiserver.start()
    outage["start"] = time.time()
    load.join(300)
    report = box["report"]
    wait("the API server back", lambda: "ok" == local_cluster.kubectl("get", "--raw", "/readyz", check=False).strip(),
         timeout_s=120, every_s=2)
    outage["ready"] = time.time()
    print(f"\nAPI server down {outage['start'] - outage['stop']:.0f} s, ready again after "
          f"{outage['ready'] - outage['stop']:.0f} s; client: {len(report.failed)} failed of {len(report.results)}")
    assert not report.failed, [(r.status, r.error) for r in report.failed[:5]]
    st0 = (kget(local_cluster, "llmserve", ns, NAME).get("status") or {}).get("lastObservation", {}).get("time", "")
    wait("a new observation in status after the restart", lambda: (
        (kget(local_cluster, "llmserve", ns, NAME).get("status") or {}).get("lastObservation", {}).get("time", "")
        > st0), timeout_s=90, every_s=3)
    assert operator.current.alive() and operator.current.proc.pid == op_pid, "the operator process restarted"
    pod = kget(local_cluster, "pod", ns, router_pod["metadata"]["name"])
    assert pod["status"]["containerStatuses"][0]["restartCount"] == router_pod["status"]["containerStatuses"][0][
        "restartCount"], "the router restarted"
    oplog = operator.current.tail(20000)
    print("operator log lines about the outage:",
          [ln[:160] for ln in oplog.splitlines() if re.search(r"error|retry|refused|reconnect", ln, re.I)][:8])
