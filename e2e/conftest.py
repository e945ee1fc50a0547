"""Fixtures of the end-to-end tests: they run against the Kubernetes cluster ``KUBECONFIG`` names (marker
``cluster``) and skip, saying why, when none is reachable. Nothing here fakes a cluster.

The local cluster (real control plane + process node agent, e2e/local, docs/e2e.md): fixtures
``local_cluster`` and ``local_namespace``; a failing test that used it gets the tails of every component's,
the agent's and the pods' logs in its report."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kube import kubectl  # e2e/kube.py (the test folder is on sys.path)
from local.fixtures import local_cluster, local_namespace  # noqa: F401 (fixtures)

REPO = Path(__file__).resolve().parents[1]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Attach the local cluster's log tails to a failing test's report."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    cluster = getattr(item, "funcargs", {}).get("local_cluster")
    if report.failed and cluster is not None:
        try:
            report.sections.append(("local cluster logs (tails)", cluster.diagnostics()))
        except Exception as err:  # noqa: BLE001 (a report must not fail)
            report.sections.append(("local cluster logs", f"unavailable: {err}"))


@pytest.fixture(scope="session")
def cluster() -> str:
    """The reachable cluster's API address; skips when ``kubectl cluster-info`` fails."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: the e2e tests need a cluster reachable through KUBECONFIG")
    try:
        out = kubectl("cluster-info", timeout=20)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
        lines = [ln for ln in (getattr(err, "stderr", "") or str(err)).splitlines() if ln.strip()]
        detail = lines[-1].strip()[:200] if lines else str(err)
        pytest.skip(f"no Kubernetes cluster reachable (kubectl cluster-info failed: {detail}); "
                    f"KUBECONFIG={os.environ.get('KUBECONFIG', '~/.kube/config')}")
    return out.splitlines()[0] if out else "cluster"


@pytest.fixture
def namespace(cluster: str) -> Iterator[str]:
    """A fresh namespace, deleted afterwards (with everything in it)."""
    ns = f"fulcrum-e2e-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", ns)
    try:
        yield ns
    finally:
        kubectl("delete", "namespace", ns, "--wait=false", check=False)
