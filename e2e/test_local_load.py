"""Issue 14, load: Fulcrum under a bursty trace on the local cluster (e2e/local; docs/e2e.md "Load and faults").

``fulcrum operator`` (a local process, observing through a real Prometheus with pod discovery) runs an LLMServe
like examples/llmserve-sim.yaml tuned for a fast test (interval 10 s, start-up 10 s, cooldown 10 s, maxGPUs 8).
A window of the bundled Azure code trace (thinned, time-compressed: ≤ 300 requests in ~100 s, outputs ≤ 32
tokens) is sent through the router's Service proxy by an aiohttp client (streamed completions). Asserts:
the pools scale out during the burst and back in after it; every scale-in is a drain (ScaledIn Events naming the
drained pods, the router marked them draining, their load never grew once marked, the router never chose one);
0 failed client requests (200, ``[DONE]``, all ``max_tokens`` tokens). Prints SLO attainment, GPU-seconds and
every scale event; then the same window through ``fulcrum replay``'s simulator with the same spec, side by side.

Run: ``python -m pytest e2e/test_local_load.py -v -s`` (about 6 min on the loaded 2-core machine).
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from local.cluster import ManagedProcess, app_etcd as start_app_etcd, free_port
from local.loadgen import TraceWindow, drive, replay_window, window_requests
from local.prometheus import (PROMETHEUS_RBAC, LocalPrometheus, PodDiscovery, kubernetes_sd_supported,
                              prometheus_binary, prometheus_config)
from local.probes import wait, kget

pytestmark = [pytest.mark.local_cluster, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "llmserve-sim.yaml"
NAME = "load"
WINDOW = TraceWindow(trace="azure-code-2023", start_s=150.0, duration_s=240.0, keep_every=3, time_scale=0.5,
                     max_isl=4000, max_tokens=32)
RESULTS = Path(os.environ.get("FULCRUM_E2E_RESULTS", "/tmp/fulcrum-e2e-load"))


def http_get(url: str, timeout: float = 3.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (loopback addresses of this harness)
        return r.read().decode()


def sim_spec(ns: str, name: str = NAME) -> dict[str, Any]:
    """examples/llmserve-sim.yaml tuned for a fast test."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"] = {"name": name, "namespace": ns}
    doc["spec"]["scaling"].update(intervalSeconds=10, podStartupSeconds=10, cooldownSeconds=10, maxGPUs=8,
                                  drainTimeoutSeconds=30)
    # a sim-worker is a sleeping Python loop: little CPU; requests are small enough to stay cheap
    doc["spec"]["engine"]["resources"] = {"requests": {"cpu": "10m", "memory": "64Mi"}}
    return doc


# --- fixtures: app etcd, Prometheus, the operator ----------------------------------------------------------


def need_agent(cluster: Any) -> None:
    if cluster.agent is None or cluster.proxies is None:
        pytest.skip("needs the local cluster's process node agent and Service proxies")
    if prometheus_binary() is None:
        pytest.skip("prometheus is not installed (scripts/install-servers.sh installs Debian's)")


@pytest.fixture
def app_etcd(local_cluster: Any, tmp_path: Path) -> Iterator[str]:
    need_agent(local_cluster)
    with start_app_etcd(tmp_path / "app-etcd") as url:
        yield url


@pytest.fixture
def prometheus(local_cluster: Any, local_namespace: str, tmp_path: Path) -> Iterator[LocalPrometheus]:
    need_agent(local_cluster)
    ns = local_namespace
    d = tmp_path / "prometheus"
    d.mkdir()
    local_cluster.kubectl("apply", "-f", "-", input_text=PROMETHEUS_RBAC.format(ns=ns))
    token = local_cluster.kubectl("create", "token", "prometheus", "-n", ns, "--duration=2h").strip()
    token_file = d / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    ca = local_cluster.control_plane.pki / "ca.crt"
    discovery = None
    if not kubernetes_sd_supported():
        discovery = PodDiscovery(local_cluster.api_url, ca, token_file, [ns])
        discovery.start()
    cfg = prometheus_config(local_cluster.api_url, ca, token_file, scrape_interval_s=2, namespaces=[ns],
                            http_sd_url=discovery.url if discovery else None)
    prom = LocalPrometheus(d, cfg)
    prom.start()
    try:
        yield prom
    finally:
        prom.stop()
        if discovery is not None:
            discovery.stop()
        local_cluster.kubectl("delete", "clusterrole,clusterrolebinding", f"{ns}-prometheus", "--ignore-not-found",
                              check=False)


