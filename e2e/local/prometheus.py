"""A real Prometheus (Debian's ``prometheus`` binary; scripts/install-servers.sh installs it) as a host process
on a loopback address, discovering the local cluster's pods through ``kubernetes_sd_configs`` (role ``pod``)
with a ServiceAccount token of its own, and scraping them the way the chart's PodMonitor and ServiceMonitor
would have the Prometheus Operator do it.

Scrape jobs (``scrape_configs`` of :func:`prometheus_config`):

- ``fulcrum-workloads`` — the chart's PodMonitor (``charts/fulcrum/templates/podmonitor.yaml``): pods labelled
  ``app.kubernetes.io/managed-by=fulcrum-operator`` with a ``fulcrum.dev/llmserve`` label, their container ports
  named ``http`` and ``scheduler``, ``/metrics``, ``honor_labels``; the relabelling of
  ``fulcrum.workloadRelabelings`` (``job`` = the pod's Deployment, e.g. ``<llmserve>-router``, which the
  operator's observe step selects; ``llmserve``, ``pool``, ``role``, ``namespace``, ``pod``).
- ``fulcrum-operator`` — the chart's ServiceMonitor of the operator's metrics Service. A ServiceMonitor is
  ``role: endpoints``, and Endpoints of loopback pod IPs are rejected by the API here (docs/e2e.md), so the
  job discovers the operator's pods (its selector labels, port ``metrics``) with ``role: pod`` instead.

The target address is Prometheus' default for role ``pod``: ``<pod IP>:<container port>``. Loopback pod IPs
are fine for Prometheus (it runs on the same host).

**Debian's build has no Kubernetes discovery.** Debian's ``prometheus`` (2.42 in bookworm) is built without the
``kubernetes`` service discovery (client-go is not packaged): ``kubernetes_sd_configs`` fails ``promtool check
config`` ("field kubernetes_sd_configs not found in type config.ScrapeConfig"). :func:`kubernetes_sd_supported`
tells; when it is missing the same jobs use ``http_sd_configs`` pointed at :class:`PodDiscovery`, a small
loopback HTTP server that lists the pods from the API server **with Prometheus' own ServiceAccount token** and
answers with exactly the targets and ``__meta_kubernetes_*`` labels Prometheus' ``role: pod`` discovery would
produce (one target per container port, ``<pod IP>:<port>``; a container without ports: ``<pod IP>``). The
relabelling — the PodMonitor's selection — is the same in both modes, and scraping and PromQL are Prometheus'
own. An upstream Prometheus binary (``$FULCRUM_PROMETHEUS_BIN``) uses ``kubernetes_sd_configs`` directly.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from .cluster import ManagedProcess, free_port

__all__ = ["PROMETHEUS_RBAC", "LocalPrometheus", "PodDiscovery", "kubernetes_sd_supported", "pod_targets",
           "prometheus_binary", "prometheus_config"]

PROMETHEUS_RBAC = """
apiVersion: v1
kind: ServiceAccount
metadata: {{name: prometheus, namespace: {ns}}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {{name: {ns}-prometheus}}
rules:
- apiGroups: [""]
  resources: [pods, namespaces]
  verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{name: {ns}-prometheus}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: {ns}-prometheus}}
subjects: [{{kind: ServiceAccount, name: prometheus, namespace: {ns}}}]
"""
"""Discovery rights of Prometheus' own ServiceAccount (``prometheus`` in the namespace ``{ns}``): read pods."""


def prometheus_binary() -> str | None:
    """``$FULCRUM_PROMETHEUS_BIN``, else ``prometheus`` on PATH (Debian's package), or None."""
    return os.environ.get("FULCRUM_PROMETHEUS_BIN") or shutil.which("prometheus")


