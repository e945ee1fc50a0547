"""Offline profiling of the step latency table, and the mixed load it (and the benchmark) drive an engine with.

Libra §4.2 refines its profile table online (Alg. 2 line 1); this module fills it *before* serving, from
measured steps only: it drives a vLLM engine that runs :mod:`fulcrum.worker.slo_scheduler` without an SLO
(recording, the base scheduler's batching) with synthetic compositions — ``d`` streaming decodes whose
prompts have ``c`` tokens, joined by one prompt of ``p`` tokens — and reads back the table the engine's
scheduler recorded, from its metrics endpoint (``FULCRUM_SCHEDULER_METRICS_PORT``; the table gauges carry
every bucket). Nothing is computed here: every bucket is a step the engine executed and timed.

Prompts are token-id lists (``/v1/completions`` accepts them), so their lengths are exact whatever the
tokenizer; decodes use ``ignore_eos`` so they last ``max_tokens``.

API::

    table = await profile_steps("http://127.0.0.1:8000", "http://127.0.0.1:9400/metrics", model="tiny",
                                prefill_tokens=[64, 256, 1024], decode_counts=[1, 4, 16], contexts=[128, 512])
    table.save("step-table.json")   # FULCRUM_STEP_TABLE for the serving engines

Each composition has a wall-clock budget (``point_timeout_s``, all its tries); one that spends it, or whose
request, stream or metrics read times out (:class:`StepTimeout`), is abandoned; after ``stop_after_timeouts``
compositions in a row failed by timeout the run stops (:class:`StepProfileStopped`: the engine stopped
answering). A composition that fails otherwise (an HTTP error, a broken stream, no mixed step after every rerun)
ends the run with that error, ``StepLog.stopped`` naming it. A :class:`StepLog` records the compositions as they
go, so a caller whose run was interrupted (Ctrl-C), stopped or failed can still read what the engine recorded
(:func:`read_table`) and say what is missing (:meth:`StepLog.partial_note`).

Adapter code (worker layer): aiohttp client.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from fulcrum.cancellation import cancel_and_wait, within
from fulcrum.errors import FulcrumError
from fulcrum.worker.latency_table import StepLatencyTable
from fulcrum.worker.profiler import partial_line, probe_endpoint

__all__ = [
    "MixedLoadResult",
    "StepLog",
    "StepProfileStopped",
    "StepTimeout",
    "StreamTiming",
    "fetch_table",
    "profile_steps",
    "read_table",
    "run_mixed_load",
    "stream_completion",
    "synthetic_prompt",
    "table_from_metrics_text",
]

_TABLE_METRICS = (
    "fulcrum_scheduler_step_table_seconds",
    "fulcrum_scheduler_step_table_samples",
    "fulcrum_scheduler_step_table_mean_prefill_tokens",
)


class StepTimeout(FulcrumError):
    """A streamed completion, the wait for the decodes' chunks or the scheduler metrics did not answer in time."""


class StepProfileStopped(FulcrumError):
    """:func:`profile_steps` stopped early: ``stop_after_timeouts`` compositions in a row failed by timeout (the
    engine stopped answering). What the engine recorded so far is still in its metrics (:func:`read_table`)."""


Composition = tuple[int, int, int]
"""One composition of :func:`profile_steps`: (decode context tokens, decodes, prefill tokens), in measuring order."""


def composition_name(comp: Composition) -> str:
    """``"256 beside 2 decodes (context 64)"``: a composition as messages name it."""
    c, d, p = comp
    return f"{p} beside {d} decodes (context {c})"


