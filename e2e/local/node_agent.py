"""The *process node agent*: a Node whose pods run as host processes. It is not a kubelet.

What it does, per Node (``NodeAgent``):

- registers the Node (capacity: cpu, memory, pods, an emulated ``nvidia.com/gpu``; Ready condition) and renews
  its Lease in ``kube-node-lease`` every 10 s;
- watches the pods bound to it (``spec.nodeName``) and, for each (``PodRunner``): gives it a loopback address of
  its own (``127.0.x.y``: ``status.podIP``), materialises its volumes (ConfigMap, Secret, projected
  service-account token + ``kube-root-ca.crt`` + downward API, downwardAPI, emptyDir, hostPath) in a per-pod
  folder, runs each container's ``command``/``args`` with Kubernetes ``$(VAR)`` expansion and its env (values,
  fieldRefs, ConfigMap/Secret keys, envFrom) inside a private mount namespace (``unshare --mount``) where those
  folders are bind-mounted at their ``mountPath`` and a per-pod ``/etc/hosts`` names the Services (see
  service_proxy); runs init containers first; runs startup/readiness/liveness probes (httpGet, tcpSocket,
  exec); reports phase, conditions, podIP(s), container statuses; restarts per ``restartPolicy`` (back-off 1 s
  doubling to 30 s); on deletion runs preStop (exec, httpGet), sends SIGTERM to each container's process group,
  waits the grace period, SIGKILLs, and deletes the pod object (grace 0).

Images are not pulled. A container runs when its ``command`` names a host program: ``fulcrum`` is the
``fulcrum`` of this Python environment (``fulcrum worker`` only where vLLM is importable), anything else must be
on ``PATH``. Otherwise it stays Waiting with reason ``ProcessAgentCannotRun`` and a message saying why (also
when ``command`` is absent: the image's entrypoint is unknown here).

Every container gets ``KUBERNETES_SERVICE_HOST=127.0.0.1``, ``KUBERNETES_SERVICE_PORT=<API port>`` (there is
no kube-proxy: ClusterIPs are never dialled), ``HOSTNAME=<pod name>`` and ``FULCRUM_BIND_HOST=<pod IP>`` (Fulcrum's
servers bind it in place of a wildcard ``--host``, so two pods' equal ports do not clash). A program that binds
``0.0.0.0`` itself takes that port on every loopback address: two such pods with one port clash.

Not done: images, resource limits (cgroups), network isolation, ``kubectl logs/exec/port-forward`` (no kubelet
API; container logs are files in the pod folder: ``PodRunner.log_path``), Service environment variables
(``enableServiceLinks``), PVCs, sidecar init containers, gRPC probes, ephemeral containers.
"""

from __future__ import annotations

import base64
import contextlib
import importlib.util
import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .cluster import REPO as _REPO, die_with_parent
from .service_proxy import LoopbackAllocator, ServiceProxies, informer

__all__ = ["CANNOT_RUN", "CONFIG_ERROR", "CannotRun", "NodeAgent", "PodRunner", "expand"]

log = logging.getLogger("fulcrum.e2e.node_agent")

CANNOT_RUN = "ProcessAgentCannotRun"
"""Waiting reason of a container the agent cannot run as a host process."""
CONFIG_ERROR = "CreateContainerConfigError"
"""Waiting reason while a ConfigMap, Secret or key a container needs is missing (the kubelet's)."""
STAGING = "/run/fulcrum-process-node-staging"
"""Where a container's mount namespace stages its volume sources (a tmpfs of its own, never seen outside)."""
_BACKOFF_MAX_S = 30.0
_VAR = re.compile(r"\$(\$|\(([A-Za-z_][A-Za-z0-9_.-]*)\))")


class CannotRun(Exception):
    """This container cannot run as a host process here (the message says why).

    ``reason``: ``ProcessAgentCannotRun`` (never will: an image, a program, a feature the agent lacks) or
    ``CreateContainerConfigError`` (a ConfigMap, Secret or key that is missing now: retried every 5 s, as the
    kubelet does).
    """

    def __init__(self, message: str, reason: str = CANNOT_RUN) -> None:
        super().__init__(message)
        self.reason = reason

    @property
    def retry(self) -> bool:
        """Whether a later attempt may succeed."""
        return self.reason == CONFIG_ERROR


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: a defined VAR is replaced, an undefined one stays as written,
    ``$$`` is a literal ``$`` (so ``$$(VAR)`` gives ``$(VAR)``)."""
    def sub(m: re.Match[str]) -> str:
        if m.group(1) == "$":
            return "$"
        return env.get(m.group(2), m.group(0))
    return _VAR.sub(sub, text)


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _now_micro() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _field(pod: dict[str, Any], path: str) -> str:
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    simple = {
        "metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"), "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"), "status.podIP": status.get("podIP"),
        "status.hostIP": "127.0.0.1", "status.podIPs": status.get("podIP"), "status.hostIPs": "127.0.0.1",
    }
    if path not in simple:
        raise CannotRun(f"fieldRef {path!r} is not supported by the process node agent")
    return str(simple[path] or "")


# --- containers ------------------------------------------------------------------------------------------


@dataclass
class Probe:
    """One probe's settings and counters (Kubernetes defaults)."""

    spec: dict[str, Any]
    kind: str  # startup | readiness | liveness
    successes: int = 0
    failures: int = 0
    next_at: float = 0.0
    last_message: str = ""

    @property
    def period(self) -> float:
        """``periodSeconds`` (default 10)."""
        return float(self.spec.get("periodSeconds") or 10)

    @property
    def timeout(self) -> float:
        """``timeoutSeconds`` (default 1)."""
        return float(self.spec.get("timeoutSeconds") or 1)


