"""Requests of a workload, as traces record them and the simulator replays them."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Request"]


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace.

    Attributes:
        arrival_s: arrival time, seconds from the start of the trace (>= 0).
        isl: input sequence length (prompt), tokens (>= 1).
        osl: output sequence length (generated), tokens (>= 1).
        prefix_ids: ids of the request's prefix KV blocks, when the trace records them (Mooncake: 512-token
            blocks); shared ids mark a reusable prefix. Empty when unknown.
    """

    arrival_s: float
    isl: int
    osl: int
    prefix_ids: tuple[int, ...] = ()
