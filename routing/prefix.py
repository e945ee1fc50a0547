"""The prefix-hash index: which instance holds which prompt KV blocks, and what a prefix pull costs.

Prompt KV blocks are identified by chained hashes, as vLLM's prefix caching keys them (block i's hash covers
every token of blocks 0..i), so an instance can reuse only a LEADING run of a prompt's blocks
(:func:`leading_blocks`). :class:`PrefixIndex` remembers, per instance, the blocks of the prompts the router sent
there (an LRU estimate of each engine's prefix cache: DOPD §V-E's "expected KV-cache hits", BanaServe §4.2's
global view of the caches). :class:`PrefixPull` and :func:`pull_costs` are BanaServe §4.2's pull of a cached
prefix from the instance holding it, priced against recomputing it.

Used by :mod:`fulcrum.routing.disaggregated` and :mod:`fulcrum.routing.load_aware`, and by the router, which hashes
prompts (:func:`prompt_block_hashes`) for policies whose :attr:`~fulcrum.routing.base.PolicyCapabilities.prefix_block_tokens`
is set. Pure: no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass

__all__ = ["prompt_block_hashes", "leading_blocks", "PrefixIndex", "PrefixPull", "pull_costs"]


def prompt_block_hashes(ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """Chained hashes of the prompt's full KV blocks, as vLLM's prefix caching keys them: block i's hash covers
    every token of blocks 0..i (so equal hashes mean equal prefixes). Shape: (len(ids) // block_size,).

    Raises:
        ValueError: ``block_size < 1``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out: list[int] = []
    h = 0
    for i in range(0, len(ids) - len(ids) % block_size, block_size):
        h = hash((h, tuple(ids[i : i + block_size])))
        out.append(h)
    return tuple(out)


def leading_blocks(hashes: Sequence[int], held: Container[int] | None) -> int:
    """How many of ``hashes`` (chained prompt block hashes), from the first, are in ``held``, blocks: with
    chained hashes only a leading run of blocks can be reused from a prefix cache."""
    n = 0
    if held:
        for h in hashes:
            if h not in held:
                break
            n += 1
    return n


class PrefixIndex:
    """Which instance holds which prompt blocks (BanaServe §4.2's global view of the caches), from the prompts the
    router sent them. Each instance keeps at most ``max_blocks`` hashes, least recently used out first (its own
    cache evicts too; the index is an estimate).

    Raises:
        ValueError: ``max_blocks < 1``.
    """

    def __init__(self, max_blocks: int = 65_536) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self.max_blocks = int(max_blocks)
        self._held: dict[str, OrderedDict[int, None]] = {}

    def record(self, instance: str, hashes: Sequence[int]) -> None:
        """``instance`` now holds these blocks."""
        held = self._held.setdefault(instance, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def leading(self, instance: str, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` that ``instance`` holds, blocks."""
        return leading_blocks(hashes, self._held.get(instance))

    def best_holder(self, hashes: Sequence[int], among: Iterable[str]) -> tuple[str | None, int]:
        """The instance of ``among`` holding the most leading blocks, and how many (None, 0 when none does)."""
        best, n_best = None, 0
        for iid in among:
            n = self.leading(iid, hashes)
            if n > n_best:
                best, n_best = iid, n
        return best, n_best

    def forget(self, instance: str) -> None:
        """Drop an instance (it left)."""
        self._held.pop(instance, None)


@dataclass(frozen=True, slots=True)
class PrefixPull:
    """A planned prefix pull: ``target`` loads the KV of the prompt's first ``tokens`` tokens from ``holder``.

    Attributes:
        holder: the instance holding the prefix. target: the instance the request runs on.
        tokens: block-aligned prefix length to pull, tokens (< P). local_tokens: what ``target`` holds itself.
    """

    holder: str
    target: str
    tokens: int
    local_tokens: int


def pull_costs(tokens: int, kv_bytes_per_token: float, link_gbps: float, overhead_s: float,
               prefill_tokens_per_s: float) -> tuple[float, float]:
    """(seconds to pull ``tokens`` tokens of KV over the link, seconds to recompute them): tokens × bytes/token
    over the bandwidth plus the fixed overhead, against tokens over the prefill throughput (BanaServe §4.2,
    eq. 17's T_KV against the forward time)."""
    return tokens * kv_bytes_per_token / (link_gbps * 1e9) + overhead_s, tokens / prefill_tokens_per_s
