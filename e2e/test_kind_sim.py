"""End to end on kind, no GPU: the chart installs the operator; an LLMServe with sim-worker pools (the GPU-free
engine emulator) is applied; a window of a real trace, compressed to a burst, is replayed against the router.
Asserts scale-out (pool replicas grow), split routing (the router ran requests as split micro-requests) and SLO
metrics (the operator exports SLO attainment, Prometheus has the router's TTFT histogram).

Marker ``cluster``; skips when docker, kind, kubectl or helm is absent. About 15 minutes (e2e/README.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "kind"))

import harness  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(2700)]  # minutes of cluster set-up: past the suite's 600 s

NS = "default"
NAME = "sim-llama-70b"


@pytest.fixture(scope="module")
def kind_cluster() -> None:
    reason = harness.missing_tools()
    if reason:
        pytest.skip(reason)
    with harness.cluster():
        yield


def test_a_burst_scales_the_sim_pools_out_routes_split_requests_and_reports_slos(kind_cluster: None) -> None:
    serve = harness.apply_llmserve(harness.REPO / "examples" / "llmserve-sim.yaml",
                                   {"router": {"policy": "split"}, "scaling": {"intervalSeconds": 30}})
    model = serve["spec"]["model"]["servedName"]
    harness.wait_for("the router and the initial pools", lambda: harness.kubectl(
        "-n", NS, "rollout", "status", f"deployment/{NAME}-router", "--timeout=10s") and harness.pool_replicas(NS, NAME), 600)
    before = harness.pool_replicas(NS, NAME)
    with harness.port_forward(NS, f"service/{NAME}-router", 8000) as router:
        # 20 minutes of Azure conversation arrivals in 4 minutes: five times the trace's rate
        counts = harness.replay_window(router, model, "azure-conv-2023", 0, 1200, 0.2)
        assert counts.get("200", 0) >= 0.95 * sum(counts.values()), counts
        metrics = harness._get(router + "/metrics")
        assert metrics is not None
    routed = harness.router_metric(metrics, "fulcrum_router_routed_requests_total")
    assert any('kind="split"' in k and v > 0 for k, v in routed.items()), routed
    after = harness.wait_for("scale-out", lambda: (lambda r: r if sum(r.values()) > sum(before.values()) else None)(
        harness.pool_replicas(NS, NAME)), 300)
    assert sum(after.values()) > sum(before.values())
    with harness.port_forward("monitoring", "service/prometheus", 9090) as prom:
        att = harness.prom_query(prom, f'fulcrum_operator_slo_attainment{{llmserve="{NS}/{NAME}"}}')
        assert att and 0.0 <= float(att[0]["value"][1]) <= 1.0
        ttft = harness.prom_query(prom, f'sum(fulcrum_router_ttft_seconds_count{{namespace="{NS}", llmserve="{NAME}"}})')
        assert ttft and float(ttft[0]["value"][1]) > 0
        planned = harness.prom_query(prom, f'fulcrum_operator_planned_instances{{llmserve="{NS}/{NAME}"}}')
        assert {p["metric"]["pool"] for p in planned} >= {"prefill", "decode"}
