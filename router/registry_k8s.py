"""The instance registry from Kubernetes: ready endpoints of the pool Services, read from their EndpointSlices.

Issue 3 lists three sources of instances: etcd leases (:mod:`fulcrum.router.registry_etcd`), a static list
(:class:`~fulcrum.router.registry.StaticRegistry`) and Kubernetes endpoints — this module. Each worker pool
(Deployment) sits behind a Service labelled with its role, pool and TP; the EndpointSlice controller copies a
Service's labels onto its EndpointSlices (plus ``kubernetes.io/service-name``), so one list + watch of
``discovery.k8s.io/v1`` EndpointSlices selected by ``label_selector`` gives every pod address and its labels.

- One :class:`~fulcrum.router.registry.InstanceRecord` per *ready* endpoint (``conditions.ready`` true, or absent,
  which the API defines as ready); ``id`` = the pod name (``targetRef.name``), else the address; ``url`` =
  ``<scheme>://<address>:<port named port_name>``; ``role``/``pool``/``tp`` from the labels ``role_label``,
  ``pool_label`` (else the Service name), ``tp_label``.
- A malformed slice (no port named ``port_name``, a role that is not prefill/decode/both, a TP that is not a
  positive integer, a non-object) is skipped with a warning; it never fails the list.
- ``watch()`` lists, then watches from the list's ``resourceVersion``; a watch that the server ends (its
  ``timeoutSeconds``) is resumed (after the backoff delay when it brought no event, so a server that closes
  every watch at once is not asked again in a tight loop), a ``410 Gone`` relists (at once after watch events,
  else after a backoff delay: a 410 right after each list does not become a tight list/watch loop), any other
  error is logged and retried with capped exponential backoff while the last list yielded stays in force
  (nothing is yielded while the API is away).

Client: the official ``kubernetes`` client (sync, urllib3) run in threads with :func:`asyncio.to_thread`; objects
are read as raw JSON (``_preload_content=False``), so a malformed object is skipped rather than failing the
client's deserialisation. A pending watch read is interrupted on cancellation by shutting its socket down.
The Kubernetes client is imported only here (STYLE 1).

Errors::

    FulcrumError
    └── KubernetesRegistryError   the API could not be read (snapshot only; watch retries)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any, Literal, cast

import kubernetes  # type: ignore[import-untyped,unused-ignore]  # typed from 37 on

from fulcrum.errors import FulcrumError
from fulcrum.router.registry import InstanceRecord
from fulcrum.router.backoff import Backoff

__all__ = ["KubernetesRegistry", "KubernetesRegistryError", "records_from_slice"]

log = logging.getLogger(__name__)

Sleep = Callable[[float], Awaitable[None]]

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
_ROLES = ("prefill", "decode", "both")


class KubernetesRegistryError(FulcrumError):
    """The Kubernetes API could not be read (unreachable, refused, or an error answer); the cause is chained."""


class _Gone(Exception):
    """The watch's resourceVersion is too old (410): list again."""


