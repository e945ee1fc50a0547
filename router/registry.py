"""Instance registry contract: where the router learns which worker instances exist.

Implementations: a static list (``StaticRegistry``, from the router config), etcd under leases
(``fulcrum.router.registry_etcd``: workers register themselves, a lease's expiry removes a dead worker), and
Kubernetes endpoints. The router only reads through :class:`Registry`.

Key layout in etcd (shared with the worker, which writes it): ``/fulcrum/<namespace>/<llmserve>/instances/<id>``
→ the JSON of :class:`InstanceRecord`, attached to the worker's lease.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

__all__ = ["InstanceRecord", "Registry", "StaticRegistry", "instance_key", "instance_prefix"]


@dataclass(frozen=True, slots=True)
class InstanceRecord:
    """One registered instance.

    Attributes:
        id: unique id (pod name in a cluster).
        url: base URL of its OpenAI-compatible server, e.g. ``http://10.0.0.5:8000``.
        role: "prefill" | "decode" | "both" (``kv_both``: the router chooses per request).
        pool: the pool (Deployment) it belongs to, e.g. ``decode-tp2``.
        tp: tensor-parallel size.
        gpu_type: GPU type, e.g. ``H100``.
        nixl_host: host of its NIXL side channel ("" when it has no KV connector).
        nixl_port: port of its NIXL side channel (0 when none).
        max_concurrency: the engine's ``max_num_seqs``.
        max_num_batched_tokens: the engine's per-step token budget.
        kv_capacity_tokens: KV cache capacity, tokens (0 = unknown).
        model: served model name.
        labels: free-form labels.
    """

    id: str
    url: str
    role: Literal["prefill", "decode", "both"] = "both"
    pool: str = "default"
    tp: int = 1
    gpu_type: str = ""
    nixl_host: str = ""
    nixl_port: int = 0
    max_concurrency: int = 256
    max_num_batched_tokens: int = 8192
    kv_capacity_tokens: int = 0
    model: str = ""
    labels: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        """JSON text (the etcd value)."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> "InstanceRecord":
        """Parse an etcd value; unknown keys are ignored (newer workers), missing ones take defaults.

        Raises:
            ValueError: not JSON, not an object, or without ``id``/``url``.
        """
        data: Any = json.loads(text)
        if not isinstance(data, dict) or "id" not in data or "url" not in data:
            raise ValueError("instance record must be a JSON object with 'id' and 'url'")
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


def instance_prefix(namespace: str, llmserve: str) -> str:
    """The etcd key prefix of one LLMServe's instances."""
    return f"/fulcrum/{namespace}/{llmserve}/instances/"


def instance_key(namespace: str, llmserve: str, instance_id: str) -> str:
    """The etcd key of one instance."""
    return instance_prefix(namespace, llmserve) + instance_id


class Registry(Protocol):
    """Read side of the instance registry."""

    async def snapshot(self) -> list[InstanceRecord]:
        """All instances registered now."""
        ...

    def watch(self) -> AsyncIterator[list[InstanceRecord]]:
        """Yields the full instance list at start and after every change, until cancelled."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


class StaticRegistry:
    """A fixed instance list (from the router config or command line)."""

    def __init__(self, records: Sequence[InstanceRecord]) -> None:
        self._records = list(records)
        self._changed = asyncio.Event()

    async def snapshot(self) -> list[InstanceRecord]:
        return list(self._records)

    def replace(self, records: Sequence[InstanceRecord]) -> None:
        """Swap the list (config reload) and wake watchers."""
        self._records = list(records)
        self._changed.set()

    async def watch(self) -> AsyncIterator[list[InstanceRecord]]:
        yield list(self._records)
        while True:
            await self._changed.wait()
            self._changed.clear()
            yield list(self._records)

    async def close(self) -> None:
        return None
