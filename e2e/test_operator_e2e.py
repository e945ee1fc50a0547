"""`fulcrum operator` end to end on a real cluster (marker ``cluster``): the CRD, examples/llmserve-sim.yaml
(engine kind ``sim``: no GPU), the pools, the router, status and events, and a scale-out under load.

Runs against whatever cluster ``KUBECONFIG`` names (kind, minikube, a real one) and skips when none is reachable.
The operator runs as a local process (``fulcrum operator --namespace <fresh ns>``) with the caller's credentials.
Settings (environment): ``FULCRUM_E2E_IMAGE`` — the Fulcrum image the router and sim-worker pods run (loaded
into the cluster beforehand, e.g. ``kind load docker-image``); ``FULCRUM_E2E_PROMETHEUS_URL`` — a Prometheus that
scrapes the namespace's router (needed by the scale-out test, which skips without it).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kube import kubectl  # e2e/kube.py (the test folder is on sys.path)
import yaml

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(2700)]  # minutes of cluster set-up: past the suite's 600 s

REPO = Path(__file__).resolve().parents[1]



EXAMPLE = REPO / "examples" / "llmserve-sim.yaml"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(what: str, probe: Callable[[], Any], timeout_s: float = 180.0, every_s: float = 2.0) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except subprocess.CalledProcessError as err:
            last = err.stderr
        else:
            if last:
                return last
        time.sleep(every_s)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what} (last: {str(last)[:500]})")


def _example(ns: str) -> tuple[str, str]:
    if not EXAMPLE.exists():
        pytest.skip(f"{EXAMPLE} is missing")
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["namespace"] = ns
    doc["spec"]["scaling"]["intervalSeconds"] = 10
    doc["spec"]["scaling"]["cooldownSeconds"] = 30
    return doc["metadata"]["name"], yaml.safe_dump(doc)


@pytest.fixture
def operator(namespace: str, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    kubectl("wait", "--for=condition=Established", "crd/llmserves.fulcrum.dev", "--timeout=60s")
    log = open(tmp_path / "operator.log", "wb")  # noqa: SIM115 (closed below)
    args = [sys.executable, "-m", "fulcrum", "operator", "--namespace", namespace, "--log-format", "text",
            "--metrics-port", str(_free_port()), "--liveness-port", str(_free_port()),
            "--image", os.environ.get("FULCRUM_E2E_IMAGE", "ghcr.io/fulcrum-llm/fulcrum:0.1.0")]
    if os.environ.get("FULCRUM_E2E_PROMETHEUS_URL"):
        args += ["--prometheus-url", os.environ["FULCRUM_E2E_PROMETHEUS_URL"]]
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        print((tmp_path / "operator.log").read_text(errors="replace")[-3000:])


def _get(kind: str, ns: str, name: str = "") -> dict[str, Any]:
    out = kubectl("get", kind, *([name] if name else []), "-n", ns, "-o", "json", check=False)
    return json.loads(out) if out else {}


def _events(ns: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in _get("events", ns).get("items", []) if e.get("reason") == reason]


def test_the_operator_builds_the_pools_router_status_and_events_of_a_sim_llmserve(
        namespace: str, operator: subprocess.Popen[bytes]) -> None:
    name, manifest = _example(namespace)
    kubectl("apply", "-f", "-", input_text=manifest)
    for dep in (f"{name}-prefill", f"{name}-decode", f"{name}-router"):
        _wait(f"Deployment {dep}", lambda dep=dep: _get("deployment", namespace, dep).get("spec"))
    dep = _get("deployment", namespace, f"{name}-decode")
    assert dep["metadata"]["labels"]["fulcrum.dev/pool"] == "decode"
    assert dep["metadata"]["ownerReferences"][0]["kind"] == "LLMServe"
    cm = _get("configmap", namespace, f"{name}-router")
    assert "router.yaml" in cm["data"]
    st = _wait("LLMServe status", lambda: _get("llmserve", namespace, name).get("status", {}).get("conditions"))
    assert {c["type"] for c in st} >= {"Ready", "Progressing", "Degraded", "ForecastReady"}
    _wait("all pools ready", lambda: next((c for c in _get("llmserve", namespace, name)["status"]["conditions"]
                                           if c["type"] == "Ready" and c["status"] == "True"), None), timeout_s=300)
    if not os.environ.get("FULCRUM_E2E_PROMETHEUS_URL"):
        _wait("an ObservationUnavailable event (no Prometheus)", lambda: _events(namespace, "ObservationUnavailable"),
              timeout_s=60)
    assert operator.poll() is None, "the operator exited"


def _load(url: str, model: str, stop: threading.Event) -> None:
    body = json.dumps({"model": model, "prompt": "hello " * 400, "max_tokens": 64}).encode()
    while not stop.is_set():
        try:
            req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=30).read()  # noqa: S310 (a port-forward we opened)
        except OSError:
            time.sleep(0.2)


def test_load_on_the_router_scales_a_pool_out(namespace: str, operator: subprocess.Popen[bytes]) -> None:
    if not os.environ.get("FULCRUM_E2E_PROMETHEUS_URL"):
        pytest.skip("FULCRUM_E2E_PROMETHEUS_URL is not set: a scale-out needs a Prometheus scraping the router")
    name, manifest = _example(namespace)
    kubectl("apply", "-f", "-", input_text=manifest)
    _wait("router ready", lambda: (_get("deployment", namespace, f"{name}-router").get("status") or {}).get("readyReplicas"),
          timeout_s=300)
    port = _free_port()
    pf = subprocess.Popen(["kubectl", "port-forward", "-n", namespace, f"svc/{name}-router", f"{port}:8000"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stop = threading.Event()
    workers = [threading.Thread(target=_load, args=(f"http://127.0.0.1:{port}", "llama-70b-sim", stop), daemon=True)
               for _ in range(16)]
    try:
        time.sleep(2)
        for w in workers:
            w.start()
        _wait("a ScaledOut event", lambda: _events(namespace, "ScaledOut"), timeout_s=300)
        pools = _get("llmserve", namespace, name)["status"]["pools"]
        assert pools["prefill"]["desired"] + pools["decode"]["desired"] > 2
    finally:
        stop.set()
        pf.terminate()
        pf.wait(10)
