"""``LocalCluster``: the control plane, the loopback Service proxies and one process node agent, started and
stopped together. The pytest fixture (``fixtures``) and the CLI (``python -m e2e.local``) both use it."""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cluster import ClusterError, ControlPlane, kubectl
from .node_agent import NodeAgent, PodRunner
from .service_proxy import LoopbackAllocator, ServiceProxies

__all__ = ["LocalCluster"]


@dataclass
class LocalCluster:
    """A whole local cluster under ``workdir``: ``start()`` → API ready, RBAC bootstrapped, Nodes Ready.

    ``nodes`` process nodes (``process-node-1`` …), each with ``gpus`` emulated ``nvidia.com/gpu``; they share
    one pod-address allocator and the Service proxies. ``kubeconfig``/``api_url`` name the cluster;
    ``proxies.address(ns, svc)`` is a Service's loopback address; ``runner(ns, pod)`` a pod's runner (its log
    files) on whichever node; ``diagnostics()`` the tails of every log. Call ``start()`` from a thread that
    outlives the cluster (its processes die with that thread: cluster.die_with_parent).
    """

    workdir: Path
    nodes: int = 1
    gpus: int = 16
    pod_prefix: str = "127.0"
    """First two octets of the pod IPs; ``"10.244"`` only inside ``netns.enter_private_netns()``."""
    control_plane: ControlPlane = field(init=False)
    proxies: ServiceProxies | None = None
    agents: list[NodeAgent] = field(default_factory=list)
    startup_s: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.control_plane = ControlPlane(self.workdir)

    @property
    def agent(self) -> NodeAgent | None:
        """The first node's agent (None before ``start()``)."""
        return self.agents[0] if self.agents else None

    def node_names(self) -> list[str]:
        """``process-node-1`` … ``process-node-<nodes>``."""
        return [f"process-node-{i + 1}" for i in range(self.nodes)]

    def runner(self, namespace: str, name: str) -> PodRunner | None:
        """The runner of pod ``namespace/name`` on any node, if one runs it."""
        return next((r for a in self.agents if (r := a.runner(namespace, name)) is not None), None)

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig."""
        return self.control_plane.kubeconfig

    @property
    def api_url(self) -> str:
        """``https://127.0.0.1:<port>``."""
        return self.control_plane.api_url

    def start(self) -> None:
        """Start everything; ClusterError (with log tails) when a part fails. Timings land in ``startup_s``."""
        t0 = time.monotonic()
        self._logging()
        # importing the kubernetes client takes seconds on a busy machine: overlap it with the control plane's start
        warm = threading.Thread(target=importlib.import_module, args=("kubernetes",), daemon=True)
        warm.start()
        self.control_plane.start()
        warm.join()
        self.startup_s["control_plane"] = self.control_plane.startup_s
        self.startup_s.update({f"control_plane.{k}": v for k, v in self.control_plane.phases_s.items()})
        try:
            from kubernetes import config

            api = config.new_client_from_config(config_file=str(self.kubeconfig))  # type: ignore[no-untyped-call]
            self.proxies = ServiceProxies(api, self.control_plane.api_port)
            self.proxies.start()
            self.startup_s["proxies"] = time.monotonic() - t0
            pod_ips = LoopbackAllocator(self.pod_prefix)
            for i, name in enumerate(self.node_names()):
                agent = NodeAgent(name, self.kubeconfig, self.control_plane.api_port,
                                  self.workdir / ("node" if i == 0 else f"node-{i + 1}"), proxies=self.proxies,
                                  pod_ips=pod_ips, gpus=self.gpus)
                self.agents.append(agent)
                agent.start()
            for name in self.node_names():
                self._wait_node_ready(name, t0 + 60)
            self.startup_s["node_ready"] = time.monotonic() - t0
            # the service-account controller's "default" ServiceAccount: pods need it to be admitted
            self._wait_default_service_account(t0 + 60)
            self.startup_s["service_accounts"] = time.monotonic() - t0
        except BaseException:
            self.stop()
            raise
        self.startup_s["total"] = time.monotonic() - t0

    def _logging(self) -> None:
        handler = logging.FileHandler(self.workdir / "agent.log") if self.workdir.is_dir() else None
        if handler is None:
            self.workdir.mkdir(parents=True, exist_ok=True)
            handler = logging.FileHandler(self.workdir / "agent.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(threadName)s: %(message)s"))
        for name in ("fulcrum.e2e.node_agent", "fulcrum.e2e.service_proxy"):
            lg = logging.getLogger(name)
            lg.setLevel(logging.INFO)
            lg.addHandler(handler)

    def kubectl(self, *args: str, check: bool = True, timeout: float = 60.0, input_text: str | None = None) -> str:
        """``kubectl --kubeconfig <admin> …``; its stdout (CalledProcessError when ``check`` and it fails)."""
        return kubectl(self.kubeconfig, *args, check=check, timeout=timeout, input_text=input_text)

    def _wait_default_service_account(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.kubectl("get", "serviceaccount", "default", "-n", "default", "--ignore-not-found",
                            check=False).strip():
                return
            time.sleep(0.3)
        raise ClusterError("the service-account controller made no default ServiceAccount in 60 s\n"
                           + self.control_plane.log_tails())

    def _wait_node_ready(self, name: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            out = self.kubectl("get", "node", name, "-o",
                               "jsonpath={.status.conditions[?(@.type=='Ready')].status}", check=False)
            if out.strip() == "True":
                return
            time.sleep(0.3)
        raise ClusterError(f"node {name} not Ready in time\n" + self.diagnostics())

    def diagnostics(self, n_chars: int = 2000) -> str:
        """Tails of the components' logs, the agent's log and every pod's container logs."""
        parts = [self.control_plane.log_tails(n_chars)]
        agent_log = self.workdir / "agent.log"
        if agent_log.is_file():
            parts.append(f"----- process node agent ({agent_log}) -----\n"
                         + agent_log.read_text(errors="replace")[-n_chars:])
        for path in sorted(self.workdir.glob("node*/pods/*/logs/*.log")):
            parts.append(f"----- {path.parent.parent.name}/{path.stem} ({path}) -----\n"
                         + path.read_text(errors="replace")[-n_chars:])
        return "\n".join(parts)

    def stop(self) -> None:
        """Stop the pods' processes, the proxies and the control plane (every process group it started)."""
        for agent in self.agents:
            agent.stop()
        if self.proxies is not None:
            self.proxies.stop()
        self.control_plane.stop()

    def env(self) -> dict[str, Any]:
        """What a shell needs to use the cluster."""
        return {"KUBECONFIG": str(self.kubeconfig), "FULCRUM_E2E_API_URL": self.api_url,
                "FULCRUM_E2E_CLUSTER_DIR": str(self.workdir), "pid": os.getpid()}