def kubernetes_sd_supported(binary: str | None = None) -> bool:
    """Whether the Prometheus binary was built with the ``kubernetes`` service discovery (Debian's is not).

    Asks ``promtool check config`` beside it (else on PATH) about a config holding one ``kubernetes_sd_configs``.
    """
    binary = binary or prometheus_binary()
    if binary is None:
        return False
    promtool = Path(binary).with_name("promtool")
    tool = str(promtool) if promtool.is_file() else shutil.which("promtool")
    if tool is None:
        return b"kubernetes_sd_configs" in Path(binary).read_bytes()
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "probe.yml"
        cfg.write_text("scrape_configs:\n- job_name: probe\n  kubernetes_sd_configs:\n  - role: pod\n"
                       "    api_server: https://127.0.0.1:1\n")
        return subprocess.run([tool, "check", "config", str(cfg)], capture_output=True, timeout=60).returncode == 0


def _label_value_name(prefix: str, key: str) -> str:
    return prefix + _label_name(key)


def pod_targets(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What Prometheus' ``kubernetes_sd_configs`` (role ``pod``) makes of ``pods``: ``http_sd`` target groups,
    one per container port (a container without ports: one target at the pod IP), with the ``__meta_kubernetes_*``
    labels of Prometheus' documentation. Pods without an IP are left out, as Prometheus does."""
    groups: list[dict[str, Any]] = []
    for pod in pods:
        meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
        ip = status.get("podIP")
        if not ip:
            continue
        ready = next((c.get("status") == "True" for c in status.get("conditions") or []
                      if c.get("type") == "Ready"), False)
        common = {"__meta_kubernetes_namespace": meta.get("namespace", ""),
                  "__meta_kubernetes_pod_name": meta.get("name", ""), "__meta_kubernetes_pod_ip": ip,
                  "__meta_kubernetes_pod_ready": "true" if ready else "false",
                  "__meta_kubernetes_pod_phase": status.get("phase", ""),
                  "__meta_kubernetes_pod_node_name": spec.get("nodeName", ""),
                  "__meta_kubernetes_pod_host_ip": status.get("hostIP", ""),
                  "__meta_kubernetes_pod_uid": meta.get("uid", "")}
        for k, v in (meta.get("labels") or {}).items():
            common[_label_value_name("__meta_kubernetes_pod_label_", k)] = v
            common[_label_value_name("__meta_kubernetes_pod_labelpresent_", k)] = "true"
        for k, v in (meta.get("annotations") or {}).items():
            common[_label_value_name("__meta_kubernetes_pod_annotation_", k)] = v
            common[_label_value_name("__meta_kubernetes_pod_annotationpresent_", k)] = "true"
        owner = next((o for o in meta.get("ownerReferences") or [] if o.get("controller")), None)
        if owner:
            common["__meta_kubernetes_pod_controller_kind"] = owner.get("kind", "")
            common["__meta_kubernetes_pod_controller_name"] = owner.get("name", "")
        for init, containers in ((False, spec.get("containers") or []), (True, spec.get("initContainers") or [])):
            for c in containers:
                base = {**common, "__meta_kubernetes_pod_container_name": c.get("name", ""),
                        "__meta_kubernetes_pod_container_image": c.get("image", ""),
                        "__meta_kubernetes_pod_container_init": "true" if init else "false"}
                ports = c.get("ports") or []
                if not ports:
                    groups.append({"targets": [ip], "labels": base})
                for p in ports:
                    groups.append({"targets": [f"{ip}:{p['containerPort']}"], "labels": {
                        **base, "__meta_kubernetes_pod_container_port_name": p.get("name", ""),
                        "__meta_kubernetes_pod_container_port_number": str(p["containerPort"]),
                        "__meta_kubernetes_pod_container_port_protocol": p.get("protocol", "TCP")}})
    return groups


class PodDiscovery:
    """An ``http_sd`` endpoint on 127.0.0.1 standing in for the ``kubernetes`` discovery a Prometheus build lacks
    (module docstring): every GET lists the pods of ``namespaces`` from ``api_url`` with the bearer token in
    ``token_file`` (CA ``ca_file``) and answers :func:`pod_targets`. An API error answers 500 (Prometheus keeps
    its last targets, as with a failing watch). ``url`` is set by ``start()``."""

    def __init__(self, api_url: str, ca_file: Path, token_file: Path, namespaces: list[str] | None) -> None:
        self.api_url, self.token_file, self.namespaces = api_url, token_file, namespaces
        self.ctx = ssl.create_default_context(cafile=str(ca_file))
        self.server: ThreadingHTTPServer | None = None
        self.url = ""
        self.requests = 0

    def pods(self) -> list[dict[str, Any]]:
        """The pods, listed with Prometheus' token (urllib.error.HTTPError when the API refuses)."""
        headers = {"Authorization": "Bearer " + self.token_file.read_text().strip()}
        paths = ([f"/api/v1/namespaces/{ns}/pods" for ns in self.namespaces] if self.namespaces
                 else ["/api/v1/pods"])
        items: list[dict[str, Any]] = []
        for path in paths:
            req = urllib.request.Request(self.api_url + path, headers=headers)
            with urllib.request.urlopen(req, context=self.ctx, timeout=10) as r:  # noqa: S310 (local API server)
                items += json.loads(r.read()).get("items") or []
        return items

    def start(self) -> None:
        """Serve on a free port of 127.0.0.1 (a daemon thread)."""
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                outer.requests += 1
                try:
                    body, code = json.dumps(pod_targets(outer.pods())).encode(), 200
                except (OSError, ValueError) as err:
                    body, code = str(err).encode(), 500
                self.send_response(code)
                self.send_header("Content-Type", "application/json" if code == 200 else "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/targets"
        threading.Thread(target=self.server.serve_forever, name="pod-discovery", daemon=True).start()

    def stop(self) -> None:
        """Stop serving."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def _sd(api_url: str, ca_file: Path, token_file: Path, namespaces: list[str] | None) -> dict[str, Any]:
    sd: dict[str, Any] = {"role": "pod", "api_server": api_url,
                          "tls_config": {"ca_file": str(ca_file)},
                          "authorization": {"type": "Bearer", "credentials_file": str(token_file)}}
    if namespaces:
        sd["namespaces"] = {"names": list(namespaces)}
    return sd


def _workload_relabelings(port: str) -> list[dict[str, Any]]:
    """The PodMonitor's selection (as the Prometheus Operator generates it) + ``fulcrum.workloadRelabelings``."""
    return [
        {"source_labels": ["__meta_kubernetes_pod_label_app_kubernetes_io_managed_by"], "regex": "fulcrum-operator",
         "action": "keep"},
        {"source_labels": ["__meta_kubernetes_pod_labelpresent_fulcrum_dev_llmserve"], "regex": "true",
         "action": "keep"},
        {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": port, "action": "keep"},
        {"source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)", "action": "drop"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "regex": "(.+)-[a-z0-9]+-[a-z0-9]+",
         "target_label": "job", "replacement": "$1"},
        {"source_labels": ["__meta_kubernetes_pod_label_fulcrum_dev_llmserve"], "target_label": "llmserve"},
        {"source_labels": ["__meta_kubernetes_pod_label_fulcrum_dev_pool"], "target_label": "pool"},
        {"source_labels": ["__meta_kubernetes_pod_label_fulcrum_dev_role"], "target_label": "role"},
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
    ]


def prometheus_config(api_url: str, ca_file: Path, token_file: Path, *, scrape_interval_s: float = 2.0,
                      operator_selector: dict[str, str] | None = None,
                      namespaces: list[str] | None = None, http_sd_url: str | None = None) -> dict[str, Any]:
    """The ``prometheus.yml`` (as a mapping): the jobs of the module docstring.

    Args:
        api_url: the API server; ca_file: its CA; token_file: a bearer token allowed to list/watch pods.
        operator_selector: the labels of the operator's pods (the chart's ServiceMonitor selector); None: no
            operator job.
        namespaces: namespaces to discover in; None: all.
        http_sd_url: a :class:`PodDiscovery` URL: discover through it (``http_sd_configs``) instead of
            ``kubernetes_sd_configs`` (a Prometheus built without the Kubernetes discovery).
    """
    interval = f"{max(int(scrape_interval_s), 1)}s"

    def sd() -> dict[str, Any]:
        if http_sd_url:
            return {"http_sd_configs": [{"url": http_sd_url, "refresh_interval": interval}]}
        return {"kubernetes_sd_configs": [_sd(api_url, ca_file, token_file, namespaces)]}

    jobs: list[dict[str, Any]] = []
    for port in ("http", "scheduler"):
        jobs.append({"job_name": f"fulcrum-workloads-{port}", "honor_labels": True, "metrics_path": "/metrics",
                     "scrape_interval": interval, "scrape_timeout": interval, **sd(),
                     "relabel_configs": _workload_relabelings(port)})
    if operator_selector:
        keep = [{"source_labels": [f"__meta_kubernetes_pod_label_{_label_name(k)}"], "regex": v, "action": "keep"}
                for k, v in sorted(operator_selector.items())]
        jobs.append({"job_name": "fulcrum-operator", "metrics_path": "/metrics", "scrape_interval": interval,
                     "scrape_timeout": interval, **sd(),
                     "relabel_configs": keep + [
                         {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": "metrics",
                          "action": "keep"},
                         {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                         {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"}]})
    return {"global": {"scrape_interval": interval, "evaluation_interval": interval}, "scrape_configs": jobs}


def _label_name(k: str) -> str:
    """A Kubernetes label key as Prometheus' discovery names it (every non-alphanumeric character → ``_``)."""
    return "".join(ch if ch.isalnum() else "_" for ch in k)


@dataclass
class LocalPrometheus:
    """``prometheus`` on ``127.0.0.1:<port>`` with the config of :func:`prometheus_config` under ``workdir``.

    ``start()`` returns once ``/-/ready`` answers; ``url`` is its base URL; ``targets()`` and ``query()`` read
    its HTTP API; ``stop()`` ends it. Its log: ``workdir/prometheus.log``.
    """

    workdir: Path
    config: dict[str, Any]
    host: str = "127.0.0.1"
    port: int = 0
    process: ManagedProcess | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 60.0) -> None:
        """Write the config, start Prometheus, wait for ``/-/ready`` (RuntimeError with its log tail)."""
        binary = prometheus_binary()
        if binary is None:
            raise RuntimeError("prometheus is not installed (scripts/install-servers.sh installs Debian's)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port(self.host)
        cfg = self.workdir / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(self.config, sort_keys=False))
        promtool = Path(binary).with_name("promtool")
        check = subprocess.run([str(promtool) if promtool.is_file() else shutil.which("promtool") or "true",
                                "check", "config", str(cfg)],
                               capture_output=True, text=True, timeout=60)
        if check.returncode != 0:
            raise RuntimeError(f"promtool check config {cfg}: {check.stdout}{check.stderr}")
        self.process = ManagedProcess("prometheus", [
            binary, f"--config.file={cfg}", f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address={self.host}:{self.port}", "--storage.tsdb.retention.time=1h",
            "--log.level=info"], self.workdir / "prometheus.log")
        self.process.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.process.alive():
                raise RuntimeError(f"prometheus exited; its log:\n{self.process.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:  # noqa: S310 (loopback)
                    if r.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.3)
        raise RuntimeError(f"prometheus not ready in {timeout_s:.0f} s; its log:\n{self.process.tail()}")

    def api(self, path: str, **params: str) -> Any:
        """GET ``/api/v1/<path>`` → its ``data`` (RuntimeError when the answer is not ``success``)."""
        qs = ("?" + urllib.parse.urlencode(params)) if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{qs}", timeout=10) as r:  # noqa: S310 (loopback)
            body = json.loads(r.read())
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus /api/v1/{path}: {body}")
        return body["data"]

    def targets(self) -> list[dict[str, Any]]:
        """The active targets (``labels``, ``health``, ``lastError``, ``scrapeUrl``…)."""
        return list(self.api("targets", state="active")["activeTargets"])

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's result vector."""
        return list(self.api("query", query=promql)["result"])

    def tail(self, n_chars: int = 3000) -> str:
        """The end of its log."""
        return self.process.tail(n_chars) if self.process else ""

    def stop(self) -> None:
        """Stop it (SIGTERM to its process group, SIGKILL after 10 s)."""
        if self.process is not None:
            self.process.stop()
