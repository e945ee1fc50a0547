"""What the simulator reports: per-request records, and the state of an instance (for reports and tests)."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["REJECTED", "exceeds_context", "output_within_context", "RequestRecord", "InstanceStatus",
           "DecodeRequestView", "DecodeInstanceView", "RoleView"]

#: ``RequestRecord.path`` of a request the router rejected: its prompt does not fit the model's context.
REJECTED = "rejected"


def exceeds_context(isl: int, max_model_len: int) -> bool:
    """Whether a prompt of ``isl`` tokens is rejected at admission: it is at least the model's context
    (``max_model_len`` tokens), which the router answers with 400 ``context_length_exceeded`` (router/app.py)."""
    return isl >= max_model_len


def output_within_context(isl: int, osl: int, max_model_len: int) -> int:
    """The output tokens an admitted prompt of ``isl`` tokens gets of the ``osl`` asked for: the engine stops at
    the context's end, ``max_model_len − isl`` tokens (vLLM's default ``max_tokens``). For a prompt that fits
    (not :func:`exceeds_context`) the result is ≥ 1."""
    return min(osl, max_model_len - isl)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One served (or unserved) request. Times in seconds since the start of the run.

    Attributes:
        arrival_s: arrival time.
        isl: prompt tokens.
        osl: output tokens: the trace's, or fewer where the context ends first (``max_model_len − isl``).
        ttft_s: time to first token (arrival → first token), seconds; ``inf`` if never served.
        tpot_s: mean time per output token after the first, seconds; 0 when osl == 1; ``inf`` if unfinished.
        finish_s: completion time; ``inf`` if never finished.
        path: the routing decision's kind and where it ran: "disaggregated" (A prefilled, B decoded, KV
            transferred) | "split" (Libra micro-requests: A prefilled the prompt head or the prompt and some
            tokens, B the rest) | "local" (colocated on a decode instance, e.g. an ultra-short prompt) |
            "unified" (colocated on a unified instance) | "rejected" (:data:`REJECTED`: the prompt is at least the
            model's context, ``max_model_len``, and the router answered 400; never served).
        queue_s: queueing time, arrival → start of its first prefill (the shared P queue and the router, or an
            engine's waiting queue for local and unified prompts), seconds; ``inf`` if its prefill never began.
        prefill_instance: id of the instance that (first) prefilled it; -1 if none did.
        decode_instance: id of the engine it finished on (the last, after a preemption or migration); -1 if
            unfinished, or finished on its P instance (one output token).
    """

    arrival_s: float
    isl: int
    osl: int
    ttft_s: float
    tpot_s: float
    finish_s: float
    path: str
    queue_s: float = math.inf
    prefill_instance: int = -1
    decode_instance: int = -1

    @property
    def e2e_s(self) -> float:
        """End-to-end latency, arrival → last token, seconds; ``inf`` if unfinished."""
        return self.finish_s - self.arrival_s


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


@dataclass(frozen=True, slots=True)
class DecodeRequestView:
    """A request decoding on an engine, as a decode rescheduler sees it (ARES §5.2 "Collect States").

    Attributes:
        idx: the request's index in arrival order (what a rescheduler returns to move it).
        isl: prompt tokens.
        generated: output tokens generated so far (its KV holds ``isl + generated`` tokens).
        osl: its true output length — known to the simulator only; an oracle predictor may read it, a real
            predictor must not.
    """

    idx: int
    isl: int
    generated: int
    osl: int


@dataclass(frozen=True, slots=True)
class DecodeInstanceView:
    """A decode-capable engine, as a decode rescheduler sees it.

    Attributes:
        iid: instance id.
        accepting: ready (a possible target); False for a draining instance (a source only).
        kv_capacity_tokens: KV cache capacity, tokens.
        step_time_s: its decode step time for the current batch, seconds (the profile's TPOT at the batch's
            size and mean context; the one-token step when idle).
        requests: its decoding requests.
    """

    iid: int
    accepting: bool
    kv_capacity_tokens: float
    step_time_s: float
    requests: tuple[DecodeRequestView, ...]


@dataclass(frozen=True, slots=True)
class RoleView:
    """A ready P or D instance, as a role balancer sees it (BanaServe eq. 32).

    Attributes:
        iid: instance id. role: "prefill" | "decode". tp: tensor-parallel size.
        compute: compute utilisation in [0, 1] — P: busy fraction over the last tick; D: decode step time over
            the TPOT SLO, capped at 1.
        memory: memory utilisation in [0, 1] — P: the prefill queue's oldest wait over the TTFT SLO, capped at 1
            (the queue is the P side's pressure; its KV lives only until transferred); D: KV cache in use over
            capacity.
    """

    iid: int
    role: str
    tp: int
    compute: float
    memory: float

    @property
    def utilisation(self) -> float:
        """U_d = compute + memory, in [0, 2]."""
        return self.compute + self.memory
