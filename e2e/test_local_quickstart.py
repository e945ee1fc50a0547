"""The quick start's cluster path (docs/quickstart.md, section 3), as a person runs it on the local cluster:
``python -m e2e.local up`` in the background, ``python -m e2e.local chart`` (the chart rendered by Helm's engine,
applied in Helm's order; the operator a pod under its ServiceAccount), ``kubectl apply -f
examples/llmserve-sim.yaml``, a completion and a streamed chat completion through the router Service's loopback
proxy address (named in every pod's hosts file), then ``python -m e2e.local down``.

This runs a second cluster beside the session's (``local_cluster`` is requested only for its skip reasons);
the two harnesses pick loopback addresses from random starts.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from local.fixtures import ExternalCluster
from local.probes import kget, wait

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.local_cluster, pytest.mark.timeout(600)]


def _cli(d: Path, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "e2e.local", *args, "--dir", str(d)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def _router_address(d: Path, service: str) -> str | None:
    for hosts in sorted(d.glob("node/pods/*/hosts")):
        for line in hosts.read_text().splitlines():
            parts = line.split()
            if len(parts) > 1 and parts[1] == service:
                return parts[0]
    return None


def _post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:  # noqa: S310 (a loopback Service proxy of this harness)
        return resp.status, resp.read()


def test_the_quick_start_cluster_path_serves_through_the_one_command_cluster(local_cluster: Any,
                                                                           tmp_path: Path) -> None:
    if getattr(local_cluster, "agent", None) is None:
        pytest.skip("an external cluster (FULCRUM_E2E_USE_KUBECONFIG=1): the one-command local cluster is not used")
    d = tmp_path / "cluster"
    log = (tmp_path / "up.log").open("wb")
    up = subprocess.Popen([sys.executable, "-m", "e2e.local", "up", "--dir", str(d), "--gpus", "8"], cwd=REPO,
                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    t0 = time.monotonic()
    try:
        wait("`python -m e2e.local up` wrote env.sh", lambda: (d / "env.sh").is_file() or up.poll() is not None,
             timeout_s=180)
        assert up.poll() is None, (tmp_path / "up.log").read_text()
        env = dict(shlex.split(line.removeprefix("export "))[0].split("=", 1)
                   for line in _cli(d, "env").stdout.splitlines() if line.startswith("export "))
        assert {"KUBECONFIG", "FULCRUM_E2E_ETCD_URL"} <= env.keys(), env
        up_s = time.monotonic() - t0
        chart = _cli(d, "chart")
        assert chart.returncode == 0, chart.stderr
        assert "operator deployment/fulcrum-operator ready" in chart.stdout, chart.stdout
        cluster = ExternalCluster(Path(env["KUBECONFIG"]), env.get("FULCRUM_E2E_API_URL", ""))
        op = kget(cluster, "pods", "fulcrum-system", selector="app.kubernetes.io/component=operator")["items"]
        assert [p["spec"]["serviceAccountName"] for p in op] == ["fulcrum"]
        cluster.kubectl("apply", "-f", str(REPO / "examples" / "llmserve-sim.yaml"))
        name = "sim-llama-70b"

        def pools_ready() -> bool:
            pools = (kget(cluster, "llmserve", "default", name).get("status") or {}).get("pools") or {}
            return all((pools.get(p) or {}).get("ready", 0) >= 1 for p in ("prefill", "decode"))

        wait("the example's prefill and decode pools ready", pools_ready, timeout_s=240, every_s=2)
        columns = cluster.kubectl("get", "llms", name, "--no-headers").split()
        assert columns[:4] == [name, "Disaggregated", "1", "1"], columns
        router = wait("the router Service's proxy address", lambda: _router_address(d, f"{name}-router"), timeout_s=60)
        base = f"http://{router}:8000"

        def completion() -> dict[str, Any] | None:
            try:
                status, body = _post(f"{base}/v1/completions",
                                     {"model": "llama-70b-sim", "prompt": "hello", "max_tokens": 16})
            except OSError:  # the router not yet Ready behind its proxy, or no worker registered yet
                return None
            return dict(json.loads(body)) if status == 200 else None

        reply = wait("a completion through the router Service", completion, timeout_s=120, every_s=2)
        assert reply["usage"]["completion_tokens"] == 16 and reply["choices"][0]["finish_reason"] == "length"
        status, body = _post(f"{base}/v1/chat/completions", {
            "model": "llama-70b-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "stream": True})
        events = [line[len(b"data: "):] for line in body.splitlines() if line.startswith(b"data: ")]
        assert status == 200 and events[-1] == b"[DONE]", body[-300:]
        text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
        assert len(text) == 4, text  # the emulator's tokenizer: one token per byte
        print(f"\nquick start on the one-command cluster: up {up_s:.1f} s, served {time.monotonic() - t0:.1f} s "
              f"after `up` started; completion {reply['choices'][0]['text']!r}, streamed {text!r}")
        down = _cli(d, "down", timeout=200)
        assert down.returncode == 0, down.stderr
        up.wait(30)
        assert up.returncode == 0, (tmp_path / "up.log").read_text()[-3000:]
        print((tmp_path / "up.log").read_text().strip().splitlines()[-1])  # "# stopped in … s"
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGTERM)
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
        log.close()
