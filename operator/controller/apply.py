"""Apply: server-side apply of the operator's objects, idempotent, with retries — the one place that writes.

Through the ``kubernetes`` client (its ``ApiClient``: authentication, TLS and kubeconfig handling) with a small
table of the resource paths the operator uses (:data:`RESOURCES`), so every object is plain JSON both ways.

Rules:

- **Field manager** ``fulcrum-operator``, ``force=True``: every object ``build_objects`` returns is the
  operator's alone (owner reference to the LLMServe), so it takes its fields back from anyone who edited them.
  Where the operator is not the owner — the pod-deletion-cost annotation on pods the ReplicaSet owns — it
  applies with its own manager ``fulcrum-operator-drain`` and ``force=False`` (a conflict is an error, not a
  take-over).
- **Idempotent**: each applied object carries the hash of its desired content in the annotation
  :data:`HASH_ANNOTATION`. Before writing, the live object is read; when its hash matches and it still holds every
  value the desired object sets (:func:`drift`: a hand edit keeps the annotation), nothing is sent (a second
  reconcile of the same spec issues no write; :attr:`Applier.writes` counts them). An edited field is taken back
  at the operator's next pass (the next interval or spec change); fields others add are left alone.
- **Replica count rule**: a pool Deployment's ``spec.replicas`` belongs to the operator. A hand edit (or an HPA
  fighting it) does not change the hash, so it is compared on its own: a live count different from the desired
  one is reverted at the operator's next interval — not on every watch event (the operator does not watch
  Deployments), and reported once per revert (:class:`ApplyReport.reverted`; the handlers log and post an Event).
  To own the count elsewhere, set ``spec.scaling.replicaOwner: External``.
- **Retries**: 409 (conflict), 429 and 5xx answers and connection errors are retried with capped exponential
  backoff (:data:`RETRY_STATUSES`); other answers raise :class:`KubeApiError` at once.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from fulcrum.errors import FulcrumError

__all__ = [
    "FIELD_MANAGER",
    "DRAIN_FIELD_MANAGER",
    "HASH_ANNOTATION",
    "RESOURCES",
    "RETRY_STATUSES",
    "KubeApiError",
    "KubeClient",
    "ApplyReport",
    "Applier",
    "resource_path",
    "desired_hash",
    "drift",
]

FIELD_MANAGER = "fulcrum-operator"
DRAIN_FIELD_MANAGER = "fulcrum-operator-drain"
#: The desired-content hash; ``build_objects`` already sets it (``fulcrum.dev/desired-hash``), else it is computed here.
HASH_ANNOTATION = "fulcrum.dev/desired-hash"
#: Answers worth retrying: conflict (a concurrent writer), throttling, server errors; 0 = no answer (connection).
RETRY_STATUSES: frozenset[int] = frozenset({0, 409, 429, 500, 502, 503, 504})

#: (apiVersion, kind) → (API prefix, plural) of every namespaced kind the operator reads or writes.
RESOURCES: dict[tuple[str, str], tuple[str, str]] = {
    ("apps/v1", "Deployment"): ("/apis/apps/v1", "deployments"),
    ("v1", "Service"): ("/api/v1", "services"),
    ("v1", "ConfigMap"): ("/api/v1", "configmaps"),
    ("v1", "ServiceAccount"): ("/api/v1", "serviceaccounts"),
    ("v1", "Pod"): ("/api/v1", "pods"),
    ("v1", "Event"): ("/api/v1", "events"),
    ("rbac.authorization.k8s.io/v1", "Role"): ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    ("policy/v1", "PodDisruptionBudget"): ("/apis/policy/v1", "poddisruptionbudgets"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): ("/apis/monitoring.coreos.com/v1", "servicemonitors"),
    ("fulcrum.dev/v1alpha1", "LLMServe"): ("/apis/fulcrum.dev/v1alpha1", "llmserves"),
}


class KubeApiError(FulcrumError):
    """The Kubernetes API refused a call (``status``: HTTP status, 0 = no answer; ``reason``: its message)."""

    def __init__(self, status: int, reason: str, path: str = "") -> None:
        super().__init__(f"Kubernetes API {status or 'unreachable'} on {path}: {reason}")
        self.status = status
        self.reason = reason
        self.path = path


def resource_path(api_version: str, kind: str, namespace: str, name: str | None = None,
                  subresource: str | None = None) -> str:
    """The REST path of a namespaced object or collection.

    Raises:
        KubeApiError: a kind the operator does not know (status 0: a programming error surfaced clearly).
    """
    try:
        prefix, plural = RESOURCES[(api_version, kind)]
    except KeyError:
        raise KubeApiError(0, f"unknown kind {api_version}/{kind}") from None
    path = f"{prefix}/namespaces/{quote(namespace)}/{plural}"
    if name is not None:
        path += f"/{quote(name)}"
        if subresource:
            path += f"/{subresource}"
    return path


def desired_hash(obj: Mapping[str, Any]) -> str:
    """SHA-256 (first 16 hex digits) of an object's canonical JSON, without the hash annotation itself."""
    clean = json.loads(json.dumps(obj, sort_keys=True, default=str))
    ann = clean.get("metadata", {}).get("annotations")
    if isinstance(ann, dict):
        ann.pop(HASH_ANNOTATION, None)
    return hashlib.sha256(json.dumps(clean, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def drift(desired: Any, live: Any, path: str = "") -> list[str]:
    """The paths where ``live`` no longer holds a value of ``desired`` (empty: the object is as applied).

    A hand edit (``kubectl edit``, another client's write) keeps the desired-hash annotation, so the hash alone
    cannot see it. Only what ``desired`` sets is compared: fields the API server or a controller added (defaults,
    ``deployment.kubernetes.io/revision``, a ``kubectl rollout restart`` annotation) are no drift, nor is a
    ``false``/``0``/empty value the server leaves out (it omits them: ``publishNotReadyAddresses: false``), nor a
    resource quantity it rewrote in its canonical form (``0.5`` → ``500m``). Lists compare item by item and must
    keep their length.

    Returns:
        the JSONPath-like paths (``.spec.template.spec.containers[0].image``) that differ, in ``desired``'s order.
    """
    if isinstance(desired, Mapping):
        if not isinstance(live, Mapping):
            return [] if not desired and live is None else [path or "."]
        out: list[str] = []
        for k, v in desired.items():
            out += drift(v, live.get(k), f"{path}.{k}")
        return out
    if isinstance(desired, list):
        if not isinstance(live, list) or len(live) != len(desired):
            return [] if not desired and live is None else [path or "."]
        return [p for i, (a, b) in enumerate(zip(desired, live)) for p in drift(a, b, f"{path}[{i}]")]
    if live is None and desired in (False, 0, ""):
        return []
    if isinstance(desired, bool) or isinstance(live, bool):
        return [] if desired is live else [path or "."]
    if desired == live or (".resources." in path and _same_quantity(desired, live)):
        return []
    return [path or "."]


def _same_quantity(a: Any, b: Any) -> bool:
    """Whether two resource quantities are equal (the API server stores ``0.5`` CPU as ``500m``, ``1.5Gi`` as
    ``1536Mi``); False when either is no quantity."""
    from kubernetes.utils import parse_quantity

    try:
        return bool(parse_quantity(a) == parse_quantity(b))  # type: ignore[no-untyped-call]
    except (ValueError, TypeError, ArithmeticError):
        return False


class KubeClient:
    """JSON calls through a ``kubernetes.client.ApiClient``, retried (module doc).

    Args:
        api_client: a configured ``kubernetes.client.ApiClient`` (kubeconfig or in-cluster).
        attempts: tries per call (≥ 1); backoff_s: first retry delay, doubling, capped at ``max_backoff_s``.
        sleep: blocking sleep (injected in tests).
    """

    def __init__(self, api_client: Any, *, attempts: int = 5, backoff_s: float = 0.2, max_backoff_s: float = 5.0,
                 sleep: Callable[[float], None] = time.sleep, timeout_s: float = 30.0) -> None:
        self.api_client = api_client
        self.attempts = max(1, attempts)
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.sleep = sleep
        self.timeout_s = timeout_s
        self.calls = 0
        self.retries = 0

    def request(self, method: str, path: str, *, query: Sequence[tuple[str, str]] = (), body: Any = None,
                content_type: str | None = None) -> dict[str, Any]:
        """One call; the parsed JSON answer (``{}`` when empty).

        Raises:
            KubeApiError: a non-2xx answer (after retries for :data:`RETRY_STATUSES`).
        """
        delay = self.backoff_s
        last: KubeApiError | None = None
        for attempt in range(self.attempts):
            if attempt:
                self.retries += 1
                self.sleep(delay)
                delay = min(delay * 2, self.max_backoff_s)
            try:
                return self._once(method, path, query, body, content_type)
            except KubeApiError as err:
                if err.status not in RETRY_STATUSES:
                    raise
                last = err
        assert last is not None
        raise last

    def _once(self, method: str, path: str, query: Sequence[tuple[str, str]], body: Any,
              content_type: str | None) -> dict[str, Any]:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
        self.calls += 1
        try:
            m, url, hdrs, b, _ = self.api_client.param_serialize(
                method=method, resource_path=path, query_params=list(query), header_params=headers,
                body=body, auth_settings=["BearerToken"])
            resp = self.api_client.call_api(m, url, header_params=hdrs, body=b, _request_timeout=self.timeout_s)
            data = resp.read()
        except Exception as err:  # urllib3 connection errors, ApiException(status=0)
            status = int(getattr(err, "status", 0) or 0)
            raise KubeApiError(status, f"{type(err).__name__}: {err}", path) from err
        if not 200 <= resp.status < 300:
            reason = resp.reason or ""
            try:
                reason = json.loads(data).get("message", reason)
            except (ValueError, AttributeError, TypeError):
                pass
            raise KubeApiError(int(resp.status), str(reason), path)
        if not data:
            return {}
        try:
            parsed = json.loads(data)
        except ValueError as err:
            raise KubeApiError(int(resp.status), f"answer is not JSON: {err}", path) from err
        return parsed if isinstance(parsed, dict) else {"items": parsed}

    # ------------------------------------------------------------------------------------------ helpers
    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist (404)."""
        try:
            return self.request("GET", resource_path(api_version, kind, namespace, name))
        except KubeApiError as err:
            if err.status == 404:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str, label_selector: str = "") -> list[dict[str, Any]]:
        """Objects of a kind in a namespace, optionally filtered by a label selector."""
        query = [("labelSelector", label_selector)] if label_selector else []
        items = self.request("GET", resource_path(api_version, kind, namespace), query=query).get("items")
        return [i for i in items or () if isinstance(i, dict)]

    def server_side_apply(self, obj: Mapping[str, Any], *, field_manager: str, force: bool,
                          subresource: str | None = None) -> dict[str, Any]:
        """PATCH ``application/apply-patch+yaml`` (JSON is YAML) with ``fieldManager`` and ``force``."""
        meta = obj.get("metadata", {})
        path = resource_path(str(obj.get("apiVersion")), str(obj.get("kind")), str(meta.get("namespace")),
                             str(meta.get("name")), subresource)
        query = [("fieldManager", field_manager)] + ([("force", "true")] if force else [])
        return self.request("PATCH", path, query=query, body=dict(obj), content_type="application/apply-patch+yaml")

    def merge_patch(self, api_version: str, kind: str, namespace: str, name: str, body: Mapping[str, Any],
                    subresource: str | None = None) -> dict[str, Any]:
        """PATCH ``application/merge-patch+json`` (e.g. an LLMServe's status subresource)."""
        return self.request("PATCH", resource_path(api_version, kind, namespace, name, subresource), body=dict(body),
                            content_type="application/merge-patch+json")

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """DELETE an object (background propagation: its pods go with it); False when it was already gone."""
        try:
            self.request("DELETE", resource_path(api_version, kind, namespace, name),
                         body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"})
        except KubeApiError as err:
            if err.status == 404:
                return False
            raise
        return True

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """POST a new object to its collection."""
        meta = obj.get("metadata", {})
        return self.request("POST", resource_path(str(obj.get("apiVersion")), str(obj.get("kind")),
                                                  str(meta.get("namespace"))), body=dict(obj))


@dataclass
class ApplyReport:
    """What one :meth:`Applier.apply_all` did.

    Attributes:
        written: ``Kind/name`` of objects sent to the API (changed or missing).
        unchanged: ``Kind/name`` of objects already as desired (nothing sent).
        reverted: ``(Deployment name, live replicas, desired replicas)`` of hand edits reverted.
    """

    written: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    reverted: list[tuple[str, int, int]] = field(default_factory=list)


def _replicas(obj: Mapping[str, Any] | None) -> int | None:
    spec = (obj or {}).get("spec") or {}
    r = spec.get("replicas") if isinstance(spec, Mapping) else None
    return int(r) if isinstance(r, int) and not isinstance(r, bool) else None


class Applier:
    """Applies desired objects idempotently (module doc). ``writes`` counts objects sent, over its lifetime."""

    def __init__(self, kube: KubeClient, *, field_manager: str = FIELD_MANAGER) -> None:
        self.kube = kube
        self.field_manager = field_manager
        self.writes = 0

    def apply(self, obj: Mapping[str, Any], report: ApplyReport | None = None) -> bool:
        """Apply one object unless the live one already matches; True when written.

        Raises:
            KubeApiError: the read or the apply failed after retries.
        """
        report = report if report is not None else ApplyReport()
        desired = json.loads(json.dumps(obj, default=str))
        meta = desired.setdefault("metadata", {})
        ann = meta.setdefault("annotations", {})
        h = str(ann.get(HASH_ANNOTATION) or desired_hash(desired))
        ann[HASH_ANNOTATION] = h
        key = f"{desired.get('kind')}/{meta.get('name')}"
        live = self.kube.get(str(desired.get("apiVersion")), str(desired.get("kind")), str(meta.get("namespace")),
                             str(meta.get("name")))
        live_hash = ((live or {}).get("metadata", {}).get("annotations") or {}).get(HASH_ANNOTATION)
        want_r, live_r = _replicas(desired), _replicas(live)
        replicas_edited = live is not None and want_r is not None and live_r is not None and live_r != want_r
        if live is not None and live_hash == h and not replicas_edited and not drift(desired, live):
            report.unchanged.append(key)
            return False
        if replicas_edited and live_hash == h:
            report.reverted.append((str(meta.get("name")), int(live_r or 0), int(want_r or 0)))
        self.kube.server_side_apply(desired, field_manager=self.field_manager, force=True)
        self.writes += 1
        report.written.append(key)
        return True

    def prune(self, namespace: str, label_selector: str, keep: Iterable[Mapping[str, Any]],
              kinds: Sequence[tuple[str, str]] = (("apps/v1", "Deployment"), ("v1", "Service"))) -> list[str]:
        """Delete objects of ``kinds`` that carry ``label_selector`` and the operator's field manager but are
        not in ``keep`` (e.g. the prefill/decode pools after a switch to Unified mode). Returns ``Kind/name``s.

        Only objects the operator applied (``managedFields`` names :data:`FIELD_MANAGER`) are ever deleted.
        """
        wanted = {(str(o.get("kind")), str(o.get("metadata", {}).get("name"))) for o in keep}
        deleted: list[str] = []
        for api_version, kind in kinds:
            for live in self.kube.list(api_version, kind, namespace, label_selector):
                meta = live.get("metadata") or {}
                name = str(meta.get("name"))
                managers = {m.get("manager") for m in meta.get("managedFields") or ()}
                if (kind, name) in wanted or self.field_manager not in managers:
                    continue
                if self.kube.delete(api_version, kind, namespace, name):
                    self.writes += 1
                    deleted.append(f"{kind}/{name}")
        return deleted

    def apply_all(self, objs: Iterable[Mapping[str, Any]]) -> ApplyReport:
        """Apply every object in order (ServiceAccount/RBAC/ConfigMaps before the Deployments that use them)."""
        report = ApplyReport()
        order = {"ServiceAccount": 0, "Role": 1, "RoleBinding": 2, "ConfigMap": 3, "Service": 4}
        for obj in sorted(objs, key=lambda o: order.get(str(o.get("kind")), 5)):
            self.apply(obj, report)
        return report
