"""What the planner asks the cluster to become: pool sizes and the router's split-policy parameters.

Both the operator (Deployments and the router ConfigMap) and the simulator (in ``fulcrum replay``) apply a
:class:`ClusterTarget`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["PoolSize", "RoutingParams", "ClusterTarget"]


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
    """

    ultra_short_tokens: int = 0
    long_request_tokens: int = 2048
    batch_timeout_s: float = 0.0
    length_aware_batching: bool = False
    max_prefill_batch_tokens: int = 8192


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
