"""Length-aware prefill grouping (DOPD Alg. 1, "Prefill Requests Scheduler", §V-B/§V-E) as a pure state machine.

DOPD groups short prompts so a prefill batch reaches the input length the P/D ratio was planned for, and runs
long prompts at once::

    if REQS_BATCH.ALL_LENGTH() ≥ i_next or (TIMER.DURATION() ≥ timeout and REQS_BATCH non-empty):
        run REQS_BATCH; reset it and the timer                                  (Alg. 1 lines 4–7)
    req ← PREFILL_QUEUE.POP()
    if the queue is empty: run REQS_BATCH if non-empty                          (lines 10–17)
    if req.length < i_next: add it to REQS_BATCH, start the timer on the first  (lines 18–22)
    else: run req at once                                                       (line 24)

Here ``i_next`` is ``long_request_tokens`` (DOPD: the forecast mean ISL; the ratio planner fills
:class:`fulcrum.target.RoutingParams`) and ``timeout`` is ``batch_timeout_s`` (eq. 18: T_timeout ≥ α·W_q).

The caller owns the clock: :meth:`PrefillBatcher.add` and :meth:`PrefillBatcher.poll` take ``now`` (seconds,
monotonic), :meth:`PrefillBatcher.next_deadline` says when to call ``poll`` next, and :meth:`PrefillBatcher.flush`
is Alg. 1's "queue empty" branch for a caller that knows its queue has drained. No I/O, no timers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

__all__ = ["PrefillBatch", "PrefillBatcher"]


T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class PrefillBatch(Generic[T]):
    """One group of prompts to prefill together.

    Attributes:
        items: the requests, in arrival order.
        tokens: their total prompt length, tokens.
        opened_at: when the first of them was added, s.
        released_at: when the batch was released, s.
        cause: "long" (a prompt of at least ``long_request_tokens``, alone), "full" (the group reached
            ``long_request_tokens``), "budget" (the next prompt would overflow ``max_batch_tokens``), "timeout"
            (the oldest waited ``batch_timeout_s``), or "flush" (the caller's queue drained).
    """

    items: tuple[T, ...]
    tokens: int
    opened_at: float
    released_at: float
    cause: Literal["long", "full", "budget", "timeout", "flush"]


def _prompt_tokens(item: object) -> int:
    return int(getattr(item, "prompt_tokens"))


class PrefillBatcher(Generic[T]):
    """DOPD Alg. 1 grouping of short prompts toward ``long_request_tokens`` (module doc).

    Args:
        long_request_tokens: i_next: a prompt of at least this many tokens is dispatched alone at once; a group
            of shorter ones is released as soon as its total reaches it, tokens (≥ 1).
        batch_timeout_s: longest the first prompt of a group waits, s (≥ 0; 0 = no grouping: every prompt is
            released when added).
        max_batch_tokens: a group is released before a prompt that would take it past this many tokens
            (None: no cap; :attr:`fulcrum.target.RoutingParams.max_prefill_batch_tokens`).
        tokens_of: prompt length of an item, tokens (default: its ``prompt_tokens`` attribute).

    Raises:
        ValueError: ``long_request_tokens < 1``, a negative or non-finite timeout, or ``max_batch_tokens < 1``.
    """

    def __init__(
        self,
        *,
        long_request_tokens: int = 2048,
        batch_timeout_s: float = 0.0,
        max_batch_tokens: int | None = None,
        tokens_of: Callable[[T], int] = _prompt_tokens,
    ) -> None:
        if long_request_tokens < 1:
            raise ValueError(f"long_request_tokens must be >= 1, got {long_request_tokens}")
        if not (batch_timeout_s >= 0.0 and batch_timeout_s != float("inf")):
            raise ValueError(f"batch_timeout_s must be a finite number >= 0, got {batch_timeout_s}")
        if max_batch_tokens is not None and max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1 or None, got {max_batch_tokens}")
        self.long_request_tokens = int(long_request_tokens)
        self.batch_timeout_s = float(batch_timeout_s)
        self.max_batch_tokens = max_batch_tokens
        self._tokens_of = tokens_of
        self._items: list[T] = []
        self._tokens = 0
        self._opened_at = 0.0

    @property
    def pending(self) -> int:
        """Prompts waiting in the open group."""
        return len(self._items)

    @property
    def pending_tokens(self) -> int:
        """Their total length, tokens."""
        return self._tokens

    def next_deadline(self) -> float | None:
        """When the open group times out (s, same clock as ``now``), or None when no group is open."""
        return self._opened_at + self.batch_timeout_s if self._items else None

    def _release(self, now: float, cause: Literal["full", "budget", "timeout", "flush"]) -> PrefillBatch[T]:
        batch = PrefillBatch(tuple(self._items), self._tokens, self._opened_at, now, cause)
        self._items, self._tokens = [], 0
        return batch

    def poll(self, now: float) -> list[PrefillBatch[T]]:
        """Release the open group if it has timed out by ``now`` (Alg. 1 line 4, timer branch)."""
        if self._items and now >= self._opened_at + self.batch_timeout_s:
            return [self._release(now, "timeout")]
        return []

    def flush(self, now: float) -> list[PrefillBatch[T]]:
        """Release the open group regardless of its size or age (Alg. 1 lines 10–13: the queue is empty)."""
        return [self._release(now, "flush")] if self._items else []

    def add(self, item: T, now: float) -> list[PrefillBatch[T]]:
        """Take one prompt at ``now``; return the batches that are ready, oldest first.

        A timed-out group is released first (Alg. 1 checks before it pops). A long prompt comes back alone
        (cause "long") and leaves the open group as it is (line 24); a short one joins the group, which is
        released when its total reaches ``long_request_tokens`` or ``batch_timeout_s`` is 0.

        Raises:
            ValueError: a negative prompt length.
        """
        tokens = self._tokens_of(item)
        if tokens < 0:
            raise ValueError(f"prompt length must be >= 0, got {tokens}")
        out = self.poll(now)
        if tokens >= self.long_request_tokens:
            out.append(PrefillBatch((item,), tokens, now, now, "long"))
            return out
        if self._items and self.max_batch_tokens is not None and self._tokens + tokens > self.max_batch_tokens:
            out.append(self._release(now, "budget"))
        if not self._items:
            self._opened_at = now
        self._items.append(item)
        self._tokens += tokens
        if self._tokens >= self.long_request_tokens:
            out.append(self._release(now, "full"))
        elif self.batch_timeout_s <= 0.0:
            out.append(self._release(now, "timeout"))
        assert self._tokens >= 0 and (not self._items or self._tokens < self.long_request_tokens)
        return out
