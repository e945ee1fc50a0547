"""The control plane of the local cluster: etcd, kube-apiserver, kube-controller-manager and kube-scheduler
(Kubernetes v1.28.0) on 127.0.0.1, each a process group of its own, with certificates made here (openssl CLI).

Binaries: ``$FULCRUM_K8S_BIN_DIR`` (uncompressed ``kube-apiserver``, ``kube-controller-manager``,
``kube-scheduler``; used as they are), else the xz-compressed ones in ``<shared>/k8s/bin`` decompressed once into
``~/.cache/fulcrum-k8s/v1.28.0`` and checked against ``<shared>/k8s/SHA256SUMS``. ``<shared>`` is
``$FULCRUM_SHARED_DIR``, else ``<repo>/../shared``, else (a git worktree) ``<main checkout>/../shared``.
etcd is Debian's ``etcd`` (scripts/install-servers.sh installs it) or ``$FULCRUM_ETCD_BIN``.

Errors: ``ClusterError`` (a binary missing or altered, a component that exits or is not ready in time); its
message names the log file to read.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "K8S_VERSION",
    "ClusterError",
    "ControlPlane",
    "ManagedProcess",
    "app_etcd",
    "binaries_available",
    "die_with_parent",
    "ensure_binaries",
    "etcd_binary",
    "free_port",
    "kubectl",
    "shared_dir",
]

K8S_VERSION = "v1.28.0"
COMPONENTS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")
REPO = Path(__file__).resolve().parents[2]
SERVICE_CIDR = "10.96.0.0/16"
"""Service ClusterIPs are allocated from here but never dialled: there is no kube-proxy (see service_proxy)."""


class ClusterError(RuntimeError):
    """The local cluster could not be prepared or started (the message says which component and its log)."""


def shared_dir() -> Path | None:
    """The shared folder holding ``k8s/bin/*.xz`` and ``k8s/SHA256SUMS``, or None when none is found."""
    candidates: list[Path] = []
    if os.environ.get("FULCRUM_SHARED_DIR"):
        candidates.append(Path(os.environ["FULCRUM_SHARED_DIR"]))
    candidates.append(REPO.parent / "shared")
    try:  # a git worktree lives elsewhere: its main checkout's sibling
        common = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--git-common-dir"], capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        candidates.append((REPO / common).resolve().parent.parent / "shared")
    except (OSError, subprocess.SubprocessError):
        pass
    for c in candidates:
        if (c / "k8s" / "SHA256SUMS").is_file():
            return c
    return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "fulcrum-k8s" / K8S_VERSION


def binaries_available() -> str | None:
    """None when the control-plane binaries can be had; else why not (for a pytest skip)."""
    env_dir = os.environ.get("FULCRUM_K8S_BIN_DIR")
    if env_dir:
        missing = [c for c in COMPONENTS if not (Path(env_dir) / c).is_file()]
        return f"FULCRUM_K8S_BIN_DIR={env_dir} lacks {', '.join(missing)}" if missing else None
    if all((_cache_dir() / c).is_file() for c in COMPONENTS):
        return None
    shared = shared_dir()
    if shared is None:
        return (f"no Kubernetes binaries: set FULCRUM_K8S_BIN_DIR, or provide <repo>/../shared/k8s/bin/*.xz "
                f"(looked beside {REPO})")
    missing = [c for c in COMPONENTS if not (shared / "k8s" / "bin" / f"{c}.xz").is_file()]
    return f"{shared}/k8s/bin lacks {', '.join(m + '.xz' for m in missing)}" if missing else None


def ensure_binaries() -> Path:
    """The folder holding the three control-plane binaries, decompressing and checking them once.

    Raises ClusterError when they are absent or a checksum differs from SHA256SUMS.
    """
    env_dir = os.environ.get("FULCRUM_K8S_BIN_DIR")
    if env_dir:
        reason = binaries_available()
        if reason:
            raise ClusterError(reason)
        return Path(env_dir)
    cache = _cache_dir()
    shared = shared_dir()
    sums: dict[str, str] = {}
    if shared is not None:
        for line in (shared / "k8s" / "SHA256SUMS").read_text().splitlines():
            if line.strip():
                digest, name = line.split()
                sums[name] = digest
    cache.mkdir(parents=True, exist_ok=True)
    for comp in COMPONENTS:
        dest, stamp = cache / comp, cache / f"{comp}.sha256"
        if dest.is_file() and stamp.is_file() and (not sums or stamp.read_text().strip() == sums.get(comp)):
            continue
        if shared is None:
            raise ClusterError(binaries_available() or f"{comp} is not in {cache}")
        src = shared / "k8s" / "bin" / f"{comp}.xz"
        if not src.is_file():
            raise ClusterError(f"{src} is missing")
        fd, tmp_name = tempfile.mkstemp(dir=cache, prefix=f".{comp}.")
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as out, lzma.open(src) as xz:
                shutil.copyfileobj(xz, out, 1 << 20)
            digest = _sha256(tmp)
            if comp in sums and digest != sums[comp]:
                raise ClusterError(f"{src} decompresses to sha256 {digest}, SHA256SUMS says {sums[comp]}")
            tmp.chmod(0o755)
            tmp.replace(dest)
            stamp.write_text(digest + "\n")
        finally:
            tmp.unlink(missing_ok=True)
    return cache


def etcd_binary() -> str | None:
    """The etcd executable ($FULCRUM_ETCD_BIN, else etcd on PATH or in /usr/bin), or None."""
    if os.environ.get("FULCRUM_ETCD_BIN"):
        return os.environ["FULCRUM_ETCD_BIN"]
    return shutil.which("etcd") or next((p for p in ("/usr/bin/etcd", "/usr/sbin/etcd") if os.access(p, os.X_OK)),
                                        None)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# --- processes -------------------------------------------------------------------------------------------


def die_with_parent(argv: list[str]) -> list[str]:
    """``argv`` under ``setpriv --pdeathsig KILL`` (util-linux) when available: the process is killed when the
    *thread* that started it ends, so a test runner killed hard (SIGKILL, a cancelled CI job) leaves no etcd,
    API server or pod process behind. Start long-lived processes from a thread that outlives them."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--", *argv] if setpriv else argv



@dataclass
class ManagedProcess:
    """A child in a process group of its own (``start_new_session``), its output in ``log``."""

    name: str
    argv: list[str]
    log: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start it (stdout and stderr appended to ``log``)."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(die_with_parent(self.argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env=self.env)

    def alive(self) -> bool:
        """True while the process runs."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to its process group, SIGKILL after ``grace_s``; waits for it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        else:  # the leader exited: its group may still hold children
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def tail(self, n_chars: int = 3000) -> str:
        """The end of its log."""
        try:
            return self.log.read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""


@contextmanager
def app_etcd(directory: Path, timeout_s: float = 30.0) -> Iterator[str]:
    """An etcd for Fulcrum's instance registry (the router's ``registry: etcd``), apart from the cluster's: a
    host process on free 127.0.0.1 ports, data and log under ``directory``. Yields its client URL once
    ``/health`` answers; stops it on exit.

    Raises:
        ClusterError: no etcd binary, or it did not answer within ``timeout_s`` (the message holds its log's tail).
    """
    etcd = etcd_binary()
    if etcd is None:
        raise ClusterError("no etcd binary: install Debian's etcd-server (scripts/install-servers.sh) "
                           "or set FULCRUM_ETCD_BIN")
    port, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    proc = ManagedProcess("app-etcd", [
        etcd, "--name", "app", "--data-dir", str(directory / "data"),
        "--listen-client-urls", url, "--advertise-client-urls", url,
        "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-cluster", f"app=http://127.0.0.1:{peer}", "--log-level", "warn"], directory / "etcd.log")
    proc.start()
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline or not proc.alive():
                raise ClusterError(f"app etcd not healthy in {timeout_s:.0f} s: {proc.tail()}")
            time.sleep(0.3)
        yield url
    finally:
        proc.stop()


def kubectl(kubeconfig: Path, *args: str, check: bool = True, timeout: float = 60.0,
            input_text: str | None = None) -> str:
    """``kubectl --kubeconfig <kubeconfig> …`` (``input_text`` on its stdin); its stdout.

    Raises:
        subprocess.CalledProcessError: it failed and ``check`` (stdout and stderr attached);
        subprocess.TimeoutExpired: it ran past ``timeout`` seconds.
    """
    argv = ["kubectl", "--kubeconfig", str(kubeconfig), *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input=input_text)
    if check and proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, argv, proc.stdout, proc.stderr)
    return proc.stdout


# --- certificates ----------------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise ClusterError(f"openssl {' '.join(args[:2])} failed: {proc.stderr.strip()[-500:]}")


def _make_pki(pki: Path, clients: dict[str, tuple[str, str]]) -> None:
    """CA, API serving cert (SANs 127.0.0.1, localhost, kubernetes.default…), client certs, SA key pair; all
    ECDSA P-256 (RSA key generation took seconds on a busy 2-core machine)."""
    if shutil.which("openssl") is None:
        raise ClusterError("openssl is not installed: the harness makes the cluster's certificates with it")
    pki.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "30",
             "-subj", "/CN=fulcrum-local-ca", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature", cwd=pki)
    sans = ("IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,"
            "DNS:kubernetes.default.svc.cluster.local")
    certs = {"apiserver": ("kube-apiserver", "", "serverAuth")}
    certs.update({name: (cn, org, "clientAuth") for name, (cn, org) in clients.items()})
    for name, (cn, org, usage) in certs.items():
        subj = f"/CN={cn}" + (f"/O={org}" if org else "")
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", subj, cwd=pki)
        ext = pki / f"{name}.ext"
        ext.write_text(f"basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
                       f"extendedKeyUsage={usage}\n" + (f"subjectAltName={sans}\n" if usage == "serverAuth" else ""))
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.crt", "-days", "30", "-extfile", ext.name, cwd=pki)
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "sa.key", cwd=pki)
    _openssl("ec", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def _kubeconfig(path: Path, server: str, pki: Path, user: str) -> None:
    doc = {
        "apiVersion": "v1", "kind": "Config", "current-context": "fulcrum-local",
        "clusters": [{"name": "fulcrum-local",
                      "cluster": {"server": server, "certificate-authority": str(pki / "ca.crt")}}],
        "users": [{"name": user, "user": {"client-certificate": str(pki / f"{user}.crt"),
                                          "client-key": str(pki / f"{user}.key")}}],
        "contexts": [{"name": "fulcrum-local", "context": {"cluster": "fulcrum-local", "user": user}}],
    }
    path.write_text(json.dumps(doc, indent=1))  # JSON is YAML
    path.chmod(0o600)


# --- the control plane -----------------------------------------------------------------------------------


@dataclass
class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler on 127.0.0.1 under ``workdir``.

    ``start()`` returns once ``/readyz`` of the API server and ``/healthz`` of the controller-manager and the
    scheduler answer ok (``startup_s`` says how long that took); ``stop()`` ends every process group. Layout of
    ``workdir``: ``pki/`` (certificates, ``ca.crt``), ``admin.kubeconfig``, ``logs/<component>.log``, ``etcd/``.
    """

    workdir: Path
    api_port: int = 0
    processes: list[ManagedProcess] = field(default_factory=list)
    startup_s: float = 0.0
    phases_s: dict[str, float] = field(default_factory=dict)
    """Seconds since ``start()`` began at which each phase ended (pki, etcd, kube-apiserver, …)."""

    @property
    def api_url(self) -> str:
        """``https://127.0.0.1:<port>``."""
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (user in group system:masters)."""
        return self.workdir / "admin.kubeconfig"

    @property
    def pki(self) -> Path:
        """Certificates and keys."""
        return self.workdir / "pki"

    @property
    def logs(self) -> Path:
        """One log file per component."""
        return self.workdir / "logs"

    @property
    def audit_log(self) -> Path:
        """The API server's audit log (JSON lines, level Metadata; ``e2e/local/audit.py`` reads it)."""
        return self.logs / "audit.log"

    def _audit_policy(self) -> Path:
        path = self.workdir / "audit-policy.yaml"
        path.write_text('{"apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"], '
                        '"rules": [{"level": "Metadata"}]}\n')
        return path

    def start(self, timeout_s: float = 90.0) -> None:
        """Make the certificates, start the four components, wait until they are ready.

        Raises ClusterError (with the failing component's log tail) when one exits or is not ready in time.
        """
        t0 = time.monotonic()
        bins = ensure_binaries()
        self.phases_s["binaries"] = time.monotonic() - t0
        etcd = etcd_binary()
        if etcd is None:
            raise ClusterError("etcd is not installed (Debian etcd-server: scripts/install-servers.sh)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        clients = {"admin": ("fulcrum-admin", "system:masters"),
                   "controller-manager": ("system:kube-controller-manager", ""),
                   "scheduler": ("system:kube-scheduler", "")}
        _make_pki(self.pki, clients)
        self.phases_s["pki"] = time.monotonic() - t0
        self.api_port = self.api_port or free_port()
        etcd_port, peer_port = free_port(), free_port()
        for user in clients:
            _kubeconfig(self.workdir / f"{user}.kubeconfig", self.api_url, self.pki, user)
        pki = self.pki
        self.processes = [
            ManagedProcess("etcd", [
                etcd, "--name", "local", "--data-dir", str(self.workdir / "etcd"),
                "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
                "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
                "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
                "--initial-cluster", f"local=http://127.0.0.1:{peer_port}",
                "--listen-metrics-urls", f"http://127.0.0.1:{free_port()}",
                "--quota-backend-bytes", str(2 << 30), "--log-level", "warn",
            ], self.logs / "etcd.log"),
            ManagedProcess("kube-apiserver", [
                str(bins / "kube-apiserver"),
                "--etcd-servers", f"http://127.0.0.1:{etcd_port}",
                "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1",
                "--secure-port", str(self.api_port),
                "--tls-cert-file", str(pki / "apiserver.crt"), "--tls-private-key-file", str(pki / "apiserver.key"),
                "--client-ca-file", str(pki / "ca.crt"),
                "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
                "--service-account-key-file", str(pki / "sa.pub"),
                "--service-account-signing-key-file", str(pki / "sa.key"),
                "--service-cluster-ip-range", SERVICE_CIDR,
                "--authorization-mode", "RBAC",
                "--allow-privileged=true",
                # the default lease reconciler would publish 127.0.0.1 in the kubernetes Endpoints, which
                # validation rejects (loopback): pods reach the API through KUBERNETES_SERVICE_HOST instead
                "--endpoint-reconciler-type", "none",
                "--profiling=false", "--v", "1",
                # audit log (level Metadata: who did which verb on which resource, and the answer's code)
                "--audit-policy-file", str(self._audit_policy()), "--audit-log-path", str(self.audit_log),
                "--audit-log-maxsize", "200", "--audit-log-maxbackup", "1",
            ], self.logs / "kube-apiserver.log"),
        ]
        common = ["--leader-elect=false", "--bind-address", "127.0.0.1", "--profiling=false", "--v", "1"]
        cm_port, sched_port = free_port(), free_port()
        cm_kc, sched_kc = self.workdir / "controller-manager.kubeconfig", self.workdir / "scheduler.kubeconfig"
        controllers = [
            ManagedProcess("kube-controller-manager", [
                str(bins / "kube-controller-manager"), *common, "--secure-port", str(cm_port),
                "--kubeconfig", str(cm_kc), "--authentication-kubeconfig", str(cm_kc),
                "--authorization-kubeconfig", str(cm_kc),
                "--service-account-private-key-file", str(pki / "sa.key"), "--root-ca-file", str(pki / "ca.crt"),
                "--use-service-account-credentials=true", "--cluster-name", "fulcrum-local",
                "--cluster-signing-cert-file", str(pki / "ca.crt"), "--cluster-signing-key-file", str(pki / "ca.key"),
                "--cert-dir", str(self.workdir / "controller-manager-certs"),
            ], self.logs / "kube-controller-manager.log"),
            ManagedProcess("kube-scheduler", [
                str(bins / "kube-scheduler"), *common, "--secure-port", str(sched_port),
                "--kubeconfig", str(sched_kc), "--authentication-kubeconfig", str(sched_kc),
                "--authorization-kubeconfig", str(sched_kc),
                "--cert-dir", str(self.workdir / "scheduler-certs"),
            ], self.logs / "kube-scheduler.log"),
        ]
        try:
            self.processes[0].start()
            self._wait_http("etcd", f"http://127.0.0.1:{etcd_port}/health", t0 + timeout_s, self.processes[0])
            self.phases_s["etcd"] = time.monotonic() - t0
            self.processes[1].start()
            self._wait_https("kube-apiserver", f"{self.api_url}/readyz", t0 + timeout_s, self.processes[1],
                             client=True)
            self.phases_s["kube-apiserver"] = time.monotonic() - t0
            self.processes += controllers
            for p in controllers:
                p.start()
            self._wait_https("kube-controller-manager", f"https://127.0.0.1:{cm_port}/healthz", t0 + timeout_s,
                             controllers[0], client=False)
            self._wait_https("kube-scheduler", f"https://127.0.0.1:{sched_port}/healthz", t0 + timeout_s,
                             controllers[1], client=False)
            self.phases_s["controllers"] = time.monotonic() - t0
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0

    def _ssl(self, client: bool) -> ssl.SSLContext:
        if client:
            ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
            ctx.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
            return ctx
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # the components' self-signed serving certs (their --cert-dir)
        return ctx

    def _wait_https(self, what: str, url: str, deadline: float, proc: ManagedProcess, *, client: bool) -> None:
        ctx = self._ssl(client)
        self._wait(what, lambda: urllib.request.urlopen(url, timeout=2, context=ctx).status == 200,  # noqa: S310
                   deadline, proc)

    def _wait_http(self, what: str, url: str, deadline: float, proc: ManagedProcess) -> None:
        self._wait(what, lambda: urllib.request.urlopen(url, timeout=2).status == 200, deadline, proc)  # noqa: S310

    @staticmethod
    def _wait(what: str, probe: object, deadline: float, proc: ManagedProcess) -> None:
        last = ""
        while time.monotonic() < deadline:
            if not proc.alive():
                raise ClusterError(f"{what} exited (rc {proc.proc.returncode if proc.proc else '?'}); "
                                   f"its log {proc.log}:\n{proc.tail()}")
            try:
                if probe():  # type: ignore[operator]
                    return
            except (OSError, urllib.error.URLError, ssl.SSLError) as err:
                last = str(err)
            time.sleep(0.2)
        raise ClusterError(f"{what} not ready in time (last: {last}); its log {proc.log}:\n{proc.tail()}")

    def alive(self) -> dict[str, bool]:
        """Each component's name → whether its process runs."""
        return {p.name: p.alive() for p in self.processes}

    def log_tails(self, n_chars: int = 2000) -> str:
        """The end of every component's log, for a failing test's report."""
        return "\n".join(f"----- {p.name} ({p.log}) -----\n{p.tail(n_chars)}" for p in self.processes)

    def stop(self) -> None:
        """Stop the components, newest first (each process group: SIGTERM, then SIGKILL after 10 s)."""
        for p in reversed(self.processes):
            p.stop()
