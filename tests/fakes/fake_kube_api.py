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
to its ``spec.replicas`` on every write (an instantly ready cluster). :meth:`kubeconfig` writes a kubeconfig
pointing at the fake.

Only the tests of the Kubernetes adapter use it (tests/unit/test_controller_api_objects.py: what goes over the
wire); the Controller's logic is tested on ``fulcrum.controller.objects.InMemoryObjects``.
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
    url: str = ""

    def __post_init__(self) -> None:
        self._failures: list[_Failure] = []
        self._lock = threading.Lock()
        self._rv = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

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

    # ------------------------------------------------------------------------------------------ serving
    async def _handle(self, request: web.Request) -> web.StreamResponse:
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
            new = _merge(live, body)
            managers = new["metadata"].setdefault("managedFields", [])
            if not any(m.get("manager") == query["fieldManager"] for m in managers):
                managers.append({"manager": query["fieldManager"], "operation": "Apply"})
        elif ctype.startswith("application/merge-patch"):
            if live is None:
                return self._status(404, f"{plural} {name} not found")
            if sub == "status":
                new = copy.deepcopy(live)
                new["status"] = _merge(live.get("status") or {}, (body or {}).get("status") or {})
            else:
                new = _merge(live, body)
        elif ctype.startswith("application/json-patch"):
            if live is None:
                return self._status(404, f"{plural} {name} not found")
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
        return web.json_response(new)