@dataclass
class StepLog:
    """What :func:`profile_steps` did so far, filled as it goes: read it after a run that was interrupted or
    stopped early.

    Attributes:
        compositions: every composition of the grid, in measuring order (set once the grid is checked).
        sent: a composition's requests went out to the engine (it may have recorded steps of this run).
        measured: compositions whose mixed step the engine recorded.
        abandoned: compositions that failed by timeout, each with why.
        stopped: why the run stopped early (set by :func:`profile_steps` when the engine stopped answering or a
            composition failed; the caller sets it for an interrupted run), or None.
    """

    compositions: list[Composition] = field(default_factory=list)
    sent: bool = False
    measured: list[Composition] = field(default_factory=list)
    abandoned: list[tuple[Composition, str]] = field(default_factory=list)
    stopped: str | None = None

    @property
    def not_measured(self) -> list[Composition]:
        """Compositions whose mixed step this run did not see recorded (abandoned, in progress or not reached)."""
        done = set(self.measured)
        return [comp for comp in self.compositions if comp not in done]

    def partial_note(self) -> str:
        """One line saying that the run ended early, why, and which compositions it did not measure."""
        return partial_line(self.stopped, len(self.compositions), "compositions",
                            [composition_name(comp) for comp in self.not_measured], 4)

    def partial_marker(self) -> dict[str, object]:
        """The keys that mark a partial table file (the loader ignores them): ``partial``, ``stopped``, ``note``
        and ``notMeasured`` (each ``{prefillTokens, decodes, contextTokens}``)."""
        return {
            "partial": True,
            "stopped": self.stopped,
            "note": self.partial_note(),
            "notMeasured": [{"prefillTokens": p, "decodes": d, "contextTokens": c} for c, d, p in self.not_measured],
        }


def synthetic_prompt(tokens: int, rng: random.Random, token_ids: tuple[int, int] = (100, 1000)) -> list[int]:
    """A prompt of exactly ``tokens`` token ids drawn uniformly from ``token_ids`` (inclusive range).

    Raises ``ValueError`` for fewer than 1 token or an empty range.
    """
    if tokens < 1 or token_ids[1] < token_ids[0]:
        raise ValueError(f"need >= 1 token from a non-empty id range, got {tokens} from {token_ids}")
    return [rng.randint(*token_ids) for _ in range(tokens)]