@dataclass
class Operator:
    """``fulcrum operator`` as a local process; ``restart()`` starts a new one (the fault scenarios)."""

    cluster: Any
    namespace: str
    etcd: str
    prometheus_url: str
    workdir: Path
    procs: list[ManagedProcess] = field(default_factory=list)
    metrics_port: int = 0

    def start(self) -> ManagedProcess:
        self.metrics_port = free_port()
        proc = ManagedProcess(f"operator-{len(self.procs)}", [
            sys.executable, "-m", "fulcrum", "operator", "--namespace", self.namespace, "--log-format", "text",
            "--kubeconfig", str(self.cluster.kubeconfig), "--metrics-port", str(self.metrics_port),
            "--liveness-port", str(free_port()), "--image", "ghcr.io/fulcrum-llm/fulcrum:local",
            "--etcd-endpoint", self.etcd, "--drain-poll-seconds", "1",
            *(["--prometheus-url", self.prometheus_url] if self.prometheus_url else [])],
            self.workdir / f"operator-{len(self.procs)}.log")
        proc.start()
        self.procs.append(proc)
        return proc

    @property
    def current(self) -> ManagedProcess:
        return self.procs[-1]

    def metrics(self) -> str:
        return http_get(f"http://127.0.0.1:{self.metrics_port}/metrics")

    def stop(self) -> None:
        for p in self.procs:
            p.stop(30)


@pytest.fixture
def operator(local_cluster: Any, local_namespace: str, app_etcd: str, prometheus: LocalPrometheus,
             tmp_path: Path) -> Iterator[Operator]:
    local_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    local_cluster.kubectl("wait", "--for=condition=Established", "crd/llmserves.fulcrum.dev", "--timeout=60s")
    op = Operator(local_cluster, local_namespace, app_etcd, prometheus.url, tmp_path)
    op.start()
    try:
        yield op
    finally:
        local_cluster.kubectl("delete", "llmserve", "--all", "-n", local_namespace, "--wait=false", check=False)
        op.stop()
        for p in op.procs:
            print(f"----- {p.name} log ({p.log}) tail -----\n{p.tail(3000)}")


# --- what the test watches while the load runs ------------------------------------------------------------


@dataclass
class Watcher:
    """Polls (every ``every_s``) the pool Deployments, the router ConfigMap's ``draining`` list and each
    draining pod's load (``/metrics`` on its pod IP) in a thread."""

    cluster: Any
    ns: str
    name: str
    every_s: float = 1.0
    samples: list[tuple[float, dict[str, dict[str, int]]]] = field(default_factory=list)
    draining_seen: dict[str, float] = field(default_factory=dict)  # pod → first time in the ConfigMap's list
    drain_load: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # pod → (t, running+waiting)
    pod_ips: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="watcher")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(10)

    def pools(self) -> dict[str, dict[str, int]]:
        items = kget(self.cluster, "deployments", self.ns, selector=f"fulcrum.dev/llmserve={self.name}").get("items") or []
        out = {}
        for d in items:
            pool = d["metadata"]["labels"].get("fulcrum.dev/pool")
            if pool:
                tp = int(d["metadata"]["labels"].get("fulcrum.dev/tp") or 1)
                out[pool] = {"replicas": int(d["spec"].get("replicas") or 0),
                             "ready": int((d.get("status") or {}).get("readyReplicas") or 0), "tp": tp}
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.time()
            try:
                self.samples.append((t, self.pools()))
                cm = kget(self.cluster, "configmap", self.ns, f"{self.name}-router")
                cfg = yaml.safe_load((cm.get("data") or {}).get("router.yaml") or "{}") or {}
                draining = list(cfg.get("draining") or [])
                if draining:
                    for p in kget(self.cluster, "pods", self.ns).get("items") or []:
                        if p["status"].get("podIP"):
                            self.pod_ips[p["metadata"]["name"]] = p["status"]["podIP"]
                for pod in draining:
                    self.draining_seen.setdefault(pod, t)
                    ip = self.pod_ips.get(pod)
                    if ip:
                        try:
                            text = http_get(f"http://{ip}:8000/metrics", timeout=2)
                        except OSError:
                            continue
                        load = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                                   if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")))
                        self.drain_load.setdefault(pod, []).append((time.time(), load))
            except Exception as err:  # noqa: BLE001 (a watcher must go on)
                self.errors.append(f"{type(err).__name__}: {err}")
            self._stop.wait(self.every_s)


