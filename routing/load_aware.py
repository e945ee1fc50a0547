"""BanaServe's load-aware dispatch (BanaServe §4.4.2, Algorithm 2; load of eq. 37).

Per instance p, the normalised load is compute plus memory utilisation (eq. 37)::

    U_p = C_p / C_p^max + M_p / M_p^max        ∈ [0, 2]

taken from ``InstanceView.compute_utilisation`` and ``memory_utilisation`` (0..1 each). When the engine's
metrics have not arrived (NaN), the router's own accounting stands in: compute ← ``inflight / max_num_seqs``
(share of the batch slots taken), memory ← ``running_tokens / kv_capacity_tokens`` (or the compute stand-in
when the capacity is unknown); each clipped to [0, 1].

Algorithm 2 sorts instances by (load, queue length) ascending and dispatches to the first (least loaded); if
even that one's load is not below the threshold δ_L, it dispatches to the instance with the shortest queue
instead (line 17: once every instance is saturated, utilisation no longer tells them apart but queueing
delay does). The queue length is the prompt work waiting on the instance: ``queued_prefill_tokens``, then
``inflight``. After each assignment the chosen instance's load is raised by EstimateLoad(req) (line 15): here a
request adds ``1 / max_num_seqs`` of compute and ``(P + D) / kv_capacity_tokens`` of memory (or
``1 / max_num_seqs`` without a known capacity). The engine's metrics are scraped, so these estimates are kept
for ``estimate_ttl_s`` (about one scrape interval) and then dropped, by which time the metrics include the
request.

BanaServe routes to prefill instances (its global KV store makes cache affinity moot). Here the policy either
colocates a request on one "both"/"decode" instance or disaggregates it: the prefill instance (role
"prefill"/"both") and then the decode instance (role "decode"/"both", another one), each by the same rule.
``disaggregate=True`` always disaggregates (where a prefill instance is available), ``False`` always colocates;
the default, ``None``, goes by the roles on offer: it disaggregates while any available instance has role
"prefill" and colocates otherwise. That default is what an Auto-mode ``LLMServe`` needs (its pools change
between Disaggregated and Unified as it runs), and a Unified pool under the router's role reassignment, whose
prefill-duty instances show as "prefill" (``fulcrum.router.roles``). A fixed ``False`` there left every prefill
instance without work: on the Auto example × the Azure code trace the colocated policy served every request on
the decode pool, 0.0% SLO attainment at 45 GPU-hours under the ``fulcrum`` planner (``disaggregated``: 84.8%,
12.87 GPU-hours).

**Load-aware dispatch over a shared KV store** (BanaServe §4.2 "Global KV Cache Store", §4.4.2; ``prefix_pull``).
BanaServe's store lets every instance read every cached prefix, so the router balances load alone. Fulcrum has
no separate store; the engines' prefix caches together are one, reachable over the KV connector: the policy
remembers which instance holds which prompt blocks (:class:`~fulcrum.routing.prefix.PrefixIndex`, chained block hashes of the prompts it
routed, :func:`~fulcrum.routing.prefix.prompt_block_hashes`; each instance's set bounded as an LRU), still chooses the instance by load
only, and when another available instance holds a longer leading prefix than the chosen one it plans a
:class:`~fulcrum.routing.prefix.PrefixPull` (block-aligned, at most P − 1 tokens: the chosen instance computes the rest). The router
(``fulcrum.router.app``) executes the plan only where it pays — pulling ``tokens × kv_bytes_per_token`` over the
link (plus a fixed overhead) must take less time than recomputing those tokens (:func:`~fulcrum.routing.prefix.pull_costs`) — and only
where the engines accept a partial prefix (router config ``kv_connector.partial_prefix``); otherwise the prefix is
recomputed and the reason counted. The plan is handed over by :meth:`LoadAwarePolicy.take_prefix_pull` (``capabilities.take_prefix_pull``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from fulcrum.routing.base import InstanceView, NoInstanceError, PolicyCapabilities, RequestInfo, RouteDecision
from fulcrum.routing.prefix import PrefixIndex, PrefixPull
from fulcrum.routing.round_robin import (
    TieBreaker,
    colocated_candidates,
    colocated_decision,
    decode_candidates,
    prefill_candidates,
)

__all__ = ["LoadAwarePolicy", "utilisation"]


def _clip01(x: float) -> float:
    return min(max(x, 0.0), 1.0)


def utilisation(inst: InstanceView) -> float:
    """U = compute + memory utilisation of ``inst`` (eq. 37), with the fallbacks of the module doc, in [0, 2]."""
    c = inst.compute_utilisation
    fallback = _clip01(inst.inflight / max(inst.max_num_seqs, 1))
    c = fallback if math.isnan(c) else _clip01(c)
    m = inst.memory_utilisation
    if math.isnan(m):
        m = _clip01(inst.running_tokens / inst.kv_capacity_tokens) if inst.kv_capacity_tokens > 0 else fallback
    else:
        m = _clip01(m)
    return c + m


class LoadAwarePolicy:
    """BanaServe Algorithm 2 (module doc).

    Args:
        load_threshold: δ_L on U ∈ [0, 2]: at or above it the shortest queue wins instead (default 1.6: both
            compute and memory at 80%).
        estimate_ttl_s: how long a dispatched request's EstimateLoad stays added to its instance's load, s
            (about the engine metrics' scrape interval).
        disaggregate: True: choose a prefill and a separate decode instance; False: one colocated instance;
            None: disaggregate while an available instance has role "prefill", colocate otherwise (module doc).
        prefix_pull: plan prefix pulls from the instance holding a prompt's longest cached prefix (module doc;
            colocated decisions only).
        kv_block_tokens: tokens per KV block the prefix hashes stand for (the engines' block size).
        min_pull_tokens: shortest prefix worth a pull, tokens (a pull costs an extra request on the holder).
        index_blocks_per_instance: blocks the prefix index remembers per instance.

    Raises:
        ValueError: a negative threshold or TTL, ``kv_block_tokens < 1``.
    """

    name = "load_aware"

    def __init__(self, *, load_threshold: float = 1.6, estimate_ttl_s: float = 5.0, disaggregate: bool | None = None,
                 prefix_pull: bool = False, kv_block_tokens: int = 16, min_pull_tokens: int = 256,
                 index_blocks_per_instance: int = 65_536) -> None:
        if not (load_threshold >= 0.0) or not (estimate_ttl_s >= 0.0):
            raise ValueError("load_threshold and estimate_ttl_s must be >= 0")
        if kv_block_tokens < 1 or min_pull_tokens < 0:
            raise ValueError("kv_block_tokens must be >= 1 and min_pull_tokens >= 0")
        self.load_threshold = float(load_threshold)
        self.estimate_ttl_s = float(estimate_ttl_s)
        self.disaggregate = None if disaggregate is None else bool(disaggregate)
        self.prefix_pull = bool(prefix_pull)
        self.kv_block_tokens = int(kv_block_tokens)
        self.capabilities = PolicyCapabilities(
            prefix_block_tokens=self.kv_block_tokens if self.prefix_pull else None,
            take_prefix_pull=self.take_prefix_pull if self.prefix_pull else None,
        )
        """Reads prompt hashes and plans prefix pulls only with ``prefix_pull``."""
        self.min_pull_tokens = int(min_pull_tokens)
        self.index = PrefixIndex(index_blocks_per_instance)
        self._pulls: dict[str, PrefixPull] = {}
        self._pending: dict[str, deque[tuple[float, float]]] = {}  # id -> (expires at, added load)
        self._ties = TieBreaker()

    def _pending_load(self, inst_id: str, now: float) -> float:
        q = self._pending.get(inst_id)
        if not q:
            return 0.0
        while q and q[0][0] <= now:
            q.popleft()
        return sum(x for _, x in q)

    @staticmethod
    def estimate_load(req: RequestInfo, inst: InstanceView) -> float:
        """EstimateLoad(req) of Alg. 2 line 15 on ``inst`` (module doc), in units of U."""
        c = 1.0 / max(inst.max_num_seqs, 1)
        if inst.kv_capacity_tokens > 0:
            m = (req.prompt_tokens + max(req.predicted_output_tokens, 1)) / inst.kv_capacity_tokens
        else:
            m = c
        return c + m

    def load(self, inst: InstanceView, now: float) -> float:
        """Eq. 37 load of ``inst`` plus the estimates of requests dispatched to it in the last ``estimate_ttl_s``."""
        return utilisation(inst) + self._pending_load(inst.id, now)

    def _select(self, req: RequestInfo, cands: Sequence[InstanceView], now: float) -> tuple[InstanceView, str]:
        loads = {i.id: self.load(i, now) for i in cands}
        target = self._ties.pick(cands, lambda i: (loads[i.id], i.queued_prefill_tokens, i.inflight))
        if loads[target.id] < self.load_threshold:
            self._pending.setdefault(target.id, deque()).append((now + self.estimate_ttl_s, self.estimate_load(req, target)))
            return target, f"least-loaded U={loads[target.id]:.2f}"
        target = self._ties.pick(cands, lambda i: (i.queued_prefill_tokens, i.inflight, loads[i.id]))
        return target, f"lowest-queue U={loads[target.id]:.2f} >= {self.load_threshold:g}"

    def route(self, req: RequestInfo, instances: Sequence[InstanceView], now: float) -> RouteDecision:
        """Route one request by Alg. 2 (module doc).

        Raises:
            NoInstanceError: no available instance may take it.
        """
        disaggregate = self.disaggregate
        if disaggregate is None:
            disaggregate = any(i.available and i.role == "prefill" for i in instances)
        if not disaggregate:
            cands = colocated_candidates(instances)
            if not cands:
                raise NoInstanceError("load_aware: no available instance with role 'both' or 'decode'")
            inst, why = self._select(req, cands, now)
            if self.prefix_pull:
                self._plan_pull(req, inst, instances)
            return colocated_decision(req, inst, why)
        prefillers = prefill_candidates(instances)
        decoders = decode_candidates(instances)
        if not decoders:
            raise NoInstanceError("load_aware: no available instance with role 'decode' or 'both'")
        if not prefillers:
            inst, why = self._select(req, decoders, now)
            return colocated_decision(req, inst, why)
        a, why = self._select(req, prefillers, now)
        others = [i for i in decoders if i.id != a.id]
        if not others:
            return colocated_decision(req, a, why)
        b, why_b = self._select(req, others, now)
        p, d = req.prompt_tokens, max(req.predicted_output_tokens, 1)
        return RouteDecision(
            kind="disaggregated", first=a.id, second=b.id, split_token=p, phi=p / (p + d),
            reason=f"{why}; decode {why_b}",
        )

    def _plan_pull(self, req: RequestInfo, inst: InstanceView, instances: Sequence[InstanceView]) -> None:
        """Plan a pull when another available instance holds a longer leading prefix than ``inst`` (module doc)."""
        self._pulls.pop(req.request_id, None)
        hashes = req.prefix_hashes
        if not hashes or req.prompt_tokens < 2:
            return
        bs = self.kv_block_tokens
        local = self.index.leading(inst.id, hashes)
        holder, n = self.index.best_holder(hashes, (i.id for i in instances if i.available and i.id != inst.id))
        tokens = min(n * bs, (req.prompt_tokens - 1) // bs * bs)  # partial: the target computes the last token
        if holder is None or tokens <= local * bs or tokens < max(self.min_pull_tokens, bs):
            return
        self._pulls[req.request_id] = PrefixPull(holder, inst.id, tokens, local * bs)

    def take_prefix_pull(self, request_id: str) -> PrefixPull | None:
        """The pull planned for ``request_id`` by the last ``route`` (once; None when there is none)."""
        return self._pulls.pop(request_id, None)

    def on_start(self, req: RequestInfo, decision: RouteDecision, now: float) -> None:
        """Record the prompt's blocks on the instances that will hold them (A, and B of a handoff)."""
        if self.prefix_pull and req.prefix_hashes:
            self.index.record(decision.first, req.prefix_hashes)
            if decision.second is not None:
                self.index.record(decision.second, req.prefix_hashes)

    def on_finish(self, request_id: str, now: float) -> None:
        """Drop a pull plan nobody took."""
        self._pulls.pop(request_id, None)
