"""The policy contract shared by every routing policy and the router that calls them.

The router keeps one :class:`InstanceView` per registered instance, up to date from its own accounting of
what it dispatched and from the instances' metrics, and asks the policy for a :class:`RouteDecision` per
request. It tells the policy when each decision's work starts and finishes so that stateful policies (the
split policy's execution predictor) can keep their per-instance queues in step.

A request of P prompt tokens and predicted D output tokens (L = P + D) split at token s (DESIGN, "The split
of one request"):

- ``colocated``: one instance does all of it (s = L);
- ``disaggregated``: instance A prefills, B decodes (s = P; A runs with ``max_tokens = 1``);
- ``split``: A prefills and decodes s − P tokens, then B continues (s > P; A runs with
  ``max_tokens = s − P + 1`` and hands off its KV cache, the handoff protocol);
- ``split`` with s < P: A prefills the first s prompt tokens and B loads that KV and prefills the rest — only
  where the KV connector supports a partial prefix safely; otherwise the policy returns the nearest safe split
  and says why in ``reason``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from fulcrum.routing.batcher import PrefillBatcher

__all__ = ["Role", "InstanceView", "RequestInfo", "RouteDecision", "Policy", "GroupsPrefills", "NoInstanceError"]

Role = Literal["prefill", "decode", "both"]


class NoInstanceError(Exception):
    """No healthy instance can take the request (the router answers 503)."""


@dataclass(frozen=True, slots=True)
class InstanceView:
    """What a policy sees of one instance.

    Attributes:
        id: stable instance id (registry key).
        role: what the instance may do: "prefill", "decode" or "both" (``kv_both``).
        tp: tensor-parallel size.
        healthy: passes health checks and is not ejected.
        draining: takes no new work (scale-in).
        inflight: requests dispatched and not finished, count.
        queued_prefill_tokens: prompt tokens dispatched and not yet prefilled, tokens.
        running_tokens: KV tokens held by running requests (context so far), tokens.
        kv_capacity_tokens: KV cache capacity, tokens (0 = unknown).
        max_num_batched_tokens: the engine's per-step token budget, tokens.
        max_num_seqs: the engine's concurrency limit, requests.
        compute_utilisation: 0..1 busy share from the engine's metrics (BanaServe), NaN if unknown.
        memory_utilisation: 0..1 KV cache usage from the engine's metrics, NaN if unknown.
        supports_partial_prefix: the KV connector can move a partial prompt prefix safely (s < P splits).
        prefix_hashes: hashes of prompt blocks this instance holds in its prefix cache (may be empty).
    """

    id: str
    role: Role = "both"
    tp: int = 1
    healthy: bool = True
    draining: bool = False
    inflight: int = 0
    queued_prefill_tokens: int = 0
    running_tokens: int = 0
    kv_capacity_tokens: int = 0
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    compute_utilisation: float = float("nan")
    memory_utilisation: float = float("nan")
    supports_partial_prefix: bool = False
    prefix_hashes: frozenset[int] = frozenset()

    @property
    def available(self) -> bool:
        """Healthy and not draining."""
        return self.healthy and not self.draining


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What a policy knows of one request at admission.

    Attributes:
        request_id: the router's id for the request.
        prompt_tokens: P, tokens.
        max_tokens: the client's ``max_tokens`` cap, tokens.
        predicted_output_tokens: D, the output-length predictor's estimate (≤ max_tokens), tokens.
        prefix_hashes: hashes of the prompt's KV blocks, for prefix-cache-aware choices.
    """

    request_id: str
    prompt_tokens: int
    max_tokens: int
    predicted_output_tokens: int
    prefix_hashes: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Where one request runs.

    Attributes:
        kind: "colocated" | "disaggregated" | "split".
        first: instance A (colocated: the only one).
        second: instance B, or None when colocated.
        split_token: s, the token after which B takes over (colocated: P + max_tokens; disaggregated: P).
        handoff_after: k = s − P generated tokens A produces before handing off (0 for disaggregated and
            colocated; > 0 for split past the prompt).
        phi: the split ratio s / L the policy chose (None when it did not split).
        reason: why, in one line (counted in the router's metrics by its first word).
    """

    kind: Literal["colocated", "disaggregated", "split"]
    first: str
    second: str | None = None
    split_token: int = 0
    handoff_after: int = 0
    phi: float | None = None
    reason: str = ""


@runtime_checkable
class Policy(Protocol):
    """A routing policy. ``route`` must be fast (the router calls it per request) and must not block.

    ``route`` raises :class:`NoInstanceError` when no available instance fits. ``on_start``/``on_finish``
    are notifications (no return value); policies without state ignore them.
    """

    name: str

    def route(self, req: RequestInfo, instances: Sequence[InstanceView], now: float) -> RouteDecision: ...

    def on_start(self, req: RequestInfo, decision: RouteDecision, now: float) -> None: ...

    def on_finish(self, request_id: str, now: float) -> None: ...


@runtime_checkable
class GroupsPrefills(Protocol):
    """A policy that groups short prompts before their prefill leg (DOPD Alg. 1): the router runs one
    :class:`~fulcrum.router.prefill_gate.PrefillGate` per prefill instance while ``batch_timeout_s > 0``.

    ``batch_timeout_s`` is the grouping timeout in seconds (DOPD eq. 18; 0 = every prompt at once);
    ``new_batcher`` returns a fresh grouper for one prefill instance.
    """

    batch_timeout_s: float

    def new_batcher(self) -> PrefillBatcher[Any]: ...
