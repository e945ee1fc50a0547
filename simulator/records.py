"""Per-request records the simulator writes (placeholder shape; the simulator module fills this in)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RequestRecord"]


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