def table_from_metrics_text(text: str, *, allow_empty: bool = False) -> StepLatencyTable:
    """Rebuild the scheduler's table from its Prometheus exposition (the three ``…_step_table_*`` gauges).

    ``allow_empty`` returns an empty table where the text holds no table metrics (an engine that has not
    executed a step yet).

    Raises:
        FulcrumError: the text holds no table metrics (not the scheduler's endpoint, or nothing recorded), unless
            ``allow_empty``.
    """
    rows: dict[tuple[str, str, str], dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in _TABLE_METRICS:
            continue
        for sample in family.samples:
            key = (sample.labels["prefill_tokens"], sample.labels["context_tokens"], sample.labels["decodes"])
            rows.setdefault(key, {})[family.name] = sample.value
    if not rows and not allow_empty:
        raise FulcrumError("no fulcrum_scheduler_step_table_* samples in the metrics: is this the scheduler's "
                           "endpoint (FULCRUM_SCHEDULER_METRICS_PORT), and has it executed a step?")
    table = StepLatencyTable()
    table.load_entries(
        {
            "prefillTokens": float(p), "contextTokens": float(c), "decodes": float(d),
            "seconds": v[_TABLE_METRICS[0]], "samples": int(v.get(_TABLE_METRICS[1], 1)),
            "meanPrefillTokens": v.get(_TABLE_METRICS[2], float(p)),
        }
        for (p, c, d), v in rows.items()
        if _TABLE_METRICS[0] in v
    )
    return table


async def fetch_table(session: aiohttp.ClientSession, metrics_url: str, *, allow_empty: bool = False) -> StepLatencyTable:
    """GET the scheduler's metrics and rebuild its table (:func:`table_from_metrics_text`).

    Raises:
        FulcrumError: the endpoint is unreachable, answers non-200, or holds no table (unless ``allow_empty``).
    """
    return table_from_metrics_text(await _metrics_text(session, metrics_url), allow_empty=allow_empty)


async def _metrics_text(session: aiohttp.ClientSession, metrics_url: str) -> str:
    """GET ``metrics_url``'s exposition. Raises :class:`FulcrumError` (:class:`StepTimeout`) as :func:`fetch_table`."""
    try:
        async with session.get(metrics_url) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise FulcrumError(f"{metrics_url} answered HTTP {resp.status}")
    except asyncio.TimeoutError as err:
        raise StepTimeout(f"the scheduler metrics at {metrics_url} did not answer in time") from err
    except aiohttp.ClientError as err:
        raise FulcrumError(f"cannot read the scheduler metrics at {metrics_url}: {err}") from err
    return text


async def _check_scheduler_metrics(session: aiohttp.ClientSession, metrics_url: str) -> None:
    """Fail fast unless ``metrics_url`` serves the SLO-aware scheduler's metrics (some ``fulcrum_scheduler_*``
    family: it serves them from its start, before any step).

    Raises:
        FulcrumError: the endpoint cannot be read (as :func:`fetch_table`), or it serves no such metrics (another
            engine's or server's, e.g. vLLM's own ``/metrics`` or ``fulcrum sim-worker``'s, which has no scheduler).
    """
    text = await _metrics_text(session, metrics_url)
    try:
        ours = any(f.name.startswith("fulcrum_scheduler_") for f in text_string_to_metric_families(text))
    except ValueError:  # not a Prometheus exposition at all
        ours = False
    if not ours:
        raise FulcrumError(
            f"{metrics_url} serves no fulcrum_scheduler_* metrics: the step table needs an engine running --scheduler-cls "
            "fulcrum.worker.slo_scheduler.SLOAwareScheduler with FULCRUM_SCHEDULER_METRICS_PORT, and --scheduler-metrics "
            "at that port (fulcrum sim-worker has no such scheduler)")


async def read_table(metrics_url: str, *, allow_empty: bool = False, timeout_s: float = 60.0) -> StepLatencyTable:
    """:func:`fetch_table` in a session of its own, bounded by ``timeout_s`` seconds.

    Raises:
        FulcrumError: as :func:`fetch_table` (:class:`StepTimeout` when the metrics did not answer in time).
    """
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        return await fetch_table(session, metrics_url, allow_empty=allow_empty)


@dataclass
class StreamTiming:
    """Client-side timing of one streamed completion (seconds on the client's monotonic clock).

    Attributes:
        prompt_tokens: prompt length, tokens.
        ttft_s: time from sending to the first token, s.
        itl_s: gaps between consecutive streamed chunks, s (a chunk is usually one token; the server merges
            tokens that end inside a UTF-8 character or that it could not send in time).
        chunks: chunks with text received.
        tokens: completion tokens the server reported (``usage``), or 0 when it sent none.
    """

    prompt_tokens: int
    ttft_s: float = float("nan")
    itl_s: list[float] = field(default_factory=list)
    chunks: int = 0
    tokens: int = 0


async def stream_completion(
    session: aiohttp.ClientSession, base_url: str, *, model: str, prompt: list[int], max_tokens: int,
    first_token: asyncio.Event | None = None, timing: StreamTiming | None = None, stream_interval: int | None = None,
) -> StreamTiming:
    """Send one streaming ``/v1/completions`` request (greedy, ``ignore_eos``) and time its tokens.

    ``first_token`` is set when the first token arrives. Pass ``timing`` (a fresh :class:`StreamTiming`) to
    watch ``timing.chunks`` grow while the stream runs. ``stream_interval`` (tokens, vLLM's per-request
    extension) makes the server send one chunk per that many tokens after the first (the first and last chunks
    go at once): the API server then does a fraction of the per-token work.

    Raises:
        FulcrumError: a non-200 answer, a stream that breaks, times out or carries a chunk that is not a JSON
            object.
    """
    body: dict[str, object] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if stream_interval is not None:
        body["stream_interval"] = int(stream_interval)
    timing = timing if timing is not None else StreamTiming(len(prompt))
    start = last = time.monotonic()
    try:
        async with session.post(f"{base_url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise FulcrumError(f"{base_url} answered HTTP {resp.status}: {(await resp.text())[:200]}")
            async for raw in resp.content:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if not isinstance(event, dict):
                    raise FulcrumError(f"{base_url}: a stream chunk is not a JSON object: {line[:200]}")
                if isinstance(event.get("usage"), dict):
                    timing.tokens = int(event["usage"].get("completion_tokens", 0))
                if not event.get("choices"):  # a usage-only chunk
                    continue
                now = time.monotonic()
                if timing.chunks == 0:
                    timing.ttft_s = now - start
                    if first_token is not None:
                        first_token.set()
                else:
                    timing.itl_s.append(now - last)
                last = now
                timing.chunks += 1
    except asyncio.TimeoutError as err:
        raise StepTimeout(f"{base_url}: the streamed completion did not finish within the session's timeout") from err
    except (aiohttp.ClientError, ValueError, TypeError) as err:
        raise FulcrumError(f"{base_url}: broken stream: {type(err).__name__}: {err}") from err
    return timing


@dataclass
class MixedLoadResult:
    """What :func:`run_mixed_load` measured: the decodes' and the long prompts' stream timings."""

    decodes: list[StreamTiming]
    long_prompts: list[StreamTiming]
    wall_s: float


async def run_mixed_load(
    base_url: str, *, model: str, decodes: int, decode_prompt_tokens: int, decode_max_tokens: int,
    long_prompts: int, long_prompt_tokens: int, long_max_tokens: int = 2, long_gap_s: float = 0.0,
    seed: int = 0, timeout_s: float = 600.0,
) -> MixedLoadResult:
    """The interference load of Libra §4.2: ``decodes`` short-prompt long decodes, and once they all stream,
    ``long_prompts`` long prompts (sent ``long_gap_s`` apart) that must prefill beside them.

    Returns every stream's timing. Raises :class:`FulcrumError` when a request fails.
    """
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    start = time.monotonic()
    async with aiohttp.ClientSession(timeout=timeout) as session:
        started = [asyncio.Event() for _ in range(decodes)]
        decode_tasks = [
            asyncio.create_task(stream_completion(
                session, base_url, model=model, prompt=synthetic_prompt(decode_prompt_tokens, rng),
                max_tokens=decode_max_tokens, first_token=ev))
            for ev in started
        ]
        try:
            await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in started)), timeout_s)
            long_tasks = []
            for i in range(long_prompts):
                if i and long_gap_s > 0:
                    await asyncio.sleep(long_gap_s)
                long_tasks.append(asyncio.create_task(stream_completion(
                    session, base_url, model=model, prompt=synthetic_prompt(long_prompt_tokens, rng),
                    max_tokens=long_max_tokens)))
            long_timings = await asyncio.gather(*long_tasks)
            decode_timings = await asyncio.gather(*decode_tasks)
        finally:
            await cancel_and_wait(decode_tasks)  # finished ones stay as they are; a failure aborts the rest
    return MixedLoadResult(list(decode_timings), list(long_timings), time.monotonic() - start)


