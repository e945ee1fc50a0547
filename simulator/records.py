"""What the simulator reports: per-request records, and the state of an instance (for reports and tests)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RequestRecord", "InstanceStatus"]


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One served (or unserved) request. Times in seconds since the start of the run.

    Attributes:
        arrival_s: arrival time.
        isl: prompt tokens.
        osl: output tokens.
        ttft_s: time to first token (arrival → first token), seconds; ``inf`` if never served.
        tpot_s: mean time per output token after the first, seconds; 0 when osl == 1; ``inf`` if unfinished.
        finish_s: completion time; ``inf`` if never finished.
        path: "disaggregated" (P then D, KV transferred) | "local" (ultra-short prompt prefilled on the decode
            instance) | "unified" (one instance did both).
    """

    arrival_s: float
    isl: int
    osl: int
    ttft_s: float
    tpot_s: float
    finish_s: float
    path: str


@dataclass(frozen=True, slots=True)
class InstanceStatus:
    """One instance of the simulated cluster at a moment.

    Attributes:
        iid: instance id (creation order).
        role: "prefill" | "decode" | "unified".
        tp: tensor-parallel size (GPUs).
        state: "starting" | "ready" | "draining".
        running: requests in its batch (P: the prefill batch; D/unified: admitted, prefilling or decoding).
        waiting: requests in its own waiting queue (D/unified; 0 for P).
        kv_tokens: KV cache tokens held (D/unified; 0 for P).
        kv_capacity_tokens: KV cache capacity, tokens (D/unified; 0 for P).
        provisioned_at_s / ready_at_s: when it was provisioned and (to be) ready, seconds.
    """

    iid: int
    role: str
    tp: int
    state: str
    running: int
    waiting: int
    kv_tokens: float
    kv_capacity_tokens: float
    provisioned_at_s: float
    ready_at_s: float
