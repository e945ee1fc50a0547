"""Stopping background tasks for sure: cancel, wait, and cancel again a task that outlived its cancellation.

Python 3.11's ``asyncio.wait_for`` returns the inner result when the inner future completes in the same loop
iteration as the outer task is cancelled, so the cancellation is lost (CPython issue gh-86296, bpo-42130; fixed
in 3.12, where ``wait_for`` is built on ``asyncio.timeout``). A background loop that awaits a library call built
on ``wait_for`` — nats-py's ``request()`` behind JetStream's ``consumer_info``, for one — can therefore survive a
single ``cancel()``, and a shutdown that awaits it waits forever. The router's prefill-queue depth watcher did
exactly that (seen as a hung test teardown, then as a CI run that never finished).

API::

    await cancel_and_wait(st.tasks)        # every task has ended when this returns
    task = await within(work(), budget_s)  # None: the budget was spent and work() stopped for sure

Adapter-level helper (asyncio only); no I/O.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from collections.abc import Coroutine
from typing import Any, TypeVar

_T = TypeVar("_T")

__all__ = ["cancel_and_wait", "within"]

log = logging.getLogger(__name__)


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]], *,
                          recancel_after_s: float = 1.0) -> None:
    """Cancel ``tasks`` and return once every one of them has ended.

    A task still running ``recancel_after_s`` seconds (default 1 s) after a cancellation is cancelled again
    (logged at DEBUG), and so on: a cancellation swallowed by ``wait_for`` (module docstring) cannot keep it
    alive, while a task whose clean-up on cancellation takes a while is interrupted at most once a second.
    Results and exceptions of the tasks are consumed (never raised here, never "never retrieved").

    Raises:
        ValueError: ``recancel_after_s`` is not positive.
        asyncio.CancelledError: the caller itself was cancelled (the tasks have then been cancelled once).
    """
    if not recancel_after_s > 0:
        raise ValueError(f"recancel_after_s must be > 0, got {recancel_after_s!r}")
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    rounds = 0
    while pending:
        for t in pending:
            t.cancel()
        if rounds:
            log.debug("cancelling %d task(s) again (round %d): a cancellation was swallowed", len(pending), rounds)
        _, pending = await asyncio.wait(pending, timeout=recancel_after_s)
        rounds += 1
    for t in tasks:
        if not t.cancelled():
            t.exception()  # retrieved: a failure of a task being stopped is not news at shutdown


async def within(work: Coroutine[Any, Any, _T], budget_s: float | None) -> asyncio.Task[_T] | None:
    """Run ``work`` as a task for at most ``budget_s`` seconds (None: no limit).

    Returns the finished task (read its ``result()``, which raises what ``work`` raised), or None when the budget
    was spent: the task has then been stopped for sure (:func:`cancel_and_wait`), as it is when the caller is
    cancelled meanwhile (Ctrl-C). Unlike ``asyncio.wait_for``, a work that swallows one cancellation cannot outlive
    the budget (module docstring).
    """
    task = asyncio.create_task(work)
    try:
        finished, _ = await asyncio.wait({task}, timeout=budget_s)
    finally:
        if not task.done():
            await cancel_and_wait([task])
    return task if finished else None