def gpu_seconds(samples: list[tuple[float, dict[str, dict[str, int]]]], t0: float, t1: float) -> float:
    """∫ Σ_pools ready instances × TP dt over [t0, t1] (step function of the Deployments' status)."""
    total = 0.0
    for (ta, a), (tb, _) in zip(samples, samples[1:]):
        lo, hi = max(ta, t0), min(tb, t1)
        if hi > lo:
            total += (hi - lo) * sum(p["ready"] * p["tp"] for p in a.values())
    return total


def scale_changes(samples: list[tuple[float, dict[str, dict[str, int]]]]) -> list[tuple[float, str, int, int]]:
    """(time, pool, old, new) of every change of a pool Deployment's ``spec.replicas``."""
    out, last = [], {}
    for t, pools in samples:
        for pool, v in pools.items():
            if pool in last and v["replicas"] != last[pool]:
                out.append((t, pool, last[pool], v["replicas"]))
            last[pool] = v["replicas"]
    return out


def events(cluster: Any, ns: str) -> list[dict[str, Any]]:
    items = kget(cluster, "events", ns).get("items") or []
    out = []
    for e in items:
        if (e.get("involvedObject") or {}).get("kind") != "LLMServe":
            continue
        t = e.get("lastTimestamp") or e.get("eventTime") or e["metadata"]["creationTimestamp"]
        out.append({"time": t, "reason": e["reason"], "message": e.get("message", ""), "count": e.get("count", 1)})
    return sorted(out, key=lambda e: e["time"])


def apply_and_wait_ready(cluster: Any, doc: dict[str, Any], timeout_s: float = 300) -> None:
    ns, name = doc["metadata"]["namespace"], doc["metadata"]["name"]
    cluster.kubectl("apply", "-f", "-", input_text=yaml.safe_dump(doc))
    for pool in ("prefill", "decode", "router"):
        wait(f"Deployment {name}-{pool} ready", lambda pool=pool: (kget(cluster, "deployment", ns, f"{name}-{pool}")
                                                                   .get("status") or {}).get("readyReplicas"),
             timeout_s=timeout_s)


