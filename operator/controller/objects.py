"""The Kubernetes objects the operator's :class:`~fulcrum.controller.handlers.Controller` reads and writes: one
seam, :class:`KubeObjects`, with the Kubernetes API implementation (:class:`ApiObjects`) and one held in memory
(:class:`InMemoryObjects`).

The Controller's logic — the target a reconcile applies, the status fields and Events of an interval, which pods a
drain picks, what a spec change or a deletion does, which error becomes which condition — needs only these seven
operations on objects (plain JSON dicts, as the API returns them). :class:`ApiObjects` does them over HTTP with
``apply.py``'s retried client, idempotent server-side apply and pruning; the handler tests run the logic on
:class:`InMemoryObjects`, and test what Kubernetes itself does (request shapes, server-side apply, retries,
404/409) on :class:`ApiObjects` — against a fake HTTP API in the unit tests and a real API server in e2e/.

Pod ``/metrics`` are not objects: the Controller reads them through its ``fetch`` callable.
"""

from __future__ import annotations

import copy
import itertools
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from fulcrum.controller.apply import DRAIN_FIELD_MANAGER, Applier, ApplyReport, KubeApiError, KubeClient

__all__ = ["KubeObjects", "ApiObjects", "InMemoryObjects"]

_LLMSERVE = ("fulcrum.dev/v1alpha1", "LLMServe")


@runtime_checkable
class KubeObjects(Protocol):
    """Namespaced Kubernetes objects for the Controller. Every method blocks (the Controller calls them in a
    worker thread); failures raise :class:`~fulcrum.controller.apply.KubeApiError` (a ``FulcrumError``)."""

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        ...

    def apply_all(self, objs: Iterable[Mapping[str, Any]]) -> ApplyReport:
        """Apply the operator's objects (it owns them whole); what was written, unchanged, and which hand edits of
        a Deployment's replicas were reverted."""
        ...

    def prune(self, namespace: str, label_selector: str, keep: Iterable[Mapping[str, Any]]) -> list[str]:
        """Delete the Deployments and Services the operator applied under ``label_selector`` that are not in
        ``keep``; their ``Kind/name``s."""
        ...

    def write_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> bool:
        """Merge ``status`` into the LLMServe's status; False when the LLMServe is gone."""
        ...

    def post_event(self, event: Mapping[str, Any]) -> None:
        """Create a core/v1 Event (``metadata.generateName`` names it)."""
        ...

    def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str]) -> bool:
        """Set annotations on a pod the operator does not own (the drain's pod-deletion cost), never taking a field
        from another manager; False when the pod is gone."""
        ...

    # ``list`` last in each class: the method's name would hide the builtin in the annotations after it
    def list(self, api_version: str, kind: str, namespace: str, label_selector: str = "") -> list[dict[str, Any]]:
        """Objects of a kind in a namespace whose labels match ``label_selector`` (``k=v`` terms, comma-separated)."""
        ...


class ApiObjects:
    """:class:`KubeObjects` over the Kubernetes API: ``kube`` (retries inside) and an :class:`Applier` (field
    manager ``fulcrum-operator``, ``force``, skip-when-hash-matches; ``applier.writes`` counts objects sent)."""

    def __init__(self, kube: KubeClient) -> None:
        self.kube = kube
        self.applier = Applier(kube)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """GET the object; None on 404."""
        return self.kube.get(api_version, kind, namespace, name)

    def apply_all(self, objs: Iterable[Mapping[str, Any]]) -> ApplyReport:
        """:meth:`Applier.apply_all` (server-side apply, in dependency order)."""
        return self.applier.apply_all(objs)

    def prune(self, namespace: str, label_selector: str, keep: Iterable[Mapping[str, Any]]) -> list[str]:
        """:meth:`Applier.prune` (only objects whose ``managedFields`` name the operator)."""
        return self.applier.prune(namespace, label_selector, keep)

    def write_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> bool:
        """Merge-patch the ``status`` subresource; False on 404."""
        try:
            self.kube.merge_patch(*_LLMSERVE, namespace, name, {"status": dict(status)}, "status")
        except KubeApiError as err:
            if err.status == 404:
                return False
            raise
        return True

    def post_event(self, event: Mapping[str, Any]) -> None:
        """POST the Event."""
        self.kube.create(event)

    def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str]) -> bool:
        """Server-side apply of the annotations with field manager ``fulcrum-operator-drain``, ``force=False`` (a
        conflict raises, never takes over); False when the pod is gone.

        A server-side apply of a missing object tries to create it, so for a pod deleted meanwhile the API server
        answers 422 (a Pod without containers is invalid) or an admission refusal, not 404: a refused apply is
        checked with a GET, and a pod that is not there is False.

        Raises:
            KubeApiError: the apply failed (after retries) on a pod that exists, or the GET failed.
        """
        obj = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": namespace, "annotations": dict(annotations)}}
        try:
            self.kube.server_side_apply(obj, field_manager=DRAIN_FIELD_MANAGER, force=False)
        except KubeApiError as err:
            if err.status == 404 or (400 <= err.status < 500 and self.kube.get("v1", "Pod", namespace, name) is None):
                return False
            raise
        return True

    def list(self, api_version: str, kind: str, namespace: str, label_selector: str = "") -> list[dict[str, Any]]:
        """GET the collection with ``labelSelector``."""
        return self.kube.list(api_version, kind, namespace, label_selector)


