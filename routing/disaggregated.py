"""DOPD's request scheduling: disaggregate, but run ultra-short prompts locally and pick decode instances by
expected prefix-cache hits and load (DOPD §V-B "Router", §V-E "Request Scheduler").

Per request of P prompt tokens:

1. **Ultra-short** (P ≤ ``ultra_short_tokens``): the KV transfer would cost more than the prefill, so the request
   runs whole on a decode instance ("PD-aggregation", §V-E; §II-C Table I): kind "colocated", no transfer.
2. **Otherwise** instance A (role "prefill"/"both") prefills and instance B (role "decode"/"both") decodes:
   kind "disaggregated", ``split_token = P``.

Expected prefix-cache hits. Prompt KV blocks are identified by chained hashes (vLLM's prefix caching: a block's
hash covers every token before it), so the tokens an instance can reuse are the LEADING blocks of the prompt it
holds: ``hit_tokens = min(P, n_leading · kv_block_tokens)`` where ``n_leading`` counts
``RequestInfo.prefix_hashes`` from the first while each is in ``InstanceView.prefix_hashes`` (what an instance
reports) or in the policy's own :class:`~fulcrum.routing.prefix.PrefixIndex` — the blocks of the prompts
it routed there (both the prefill and the decode instance hold a prompt's KV afterwards; least recently used out
first; an estimate of each engine's prefix cache, as DOPD's router infers it).

Costs (documented, in tokens; the smallest wins, ties → fewer in-flight requests → round-robin):

- prefill instance A: ``queued_prefill_tokens + (P − hit_tokens)`` — the prompt work ahead of this prompt's
  first token, including its own uncached part;
- decode instance B: ``running_tokens + queued_prefill_tokens + miss_weight · (P − hit_tokens)`` — the KV it
  holds or is about to hold (its load, DOPD's "inferred load"), plus the prompt KV it must receive or compute
  because its cache lacks it (DOPD's "expected KV-cache hits"). When every candidate reports its KV capacity the
  cost is divided by it (a fraction of the instance's memory), so unequal instances compare fairly.

Length-aware prefill batching (DOPD Alg. 1) is not a per-request decision: :meth:`DisaggregatedPolicy.new_batcher`
gives the router a :class:`~fulcrum.routing.batcher.PrefillBatcher` configured from the same parameters (through
``capabilities.prefill_batcher``, set while ``batch_timeout_s > 0``), which the router's
:class:`~fulcrum.router.prefill_gate.PrefillGate` and the simulator run per prefill instance.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from fulcrum.routing.batcher import PrefillBatcher
from fulcrum.routing.base import InstanceView, NoInstanceError, PolicyCapabilities, RequestInfo, RouteDecision
from fulcrum.routing.prefix import PrefixIndex, leading_blocks
from fulcrum.routing.round_robin import (
    TieBreaker,
    colocated_decision,
    decode_candidates,
    prefill_candidates,
)

__all__ = ["DisaggregatedPolicy", "prefix_hit_tokens"]


def prefix_hit_tokens(req: RequestInfo, inst: InstanceView, kv_block_tokens: int,
                      index: PrefixIndex | None = None) -> int:
    """Prompt tokens ``inst`` holds in its prefix cache for ``req``: leading matching blocks × block size, ≤ P —
    from what the instance reports (``InstanceView.prefix_hashes``) or, larger of the two, what ``index`` knows."""
    if not req.prefix_hashes:
        return 0
    n = leading_blocks(req.prefix_hashes, inst.prefix_hashes)
    if index is not None:
        n = max(n, index.leading(inst.id, req.prefix_hashes))
    return min(req.prompt_tokens, n * kv_block_tokens)


class DisaggregatedPolicy:
    """DOPD §V-B/§V-E routing (module doc).

    Args:
        ultra_short_tokens: prompts of at most this many tokens run whole on a decode instance (0 = never),
            tokens. The ratio planner derives it (:attr:`fulcrum.target.RoutingParams.ultra_short_tokens`).
        miss_weight: cost of one prompt token a decode instance lacks in its cache, relative to one token of
            KV it already holds (1.0: a token to move or recompute weighs as much as a token of load).
        kv_block_tokens: tokens per KV block the prefix hashes stand for (vLLM's default block size 16).
        long_request_tokens: i_next of DOPD Alg. 1 for :meth:`new_batcher`, tokens.
        batch_timeout_s: grouping timeout of DOPD Alg. 1 for :meth:`new_batcher`, s (0 = no grouping).
        max_batch_tokens: token cap of one prefill group for :meth:`new_batcher` (None: none).
        index_blocks_per_instance: prompt blocks remembered per instance for the prefix-hit estimate.

    Raises:
        ValueError: a negative threshold or weight, a weight that is not a finite number, or
            ``kv_block_tokens < 1``.
    """

    name = "disaggregated"

    def __init__(
        self,
        *,
        ultra_short_tokens: int = 0,
        miss_weight: float = 1.0,
        kv_block_tokens: int = 16,
        long_request_tokens: int = 2048,
        batch_timeout_s: float = 0.0,
        max_batch_tokens: int | None = None,
        index_blocks_per_instance: int = 65_536,
    ) -> None:
        if ultra_short_tokens < 0 or miss_weight < 0 or kv_block_tokens < 1:
            raise ValueError("ultra_short_tokens and miss_weight must be >= 0 and kv_block_tokens >= 1")
        if not math.isfinite(miss_weight):  # NaN sent every request to the first decode instance, inf round-robin
            raise ValueError(f"miss_weight must be a finite number >= 0, got {miss_weight!r}")
        self.ultra_short_tokens = int(ultra_short_tokens)
        self.miss_weight = float(miss_weight)
        self.kv_block_tokens = int(kv_block_tokens)
        self.long_request_tokens = int(long_request_tokens)
        self.batch_timeout_s = float(batch_timeout_s)
        self.max_batch_tokens = max_batch_tokens
        PrefillBatcher[RequestInfo](  # validate the batching parameters now, not at the router's first use
            long_request_tokens=self.long_request_tokens, batch_timeout_s=self.batch_timeout_s,
            max_batch_tokens=self.max_batch_tokens,
        )
        self._prefill_ties = TieBreaker()
        self._decode_ties = TieBreaker()
        self.index = PrefixIndex(index_blocks_per_instance)
        self.capabilities = self._capabilities()
        """Groups prefills (DOPD Alg. 1) while ``batch_timeout_s > 0``; reads prompt hashes of ``kv_block_tokens``."""

    def reconfigure(self, params: Mapping[str, Any]) -> bool:
        """Take the constructor parameters ``params`` (missing ones: their defaults) in place, keeping what the
        policy has learned: its :class:`~fulcrum.routing.prefix.PrefixIndex` of the blocks it routed and its
        round-robin tie-breakers. The plans move ``ultra_short_tokens`` and DOPD Alg. 1's parameters from one
        interval to the next, and a new policy each time would forget every instance's prefix cache.

        ``capabilities`` becomes a new object only when the grouping (DOPD Alg. 1's ``long_request_tokens``,
        ``batch_timeout_s``, ``max_batch_tokens``) changes: the caller then starts new prefill gates, as for a
        new policy (:func:`fulcrum.routing.registry.reconfigured`).

        Returns:
            True when applied; False when ``kv_block_tokens`` or ``index_blocks_per_instance`` change (the prefix
            index is keyed by blocks of that size): build a new policy then. Nothing changes on False.

        Raises:
            ValueError: a value the constructor rejects (nothing changes).
            TypeError: an unknown parameter (nothing changes).
        """
        fresh = DisaggregatedPolicy(**params)  # validates exactly as a new policy would
        if fresh.kv_block_tokens != self.kv_block_tokens or fresh.index.max_blocks != self.index.max_blocks:
            return False
        grouping = (fresh.long_request_tokens, fresh.batch_timeout_s, fresh.max_batch_tokens)
        regroup = grouping != (self.long_request_tokens, self.batch_timeout_s, self.max_batch_tokens)
        self.ultra_short_tokens = fresh.ultra_short_tokens
        self.miss_weight = fresh.miss_weight
        self.long_request_tokens, self.batch_timeout_s, self.max_batch_tokens = grouping
        if regroup:
            self.capabilities = self._capabilities()
        return True

    def _capabilities(self) -> PolicyCapabilities:
        return PolicyCapabilities(
            prefill_batcher=self.new_batcher if self.batch_timeout_s > 0.0 else None,  # 0: every prompt at once
            prefix_block_tokens=self.kv_block_tokens,
        )

    def new_batcher(self) -> PrefillBatcher[RequestInfo]:
        """A DOPD Alg. 1 prefill grouper with this policy's ``long_request_tokens`` and ``batch_timeout_s``."""
        return PrefillBatcher(
            long_request_tokens=self.long_request_tokens, batch_timeout_s=self.batch_timeout_s,
            max_batch_tokens=self.max_batch_tokens,
        )

    def decode_cost(self, req: RequestInfo, inst: InstanceView, by_capacity: bool) -> float:
        """Decode-instance cost of ``req`` on ``inst`` (module doc), tokens or a fraction of KV capacity."""
        miss = req.prompt_tokens - prefix_hit_tokens(req, inst, self.kv_block_tokens, self.index)
        cost = inst.running_tokens + inst.queued_prefill_tokens + self.miss_weight * miss
        return cost / inst.kv_capacity_tokens if by_capacity else cost

    def prefill_cost(self, req: RequestInfo, inst: InstanceView) -> float:
        """Prefill-instance cost of ``req`` on ``inst``: queued prompt tokens plus its own uncached ones."""
        return inst.queued_prefill_tokens + req.prompt_tokens - prefix_hit_tokens(req, inst, self.kv_block_tokens, self.index)

    def _pick_decode(self, req: RequestInfo, cands: Sequence[InstanceView]) -> InstanceView:
        by_cap = all(i.kv_capacity_tokens > 0 for i in cands)
        return self._decode_ties.pick(cands, lambda i: (self.decode_cost(req, i, by_cap), i.inflight))

    def route(self, req: RequestInfo, instances: Sequence[InstanceView], now: float) -> RouteDecision:
        """Route one request (module doc).

        Raises:
            NoInstanceError: no available instance may decode it.
        """
        decoders = decode_candidates(instances)
        if not decoders:
            raise NoInstanceError("disaggregated: no available instance with role 'decode' or 'both'")
        p = req.prompt_tokens
        if p <= self.ultra_short_tokens:
            inst = self._pick_decode(req, decoders)
            return colocated_decision(req, inst, f"ultra-short P={p} <= {self.ultra_short_tokens}: local prefill")
        prefillers = prefill_candidates(instances)
        if not prefillers:
            inst = self._pick_decode(req, decoders)
            return colocated_decision(req, inst, "no-prefill-instance: local prefill on the decode instance")
        a = self._prefill_ties.pick(prefillers, lambda i: (self.prefill_cost(req, i), i.inflight))
        others = [i for i in decoders if i.id != a.id]
        if not others:
            return colocated_decision(req, a, "single-instance: no other decode instance")
        b = self._pick_decode(req, others)
        d = max(req.predicted_output_tokens, 1)
        return RouteDecision(
            kind="disaggregated", first=a.id, second=b.id, split_token=p, handoff_after=0, phi=p / (p + d),
            reason="disaggregated",
        )

    def on_start(self, req: RequestInfo, decision: RouteDecision, now: float) -> None:
        """Record that the chosen instances now hold the prompt's blocks (the prefix-hit estimate)."""
        if req.prefix_hashes:
            self.index.record(decision.first, req.prefix_hashes)
            if decision.second is not None:
                self.index.record(decision.second, req.prefix_hashes)

    def on_finish(self, request_id: str, now: float) -> None:
        """Stateless: nothing to forget."""
        return None