def _str_map(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        return {}
    return {str(k): str(v) for k, v in value.items()}


def records_from_slice(
    obj: Any,
    *,
    port_name: str = "http",
    role_label: str = "fulcrum.dev/role",
    pool_label: str = "fulcrum.dev/pool",
    tp_label: str = "fulcrum.dev/tp",
    scheme: str = "http",
) -> list[InstanceRecord]:
    """The instance records of one EndpointSlice (a ``discovery.k8s.io/v1`` object as parsed JSON).

    Returns one record per ready endpoint (``conditions.ready`` true or absent), in the slice's order.

    Raises:
        ValueError: the object is malformed: not a mapping, no port named ``port_name``, a role label other than
            prefill/decode/both, or a TP label that is not a positive integer.
    """
    if not isinstance(obj, dict):
        raise ValueError("EndpointSlice is not an object")
    meta = obj.get("metadata") or {}
    labels = _str_map(meta.get("labels") if isinstance(meta, dict) else None)
    port: int | None = None
    for p in obj.get("ports") or []:
        if isinstance(p, dict) and (p.get("name") or "") == port_name and isinstance(p.get("port"), int):
            port = int(p["port"])
            break
    if port is None or not 1 <= port <= 65535:
        raise ValueError(f"no port named {port_name!r}")
    role = labels.get(role_label, "both")
    if role not in _ROLES:
        raise ValueError(f"label {role_label}={role!r} is not one of {', '.join(_ROLES)}")
    try:
        tp = int(labels.get(tp_label, "1"))
    except ValueError:
        tp = 0
    if tp < 1:
        raise ValueError(f"label {tp_label}={labels.get(tp_label)!r} is not a positive integer")
    pool = labels.get(pool_label) or labels.get(SERVICE_NAME_LABEL) or "default"
    endpoints = obj.get("endpoints") or []
    if not isinstance(endpoints, list):
        raise ValueError("endpoints is not a list")
    records: list[InstanceRecord] = []
    for ep in endpoints:
        if not isinstance(ep, dict):
            continue
        conditions = ep.get("conditions") or {}
        if isinstance(conditions, dict) and conditions.get("ready") is False:
            continue
        addresses = ep.get("addresses") or []
        if not isinstance(addresses, list) or not addresses or not isinstance(addresses[0], str):
            continue
        address = addresses[0]  # the API: addresses of one endpoint are interchangeable
        host = f"[{address}]" if ":" in address else address
        target = ep.get("targetRef") or {}
        name = target.get("name") if isinstance(target, dict) else None
        records.append(InstanceRecord(
            id=str(name) if name else address,
            url=f"{scheme}://{host}:{port}",
            role=cast(Literal["prefill", "decode", "both"], role),
            pool=pool,
            tp=tp,
            labels=labels,
        ))
    return records


def _iter_lines(resp: Any) -> Iterator[bytes]:
    """Lines (without newline, empty ones dropped) of a streamed urllib3 response."""
    buffer = b""
    for chunk in resp.stream(amt=None, decode_content=False):
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.strip():
                yield line
    if buffer.strip():
        yield buffer


def _close_response(resp: Any) -> None:
    """Interrupt a thread blocked reading ``resp`` (socket shutdown), then release it."""
    with contextlib.suppress(Exception):
        shutdown = getattr(resp, "shutdown", None)  # urllib3 >= 2.3
        if shutdown is not None:
            shutdown()
    with contextlib.suppress(Exception):
        resp.close()
    with contextlib.suppress(Exception):
        resp.release_conn()


class KubernetesRegistry:
    """Instances from the EndpointSlices of the pool Services (implements :class:`~fulcrum.router.registry.Registry`).

    Args:
        namespace: namespace of the Services (the LLMServe's).
        label_selector: selects the pool Services' EndpointSlices, e.g. ``fulcrum.dev/llmserve=llama`` (slices
            carry their Service's labels).
        port_name: the Service port of the OpenAI-compatible server ("" for an unnamed single port).
        role_label: label holding ``prefill`` | ``decode`` | ``both`` (absent = ``both``).
        pool_label: label holding the pool name (absent = the Service name).
        tp_label: label holding the tensor-parallel size (absent = 1).
        configuration: a ``kubernetes.client.Configuration``; None = in-cluster config, else ``~/.kube/config``
            (loaded at the first request, so a missing config is a logged, retried failure).
        scheme: URL scheme of the instances ("http").
        request_timeout_s: connect and read deadline of a list, and connect deadline of a watch, seconds. 10 s:
            a loaded API server answers well within it, a hung one does not stall the router's start for long.
        watch_timeout_s: ``timeoutSeconds`` asked of each watch, seconds; the watch is then resumed from the last
            ``resourceVersion`` (no relist). 300 s: long polls, yet a silently dead connection is noticed (the read
            deadline is this plus ``request_timeout_s``).
        backoff_initial_s: first retry delay of ``watch`` after a failure, seconds (doubles each retry).
        backoff_max_s: retry delay cap, seconds. 5 s: an API server restart is noticed within seconds.
        sleep: the awaitable sleep used between retries.

    Records are returned sorted by ``id``; an id seen in two slices (dual-stack) is kept once (the first slice
    by name).
    """

    def __init__(
        self,
        namespace: str,
        label_selector: str,
        port_name: str = "http",
        role_label: str = "fulcrum.dev/role",
        pool_label: str = "fulcrum.dev/pool",
        tp_label: str = "fulcrum.dev/tp",
        *,
        configuration: Any | None = None,
        scheme: str = "http",
        request_timeout_s: float = 10.0,
        watch_timeout_s: int = 300,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 5.0,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        if not namespace:
            raise ValueError("KubernetesRegistry needs a namespace")
        if request_timeout_s <= 0 or watch_timeout_s < 1:
            raise ValueError("request_timeout_s must be > 0 and watch_timeout_s >= 1")
        Backoff(backoff_initial_s, backoff_max_s)  # validate now, not at the first failure
        self.namespace = namespace
        self.label_selector = label_selector
        self._parse_args: dict[str, str] = {
            "port_name": port_name, "role_label": role_label, "pool_label": pool_label, "tp_label": tp_label,
            "scheme": scheme,
        }
        self._configuration = configuration
        self._request_timeout_s = request_timeout_s
        self._watch_timeout_s = int(watch_timeout_s)
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._sleep = sleep
        self._api_client: Any = None
        self._api: Any = None
        self._open: set[Any] = set()  # watch responses being read (shut down by close())

    # ------------------------------------------------------------------------------------------ API access
    def _discovery(self) -> Any:
        """The DiscoveryV1Api (blocking: may load the kube config; call in a thread)."""
        if self._api is None:
            cfg = self._configuration
            if cfg is None:
                cfg = kubernetes.client.Configuration()
                try:
                    kubernetes.config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call,unused-ignore]
                except kubernetes.config.ConfigException:
                    kubernetes.config.load_kube_config(client_configuration=cfg)  # type: ignore[no-untyped-call,unused-ignore]
            self._api_client = kubernetes.client.ApiClient(cfg)
            self._api = kubernetes.client.DiscoveryV1Api(self._api_client)
        return self._api

    def _list_blocking(self) -> tuple[dict[str, list[InstanceRecord]], str]:
        """List the slices: records by slice name, and the list's resourceVersion."""
        resp = self._discovery().list_namespaced_endpoint_slice(
            self.namespace, label_selector=self.label_selector, _preload_content=False,
            _request_timeout=(self._request_timeout_s, self._request_timeout_s),
        )
        try:
            data = json.loads(resp.data)
        finally:
            _close_response(resp)
        if not isinstance(data, dict) or not isinstance(data.get("items", []), list):
            raise ValueError("EndpointSliceList answer is not a list object")
        slices: dict[str, list[InstanceRecord]] = {}
        for obj in data.get("items") or []:
            parsed = self._parse(obj)
            if parsed is not None:
                slices[parsed[0]] = parsed[1]
        meta = data.get("metadata") or {}
        return slices, str(meta.get("resourceVersion", "")) if isinstance(meta, dict) else ""

    def _open_watch(self, resource_version: str) -> Any:
        """Start a watch from ``resource_version`` (blocking); the raw streamed response."""
        return self._discovery().list_namespaced_endpoint_slice(
            self.namespace, label_selector=self.label_selector, watch=True, allow_watch_bookmarks=True,
            resource_version=resource_version or None, timeout_seconds=self._watch_timeout_s,
            _preload_content=False,
            _request_timeout=(self._request_timeout_s, self._watch_timeout_s + self._request_timeout_s),
        )

    def _parse(self, obj: Any) -> tuple[str, list[InstanceRecord]] | None:
        """(slice name, its records), or None (logged) when the object is malformed."""
        meta = obj.get("metadata") if isinstance(obj, dict) else None
        name = meta.get("name") if isinstance(meta, dict) else None
        if not isinstance(name, str) or not name:
            log.warning("registry: skipping an EndpointSlice without metadata.name")
            return None
        try:
            return name, records_from_slice(obj, **self._parse_args)
        except (ValueError, TypeError) as exc:
            log.warning("registry: skipping malformed EndpointSlice %s/%s: %s", self.namespace, name, exc)
            return None

    @staticmethod
    def _flatten(slices: Mapping[str, list[InstanceRecord]]) -> list[InstanceRecord]:
        by_id: dict[str, InstanceRecord] = {}
        for name in sorted(slices):
            for record in slices[name]:
                by_id.setdefault(record.id, record)
        return sorted(by_id.values(), key=lambda r: r.id)

    # ------------------------------------------------------------------------------------------ Registry
    async def snapshot(self) -> list[InstanceRecord]:
        """The ready instances now (one list request), sorted by id.

        Raises:
            KubernetesRegistryError: the API could not be read (the client's error is chained).
        """
        try:
            slices, _ = await asyncio.to_thread(self._list_blocking)
        except Exception as exc:  # ApiException, urllib3 errors, config errors, bad JSON
            raise KubernetesRegistryError(
                f"EndpointSlices in {self.namespace} ({self.label_selector}) could not be listed: {exc}") from exc
        return self._flatten(slices)

    async def watch(self) -> AsyncIterator[list[InstanceRecord]]:
        """Yield the ready instances once listed, then after every change, forever.

        After a failure (API down, connection lost, an error answer) it logs a warning, waits with capped
        exponential backoff and lists again, yielding only when the list differs from the last one yielded; while
        the API is away nothing is yielded, so the router keeps the last list. Never raises except
        ``CancelledError``; closing the generator shuts its watch connection down.
        """
        backoff = Backoff(self._backoff_initial_s, self._backoff_max_s)
        gone_backoff = Backoff(self._backoff_initial_s, self._backoff_max_s)  # 410s with no event between them
        last: list[InstanceRecord] | None = None
        failures = 0
        progress = True  # whether a watch event was applied since the last list
        while True:
            try:
                progress = False
                slices, version = await asyncio.to_thread(self._list_blocking)
                if failures:
                    log.info("registry: EndpointSlices in %s listed again after %d failure(s)", self.namespace,
                             failures)
                failures = 0
                backoff.reset()
                current = self._flatten(slices)
                if current != last:
                    last = current
                    yield current
                while True:  # successive watches, each resumed from the last resourceVersion seen
                    resp = await asyncio.to_thread(self._open_watch, version)
                    self._open.add(resp)
                    events = 0
                    try:
                        lines = _iter_lines(resp)
                        while (line := await asyncio.to_thread(next, lines, None)) is not None:
                            version = self._apply(slices, line, version)
                            events += 1
                            progress = True
                            gone_backoff.reset()
                            current = self._flatten(slices)
                            if current != last:
                                last = current
                                yield current
                    finally:
                        self._open.discard(resp)
                        _close_response(resp)
                    if events:
                        backoff.reset()
                    else:  # ended without an event (a quiet timeoutSeconds, or a server closing watches at
                        # once): wait before the next, so a server that ends every watch is not hammered
                        await self._sleep(backoff.next())
            except _Gone:
                if progress:
                    log.info("registry: watch of %s expired (410); listing again", self.namespace)
                    continue
                # 410 again with no event since the last list: list again after a backoff, not in a tight loop
                delay = gone_backoff.next()
                log.warning("registry: watch of %s expired (410) right after a list; listing again in %.1f s",
                            self.namespace, delay)
            except Exception as exc:  # never raise into the router: log, back off, list again
                failures += 1
                delay = backoff.next()
                log.warning("registry: Kubernetes API failed for EndpointSlices in %s (%s: %s); retrying in %.1f s",
                            self.namespace, type(exc).__name__, exc, delay)
            await self._sleep(delay)

    def _apply(self, slices: dict[str, list[InstanceRecord]], line: bytes, version: str) -> str:
        """Apply one watch event line to ``slices``; returns the resourceVersion to resume from.

        Raises:
            _Gone: an ERROR event with code 410.
            KubernetesRegistryError: another ERROR event (the watch is restarted after backoff).
        """
        try:
            event = json.loads(line)
        except ValueError:
            log.warning("registry: skipping a watch line that is not JSON")
            return version
        if not isinstance(event, dict):
            return version
        kind, obj = event.get("type"), event.get("object")
        if kind == "ERROR":
            code = obj.get("code") if isinstance(obj, dict) else None
            if code == 410:
                raise _Gone()
            message = obj.get("message") if isinstance(obj, dict) else obj
            raise KubernetesRegistryError(f"watch error {code}: {message}")
        meta = obj.get("metadata") if isinstance(obj, dict) else None
        new_version = meta.get("resourceVersion") if isinstance(meta, dict) else None
        if isinstance(new_version, str) and new_version:
            version = new_version
        if kind == "BOOKMARK":
            return version
        if kind == "DELETED":
            name = meta.get("name") if isinstance(meta, dict) else None
            if isinstance(name, str):
                slices.pop(name, None)
            return version
        if kind in ("ADDED", "MODIFIED"):
            parsed = self._parse(obj)
            if parsed is None:  # a slice overwritten with garbage no longer names usable instances
                name = meta.get("name") if isinstance(meta, dict) else None
                if isinstance(name, str):
                    slices.pop(name, None)
            else:
                slices[parsed[0]] = parsed[1]
        return version

    async def close(self) -> None:
        """Shut open watch connections down and release the API client."""
        for resp in list(self._open):
            _close_response(resp)
        self._open.clear()
        client, self._api_client, self._api = self._api_client, None, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
