"""What the planner asks the cluster to become: pool sizes and the router's split-policy parameters.

Both the operator (Deployments and the router ConfigMap) and the simulator (in ``fulcrum replay``) apply a
:class:`ClusterTarget`. Pools are named by :class:`Pool`, never by string: ``target.pool(Pool.DECODE)``,
``target.with_pool(Pool.DECODE, size)``, ``for pool in Pool``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum

__all__ = ["Pool", "PoolSize", "RoutingParams", "ClusterTarget", "plan_role_bounds", "role_bounds"]


class Pool(str, Enum):
    """The three worker pools of an LLMServe (iteration order: prefill, decode, unified).

    - ``PREFILL``: prefill-only instances (Disaggregated mode; vLLM ``kv_producer``);
    - ``DECODE``: decode instances that also prefill ultra-short prompts locally (``kv_consumer``);
    - ``UNIFIED``: instances doing chunked prefill and decode (Unified mode; ``kv_both``).

    A ``str`` enum: ``Pool.DECODE == "decode"``, and ``str(pool)`` is its value (labels, status keys, metrics).
    """

    PREFILL = "prefill"
    DECODE = "decode"
    UNIFIED = "unified"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def disaggregated(cls) -> tuple[Pool, Pool]:
        """The pools of Disaggregated mode: (PREFILL, DECODE)."""
        return cls.PREFILL, cls.DECODE


@dataclass(frozen=True)
class PoolSize:
    """Instances of one pool and the tensor-parallel size of each (GPUs = replicas × tp)."""

    replicas: int = 0
    tp: int = 1

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {self.replicas}")
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")

    @property
    def gpus(self) -> int:
        """GPUs the pool uses."""
        return self.replicas * self.tp


@dataclass(frozen=True)
class RoutingParams:
    """Per-request split policy parameters the router (and the simulator's router) apply.

    Attributes:
        ultra_short_tokens: prompts of at most this many tokens are prefilled locally on a decode instance
            (no KV transfer): where the transfer costs more than a local prefill (DOPD §II-C, §V-E).
        long_request_tokens: i_next of DOPD Alg. 1: a prompt at least this long is prefilled at once; shorter
            ones are grouped until their total reaches it or ``batch_timeout_s`` passes.
        batch_timeout_s: longest a short prompt waits to be grouped (DOPD eq. 18), seconds.
        length_aware_batching: DOPD Alg. 1 when true, first-come-first-served prefill batches otherwise.
        max_prefill_batch_tokens: token budget of one prefill batch.
        prefill_share: in Unified mode, the share of the pool's instances the plan expects on prefill duty,
            r / (1 + r) with r DOPD eq. (15)'s n_p/n_d = cc_d·t_p/(t_d·OSL) at the unified TP; the bounds of the
            router's role reassignment are drawn around it (:func:`fulcrum.target.role_bounds`). None: no plan
            for duties (Disaggregated mode, or a plan without decode capacity).
        decode_concurrency: in Unified mode, the most requests one instance of the pool decodes within the TPOT
            SLO at the forecast lengths (cc of DOPD eqs. 11–14 with the profiled TPOT check): the router's role
            reassignment counts a decode-duty instance's compute as full there (eq. 32's C_max,
            :func:`fulcrum.rebalancing.duties.decode_utilisation`). None: not planned (the engine's
            ``max_num_seqs`` stands in).
    """

    ultra_short_tokens: int = 0
    long_request_tokens: int = 2048
    batch_timeout_s: float = 0.0
    length_aware_batching: bool = False
    max_prefill_batch_tokens: int = 8192
    prefill_share: float | None = None
    decode_concurrency: int | None = None


@dataclass(frozen=True)
class ClusterTarget:
    """Desired pools. In Disaggregated mode ``unified`` is empty; in Unified mode ``prefill``/``decode`` are."""

    prefill: PoolSize = field(default_factory=PoolSize)
    decode: PoolSize = field(default_factory=PoolSize)
    unified: PoolSize = field(default_factory=PoolSize)
    routing: RoutingParams = field(default_factory=RoutingParams)

    @property
    def gpus(self) -> int:
        """GPUs all pools use."""
        return self.prefill.gpus + self.decode.gpus + self.unified.gpus

    def pool(self, pool: Pool) -> PoolSize:
        """The size of ``pool``."""
        if pool is Pool.PREFILL:
            return self.prefill
        if pool is Pool.DECODE:
            return self.decode
        return self.unified

    def with_pool(self, pool: Pool, size: PoolSize) -> ClusterTarget:
        """A copy with ``pool`` set to ``size`` (routing and the other pools kept)."""
        if pool is Pool.PREFILL:
            return replace(self, prefill=size)
        if pool is Pool.DECODE:
            return replace(self, decode=size)
        return replace(self, unified=size)

    def with_replicas(self, pool: Pool, replicas: int) -> ClusterTarget:
        """A copy with ``pool``'s instance count set to ``replicas`` (its TP kept).

        Raises:
            ValueError: ``replicas`` < 0.
        """
        return self.with_pool(pool, PoolSize(replicas, self.pool(pool).tp))

    def pools(self) -> Iterator[tuple[Pool, PoolSize]]:
        """``(pool, size)`` for every pool, in :class:`Pool` order."""
        return ((p, self.pool(p)) for p in Pool)

    def same_pools(self, other: ClusterTarget) -> bool:
        """Whether ``other`` has the same pool sizes and TPs (routing parameters not compared)."""
        return all(self.pool(p) == other.pool(p) for p in Pool)

    @classmethod
    def of(cls, pools: Mapping[Pool, PoolSize], routing: RoutingParams | None = None) -> ClusterTarget:
        """A target from ``pool → size`` (pools left out are empty) and the routing parameters (default ones)."""
        empty = PoolSize()
        return cls(prefill=pools.get(Pool.PREFILL, empty), decode=pools.get(Pool.DECODE, empty),
                   unified=pools.get(Pool.UNIFIED, empty), routing=routing or RoutingParams())


def plan_role_bounds(target: ClusterTarget) -> tuple[int, int, int, int] | None:
    """The bounds the operator writes for the router's role reassignment under ``target``: :func:`role_bounds` of
    its unified pool at the plan's prefill share when the pool has two instances or more; None otherwise (the
    router's defaults then hold: one instance per duty at least)."""
    if target.unified.replicas < 2:
        return None
    return role_bounds(target.unified.replicas, target.routing.prefill_share)


