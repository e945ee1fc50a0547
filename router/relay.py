"""Relaying one upstream answer to the client: the client's stream, the exchange being served, the relay loop.

The client's SSE response is opened only when the first event is ready, so until then a failed instance can
be retried elsewhere and an error can still be answered with its own status (502, 503, the engine's 4xx).
Events are relayed whole (never half an event), untouched unless the caller transforms them (handoffs rewrite
ids and usage). The router always asks the engine for ``stream_options.include_usage`` (it needs the true
output length) and drops the usage chunk when the client did not ask for it.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from fulcrum.router.metrics import RouterMetrics
from fulcrum.router.schemas import ChatCompletionRequest, CompletionRequest, Endpoint
from fulcrum.router.sse import EventSplitter, event_payload, is_usage_only, plain_token_events, split_events
from fulcrum.router.tokens import PromptTokens, token_count
from fulcrum.router.upstream import Ticket, UpstreamFailure, UpstreamPool, upstream_message

__all__ = ["ClientGone", "ClientSink", "Exchange", "Outcome", "relay", "Transform", "count_event_tokens",
           "error_outcome_message", "stream_timeout", "whole_usage"]

Transform = Callable[[dict[str, Any]], "dict[str, Any] | None"]


class ClientGone(Exception):
    """The client closed its connection; upstream work must stop."""


@dataclass(slots=True)
class Exchange:
    """One client request being served.

    Attributes:
        request_id: the router's id.
        endpoint: "completions" or "chat".
        req: the validated request.
        body: what is forwarded (unknown fields kept; ``model`` filled; usage forced on for streams).
        stream: whether the client asked for a stream.
        client_usage: whether the client asked for the usage chunk.
        prompt: the prompt's size (and ids where known).
        max_tokens: the client's cap on generated tokens (None = up to the context).
        model: the model name answers carry.
        created: Unix seconds for rewritten answers (from the request's arrival).
        t0: arrival on the router's monotonic clock, seconds.
        raw: the client's body bytes while ``body`` is exactly what the client sent (a whole answer relayed
            from ``body`` then forwards them as they came, not re-encoded); None otherwise.
    """

    request_id: str
    endpoint: Endpoint
    req: CompletionRequest | ChatCompletionRequest
    body: dict[str, Any]
    stream: bool
    client_usage: bool
    prompt: PromptTokens
    max_tokens: int | None
    model: str
    created: int
    t0: float
    raw: bytes | None = None

    @property
    def path(self) -> str:
        """The upstream path of the client's endpoint."""
        return "/v1/completions" if self.endpoint == "completions" else "/v1/chat/completions"


@dataclass(slots=True)
class Outcome:
    """How an upstream call ended.

    Attributes:
        status: HTTP status to answer (200, or the engine's 4xx relayed).
        body: the whole answer for non-streamed requests and errors (None when it was streamed).
        completion_tokens: tokens generated, from the engine's usage where it gave one.
        prompt_tokens: the engine's count of prompt tokens, or None.
        data: the parsed non-streamed answer, when it was parsed (a relayed answer without a transform is not:
            only its ``usage`` is read, :func:`whole_usage`).
        instance: the instance whose answer a non-200 outcome is, where the caller knows it (the router retries
            an engine's 429 elsewhere and leaves that instance out); None when not known.
    """

    status: int
    body: bytes | None
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    data: dict[str, Any] | None = field(default=None)
    instance: str | None = None