async def _wait_for_chunks(streams: Sequence[StreamTiming], tasks: Sequence[asyncio.Task[StreamTiming]],
                           at_least: Sequence[int], timeout_s: float) -> None:
    """Wait until every ``streams[i]`` has ``at_least[i]`` chunks (or its task ended). Raises on a failed task
    (also when every task has ended, one of them by failing: the decodes did not run)."""
    deadline = time.monotonic() + timeout_s
    while True:
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        if not any(t.chunks < n and not task.done() for t, task, n in zip(streams, tasks, at_least, strict=True)):
            return
        if time.monotonic() > deadline:
            raise StepTimeout(f"the decodes did not stream within {timeout_s:g} s")
        await asyncio.sleep(0.002)


def _decode_caps(first: int, longest: int | None, tries: int) -> list[int]:
    """The decode caps of a composition's ``tries`` tries, tokens: ``first``, doubling, at most ``longest``."""
    return [first * 2**i if longest is None else min(first * 2**i, longest) for i in range(tries)]


def _mixed_steps(table: StepLatencyTable, decodes: int, prefill: int) -> int:
    """Measured steps in the buckets of ``prefill`` tokens beside ``decodes`` decodes (any decode context)."""
    key = StepLatencyTable.key_for(prefill, 0, decodes)
    return sum(e.samples for e in table
               if e.key.prefill_tokens == key.prefill_tokens and e.key.decodes == key.decodes)