def role_bounds(instances: int, prefill_share: float | None, spread: float = 2.0) -> tuple[int, int, int, int]:
    """Instances per duty role reassignment may use in a pool of ``instances`` ``both`` instances:
    ``(min_prefill, max_prefill, min_decode, max_decode)``.

    The plan expects ``n_p* = instances · prefill_share`` on prefill duty (DOPD eq. 15 at the forecast lengths);
    the router may move the split within a factor ``spread`` of it — ``[⌊n_p*/spread⌋, ⌈n_p*·spread⌉]`` — as
    load drifts inside the interval (BanaServe Alg. 1), always leaving one instance on each duty. Without a
    share (None) only that last rule holds. A pool of fewer than two instances cannot split: (0, n, 0, n).

    Raises:
        ValueError: negative ``instances``, a share outside [0, 1], or ``spread < 1``.
    """
    if instances < 0 or spread < 1.0 or (prefill_share is not None and not 0.0 <= prefill_share <= 1.0):
        raise ValueError(f"bad role bounds input: instances={instances}, share={prefill_share}, spread={spread}")
    if instances < 2:
        return 0, instances, 0, instances
    lo, hi = 1, instances - 1
    if prefill_share is not None:
        target = instances * prefill_share
        lo = min(max(lo, math.floor(target / spread)), hi)
        hi = max(lo, min(hi, math.ceil(target * spread)))
    return lo, hi, instances - hi, instances - lo
