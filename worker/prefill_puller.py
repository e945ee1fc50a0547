"""The worker's side of the NATS prefill queue (DOPD §V-C): pull the LLMServe's prefill jobs for the local engine.

With ``router.prefillQueue: nats`` the router publishes every prefill leg to a JetStream work queue instead of
calling a prefill instance directly; each prefill-capable worker pod (role ``prefill`` or ``both``) runs a puller
next to its engine (``fulcrum.router.prefill_queue.run_prefill_worker``), so the pool is elastic by construction:
a new pod adds pulling capacity, a draining one stops pulling.

:class:`PrefillPuller` has the shape of a registration (``start()`` once the engine is ready, ``stop()`` when the
worker starts to drain), so ``fulcrum worker`` and ``fulcrum sim-worker`` start and stop it exactly where they
register in and deregister from etcd; :class:`Registrations` runs several such things as one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Protocol

from fulcrum.cancellation import cancel_and_wait
from fulcrum.router.prefill_queue import QueueLayout, run_prefill_worker

__all__ = ["Startable", "PrefillPuller", "Registrations"]

log = logging.getLogger(__name__)


class Startable(Protocol):
    """Something started once the engine serves and stopped when the worker drains."""

    async def start(self) -> bool: ...

    async def stop(self) -> None: ...


class PrefillPuller:
    """Pull prefill jobs of one LLMServe's queue for the engine at ``engine_url``.

    Args:
        nats_url: NATS URL(s), e.g. ``nats://nats:4222``.
        engine_url: the local engine, e.g. ``http://127.0.0.1:8000``.
        namespace, llmserve: whose queue (:meth:`QueueLayout.for_llmserve`: the names the router uses too).
        worker_id: this pod's id (logs and job replies).
        concurrency: jobs in hand at once (the engine batches them).
        stop_timeout_s: longest wait for the jobs in hand at ``stop()``, seconds; then they are nak'ed (another
            worker gets them at once).

    Raises:
        ValueError: empty namespace or LLMServe name.
    """

    def __init__(self, nats_url: str, engine_url: str, *, namespace: str, llmserve: str, worker_id: str,
                 concurrency: int = 4, stop_timeout_s: float = 60.0) -> None:
        self.layout = QueueLayout.for_llmserve(namespace, llmserve)
        self._nats_url = nats_url
        self._engine_url = engine_url
        self._worker_id = worker_id
        self._concurrency = concurrency
        self._stop_timeout_s = stop_timeout_s
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def key(self) -> str:
        """What it pulls from (for logs)."""
        return f"nats stream {self.layout.stream}"

    async def start(self) -> bool:
        """Start pulling in the background (the puller connects, and reconnects, by itself). Returns True."""
        if self._task is None:
            self._stop.clear()
            self._task = asyncio.create_task(self._run(), name="prefill-puller")
        return True

    async def _run(self) -> None:
        try:
            await run_prefill_worker(
                self._nats_url, self._engine_url, stream=self.layout.stream,
                subject_prefix=self.layout.subject_prefix, durable=self.layout.durable,
                ack_wait_s=self.layout.ack_wait_s, max_deliver=self.layout.max_deliver,
                concurrency=self._concurrency, worker_id=self._worker_id, stop=self._stop,
            )
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the engine keeps serving direct requests; the pod stays up
            log.exception("prefill puller for %s stopped with an error", self.layout.stream)

    async def stop(self) -> None:
        """Stop pulling; wait for the jobs in hand (at most ``stop_timeout_s``), then cancel (they are nak'ed)."""
        task, self._task = self._task, None
        if task is None:
            return
        self._stop.set()
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=self._stop_timeout_s)
        except asyncio.TimeoutError:
            await cancel_and_wait([task])


class Registrations:
    """Several registrations as one: started in order, stopped in reverse order; ``start()`` is True when all
    started (each keeps retrying in the background otherwise)."""

    def __init__(self, parts: Sequence[Startable]) -> None:
        self._parts = list(parts)

    @property
    def key(self) -> str:
        """The parts' keys, joined."""
        return ", ".join(str(getattr(p, "key", type(p).__name__)) for p in self._parts)

    async def start(self) -> bool:
        ok = True
        for p in self._parts:
            ok = await p.start() and ok
        return ok

    async def stop(self) -> None:
        for p in reversed(self._parts):
            await p.stop()