def router_up(cluster: Any, ns: str, name: str, model: str) -> str:
    ip = cluster.proxies.address(ns, f"{name}-router", timeout_s=30)
    url = f"http://{ip}:8000"

    def one() -> bool:
        body = json.dumps({"model": model, "prompt": "x" * 64, "max_tokens": 2}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:  # noqa: S310 (loopback proxy)
            return r.status == 200

    wait("a completion through the router's Service proxy", one, timeout_s=120, every_s=2)
    return url


def router_log(cluster: Any, ns: str, name: str) -> str:
    text = ""
    for p in kget(cluster, "pods", ns, selector=f"fulcrum.dev/llmserve={name},app.kubernetes.io/component=router"
                  ).get("items") or []:
        r = cluster.runner(ns, p["metadata"]["name"])
        if r is not None:
            text += r.log_path("router").read_text(errors="replace")
    return text


# --- the scenario --------------------------------------------------------------------------------------------


def test_a_bursty_trace_scales_out_and_drains_back_in_with_no_failed_request(
        local_cluster: Any, local_namespace: str, operator: Operator, prometheus: LocalPrometheus) -> None:
    ns = local_namespace
    doc = sim_spec(ns)
    model = doc["spec"]["model"]["servedName"]
    slo = doc["spec"]["slo"]
    t_apply = time.time()
    apply_and_wait_ready(local_cluster, doc)
    url = router_up(local_cluster, ns, NAME, model)
    # the operator observes only once Prometheus has the router's series
    wait("the router scraped by Prometheus", lambda: prometheus.query(
        f'fulcrum_router_requests_admitted_total{{namespace="{ns}",job="{NAME}-router"}}'), timeout_s=60)
    watcher = Watcher(local_cluster, ns, NAME)
    watcher.start()
    before = wait("initial pools", watcher.pools)
    requests = window_requests(WINDOW)
    assert 100 <= len(requests) <= 400
    print(f"\nready {time.time() - t_apply:.0f} s after apply; driving {len(requests)} requests over "
          f"{requests[-1].arrival_s:.0f} s ({WINDOW})")
    report = drive(url, model, requests)
    t_load_end = time.time()
    print(f"load done in {report.ended - report.started:.0f} s: {report.summary(slo['ttftMs'] / 1e3, slo['tpotMs'] / 1e3)}")
    try:
        peak = max(sum(p["replicas"] for p in s.values()) for _, s in watcher.samples)
        initial = sum(p["replicas"] for p in before.values())

        wait("scale-in after the burst", lambda: sum(p["replicas"] for p in watcher.pools().values()) <= max(
            initial, peak - 2) and not _draining_now(local_cluster, ns), timeout_s=180, every_s=2)
        # a drain's ScaledIn Event comes after its pool has shrunk (drain_pool returns first)
        wait("a ScaledIn Event", lambda: any(e["reason"] == "ScaledIn" for e in events(local_cluster, ns)),
             timeout_s=60, every_s=1)
    finally:
        watcher.stop()
    t_end = time.time()
    (RESULTS).mkdir(parents=True, exist_ok=True)
    (RESULTS / "client.json").write_text(report.to_json())
    changes = scale_changes(watcher.samples)
    evs = events(local_cluster, ns)
    gpu_s_load = gpu_seconds(watcher.samples, report.started, t_load_end)
    gpu_s_all = gpu_seconds(watcher.samples, report.started, t_end)
    summary = report.summary(slo["ttftMs"] / 1e3, slo["tpotMs"] / 1e3)
    rlog = router_log(local_cluster, ns, NAME)
    lines = [f"client: {summary}",
             f"GPU-seconds (ready instances × TP): {gpu_s_load:.0f} during the load ({t_load_end - report.started:.0f} s), "
             f"{gpu_s_all:.0f} until scaled in ({t_end - report.started:.0f} s)",
             "scale changes (Deployment spec.replicas; t from the first request):"]
    lines += [f"  {t - report.started:+7.1f} s  {pool}: {a} → {b}" for t, pool, a, b in changes]
    lines += ["operator Events:"] + [f"  {e['time']} {e['reason']}: {e['message'][:160]}" for e in evs]
    lines += [f"drained pods (first seen in the router ConfigMap's draining list): "
              f"{ {p: round(t - report.started, 1) for p, t in watcher.draining_seen.items()} }"]
    text = "\n".join(lines)
    print(text)
    (RESULTS / "live.txt").write_text(text + "\n")
    (RESULTS / "samples.json").write_text(json.dumps(watcher.samples))

    # 0 failed client requests
    assert not report.failed, [(r.index, r.status, r.error) for r in report.failed[:10]]
    # scale-out during the burst, scale-in after it
    outs = [c for c in changes if c[3] > c[2]]
    ins = [c for c in changes if c[3] < c[2]]
    assert outs, "no pool scaled out"
    assert peak > initial
    assert ins and ins[-1][0] > outs[0][0], "no scale-in after the scale-out"
    # every scale-in was a drain: a ScaledIn Event naming the pods, and the router never chose a draining one
    scaled_in = [e for e in evs if e["reason"] == "ScaledIn"]
    assert scaled_in, [e["reason"] for e in evs]
    drained = {p.strip() for e in scaled_in for p in re.sub(r".*after draining (.*?): .*", r"\1", e["message"]).split(",")
               if p.strip() and p.strip() != "none"}
    assert drained, scaled_in
    assert "chose a draining instance" not in rlog
    # the drained pods are gone
    left = {p["metadata"]["name"] for p in kget(local_cluster, "pods", ns).get("items") or []}
    assert not drained & left, drained & left
    # the router saw every victim in its draining list before it went: the drain's confirm step waits for the
    # router's fulcrum_router_instance_draining (operator/controller/drain.py, step 3)
    marked = drained_in_log(rlog)
    print(f"drained pods the router had marked draining: {len(drained & marked)} of {len(drained)}; "
          f"seen in the ConfigMap by the watcher: {len(drained & set(watcher.draining_seen))}")
    assert drained <= marked, f"drained before the router had them as draining: {sorted(drained - marked)}"
    assert not [e for e in evs if e["reason"] == "DrainUnconfirmed"], "a router never confirmed a drain"
    # a drained pod's load never grew once the router had it as draining (+1 s for the sample in flight)
    for pod, series in watcher.drain_load.items():
        grew = [(round(tb - report.started, 1), a, b) for (ta, a), (tb, b) in zip(series, series[1:])
                if b > a and ta > watcher.draining_seen[pod] + 6]  # the agent re-reads ConfigMaps every 5 s
        assert not grew, (pod, grew)
    # the operator's drain metric counted them
    drains = re.findall(r"^fulcrum_operator_drain_seconds_count(?:\{[^}]*\})? ([0-9.e+]+)", operator.metrics(), re.M)
    assert drains and float(drains[0]) >= len(scaled_in)

    # live vs replay: the same window, the same spec
    t0 = time.time()
    run = replay_window(requests, doc["spec"], warmup_s=0.0)
    s = run.summary
    replay_gpu_s = s.gpu_hours * 3600
    tl = [(round(p.time_s), p.prefill, p.decode) for p in run.timeline]
    table = ["| | live (local cluster) | replay (simulator) |", "|---|---|---|",
             f"| requests | {summary['requests']} | {s.requests} |",
             f"| SLO attainment (TTFT ≤ {slo['ttftMs']} ms and TPOT ≤ {slo['tpotMs']} ms) | "
             f"{summary['slo_attainment']:.3f} | {s.slo_attainment:.3f} |",
             f"| TTFT attainment | {summary['ttft_attainment']:.3f} | {s.ttft_attainment:.3f} |",
             f"| TPOT attainment | {summary['tpot_attainment']:.3f} | {s.tpot_attainment:.3f} |",
             f"| TTFT p90 (s) | {summary['ttft_p90_s']:.2f} | {s.ttft_p_s:.2f} |",
             f"| TPOT p90 (ms) | {summary['tpot_p90_s'] * 1e3:.1f} | {s.tpot_p_s * 1e3:.1f} |",
             f"| GPU-seconds | {gpu_s_all:.0f} (until scaled in) / {gpu_s_load:.0f} (load) | {replay_gpu_s:.0f} |",
             f"| scale events | {len(changes)} | {s.scale_events} |",
             f"| peak instances (P+D) | {peak} | {max(p + d for _, p, d in tl) if tl else 0} |"]
    text = "\n".join(table) + f"\nreplay timeline (t, prefill, decode): {tl}\nreplay took {time.time() - t0:.0f} s"
    print(text)
    (RESULTS / "live_vs_replay.md").write_text(text + "\n")


def _draining_now(cluster: Any, ns: str) -> bool:
    st = kget(cluster, "llmserve", ns, NAME).get("status") or {}
    return bool(st.get("draining"))


def drained_in_log(router_log_text: str) -> set[str]:
    """Instances the router logged as 'draining: no new requests'."""
    return set(re.findall(r"instance (\S+) draining: no new requests", router_log_text))