def _matches(labels: Mapping[str, str], selector: str) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        k, _, v = term.partition("=")
        if labels.get(k) != v:
            return False
    return True


def _merge(live: Any, patch: Any) -> Any:
    """RFC 7386 merge (None deletes a key; lists replace)."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    out = dict(live) if isinstance(live, Mapping) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merge(out.get(k), v)
    return out


@dataclass
class InMemoryObjects:
    """:class:`KubeObjects` held in a dict: no API server, no HTTP, no controllers besides one optional rule.

    ``apply_all`` stores each object as given (the operator owns it whole) and reports it written when it differs
    from the stored one, or the replica count reverted when only a Deployment's ``spec.replicas`` differs — what
    :class:`ApiObjects` reports for the same objects; ``prune`` deletes the applied Deployments and Services not
    kept. With ``auto_ready`` a Deployment's ``status.readyReplicas`` follows its ``spec.replicas`` at once (a
    cluster whose pods start instantly). No ReplicaSet controller: a Deployment whose replicas drop keeps its pods
    here; tests read the victims from the pod-deletion cost :meth:`annotate_pod` left.

    Attributes:
        objects: ``(kind, namespace, name)`` → the object (tests seed and edit it directly).
        events: every Event posted, in order.
        fail: ``operation name`` → a :class:`KubeApiError` that operation raises (until removed), e.g.
            ``{"apply_all": KubeApiError(500, "down")}``.
    """

    auto_ready: bool = True
    objects: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    fail: dict[str, KubeApiError] = field(default_factory=dict)
    writes: int = 0
    """Objects written or deleted by ``apply_all`` and ``prune``, over its lifetime (as ``Applier.writes``)."""

    def __post_init__(self) -> None:
        self._names = itertools.count(1)
        self._lock = threading.RLock()  # the Controller calls from worker threads (an interval's, the drains')
        self._applied: set[tuple[str, str, str]] = set()

    def _check(self, op: str) -> None:
        err = self.fail.get(op)
        if err is not None:
            raise err

    def put(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Store ``obj`` as is (a copy; namespace ``default`` and uid ``uid-NAME`` unless given); the stored copy."""
        stored = copy.deepcopy(dict(obj))
        meta = stored.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        meta.setdefault("uid", f"uid-{meta['name']}")
        with self._lock:
            self.objects[(str(stored.get("kind")), meta["namespace"], meta["name"])] = stored
        return copy.deepcopy(stored)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """A copy of the stored object, or None."""
        with self._lock:
            self._check("get")
            obj = self.objects.get((kind, namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def apply_all(self, objs: Iterable[Mapping[str, Any]]) -> ApplyReport:
        """Store every object (class doc); the report ``ApiObjects`` would give."""
        with self._lock:
            self._check("apply_all")
            report = ApplyReport()
            for obj in objs:
                meta = obj.get("metadata") or {}
                key = (str(obj.get("kind")), str(meta.get("namespace", "default")), str(meta.get("name")))
                live = self.objects.get(key)
                desired = copy.deepcopy(dict(obj))
                if live is not None and "status" in live:
                    desired["status"] = copy.deepcopy(live["status"])
                label = f"{key[0]}/{key[2]}"
                if live is not None and _strip(live) == _strip(desired):
                    report.unchanged.append(label)
                else:
                    want, have = _replicas(desired), _replicas(live)
                    if (live is not None and want is not None and have is not None and want != have
                            and _strip(live, "replicas") == _strip(desired, "replicas")):
                        report.reverted.append((key[2], have, want))  # only the replica count was edited
                    self.writes += 1
                    report.written.append(label)
                if key[0] == "Deployment" and self.auto_ready:
                    desired.setdefault("status", {})["readyReplicas"] = _replicas(desired) or 0
                self.objects[key] = desired
                self._applied.add(key)
            return report

    def prune(self, namespace: str, label_selector: str, keep: Iterable[Mapping[str, Any]]) -> list[str]:
        """Delete the Deployments and Services applied here under the selector and not in ``keep``."""
        with self._lock:
            self._check("prune")
            wanted = {(str(o.get("kind")), str((o.get("metadata") or {}).get("name"))) for o in keep}
            deleted = []
            for key in sorted(self._applied):
                kind, ns, name = key
                obj = self.objects.get(key)
                if (kind not in ("Deployment", "Service") or ns != namespace or (kind, name) in wanted or obj is None
                        or not _matches((obj.get("metadata") or {}).get("labels") or {}, label_selector)):
                    continue
                del self.objects[key]
                self._applied.discard(key)
                self.writes += 1
                deleted.append(f"{kind}/{name}")
            return deleted

    def write_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> bool:
        """Merge ``status`` into the stored LLMServe's; False when none is stored."""
        with self._lock:
            self._check("write_status")
            obj = self.objects.get((_LLMSERVE[1], namespace, name))
            if obj is None:
                return False
            obj["status"] = _merge(obj.get("status") or {}, dict(status))
            return True

    def post_event(self, event: Mapping[str, Any]) -> None:
        """Append the Event (named ``generateName`` + a counter) to :attr:`events`."""
        with self._lock:
            self._check("post_event")
            ev = copy.deepcopy(dict(event))
            meta = ev.setdefault("metadata", {})
            meta.setdefault("name", f"{meta.get('generateName', 'event.')}{next(self._names)}")
            self.events.append(ev)

    def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str]) -> bool:
        """Merge the annotations into the stored pod's; False when it is gone."""
        with self._lock:
            self._check("annotate_pod")
            pod = self.objects.get(("Pod", namespace, name))
            if pod is None:
                return False
            pod.setdefault("metadata", {}).setdefault("annotations", {}).update(annotations)
            return True

    def by_reason(self, reason: str | None = None) -> list[dict[str, Any]]:
        """The Events posted with ``reason`` (all when None), in order."""
        with self._lock:
            return [e for e in self.events if reason is None or e.get("reason") == reason]

    def list(self, api_version: str, kind: str, namespace: str, label_selector: str = "") -> list[dict[str, Any]]:
        """Copies of the stored objects of ``kind`` in ``namespace`` matching the selector, by name."""
        with self._lock:
            self._check("list")
            return [copy.deepcopy(o) for (k, ns, _), o in sorted(self.objects.items())
                    if k == kind and ns == namespace and _matches((o.get("metadata") or {}).get("labels") or {},
                                                                  label_selector)]


def _replicas(obj: Mapping[str, Any] | None) -> int | None:
    r = ((obj or {}).get("spec") or {}).get("replicas")
    return r if isinstance(r, int) and not isinstance(r, bool) else None


def _strip(obj: Mapping[str, Any], *spec_keys: str) -> dict[str, Any]:
    """``obj`` without ``status`` and without ``spec_keys`` in its ``spec`` (for comparing desired with live)."""
    out = {k: v for k, v in obj.items() if k != "status"}
    if spec_keys and isinstance(out.get("spec"), Mapping):
        out["spec"] = {k: v for k, v in out["spec"].items() if k not in spec_keys}
    return out
