"""``cancel_and_wait`` stops a loop whose cancellation ``asyncio.wait_for`` swallowed (Python 3.11, gh-86296)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from fulcrum.cancellation import cancel_and_wait, within

pytestmark = pytest.mark.asyncio


async def _swallowing_loop(futures: "asyncio.Queue[asyncio.Future[None]]", laps: list[int]) -> None:
    """A background loop like the router's depth watcher: each lap awaits a library call built on wait_for."""
    while True:
        fut = await futures.get()
        await asyncio.wait_for(fut, 10)
        laps.append(1)
        await asyncio.sleep(0.01)


async def _start_racing_cancel() -> tuple[asyncio.Task[None], list[int]]:
    """Start the loop and cancel it in the loop iteration where its awaited future completes."""
    loop = asyncio.get_running_loop()
    futures: asyncio.Queue[asyncio.Future[None]] = asyncio.Queue()
    laps: list[int] = []
    task = asyncio.create_task(_swallowing_loop(futures, laps))
    fut: asyncio.Future[None] = loop.create_future()
    futures.put_nowait(fut)
    for _ in range(5):  # the task reaches wait_for and awaits its inner waiter
        await asyncio.sleep(0)
    fut.set_result(None)  # wait_for's waiter is released on the next callback run...
    await asyncio.sleep(0)  # ...which happens before this coroutine resumes, the task's wake-up after it
    task.cancel()  # wait_for sees the cancellation with its future done
    return task, laps


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="Python 3.12+ wait_for no longer swallows a cancellation")
async def test_the_race_is_real_a_single_cancel_leaves_the_loop_running() -> None:
    task, laps = await _start_racing_cancel()
    await asyncio.sleep(0.1)
    assert not task.done() and laps == [1]  # the loop went on past its cancellation
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_cancel_and_wait_ends_a_loop_that_swallowed_its_cancellation() -> None:
    task, _ = await _start_racing_cancel()
    await asyncio.wait_for(cancel_and_wait([task], recancel_after_s=0.05), 5)
    assert task.cancelled()


async def test_finished_failed_and_running_tasks_all_end_and_failures_are_consumed() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    async def forever() -> None:
        await asyncio.Event().wait()

    failed = asyncio.create_task(fails())
    done = asyncio.create_task(asyncio.sleep(0))
    running = asyncio.create_task(forever())
    await asyncio.sleep(0.01)
    await cancel_and_wait([failed, done, running])
    assert failed.done() and done.done() and running.cancelled()


async def test_a_non_positive_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="recancel_after_s"):
        await cancel_and_wait([], recancel_after_s=0)


async def test_within_returns_the_finished_task_or_none_with_the_work_stopped_for_sure() -> None:
    async def quick() -> int:
        return 7

    async def failing() -> int:
        raise ValueError("engine said no")

    done = await within(quick(), 1.0)
    assert done is not None and done.result() == 7
    failed = await within(failing(), None)
    assert failed is not None
    with pytest.raises(ValueError, match="engine said no"):
        failed.result()

    ended: list[str] = []

    async def stubborn() -> None:  # swallows its first cancellation, as a wait_for-based library call may
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            ended.append("swallowed")
        await asyncio.sleep(10)

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await within(stubborn(), 0.05) is None
    assert ended == ["swallowed"] and loop.time() - t0 < 5.0  # re-cancelled after 1 s, not left running
