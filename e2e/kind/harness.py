"""Helpers of the kind end-to-end tests: tools present, cluster up, chart installed, LLMServe applied, a trace
window replayed against the router, Prometheus queried. Everything shells out to the real tools (docker, kind,
kubectl, helm); nothing here is a fake.

The tests skip (``missing_tools``) when a tool is absent. Environment: ``KIND_CLUSTER_NAME`` (default
``fulcrum-e2e``), ``FULCRUM_E2E_KEEP=1`` keeps the cluster afterwards (else it is deleted when this harness
created it), ``FULCRUM_IMAGE`` (default ``fulcrum:e2e``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "REPO", "KIND_DIR", "CLUSTER", "missing_tools", "sh", "kubectl", "cluster", "llmserve_object", "apply_llmserve", "wait_for",
    "port_forward", "replay_window", "prom_query", "pool_replicas", "router_metric",
]

REPO = Path(__file__).resolve().parents[2]
KIND_DIR = REPO / "e2e" / "kind"
CLUSTER = os.environ.get("KIND_CLUSTER_NAME", "fulcrum-e2e")


def missing_tools(tools: Sequence[str] = ("docker", "kind", "kubectl", "helm")) -> str | None:
    """A skip reason naming the absent tools (or a docker daemon that does not answer), else ``None``."""
    absent = [t for t in tools if shutil.which(t) is None]
    if absent:
        return f"{', '.join(absent)} not found: the kind e2e tests need docker, kind, kubectl and helm (e2e/README.md)"
    if "docker" in tools and subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode != 0:
        return "docker is installed but its daemon does not answer (docker info failed)"
    return None


def sh(*cmd: str, timeout: float = 900, check: bool = True, env: dict[str, str] | None = None) -> str:
    """Run a command; its stdout. Raises ``AssertionError`` with the output when it fails and ``check``."""
    out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, **(env or {})})
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
    return out.stdout


def kubectl(*args: str, timeout: float = 300) -> str:
    return sh("kubectl", "--context", f"kind-{CLUSTER}", *args, timeout=timeout)


@contextlib.contextmanager
def cluster(gpu: bool = False, worker_image: str | None = None) -> Iterator[None]:
    """Create (or reuse) the kind cluster and install the chart; delete the cluster afterwards if created here."""
    existed = CLUSTER in sh("kind", "get", "clusters", check=False).split()
    sh("bash", str(KIND_DIR / "create-cluster.sh"), *(["--gpu"] if gpu else []), "--name", CLUSTER, timeout=900)
    try:
        sh("bash", str(KIND_DIR / "install.sh"), "--name", CLUSTER,
           *(["--worker-image", worker_image] if worker_image else []), timeout=1800)
        yield
    finally:
        if not existed and os.environ.get("FULCRUM_E2E_KEEP") != "1":
            sh("kind", "delete", "cluster", "--name", CLUSTER, check=False, timeout=300)


def llmserve_object(path: Path, patch: dict[str, Any] | None = None, name: str | None = None) -> dict[str, Any]:
    """An LLMServe file with ``patch`` deep-merged into its spec (and renamed to ``name``)."""
    obj: dict[str, Any] = yaml.safe_load(path.read_text())

    def merge(a: dict[str, Any], b: dict[str, Any]) -> None:
        for k, v in b.items():
            if isinstance(v, dict) and isinstance(a.get(k), dict):
                merge(a[k], v)
            else:
                a[k] = v

    merge(obj["spec"], patch or {})
    if name:
        obj["metadata"]["name"] = name
    return obj


def apply_llmserve(path: Path, patch: dict[str, Any] | None = None, name: str | None = None) -> dict[str, Any]:
    """Apply an LLMServe file (see :func:`llmserve_object`); returns the applied object."""
    obj = llmserve_object(path, patch, name)
    out = subprocess.run(["kubectl", "--context", f"kind-{CLUSTER}", "apply", "-f", "-"], input=yaml.safe_dump(obj),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return obj


def wait_for(what: str, check: Any, timeout_s: float, every_s: float = 5.0) -> Any:
    """Poll ``check()`` until it returns a truthy value; ``AssertionError`` naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (AssertionError, OSError, ValueError, KeyError) as e:
            last = e
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what} (last: {last!r})")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def port_forward(namespace: str, target: str, port: int) -> Iterator[str]:
    """``kubectl port-forward``; yields ``http://127.0.0.1:<local port>``."""
    local = _free_port()
    proc = subprocess.Popen(["kubectl", "--context", f"kind-{CLUSTER}", "-n", namespace, "port-forward", target,
                             f"{local}:{port}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{local}"
        wait_for(f"port-forward to {target}", lambda: _get(url + "/health", ok_only=False) is not None, 60, 1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _get(url: str, ok_only: bool = True) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode()
    except urllib.error.HTTPError as e:
        return None if ok_only else str(e.code)
    except OSError:
        return None


def replay_window(router_url: str, model: str, trace: str, start_s: float, duration_s: float, time_scale: float,
                  max_tokens: int = 128) -> dict[str, int]:
    """Send a trace window's requests to the router at their (scaled) arrival times; counts by HTTP status.

    Prompts are ``isl`` words (the emulator counts tokens with its own tokenizer), ``max_tokens`` = the trace's
    output length capped at ``max_tokens``.
    """
    import aiohttp

    from fulcrum.traces import load_trace

    reqs = load_trace(trace, None, start_s=start_s, duration_s=duration_s).requests
    counts: dict[str, int] = {}

    async def one(session: aiohttp.ClientSession, delay: float, isl: int, osl: int) -> None:
        await asyncio.sleep(delay)
        body = {"model": model, "prompt": "hello " * max(isl, 1), "max_tokens": max(1, min(osl, max_tokens)),
                "stream": False}
        try:
            async with session.post(router_url + "/v1/completions", json=body) as r:
                await r.read()
                key = str(r.status)
        except aiohttp.ClientError as e:
            key = type(e).__name__
        counts[key] = counts.get(key, 0) + 1

    async def run() -> None:
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(*(one(session, r.arrival_s * time_scale, r.isl, r.osl) for r in reqs))

    asyncio.run(run())
    return counts


def prom_query(prom_url: str, expr: str) -> list[dict[str, Any]]:
    """Prometheus instant query; the result vector."""
    text = _get(prom_url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert text is not None, f"Prometheus did not answer {expr}"
    body = json.loads(text)
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def pool_replicas(namespace: str, llmserve: str) -> dict[str, int]:
    """``spec.replicas`` of the LLMServe's pool Deployments, by pool label."""
    items = json.loads(kubectl("-n", namespace, "get", "deployments", "-l", f"fulcrum.dev/llmserve={llmserve}",
                               "-o", "json"))["items"]
    return {d["metadata"]["labels"]["fulcrum.dev/pool"]: int(d["spec"]["replicas"])
            for d in items if "fulcrum.dev/pool" in d["metadata"]["labels"]}


def router_metric(metrics_text: str, name: str) -> dict[str, float]:
    """Samples of one metric in a /metrics text, keyed by their label text."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key[len(name):]] = float(value)
    return out
