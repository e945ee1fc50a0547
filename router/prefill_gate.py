"""DOPD Alg. 1 in the request path: short prompts wait at a per-instance gate until their prefill group is released.

:class:`fulcrum.routing.batcher.PrefillBatcher` is the pure state machine of DOPD's "Prefill Requests Scheduler"
(Alg. 1, §V-B/§V-E); this module is its asyncio adapter for the router. Before the prefill leg of a
``disaggregated`` decision is sent to instance A, the request calls :meth:`PrefillGate.admit` with A's id and
its prompt length and waits until its group is released:

- a prompt of at least ``long_request_tokens`` (i_next) passes at once (Alg. 1 line 24, cause ``long``);
- shorter prompts for the same instance are grouped; the group passes together when its total reaches i_next
  (``full``), when the next prompt would overflow ``max_batch_tokens`` (``budget``), or when its first prompt
  has waited ``batch_timeout_s`` (``timeout``; eq. 18 sizes it from the queueing delay);
- Alg. 1's "prefill queue empty" branch (lines 10–17) is the instance having no prefill in flight: the caller
  says so with ``idle=True``, and the open group, this prompt included, passes at once (``flush``): holding
  prompts back from an idle prefill instance would only waste it.

The released group's prefill legs then go out together, so the engine schedules them in the same steps (vLLM
batches the prompts it has waiting up to its token budget). ``batch_timeout_s = 0`` (the default) releases
every prompt as it comes: no grouping, no wait.

A request whose client goes away while it waits leaves its place in the group (its tokens still count toward
the group's total, as DOPD's batch would hold them); the others are unaffected. Adapter code: it owns timers
and futures, and keeps no state besides the batchers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from fulcrum.routing.batcher import PrefillBatch, PrefillBatcher

__all__ = ["HeldPrefill", "PrefillGate"]


@dataclass(eq=False, slots=True)
class HeldPrefill:
    """One prompt at the gate: its length (tokens) and the future its request awaits (the release cause)."""

    prompt_tokens: int
    released: asyncio.Future[str] = field(repr=False)


class PrefillGate:
    """Per-prefill-instance DOPD Alg. 1 grouping for the router (module doc).

    Args:
        make_batcher: a new :class:`PrefillBatcher` for an instance (the policy's ``capabilities.prefill_batcher``).
        clock: monotonic seconds, the batchers' ``now`` (default: the event loop's clock, which its timers use).
        on_release: called with every released group (metrics), before its requests resume.
    """

    def __init__(
        self,
        make_batcher: Callable[[], PrefillBatcher[HeldPrefill]],
        clock: Callable[[], float] | None = None,
        on_release: Callable[[PrefillBatch[HeldPrefill]], None] | None = None,
    ) -> None:
        self._make_batcher = make_batcher
        self._clock = clock if clock is not None else (lambda: asyncio.get_running_loop().time())
        self._on_release = on_release
        self._batchers: dict[str, PrefillBatcher[HeldPrefill]] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def pending(self, instance_id: str) -> int:
        """Prompts waiting at ``instance_id``'s gate."""
        b = self._batchers.get(instance_id)
        return b.pending if b is not None else 0

    async def admit(self, instance_id: str, prompt_tokens: int, *, idle: bool) -> str:
        """Wait until the prefill of a ``prompt_tokens``-token prompt may be sent to ``instance_id``.

        Args:
            instance_id: the prefill instance the policy chose.
            prompt_tokens: the prompt's length, tokens (≥ 0).
            idle: True when the instance has no prefill in flight (Alg. 1's empty queue: release now).

        Returns:
            The release cause: "long", "full", "budget", "timeout" or "flush".

        Raises:
            ValueError: a negative prompt length.
            asyncio.CancelledError: the waiting request was cancelled (its client went away).
        """
        batcher = self._batchers.get(instance_id)
        if batcher is None:
            batcher = self._batchers[instance_id] = self._make_batcher()
        held = HeldPrefill(prompt_tokens, asyncio.get_running_loop().create_future())
        now = self._clock()
        released = batcher.add(held, now)
        if idle:
            released += batcher.flush(now)
        self._release(released)
        self._arm(instance_id, batcher)
        return await held.released

    def close(self) -> None:
        """Release every waiting prompt (cause "flush") and stop the timers: the gate is being replaced."""
        now = self._clock()
        for iid, batcher in list(self._batchers.items()):
            self._release(batcher.flush(now))
            self._disarm(iid)
        self._batchers.clear()

    # ------------------------------------------------------------------ internals
    def _release(self, batches: list[PrefillBatch[HeldPrefill]]) -> None:
        for batch in batches:
            if self._on_release is not None:
                self._on_release(batch)
            for held in batch.items:
                if not held.released.done():  # a cancelled waiter keeps its place but resumes nobody
                    held.released.set_result(batch.cause)

    def _arm(self, iid: str, batcher: PrefillBatcher[HeldPrefill]) -> None:
        """(Re)start the timer of ``iid``'s open group, or stop it when no group is open."""
        self._disarm(iid)
        deadline = batcher.next_deadline()
        if deadline is None:
            return
        delay = max(0.0, deadline - self._clock())
        self._timers[iid] = asyncio.get_running_loop().call_later(delay, self._expire, iid)

    def _disarm(self, iid: str) -> None:
        timer = self._timers.pop(iid, None)
        if timer is not None:
            timer.cancel()

    def _expire(self, iid: str) -> None:
        self._timers.pop(iid, None)
        batcher = self._batchers.get(iid)
        if batcher is None:
            return
        self._release(batcher.poll(self._clock()))
        self._arm(iid, batcher)