@dataclass
class Container:
    """A container of a pod: its argv, env, process and the status the agent reports."""

    spec: dict[str, Any]
    init: bool = False
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    state: dict[str, Any] = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: dict[str, Any] = field(default_factory=dict)
    ready: bool = False
    started: bool = False
    restart_at: float = 0.0
    started_mono: float = 0.0
    probes: dict[str, Probe] = field(default_factory=dict)
    probe_lock: threading.Lock = field(default_factory=threading.Lock)
    killed_by: str = ""

    @property
    def name(self) -> str:
        """The container's name."""
        return str(self.spec["name"])

    def status(self) -> dict[str, Any]:
        """This container's entry of ``status.containerStatuses``."""
        out: dict[str, Any] = {"name": self.name, "image": self.spec.get("image") or "", "imageID": "",
                               "ready": self.ready, "restartCount": self.restarts, "state": self.state,
                               "started": self.started}
        if self.proc is not None and "running" in self.state:
            out["containerID"] = f"process://{self.proc.pid}"
        if self.last_state:
            out["lastState"] = self.last_state
        return out


class PodRunner:
    """Runs one pod's containers as processes and reports its status (a thread of its own).

    Lifecycle: ``update(pod)`` with each watched version; a ``deletionTimestamp`` starts the termination.
    ``done`` is set once the processes are gone and the pod object was deleted.
    """

    def __init__(self, agent: NodeAgent, pod: dict[str, Any]) -> None:
        self.agent = agent
        self.pod = pod
        meta = pod["metadata"]
        self.key = f"{meta['namespace']}/{meta['name']}"
        self.dir = agent.workdir / "pods" / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"
        self.ip = ""
        self._own_ip = False
        self.init_containers = [Container(c, init=True) for c in pod["spec"].get("initContainers") or []]
        self.containers = [Container(c) for c in pod["spec"]["containers"]]
        self.deleting = threading.Event()
        self.vanished = threading.Event()  # the object is gone from the API (force-deleted)
        self.done = threading.Event()
        self._published: str = ""
        self._phase = "Pending"
        self._init_done = not self.init_containers
        self._cannot_run = ""
        self._retry_at = float("inf")
        self._volumes_refreshed = 0.0
        self._token_expiry: dict[str, float] = {}
        self.thread = threading.Thread(target=self._run, name=f"pod-{self.key}", daemon=True)

    def log_path(self, container: str) -> Path:
        """The file holding ``container``'s stdout and stderr (appended across restarts)."""
        return self.dir / "logs" / f"{container}.log"

    def update(self, pod: dict[str, Any]) -> None:
        """A newer version of the pod object."""
        self.pod = pod
        if pod["metadata"].get("deletionTimestamp"):
            self.deleting.set()

    # --- main loop -------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._prepare()
            while not self.deleting.is_set():
                self._tick()
                self._publish()
                self.deleting.wait(0.25)
        except Exception as err:  # noqa: BLE001 (reported on the pod, kept in the agent's log)
            log.exception("pod %s failed in the agent", self.key)
            self._cannot_run = self._cannot_run or f"process node agent error: {err}"
            for c in self.containers:
                c.state = {"waiting": {"reason": CANNOT_RUN, "message": self._cannot_run}}
            with contextlib.suppress(Exception):
                self._publish()
            self.deleting.wait()
        finally:
            self._terminate()
            if self._own_ip:
                self.agent.pod_ips.release(self.ip)
                self.agent.hosts_files.pop(self.key, None)
            if not self.vanished.is_set():
                self.agent.delete_pod(self.pod)
            self.done.set()

    def _prepare(self) -> None:
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        ports = [int(p["containerPort"]) for c in self.containers for p in c.spec.get("ports") or []]
        if self.pod["spec"].get("hostNetwork"):
            self.ip = "127.0.0.1"  # the node's address; its ports are shared with everything on the host
        else:
            self.ip = self.agent.pod_ips.allocate(ports)
            self._own_ip = True
        self.agent.hosts_files[self.key] = self.dir / "hosts"
        self.agent.write_hosts(self.key)
        self._publish(force=True)
        self._configure()

    def _configure(self) -> None:
        """Volumes, env and argv of every container; on CannotRun the containers wait with its reason."""
        try:
            self._refresh_volumes(first=True)
            for c in [*self.init_containers, *self.containers]:
                self._resolve(c)
        except CannotRun as err:
            self._cannot_run = str(err)
            self._retry_at = time.monotonic() + 5.0 if err.retry else float("inf")
            for c in [*self.init_containers, *self.containers]:
                c.state = {"waiting": {"reason": err.reason, "message": str(err)}}
            log.info("pod %s: cannot run (%s): %s", self.key, err.reason, err)
        else:
            if self._cannot_run:
                for c in [*self.init_containers, *self.containers]:
                    c.state = {"waiting": {"reason": "ContainerCreating"}}
            self._cannot_run = ""

    def _tick(self) -> None:
        now = time.monotonic()
        if self._cannot_run:
            if now >= self._retry_at:
                self._configure()
            if self._cannot_run:
                return
        if now - self._volumes_refreshed > 5:
            self._refresh_volumes()
        if not self._init_done:
            self._tick_init(now)
            return
        policy = self.pod["spec"].get("restartPolicy", "Always")
        for c in self.containers:
            if c.proc is None:
                if c.restart_at <= now and not ("terminated" in c.state and not self._restarts(policy, c)):
                    self._start(c)
                continue
            rc = c.proc.poll()
            if rc is not None:
                self._exited(c, rc, policy)
                continue
            self._probe_due(c, now)

    def _tick_init(self, now: float) -> None:
        policy = self.pod["spec"].get("restartPolicy", "Always")
        for c in self.init_containers:
            if "terminated" in c.state and c.state["terminated"]["exitCode"] == 0:
                continue
            if c.proc is None:
                if c.restart_at <= now and not ("terminated" in c.state and policy == "Never"):
                    self._start(c)
                return
            rc = c.proc.poll()
            if rc is None:
                return
            self._exited(c, rc, "OnFailure" if policy == "Always" else policy)
            if rc != 0:
                return
        self._init_done = True

    @staticmethod
    def _restarts(policy: str, c: Container) -> bool:
        code = c.state.get("terminated", {}).get("exitCode", 0)
        return policy == "Always" or (policy == "OnFailure" and code != 0)

    # --- resolving a container: argv, env, mounts ------------------------------------------------------

    def _env(self, c: Container) -> dict[str, str]:
        pod, agent = self.pod, self.agent
        base = {
            "PATH": f"{agent.python_bin}:{os.environ.get('PATH', '/usr/local/bin:/usr/bin:/bin')}",
            "HOME": os.environ.get("HOME", "/root"), "LANG": os.environ.get("LANG", "C.UTF-8"),
            "HOSTNAME": pod["metadata"]["name"], "PYTHONUNBUFFERED": "1",
            "KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(agent.api_port),
            "KUBERNETES_SERVICE_PORT_HTTPS": str(agent.api_port), "FULCRUM_BIND_HOST": self.ip,
        }
        ns = pod["metadata"]["namespace"]
        env: dict[str, str] = {}
        for src in c.spec.get("envFrom") or []:
            prefix = src.get("prefix", "")
            for kind in ("configMapRef", "secretRef"):
                ref = src.get(kind)
                if ref:
                    data = agent.read_data(kind[:-3], ns, ref["name"], optional=bool(ref.get("optional")))
                    env.update({prefix + k: v for k, v in data.items()})
        for e in c.spec.get("env") or []:
            if "valueFrom" not in e:
                env[e["name"]] = expand(e.get("value", ""), {**base, **env})
                continue
            vf = e["valueFrom"]
            if "fieldRef" in vf:
                env[e["name"]] = _field(pod, vf["fieldRef"]["fieldPath"]) if vf["fieldRef"]["fieldPath"] != \
                    "status.podIP" else self.ip
            elif "configMapKeyRef" in vf or "secretKeyRef" in vf:
                kind = "configMap" if "configMapKeyRef" in vf else "secret"
                ref = vf[f"{kind}KeyRef"]
                data = agent.read_data(kind, ns, ref["name"], optional=bool(ref.get("optional")))
                if ref["key"] not in data and not ref.get("optional"):
                    raise CannotRun(f"env {e['name']}: key {ref['key']!r} not in {kind} {ns}/{ref['name']}",
                                    CONFIG_ERROR)
                if ref["key"] in data:
                    env[e["name"]] = data[ref["key"]]
            elif "resourceFieldRef" in vf:
                res = vf["resourceFieldRef"]["resource"]
                part, _, name = res.partition(".")
                env[e["name"]] = str(((c.spec.get("resources") or {}).get(part) or {}).get(name, "0"))
            else:
                raise CannotRun(f"env {e['name']}: valueFrom {sorted(vf)} is not supported")
        return {**base, **env}

    def _resolve(self, c: Container) -> None:
        env = self._env(c)
        command = [expand(a, env) for a in c.spec.get("command") or []]
        args = [expand(a, env) for a in c.spec.get("args") or []]
        image = c.spec.get("image") or ""
        if not command:
            raise CannotRun(f"container {c.name}: no command, and the entrypoint of image {image!r} is unknown "
                            f"(the process node agent pulls no images; it runs host programs)")
        exe = command[0]
        if Path(exe).name == "fulcrum":
            exe = str(self.agent.python_bin / "fulcrum")
            if args[:1] == ["worker"] and importlib.util.find_spec("vllm") is None:
                raise CannotRun(f"container {c.name}: `fulcrum worker` needs vLLM and a GPU (image {image!r}); "
                                f"vLLM is not installed here")
        else:
            found = shutil.which(exe, path=env["PATH"])
            if found is None:
                raise CannotRun(f"container {c.name}: {exe!r} is not a program on this host (image {image!r} is "
                                f"not pulled: the process node agent runs host programs)")
            exe = found
        c.env = env
        c.argv = [exe, *command[1:], *args]
        c.probes = {k: Probe(c.spec[f"{k}Probe"], k) for k in ("startup", "readiness", "liveness")
                    if c.spec.get(f"{k}Probe") and not c.init}

    def _mounts(self, c: Container) -> list[tuple[Path, str]]:
        vols = {v["name"]: v for v in self.pod["spec"].get("volumes") or []}
        out: list[tuple[Path, str]] = []
        for m in c.spec.get("volumeMounts") or []:
            v = vols.get(m["name"])
            if v is None:
                raise CannotRun(f"container {c.name}: volumeMount {m['name']!r} names no volume")
            src = Path(v["hostPath"]["path"]) if "hostPath" in v else self.dir / "volumes" / m["name"]
            if m.get("subPath"):
                src = src / m["subPath"]
            out.append((src, m["mountPath"]))
        out.append((self.dir / "hosts", "/etc/hosts"))
        return out

    def _wrapper(self, c: Container, argv: list[str] | None = None) -> list[str]:
        """``unshare --mount`` + a shell that bind-mounts the volumes, then execs ``argv`` (default: the
        container's own; exec probes and hooks run in a namespace like the container's).

        Every source is first bind-mounted onto a private tmpfs at ``STAGING`` and only then onto its mountPath
        (parents before children): a mountPath that covers a source's folder (an emptyDir at ``/tmp`` while the
        pod folders live under ``/tmp``) would otherwise hide the sources mounted after it. The host folders the
        program itself runs from — this Python environment and the repository an editable install points into —
        are bound back over any mountPath that covers them (a checkout under ``/tmp`` would otherwise vanish
        under the chart operator's ``/tmp`` emptyDir: "fulcrum: not found").
        """
        mounts = self._mounts(c)
        dests = [Path(d) for _, d in mounts]
        for keep in sorted({Path(sys.prefix).resolve(), _REPO}):
            if any(d == keep or d in keep.parents for d in dests):
                mounts.append((keep, str(keep)))
        mounts = sorted(mounts, key=lambda m: len(Path(m[1]).parts))
        lines = ["set -e", f"mkdir -p {STAGING}", f"mount -t tmpfs -o size=1m fulcrum-staging {STAGING}"]
        for i, (src, _) in enumerate(mounts):
            stage = f"{STAGING}/{i}"
            lines.append(f"mkdir {stage}" if src.is_dir() else f"touch {stage}")
            lines.append(f"mount --bind {shlex.quote(str(src))} {stage}")
        for i, (src, dest) in enumerate(mounts):
            d = shlex.quote(dest)
            if src.is_dir():
                lines.append(f"mkdir -p {d}")
            else:
                lines.append(f"mkdir -p {shlex.quote(str(Path(dest).parent))}; [ -e {d} ] || touch {d}")
            lines.append(f"mount --bind {STAGING}/{i} {d}")
        lines.append('exec "$@"')
        script = self.dir / f"{c.name}.mounts.sh"
        script.write_text("\n".join(lines) + "\n")
        return ["unshare", "--mount", "--propagation", "private", "/bin/sh", str(script), *(argv or c.argv)]

    # --- volumes ---------------------------------------------------------------------------------------

    def _refresh_volumes(self, first: bool = False) -> None:
        """(Re)write every ConfigMap/Secret/projected/downwardAPI volume (atomic per file; like the kubelet,
        later changes show up after a few seconds)."""
        self._volumes_refreshed = time.monotonic()
        ns = self.pod["metadata"]["namespace"]
        for v in self.pod["spec"].get("volumes") or []:
            root = self.dir / "volumes" / v["name"]
            root.mkdir(parents=True, exist_ok=True)
            try:
                files = self._volume_files(v, ns)
            except CannotRun:
                if first:
                    raise
                continue
            for rel, data in files.items():
                path = root / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                if path.is_file() and path.read_bytes() == data:
                    continue
                tmp = path.with_name(f".{path.name}.tmp")
                tmp.write_bytes(data)
                tmp.replace(path)
            if any(k in v for k in ("configMap", "secret", "projected", "downwardAPI")):
                for old in [p for p in root.rglob("*") if p.is_file()]:
                    if str(old.relative_to(root)) not in files:
                        old.unlink()  # a key removed from its ConfigMap or Secret

    def _volume_files(self, v: dict[str, Any], ns: str) -> dict[str, bytes]:
        if "emptyDir" in v or "hostPath" in v:
            return {}
        if "configMap" in v or "secret" in v:
            kind = "configMap" if "configMap" in v else "secret"
            src = v[kind]
            name = src.get("name") or src.get("secretName")
            return self._keyed(kind, ns, name, src.get("items"), bool(src.get("optional")))
        if "downwardAPI" in v:
            return {i["path"]: _field(self.pod, i["fieldRef"]["fieldPath"]).encode()
                    for i in v["downwardAPI"].get("items") or [] if "fieldRef" in i}
        if "projected" in v:
            out: dict[str, bytes] = {}
            for s in v["projected"].get("sources") or []:
                if "serviceAccountToken" in s:
                    out[s["serviceAccountToken"]["path"]] = self._token(v["name"], s["serviceAccountToken"])
                elif "configMap" in s or "secret" in s:
                    kind = "configMap" if "configMap" in s else "secret"
                    out.update(self._keyed(kind, ns, s[kind]["name"], s[kind].get("items"),
                                           bool(s[kind].get("optional"))))
                elif "downwardAPI" in s:
                    out.update({i["path"]: _field(self.pod, i["fieldRef"]["fieldPath"]).encode()
                                for i in s["downwardAPI"].get("items") or [] if "fieldRef" in i})
            return out
        raise CannotRun(f"volume {v['name']!r}: kind {sorted(k for k in v if k != 'name')} is not supported by "
                        f"the process node agent")

    def _keyed(self, kind: str, ns: str, name: str, items: list[dict[str, Any]] | None,
               optional: bool) -> dict[str, bytes]:
        data = self.agent.read_data(kind, ns, name, optional=optional, binary=True)
        if items:
            return {i["path"]: data[i["key"]] for i in items if i["key"] in data}
        return {k: bytes(v) for k, v in data.items()}

    def _token(self, volume: str, src: dict[str, Any]) -> bytes:
        key = f"{volume}/{src['path']}"
        path = self.dir / "volumes" / volume / src["path"]
        if path.is_file() and time.time() < self._token_expiry.get(key, 0):
            return bytes(path.read_bytes())
        seconds = int(src.get("expirationSeconds") or 3600)
        token = self.agent.request_token(self.pod, src.get("audience"), seconds)
        self._token_expiry[key] = time.time() + 0.8 * seconds  # the kubelet refreshes at 80 % of the lifetime
        return token.encode()

    # --- processes -------------------------------------------------------------------------------------

    def _start(self, c: Container) -> None:
        out = self.log_path(c.name).open("ab")
        out.write(f"----- {_now()} start {shlex.join(c.argv)}\n".encode())
        out.flush()
        try:
            c.proc = subprocess.Popen(die_with_parent(self._wrapper(c)), stdout=out, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=c.env, start_new_session=True,
                                      cwd=c.spec.get("workingDir") or str(self.dir))
        finally:
            out.close()
        c.started_mono = time.monotonic()
        c.state = {"running": {"startedAt": _now()}}
        c.started = "startup" not in c.probes
        c.ready = c.started and "readiness" not in c.probes
        for p in c.probes.values():
            p.successes = p.failures = 0
            p.next_at = time.monotonic() + float(p.spec.get("initialDelaySeconds") or 0)
        log.info("pod %s: started %s (pid %d) on %s", self.key, c.name, c.proc.pid, self.ip)

    def _exited(self, c: Container, rc: int, policy: str) -> None:
        started = c.state.get("running", {}).get("startedAt", _now())
        reason = c.killed_by or ("Completed" if rc == 0 else "Error")
        c.state = {"terminated": {"exitCode": rc, "reason": reason, "startedAt": started, "finishedAt": _now()}}
        c.killed_by = ""
        if c.proc is not None:
            _signal_group(c.proc, signal.SIGKILL)  # what its leader left behind
        c.proc = None
        c.ready = c.started = False
        if self._restarts(policy, c):
            ran = time.monotonic() - c.started_mono
            delay = 1.0 if ran > 60 else min(_BACKOFF_MAX_S, 2.0 ** min(c.restarts, 5))
            c.last_state = c.state
            c.state = {"waiting": {"reason": "CrashLoopBackOff",
                                   "message": f"back-off {delay:.0f}s restarting failed container={c.name}"}}
            c.restarts += 1
            c.restart_at = time.monotonic() + delay
        log.info("pod %s: %s exited rc=%s", self.key, c.name, rc)

    def _probe_due(self, c: Container, now: float) -> None:
        for kind in ("startup", "readiness", "liveness"):
            p = c.probes.get(kind)
            if p is None or now < p.next_at or (kind != "startup" and not c.started):
                continue
            if kind == "startup" and c.started:
                continue
            if not c.probe_lock.acquire(blocking=False):
                return  # a probe of this container still runs
            p.next_at = now + p.period
            threading.Thread(target=self._probe, args=(c, p), daemon=True).start()
            return

    def _probe(self, c: Container, p: Probe) -> None:
        try:
            ok, msg = self._check(c, p.spec, p.timeout)
            p.last_message = msg
            if ok:
                p.successes, p.failures = p.successes + 1, 0
            else:
                p.successes, p.failures = 0, p.failures + 1
            success_threshold = int(p.spec.get("successThreshold") or 1)
            failure_threshold = int(p.spec.get("failureThreshold") or 3)
            if p.kind == "startup":
                if p.successes >= 1:
                    c.started = True
                    c.ready = "readiness" not in c.probes
                elif p.failures >= failure_threshold:
                    self._kill(c, "StartupProbeFailed", msg)
            elif p.kind == "readiness":
                if p.successes >= success_threshold:
                    c.ready = True
                elif p.failures >= failure_threshold:
                    c.ready = False
            elif p.failures >= failure_threshold:
                self._kill(c, "LivenessProbeFailed", msg)
        finally:
            c.probe_lock.release()

    def _port(self, c: Container, port: Any) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for p in c.spec.get("ports") or []:
            if p.get("name") == port:
                return int(p["containerPort"])
        raise ValueError(f"container {c.name} has no port named {port!r}")

    def _check(self, c: Container, spec: dict[str, Any], timeout: float) -> tuple[bool, str]:
        """Run one probe action: (passed, message)."""
        try:
            if "httpGet" in spec:
                h = spec["httpGet"]
                scheme = (h.get("scheme") or "HTTP").lower()
                url = f"{scheme}://{h.get('host') or self.ip}:{self._port(c, h['port'])}{h.get('path') or '/'}"
                req = urllib.request.Request(url, headers={x["name"]: x["value"] for x in h.get("httpHeaders") or []})
                try:
                    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (a pod's own port)
                        return 200 <= resp.status < 400, f"HTTP {resp.status}"
                except urllib.error.HTTPError as err:
                    return False, f"HTTP probe failed with statuscode: {err.code}"
            if "tcpSocket" in spec:
                t = spec["tcpSocket"]
                with socket.create_connection((t.get("host") or self.ip, self._port(c, t["port"])), timeout=timeout):
                    return True, "tcp ok"
            if "exec" in spec:
                proc = subprocess.run(self._wrapper(c, list(spec["exec"]["command"])), env=c.env,
                                      capture_output=True, timeout=timeout, cwd=str(self.dir))
                return proc.returncode == 0, f"exec rc {proc.returncode}: {proc.stdout[-200:]!r}"
            return False, f"probe kind {sorted(spec)} is not supported by the process node agent"
        except (OSError, ValueError, subprocess.TimeoutExpired) as err:
            return False, str(err)

    def _kill(self, c: Container, reason: str, msg: str) -> None:
        proc = c.proc
        if proc is None:
            return
        log.info("pod %s: killing %s (%s: %s)", self.key, c.name, reason, msg)
        c.killed_by = reason
        grace = float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)

    def _terminate(self) -> None:
        """preStop hooks, SIGTERM, the grace period, SIGKILL (the kubelet's order)."""
        meta = self.pod["metadata"]
        grace = meta.get("deletionGracePeriodSeconds")
        grace = float(grace if grace is not None else self.pod["spec"].get("terminationGracePeriodSeconds", 30))
        deadline = time.monotonic() + grace
        running = [c for c in [*self.init_containers, *self.containers] if c.proc is not None and c.proc.poll() is None]
        hooks = [threading.Thread(target=self._pre_stop, args=(c, deadline), daemon=True) for c in running]
        for t in hooks:
            t.start()
        for t in hooks:
            t.join(max(0.0, deadline - time.monotonic()))
        for c in running:
            assert c.proc is not None
            _signal_group(c.proc, signal.SIGTERM)
        for c in running:
            assert c.proc is not None
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.info("pod %s: %s outlived its grace period (%.0f s): SIGKILL", self.key, c.name, grace)
                _signal_group(c.proc, signal.SIGKILL)
                c.proc.wait()
            _signal_group(c.proc, signal.SIGKILL)  # leftovers of its group
        log.info("pod %s: terminated", self.key)

    def _pre_stop(self, c: Container, deadline: float) -> None:
        hook = ((c.spec.get("lifecycle") or {}).get("preStop")) or {}
        if hook:
            ok, msg = self._check(c, hook, max(0.1, deadline - time.monotonic()))
            log.info("pod %s: preStop of %s: %s (%s)", self.key, c.name, "ok" if ok else "failed", msg)

    # --- status ----------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The pod's ``status`` as the agent sees it now."""
        now = _now()
        cs = [c.status() for c in self.containers]
        init = [c.status() for c in self.init_containers]
        running = any("running" in c.state for c in self.containers)
        policy = self.pod["spec"].get("restartPolicy", "Always")
        terminated = [c.state["terminated"] for c in self.containers if "terminated" in c.state]
        if running:
            phase = "Running"
        elif len(terminated) == len(self.containers) and policy != "Always":
            phase = "Succeeded" if all(t["exitCode"] == 0 for t in terminated) else (
                "Failed" if policy == "Never" else "Running")
        else:
            phase = self._phase if self._phase != "Pending" else "Pending"
        self._phase = phase
        containers_ready = all(c.ready for c in self.containers)
        gates = [g["conditionType"] for g in self.pod["spec"].get("readinessGates") or []]
        have = {cond["type"]: cond.get("status") for cond in (self.pod.get("status") or {}).get("conditions") or []}
        ready = containers_ready and all(have.get(g) == "True" for g in gates)

        def cond(kind: str, ok: bool, reason: str = "") -> dict[str, Any]:
            d: dict[str, Any] = {"type": kind, "status": "True" if ok else "False", "lastProbeTime": None,
                                 "lastTransitionTime": now}
            if not ok and reason:
                d["reason"] = reason
            return d

        conditions = [cond("Initialized", self._init_done, "ContainersNotInitialized"),
                      cond("Ready", ready, "ContainersNotReady"),
                      cond("ContainersReady", containers_ready, "ContainersNotReady"),
                      cond("PodScheduled", True)]
        out: dict[str, Any] = {"phase": phase, "conditions": conditions, "hostIP": "127.0.0.1",
                               "hostIPs": [{"ip": "127.0.0.1"}], "containerStatuses": cs,
                               "startTime": (self.pod.get("status") or {}).get("startTime") or now}
        if self.ip:
            out["podIP"], out["podIPs"] = self.ip, [{"ip": self.ip}]
        if init:
            out["initContainerStatuses"] = init
        return out

    def _publish(self, force: bool = False) -> None:
        st = self.status()
        # compare without the timestamps of the conditions (they change on every call)
        digest = json.dumps({**st, "conditions": [(c["type"], c["status"]) for c in st["conditions"]]},
                            sort_keys=True)
        if digest == self._published and not force:
            return
        old = {c["type"]: c for c in (self.pod.get("status") or {}).get("conditions") or []}
        for c in st["conditions"]:  # keep the transition time of an unchanged condition
            if old.get(c["type"], {}).get("status") == c["status"] and old[c["type"]].get("lastTransitionTime"):
                c["lastTransitionTime"] = old[c["type"]]["lastTransitionTime"]
        self.agent.patch_status(self.pod, st)
        self._published = digest


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