class ClientSink:
    """The client's streamed answer: opened at the first event, timed (TTFT, ITL) as events leave.

    Args:
        request: the client's request.
        metrics: TTFT and ITL are observed here.
        clock: monotonic seconds; ``t0`` is the request's arrival on it.
    """

    __slots__ = ("request", "metrics", "clock", "t0", "response", "first_token_at", "last_token_at", "tokens",
                 "watch_next", "next_token_at")

    def __init__(self, request: web.Request, metrics: RouterMetrics, clock: Callable[[], float], t0: float) -> None:
        self.request = request
        self.metrics = metrics
        self.clock = clock
        self.t0 = t0
        self.response: web.StreamResponse | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.tokens = 0
        self.watch_next = False
        """When True, the next token's send time is kept in ``next_token_at`` (handoff latency)."""
        self.next_token_at: float | None = None

    @property
    def started(self) -> bool:
        """Whether anything was sent to the client (then no retry and no error status are possible)."""
        return self.response is not None

    async def send(self, event: bytes, tokens: int = 1) -> None:
        """Write one whole event; ``tokens`` it carries (0 for usage/DONE).

        Raises:
            ClientGone: the client closed the connection.
        """
        try:
            if self.response is None:
                resp = web.StreamResponse(status=200, headers={
                    "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
                await resp.prepare(self.request)
                self.response = resp
            await self.response.write(event)
        except (ConnectionError, RuntimeError) as err:  # reset by peer / writing after the transport closed
            raise ClientGone(str(err)) from err
        if tokens > 0:
            now = self.clock()
            if self.first_token_at is None:
                self.first_token_at = now
                self.metrics.ttft.observe(now - self.t0)
            elif self.last_token_at is not None:
                self.metrics.itl.observe(now - self.last_token_at)
            self.last_token_at = now
            self.tokens += tokens
            if self.watch_next:
                self.next_token_at = now
                self.watch_next = False

    def answer(self) -> web.StreamResponse:
        """The streamed response (only after the first ``send``)."""
        assert self.response is not None, "nothing was streamed"
        return self.response

    async def close(self) -> None:
        """Finish the stream."""
        if self.response is not None:
            try:
                await self.response.write_eof()
            except (ConnectionError, RuntimeError) as err:
                raise ClientGone(str(err)) from err


def count_event_tokens(obj: dict[str, Any]) -> int:
    """Tokens one streamed chunk carries: its ``token_ids`` when present, else 1 per choice with output."""
    n = 0
    for ch in obj.get("choices") or ():
        if not isinstance(ch, dict):
            continue
        ids = ch.get("token_ids")
        if isinstance(ids, list):
            n += len(ids)
        elif ch.get("text") or (isinstance(ch.get("delta"), dict) and (ch["delta"].get("content") or ch["delta"].get("tool_calls"))):
            n += 1
    return n


def _parse_json(raw: bytes, iid: str) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except ValueError as err:
        raise UpstreamFailure(iid, "broken", f"{iid} answered with a body that is not JSON") from err
    if not isinstance(data, dict):
        raise UpstreamFailure(iid, "broken", f"{iid} answered with JSON that is not an object")
    return data


_DECODER = json.JSONDecoder()
_USAGE_VALUE = re.compile(rb'\s*:\s*\{')


def whole_usage(raw: bytes) -> dict[str, Any] | None:
    """The ``usage`` object of a whole JSON answer, found from the end without parsing the rest (vLLM and OpenAI
    write it last; the answer's text cannot hold an unescaped ``"usage"``); None when it is not found that way
    (then parse the whole answer)."""
    if raw[:1] != b"{":
        return None
    i = raw.rfind(b'"usage"')
    if i <= 0 or raw[i - 1] == 0x5C:  # a backslash: inside a string
        return None
    m = _USAGE_VALUE.match(raw, i + 7)
    if m is None:
        return None
    try:
        obj, _ = _DECODER.raw_decode(raw[m.end() - 1:].decode())
    except (ValueError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


async def _relay_whole(pool: UpstreamPool, iid: str, path: str, body: dict[str, Any] | bytes, ticket: Ticket,
                       transform: Transform | None) -> Outcome:
    status, raw, _ = await pool.fetch(iid, path, body)
    if status != 200:
        return Outcome(status, raw, instance=iid)
    data: dict[str, Any] | None = None
    usage = whole_usage(raw) if transform is None else None
    if usage is None:
        try:
            data = _parse_json(raw, iid)
        except UpstreamFailure as err:
            pool.record_failure(iid, err.cause)
            raise
        u = data.get("usage")
        usage = u if isinstance(u, dict) else {}
    ct = token_count(usage.get("completion_tokens"))
    if ct is None:
        ct = 0  # not given, or not a count: unknown
    ticket.add_tokens(ct)
    if transform is not None and data is not None:
        try:
            data = transform(data) or data
        except UpstreamFailure as err:  # the answer's shape is not what the transform reads
            pool.record_failure(iid, err.cause)
            raise
        raw = json.dumps(data).encode()
    return Outcome(200, raw, ct, token_count(usage.get("prompt_tokens")), data)


async def relay(pool: UpstreamPool, ex: Exchange, iid: str, path: str, body: dict[str, Any], sink: ClientSink,
                ticket: Ticket, transform: Transform | None = None) -> Outcome:
    """Send ``body`` to ``iid`` and pass its answer on: whole (returned) or streamed (written to ``sink``).

    ``transform`` rewrites each parsed chunk (or the whole answer); returning None drops a chunk; raising
    :class:`UpstreamFailure` (an answer it cannot read) fails the call like any engine failure. Without it,
    streamed events are relayed byte for byte and only the usage chunk is parsed. The final ``[DONE]`` is
    left to the caller.

    Raises:
        UpstreamFailure: the call failed (recorded against the instance); ``sink.started`` tells whether a retry
            is still possible.
        ClientGone: the client went away (the upstream connection is closed on the way out).
    """
    if body.get("stream") is not True:
        raw = ex.raw if body is ex.body else None  # the client's own bytes: nothing to re-encode
        return await _relay_whole(pool, iid, path, raw if raw is not None else body, ticket, transform)
    loop = asyncio.get_running_loop()
    state = _StreamState()
    t = pool.config.timeouts
    # one deadline: until the first relayed event, first_token_s from the call's start (the answer's headers
    # included: vLLM sends them at once, before prefill); from then on, idle_s from the last bytes the engine
    # sent (paused while the client takes an event). The socket's own read limit is only a backstop.
    deadline = asyncio.timeout_at(loop.time() + t.first_token_s)
    try:
        async with deadline:
            early = await _relay_events(pool, ex, iid, path, body, sink, ticket, transform, state, deadline, t.idle_s)
    except TimeoutError as err:
        if not deadline.expired():
            raise
        raise stream_timeout(pool, iid, started=state.relayed) from err
    if early is not None:
        return early
    usage = state.usage or {}
    ct = token_count(usage.get("completion_tokens"))
    return Outcome(200, None, state.counted if ct is None else ct, token_count(usage.get("prompt_tokens")))


def stream_timeout(pool: UpstreamPool, iid: str, *, started: bool) -> UpstreamFailure:
    """Record that ``iid``'s stream deadline fired (cause "timeout") and return the failure to raise: no token
    within ``timeouts.first_token_s``, or (``started``: a token came) silence for ``timeouts.idle_s`` after it.
    The deadline protocol of :func:`relay` and of the decode-rescheduling legs (``fulcrum.router.rescheduler``)."""
    t = pool.config.timeouts
    pool.record_failure(iid, "timeout")
    if started:
        return UpstreamFailure(iid, "timeout", f"{iid} sent nothing for {t.idle_s:g} s in the middle of its stream")
    return UpstreamFailure(iid, "timeout", f"{iid} sent no token within {t.first_token_s:g} s")


@dataclass(slots=True)
class _StreamState:
    usage: dict[str, Any] | None = None
    counted: int = 0
    relayed: bool = False
    """An event was sent on: the idle limit applies (no longer the first-token one)."""


async def _relay_events(pool: UpstreamPool, ex: Exchange, iid: str, path: str, body: dict[str, Any], sink: ClientSink,
                        ticket: Ticket, transform: Transform | None, state: _StreamState,
                        deadline: asyncio.Timeout, idle_s: float) -> Outcome | None:
    """The streaming relay loop; returns an outcome only for a non-200 answer. ``deadline`` (first_token_s from
    the start) moves to ``idle_s`` after the engine's latest bytes once an event has been relayed."""
    done = False
    loop = asyncio.get_running_loop()
    async with pool.open(iid, path, body, stream=True) as resp:
        if resp.status != 200:
            return Outcome(resp.status, await resp.read(), instance=iid)
        splitter = EventSplitter()
        async for chunk in resp.content.iter_any():
            block = splitter.feed_block(chunk)
            if not block:
                if state.relayed:  # part of an event: the engine is not silent
                    deadline.reschedule(loop.time() + idle_s)
                continue
            plain = plain_token_events(block) if transform is None else 0
            if plain:  # the common case: output events only, relayed as they came, one token each
                ticket.add_tokens(plain)
                state.counted += plain
                deadline.reschedule(None)  # a slow client is not a silent engine
                await sink.send(block, tokens=plain)
                state.relayed = True
                deadline.reschedule(loop.time() + idle_s)
                continue
            out: list[bytes] = []
            tokens = 0
            for ev in split_events(block):
                if ev.startswith(b"data: [DONE]"):
                    done = True
                    continue
                if not ev.startswith(b"data:"):
                    continue  # comments and keep-alives are not relayed
                n = 1
                if transform is not None or b'"usage":{' in ev or b'"usage": {' in ev or b'"error"' in ev:
                    obj = _parse_json(event_payload(ev) or b"", iid)
                    if is_usage_only(obj):
                        state.usage = obj["usage"]
                        if not ex.client_usage:
                            continue
                        n = 0
                    elif "error" in obj and not obj.get("choices"):
                        err = obj["error"]
                        msg = err.get("message") if isinstance(err, dict) else str(err)
                        raise UpstreamFailure(iid, "status", str(msg)[:500] or "engine error in stream", 500)
                    else:
                        n = count_event_tokens(obj)
                    if transform is not None:
                        new = transform(obj)
                        if new is None:
                            continue
                        ev = b"data: " + json.dumps(new, separators=(",", ":")).encode() + b"\n\n"
                out.append(ev)
                tokens += n
            if not out:
                if state.relayed:  # keep-alives, a dropped usage chunk: the engine is not silent
                    deadline.reschedule(loop.time() + idle_s)
                continue
            if tokens:
                ticket.add_tokens(tokens)
                state.counted += tokens
            deadline.reschedule(None)  # a slow client is not a silent engine
            # the events one upstream read completed leave in one write (they arrived together)
            await sink.send(out[0] if len(out) == 1 else b"".join(out), tokens=tokens)
            state.relayed = True
            deadline.reschedule(loop.time() + idle_s)
        if not done:
            raise UpstreamFailure(iid, "broken", f"{iid} ended the stream before [DONE]")
    return None


def error_outcome_message(out: Outcome) -> str:
    """The engine's message in a non-200 outcome."""
    return upstream_message(out.body or b"", out.status)
