"""The etcd instance registry against a real etcd on 127.0.0.1 (DOPD §V-C: instances metadata DB).

Each test uses its own LLMServe name, so they share one etcd per module; the restart test wipes etcd's data and
brings it back on the same port. Leases use a 2 s TTL (etcd's minimum with default timings) to stay fast.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any, Literal

import pytest

pytest.importorskip("aetcd", reason="aetcd is not installed (pip install aetcd)")

import aetcd  # noqa: E402

from fulcrum.cancellation import cancel_and_wait  # noqa: E402
from fulcrum.router.registry import InstanceRecord, instance_key  # noqa: E402
from fulcrum.router.registry_etcd import (  # noqa: E402
    EtcdRegistration,
    EtcdRegistry,
    RegistryUnavailableError,
    parse_endpoints,
)

from .servers import EtcdServer, etcd_server  # noqa: E402,F401  (etcd_server is a fixture)

NS = "tests"
TTL_S = 2


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run an async scenario; fail when it leaves tasks of its own behind (gRPC's internal ones aside)."""

    async def main() -> None:
        await scenario()
        await asyncio.sleep(0.05)  # let gRPC finish closing its calls
        leaked = [
            t for t in asyncio.all_tasks()
            if t is not asyncio.current_task() and "grpc" not in repr(t.get_coro())
        ]
        assert not leaked, f"tasks left running: {leaked}"

    asyncio.run(main())