# --- the agent -------------------------------------------------------------------------------------------


class NodeAgent:
    """Registers Node ``name`` and runs the pods bound to it as processes (see the module docstring).

    ``kubeconfig``: credentials allowed to manage Nodes, Leases, pods (and their status), ConfigMaps, Secrets
    and service-account tokens (the harness passes the admin's). ``api_port``: the API server's port on
    127.0.0.1, given to pods as ``KUBERNETES_SERVICE_PORT``. ``workdir``: pod folders (volumes, hosts file,
    container logs). ``proxies``: the Service proxies whose names go into the pods' ``/etc/hosts``.
    """

    def __init__(self, name: str, kubeconfig: Path, api_port: int, workdir: Path, *,
                 proxies: ServiceProxies | None = None, pod_ips: LoopbackAllocator | None = None,
                 gpus: int = 16, cpu: str = "16", memory: str = "64Gi", max_pods: int = 110,
                 labels: dict[str, str] | None = None) -> None:
        from kubernetes import client, config

        self.name = name
        self.api_port = api_port
        self.workdir = workdir
        self.api = config.new_client_from_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]
        self.core: Any = client.CoreV1Api(self.api)  # called with plain dicts (the API JSON)
        self.coord: Any = client.CoordinationV1Api(self.api)
        self.proxies = proxies
        self.pod_ips = pod_ips or LoopbackAllocator("127.0")
        self.capacity = {"cpu": cpu, "memory": memory, "pods": str(max_pods), "nvidia.com/gpu": str(gpus),
                         "ephemeral-storage": "100Gi"}
        self.labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                       "fulcrum.dev/process-node": "true", **(labels or {})}
        self.python_bin = Path(sys.executable).parent
        self.pods: dict[str, PodRunner] = {}
        self.hosts_files: dict[str, Path] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        if proxies is not None:
            proxies.on_change.append(self.write_all_hosts)

    # --- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        """Register the Node (Ready), start the Lease renewal and the pod watch."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._register()
        threading.Thread(target=self._heartbeat, name=f"lease-{self.name}", daemon=True).start()
        informer(f"pods-{self.name}", self.core.list_pod_for_all_namespaces, self._sync, self._event, self._stop,
                 field_selector=f"spec.nodeName={self.name}")

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop every pod's processes (SIGTERM, then SIGKILL after ``grace_s``) without deleting the objects."""
        self._stop.set()
        with self._lock:
            runners = list(self.pods.values())
        for r in runners:
            r.vanished.set()
            r.pod["metadata"]["deletionGracePeriodSeconds"] = min(
                grace_s, float(r.pod["metadata"].get("deletionGracePeriodSeconds") or grace_s))
            r.deleting.set()
        for r in runners:
            r.done.wait(grace_s + 5)

    def _node(self) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.name, "labels": self.labels}}

    def _node_status(self) -> dict[str, Any]:
        now = _now()
        ready = {"type": "Ready", "status": "True", "reason": "ProcessNodeAgentReady",
                 "message": "process node agent is posting ready status", "lastHeartbeatTime": now,
                 "lastTransitionTime": now}
        return {"status": {
            "capacity": self.capacity, "allocatable": self.capacity, "conditions": [ready],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": self.name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
            "nodeInfo": {"machineID": "", "systemUUID": "", "bootID": "", "kernelVersion": os.uname().release,
                         "osImage": "process node agent (fulcrum e2e)", "containerRuntimeVersion": "process://",
                         "kubeletVersion": "v1.28.0", "kubeProxyVersion": "", "operatingSystem": "linux",
                         "architecture": "amd64"},
        }}

    def _register(self) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.core.create_node(self._node())
        except ApiException as err:
            if err.status != 409:
                raise
        self.core.patch_node_status(self.name, self._node_status())
        lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                 "metadata": {"name": self.name, "namespace": "kube-node-lease"},
                 "spec": {"holderIdentity": self.name, "leaseDurationSeconds": 40, "renewTime": _now_micro()}}
        try:
            self.coord.create_namespaced_lease("kube-node-lease", lease)
        except ApiException as err:
            if err.status != 409:
                raise

    def _heartbeat(self) -> None:
        beats = 0
        while not self._stop.wait(10.0):
            beats += 1
            try:
                self.coord.patch_namespaced_lease(self.name, "kube-node-lease",
                                                  {"spec": {"renewTime": _now_micro(), "holderIdentity": self.name}})
                if beats % 6 == 0:
                    self.core.patch_node_status(self.name, self._node_status())
            except Exception as err:  # noqa: BLE001
                log.warning("node %s: heartbeat failed: %s", self.name, err)

    # --- pods ------------------------------------------------------------------------------------------

    def _sync(self, items: list[dict[str, Any]]) -> None:
        seen = set()
        for pod in items:
            seen.add(pod["metadata"]["uid"])
            self._event("MODIFIED", pod)
        with self._lock:
            gone = [r for uid, r in self.pods.items() if uid not in seen]
        for r in gone:
            self._event("DELETED", r.pod)

    def _event(self, etype: str, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        with self._lock:
            runner = self.pods.get(uid)
            if runner is None:
                if etype == "DELETED" or self._stop.is_set():
                    return
                if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed") and \
                        not pod["metadata"].get("deletionTimestamp"):
                    return  # finished before this agent started
                runner = PodRunner(self, pod)
                self.pods[uid] = runner
                runner.update(pod)
                runner.thread.start()
                threading.Thread(target=self._reap, args=(uid, runner), daemon=True).start()
                return
        runner.update(pod)
        if etype == "DELETED":
            runner.vanished.set()
            runner.pod["metadata"]["deletionGracePeriodSeconds"] = 0
            runner.deleting.set()

    def _reap(self, uid: str, runner: PodRunner) -> None:
        runner.done.wait()
        with self._lock:
            if self.pods.get(uid) is runner:
                del self.pods[uid]

    def runner(self, namespace: str, name: str) -> PodRunner | None:
        """The runner of pod ``namespace/name`` on this node, if any."""
        with self._lock:
            return next((r for r in self.pods.values() if r.key == f"{namespace}/{name}"), None)

    # --- API calls the runners make --------------------------------------------------------------------

    def patch_status(self, pod: dict[str, Any], status: dict[str, Any]) -> None:
        """Write a pod's status (merge patch; a pod already gone is ignored)."""
        from kubernetes.client.exceptions import ApiException

        meta = pod["metadata"]
        try:
            self.core.patch_namespaced_pod_status(meta["name"], meta["namespace"], {"status": status})
        except ApiException as err:
            if err.status != 404:
                log.warning("pod %s/%s: status update failed: %s", meta["namespace"], meta["name"], err.reason)

    def delete_pod(self, pod: dict[str, Any]) -> None:
        """Delete the pod object now (grace 0, this uid only), as the kubelet does once its containers are gone."""
        from kubernetes.client.exceptions import ApiException

        meta = pod["metadata"]
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}}
        try:
            self.core.delete_namespaced_pod(meta["name"], meta["namespace"], body=body)
        except ApiException as err:
            if err.status not in (404, 409):
                log.warning("pod %s/%s: delete failed: %s", meta["namespace"], meta["name"], err.reason)

    def read_data(self, kind: str, namespace: str, name: str, *, optional: bool = False,
                  binary: bool = False) -> dict[str, Any]:
        """A ConfigMap's or Secret's data (str values, or bytes with ``binary``); CannotRun when it is
        missing and not optional."""
        from kubernetes.client.exceptions import ApiException

        read = self.core.read_namespaced_config_map if kind == "configMap" else self.core.read_namespaced_secret
        try:
            doc = json.loads(read(name, namespace, _preload_content=False).data)
        except ApiException as err:
            if err.status == 404 and optional:
                return {}
            if err.status == 404:
                raise CannotRun(f"{kind} {namespace}/{name} not found", CONFIG_ERROR) from err
            raise
        out: dict[str, Any] = {}
        if kind == "configMap":
            out.update({k: v.encode() if binary else v for k, v in (doc.get("data") or {}).items()})
            out.update({k: base64.b64decode(v) if binary else base64.b64decode(v).decode(errors="replace")
                        for k, v in (doc.get("binaryData") or {}).items()})
        else:
            out.update({k: base64.b64decode(v) if binary else base64.b64decode(v).decode(errors="replace")
                        for k, v in (doc.get("data") or {}).items()})
        return out

    def request_token(self, pod: dict[str, Any], audience: str | None, seconds: int) -> str:
        """A service-account token bound to ``pod`` (TokenRequest), as the kubelet asks for a projected one."""
        meta = pod["metadata"]
        sa = pod["spec"].get("serviceAccountName") or "default"
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {
            "audiences": [audience] if audience else None, "expirationSeconds": max(600, seconds),
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}}}
        resp = self.core.create_namespaced_service_account_token(sa, meta["namespace"], body, _preload_content=False)
        return str(json.loads(resp.data)["status"]["token"])

    # --- hosts files -----------------------------------------------------------------------------------

    def write_hosts(self, key: str) -> None:
        """(Re)write pod ``key``'s ``/etc/hosts`` in place (its bind mount keeps the inode)."""
        path = self.hosts_files.get(key)
        runner = next((r for r in list(self.pods.values()) if r.key == key), None)
        if path is None or runner is None:
            return
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
                 f"{runner.ip}\t{runner.pod['metadata']['name']}"]
        if self.proxies is not None:  # kubernetes.default.svc:443 included (its proxy forwards to the API server)
            lines += self.proxies.hosts_lines()
        text = "\n".join(lines) + "\n"
        with open(path, "a+") as f:  # noqa: PTH123 (in place: truncate + write, never a rename)
            f.seek(0)
            if f.read() != text:
                f.seek(0)
                f.truncate()
                f.write(text)

    def write_all_hosts(self) -> None:
        """Rewrite every pod's hosts file (the Services changed)."""
        for key in list(self.hosts_files):
            self.write_hosts(key)
