"""A FAKE Kubernetes API server (aiohttp on 127.0.0.1, in a background thread) for the operator's tests. Not a
cluster: it keeps objects in memory and implements only the paths the operator uses.

- ``GET`` an object or a collection (``labelSelector`` with ``k=v`` terms), for core (``/api/v1``) and group
  (``/apis/<group>/<version>``) namespaced kinds;
- ``PATCH`` with ``application/apply-patch+yaml`` (server-side apply: creates when missing, otherwise merges
  the applied fields over the live object; ``fieldManager`` and ``force`` are recorded),
  ``application/merge-patch+json`` (RFC 7386, also on the ``/status`` subresource) and
  ``application/json-patch+json`` (RFC 6902 on objects: kopf's annotations);
- ``POST`` to a collection (Events; ``generateName`` honoured); ``DELETE`` of an object;
- just enough discovery (``/api``, ``/apis``, the ``fulcrum.dev``, ``apiextensions.k8s.io`` and core resource
  lists), namespace and CRD listing, and silent ``?watch=true`` streams, for a smoke run of the whole kopf
  operator.

Extras for tests: every request is logged (:attr:`FakeKubeApi.requests`); :meth:`FakeKubeApi.fail` makes the
next N matching calls answer a status (409/500 …); ``auto_ready`` sets a Deployment's ``status.readyReplicas``
to its ``spec.replicas`` on every write (an instantly ready cluster); pods added with :meth:`add_pod` serve a
vLLM-like ``/metrics`` (``vllm:num_requests_running``/``waiting`` from :attr:`pod_loads`) on their own port,
and when a pool Deployment's replicas drop, the pods with the lowest ``pod-deletion-cost`` are deleted, as the
ReplicaSet controller does. :meth:`kubeconfig` writes a kubeconfig pointing at the fake.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

__all__ = ["FakeKubeApi", "RequestLog"]


@dataclass
class RequestLog:
    """One request the fake received."""

    method: str
    path: str
    query: dict[str, str]
    content_type: str
    body: Any
    status: int = 200


@dataclass
class _Failure:
    method: str
    path_contains: str
    status: int
    times: int


def _merge(live: Any, patch: Any) -> Any:
    """RFC 7386 merge patch (null deletes; lists replace)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(live) if isinstance(live, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merge(out.get(k), v)
    return out


def _json_patch(doc: Any, ops: list[dict[str, Any]]) -> Any:
    """RFC 6902 add/replace/remove/test on dict paths (what kopf sends for annotations and finalizers)."""
    doc = copy.deepcopy(doc)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent = doc
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent.setdefault(p, {})
        last = parts[-1]
        kind = op["op"]
        if kind == "test":
            cur = parent[int(last)] if isinstance(parent, list) else parent.get(last)
            if cur != op.get("value"):
                raise ValueError(f"test failed at {op['path']}")
        elif kind in ("add", "replace"):
            if isinstance(parent, list):
                if last == "-":
                    parent.append(op["value"])
                elif kind == "add":
                    parent.insert(int(last), op["value"])
                else:
                    parent[int(last)] = op["value"]
            else:
                parent[last] = op["value"]
        elif kind == "remove":
            if isinstance(parent, list):
                del parent[int(last)]
            else:
                del parent[last]
        else:
            raise ValueError(f"unsupported op {kind}")
    return doc


def _matches(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        k, _, v = term.partition("=")
        if labels.get(k) != v:
            return False
    return True


@dataclass
class FakeKubeApi:
    """The fake API (module doc). ``start()`` → ``url``; ``stop()`` when done."""

    auto_ready: bool = True
    objects: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)  # (plural, ns, name)
    requests: list[RequestLog] = field(default_factory=list)
    pod_loads: dict[str, tuple[float, float]] = field(default_factory=dict)
    url: str = ""

    def __post_init__(self) -> None:
        self._failures: list[_Failure] = []
        self._lock = threading.Lock()
        self._rv = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._pod_ports: dict[int, str] = {}

    # ------------------------------------------------------------------------------------------ control
    def start(self) -> "FakeKubeApi":
        ready = threading.Event()

        def main() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._start())
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._runner.cleanup() if self._runner else asyncio.sleep(0))
            self._loop.close()

        self._thread = threading.Thread(target=main, name="fake-kube-api", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake kube API did not start")
        return self

    async def _start(self) -> None:
        self._stopping = asyncio.Event()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        self._api_port = port

    async def _shutdown(self) -> None:
        self._stopping.set()  # ends open watch streams
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def stop(self) -> None:
        if self._loop is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    def kubeconfig(self, path: Path) -> Path:
        """Write a kubeconfig naming the fake (token auth) and return its path."""
        cfg = {
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "default"}}],
        }
        path.write_text(json.dumps(cfg))
        return path

    def fail(self, method: str, path_contains: str, status: int, times: int = 1) -> None:
        """The next ``times`` requests with ``method`` whose path contains ``path_contains`` answer ``status``."""
        with self._lock:
            self._failures.append(_Failure(method, path_contains, status, times))

    def get(self, plural: str, ns: str, name: str) -> dict[str, Any] | None:
        """A stored object (a copy), or None."""
        with self._lock:
            obj = self.objects.get((plural, ns, name))
            return copy.deepcopy(obj) if obj is not None else None

    def put(self, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Store an object as is (tests seed the LLMServe, hand-edit a Deployment …)."""
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        meta.setdefault("uid", str(uuid.uuid4()))
        meta["resourceVersion"] = str(next(self._rv))
        with self._lock:
            self.objects[(plural, meta["namespace"], meta["name"])] = copy.deepcopy(obj)
        return obj

    def list(self, plural: str, ns: str | None = None) -> list[dict[str, Any]]:
        """Stored objects of a kind (copies), optionally in one namespace."""
        with self._lock:
            return [copy.deepcopy(o) for (p, n, _), o in sorted(self.objects.items())
                    if p == plural and (ns is None or n == ns)]

    def writes(self) -> list[RequestLog]:
        """Every PATCH/POST/PUT/DELETE received that succeeded (not Events)."""
        return [r for r in self.requests if r.method in ("PATCH", "POST", "PUT", "DELETE") and r.status < 300
                and "/events" not in r.path]

    def add_pod(self, name: str, labels: dict[str, str], *, ns: str = "default", running: float = 0.0,
                waiting: float = 0.0, ready: bool = True) -> None:
        """A pod with its own ``/metrics`` port on 127.0.0.1 (loads in :attr:`pod_loads`)."""
        assert self._loop is not None
        fut = asyncio.run_coroutine_threadsafe(self._open_pod_port(name), self._loop)
        port = fut.result(10)
        self.pod_loads[name] = (running, waiting)
        self.put("pods", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": dict(labels), "annotations": {}},
            "spec": {"containers": [{"name": "worker", "ports": [{"name": "http", "containerPort": port}]}]},
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
        })

    async def _open_pod_port(self, name: str) -> int:
        assert self._runner is not None
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        self._pod_ports[port] = name
        return port

    # ------------------------------------------------------------------------------------------ serving
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        sock = request.transport.get_extra_info("sockname") if request.transport else None
        if sock and sock[1] != self._api_port:
            return self._pod_metrics(self._pod_ports.get(sock[1], ""))
        raw = await request.read()
        ctype = request.headers.get("Content-Type", "")
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            return self._status(400, "body is not JSON")
        entry = RequestLog(request.method, request.path, dict(request.query), ctype, body)
        with self._lock:
            self.requests.append(entry)
            for f in self._failures:
                if f.times > 0 and f.method == request.method and f.path_contains in request.path:
                    f.times -= 1
                    entry.status = f.status
                    return self._status(f.status, f"injected failure {f.status}")
        if request.method == "GET" and request.query.get("watch") in ("true", "1"):
            return await self._watch(request)
        discovery = self._discovery(request.path)
        if discovery is not None:
            return web.json_response(discovery)
        resp = self._dispatch(request.method, request.path, dict(request.query), ctype, body)
        entry.status = resp.status
        return resp

    def _discovery(self, path: str) -> dict[str, Any] | None:
        """Just enough API discovery for kopf to find ``llmserves`` and post Events."""
        if path == "/api":
            return {"kind": "APIVersions", "versions": ["v1"]}
        if path == "/apis":
            return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
                {"name": "fulcrum.dev", "versions": [{"groupVersion": "fulcrum.dev/v1alpha1", "version": "v1alpha1"}],
                 "preferredVersion": {"groupVersion": "fulcrum.dev/v1alpha1", "version": "v1alpha1"}},
                {"name": "apiextensions.k8s.io", "versions": [{"groupVersion": "apiextensions.k8s.io/v1", "version": "v1"}],
                 "preferredVersion": {"groupVersion": "apiextensions.k8s.io/v1", "version": "v1"}}]}
        if path == "/apis/apiextensions.k8s.io/v1":
            return {"kind": "APIResourceList", "groupVersion": "apiextensions.k8s.io/v1", "resources": [
                {"name": "customresourcedefinitions", "singularName": "customresourcedefinition", "namespaced": False,
                 "kind": "CustomResourceDefinition", "verbs": ["get", "list", "watch"]}]}
        if path == "/apis/apiextensions.k8s.io/v1/customresourcedefinitions":
            return {"kind": "List", "metadata": {"resourceVersion": str(next(self._rv))}, "items": []}
        if path == "/api/v1":
            return {"kind": "APIResourceList", "groupVersion": "v1", "resources": [
                {"name": "events", "singularName": "event", "namespaced": True, "kind": "Event",
                 "verbs": ["create", "get", "list"]},
                {"name": "namespaces", "singularName": "namespace", "namespaced": False, "kind": "Namespace",
                 "verbs": ["get", "list", "watch"]}]}
        if path == "/api/v1/namespaces":
            names = sorted({k[1] for k in self.objects} | {"default"})
            return {"kind": "NamespaceList", "metadata": {"resourceVersion": str(next(self._rv))},
                    "items": [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}} for n in names]}
        if path == "/apis/fulcrum.dev/v1alpha1":
            return {"kind": "APIResourceList", "groupVersion": "fulcrum.dev/v1alpha1", "resources": [
                {"name": "llmserves", "singularName": "llmserve", "namespaced": True, "kind": "LLMServe",
                 "shortNames": ["llms"], "verbs": ["get", "list", "watch", "patch", "update"]},
                {"name": "llmserves/status", "singularName": "", "namespaced": True, "kind": "LLMServe",
                 "verbs": ["get", "patch", "update"]}]}
        return None

    async def _watch(self, request: web.Request) -> web.StreamResponse:
        """A watch stream that stays open (silent) until its timeout or the fake stops."""
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        try:
            await asyncio.wait_for(self._stopping.wait(), float(request.query.get("timeoutSeconds", "60")))
        except asyncio.TimeoutError:
            pass
        return resp

    def _pod_metrics(self, pod: str) -> web.Response:
        running, waiting = self.pod_loads.get(pod, (0.0, 0.0))
        text = ("# HELP vllm:num_requests_running Requests running.\n# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{model_name="m"}} {running}\n'
                "# HELP vllm:num_requests_waiting Requests waiting.\n# TYPE vllm:num_requests_waiting gauge\n"
                f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n')
        return web.Response(text=text, content_type="text/plain")

    @staticmethod
    def _status(code: int, message: str) -> web.Response:
        return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
                                  "code": code}, status=code)

    def _dispatch(self, method: str, path: str, query: dict[str, str], ctype: str, body: Any) -> web.Response:
        parts = [p for p in path.split("/") if p]
        # /api/v1/namespaces/NS/PLURAL[/NAME[/SUB]] or /apis/G/V/namespaces/NS/PLURAL[/NAME[/SUB]]
        base = 2 if parts[:1] == ["api"] else 3
        rest = parts[base:]
        if len(rest) < 3 or rest[0] != "namespaces":
            return self._status(404, f"unsupported path {path}")
        ns, plural = rest[1], rest[2]
        name = rest[3] if len(rest) > 3 else None
        sub = rest[4] if len(rest) > 4 else None
        with self._lock:
            if method == "GET" and name is None:
                sel = query.get("labelSelector", "")
                items = [copy.deepcopy(o) for (p, n, _), o in sorted(self.objects.items())
                         if p == plural and n == ns and _matches(o.get("metadata", {}).get("labels") or {}, sel)]
                return web.json_response({"kind": "List", "metadata": {"resourceVersion": str(next(self._rv))},
                                          "items": items})
            if method == "GET":
                obj = self.objects.get((plural, ns, name))
                return web.json_response(obj) if obj is not None else self._status(404, f"{plural} {name} not found")
            if method == "POST" and name is None:
                obj = dict(body or {})
                meta = obj.setdefault("metadata", {})
                if not meta.get("name"):
                    meta["name"] = f"{meta.get('generateName', 'obj-')}{uuid.uuid4().hex[:8]}"
                meta["namespace"] = ns
                meta["uid"] = str(uuid.uuid4())
                meta["resourceVersion"] = str(next(self._rv))
                self.objects[(plural, ns, meta["name"])] = obj
                return web.json_response(obj, status=201)
            if method == "DELETE" and name is not None:
                if self.objects.pop((plural, ns, name), None) is None:
                    return self._status(404, f"{plural} {name} not found")
                return web.json_response({"kind": "Status", "status": "Success"})
            if method == "PATCH" and name is not None:
                return self._patch(plural, ns, name, sub, query, ctype, body)
        return self._status(405, f"{method} {path} not supported by the fake")

    def _patch(self, plural: str, ns: str, name: str, sub: str | None, query: dict[str, str], ctype: str,
               body: Any) -> web.Response:
        key = (plural, ns, name)
        live = self.objects.get(key)
        if ctype.startswith("application/apply-patch"):
            if not query.get("fieldManager"):
                return self._status(400, "fieldManager is required for apply patch")
            if live is None:
                live = {"metadata": {"uid": str(uuid.uuid4())}}
            old_replicas = (live.get("spec") or {}).get("replicas")
            new = _merge(live, body)
            managers = new["metadata"].setdefault("managedFields", [])
            if not any(m.get("manager") == query["fieldManager"] for m in managers):
                managers.append({"manager": query["fieldManager"], "operation": "Apply"})
        elif ctype.startswith("application/merge-patch"):
            if live is None:
                return self._status(404, f"{plural} {name} not found")
            old_replicas = (live.get("spec") or {}).get("replicas")
            if sub == "status":
                new = copy.deepcopy(live)
                new["status"] = _merge(live.get("status") or {}, (body or {}).get("status") or {})
            else:
                new = _merge(live, body)
        elif ctype.startswith("application/json-patch"):
            if live is None:
                return self._status(404, f"{plural} {name} not found")
            old_replicas = (live.get("spec") or {}).get("replicas")
            try:
                new = _json_patch(live, body or [])
            except (KeyError, IndexError, ValueError) as err:
                return self._status(422, f"json patch failed: {err}")
        else:
            return self._status(415, f"unsupported content type {ctype}")
        new["metadata"]["resourceVersion"] = str(next(self._rv))
        if plural == "deployments" and self.auto_ready:
            new.setdefault("status", {})["readyReplicas"] = int((new.get("spec") or {}).get("replicas") or 0)
        self.objects[key] = new
        if plural == "deployments":
            self._replicaset(ns, new, old_replicas)
        return web.json_response(new)

    def _replicaset(self, ns: str, dep: dict[str, Any], old: Any) -> None:
        """Delete the lowest-cost pods of a shrunk pool, as the ReplicaSet controller does."""
        new = (dep.get("spec") or {}).get("replicas")
        if not isinstance(new, int) or not isinstance(old, int) or new >= old:
            return
        sel = (dep.get("spec") or {}).get("selector", {}).get("matchLabels") or {}
        pods = [(k, o) for k, o in self.objects.items() if k[0] == "pods" and k[1] == ns
                and all((o["metadata"].get("labels") or {}).get(a) == b for a, b in sel.items())]
        if len(pods) <= new:
            return

        def cost(item: tuple[tuple[str, str, str], dict[str, Any]]) -> tuple[int, str]:
            ann = item[1]["metadata"].get("annotations") or {}
            return int(ann.get("controller.kubernetes.io/pod-deletion-cost", "0")), item[0][2]

        for k, _ in sorted(pods, key=cost)[: len(pods) - new]:
            del self.objects[k]
