"""The instance registry in etcd: workers register under a lease, the router watches the prefix (DOPD §V-C).

DOPD §V-C ("Connector") keeps "an instances metadata DB ... implemented as an etcd service that registers the IDs
of all P-instances and D-instances together with the addresses of their KV-cache blocks". Fulcrum keeps one key
per instance, attached to that worker's lease, so liveness is the lease: a worker that dies stops refreshing it
and etcd deletes the key after the TTL.

- :class:`EtcdRegistration` (worker side): grants a lease, puts the :class:`~fulcrum.router.registry.InstanceRecord`
  under :func:`~fulcrum.router.registry.instance_key` attached to it, refreshes the lease every TTL/3 in a
  background task; ``stop()`` revokes the lease (the key goes at once). etcd unreachable is never fatal: it is
  logged and retried with capped exponential backoff; after an outage the key is put again under a new lease.
- :class:`EtcdRegistry` (router side, the :class:`~fulcrum.router.registry.Registry` protocol): ``snapshot()``
  reads the prefix; ``watch()`` yields the full list at start and after every change, resynchronises with a full
  read after any error, and keeps retrying (never raising into the router) while etcd is away.

Client: ``aetcd`` (asyncio, gRPC, maintained), not ``etcd3`` 0.12 (2020), whose generated protobuf modules fail
to import with protobuf >= 4 unless the whole process switches to the pure-Python protobuf implementation.
See docs/connectors.md.

Errors::

    FulcrumError
    └── RegistryUnavailableError   etcd could not be read (snapshot only; watch and registration retry)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aetcd  # type: ignore[import-untyped]

from fulcrum.cancellation import cancel_and_wait
from fulcrum.errors import FulcrumError
from fulcrum.router.registry import InstanceRecord, instance_key, instance_prefix
from fulcrum.router.backoff import Backoff

__all__ = ["EtcdRegistration", "EtcdRegistry", "RegistryUnavailableError", "parse_endpoints"]

log = logging.getLogger(__name__)

Sleep = Callable[[float], Awaitable[None]]

DEFAULT_PORT = 2379

# gRPC keepalive on the channel: a silently dead connection (node gone, no RST) is noticed within ~15 s instead
# of never for a long-lived watch stream. etcd's default --grpc-keepalive-min-time is 5 s; pinging more often
# than that gets the connection closed with "too_many_pings", so 10 s.
_CHANNEL_OPTIONS: dict[str, Any] = {
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
}


class RegistryUnavailableError(FulcrumError):
    """etcd could not be read (unreachable, timed out, or refused the request); the cause is chained."""


def parse_endpoints(endpoint: str) -> list[tuple[str, int]]:
    """Parse ``"host:port"``, ``"http://host:port"`` or a comma-separated list of them into ``(host, port)``.

    A missing port means 2379. IPv6 hosts are written in brackets (``[::1]:2379``).

    Raises:
        ValueError: empty, or a port that is not an integer in 1..65535.
    """
    result: list[tuple[str, int]] = []
    for raw in endpoint.split(","):
        item = raw.strip()
        if not item:
            continue
        for scheme in ("http://", "https://"):
            if item.startswith(scheme):
                item = item[len(scheme):]
        item = item.rstrip("/")
        if item.startswith("["):
            host, _, rest = item[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else ""
        elif item.count(":") == 1:
            host, _, port_text = item.partition(":")
        else:
            host, port_text = item, ""
        try:
            port = int(port_text) if port_text else DEFAULT_PORT
        except ValueError as exc:
            raise ValueError(f"bad etcd endpoint {raw!r}: port is not an integer") from exc
        if not host or not 1 <= port <= 65535:
            raise ValueError(f"bad etcd endpoint {raw!r}")
        result.append((host, port))
    if not result:
        raise ValueError("no etcd endpoint given")
    return result


class _Endpoints:
    """Round-robin over the configured etcd endpoints; one new aetcd client per (re)connection."""

    def __init__(self, endpoint: str, rpc_timeout_s: float) -> None:
        self.endpoints = parse_endpoints(endpoint)
        self.rpc_timeout_s = rpc_timeout_s
        self._index = 0

    def client(self) -> Any:
        host, port = self.endpoints[self._index % len(self.endpoints)]
        return aetcd.Client(host=host, port=port, timeout=self.rpc_timeout_s, options=dict(_CHANNEL_OPTIONS))

    def rotate(self) -> None:
        """Try the next endpoint at the next connection (after a failure)."""
        self._index += 1

    def __str__(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)


async def _close_quietly(client: Any) -> None:
    """Close an aetcd client; errors while closing a dead connection are not interesting."""
    with contextlib.suppress(Exception):
        await client.close()


_STR_FIELDS = ("id", "url", "pool", "gpu_type", "nixl_host", "model")
_COUNT_FIELDS = ("nixl_port", "max_concurrency", "max_num_batched_tokens", "kv_capacity_tokens")
_ROLES = ("prefill", "decode", "both")


def _json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {str: "a string", int: "an integer", float: "a number", list: "an array", dict: "an object"}.get(
        type(value), type(value).__name__)


def _check_record(record: InstanceRecord) -> None:
    """Check the types and ranges of a record decoded from JSON (which ``from_json`` takes as they come).

    Raises:
        ValueError: a field of the wrong JSON type (``id``: 5), an empty ``id``/``url``, a ``role`` other than
            prefill/decode/both, a ``tp`` below 1 or a negative count; the message names the field.
    """
    for name in _STR_FIELDS:
        value = getattr(record, name)
        if not isinstance(value, str):
            raise ValueError(f"field {name!r} is {_json_type(value)}, not a string")
    if not record.id or not record.url:
        raise ValueError("fields 'id' and 'url' must not be empty")
    if record.role not in _ROLES:
        raise ValueError(f"field 'role' is {record.role!r}, not one of {', '.join(_ROLES)}")
    for name in ("tp", *_COUNT_FIELDS):
        value = getattr(record, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"field {name!r} is {_json_type(value)}, not an integer")
        if value < (1 if name == "tp" else 0):
            raise ValueError(f"field {name!r} is {value}, must be >= {1 if name == 'tp' else 0}")
    if not isinstance(record.labels, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in record.labels.items()):
        raise ValueError("field 'labels' must be an object of strings")


def _parse_value(key: bytes, value: bytes) -> InstanceRecord | None:
    """The record in one etcd value, or None (logged) when the value is malformed: not JSON, not an object, no
    ``id``/``url``, or a field of the wrong type or range (:func:`_check_record`). Unknown fields are ignored."""
    try:
        record = InstanceRecord.from_json(value)
        _check_record(record)
        return record
    except (ValueError, TypeError) as exc:
        log.warning("registry: skipping malformed value under %s: %s", key.decode(errors="replace"), exc)
        return None


class EtcdRegistry:
    """Read side of the etcd instance registry (implements :class:`fulcrum.router.registry.Registry`).

    Args:
        endpoint: etcd client endpoint(s), ``"host:port"`` or ``"http://host:port"``, comma-separated for several
            (tried in turn after failures).
        namespace: Kubernetes namespace of the LLMServe.
        llmserve: LLMServe name. Keys read: ``/fulcrum/<namespace>/<llmserve>/instances/*``.
        rpc_timeout_s: deadline of each etcd request, seconds. 5 s: long enough for a loaded etcd, short enough
            that a hung etcd does not stall a snapshot.
        backoff_initial_s: first retry delay of ``watch`` after a failure, seconds (doubles each retry).
        backoff_max_s: retry delay cap, seconds. 5 s: an etcd restart is noticed within seconds without
            hammering an etcd that is down.
        sleep: the awaitable sleep used between retries (injectable for tests).

    Malformed values under the prefix (not JSON, no ``id``/``url``) are skipped with a warning, never raised.
    Records are returned sorted by ``id``.
    """

    def __init__(
        self,
        endpoint: str,
        namespace: str,
        llmserve: str,
        *,
        rpc_timeout_s: float = 5.0,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 5.0,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self._endpoints = _Endpoints(endpoint, rpc_timeout_s)
        self._prefix = instance_prefix(namespace, llmserve).encode()
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        Backoff(backoff_initial_s, backoff_max_s)  # validate now, not at the first failure
        self._sleep = sleep
        self._client: Any = None  # shared by snapshot(); each watch() has its own

    @property
    def prefix(self) -> str:
        """The key prefix read, e.g. ``/fulcrum/default/llama/instances/``."""
        return self._prefix.decode()

    async def _read(self, client: Any) -> tuple[dict[bytes, InstanceRecord], int]:
        """All parsable records under the prefix, by key, and the store revision of the read."""
        result = await client.get_prefix(self._prefix)
        records: dict[bytes, InstanceRecord] = {}
        for kv in result:
            record = _parse_value(kv.key, kv.value)
            if record is not None:
                records[kv.key] = record
        return records, int(result.header.revision)

    async def snapshot(self) -> list[InstanceRecord]:
        """All instances registered now, sorted by id.

        Raises:
            RegistryUnavailableError: etcd unreachable or the request failed (the aetcd error is chained).
        """
        if self._client is None:
            self._client = self._endpoints.client()
        try:
            records, _ = await self._read(self._client)
        except Exception as exc:  # aetcd raises ClientError subclasses, grpc/OS errors may leak through
            client, self._client = self._client, None
            self._endpoints.rotate()
            await _close_quietly(client)
            raise RegistryUnavailableError(f"etcd at {self._endpoints} could not be read: {exc}") from exc
        return sorted(records.values(), key=lambda r: r.id)

    async def watch(self) -> AsyncIterator[list[InstanceRecord]]:
        """Yield the full instance list once connected, then after every change under the prefix, forever.

        After any error (etcd stopped, connection lost, revision compacted) the watch logs a warning, waits with
        capped exponential backoff, reads the prefix again and resumes from that read's revision; it yields the
        re-read list only when it differs from the last one yielded. While etcd is away nothing is yielded (the
        router keeps the last list it saw). Never raises except ``CancelledError``; closing the generator (or
        cancelling the task iterating it) releases its connection.
        """
        backoff = Backoff(self._backoff_initial_s, self._backoff_max_s)
        last: list[InstanceRecord] | None = None
        failures = 0
        while True:
            client = self._endpoints.client()
            try:
                records, revision = await self._read(client)
                current = sorted(records.values(), key=lambda r: r.id)
                if current != last:
                    last = current
                    yield current
                watch = await client.watch_prefix(self._prefix, start_revision=revision + 1)
                if failures:
                    log.info("registry: watching %s again from revision %d after %d failure(s)",
                             self.prefix, revision + 1, failures)
                failures = 0
                backoff.reset()
                try:
                    async for event in watch:
                        if self._apply(records, event):
                            current = sorted(records.values(), key=lambda r: r.id)
                            if current != last:
                                last = current
                                yield current
                finally:
                    with contextlib.suppress(Exception):
                        await watch.cancel()
                delay = backoff.next()
                log.warning("registry: watch on %s ended by etcd; resynchronising in %.1f s", self.prefix, delay)
            except Exception as exc:  # never raise into the router: log, back off, resync
                failures += 1
                delay = backoff.next()
                log.warning("registry: etcd at %s failed (%s: %s); retrying in %.1f s",
                            self._endpoints, type(exc).__name__, exc, delay)
                self._endpoints.rotate()
            finally:
                await _close_quietly(client)
            await self._sleep(delay)

    @staticmethod
    def _apply(records: dict[bytes, InstanceRecord], event: Any) -> bool:
        """Apply one watch event to ``records``; True when the map changed."""
        key: bytes = event.kv.key
        if event.kind == aetcd.EventKind.DELETE:
            return records.pop(key, None) is not None
        record = _parse_value(key, event.kv.value)
        if record is None:  # a key overwritten with garbage no longer names a usable instance
            return records.pop(key, None) is not None
        if records.get(key) == record:
            return False
        records[key] = record
        return True

    async def close(self) -> None:
        """Close the snapshot connection (each ``watch()`` closes its own when it ends)."""
        client, self._client = self._client, None
        if client is not None:
            await _close_quietly(client)


class EtcdRegistration:
    """Worker side: keep one instance's record in etcd under a lease while the worker lives.

    Args:
        endpoint: etcd endpoint(s), as for :class:`EtcdRegistry`.
        namespace: Kubernetes namespace of the LLMServe.
        llmserve: LLMServe name; the key is ``instance_key(namespace, llmserve, record.id)``.
        record: what to publish (its JSON is the value).
        ttl_s: lease TTL, seconds (integer, as etcd grants; etcd raises values below its minimum, about 2 s with
            default timings). 10 s: a dead worker leaves the router's list within 10 s, and a refresh every
            TTL/3 survives two lost refreshes.
        backoff_initial_s: first retry delay after a failure, seconds (doubles each retry).
        backoff_max_s: retry delay cap, seconds.
        sleep: the awaitable sleep used between refreshes and retries (injectable for tests).

    Lifecycle: ``await start()`` → registered (or retrying in the background) → ``await stop()`` revokes the
    lease, which deletes the key at once. A crash (no ``stop()``) lets the lease expire after ``ttl_s``.
    """

    def __init__(
        self,
        endpoint: str,
        namespace: str,
        llmserve: str,
        record: InstanceRecord,
        ttl_s: int = 10,
        *,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 5.0,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        if ttl_s < 1:
            raise ValueError("ttl_s must be >= 1 s")
        # each request must fail well within the TTL, so that a refresh can be retried before the lease expires
        self._endpoints = _Endpoints(endpoint, rpc_timeout_s=max(0.5, min(5.0, ttl_s / 3)))
        self._namespace = namespace
        self._llmserve = llmserve
        self._record = record
        self._ttl_s = int(ttl_s)
        self._backoff = Backoff(backoff_initial_s, backoff_max_s)
        self._sleep = sleep
        self._task: asyncio.Task[None] | None = None
        self._first_attempt = asyncio.Event()
        self._registered = False
        self._lease_id: int | None = None
        self._client: Any = None

    @property
    def key(self) -> str:
        """The etcd key of this instance."""
        return instance_key(self._namespace, self._llmserve, self._record.id)

    @property
    def registered(self) -> bool:
        """True while the key is believed present (last put/refresh succeeded)."""
        return self._registered

    @property
    def lease_id(self) -> int | None:
        """The current lease's id (None before the first grant and after ``stop()``)."""
        return self._lease_id

    async def start(self) -> bool:
        """Start registering in a background task and wait for the first attempt (at most one request deadline).

        Returns:
            True when the record is in etcd now; False when etcd was unreachable (the background task keeps
            retrying with backoff, and logs). Never raises for etcd failures.
        """
        if self._task is None or self._task.done():
            self._first_attempt.clear()
            self._task = asyncio.create_task(self._run(), name=f"etcd-registration:{self._record.id}")
        await self._first_attempt.wait()
        return self._registered

    async def update(self, record: InstanceRecord) -> None:
        """Replace the published record (same ``id``), under the current lease.

        When etcd is unreachable the new record is kept and put at the next (re-)registration.

        Raises:
            ValueError: ``record.id`` differs (a different instance needs its own registration).
        """
        if record.id != self._record.id:
            raise ValueError("update() keeps the instance id; register a new EtcdRegistration instead")
        self._record = record
        if self._registered and self._client is not None and self._lease_id is not None:
            try:
                await self._client.put(self.key.encode(), record.to_json().encode(), lease=self._lease_id)
            except Exception as exc:
                log.warning("registration %s: update not written now (%s); it will be at re-registration",
                            self.key, exc)

    async def stop(self) -> None:
        """Stop refreshing and revoke the lease (the key disappears at once). Never raises for etcd failures.

        When etcd cannot be reached the lease is left to expire by itself after ``ttl_s``.
        """
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait([task])
        lease_id, self._lease_id = self._lease_id, None
        self._registered = False
        client, self._client = self._client, None
        if lease_id is None:
            if client is not None:
                await _close_quietly(client)
            return
        client = client or self._endpoints.client()
        try:
            await client.revoke_lease(lease_id)
            log.info("registration %s: lease %x revoked", self.key, lease_id)
        except Exception as exc:
            log.warning("registration %s: could not revoke lease %x (%s); it expires within %d s",
                        self.key, lease_id, exc, self._ttl_s)
        finally:
            await _close_quietly(client)

    async def _run(self) -> None:
        """Register, refresh until the lease is lost or etcd fails, back off, register again; forever."""
        while True:
            client = self._endpoints.client()
            self._client = client
            try:
                await self._register(client)
                self._first_attempt.set()
                await self._keep_alive(client)
                log.warning("registration %s: lease %x expired; registering again", self.key, self._lease_id or 0)
                delay = self._backoff.initial_s
            except Exception as exc:  # never fatal: log, back off, try again
                self._registered = False
                delay = self._backoff.next()
                log.warning("registration %s: etcd at %s failed (%s: %s); retrying in %.1f s",
                            self.key, self._endpoints, type(exc).__name__, exc, delay)
                self._endpoints.rotate()
            finally:
                self._first_attempt.set()
            self._registered = False
            if self._client is client:
                self._client = None
            await _close_quietly(client)
            await self._sleep(delay)

    async def _register(self, client: Any) -> None:
        """Grant a new lease, put the record under it, revoke the previous lease if there was one."""
        old_lease = self._lease_id
        lease = await client.lease(self._ttl_s)
        self._lease_id = int(lease.id)
        await client.put(self.key.encode(), self._record.to_json().encode(), lease=lease.id)
        self._registered = True
        self._backoff.reset()
        log.info("registration %s: registered with lease %x (ttl %d s)", self.key, lease.id, int(lease.ttl))
        if old_lease is not None and old_lease != lease.id:
            # the key now belongs to the new lease; revoking the old one (if etcd still has it) deletes nothing
            with contextlib.suppress(Exception):
                await client.revoke_lease(old_lease)

    async def _keep_alive(self, client: Any) -> None:
        """Refresh the lease every TTL/3; return when etcd says it no longer exists, raise when etcd fails."""
        interval = self._ttl_s / 3.0
        while True:
            await self._sleep(interval)
            reply = await client.refresh_lease(self._lease_id)
            if reply is None or int(reply.TTL) <= 0:
                return