class Watcher:
    """Iterates ``registry.watch()`` in a task and keeps every list it yields."""

    def __init__(self, registry: EtcdRegistry) -> None:
        self.lists: list[list[InstanceRecord]] = []
        self._event = asyncio.Event()
        self._task = asyncio.create_task(self._consume(registry))

    async def _consume(self, registry: EtcdRegistry) -> None:
        async for records in registry.watch():
            self.lists.append(records)
            self._event.set()

    def ids(self) -> list[str] | None:
        return [r.id for r in self.lists[-1]] if self.lists else None

    async def wait_for(self, predicate: Callable[[list[str]], bool], timeout_s: float) -> float:
        """Wait until the latest list's ids satisfy ``predicate``; returns the seconds waited."""
        start = time.monotonic()
        deadline = start + timeout_s
        while True:
            ids = self.ids()
            if ids is not None and predicate(ids):
                return time.monotonic() - start
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"watch did not reach the expected state in {timeout_s} s; lists: {self.lists}")
            self._event.clear()
            try:
                await asyncio.wait_for(self._event.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    @property
    def running(self) -> bool:
        return not self._task.done()

    async def stop(self) -> None:
        await cancel_and_wait([self._task])  # the watch's calls can swallow one cancel (Python 3.11 wait_for)


def record(instance_id: str, role: Literal["prefill", "decode", "both"] = "both") -> InstanceRecord:
    return InstanceRecord(id=instance_id, url=f"http://127.0.0.1:9/{instance_id}", role=role, pool="p", tp=1)


def test_endpoints_parse_with_scheme_default_port_and_lists() -> None:
    assert parse_endpoints("http://127.0.0.1:23790") == [("127.0.0.1", 23790)]
    assert parse_endpoints("etcd, etcd-1:2380") == [("etcd", 2379), ("etcd-1", 2380)]
    assert parse_endpoints("[::1]:2381") == [("::1", 2381)]
    with pytest.raises(ValueError):
        parse_endpoints("etcd:notaport")
    with pytest.raises(ValueError):
        parse_endpoints(" , ")


def test_a_registered_worker_appears_in_the_watch_and_leaves_when_it_stops(etcd_server: EtcdServer) -> None:
    async def scenario() -> None:
        registry = EtcdRegistry(etcd_server.endpoint, NS, "appear")
        watcher = Watcher(registry)
        await watcher.wait_for(lambda ids: ids == [], 5)  # the full (empty) list comes first

        a = EtcdRegistration(etcd_server.endpoint, NS, "appear", record("worker-a", "prefill"), ttl_s=TTL_S)
        b = EtcdRegistration(etcd_server.endpoint, NS, "appear", record("worker-b", "decode"), ttl_s=TTL_S)
        assert await a.start() and await b.start()
        assert a.key == instance_key(NS, "appear", "worker-a")
        await watcher.wait_for(lambda ids: ids == ["worker-a", "worker-b"], 5)
        snap = await registry.snapshot()
        assert [(r.id, r.role) for r in snap] == [("worker-a", "prefill"), ("worker-b", "decode")]

        # keepalive works: still registered after twice the TTL
        await asyncio.sleep(2 * TTL_S)
        assert [r.id for r in await registry.snapshot()] == ["worker-a", "worker-b"]

        # an update is seen by the watch (same key, same lease)
        await a.update(record("worker-a", "both"))
        await watcher.wait_for(lambda ids: True, 1)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and watcher.lists[-1][0].role != "both":
            await asyncio.sleep(0.05)
        assert watcher.lists[-1][0].role == "both"

        # stop() revokes the lease: the key goes at once, not after the TTL
        started = time.monotonic()
        await a.stop()
        await watcher.wait_for(lambda ids: ids == ["worker-b"], 5)
        assert time.monotonic() - started < 1.0
        assert a.lease_id is None and not a.registered

        await b.stop()
        await watcher.wait_for(lambda ids: ids == [], 5)
        await watcher.stop()
        await registry.close()

    run(scenario)


_DEAD_WORKER = """
import asyncio, sys
from fulcrum.router.registry import InstanceRecord
from fulcrum.router.registry_etcd import EtcdRegistration

async def main():
    reg = EtcdRegistration(sys.argv[1], sys.argv[2], sys.argv[3], InstanceRecord(id="doomed", url="http://x:1"),
                           ttl_s=int(sys.argv[4]))
    ok = await reg.start()
    print("registered" if ok else "failed", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_a_worker_that_dies_without_deregistering_disappears_after_its_ttl(etcd_server: EtcdServer) -> None:
    async def scenario() -> None:
        registry = EtcdRegistry(etcd_server.endpoint, NS, "dead")
        watcher = Watcher(registry)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _DEAD_WORKER, etcd_server.endpoint, NS, "dead", str(TTL_S),
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
            assert line.strip() == b"registered"
            await watcher.wait_for(lambda ids: ids == ["doomed"], 5)
            await asyncio.sleep(1.5 * TTL_S)  # alive: its keepalive holds the key past the TTL
            assert watcher.ids() == ["doomed"]
            proc.kill()  # SIGKILL: no revoke, no more keepalives
            await proc.wait()
            killed = time.monotonic()
            await watcher.wait_for(lambda ids: ids == [], TTL_S + 3)
            gone_after = time.monotonic() - killed
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        # the last refresh was at most TTL/3 before the kill, and etcd checks expiries every 0.5 s
        assert 0.3 < gone_after < TTL_S + 2, gone_after
        await watcher.stop()
        await registry.close()

    run(scenario)


def test_malformed_values_under_the_prefix_are_skipped_with_a_log(
    etcd_server: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="fulcrum.router.registry_etcd")
    prefix = f"/fulcrum/{NS}/junk/instances/"

    async def scenario() -> None:
        host, port = parse_endpoints(etcd_server.endpoint)[0]
        async with aetcd.Client(host=host, port=port) as raw:
            await raw.put((prefix + "not-json").encode(), b"{oops")
            await raw.put((prefix + "no-url").encode(), b'{"id": "no-url"}')
            await raw.put((prefix + "good").encode(), record("good").to_json().encode())
            registry = EtcdRegistry(etcd_server.endpoint, NS, "junk")
            assert [r.id for r in await registry.snapshot()] == ["good"]
            watcher = Watcher(registry)
            await watcher.wait_for(lambda ids: ids == ["good"], 5)
            # garbage arriving through the watch is skipped too, and the watch goes on
            await raw.put((prefix + "list").encode(), b"[1, 2]")
            await raw.put((prefix + "bytes").encode(), b"\xff\xfe")
            await raw.put((prefix + "later").encode(), record("later").to_json().encode())
            await watcher.wait_for(lambda ids: ids == ["good", "later"], 5)
            # a good key overwritten with garbage leaves the list
            await raw.put((prefix + "good").encode(), b"garbage")
            await watcher.wait_for(lambda ids: ids == ["later"], 5)
            assert watcher.running
            await watcher.stop()
            await registry.close()
            await raw.delete_prefix(prefix.encode())

    run(scenario)
    skipped = {m for m in caplog.messages if "malformed" in m}
    for key in ("not-json", "no-url", "list", "bytes", "good"):
        assert any(prefix + key in m for m in skipped), (key, skipped)


def test_after_an_etcd_restart_with_empty_data_the_registration_comes_back(etcd_server: EtcdServer) -> None:
    async def scenario() -> None:
        registry = EtcdRegistry(etcd_server.endpoint, NS, "restart", backoff_max_s=0.5)
        watcher = Watcher(registry)
        reg = EtcdRegistration(etcd_server.endpoint, NS, "restart", record("phoenix"), ttl_s=TTL_S,
                               backoff_max_s=0.5)
        assert await reg.start()
        first_lease = reg.lease_id
        await watcher.wait_for(lambda ids: ids == ["phoenix"], 5)

        etcd_server.kill()
        try:
            with pytest.raises(RegistryUnavailableError):
                await registry.snapshot()
            await asyncio.sleep(1.0)  # both sides fail and retry meanwhile, without raising
            assert watcher.running
            assert not reg.registered
            assert watcher.ids() == ["phoenix"]  # the router keeps the last list it saw
        finally:
            await asyncio.to_thread(etcd_server.start, True)  # same port, empty data: the old lease is gone

        # the worker re-creates its key under a new lease in the new (empty) etcd
        deadline = time.monotonic() + 10
        while not (reg.registered and await _ids_or_none(registry) == ["phoenix"]):
            assert time.monotonic() < deadline, "the registration did not come back within 10 s"
            await asyncio.sleep(0.1)
        assert reg.lease_id != first_lease
        # the router's watch follows the new etcd: it sees the key, and then its removal
        await watcher.wait_for(lambda ids: ids == ["phoenix"], 5)
        await reg.stop()
        await watcher.wait_for(lambda ids: ids == [], 5)
        assert watcher.running
        await watcher.stop()
        await registry.close()

    run(scenario)


async def _ids_or_none(registry: EtcdRegistry) -> list[str] | None:
    try:
        return [r.id for r in await registry.snapshot()]
    except RegistryUnavailableError:
        return None


def test_registration_is_not_fatal_when_etcd_is_unreachable_at_start() -> None:
    from .servers import free_port

    sleeps: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        sleeps.append(seconds)
        await asyncio.sleep(0.01)

    async def scenario() -> None:
        reg = EtcdRegistration(f"127.0.0.1:{free_port()}", NS, "nowhere", record("lonely"), ttl_s=TTL_S,
                               backoff_initial_s=0.1, backoff_max_s=0.4, sleep=fake_sleep)
        assert await reg.start() is False
        while len(sleeps) < 5:
            await asyncio.sleep(0.01)
        await reg.stop()
        assert not reg.registered

    run(scenario)
    # capped exponential backoff (±20 % jitter): 0.1, 0.2, 0.4, 0.4, ...
    assert 0.08 <= sleeps[0] <= 0.12 and 0.16 <= sleeps[1] <= 0.24
    assert all(s <= 0.4 for s in sleeps) and max(sleeps) >= 0.32
