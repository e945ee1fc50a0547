"""The event loop of the simulator: a heap of timed callbacks, ordered explicitly.

A deliberately small kernel in the manner of Vidur's ``simulator.py`` (STYLE.md §13), without its faults:

- events at the same time are ordered by ``(time, priority, sequence)`` — an explicit priority per kind of
  event (see :class:`Priority`), then the order in which they were scheduled — so a run never depends on
  how Python compares callbacks and is deterministic;
- cancellation is lazy (a cancelled sequence number is skipped when popped), so rescheduling an
  instance's next event is O(log n);
- the clock only moves forward, and only here.

The kernel knows nothing of requests or instances: a handler is any ``Callable[[int], None]`` called with
the integer argument it was scheduled with (instances pass a decode step index, others ignore it), at
``kernel.now`` equal to the event's time.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from enum import IntEnum

__all__ = ["Priority", "Handler", "Kernel"]

#: An event handler: called with the integer argument given to :meth:`Kernel.schedule`.
Handler = Callable[[int], None]


class Priority(IntEnum):
    """Order of events that fall at the same instant (lower runs first).

    Events that free capacity run before events that claim it, so a request arriving at the very moment a
    batch finishes sees the freed instance.
    """

    READY = 0  #: a starting instance becomes ready
    STEP = 1  #: a decode/unified instance reaches a step boundary (finishes, joins, preemption)
    PREFILL_DONE = 2  #: a prefill batch completes on a P instance
    KV_ARRIVAL = 3  #: a KV cache transfer lands on a decode instance
    ARRIVAL = 4  #: a request of the trace arrives at the router
    TIMER = 5  #: a length-aware batching timeout expires (DOPD Alg. 1 line 4)
    DRAIN_TIMEOUT = 6  #: a draining instance ran out of time
    START = 7  #: an idle engine starts stepping (after every arrival of the same instant, so they batch)


class Kernel:
    """A discrete-event clock: :meth:`schedule` callbacks, :meth:`run_until` a time.

    Times are seconds since the start of the run. Not thread-safe; one kernel per simulation.
    """

    __slots__ = ("_heap", "_seq", "_cancelled", "now", "processed")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Handler, int]] = []
        self._seq = 0
        self._cancelled: set[int] = set()
        self.now: float = 0.0  #: current simulated time, seconds
        self.processed: int = 0  #: events handled so far (for benchmarks)

    def schedule(self, time: float, priority: Priority, handler: Handler, arg: int = 0) -> int:
        """Call ``handler(arg)`` at ``time`` (seconds; clamped to ``now`` if earlier). Returns a handle.

        Raises:
            ValueError: ``time`` is NaN.
        """
        if math.isnan(time):
            raise ValueError("cannot schedule an event at NaN")
        seq = self._seq
        self._seq = seq + 1
        heapq.heappush(self._heap, (time if time > self.now else self.now, int(priority), seq, handler, arg))
        return seq

    def cancel(self, handle: int) -> None:
        """Forget a scheduled event (no effect if it already ran)."""
        if handle < self._seq:
            self._cancelled.add(handle)

    def next_time(self) -> float:
        """Time of the next live event, seconds; ``inf`` when none is left."""
        heap = self._heap
        cancelled = self._cancelled
        while heap and heap[0][2] in cancelled:
            cancelled.discard(heapq.heappop(heap)[2])
        return heap[0][0] if heap else math.inf

    def step(self) -> bool:
        """Handle the next live event (advancing ``now`` to it). Returns False when none is left."""
        heap = self._heap
        cancelled = self._cancelled
        while heap:
            time, _, seq, handler, arg = heapq.heappop(heap)
            if seq in cancelled:
                cancelled.discard(seq)
                continue
            self.now = time
            self.processed += 1
            handler(arg)
            return True
        return False

    def run_until(self, t: float) -> None:
        """Handle every event with time <= ``t`` (including those scheduled meanwhile); then ``now = t``.

        Raises:
            ValueError: ``t`` is before ``now``.
        """
        if t < self.now:
            raise ValueError(f"cannot run back in time: now={self.now} s, asked {t} s")
        heap = self._heap
        cancelled = self._cancelled
        pop = heapq.heappop
        while heap and heap[0][0] <= t:
            time, _, seq, handler, arg = pop(heap)
            if seq in cancelled:
                cancelled.discard(seq)
                continue
            self.now = time
            self.processed += 1
            handler(arg)
        self.now = t
