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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from fulcrum.routing.batcher import PrefillBatcher
from fulcrum.routing.prefix import PrefixPull

__all__ = ["Role", "InstanceView", "RequestInfo", "RouteDecision", "Policy", "PolicyCapabilities", "NO_CAPABILITIES",
           "NoInstanceError"]

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


@dataclass(frozen=True, slots=True)
class PolicyCapabilities:
    """What a policy needs from its caller (the router or the simulator) beyond ``route``, typed instead of probed.

    Attributes:
        prefill_batcher: a factory of one DOPD Alg. 1 grouper (:class:`~fulcrum.routing.batcher.PrefillBatcher`)
            per prefill instance, when the policy groups short prompts before their prefill leg; None: every
            prompt goes to its prefill instance at once. The grouper holds whatever items the caller gives it
            (the router its waiting requests, the simulator :class:`RequestInfo`), reading their
            ``prompt_tokens``.
        prefix_block_tokens: tokens per KV block of the prompt hashes the policy reads
            (``RequestInfo.prefix_hashes``, :func:`~fulcrum.routing.prefix.prompt_block_hashes`); None: the
            policy reads no hashes, so the caller need not compute them.
        take_prefix_pull: ``take_prefix_pull(request_id)`` hands over the prefix pull the last ``route`` planned
            for that request, once (BanaServe §4.2; :class:`~fulcrum.routing.prefix.PrefixPull`), or None; this
            field is None when the policy never plans pulls.
    """

    prefill_batcher: Callable[[], PrefillBatcher[Any]] | None = None
    prefix_block_tokens: int | None = None
    take_prefix_pull: Callable[[str], PrefixPull | None] | None = None

    def __post_init__(self) -> None:
        if self.prefix_block_tokens is not None and self.prefix_block_tokens < 1:
            raise ValueError(f"prefix_block_tokens must be >= 1 or None, got {self.prefix_block_tokens}")


NO_CAPABILITIES = PolicyCapabilities()
"""A policy that needs nothing beyond ``route`` and its notifications."""


@runtime_checkable
class Policy(Protocol):
    """A routing policy. ``route`` must be fast (the router calls it per request) and must not block.

    ``route`` raises :class:`NoInstanceError` when no available instance fits. ``on_start``/``on_finish``
    are notifications (no return value); policies without state ignore them. ``capabilities`` says what else
    the caller must provide or may ask (:class:`PolicyCapabilities`).
    """

    name: str
    capabilities: PolicyCapabilities

    def route(self, req: RequestInfo, instances: Sequence[InstanceView], now: float) -> RouteDecision: ...

    def on_start(self, req: RequestInfo, decision: RouteDecision, now: float) -> None: ...

    def on_finish(self, request_id: str, now: float) -> None: ...
