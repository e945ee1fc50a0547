"""The handoff protocol: one request served by two engines over vLLM's NIXL ``kv_transfer_params``.

DESIGN, "The split of one request" and "A real vLLM engine on the CPU". Shared by the ``disaggregated`` and
``split`` policies (and, later, ARES decode rescheduling):

- **disaggregated** (s = P): engine A gets the request with ``max_tokens = 1``, ``stream = false`` and
  ``kv_transfer_params = {"do_remote_decode": true, ...}``; its answer's ``kv_transfer_params`` go unchanged with
  the original request to engine B, which pulls the prompt's KV and generates everything. A's token is dropped.
- **split after k tokens** (s = P + k): A gets the prompt as token ids with ``max_tokens = k + 1``,
  ``return_token_ids`` and ``logprobs = 0`` (whose ``text_offset`` cuts A's text after token k); the client gets
  A's first k tokens, then B continues from prompt + those k token ids with A's ``kv_transfer_params`` and
  ``max_tokens`` reduced by k. A's (k+1)-th token is dropped (B regenerates it from the same KV). The client sees
  one stream and one answer; ``usage`` says prompt P and completion k + B's tokens.

**The block-coverage guard.** B must never get a prompt whose KV the transferred blocks do not cover: vLLM's
decode engine asserts ``num_decode_blocks <= len(prefill_group)`` and dies. Seen on vLLM CPU (DESIGN): A's
blocks cover P + k − 1 tokens when k ≥ 1 (P when k = 0), so B's prompt of P + k tokens needs one block more
exactly when (P + k − 1) is a multiple of the block size. Two defences, both pure functions:

1. :func:`plan_handoff` moves k down to the nearest safe value before A runs (k = 0 is always safe);
2. :func:`handoff_is_safe` checks B's block need against the number of ``remote_block_ids`` A actually
   returned; when they do not cover it, B runs without the KV (it recomputes the prefix) instead of dying.

Partial-prefix splits (s < P) are refused (run as disaggregated): the KV connector cannot move a partial
prompt safely (DESIGN).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from fulcrum.router.metrics import RouterMetrics
from fulcrum.router.relay import ClientSink, Exchange, Outcome, Transform, relay
from fulcrum.router.schemas import ChatCompletionRequest, CompletionRequest
from fulcrum.router.sse import encode_event, is_usage_only
from fulcrum.router.tokens import count_prompt
from fulcrum.router.upstream import UpstreamFailure, UpstreamPool

__all__ = [
    "DO_REMOTE_DECODE",
    "blocks_needed",
    "predicted_covered_tokens",
    "remote_block_count",
    "handoff_is_safe",
    "HandoffPlan",
    "plan_handoff",
    "split_blocker",
    "run_colocated",
    "run_disaggregated",
    "run_split",
    "disagg_blocker",
]

log = logging.getLogger(__name__)

DO_REMOTE_DECODE: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}
"""``kv_transfer_params`` asking engine A to keep its KV for a remote decode (vLLM NixlConnector)."""

_CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls", "response_format", "functions", "function_call",
              "documents", "continue_final_message", "reasoning_effort", "include_reasoning", "audio", "modalities")


# ----------------------------------------------------------------------------------------------- the guard
def blocks_needed(tokens: int, block_size: int) -> int:
    """KV blocks a prompt of ``tokens`` occupies, ⌈tokens / block_size⌉.

    Raises:
        ValueError: negative tokens or a block size below 1.
    """
    if tokens < 0 or block_size < 1:
        raise ValueError(f"need tokens >= 0 and block_size >= 1, got {tokens}, {block_size}")
    return -(-tokens // block_size)


def predicted_covered_tokens(prompt_tokens: int, k: int) -> int:
    """Tokens whose KV engine A's transferred blocks hold after a run with ``max_tokens = k + 1`` (DESIGN, seen
    on vLLM CPU): P + k − 1 for k ≥ 1, P for k = 0."""
    return prompt_tokens if k == 0 else prompt_tokens + k - 1


def remote_block_count(kv_params: dict[str, Any] | None) -> int | None:
    """Blocks A offers in ``remote_block_ids`` (per KV-cache group: the smallest group), or None if unknown."""
    if not isinstance(kv_params, dict):
        return None
    ids = kv_params.get("remote_block_ids")
    if not isinstance(ids, list):
        return None
    if ids and all(isinstance(g, list) for g in ids):
        return min(len(g) for g in ids)
    return len(ids)


def handoff_is_safe(prompt_tokens: int, k: int, block_size: int, remote_blocks: int | None = None) -> bool:
    """Whether B may get a prompt of P + k tokens on A's KV.

    Args:
        prompt_tokens: P, tokens.
        k: A's generated tokens given to B, tokens (0 = disaggregated).
        block_size: the engines' KV block size, tokens.
        remote_blocks: blocks A actually returned; None = use :func:`predicted_covered_tokens`.

    Returns:
        True when ⌈(P + k) / block_size⌉ ≤ the blocks A transfers.
    """
    have = remote_blocks if remote_blocks is not None else blocks_needed(predicted_covered_tokens(prompt_tokens, k), block_size)
    return blocks_needed(prompt_tokens + k, block_size) <= have


@dataclass(frozen=True, slots=True)
class HandoffPlan:
    """How a split runs.

    Attributes:
        k: A's generated tokens handed to B (0 = disaggregated), tokens.
        colocated: A does the whole request (k + 1 reaches the client's cap: nothing left for B).
        adjusted: the guard moved k away from the policy's choice.
    """

    k: int
    colocated: bool = False
    adjusted: bool = False


def plan_handoff(prompt_tokens: int, k: int, block_size: int, max_tokens: int | None) -> HandoffPlan:
    """The largest safe k' ≤ k (:func:`handoff_is_safe` with the predicted coverage); k' = 0 is always safe.

    Raises:
        ValueError: negative P or k.
    """
    if prompt_tokens < 0 or k < 0:
        raise ValueError(f"need P >= 0 and k >= 0, got {prompt_tokens}, {k}")
    if max_tokens is not None and k + 1 >= max_tokens:
        return HandoffPlan(k=k, colocated=True)
    kk = k
    while kk > 0 and not handoff_is_safe(prompt_tokens, kk, block_size):
        kk -= 1
    return HandoffPlan(k=kk, adjusted=kk != k)


def split_blocker(ex: Exchange) -> str | None:
    """Why a request cannot be split past its prompt (None when it can). Such requests run disaggregated.

    Stop strings could straddle the handoff (B only sees its own text); client logprobs, echo and n > 1 would
    need merging two engines' extras; chat requests with tools or structured output need the chat endpoint
    on both sides, while a split continues through ``/v1/completions`` with token ids.
    """
    b = ex.body
    if b.get("stop"):
        return "stop strings"
    if isinstance(ex.req, CompletionRequest):
        if ex.req.logprobs is not None or ex.req.echo or (ex.req.best_of or 1) > 1 or ex.req.suffix:
            return "logprobs/echo/best_of/suffix"
    elif isinstance(ex.req, ChatCompletionRequest):
        if ex.req.logprobs or any(k in b for k in _CHAT_ONLY):
            return "chat features"
    if (ex.req.n or 1) > 1:
        return "n > 1"
    return None


def disagg_blocker(ex: Exchange) -> str | None:
    """Why a request cannot be handed off at all (None when it can): n > 1, best_of, echo."""
    if (ex.req.n or 1) > 1:
        return "n > 1"
    if isinstance(ex.req, CompletionRequest) and (ex.req.echo or (ex.req.best_of or 1) > 1):
        return "echo/best_of"
    return None


# ----------------------------------------------------------------------------------------------- executors
async def run_colocated(pool: UpstreamPool, ex: Exchange, iid: str, sink: ClientSink) -> Outcome:
    """One engine does everything; its answer is relayed."""
    ticket = pool.acquire(iid, ex.prompt.count, ex.prompt.count)
    try:
        return await relay(pool, ex, iid, ex.path, ex.body, sink, ticket)
    finally:
        ticket.release()


def _prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    a = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    a.update(max_tokens=1, stream=False, kv_transfer_params=dict(DO_REMOTE_DECODE))
    if chat and "max_completion_tokens" in a:
        a["max_completion_tokens"] = 1
    return a


async def _run_prefill(pool: UpstreamPool, iid: str, path: str, body: dict[str, Any], queued: int) -> Outcome:
    ticket = pool.acquire(iid, queued, queued)
    try:
        status, raw, data = await pool.post_json(iid, path, body)
    finally:
        ticket.release()
    return Outcome(status, raw, data=data if isinstance(data, dict) else None)


async def run_disaggregated(pool: UpstreamPool, ex: Exchange, a: str, b: str, sink: ClientSink,
                            metrics: RouterMetrics, block_size: int) -> Outcome:
    """A prefills (``max_tokens = 1``), B decodes everything on A's KV (module docstring).

    Raises:
        UpstreamFailure: A or B failed (B's failure is retried by the caller only if nothing was streamed).
    """
    out = await _run_prefill(pool, a, ex.path, _prefill_body(ex.body, ex.endpoint == "chat"), ex.prompt.count)
    a_done = sink.clock()
    if out.status != 200 or out.data is None:
        return out
    kv = out.data.get("kv_transfer_params")
    u = out.data.get("usage")
    pt = u.get("prompt_tokens") if isinstance(u, dict) else None
    p_exact = pt if isinstance(pt, int) else ex.prompt.count
    body = dict(ex.body)
    if isinstance(kv, dict) and handoff_is_safe(p_exact, 0, block_size, remote_block_count(kv)):
        body["kv_transfer_params"] = kv
        queued = 0
    else:
        metrics.handoff_guard.labels("no-kv" if not isinstance(kv, dict) else "fallback").inc()
        queued = p_exact
    return await _relay_b(pool, ex, b, ex.path, body, sink, metrics, "disaggregated", a_done, queued, p_exact, None)


async def _relay_b(pool: UpstreamPool, ex: Exchange, b: str, path: str, body: dict[str, Any], sink: ClientSink,
                   metrics: RouterMetrics, kind: str, a_done: float, queued: int, context: int,
                   transform: Transform | None) -> Outcome:
    """Engine B's part; for streams, the gap from A's answer to B's first token is the handoff latency."""
    ticket = pool.acquire(b, queued, context)
    sink.next_token_at = None
    sink.watch_next = ex.stream
    try:
        out = await relay(pool, ex, b, path, body, sink, ticket, transform)
    finally:
        ticket.release()
        sink.watch_next = False
    if out.status == 200 and sink.next_token_at is not None:
        gap = max(0.0, sink.next_token_at - a_done)
        metrics.handoff.labels(kind).observe(gap)
        if "kv_transfer_params" in body:
            metrics.kv_transfer.labels(kind).observe(gap)
    return out


# ----------------------------------------------------------------------------------------------- split
def _usage(p: int, c: int) -> dict[str, int]:
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


class _Shape:
    """Builds answers in the client's format (completions or chat) with the router's id."""

    def __init__(self, ex: Exchange) -> None:
        self.ex = ex
        self.chat = ex.endpoint == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + ex.request_id

    def chunk(self, text: str, finish: str | None = None, stop_reason: Any = None, first: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        if finish is not None:
            choice["stop_reason"] = stop_reason
        return {"id": self.id, "object": obj, "created": self.ex.created, "model": self.ex.model, "choices": [choice]}

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.ex.created, "model": self.ex.model, "choices": [], "usage": usage}

    def whole(self, text: str, finish: str | None, stop_reason: Any, usage: dict[str, int]) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.ex.created, "model": self.ex.model,
                "choices": [choice], "usage": usage}


def _completions_body(ex: Exchange) -> dict[str, Any]:
    """The request's sampling options for ``/v1/completions`` (chat-only fields and the prompt removed)."""
    drop = {"messages", "prompt", "max_completion_tokens", "logprobs", "top_logprobs", "stream_options", "n",
            "chat_template", "chat_template_kwargs", "add_generation_prompt", "echo", "return_token_ids",
            "kv_transfer_params", "user", *_CHAT_ONLY}
    return {k: v for k, v in ex.body.items() if k not in drop}


async def _prompt_ids(pool: UpstreamPool, ex: Exchange) -> tuple[int, ...] | None:
    if ex.prompt.ids is not None:
        return ex.prompt.ids
    got = await count_prompt(pool, ex.req, ex.body, ex.body.get("model"), "tokenize")
    return got.ids


def _text_before(choice: dict[str, Any], k: int) -> str | None:
    """The text of the first k generated tokens, cut at ``logprobs.text_offset[k]``."""
    lp = choice.get("logprobs")
    text = choice.get("text")
    if not isinstance(lp, dict) or not isinstance(text, str):
        return None
    off = lp.get("text_offset")
    if not isinstance(off, list) or len(off) <= k or not all(isinstance(o, int) for o in off[: k + 1]):
        return None
    return text[: off[k] - off[0]]


async def run_split(pool: UpstreamPool, ex: Exchange, a: str, b: str, k: int, sink: ClientSink,
                    metrics: RouterMetrics, block_size: int) -> Outcome:
    """A generates k tokens (the client gets them), B continues on A's KV (module docstring).

    Falls back to :func:`run_disaggregated` when the request cannot be split past its prompt
    (:func:`split_blocker`) or the guard moves k to 0, and to a colocated run on A when A would reach the
    client's cap anyway.

    Raises:
        UpstreamFailure: A or B failed.
    """
    plan = plan_handoff(ex.prompt.count, k, block_size, ex.max_tokens)
    if plan.colocated:
        return await run_colocated(pool, ex, a, sink)
    if plan.adjusted:
        metrics.handoff_guard.labels("adjusted").inc()
    if plan.k == 0 or split_blocker(ex) is not None:
        return await run_disaggregated(pool, ex, a, b, sink, metrics, block_size)
    k = plan.k
    ids = await _prompt_ids(pool, ex)
    base = _completions_body(ex)
    a_body = dict(base, max_tokens=k + 1, stream=False, logprobs=0, return_token_ids=True,
                  kv_transfer_params=dict(DO_REMOTE_DECODE))
    a_body.pop("min_tokens", None)
    if ids is not None:
        a_body["prompt"] = list(ids)
    elif isinstance(ex.req, CompletionRequest):
        a_body["prompt"] = ex.req.single_prompt()
    else:
        return await run_disaggregated(pool, ex, a, b, sink, metrics, block_size)
    out = await _run_prefill(pool, a, "/v1/completions", a_body, ex.prompt.count)
    a_done = sink.clock()
    if out.status != 200 or out.data is None:
        return out
    shape = _Shape(ex)
    choices = out.data.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    gen = choice.get("token_ids")
    p_ids = choice.get("prompt_token_ids") or (list(ids) if ids is not None else None)
    u = out.data.get("usage")
    usage: dict[str, Any] = u if isinstance(u, dict) else {}
    p = int(usage.get("prompt_tokens") or (len(p_ids) if p_ids else ex.prompt.count))
    if not isinstance(gen, list) or len(gen) < k + 1 or choice.get("finish_reason") != "length":
        # A finished on its own (stop, EOS) before the handoff point: its answer is the whole answer
        text = str(choice.get("text") or "")
        n = len(gen) if isinstance(gen, list) else int(usage.get("completion_tokens") or 0)
        return await _emit_whole(ex, shape, sink, text, choice.get("finish_reason"), choice.get("stop_reason"), _usage(p, n))
    text_k = _text_before(choice, k)
    if text_k is None or not p_ids:
        log.warning("engine %s returned no token ids or text offsets: running %s colocated on %s", a, ex.request_id, b)
        metrics.handoff_guard.labels("no-token-ids").inc()
        return await run_colocated(pool, ex, b, sink)
    kv = out.data.get("kv_transfer_params")
    b_body = dict(base, prompt=list(p_ids) + list(gen[:k]), stream=ex.stream)
    if ex.max_tokens is not None:
        b_body["max_tokens"] = ex.max_tokens - k
    if isinstance(ex.body.get("min_tokens"), int):
        b_body["min_tokens"] = max(0, ex.body["min_tokens"] - k)
    if ex.stream:
        b_body["stream_options"] = {"include_usage": True}
    queued = p + k
    if isinstance(kv, dict) and handoff_is_safe(p, k, block_size, remote_block_count(kv)):
        b_body["kv_transfer_params"] = kv
        queued = 0
    else:
        metrics.handoff_guard.labels("fallback" if isinstance(kv, dict) else "no-kv").inc()
    if ex.stream:
        await sink.send(encode_event(shape.chunk(text_k, first=True)), tokens=k)

    def transform(obj: dict[str, Any]) -> dict[str, Any] | None:
        if is_usage_only(obj):
            u = obj["usage"]
            return shape.usage_chunk(_usage(p, k + int(u.get("completion_tokens") or 0)))
        if "choices" in obj and "usage" in obj and isinstance(obj.get("usage"), dict) and not ex.stream:
            ch = obj["choices"][0] if obj["choices"] else {}
            u = obj["usage"]
            return shape.whole(text_k + str(ch.get("text") or ""), ch.get("finish_reason"), ch.get("stop_reason"),
                               _usage(p, k + int(u.get("completion_tokens") or 0)))
        ch = (obj.get("choices") or [{}])[0]
        return shape.chunk(str(ch.get("text") or ""), ch.get("finish_reason"), ch.get("stop_reason"))

    res = await _relay_b(pool, ex, b, "/v1/completions", b_body, sink, metrics, "split", a_done, queued, p + k, transform)
    if res.status == 200:
        res.completion_tokens += k
        res.prompt_tokens = p
    return res


async def _emit_whole(ex: Exchange, shape: _Shape, sink: ClientSink, text: str, finish: Any, stop_reason: Any,
                      usage: dict[str, int]) -> Outcome:
    if not ex.stream:
        data = shape.whole(text, finish, stop_reason, usage)
        return Outcome(200, json.dumps(data).encode(), usage["completion_tokens"], usage["prompt_tokens"], data)
    await sink.send(encode_event(shape.chunk(text, first=True)), tokens=usage["completion_tokens"])
    await sink.send(encode_event(shape.chunk("", finish, stop_reason)), tokens=0)
    if ex.client_usage:
        await sink.send(encode_event(shape.usage_chunk(usage)), tokens=0)
    return Outcome(200, None, usage["completion_tokens"], usage["prompt_tokens"])
