"""Loopback Service proxies: the local cluster's stand-in for kube-proxy (which it does not have).

Every Service gets an address of its own on the loopback (``127.1.x.y`` by default) and, per Service port, a TCP
forwarder listening on ``<that address>:<port>`` that connects each client to one of the Service's *ready*
endpoints (round robin). The ClusterIP the API server allocated is never dialled.

Endpoints come from the Pods themselves (the Service's selector, condition Ready, ``status.podIP``, the target
port by number or by container-port name), not from EndpointSlices: the pods' loopback addresses are exactly
what API validation forbids in an EndpointSlice or Endpoints ("may not be in the loopback range"), so the
EndpointSlice controller fails to write them (its log says so) and there are none to read.
Pods find Services by name through the ``/etc/hosts`` the process node agent mounts in their mount namespace
(``hosts_lines``: ``<svc>``, ``<svc>.<ns>``, ``<svc>.<ns>.svc``, ``<svc>.<ns>.svc.cluster.local``); tests use
``address(namespace, name)``. The ``kubernetes`` Service of ``default`` forwards to the API server itself.

Threads: one informer per resource (Services, Pods; list + watch), one accept loop per listener, two pumps per connection.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["LoopbackAllocator", "ServiceProxies", "informer"]

log = logging.getLogger("fulcrum.e2e.service_proxy")


class LoopbackAllocator:
    """Hands out loopback addresses ``<prefix>.<a>.<b>`` whose given TCP ports can be bound right now.

    ``prefix`` is the first two octets (``"127.0"``: pods; ``"127.1"``: Services). A random start keeps two
    harnesses on one machine apart; an address is taken only when a bind of every asked port succeeds.
    """

    def __init__(self, prefix: str, seed: int | None = None) -> None:
        self.prefix = prefix
        self._used: set[str] = set()
        self._lock = threading.Lock()
        self._start = random.Random(seed).randrange(254 * 254)

    def allocate(self, ports: Iterable[int] = ()) -> str:
        """A free address (raises RuntimeError when the /16 is exhausted)."""
        ports = list(ports)
        with self._lock:
            for i in range(254 * 254):
                k = (self._start + i) % (254 * 254)
                ip = f"{self.prefix}.{k // 254 + 1}.{k % 254 + 1}"
                if ip == "127.0.0.1" or ip in self._used or not _bindable(ip, ports):
                    continue
                self._used.add(ip)
                self._start = k + 1
                return ip
        raise RuntimeError(f"no free loopback address left in {self.prefix}.0.0/16")

    def release(self, ip: str) -> None:
        """Give ``ip`` back."""
        with self._lock:
            self._used.discard(ip)


def _bindable(ip: str, ports: list[int]) -> bool:
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((ip, port))
            except OSError:
                return False
    return True


def informer(name: str, list_fn: Callable[..., Any], on_sync: Callable[[list[dict[str, Any]]], None],
             on_event: Callable[[str, dict[str, Any]], None], stop: threading.Event, **kwargs: Any) -> threading.Thread:
    """A daemon thread: ``list_fn(**kwargs)`` (raw JSON) → ``on_sync(items)``, then watch from its
    resourceVersion → ``on_event(type, object)``; relists after an error or a 410 Gone. Objects are plain dicts
    (the API's JSON, camelCase)."""
    from kubernetes import watch

    def loop() -> None:
        while not stop.is_set():
            try:
                resp = list_fn(_preload_content=False, **kwargs)
                doc = json.loads(resp.data)
                on_sync(doc.get("items") or [])
                rv = doc["metadata"]["resourceVersion"]
                while not stop.is_set():
                    w: Any = watch.Watch()  # type: ignore[no-untyped-call]
                    w.get_return_type = lambda func: None  # raw dicts: no model deserialisation
                    for ev in w.stream(list_fn, resource_version=rv, timeout_seconds=30, allow_watch_bookmarks=True,
                                       **kwargs):
                        if stop.is_set():
                            w.stop()
                            break
                        obj = ev["raw_object"]
                        if ev["type"] == "ERROR":
                            raise RuntimeError(f"watch error: {obj.get('message')}")
                        rv = obj.get("metadata", {}).get("resourceVersion", rv)
                        if ev["type"] != "BOOKMARK":
                            on_event(ev["type"], obj)
            except Exception as err:  # noqa: BLE001 (any failure: relist, as client-go's reflector does)
                if not stop.is_set():
                    log.info("%s informer: %s; relisting", name, err)
                    stop.wait(1.0)

    t = threading.Thread(target=loop, name=f"informer-{name}", daemon=True)
    t.start()
    return t


class _Forwarder:
    """One listening socket forwarding each connection to a backend (host, port) picked round robin."""

    def __init__(self, ip: str, port: int) -> None:
        self.ip, self.port = ip, port
        self.backends: list[tuple[str, int]] = []
        self._rr = itertools.count()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((ip, port))
        self._sock.listen(128)
        self._closed = False
        threading.Thread(target=self._accept, name=f"svc-{ip}:{port}", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        backends = list(self.backends)
        upstream = None
        for _ in range(len(backends)):
            target = backends[next(self._rr) % len(backends)]
            try:
                upstream = socket.create_connection(target, timeout=5)
                upstream.settimeout(None)
                break
            except OSError:
                continue
        if upstream is None:  # no ready endpoint: refuse, as kube-proxy's REJECT rule does
            conn.close()
            return
        back = threading.Thread(target=_pump, args=(upstream, conn), daemon=True)
        back.start()
        _pump(conn, upstream)
        back.join()
        conn.close()
        upstream.close()

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                s.shutdown(how)
            except OSError:
                pass


class ServiceProxies:
    """Keeps one loopback address and one forwarder per Service port in step with the cluster.

    ``api_client``: a kubernetes ``ApiClient`` allowed to list/watch Services and Pods everywhere.
    ``api_port``: the API server's port (the ``default/kubernetes`` Service forwards to ``127.0.0.1:<it>``).
    ``on_change``: called (no arguments) after the set of Service addresses changed (the node agent rewrites
    the pods' hosts files).
    """

    def __init__(self, api_client: Any, api_port: int, allocator: LoopbackAllocator | None = None) -> None:
        self._api = api_client
        self.api_port = api_port
        self.allocator = allocator or LoopbackAllocator("127.1")
        self._lock = threading.RLock()
        self._services: dict[tuple[str, str], dict[str, Any]] = {}
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}
        self._ips: dict[tuple[str, str], str] = {}
        self._forwarders: dict[tuple[str, str], dict[int, _Forwarder]] = {}
        self._stop = threading.Event()
        self.on_change: list[Callable[[], None]] = []
        self._synced = {"services": threading.Event(), "pods": threading.Event()}

    def start(self) -> None:
        """Start the two informers and wait (10 s at most) for their first lists."""
        from kubernetes import client

        core = client.CoreV1Api(self._api)
        informer("services", core.list_service_for_all_namespaces, lambda items: self._sync("services", items),
                 lambda t, o: self._event("services", t, o), self._stop)
        informer("pods", core.list_pod_for_all_namespaces, lambda items: self._sync("pods", items),
                 lambda t, o: self._event("pods", t, o), self._stop)
        for ev in self._synced.values():
            ev.wait(10)

    def stop(self) -> None:
        """Stop watching and close every listener."""
        self._stop.set()
        with self._lock:
            for key in list(self._forwarders):
                self._drop(key)

    # --- queries ---------------------------------------------------------------------------------------

    def address(self, namespace: str, name: str, timeout_s: float = 0.0) -> str:
        """The loopback address of Service ``namespace/name`` (waits up to ``timeout_s`` for it; KeyError)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                ip = self._ips.get((namespace, name))
            if ip or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        if not ip:
            raise KeyError(f"no loopback proxy for Service {namespace}/{name}")
        return ip

    def backends(self, namespace: str, name: str) -> dict[int, list[tuple[str, int]]]:
        """Service port → the ready endpoints it forwards to now."""
        with self._lock:
            return {p: list(f.backends) for p, f in self._forwarders.get((namespace, name), {}).items()}

    def hosts_lines(self) -> list[str]:
        """``/etc/hosts`` lines naming every Service by its four DNS forms."""
        with self._lock:
            items = sorted(self._ips.items())
        return [f"{ip}\t{n} {n}.{ns} {n}.{ns}.svc {n}.{ns}.svc.cluster.local" for (ns, n), ip in items]

    # --- informer callbacks ----------------------------------------------------------------------------

    def _sync(self, kind: str, items: list[dict[str, Any]]) -> None:
        with self._lock:
            table = self._services if kind == "services" else self._pods
            table.clear()
            for obj in items:
                table[(obj["metadata"]["namespace"], obj["metadata"]["name"])] = obj
            self._reconcile()
        self._synced[kind].set()

    def _event(self, kind: str, etype: str, obj: dict[str, Any]) -> None:
        with self._lock:
            table = self._services if kind == "services" else self._pods
            key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
            if etype == "DELETED":
                table.pop(key, None)
            else:
                table[key] = obj
            self._reconcile()

    def _reconcile(self) -> None:
        changed = False
        wanted = {k: s for k, s in self._services.items()
                  if (s.get("spec") or {}).get("type", "ClusterIP") in ("ClusterIP", "NodePort", "LoadBalancer")}
        for key in list(self._forwarders):
            if key not in wanted:
                self._drop(key)
                changed = True
        for key, svc in wanted.items():
            ports = [int(p["port"]) for p in svc["spec"].get("ports") or [] if p.get("protocol", "TCP") == "TCP"]
            fwd = self._forwarders.get(key)
            if fwd is not None and sorted(fwd) != sorted(ports):
                self._drop(key)
                fwd = None
            if fwd is None:
                try:
                    ip = self.allocator.allocate(ports)
                    self._forwarders[key] = {p: _Forwarder(ip, p) for p in ports}
                except (OSError, RuntimeError) as err:
                    log.warning("no loopback proxy for Service %s/%s: %s", *key, err)
                    continue
                self._ips[key] = ip
                changed = True
            for sp in svc["spec"].get("ports") or []:
                f = self._forwarders[key].get(int(sp["port"]))
                if f is not None:
                    f.backends = self._endpoints(key, sp)
        if changed:
            for cb in list(self.on_change):
                try:
                    cb()
                except Exception:  # noqa: BLE001
                    log.exception("on_change callback failed")

    def _endpoints(self, key: tuple[str, str], service_port: dict[str, Any]) -> list[tuple[str, int]]:
        ns, name = key
        if key == ("default", "kubernetes"):
            return [("127.0.0.1", self.api_port)]
        spec = self._services[key]["spec"]
        selector = spec.get("selector") or {}
        if not selector:
            return []
        target = service_port.get("targetPort", service_port["port"])
        out: list[tuple[str, int]] = []
        for (pns, _), pod in sorted(self._pods.items()):
            labels = pod["metadata"].get("labels") or {}
            status = pod.get("status") or {}
            if pns != ns or any(labels.get(k) != v for k, v in selector.items()) or not status.get("podIP"):
                continue
            ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
            if pod["metadata"].get("deletionTimestamp") or not (ready or spec.get("publishNotReadyAddresses")):
                continue
            if isinstance(target, int) or str(target).isdigit():
                port: int | None = int(target)
            else:
                port = next((int(p["containerPort"]) for c in pod["spec"]["containers"] for p in c.get("ports") or []
                             if p.get("name") == target), None)
            if port is not None:
                out.append((status["podIP"], port))
        return out

    def _drop(self, key: tuple[str, str]) -> None:
        for f in self._forwarders.pop(key, {}).values():
            f.close()
        ip = self._ips.pop(key, None)
        if ip:
            self.allocator.release(ip)