async def _profile_composition(
    session: aiohttp.ClientSession, base_url: str, metrics_url: str, *, model: str, decodes: int, context: int,
    prefill: int, decode_cap: int, rng: random.Random, timeout_s: float, stream_interval: int,
) -> bool:
    """One composition of :func:`profile_steps`: ``decodes`` streams of ``context``-token prompts, then one
    ``prefill``-token prompt beside them, then the decodes alone again; the decodes are cancelled (the engine
    aborts them) once each has streamed one more chunk (``stream_interval`` tokens) after the prompt's prefill.

    Whether the prompt's prefill ran beside the decodes is read from the engine's own table (the bucket of
    ``prefill`` tokens beside ``decodes`` decodes gained a step), not from the client's view of the streams:
    when the API server lags the engine core, a client can see the prompt's token before or after the decodes'
    last ones whatever the engine did. The table is read while the engine is idle (before the decodes start,
    after they are cancelled): the engine core serves its metrics from a thread that a busy core starves.
    Returns False when that step is not there (a decode had reached ``decode_cap`` before the prompt was
    admitted; the caller retries with a larger cap). Raises :class:`FulcrumError` on a failed request or an
    unreadable table.
    """
    before = _mixed_steps(await fetch_table(session, metrics_url, allow_empty=True), decodes, prefill)
    timings = [StreamTiming(context) for _ in range(decodes)]
    tasks = [
        asyncio.create_task(stream_completion(session, base_url, model=model, prompt=synthetic_prompt(context, rng),
                                              max_tokens=decode_cap, timing=t, stream_interval=stream_interval))
        for t in timings
    ]
    try:
        # decode-only steps with all ``decodes`` running: each stream has its first token and the next chunk
        await _wait_for_chunks(timings, tasks, [2] * decodes, timeout_s)
        await stream_completion(session, base_url, model=model, prompt=synthetic_prompt(prefill, rng), max_tokens=1)
        # decode-only steps after the mixed one
        await _wait_for_chunks(timings, tasks, [t.chunks + 1 for t in timings], timeout_s)
    finally:
        await cancel_and_wait(tasks)
    # the prompt's step was recorded before its token left the engine core
    return _mixed_steps(await fetch_table(session, metrics_url, allow_empty=True), decodes, prefill) > before


