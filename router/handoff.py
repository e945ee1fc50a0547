"""The handoff protocol: one request served by two engines over vLLM's NIXL ``kv_transfer_params``.

DESIGN, "The split of one request" and "A real vLLM engine on the CPU". Shared by the ``disaggregated`` and
``split`` policies (and, later, ARES decode rescheduling):

- **disaggregated** (s = P): engine A gets the request with ``max_tokens = 1``, ``stream = false`` and
  ``kv_transfer_params = {"do_remote_decode": true, ...}``; its answer's ``kv_transfer_params`` go unchanged with
  the original request to engine B, which pulls the prompt's KV and generates everything. A's token is dropped.
- **split after k tokens** (s = P + k): A gets the prompt as token ids with ``max_tokens = k + 1``,
  ``return_token_ids`` and ``logprobs = 0`` (each token's own string, to cut A's text after token k:
  :func:`text_cut`); the client gets A's first k tokens, then B continues from prompt + those k token ids with
  A's ``kv_transfer_params`` and ``max_tokens`` reduced by k. A's (k+1)-th token is dropped (B regenerates it
  from the same KV). The client sees one stream and one answer; ``usage`` says prompt P and completion k + B's
  tokens. Where no exact cut exists (token k ends inside a UTF-8 character), B continues from the prompt alone
  on the same KV (k = 0): correct, only A's k tokens of work are lost. Chat requests run both parts through
  ``/v1/completions`` on the chat-templated token ids and are answered in the chat format.

**The block-coverage guard.** B must never get a prompt whose KV the transferred blocks do not cover: vLLM's
decode engine asserts ``num_decode_blocks <= len(prefill_group)`` (NIXL connector, ``_apply_prefix_caching``)
and dies. DESIGN reports, from vLLM CPU runs: A's blocks cover P + k − 1 tokens when k ≥ 1 (P when k = 0), so
B's prompt of P + k tokens needs one block more exactly when (P + k − 1) is a multiple of the block size. Two
defences, both pure functions:

1. :func:`plan_handoff` moves k down to the nearest value safe under that model before A runs (k = 0 is
   always safe);
2. :func:`handoff_is_safe` checks B's block need against what A actually returned — the number of
   ``remote_block_ids`` and ``remote_num_tokens`` — and when they do not cover B's prompt, B runs without the
   KV (it recomputes the prefix) instead of dying.

(On vLLM CPU 0.32 with block size 32, A run with ``max_tokens = k + 1`` returned ⌈(P + k) / 32⌉ blocks and
``remote_num_tokens = P + k`` at every k tried, boundaries included, and B continued correctly from all k
tokens; the first defence is then only conservative, the second exact.)

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
from fulcrum.router.tokens import count_prompt, token_count
from fulcrum.router.upstream import UpstreamFailure, UpstreamPool

__all__ = [
    "DO_REMOTE_DECODE",
    "blocks_needed",
    "predicted_covered_tokens",
    "remote_block_count",
    "remote_token_count",
    "handoff_is_safe",
    "HandoffPlan",
    "plan_handoff",
    "split_blocker",
    "text_cut",
    "Cut",
    "choose_cut",
    "run_colocated",
    "run_disaggregated",
    "run_split",
    "disagg_blocker",
    "AnswerShape",
    "completions_body",
    "prompt_ids",
    "prefill_body",
    "run_prefill",
    "whole_usage",
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


def handoff_is_safe(prompt_tokens: int, k: int, block_size: int, remote_blocks: int | None = None,
                    remote_tokens: int | None = None) -> bool:
    """Whether B may get a prompt of P + k tokens on A's KV.

    Args:
        prompt_tokens: P, tokens.
        k: A's generated tokens given to B, tokens (0 = disaggregated).
        block_size: the engines' KV block size, tokens.
        remote_blocks: blocks A actually returned (``len(remote_block_ids)``); None = use
            :func:`predicted_covered_tokens`.
        remote_tokens: tokens A says its KV holds (``remote_num_tokens``), or None when it does not say.

    Returns:
        True when ⌈(P + k) / block_size⌉ equals the blocks A transfers (≤ the predicted ones when A's answer is
        not known yet) and P + k − 1 ≤ the tokens A computed (B recomputes the last token of its prompt, as
        vLLM's decode side always does).
    """
    n = prompt_tokens + k
    if remote_tokens is not None and n - 1 > remote_tokens:
        return False  # B computes its prompt's last token itself; the KV must hold every token before it
    if remote_blocks is not None:
        # B's decode side end-trims A's block list to the blocks it needs: more blocks than A sent trips its
        # assertion, fewer would take A's *last* blocks for the start of the prompt (wrong KV, silently)
        return blocks_needed(n, block_size) == remote_blocks
    return blocks_needed(n, block_size) <= blocks_needed(predicted_covered_tokens(prompt_tokens, k), block_size)


def remote_token_count(kv_params: dict[str, Any] | None) -> int | None:
    """``remote_num_tokens`` of A's ``kv_transfer_params`` (vLLM ≥ 0.11 sends it), or None."""
    if not isinstance(kv_params, dict):
        return None
    n = kv_params.get("remote_num_tokens")
    return n if isinstance(n, int) and not isinstance(n, bool) else None


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


def text_cut(text: str, token_strings: list[str] | None, k: int) -> str | None:
    """The text of A's first k tokens, cut from A's whole text, or None when no exact cut is known.

    vLLM's ``logprobs.text_offset`` sums the lengths of tokens decoded one by one, which drifts from the text
    wherever a token holds part of a UTF-8 character; so the cut removes the dropped tokens' own strings
    (tokens k + 1 ... of ``token_strings``) from the end instead, and only where that is exact: token k and
    every dropped token decode alone without U+FFFD (whole characters, so the cut falls on a character
    boundary) and the text ends with their strings joined (which fails for tokenizers whose tokens decode
    differently alone, e.g. SentencePiece's leading space). A cut inside a character is refused for a second
    reason: a prompt ending mid-character makes vLLM's incremental detokenizer on B emit its whole prompt as
    output (seen on vLLM CPU 0.32).

    Args:
        text: A's generated text.
        token_strings: ``logprobs.tokens`` of A's answer (each token decoded alone), or None.
        k: tokens handed to B (1 ≤ k < len(token_strings)).
    """
    if token_strings is None or not 1 <= k < len(token_strings):
        return None
    kept_last, dropped = token_strings[k - 1], token_strings[k:]
    if not all(isinstance(t, str) and t for t in (kept_last, *dropped)):
        return None
    tail = "".join(dropped)
    if "\ufffd" in kept_last + tail or not text.endswith(kept_last + tail):
        return None
    return text[: len(text) - len(tail)]


@dataclass(frozen=True, slots=True)
class Cut:
    """Where B takes over once A has answered.

    Attributes:
        k: A's tokens B continues from (0 = from the prompt alone), tokens.
        text: the text of those k tokens (what the client gets from A).
        use_kv: B gets A's ``kv_transfer_params`` (else B recomputes its whole prompt).
    """

    k: int
    text: str
    use_kv: bool


def choose_cut(text: str, token_strings: list[str] | None, k: int, prompt_tokens: int, block_size: int,
               remote_blocks: int | None, remote_tokens: int | None) -> Cut:
    """The largest k' ≤ k with an exact text cut (:func:`text_cut`) whose prompt A's KV fits exactly
    (:func:`handoff_is_safe`); else the prompt alone on the KV when that fits; else the largest exact cut
    without the KV; else the prompt alone without it. Pure."""
    clean: Cut | None = None
    for kk in range(k, 0, -1):
        t = text_cut(text, token_strings, kk)
        if t is None:
            continue
        if handoff_is_safe(prompt_tokens, kk, block_size, remote_blocks, remote_tokens):
            return Cut(kk, t, True)
        clean = clean or Cut(kk, t, False)
    if handoff_is_safe(prompt_tokens, 0, block_size, remote_blocks, remote_tokens):
        return Cut(0, "", True)
    return clean or Cut(0, "", False)


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
    pt = token_count(u.get("prompt_tokens")) if isinstance(u, dict) else None
    p_exact = pt if pt is not None else ex.prompt.count
    body = dict(ex.body)
    if isinstance(kv, dict) and handoff_is_safe(p_exact, 0, block_size, remote_block_count(kv), remote_token_count(kv)):
        body["kv_transfer_params"] = kv
        queued = 0
    else:
        metrics.child(metrics.handoff_guard, "no-kv" if not isinstance(kv, dict) else "fallback").inc()
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
        metrics.child(metrics.handoff, kind).observe(gap)
        if "kv_transfer_params" in body:
            metrics.child(metrics.kv_transfer, kind).observe(gap)
    return out


# ----------------------------------------------------------------------------------------------- split
def _usage(p: int, c: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Usage of the whole request: prompt P, completion c (other fields of the engine's usage kept)."""
    return {**(extra or {}), "prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


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

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.ex.created, "model": self.ex.model, "choices": [], "usage": usage}

    def whole(self, text: str, finish: str | None, stop_reason: Any, usage: dict[str, Any]) -> dict[str, Any]:
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
        metrics.child(metrics.handoff_guard, "adjusted").inc()
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
    try:  # A's 200 answer must have the shape the handoff reads; else A is broken (recorded, retried elsewhere)
        choice = _one_choice(out.data, a)
        if not isinstance(choice.get("finish_reason"), str):
            raise UpstreamFailure(a, "broken", f"{a} answered a choice without a finish_reason")
        gen = _token_ids(choice.get("token_ids"), a, "token_ids")
        p_ids = _token_ids(choice.get("prompt_token_ids"), a, "prompt_token_ids")
    except UpstreamFailure as err:
        pool.record_failure(a, err.cause)
        raise
    p_ids = p_ids or (list(ids) if ids is not None else None)
    u = out.data.get("usage")
    usage: dict[str, Any] = u if isinstance(u, dict) else {}
    p = token_count(usage.get("prompt_tokens")) or (len(p_ids) if p_ids else ex.prompt.count)
    if choice.get("finish_reason") != "length":
        # A finished on its own (stop, EOS) before the handoff point: its answer is the whole answer
        text = str(choice.get("text") or "")
        n = len(gen) if isinstance(gen, list) else token_count(usage.get("completion_tokens")) or 0
        return await _emit_whole(ex, shape, sink, text, choice.get("finish_reason"), choice.get("stop_reason"), _usage(p, n))
    if not isinstance(gen, list) or len(gen) < k + 1 or not p_ids:
        log.warning("engine %s returned no token ids (return_token_ids unsupported?): running %s colocated on %s",
                    a, ex.request_id, b)
        metrics.child(metrics.handoff_guard, "no-token-ids").inc()
        return await run_colocated(pool, ex, b, sink)
    lp = choice.get("logprobs")
    strings = lp.get("tokens") if isinstance(lp, dict) and isinstance(lp.get("tokens"), list) else None
    kv = out.data.get("kv_transfer_params")
    kv_ok = isinstance(kv, dict)
    cut = choose_cut(str(choice.get("text") or ""), strings, k, p, block_size,
                     remote_block_count(kv) if kv_ok else 0, remote_token_count(kv) if kv_ok else None)
    if cut.k != k:
        metrics.child(metrics.handoff_guard, "moved-cut").inc()
    if not cut.use_kv:
        metrics.child(metrics.handoff_guard, "fallback" if kv_ok else "no-kv").inc()
    k, text_k = cut.k, cut.text
    b_body = dict(base, prompt=list(p_ids) + list(gen[:k]), stream=ex.stream)
    if ex.max_tokens is not None:
        b_body["max_tokens"] = ex.max_tokens - k
    if isinstance(ex.body.get("min_tokens"), int):
        b_body["min_tokens"] = max(0, ex.body["min_tokens"] - k)
    if ex.stream:
        b_body["stream_options"] = {"include_usage": True}
    queued = p + k
    if cut.use_kv:
        b_body["kv_transfer_params"] = kv
        queued = 0
    first_sent = [False]
    if ex.stream and k > 0:
        await sink.send(encode_event(shape.chunk(text_k, first=True)), tokens=k)
        first_sent[0] = True

    def transform(obj: dict[str, Any]) -> dict[str, Any] | None:
        raw_u = obj.get("usage")
        u: dict[str, Any] = raw_u if isinstance(raw_u, dict) else {}
        if not ex.stream:  # B's whole answer
            ch = _one_choice(obj, b)
            return shape.whole(text_k + str(ch.get("text") or ""), ch.get("finish_reason"), ch.get("stop_reason"),
                               _usage(p, k + (token_count(u.get("completion_tokens")) or 0), u))
        if is_usage_only(obj):
            return shape.usage_chunk(_usage(p, k + (token_count(u.get("completion_tokens")) or 0), u))
        ch = _one_choice(obj, b)
        first = not first_sent[0]
        first_sent[0] = True
        return shape.chunk(str(ch.get("text") or ""), ch.get("finish_reason"), ch.get("stop_reason"), first=first)

    res = await _relay_b(pool, ex, b, "/v1/completions", b_body, sink, metrics, "split", a_done, queued, p + k, transform)
    if res.status == 200:
        res.completion_tokens += k
        res.prompt_tokens = p
    return res


def _one_choice(obj: dict[str, Any], iid: str) -> dict[str, Any]:
    """The one choice of an engine's ``/v1/completions`` answer or chunk (n = 1), its text a string when given.

    Raises:
        UpstreamFailure: "broken": ``choices`` is not a non-empty list of objects, or the text is not a string
            (not recorded here: the caller records it, or :func:`relay` does for a transform's failure).
    """
    choices = obj.get("choices")
    ch = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(ch, dict):
        raise UpstreamFailure(iid, "broken", f"{iid} answered without a choice object: choices = {choices!r}"[:300])
    text = ch.get("text")
    if text is not None and not isinstance(text, str):
        raise UpstreamFailure(iid, "broken", f"{iid} answered a choice whose text is not a string")
    return ch


def _token_ids(value: Any, iid: str, name: str) -> list[int] | None:
    """An answer's ``token_ids``/``prompt_token_ids``: None when absent, else a list of token ids.

    Raises:
        UpstreamFailure: "broken": present but not a list of non-negative integers (not recorded here).
    """
    if value is None:
        return None
    if not isinstance(value, list) or any(token_count(t) is None for t in value):
        raise UpstreamFailure(iid, "broken", f"{iid} answered {name} that are not a list of token ids")
    return value


async def _emit_whole(ex: Exchange, shape: _Shape, sink: ClientSink, text: str, finish: Any, stop_reason: Any,
                      usage: dict[str, Any]) -> Outcome:
    if not ex.stream:
        data = shape.whole(text, finish, stop_reason, usage)
        return Outcome(200, json.dumps(data).encode(), usage["completion_tokens"], usage["prompt_tokens"], data)
    await sink.send(encode_event(shape.chunk(text, first=True)), tokens=usage["completion_tokens"])
    await sink.send(encode_event(shape.chunk("", finish, stop_reason)), tokens=0)
    if ex.client_usage:
        await sink.send(encode_event(shape.usage_chunk(usage)), tokens=0)
    return Outcome(200, None, usage["completion_tokens"], usage["prompt_tokens"])


# Public names for the other executors of one request across engines (``fulcrum.router.rescheduler``: decode
# rescheduling continues a request elsewhere the way a split continues it on B).
AnswerShape = _Shape
"""Builds answers in the client's format (completions or chat) under the router's id."""
completions_body = _completions_body
"""The request's sampling options for ``/v1/completions`` (chat-only fields and the prompt removed)."""
prompt_ids = _prompt_ids
"""The prompt's token ids (chat: templated), from the admission count or one ``/tokenize`` call; None if unknown."""
prefill_body = _prefill_body
"""The prefill leg's body: ``max_tokens = 1``, not streamed, ``kv_transfer_params.do_remote_decode``."""
run_prefill = _run_prefill
"""POST a prefill leg with the pool's accounting; the answer as an :class:`Outcome` (parsed ``data``)."""
whole_usage = _usage
"""Usage of the whole request: prompt P, completion c."""
