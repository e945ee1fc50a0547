"""The etcd instance registry against a real etcd (tests/integration/servers.py; skips when the binary is absent):
records whose fields have the wrong JSON types, a watch that outlives a compaction and an etcd restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aetcd", reason="aetcd is not installed (pip install aetcd)")

import aetcd  # noqa: E402

from fulcrum.cancellation import cancel_and_wait  # noqa: E402
from fulcrum.router.registry import InstanceRecord, instance_key  # noqa: E402
from fulcrum.router.registry_etcd import EtcdRegistry  # noqa: E402

from integration.servers import EtcdServer, find_binary  # noqa: E402

NS = "w2"


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """An etcd of this test only (some tests restart it); always stopped."""
    binary = find_binary("etcd", "FULCRUM_ETCD_BIN")
    if binary is None:
        pytest.skip("etcd binary not found: run scripts/install-servers.sh (Debian package etcd-server)")
    server = EtcdServer(binary, tmp_path)
    try:
        server.start()
        yield server
    finally:
        server.stop()


def _client(server: EtcdServer) -> Any:
    return aetcd.Client(host="127.0.0.1", port=server.port)


BAD_VALUES: dict[str, dict[str, Any]] = {
    "int-id": {"id": 5, "url": "http://127.0.0.1:9/a"},
    "list-url": {"id": "list-url", "url": ["http://127.0.0.1:9/a"]},
    "empty-url": {"id": "empty-url", "url": ""},
    "str-tp": {"id": "str-tp", "url": "http://127.0.0.1:9/b", "tp": "2"},
    "zero-tp": {"id": "zero-tp", "url": "http://127.0.0.1:9/b", "tp": 0},
    "bad-role": {"id": "bad-role", "url": "http://127.0.0.1:9/c", "role": "gpu"},
    "bool-port": {"id": "bool-port", "url": "http://127.0.0.1:9/c", "nixl_port": True},
    "list-labels": {"id": "list-labels", "url": "http://127.0.0.1:9/d", "labels": ["x"]},
    "null-pool": {"id": "null-pool", "url": "http://127.0.0.1:9/d", "pool": None},
}


def test_records_with_wrongly_typed_fields_are_skipped_not_fatal(
        etcd: EtcdServer, caplog: pytest.LogCaptureFixture) -> None:
    good = InstanceRecord(id="good", url="http://127.0.0.1:9/good", role="decode", pool="p", tp=2,
                          labels={"zone": "a"})

    async def scenario() -> None:
        client = _client(etcd)
        registry = EtcdRegistry(etcd.endpoint, NS, "types", backoff_max_s=0.2)
        try:
            await client.put(instance_key(NS, "types", "good").encode(),
                             (good.to_json()[:-1] + ', "future_field": {"x": 1}}').encode())
            for key, value in BAD_VALUES.items():
                await client.put(instance_key(NS, "types", key).encode(), json.dumps(value).encode())
            assert await registry.snapshot() == [good]

            async def first() -> list[InstanceRecord]:
                async for records in registry.watch():
                    return records
                raise AssertionError("watch ended")

            assert await asyncio.wait_for(first(), 10) == [good]
        finally:
            await registry.close()
            await client.close()

    with caplog.at_level(logging.WARNING, logger="fulcrum.router.registry_etcd"):
        asyncio.run(scenario())
    skipped = [r.getMessage() for r in caplog.records if "skipping malformed value" in r.getMessage()]
    assert any("int-id" in m and "'id'" in m for m in skipped), skipped
    assert any("str-tp" in m and "'tp'" in m for m in skipped), skipped
    assert any("bad-role" in m and "'role'" in m for m in skipped), skipped


def test_a_watched_key_overwritten_with_a_wrongly_typed_record_leaves_and_the_watch_goes_on(etcd: EtcdServer) -> None:
    async def scenario() -> None:
        client = _client(etcd)
        registry = EtcdRegistry(etcd.endpoint, NS, "overwrite", backoff_max_s=0.2)
        lists: list[list[str]] = []
        changed = asyncio.Event()

        async def consume() -> None:
            async for records in registry.watch():
                lists.append([r.id for r in records])
                changed.set()

        async def until(ids: list[str]) -> None:
            deadline = time.monotonic() + 10
            while not lists or lists[-1] != ids:
                assert time.monotonic() < deadline, lists
                changed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(changed.wait(), 0.1)

        for name in ("a", "b"):
            await client.put(instance_key(NS, "overwrite", name).encode(),
                             InstanceRecord(id=name, url=f"http://127.0.0.1:9/{name}").to_json().encode())
        task = asyncio.create_task(consume())
        try:
            await until(["a", "b"])
            await client.put(instance_key(NS, "overwrite", "a").encode(), b'{"id": "a", "url": 7}')
            await until(["b"])
            await client.put(instance_key(NS, "overwrite", "c").encode(),
                             InstanceRecord(id="c", url="http://127.0.0.1:9/c").to_json().encode())
            await until(["b", "c"])
        finally:
            await cancel_and_wait([task])
            await registry.close()
            await client.close()

    asyncio.run(scenario())