async def profile_steps(
    base_url: str, metrics_url: str, *, model: str, prefill_tokens: Sequence[int], decode_counts: Sequence[int],
    contexts: Sequence[int], decode_tokens: int = 256, seed: int = 0, timeout_s: float = 600.0, retries: int = 4,
    stream_interval: int = 16, point_timeout_s: float | None = None, stop_after_timeouts: int = 1,
    log: StepLog | None = None, warn: Callable[[str], None] | None = None,
) -> StepLatencyTable:
    """Fill the step latency table from measured steps of a running engine (the offline mode of Alg. 2's table).

    For every context ``c`` in ``contexts`` (tokens), decode count ``d`` in ``decode_counts`` and prefill size
    ``p`` in ``prefill_tokens`` (tokens): ``d`` decodes with ``c``-token prompts stream (decode-only steps),
    one ``p``-token prompt prefills beside all of them (the mixed step), the decodes stream a few more steps
    alone, then they are cancelled. The engine's scheduler records every step; afterwards the table is read
    from ``metrics_url``. Whether the mixed step ran is checked in that table after every composition (its
    bucket gained a step). ``decode_tokens`` caps each decode (tokens): it only has to outlast the prompt's
    admission; when the mixed step is missing (a decode reached the cap first), the composition is run again
    with twice the cap, at most the engine's ``max_model_len`` (``/v1/models``) less the context (``retries``
    reruns at most, >= 0; ``fulcrum profile --step-table`` passes ``--retries``, default 4). The decodes stream
    one chunk per ``stream_interval`` tokens (vLLM's per-request ``stream_interval``), a sixteenth of the API
    server's per-token work at the default.

    Why the reruns: a fast engine (a small model on a CPU: ~2 ms a step) can outrun its own API server, which
    then stops taking new requests and sending tokens until the running ones end (seen with vLLM 0.32's CPU
    engine, for up to 1.5 s, in about one composition of ten on a loaded 2-core machine); the prompt then
    prefills alone and the composition is run again.

    The engine must run ``--scheduler-cls fulcrum.worker.slo_scheduler.SLOAwareScheduler`` without
    ``FULCRUM_TPOT_SLO_MS`` (recording only) and with ``FULCRUM_SCHEDULER_METRICS_PORT``. Its
    ``--max-model-len`` must exceed ``max(contexts) + 8`` and ``max(prefill_tokens)``, and its
    ``--max-num-batched-tokens`` must reach ``max(prefill_tokens) + max(decode_counts)`` (a chunked prompt lands
    in smaller buckets, and its composition is not measured).

    A hung engine: every request, stream wait and metrics read is bounded by ``timeout_s``, and each
    composition (all its tries) by ``point_timeout_s`` seconds of wall clock (None: no budget beyond
    ``timeout_s`` per request). A composition that spends its budget, or one of whose requests times out
    (:class:`StepTimeout`), is abandoned (its requests cancelled; ``warn`` is told, ``log.abandoned`` records it)
    and the run goes on with the next; after ``stop_after_timeouts`` compositions in a row failed by timeout (a
    measured one restarts the count; 0 = never stop) it raises :class:`StepProfileStopped`. The default, 1, stops
    at the first timeout, as this function always did. A composition that fails otherwise (an HTTP error, a broken
    stream or metrics read, no mixed step after every rerun) ends the run: the error is raised as it was, with
    ``log.stopped`` set to ``composition <p> beside <d> decodes (context <c>) failed: <error>``. Pass ``log`` (a
    fresh :class:`StepLog`) to know, after an interrupted, stopped or failed run, which compositions were measured
    (``log.sent``: whether any request went out); the table itself stays in the engine (:func:`read_table`).

    Raises:
        ValueError: an empty or non-positive grid, ``decode_tokens`` < 8, ``stream_interval`` < 1, a ``timeout_s``
            or ``point_timeout_s`` that is not a positive number of seconds, ``stop_after_timeouts`` < 0,
            ``retries`` < 0 (these four named by the flags of ``fulcrum profile``: ``--request-timeout-s``,
            ``--point-timeout-s``, ``--stop-after-timeouts``, ``--retries``), or a context or prompt that the
            engine's ``max_model_len`` cannot hold.
        ProfileError: the endpoint does not answer ``/v1/models`` or does not serve ``model``.
        StepProfileStopped: ``stop_after_timeouts`` compositions in a row failed by timeout.
        FulcrumError: ``metrics_url`` cannot be read or serves no ``fulcrum_scheduler_*`` metrics (before anything is
            sent), a request fails otherwise, a composition's mixed step was still missing after ``retries`` reruns
            (``log.stopped`` says which composition, for both), or the metrics hold no table.
    """
    grids = {"prefill_tokens": prefill_tokens, "decode_counts": decode_counts, "contexts": contexts}
    for name, grid in grids.items():
        if not grid or any(int(v) < 1 for v in grid):
            raise ValueError(f"{name} must be a non-empty list of positive integers, got {list(grid)!r}")
    if decode_tokens < 8:
        raise ValueError(f"decode_tokens must be >= 8 (the decodes stream before and after the prompt), got {decode_tokens}")
    if stream_interval < 1:
        raise ValueError(f"stream_interval must be >= 1 token, got {stream_interval}")
    # the budget and retry values, checked here once for this function and ``fulcrum profile --step-table``: the
    # messages name the command's flags (as ProfileGrid's do for the profile mode)
    for flag, v in (("--request-timeout-s", timeout_s), ("--point-timeout-s", point_timeout_s)):
        if v is not None and not (math.isfinite(v) and v > 0):
            raise ValueError(f"{flag} must be a positive number of seconds, got {v}")
    if stop_after_timeouts < 0:
        raise ValueError(f"--stop-after-timeouts must be >= 0, got {stop_after_timeouts}")
    if retries < 0:
        raise ValueError(f"--retries must be >= 0, got {retries}")
    log = log if log is not None else StepLog()
    log.compositions = [(int(c), int(d), int(p)) for c in contexts for d in decode_counts for p in prefill_tokens]

    def say(msg: str) -> None:
        if warn is not None:
            warn(msg)

    rng = random.Random(seed)
    # a connection per request: a kept-alive one can be closed by the server (its keep-alive timeout, or the
    # abort of a cancelled stream) just as the next request goes out on it (seen under load)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                     connector=aiohttp.TCPConnector(force_close=True)) as session:
        max_model_len = (await probe_endpoint(session, base_url, model)).max_model_len
        if max_model_len is not None:
            too_long = [v for v in (*(int(c) + 8 for c in contexts), *(int(p) for p in prefill_tokens)) if v > max_model_len]
            if too_long:
                raise ValueError(f"the engine's max_model_len is {max_model_len} tokens: contexts + 8 decode tokens and "
                                 f"prompts must fit in it (got {max(too_long)})")
        # the scheduler's metrics once before anything is sent: a wrong --scheduler-metrics, or an engine without the
        # scheduler, is bad input (exit 2), not a composition that failed mid-run
        await _check_scheduler_metrics(session, metrics_url)
        in_a_row = 0
        for comp in log.compositions:
            c, d, p = comp
            caps = _decode_caps(decode_tokens, max_model_len - c if max_model_len is not None else None, retries + 1)

            async def tries(c: int = c, d: int = d, p: int = p, caps: list[int] = caps) -> bool:
                for cap in caps:
                    if await _profile_composition(session, base_url, metrics_url, model=model, decodes=d,
                                                  context=c, prefill=p, decode_cap=cap, rng=rng,
                                                  timeout_s=timeout_s, stream_interval=int(stream_interval)):
                        return True
                return False

            log.sent = True
            # the budget runs in its own task, stopped for sure (within: its decodes are cancelled too)
            # when spent or when this one is cancelled (Ctrl-C): a hung engine costs a composition at most the budget
            task = await within(tries(), point_timeout_s)
            why = None
            if task is None:
                why = f"budget of {point_timeout_s:g} s spent (--point-timeout-s)"
            else:
                try:
                    measured = task.result()
                    if not measured:
                        raise FulcrumError(
                            f"the {p}-token prompt did not prefill beside the {d} decodes (context {c}) in {retries + 1} "
                            f"tries (decode caps {caps} tokens): the engine's table has no such step. Is the engine "
                            f"overloaded (raise --retries: each rerun doubles the decode cap), or "
                            f"--max-num-batched-tokens below {p + d} (the prompt was chunked)?")
                except StepTimeout as err:
                    why = str(err)
                except FulcrumError as err:
                    # the run ends here; the caller keeps what the engine recorded so far (log.sent is set)
                    log.stopped = f"composition {composition_name(comp)} failed: {err}"
                    raise
            if why is None:
                log.measured.append(comp)
                in_a_row = 0
                continue
            log.abandoned.append((comp, why))
            in_a_row += 1
            say(f"composition {composition_name(comp)}: {why}; abandoned")
            if stop_after_timeouts and in_a_row >= stop_after_timeouts:
                log.stopped = (f"the engine stopped answering ({in_a_row} composition(s) in a row failed by timeout, "
                               f"the last {composition_name(comp)}: {why})")
                say(f"{log.stopped}; stopping")
                raise StepProfileStopped(log.stopped)
    return await read_table(metrics_url)
