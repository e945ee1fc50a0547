"""Install ``charts/fulcrum`` on the local cluster the way ``helm install`` would, without a helm binary: the chart
is rendered by Helm's own Go engine (``tests/helm_render.py``, package ``helm-python-sdk``) and applied with
``kubectl apply --server-side`` in Helm's order — the chart's ``crds/`` first (and CRDs among the templates,
waited for until ``Established``), then the templates, then the ``post-install`` hooks.

``local_values(...)`` are the values for this cluster: an image whose name contains ``fulcrum`` (the process
node agent then runs the installed ``fulcrum``), the operator's ``--prometheus-url``, and etcd/NATS not bundled
(their images cannot run as host processes): ``etcd.endpoint`` names an etcd the test runs on a loopback address.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = ["REPO", "Installed", "helm_render", "install", "local_values", "split_objects", "uninstall"]

REPO = Path(__file__).resolve().parents[2]


def helm_render() -> Any:
    """``tests/helm_render.py`` as a module (the tests folder is not a package)."""
    spec = importlib.util.spec_from_file_location("fulcrum_helm_render", REPO / "tests" / "helm_render.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("fulcrum_helm_render", mod)
    spec.loader.exec_module(mod)
    return mod


def local_values(*, prometheus_url: str, etcd_endpoint: str, watch_namespaces: list[str],
                 image_tag: str = "local", extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Chart values for the local cluster (module docstring); ``extra`` is merged over them (one level)."""
    values: dict[str, Any] = {
        "image": {"repository": "ghcr.io/fulcrum-llm/fulcrum", "tag": image_tag, "pullPolicy": "Never"},
        "operator": {"namespaces": list(watch_namespaces), "prometheusUrl": prometheus_url, "logFormat": "text",
                     # every pod shares the host's network namespace: ports are per pod IP, but keep them apart
                     # from the defaults of anything else the test runs on 127.0.0.1
                     "livenessPort": 8080, "metricsPort": 9090,
                     "extraArgs": ["--drain-poll-seconds=1"]},
        "etcd": {"enabled": False, "endpoint": etcd_endpoint},
        "nats": {"enabled": False, "url": ""},
    }
    for k, v in (extra or {}).items():
        if isinstance(v, dict) and isinstance(values.get(k), dict):
            values[k] = {**values[k], **v}
        else:
            values[k] = v
    return values


def split_objects(objs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(CRDs, ordinary objects, post-install hooks) in Helm's install order."""
    crds, plain, hooks = [], [], []
    for o in objs:
        hook = ((o.get("metadata") or {}).get("annotations") or {}).get("helm.sh/hook", "")
        if "post-install" in hook:
            hooks.append(o)
        elif o.get("kind") == "CustomResourceDefinition":
            crds.append(o)
        else:
            plain.append(o)
    return crds, plain, hooks


@dataclass
class Installed:
    """A release on the cluster: what was applied, and how long each step took."""

    release: str
    namespace: str
    objects: list[dict[str, Any]]
    timings_s: dict[str, float] = field(default_factory=dict)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        """The applied objects of one kind."""
        return [o for o in self.objects if o.get("kind") == kind]

    @property
    def service_account(self) -> str:
        """The operator's ServiceAccount name."""
        return str(self.of_kind("ServiceAccount")[0]["metadata"]["name"])

    @property
    def operator_deployment(self) -> str:
        """The operator Deployment's name."""
        return next(str(o["metadata"]["name"]) for o in self.of_kind("Deployment")
                    if o["metadata"]["name"].endswith("-operator"))


_BEFORE_WORKLOADS = ("ServiceAccount", "Secret", "ConfigMap", "ClusterRole", "ClusterRoleBinding", "Role",
                     "RoleBinding")


def _apply(cluster: Any, objs: list[dict[str, Any]]) -> None:
    if objs:
        cluster.kubectl("apply", "--server-side", "--field-manager=helm", "--force-conflicts", "-f", "-",
                        input_text=yaml.safe_dump_all(objs), timeout=120)


def install(cluster: Any, values: dict[str, Any], *, release: str, namespace: str,
            ready_timeout_s: float = 180.0) -> Installed:
    """Render and apply the chart (module docstring); returns once the operator Deployment is Available.

    Raises:
        subprocess.CalledProcessError: kubectl rejected an object; TimeoutError: the operator not ready in time.
    """
    hr = helm_render()
    t0 = time.monotonic()
    objs = hr.objects(hr.render(values, release=release, namespace=namespace))
    timings = {"render": time.monotonic() - t0}
    cluster.kubectl("create", "namespace", namespace, check=False)
    cluster.kubectl("apply", "--server-side", "--field-manager=helm", "--force-conflicts",
                    "-f", str(hr.CHART / "crds"), timeout=120)
    crds, plain, hooks = split_objects(objs)
    _apply(cluster, crds)
    names = [f"crd/{c['metadata']['name']}" for c in crds] + [
        f"crd/{yaml.safe_load(p.read_text())['metadata']['name']}" for p in sorted((hr.CHART / "crds").glob("*.yaml"))]
    cluster.kubectl("wait", "--for=condition=Established", *names, "--timeout=60s", timeout=70)
    timings["crds"] = time.monotonic() - t0
    # Helm's install order: identities and RBAC exist before the workloads that use them (a Deployment applied in
    # the same request as its ServiceAccount lost that race in CI: "serviceaccount not found", pod never created)
    first = [o for o in plain if o.get("kind") in _BEFORE_WORKLOADS]
    _apply(cluster, first)
    _apply(cluster, [o for o in plain if o.get("kind") not in _BEFORE_WORKLOADS])
    _apply(cluster, hooks)
    timings["applied"] = time.monotonic() - t0
    inst = Installed(release, namespace, crds + plain + hooks, timings)
    dep = inst.operator_deployment
    try:
        cluster.kubectl("rollout", "status", f"deployment/{dep}", "-n", namespace,
                        f"--timeout={int(ready_timeout_s)}s", timeout=ready_timeout_s + 10)
    except subprocess.CalledProcessError as err:
        raise TimeoutError(f"deployment {dep} not ready in {ready_timeout_s:.0f} s: {err.stdout}{err.stderr}") from err
    timings["operator_ready"] = time.monotonic() - t0
    return inst


def uninstall(cluster: Any, inst: Installed) -> None:
    """Delete what ``install`` applied (namespaced objects, cluster-scoped RBAC; CRDs are kept, as Helm does)."""
    keep = {"CustomResourceDefinition"}
    objs = [o for o in inst.objects if o.get("kind") not in keep]
    if objs:
        cluster.kubectl("delete", "--ignore-not-found", "--wait=false", "-f", "-",
                        input_text=yaml.safe_dump_all(objs), check=False, timeout=120)
