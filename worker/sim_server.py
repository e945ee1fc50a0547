"""The sim-worker's HTTP server: an OpenAI-compatible engine emulator timed by a performance profile.

A product feature, not a test fake: it runs as the worker pods of an ``LLMServe`` with
``spec.engine.kind: sim`` (GPU-free clusters, e2e tests) and behind the router in tests. One
:class:`~fulcrum.worker.sim_engine.SimEngine` does the batching and the timing; this module serves it:

- ``POST /v1/completions`` and ``/v1/chat/completions``: streamed (SSE, ``stream_options.include_usage``) or
  whole; ``max_tokens`` (chat: also ``max_completion_tokens``), ``stop`` strings, ``ignore_eos`` (accepted; the
  emulated model never emits EOS, so every request runs to ``max_tokens`` or a stop string), ``return_token_ids``,
  ``logprobs`` on completions (each token's string, log-probability 0.0: greedy output is certain), ``logprobs``/
  ``top_logprobs`` on chat (``choices[].logprobs.content``: each token's entry with log-probability 0.0 and, when
  ``top_logprobs`` > 0, itself as its one alternative; in every streamed token chunk too; checked with vLLM's 400s:
  ``top_logprobs`` without ``logprobs``, below −1, or past ``max_logprobs`` = 20), model-name check (404 like
  vLLM), context check (400 with vLLM's message), ``n > 1``/``best_of``/``echo`` refused (400).
  A client that goes away aborts its request (its KV is freed at once).
- ``POST /tokenize`` (``prompt`` or ``messages``), ``POST /detokenize``, ``GET /v1/models``, ``GET /health``
  (200 while serving, 503 once draining), ``GET /metrics`` (vLLM's metric names, one
  ``prometheus_client.CollectorRegistry`` per app).
- The **NIXL ``kv_transfer_params`` protocol** of vLLM's ``NixlConnector`` (docs/connectors.md,
  router/handoff.py): a non-streamed request with ``do_remote_decode`` keeps its KV blocks after it finishes and
  answers ``kv_transfer_params`` = ``{do_remote_prefill: true, remote_engine_id, remote_block_ids, remote_host,
  remote_port, remote_request_id, remote_num_tokens, tp_size}`` where ``remote_num_tokens = P + n − 1`` after n
  generated tokens (P + k for a handoff after k tokens: A ran ``max_tokens = k + 1``) and the block list covers
  exactly those tokens; ``remote_host``/``remote_port`` are this server's own address (its HTTP port doubles as
  the side channel). A request with ``do_remote_prefill`` **pulls** those blocks from the named worker over HTTP
  (``POST {remote_host}:{remote_port}/fulcrum/kv/pull``: a real pull from the other process, which frees them),
  is charged ``profile.kv_transfer_seconds(tokens, kv_transfer_gbps)`` (× ``time_scale``) before it may run,
  and computes only what the KV lacks (at least its last prompt token). Held KV nobody pulls is freed after
  ``kv_hold_timeout_s`` (vLLM's ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s).
- **Uncovered prompts get 400**: a prompt needing more blocks than ``remote_block_ids`` lists, or whose tokens
  (all but the last) the pulled KV does not hold, is refused with the reason. vLLM's decode engine would crash
  instead (``assert num_decode_blocks <= len(prefill_group)``) or silently decode on the wrong KV. When the pull
  itself fails (the source is gone, the KV expired) the request recomputes its prompt locally, as vLLM's
  default ``kv_load_failure_policy`` does, and ``vllm:nixl_num_failed_transfers_total`` counts it.

Timing: one engine-loop task runs :meth:`SimEngine.step` and sleeps each step's emulated duration, on a
timeline that catches up when the event loop wakes a little late (up to 50 ms behind), so measured TTFT and TPOT
follow the profile while the process keeps up; beyond that the timeline restarts from now and the measured
latencies grow — which the benchmark (benchmarks/bench_sim_worker.py) measures.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import TypeAdapter, ValidationError

from fulcrum.cancellation import cancel_and_wait
from fulcrum.ratio.profile import PerformanceProfile
from fulcrum.router.registry_etcd import EtcdRegistration
from fulcrum.worker.sim_engine import (
    VOCAB_SIZE,
    SimEngine,
    SimEngineConfig,
    StepOutput,
    chat_token_ids,
    encode_text,
)

__all__ = ["SimServerSettings", "SimWorker", "SIM_WORKER", "create_sim_app", "serve"]

log = logging.getLogger(__name__)

_MAX_LAG_S = 0.05
"""How far behind its timeline the engine loop may wake and still keep it (seconds of real time)."""

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


@dataclass(frozen=True)
class SimServerSettings:
    """What the server says about itself.

    Attributes:
        model: served model name (requests naming another model get 404).
        engine_id: this worker's id (``remote_engine_id`` in ``kv_transfer_params``; the pod name in a cluster).
        max_model_len: context limit, tokens (prompt + max_tokens).
        kv_transfer_gbps: link bandwidth charged for KV pulled into this worker, GB/s (50: a 400 Gb/s NIC).
        kv_hold_timeout_s: held KV nobody pulls is freed after this, seconds (vLLM's 480 s default).
        advertise_host: ``remote_host`` answered to ``do_remote_decode`` (None: the local address the request
            came in on).
        advertise_port: ``remote_port`` likewise (None: the local port the request came in on).
        pull_timeout_s: deadline of one KV pull from another worker, seconds.
    """

    model: str
    engine_id: str
    max_model_len: int
    kv_transfer_gbps: float = 50.0
    kv_hold_timeout_s: float = 480.0
    advertise_host: str | None = None
    advertise_port: int | None = None
    pull_timeout_s: float = 10.0


class _Metrics:
    """vLLM's metric names (DESIGN, "Metrics"), on the app's own registry."""

    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        lab = ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", lab, registry=r).labels(model)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting", lab, registry=r).labels(model)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage, 0..1", lab, registry=r).labels(model)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", lab,
                              buckets=_LATENCY_BUCKETS, registry=r).labels(model)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency", lab,
                             buckets=_LATENCY_BUCKETS, registry=r).labels(model)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds", "Mean time per output token per request",
                              lab, buckets=_LATENCY_BUCKETS, registry=r).labels(model)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", lab,
                             buckets=_LATENCY_BUCKETS, registry=r).labels(model)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time from arrival to the first step", lab,
                               buckets=_LATENCY_BUCKETS, registry=r).labels(model)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens", lab, registry=r).labels(model)
        self.by_source = Counter("vllm:prompt_tokens_by_source", "Prompt tokens by source", lab + ["source"],
                                 registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", lab, registry=r).labels(model)
        self.req_prompt = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request", lab,
                                    buckets=_TOKEN_BUCKETS, registry=r).labels(model)
        self.req_gen = Histogram("vllm:request_generation_tokens", "Generated tokens per request", lab,
                                 buckets=_TOKEN_BUCKETS, registry=r).labels(model)
        self.success = Counter("vllm:request_success", "Finished requests", lab + ["finished_reason"], registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions", lab, registry=r).labels(model)
        self.xfer = Histogram("vllm:nixl_xfer_time_seconds", "Emulated KV transfer time", lab,
                              buckets=_LATENCY_BUCKETS, registry=r).labels(model)
        self.xfer_failed = Counter("vllm:nixl_num_failed_transfers", "Failed KV pulls", lab, registry=r).labels(model)
        self.model = model


class _Stream:
    """Tokens of one live request, as the engine loop delivers them (batched: one wake-up per step)."""

    __slots__ = ("tokens", "event", "done", "arrival", "first_at", "last_at", "scheduled_at", "n")

    def __init__(self, arrival: float) -> None:
        self.tokens: list[int] = []
        self.event = asyncio.Event()
        self.done = False
        self.arrival = arrival
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.scheduled_at: float | None = None
        self.n = 0

    async def batches(self) -> Any:
        """Yield lists of new token ids until the request finished (``done``)."""
        while True:
            await self.event.wait()
            self.event.clear()
            got, self.tokens = self.tokens, []
            if got:
                yield got
            if self.done:
                return


_BOOL = TypeAdapter(bool)
_INT = TypeAdapter(int)
_MAX_LOGPROBS = 20
"""Most ``logprobs`` a completion request may ask for (vLLM's default ``max_logprobs``)."""


def _lax_bool(value: Any, name: str) -> bool:
    """``value`` read as vLLM's request models read a boolean field (pydantic's lax mode: ``true``, ``"yes"``,
    ``1``...); None is False.

    Raises:
        _BadRequest: 400, a value pydantic would not read as a boolean (vLLM answers 400 too).
    """
    if value is None:
        return False
    try:
        return bool(_BOOL.validate_python(value))
    except ValidationError:
        raise _BadRequest(400, f"{name}: Input should be a valid boolean, got {value!r}") from None


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _json_object(raw: bytes) -> dict[str, Any]:
    """A request body read as a JSON object.

    Raises:
        _BadRequest: 400, a body that is not JSON (also one nested too deeply for the parser: ``json`` raises
            RecursionError on it), or JSON that is not an object.
    """
    try:
        body = json.loads(raw)
    except RecursionError:
        raise _BadRequest(400, "body is not JSON: nested too deeply") from None
    except ValueError:
        raise _BadRequest(400, "body is not JSON") from None
    if not isinstance(body, dict):
        raise _BadRequest(400, "body must be a JSON object")
    return body


def _error(status: int, message: str) -> web.Response:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": status}},
                             status=status)


def _lax_int(value: Any, name: str) -> int | None:
    """``value`` read as vLLM's request models read an integer field (pydantic's lax mode: ``5``, ``"5"``,
    ``5.0``...); None stays None.

    Raises:
        _BadRequest: 400, a value pydantic would not read as an integer (vLLM answers 400 too).
    """
    if value is None:
        return None
    try:
        return int(_INT.validate_python(value))
    except ValidationError:
        raise _BadRequest(400, f"{name}: Input should be a valid integer, got {value!r}") from None


def _stops(body: dict[str, Any]) -> list[str]:
    """The request's non-empty stop strings.

    Raises:
        _BadRequest: 400, a ``stop`` that is neither a string nor a list of strings (vLLM refuses it too).
    """
    st = body.get("stop")
    if st is None:
        return []
    if isinstance(st, str):
        return [st] if st else []
    if isinstance(st, list) and all(isinstance(x, str) for x in st):
        return [x for x in st if x]
    raise _BadRequest(400, f"stop must be a string or a list of strings, got {st!r}")


def _piece(tok: int) -> str:
    return bytes([tok]).decode("utf-8", errors="replace")


def _chat_top_logprobs(body: dict[str, Any]) -> int | None:
    """How many alternatives a chat request wants with each token's log-probability (``top_logprobs``, 0..20),
    or None when it wants no log-probabilities (``logprobs`` false or absent).

    Read as vLLM reads them: its ``ChatCompletionRequest.check_logprobs`` validator sees the raw JSON before
    pydantic (a ``top_logprobs`` that is no number is refused there; ``logprobs`` is tested for truth, so
    ``"false"`` passes it and pydantic then reads it as False), then pydantic's lax ``bool``/``int``, then the
    engine's ``max_logprobs`` (20; ``-1`` asks for the whole vocabulary, 256 tokens). A null ``top_logprobs`` is
    the default, 0.

    Raises:
        _BadRequest: 400 with vLLM's message.
    """
    raw = body.get("top_logprobs")
    if raw is not None:
        if not isinstance(raw, (int, float)):
            raise _BadRequest(400, "`top_logprobs` must be an integer.")
        if raw < 0 and raw != -1:
            raise _BadRequest(400, "`top_logprobs` must be a positive value or -1.")
        if (raw == -1 or raw > 0) and not body.get("logprobs"):
            raise _BadRequest(400, "when using `top_logprobs`, `logprobs` must be set to true.")
    wanted = _lax_bool(body.get("logprobs"), "logprobs")
    top = _lax_int(raw, "top_logprobs") or 0
    if not wanted:
        return None
    n = VOCAB_SIZE if top == -1 else top
    if n > _MAX_LOGPROBS:
        raise _BadRequest(400, f"Requested sample logprobs of {n}, which is greater than max allowed: {_MAX_LOGPROBS}")
    return top


def _chat_logprob(tok: int, top: int) -> dict[str, Any]:
    """One token's entry of a chat answer's ``logprobs.content`` (OpenAI's shape): log-probability 0.0 (greedy
    output is certain), so the token itself is its one alternative when ``top`` > 0 (every other token's
    probability is 0)."""
    piece = _piece(tok)
    entry: dict[str, Any] = {"token": piece, "logprob": 0.0, "bytes": list(piece.encode())}
    return {**entry, "top_logprobs": [dict(entry)] if top > 0 else []}


class SimWorker:
    """The emulator's state behind the HTTP app: engine, engine loop, live streams, metrics, drain flag.

    Args:
        profile: latency tables.
        engine_config: the engine's shape (see :class:`SimEngineConfig`).
        settings: served model, ids, limits.
        clock: monotonic seconds (the event loop's clock by default; the engine loop sleeps on it).
    """

    def __init__(self, profile: PerformanceProfile, engine_config: SimEngineConfig, settings: SimServerSettings,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.profile = profile
        self.engine = SimEngine(profile, engine_config)
        self.settings = settings
        self.metrics = _Metrics(settings.model)
        self.draining = False
        self._clock = clock
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._release: dict[str, asyncio.TimerHandle] = {}
        self._seq = 0
        self.steps = 0
        """Engine steps run so far."""

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the engine loop and the pull client (app start-up)."""
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._run_loop(), name="sim-engine-loop")
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.settings.pull_timeout_s))

    async def close(self) -> None:
        """Stop the engine loop, cancel hold timers, close the pull client (app clean-up)."""
        task, self._loop_task = self._loop_task, None
        if task is not None:
            await cancel_and_wait([task])
        for h in self._release.values():
            h.cancel()
        self._release.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def busy(self) -> int:
        """Requests running or waiting in the engine, plus answers still being written."""
        return self.engine.num_running + self.engine.num_waiting + len(self._streams)

    def start_draining(self) -> None:
        """Fail ``/health`` from now on (readiness drops, the router stops sending); requests still served."""
        self.draining = True

    async def wait_drained(self, timeout_s: float, held_grace_s: float = 10.0) -> bool:
        """Wait until no request runs, waits or is being answered (True), or ``timeout_s`` passes (False); then
        up to ``held_grace_s`` more for held KV to be pulled by the decode side (a handoff in flight)."""
        deadline = self._clock() + timeout_s
        while self.busy and self._clock() < deadline:
            await asyncio.sleep(0.05)
        drained = self.busy == 0
        grace = min(deadline, self._clock() + held_grace_s)
        while self.engine.num_held and self._clock() < grace:
            await asyncio.sleep(0.05)
        return drained

    # ------------------------------------------------------------------ engine loop
    async def _run_loop(self) -> None:
        prev_end: float | None = None
        while True:
            now = self._clock()
            preemptions = self.engine.num_preemptions
            out = self.engine.step(now)
            self._gauges()
            if out is None:
                prev_end = None
                if self.engine.num_preemptions != preemptions:
                    continue  # the step only preempted: the next one schedules with the freed blocks
                # Sleep until a transfer completes (a ready_at in the future) or something changes (_wake: a new
                # request, an abort, KV pulled or released). A waiting request that is ready but cannot get KV
                # blocks is no reason to wake: only freed blocks (which set _wake) can let it in.
                wake = self.engine.next_ready_at()
                self._wake.clear()
                timeout = None if wake is None or wake <= now else wake - now
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)
                continue
            self.steps += 1
            start = prev_end if prev_end is not None and now - prev_end <= _MAX_LAG_S else now
            end = start + out.duration
            self._mark_scheduled(out, start)
            delay = end - self._clock()
            await asyncio.sleep(max(delay, 0.0))
            prev_end = end
            self._deliver(out, max(end, self._clock()) if delay < 0 else end)

    def _mark_scheduled(self, out: StepOutput, start: float) -> None:
        for rid in out.scheduled:
            s = self._streams.get(rid)
            if s is not None and s.scheduled_at is None:
                s.scheduled_at = start
                self.metrics.queue.observe(max(0.0, start - s.arrival))
        if out.preempted:
            self.metrics.preemptions.inc(len(out.preempted))

    def _deliver(self, out: StepOutput, at: float) -> None:
        m = self.metrics
        n = 0
        for t in out.outputs:
            s = self._streams.get(t.request_id)
            if s is None:
                continue  # aborted while the step ran
            n += 1
            if s.first_at is None:
                s.first_at = at
                m.ttft.observe(at - s.arrival)
            elif s.last_at is not None:
                m.itl.observe(at - s.last_at)
            s.last_at = at
            s.n += 1
            s.tokens.append(t.token)
            if t.finished:
                s.done = True
            s.event.set()
        if n:
            m.generation_tokens.inc(n)

    def _gauges(self) -> None:
        self.metrics.running.set(self.engine.num_running)
        self.metrics.waiting.set(self.engine.num_waiting)
        self.metrics.kv_usage.set(self.engine.kv_usage)

    # ------------------------------------------------------------------ requests
    def _new_id(self, chat: bool) -> str:
        self._seq += 1
        return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:12]}{self._seq:x}"

    def prompt_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        """The prompt's token ids (byte-level tokenizer, chat template for messages).

        Raises:
            _BadRequest: no usable prompt, or a token id outside the vocabulary.
        """
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise _BadRequest(400, "messages must be a non-empty list")
            try:
                agp = body.get("add_generation_prompt")
                return chat_token_ids(msgs, True if agp is None else _lax_bool(agp, "add_generation_prompt"))
            except ValueError as err:
                raise _BadRequest(400, str(err)) from None
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        elif isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
            raise _BadRequest(400, f"batched prompts ({len(p)}) are not supported by the sim-worker: send one request "
                                   "per prompt")
        if isinstance(p, str) and p:
            return encode_text(p)
        if isinstance(p, list) and p:
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < VOCAB_SIZE for t in p):
                raise _BadRequest(400, f"token id out of vocabulary (0..{VOCAB_SIZE - 1})")
            return [int(t) for t in p]
        raise _BadRequest(400, "prompt must be a non-empty string, a list of token ids, or a list of one of them")

    def _max_tokens(self, body: dict[str, Any], chat: bool, p: int) -> int:
        cap = body.get("max_completion_tokens") if chat and body.get("max_completion_tokens") is not None \
            else body.get("max_tokens")
        if cap is None:
            if chat and p >= self.settings.max_model_len:  # vLLM checks the prompt alone when max_tokens is unset
                raise _BadRequest(400, f"This model's maximum context length is {self.settings.max_model_len} "
                                       f"tokens. However, you requested {p} tokens in the messages, Please reduce "
                                       f"the length of the messages.")
            cap = self.settings.max_model_len - p if chat else 16
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
            raise _BadRequest(400, "max_tokens must be a positive integer")
        if p + cap > self.settings.max_model_len:
            raise _BadRequest(400, f"This model's maximum context length is {self.settings.max_model_len} tokens. "
                                   f"However, you requested {p + cap} tokens ({p} in the messages, {cap} in the "
                                   f"completion). Please reduce the length of the messages or completion.")
        return cap

    async def pull_kv(self, kvp: dict[str, Any], ids: list[int]) -> tuple[int, float]:
        """Remote prefill: pull the KV ``kvp`` names from the other worker.

        Returns:
            (tokens whose KV this request now holds, emulated transfer seconds before ``time_scale``); (0, 0.0)
            when the pull failed (the request recomputes, like vLLM's default ``kv_load_failure_policy``).

        Raises:
            _BadRequest: malformed ``kv_transfer_params``, or a prompt the transferred KV does not cover (vLLM's
                decode engine would crash on it, see the module doc).
        """
        host, port, rrid = kvp.get("remote_host"), kvp.get("remote_port"), kvp.get("remote_request_id")
        if not isinstance(host, str) or not host or not isinstance(port, int) or not isinstance(rrid, str):
            raise _BadRequest(400, "kv_transfer_params with do_remote_prefill need remote_host (string), "
                                   "remote_port (integer) and remote_request_id (string)")
        blocks = kvp.get("remote_block_ids")
        n_blocks: int | None = None
        if isinstance(blocks, list):
            n_blocks = min(len(g) for g in blocks) if blocks and all(isinstance(g, list) for g in blocks) \
                else len(blocks)
        need = self.engine.blocks_for(len(ids))
        assert self._session is not None, "SimWorker.start() was not called"
        url = f"http://{host}:{port}/fulcrum/kv/pull"
        try:
            async with self._session.post(url, json={"request_id": rrid, "engine_id": kvp.get("remote_engine_id")}) \
                    as r:
                data = await r.json() if r.status == 200 else None
                status = r.status
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            data, status = None, 0
            log.warning("KV pull of %s from %s failed (%s): recomputing the prompt", rrid, url, exc)
        if not isinstance(data, dict) or not isinstance(data.get("tokens"), list):
            if status:
                log.warning("KV pull of %s from %s answered %s: recomputing the prompt", rrid, url, status)
            self.metrics.xfer_failed.inc()
            return 0, 0.0
        stored: list[int] = data["tokens"]
        have = len(ids) - 1  # the last prompt token is always computed here
        if n_blocks is not None and need > n_blocks:
            raise _BadRequest(400, f"the prompt of {len(ids)} tokens needs {need} KV blocks but the transfer holds "
                                   f"{n_blocks} (vLLM's decode engine would fail its assertion "
                                   f"num_decode_blocks <= len(prefill_group))")
        if len(stored) < have:
            raise _BadRequest(400, f"the transferred KV covers {len(stored)} tokens but the prompt needs its first "
                                   f"{have} (vLLM's decode engine would fail on this handoff)")
        if stored[:have] != ids[:have]:
            raise _BadRequest(400, "the transferred KV holds other tokens than this prompt's")
        seconds = self.profile.kv_transfer_seconds(len(stored), self.settings.kv_transfer_gbps)
        self.metrics.xfer.observe(seconds * self.engine.config.time_scale)
        return have, seconds

    def take_kv(self, request_id: str, engine_id: Any) -> dict[str, Any] | None:
        """Serve a pull: hand over and free a held KV (None when none is held under that id)."""
        if engine_id not in (None, self.settings.engine_id):
            return None
        held = self.engine.take_kv(request_id)
        h = self._release.pop(request_id, None)
        if h is not None:
            h.cancel()
        if held is None:
            return None
        self._wake.set()  # freed blocks may let waiting requests in
        return {"engine_id": self.settings.engine_id, "request_id": request_id, "tokens": list(held.tokens),
                "block_ids": list(held.block_ids), "block_size": self.engine.config.block_size}

    def _hold(self, request_id: str) -> None:
        def release() -> None:
            self._release.pop(request_id, None)
            if self.engine.release_kv(request_id):
                log.info("held KV of %s expired unpulled after %.0f s", request_id, self.settings.kv_hold_timeout_s)
                self._wake.set()

        self._release[request_id] = asyncio.get_running_loop().call_later(self.settings.kv_hold_timeout_s, release)

    async def generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        """Serve one completion or chat completion request (module doc)."""
        try:
            body = _json_object(await request.read())
            return await self._generate(request, body, chat)
        except _BadRequest as err:
            return _error(err.status, str(err))

    async def _generate(self, request: web.Request, body: dict[str, Any], chat: bool) -> web.StreamResponse:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _BadRequest(400, f"model: Input should be a valid string, got {model!r}")
        if model is not None and model != self.settings.model:
            raise _BadRequest(404, f"The model `{model}` does not exist.")
        choices = _lax_int(body.get("n"), "n")
        if choices is not None and choices < 1:
            raise _BadRequest(400, f"n must be at least 1, got {choices}.")
        if (choices or 1) != 1 or (body.get("best_of") or 1) != 1 or _lax_bool(body.get("echo"), "echo"):
            raise _BadRequest(400, "the sim-worker serves n = 1 without best_of or echo")
        _stops(body)  # a bad stop is a 400 now, not once the answer has begun
        if not chat:
            lp = _lax_int(body.get("logprobs"), "logprobs")
            if lp is not None and lp < 0:
                raise _BadRequest(400, "`logprobs` must be a positive value.")  # vLLM's CompletionRequest
            if lp is not None and lp > _MAX_LOGPROBS:
                raise _BadRequest(400, f"Requested sample logprobs of {lp}, which is greater than max allowed: "
                                       f"{_MAX_LOGPROBS}")
        else:
            _chat_top_logprobs(body)
        ids = self.prompt_ids(body, chat)
        cap = self._max_tokens(body, chat, len(ids))
        stream = _lax_bool(body.get("stream"), "stream")
        raw_kvp = body.get("kv_transfer_params")
        if not isinstance(raw_kvp, (dict, type(None))):
            raise _BadRequest(400, "kv_transfer_params must be an object")
        kvp: dict[str, Any] = raw_kvp or {}
        arrival = self._clock()
        computed, xfer_s = 0, 0.0
        if kvp.get("do_remote_prefill"):
            computed, xfer_s = await self.pull_kv(kvp, ids)
        keep_kv = bool(kvp.get("do_remote_decode")) and not stream
        rid = self._new_id(chat)
        now = self._clock()
        try:
            self.engine.add_request(rid, ids, cap, now=now, computed_tokens=computed, keep_kv=keep_kv,
                                    ready_at=now + xfer_s * self.engine.config.time_scale)
        except ValueError as err:
            raise _BadRequest(400, str(err)) from None
        m = self.metrics
        m.prompt_tokens.inc(len(ids))
        m.by_source.labels(m.model, "local_compute").inc(len(ids) - computed)
        if computed:
            m.by_source.labels(m.model, "external_kv_transfer").inc(computed)
        m.req_prompt.observe(len(ids))
        s = _Stream(arrival)
        self._streams[rid] = s
        self._wake.set()
        finish = None
        try:
            if stream:
                resp, finish, n = await self._answer_stream(request, body, chat, rid, ids, s)
            else:
                resp, finish, n = await self._answer_whole(request, body, chat, rid, ids, s, keep_kv)
            return resp
        finally:
            self._streams.pop(rid, None)
            freed = self.engine.abort(rid)
            if keep_kv and rid not in self._release:
                # The answer naming the held KV never went out (the client went away, possibly after the last
                # step finished the request and held its KV): nobody can pull it, and no expiry timer is armed.
                freed = self.engine.release_kv(rid) or freed
            if freed:
                self._wake.set()
            if finish is not None:
                self._finished(s, finish, n)

    def _finished(self, s: _Stream, finish: str, n: int) -> None:
        m = self.metrics
        end = s.last_at if s.last_at is not None else self._clock()
        m.e2e.observe(end - s.arrival)
        m.req_gen.observe(n)
        m.success.labels(m.model, finish).inc()
        if n > 1 and s.first_at is not None and s.last_at is not None:
            m.tpot.observe((s.last_at - s.first_at) / (n - 1))

    async def _tokens(self, rid: str, s: _Stream, stops: list[str], on_batch: Any) -> tuple[list[int], str, str, Any]:
        """Consume the request's tokens: (token ids, text, finish_reason, stop_reason); ``on_batch(pairs)`` gets
        each step's (token, text released with it) pairs.

        With stop strings the last ``max(len(stop)) − 1`` characters are held back until the request ends or a
        stop string matches (vLLM's incremental detokenizer does the same), so the streamed pieces never show the
        start of a stop string that later tokens complete: they always add up to the non-streamed text.
        """
        gen: list[int] = []
        text = ""
        sent = 0  # characters of text released to on_batch
        hold = max((len(stp) for stp in stops), default=1) - 1
        async for batch in s.batches():
            pairs: list[tuple[int, str]] = []
            for i, tok in enumerate(batch):
                gen.append(tok)
                piece = _piece(tok)
                for stp in stops:
                    idx = (text + piece).find(stp)
                    if idx >= 0:
                        text = (text + piece)[:idx]
                        pairs.append((tok, text[sent:]))
                        if self.engine.stop(rid):
                            self._wake.set()
                        if on_batch is not None:
                            await on_batch(pairs)
                        return gen, text, "stop", stp
                text += piece
                # the request's last token (done is read as the batch was taken: no await since) releases all
                upto = len(text) if s.done and i == len(batch) - 1 else len(text) - hold
                pairs.append((tok, text[sent:upto] if upto > sent else ""))
                sent = max(sent, upto)
            if on_batch is not None:
                await on_batch(pairs)
        return gen, text, "length", None

    def _kv_answer(self, request: web.Request, rid: str) -> dict[str, Any] | None:
        held = self.engine.held_kv(rid)
        if held is None:
            return None
        host, port = self.settings.advertise_host, self.settings.advertise_port
        sock = request.transport.get_extra_info("sockname") if request.transport is not None else None
        if host is None:
            host = str(sock[0]) if sock else "127.0.0.1"
        if port is None:
            port = int(sock[1]) if sock else 0
        self._hold(rid)
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.settings.engine_id,
                "remote_block_ids": list(held.block_ids), "remote_host": host, "remote_port": port,
                "remote_request_id": rid, "remote_num_tokens": len(held.tokens),
                "tp_size": self.engine.config.tp}

    async def _answer_whole(self, request: web.Request, body: dict[str, Any], chat: bool, rid: str, ids: list[int],
                            s: _Stream, keep_kv: bool) -> tuple[web.StreamResponse, str, int]:
        gen, text, finish, stop_reason = await self._tokens(rid, s, _stops(body), None)
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(gen), "total_tokens": len(ids) + len(gen)}
        choice: dict[str, Any]
        if chat:
            top = _chat_top_logprobs(body)
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None if top is None else {"content": [_chat_logprob(t, top) for t in gen]},
                      "finish_reason": finish, "stop_reason": stop_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": self._logprobs(body, gen), "finish_reason": finish,
                      "stop_reason": stop_reason}
        if body.get("return_token_ids") is True:
            choice["token_ids"] = gen
            choice["prompt_token_ids"] = ids
        out: dict[str, Any] = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                               "created": int(time.time()), "model": self.settings.model, "choices": [choice],
                               "usage": usage}
        if keep_kv:
            out["kv_transfer_params"] = self._kv_answer(request, rid)
        return web.json_response(out), finish, len(gen)

    @staticmethod
    def _logprobs(body: dict[str, Any], gen: list[int], offset: int = 0) -> dict[str, Any] | None:
        """A completion's ``logprobs`` for the tokens ``gen`` (vLLM's ``CompletionLogProbs``), or None when the
        request wants none; ``offset``: characters of the answer before ``gen[0]`` (a streamed chunk's
        ``text_offset`` counts from the answer's start, as vLLM's does)."""
        lp = _lax_int(body.get("logprobs"), "logprobs")  # validated by _generate
        if lp is None or lp < 0:
            return None
        pieces = [_piece(t) for t in gen]
        offs, o = [], offset
        for p in pieces:
            offs.append(o)
            o += len(p)
        top = [{p: 0.0} for p in pieces] if lp > 0 else None
        return {"tokens": pieces, "token_logprobs": [0.0] * len(pieces), "top_logprobs": top, "text_offset": offs}

    async def _answer_stream(self, request: web.Request, body: dict[str, Any], chat: bool, rid: str, ids: list[int],
                             s: _Stream) -> tuple[web.StreamResponse, str, int]:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = (f'data: {{"id": "{rid}", "object": "{obj}", "created": {created}, '
                f'"model": {json.dumps(self.settings.model)}, "choices": [').encode()
        want_ids = body.get("return_token_ids") is True
        raw_so = body.get("stream_options")
        so: dict[str, Any] = raw_so if isinstance(raw_so, dict) else {}
        top = _chat_top_logprobs(body) if chat else None
        first = [True]
        sent = [0]  # characters of the answer streamed so far (a completion's text_offset)

        def chunk(choice: dict[str, Any]) -> bytes:
            return head + json.dumps(choice).encode() + b"]}\n\n"

        if chat:
            await resp.write(chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}))

        async def send(pairs: list[tuple[int, str]]) -> None:
            parts = []
            for tok, piece in pairs:
                c: dict[str, Any]
                if chat:
                    c = {"index": 0, "delta": {"content": piece},
                         "logprobs": None if top is None else {"content": [_chat_logprob(tok, top)]},
                         "finish_reason": None}
                else:
                    c = {"index": 0, "text": piece, "logprobs": self._logprobs(body, [tok], sent[0]),
                         "finish_reason": None}
                    sent[0] += len(piece)
                if want_ids:
                    c["token_ids"] = [tok]
                    if first[0] and not chat:
                        c["prompt_token_ids"] = ids
                first[0] = False
                parts.append(chunk(c))
            await resp.write(b"".join(parts))

        gen, _, finish, stop_reason = await self._tokens(rid, s, _stops(body), send)
        tail = {"index": 0, "delta": {}, "logprobs": None} if chat else {"index": 0, "text": "", "logprobs": None}
        tail.update(finish_reason=finish, stop_reason=stop_reason)
        last = chunk(tail)
        if so.get("include_usage") is True:
            usage = {"prompt_tokens": len(ids), "completion_tokens": len(gen), "total_tokens": len(ids) + len(gen)}
            last += head[:-len(b'"choices": [')] + b'"choices": [], "usage": ' + json.dumps(usage).encode() + b"}\n\n"
        await resp.write(last + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp, finish, len(gen)


SIM_WORKER = web.AppKey("sim_worker", SimWorker)
"""Where :func:`create_sim_app` keeps the :class:`SimWorker` in the app."""


def create_sim_app(worker: SimWorker) -> web.Application:
    """The aiohttp application serving ``worker`` (routes in the module doc). Start-up starts the engine loop,
    clean-up stops it. Serve it with ``handler_cancellation=True`` so a client that goes away aborts its
    request."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[SIM_WORKER] = worker

    async def completions(request: web.Request) -> web.StreamResponse:
        return await worker.generate(request, chat=False)

    async def chat(request: web.Request) -> web.StreamResponse:
        return await worker.generate(request, chat=True)

    async def tokenize(request: web.Request) -> web.Response:
        try:
            body = _json_object(await request.read())
            ids = worker.prompt_ids(body, chat="messages" in body)
        except _BadRequest as err:
            return _error(err.status, str(err))
        return web.json_response({"count": len(ids), "max_model_len": worker.settings.max_model_len, "tokens": ids})

    async def detokenize(request: web.Request) -> web.Response:
        try:
            body = _json_object(await request.read())
        except _BadRequest as err:
            return _error(err.status, str(err))
        toks = body.get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) and 0 <= t < VOCAB_SIZE for t in toks):
            return _error(400, f"tokens must be a list of token ids (0..{VOCAB_SIZE - 1})")
        return web.json_response({"prompt": bytes(toks).decode("utf-8", errors="replace")})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": worker.settings.model, "object": "model", "owned_by": "fulcrum-sim",
             "max_model_len": worker.settings.max_model_len}]})

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=503 if worker.draining else 200, text="draining" if worker.draining else "")

    async def metrics(request: web.Request) -> web.Response:
        worker._gauges()
        return web.Response(body=generate_latest(worker.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def kv_pull(request: web.Request) -> web.Response:
        try:
            body = _json_object(await request.read())
        except _BadRequest as err:
            return _error(err.status, str(err))
        rid = body.get("request_id")
        got = worker.take_kv(rid, body.get("engine_id")) if isinstance(rid, str) else None
        if got is None:
            return _error(404, f"no KV held for request {rid!r} on engine {worker.settings.engine_id}")
        return web.json_response(got)

    async def on_startup(app: web.Application) -> None:
        await worker.start()

    async def on_cleanup(app: web.Application) -> None:
        await worker.close()

    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/fulcrum/kv/pull", kv_pull)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


async def serve(worker: SimWorker, host: str, port: int, *, registration: EtcdRegistration | None = None,
                drain_timeout_s: float = 300.0, ready: Callable[[int], None] | None = None) -> int:
    """Serve until SIGTERM/SIGINT, then drain: ``/health`` → 503, deregister from etcd, wait until no request
    runs or waits (or ``drain_timeout_s``), stop. Returns the exit code (0).

    Args:
        worker: the emulator.
        host: address to listen on.
        port: port to listen on.
        registration: the etcd registration to start once serving and stop at SIGTERM (None: none).
        drain_timeout_s: longest wait for in-flight requests after SIGTERM, seconds.
        ready: called with the bound port once serving.

    Raises:
        OSError: the address cannot be bound (the port is in use, the host is not local); the app is cleaned up.
    """
    import signal

    app = create_sim_app(worker)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as err:  # the port is taken or the address is not local: one line, and the worker closed
        await runner.cleanup()
        raise OSError(f"cannot listen on {host}:{port}: {err.strerror or err}") from err
    bound = int(runner.addresses[0][1]) if runner.addresses else port
    log.info("sim-worker %s serving %s on %s:%d (profile %s, TP %d)", worker.settings.engine_id,
             worker.settings.model, host, bound, worker.profile.name, worker.engine.config.tp)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        if registration is not None:
            ok = await registration.start()
            log.info("registration %s: %s", registration.key, "registered" if ok else "etcd unreachable, retrying")
        if ready is not None:
            ready(bound)
        await stop.wait()
        log.info("sim-worker %s: draining (%d requests in flight)", worker.settings.engine_id, worker.busy)
        worker.start_draining()
        if registration is not None:
            await registration.stop()
        drained = await worker.wait_drained(drain_timeout_s)
        log.info("sim-worker %s: %s", worker.settings.engine_id,
                 "drained" if drained else f"drain timeout after {drain_timeout_s:.0f} s")
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await runner.cleanup()
    return 0
