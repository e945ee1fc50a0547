"""pytest fixtures of the local cluster (imported by e2e/conftest.py).

``local_cluster`` (session): a ``LocalCluster`` (two process nodes with 8 emulated GPUs each) started under
pytest's temporary folder, stopped after the session. With ``FULCRUM_E2E_USE_KUBECONFIG=1`` and ``KUBECONFIG`` set, the cluster KUBECONFIG names is used
instead (an ``ExternalCluster``: no process node agent and no loopback Service proxies; tests that need them
skip). Skips, with the reason, only when neither the binaries (and etcd) nor such a cluster exist.
``local_namespace``: a fresh namespace, deleted afterwards.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .cluster import binaries_available, etcd_binary, kubectl
from .harness import LocalCluster

__all__ = ["ExternalCluster", "local_cluster", "local_namespace"]


@dataclass
class ExternalCluster:
    """A cluster named by ``KUBECONFIG`` (``FULCRUM_E2E_USE_KUBECONFIG=1``): same surface as LocalCluster for
    kubectl, without ``agent`` and ``proxies``."""

    kubeconfig: Path
    api_url: str
    agent: Any = None
    proxies: Any = None

    def kubectl(self, *args: str, check: bool = True, timeout: float = 60.0, input_text: str | None = None) -> str:
        """``kubectl --kubeconfig <it> …``; its stdout."""
        return kubectl(self.kubeconfig, *args, check=check, timeout=timeout, input_text=input_text)

    def diagnostics(self, n_chars: int = 2000) -> str:
        """Nothing to add: the cluster's logs are its own."""
        return ""

    def runner(self, namespace: str, name: str) -> None:
        """No process node agent here."""
        return None


@pytest.fixture(scope="session")
def local_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster | ExternalCluster]:
    """The cluster the local e2e tests run on (see the module docstring)."""
    kubeconfig = os.environ.get("KUBECONFIG", "")
    if os.environ.get("FULCRUM_E2E_USE_KUBECONFIG") == "1" and kubeconfig:
        server = subprocess.run(["kubectl", "--kubeconfig", kubeconfig, "config", "view", "--minify", "-o",
                                 "jsonpath={.clusters[0].cluster.server}"], capture_output=True, text=True,
                                timeout=30).stdout.strip()
        yield ExternalCluster(Path(kubeconfig), server)
        return
    missing = binaries_available()
    if missing is None and etcd_binary() is None:
        missing = "etcd is not installed (scripts/install-servers.sh installs Debian's etcd-server)"
    if missing is None and shutil.which("kubectl") is None:
        missing = "kubectl is not installed"
    if missing is not None:
        pytest.skip(f"no local Kubernetes cluster: {missing}; and no FULCRUM_E2E_USE_KUBECONFIG=1 with KUBECONFIG")
    pod_prefix = "127.0"
    if os.environ.get("FULCRUM_E2E_NETNS") == "1":  # pod IPs the API accepts in EndpointSlices (netns.py)
        from .netns import POD_PREFIX, enter_private_netns

        enter_private_netns()
        pod_prefix = POD_PREFIX
    cluster = LocalCluster(tmp_path_factory.mktemp("local-cluster"), nodes=2, gpus=8, pod_prefix=pod_prefix)
    cluster.start()
    print(f"local cluster up in {cluster.startup_s['total']:.1f} s "
          f"(control plane {cluster.startup_s['control_plane']:.1f} s): {cluster.api_url}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def local_namespace(local_cluster: LocalCluster | ExternalCluster) -> Iterator[str]:
    """A fresh namespace on the local cluster, deleted (without waiting) afterwards."""
    ns = f"e2e-{uuid.uuid4().hex[:6]}"
    local_cluster.kubectl("create", "namespace", ns)
    try:
        yield ns
    finally:
        local_cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
