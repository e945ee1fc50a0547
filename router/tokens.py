"""The prompt's length P in tokens (and its token ids where they are known), for policies and the context check.

- A completions prompt given as token ids: exact, no call.
- ``token_count: tokenize`` (the default): vLLM's ``POST /tokenize`` on an available instance —
  ``{"model", "prompt"}`` or ``{"model", "messages", "add_generation_prompt": true}`` answers
  ``{"tokens": [...], "count": n, "max_model_len": m}``; the chat template is applied exactly as the chat
  endpoint applies it. An engine's 4xx (e.g. a message the template rejects) is the client's error (400), except
  429 (too many requests): a busy tokenizer is not the prompt's fault, so, like a failed call, another instance is
  asked (two in all).
- ``token_count: estimate``, or when no instance answers ``/tokenize`` (an answer other than non-negative integer
  token ids and, when given, a positive integer ``max_model_len`` is ignored and logged): one token per 4 UTF-8
  bytes of text (+4 per chat message for the template's role markers). It only feeds the policies; the
  context-length check is then the engine's (its 400 is relayed), never the router's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from fulcrum.router.errors import BadRequest
from fulcrum.router.schemas import ChatCompletionRequest, CompletionRequest
from fulcrum.router.upstream import UpstreamFailure, UpstreamPool, upstream_message

__all__ = ["PromptTokens", "estimate_tokens", "count_prompt", "token_count", "CHAT_TOKENIZE_KEYS"]

log = logging.getLogger(__name__)

CHAT_TOKENIZE_KEYS = ("chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
                      "tools", "documents", "mm_processor_kwargs")
"""Chat request fields that change the templated prompt, forwarded to ``/tokenize``."""

_BYTES_PER_TOKEN = 4
_TOKENS_PER_MESSAGE = 4


@dataclass(frozen=True, slots=True)
class PromptTokens:
    """The prompt's size.

    Attributes:
        count: P, tokens (exact or estimated).
        ids: the prompt's token ids (chat: after the template), or None when not known.
        exact: whether ``count`` came from the tokenizer.
        max_model_len: the engine's context limit from ``/tokenize``, or None.
    """

    count: int
    ids: tuple[int, ...] | None
    exact: bool
    max_model_len: int | None = None


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def estimate_tokens(req: CompletionRequest | ChatCompletionRequest) -> int:
    """The byte estimate (module docstring), at least 1 token."""
    if isinstance(req, CompletionRequest):
        p = req.single_prompt()
        if isinstance(p, list):
            return max(1, len(p))
        return max(1, -(-_utf8_len(p) // _BYTES_PER_TOKEN))
    n = sum(-(-_utf8_len(_content_text(m.content)) // _BYTES_PER_TOKEN) + _TOKENS_PER_MESSAGE for m in req.messages)
    return max(1, n)


def _utf8_len(text: str) -> int:
    """Bytes of ``text`` in UTF-8; a lone surrogate (refused at parsing, ``fulcrum.router.schemas``) counts 3."""
    return len(text.encode(errors="surrogatepass"))


def token_count(value: Any) -> int | None:
    """A token count or id from an engine (``usage``, ``/tokenize``): a non-negative integer (not a bool), else
    None (unknown)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _tokenize_answer(data: dict[str, Any]) -> tuple[tuple[int, ...], int | None] | str:
    """A ``/tokenize`` answer holding a ``tokens`` list: (the token ids, ``max_model_len`` or None when absent), or
    why it cannot be used."""
    tokens = data["tokens"]
    for t in tokens:
        if token_count(t) is None:
            return f"a token id is not a non-negative integer: {t!r}"[:200]
    mml = data.get("max_model_len")
    if mml is not None and not token_count(mml):
        return f"max_model_len is not a positive integer: {mml!r}"[:200]
    return tuple(tokens), mml


def _tokenize_body(req: CompletionRequest | ChatCompletionRequest, body: dict[str, Any], model: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if model:
        out["model"] = model
    if isinstance(req, CompletionRequest):
        out["prompt"] = req.single_prompt()
    else:
        out["messages"] = body["messages"]
        out["add_generation_prompt"] = True
        for k in CHAT_TOKENIZE_KEYS:
            if k in body:
                out[k] = body[k]
    return out


async def count_prompt(pool: UpstreamPool, req: CompletionRequest | ChatCompletionRequest, body: dict[str, Any],
                       model: str | None, mode: str) -> PromptTokens:
    """P for one request (module docstring).

    Raises:
        BadRequest: the engine's tokenizer rejected the prompt with a 4xx other than 404, 405 and 429 (its message
            is kept). A failed call or a 429 moves on to another instance; when none answers, the estimate.
    """
    if isinstance(req, CompletionRequest):
        p = req.single_prompt()
        if isinstance(p, list):
            return PromptTokens(len(p), tuple(p), True, pool.learned_max_model_len)
    if mode == "tokenize":
        tried: list[str] = []
        tok_body = _tokenize_body(req, body, model)
        for _ in range(2):
            iid = pool.any_available(exclude=tried)
            if iid is None:
                break
            tried.append(iid)
            try:
                status, raw, data = await pool.post_json(iid, "/tokenize", tok_body,
                                                         total_s=pool.config.timeouts.first_token_s)
            except UpstreamFailure as err:
                log.warning("tokenize on %s failed (%s); trying another instance", iid, err.cause)
                continue
            if status == 429:  # a busy tokenizer, not a bad prompt: as a failed call, ask another instance
                log.warning("tokenize on %s answered 429 (too many requests); trying another instance", iid)
                continue
            if 400 <= status < 500 and status not in (404, 405):
                raise BadRequest(f"the engine's tokenizer rejected the prompt: {upstream_message(raw, status)}")
            if status != 200 or not isinstance(data, dict) or not isinstance(data.get("tokens"), list):
                break  # an engine without /tokenize: estimate
            got = _tokenize_answer(data)
            if isinstance(got, str):
                log.warning("%s answered /tokenize with a malformed body (%s); estimating the prompt's length", iid, got)
                break
            ids, mml = got
            if mml is not None:
                pool.learned_max_model_len = mml
            return PromptTokens(len(ids), ids, True, pool.learned_max_model_len)
    return PromptTokens(estimate_tokens(req), None, False, pool.learned_max_model_len)
