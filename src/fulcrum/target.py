"""What the planner asks the cluster to become: pool sizes and the router's split-policy parameters.

Both the operator (Deployments and the router ConfigMap) and the simulator (in ``fulcrum replay``) apply a
:class:`ClusterTarget`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["PoolSize", "RoutingParams", "ClusterTarget", "role_bounds"]


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
    """

    ultra_short_tokens: int = 0
    long_request_tokens: int = 2048
    batch_timeout_s: float = 0.0
    length_aware_batching: bool = False
    max_prefill_batch_tokens: int = 8192
    prefill_share: float | None = None


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
