"""``python -m e2e.local up|down|env`` (from the repository root): a local cluster for a shell.

- ``up [--dir DIR] [--nodes N] [--gpus G]``: start it (control plane, Service proxies, process node agent, and an
  etcd for Fulcrum's instance registry: pod IPs are loopback addresses, which EndpointSlices refuse, so the
  router's Kubernetes registry cannot work here — docs/e2e.md) and stay in the foreground until interrupted
  (Ctrl-C or ``down``); prints ``export KUBECONFIG=… FULCRUM_E2E_ETCD_URL=…`` and writes it to ``DIR/env.sh``.
- ``down [--dir DIR]``: stop the ``up`` running on DIR (SIGTERM to its pid), which stops every process it started.
- ``env [--dir DIR]``: print ``DIR/env.sh`` (``eval "$(python -m e2e.local env)"``).
- ``chart [--dir DIR] [--namespace NS] [--watch NS ...] [--prometheus-url URL] [--etcd-endpoint URL]``: what
  ``helm install fulcrum charts/fulcrum`` does, on the cluster ``up`` runs (no helm binary here: the chart is
  rendered by Helm's engine and applied in Helm's order, e2e/local/chart.py); returns once the operator is ready.

DIR defaults to ``$FULCRUM_E2E_CLUSTER_DIR``, else ``~/.cache/fulcrum-k8s/cluster``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .cluster import ClusterError, app_etcd
from .harness import LocalCluster


def _default_dir() -> Path:
    env = os.environ.get("FULCRUM_E2E_CLUSTER_DIR")
    return Path(env) if env else Path.home() / ".cache" / "fulcrum-k8s" / "cluster"


def _up(d: Path, nodes: int, gpus: int) -> int:
    pid_file = d / "up.pid"
    if pid_file.is_file() and pid_file.read_text().strip().isdigit() and _running(int(pid_file.read_text())):
        print(f"a local cluster already runs on {d} (pid {pid_file.read_text().strip()}); "
              f"`python -m e2e.local down` first", file=sys.stderr)
        return 1
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    cluster = LocalCluster(d, nodes=nodes, gpus=gpus)
    registry = contextlib.ExitStack()
    try:
        cluster.start()
        etcd_url = registry.enter_context(app_etcd(d / "app-etcd"))
    except ClusterError as err:
        print(f"local cluster failed to start: {err}", file=sys.stderr)
        cluster.stop()
        return 1
    env = {**cluster.env(), "FULCRUM_E2E_ETCD_URL": etcd_url}
    text = "".join(f"export {k}={shlex.quote(str(v))}\n" for k, v in env.items() if k != "pid")
    (d / "env.sh").write_text(text)
    pid_file.write_text(str(os.getpid()))
    print(text, end="")
    print(f"# up in {cluster.startup_s['total']:.1f} s (control plane {cluster.startup_s['control_plane']:.1f} s); "
          f"logs in {d}/logs, {d}/agent.log, {d}/node/pods/*/logs; Ctrl-C or `python -m e2e.local down` stops it",
          flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        dead = [n for n, alive in cluster.control_plane.alive().items() if not alive]
        if dead:
            print(f"{', '.join(dead)} exited; stopping (see {d}/logs)", file=sys.stderr)
            break
    t0 = time.monotonic()
    cluster.stop()
    registry.close()
    print(f"# stopped in {time.monotonic() - t0:.1f} s", flush=True)
    pid_file.unlink(missing_ok=True)
    return 0


def _running(pid: int) -> bool:
    """True while ``pid`` runs (a zombie — exited, not yet reaped by its parent — has stopped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


def _down(d: Path, timeout_s: float) -> int:
    pid_file = d / "up.pid"
    if not pid_file.is_file():
        print(f"no local cluster runs on {d}", file=sys.stderr)
        return 1
    pid = int(pid_file.read_text())
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pid_file.unlink(missing_ok=True)
        return 0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _running(pid):
            return 0
        time.sleep(0.2)
    print(f"pid {pid} still runs after {timeout_s:.0f} s", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    """The CLI; returns its exit code."""
    p = argparse.ArgumentParser(prog="python -m e2e.local", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["up", "down", "env", "chart"])
    p.add_argument("--dir", type=Path, default=None, help="cluster folder (default: see above)")
    p.add_argument("--nodes", type=int, default=1, help="process nodes (up; default 1)")
    p.add_argument("--gpus", type=int, default=16, help="emulated nvidia.com/gpu per node (up; default 16)")
    p.add_argument("--timeout", type=float, default=180.0,
                   help="seconds `down` waits for the `up` to stop its pods and control plane (default 180)")
    p.add_argument("--namespace", default="fulcrum-system", help="release namespace (chart; default fulcrum-system)")
    p.add_argument("--watch", nargs="*", default=[], help="namespaces the operator watches (chart; default: all)")
    p.add_argument("--prometheus-url", default="", help="the operator's --prometheus-url (chart; default none)")
    p.add_argument("--etcd-endpoint", default=None,
                   help="the routers' etcd registry (chart; default: the one `up` started, $FULCRUM_E2E_ETCD_URL)")
    args = p.parse_args(argv)
    d = (args.dir or _default_dir()).resolve()
    if args.action == "up":
        if args.nodes < 1 or args.gpus < 0:
            p.error("--nodes must be >= 1 and --gpus >= 0")
        return _up(d, args.nodes, args.gpus)
    if args.action == "down":
        return _down(d, args.timeout)
    env_file = d / "env.sh"
    if not env_file.is_file():
        print(f"no local cluster on {d} (`python -m e2e.local up`)", file=sys.stderr)
        return 1
    if args.action == "chart":
        return _chart(env_file, args.namespace, args.watch, args.prometheus_url, args.etcd_endpoint)
    print(env_file.read_text(), end="")
    return 0


def _chart(env_file: Path, namespace: str, watch: list[str], prometheus_url: str, etcd_endpoint: str | None) -> int:
    from . import chart
    from .fixtures import ExternalCluster

    env = dict(shlex.split(line.removeprefix("export "))[0].split("=", 1)
               for line in env_file.read_text().splitlines() if line.startswith("export "))
    cluster = ExternalCluster(Path(env["KUBECONFIG"]), api_url=env.get("FULCRUM_E2E_API_URL", ""))
    etcd_endpoint = env.get("FULCRUM_E2E_ETCD_URL", "") if etcd_endpoint is None else etcd_endpoint
    values = chart.local_values(prometheus_url=prometheus_url, etcd_endpoint=etcd_endpoint, watch_namespaces=watch)
    try:
        inst = chart.install(cluster, values, release="fulcrum", namespace=namespace)
    except (TimeoutError, subprocess.CalledProcessError) as err:
        print(f"chart install failed: {err} {getattr(err, 'stderr', '') or ''}", file=sys.stderr)
        return 1
    print(f"installed release fulcrum in {namespace}: {len(inst.objects)} objects; operator "
          f"deployment/{inst.operator_deployment} ready in {inst.timings_s['operator_ready']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
