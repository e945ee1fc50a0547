"""End to end on kind with NVIDIA GPUs: real vLLM workers (`fulcrum worker`, worker-image/Dockerfile) serving a
small model, P/D over NIXL. A trace window is replayed against the router; asserts scale-out, split routing and
SLO metrics as the sim test does, on real engines.

Markers ``cluster`` and ``gpu``; skips without docker/kind/kubectl/helm, without ``nvidia-smi``, or without a
worker image named by ``FULCRUM_E2E_WORKER_IMAGE`` (built beforehand: it holds vLLM and NIXL, ~10 GB).
The model (``FULCRUM_E2E_MODEL``, default Qwen/Qwen2.5-0.5B-Instruct) is pulled by the worker pods from the
Hugging Face Hub, so the node needs internet access. About 30 minutes (e2e/README.md).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "kind"))

import harness  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.gpu, pytest.mark.timeout(5400)]  # image pulls and model load: past 600 s

NS = "default"
NAME = "gpu-small"
MODEL = os.environ.get("FULCRUM_E2E_MODEL", "Qwen/Qwen2.5-0.5B-Instruct")


@pytest.fixture(scope="module")
def kind_gpu_cluster() -> str:
    reason = harness.missing_tools()
    if reason:
        pytest.skip(reason)
    if shutil.which("nvidia-smi") is None:
        pytest.skip("nvidia-smi not found: the GPU e2e test needs an NVIDIA GPU and driver on the host")
    image = os.environ.get("FULCRUM_E2E_WORKER_IMAGE")
    if not image:
        pytest.skip("set FULCRUM_E2E_WORKER_IMAGE to a worker image built from worker-image/Dockerfile")
    with harness.cluster(gpu=True, worker_image=image):
        yield image


def test_real_vllm_pools_scale_out_route_split_requests_and_report_slos(kind_gpu_cluster: str) -> None:
    image = kind_gpu_cluster
    harness.apply_llmserve(harness.REPO / "examples" / "llmserve-sim.yaml", {
        "model": {"name": MODEL, "servedName": "small"},
        "engine": {"kind": "vllm", "image": image, "maxModelLen": 4096,
                   "resources": {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "16Gi"}}},
        "gpu": {"type": "H100"},
        "slo": {"ttftMs": 1000, "tpotMs": 50, "percentile": 90},
        "scaling": {"minGPUs": 2, "maxGPUs": 4, "tpPrefill": 1, "tpDecode": 1, "intervalSeconds": 30,
                    "podStartupSeconds": 120},
        "router": {"policy": "split"},
    }, name=NAME)
    harness.wait_for("the router and the vLLM pools", lambda: harness.kubectl(
        "-n", NS, "rollout", "status", f"deployment/{NAME}-router", "--timeout=10s") and harness.pool_replicas(NS, NAME), 1200)
    before = harness.pool_replicas(NS, NAME)
    with harness.port_forward(NS, f"service/{NAME}-router", 8000) as router:
        counts = harness.replay_window(router, "small", "azure-conv-2023", 0, 1200, 0.25)
        assert counts.get("200", 0) >= 0.95 * sum(counts.values()), counts
        metrics = harness._get(router + "/metrics")
    routed = harness.router_metric(metrics or "", "fulcrum_router_routed_requests_total")
    assert any('kind="split"' in k and v > 0 for k, v in routed.items()), routed
    harness.wait_for("scale-out", lambda: sum(harness.pool_replicas(NS, NAME).values()) > sum(before.values()), 600)
    with harness.port_forward("monitoring", "service/prometheus", 9090) as prom:
        att = harness.prom_query(prom, f'fulcrum_operator_slo_attainment{{llmserve="{NS}/{NAME}"}}')
        assert att and 0.0 <= float(att[0]["value"][1]) <= 1.0
        ttft = harness.prom_query(prom, f'sum(vllm:time_to_first_token_seconds_count{{namespace="{NS}", llmserve="{NAME}"}})')
        assert ttft and float(ttft[0]["value"][1]) > 0
