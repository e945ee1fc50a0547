"""The request bodies the router accepts: OpenAI ``/v1/completions`` and ``/v1/chat/completions``.

Only the fields the router reads are declared, strictly typed (a string where a number belongs is a 400, as
OpenAI answers); every other field is kept as written and passed to the engine untouched (``extra="allow"``),
so sampling options the router does not know (``top_k``, ``ignore_eos``, ``structured_outputs`` ...) work.

Batches: ``prompt`` may be a string, a list of token ids, or a list of one of those; a batch of more than one
prompt is a 400 (send one request per prompt) — routing and splitting are decisions about one sequence.

``kv_transfer_params`` from a client is refused (400): it steers the engines' KV connector, and malformed values
kill a decode engine (vLLM advisories on incomplete ``kv_transfer_params``); only the router sets it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError

from fulcrum.router.errors import BadRequest

__all__ = [
    "MAX_TOKENS_LIMIT",
    "StreamOptions",
    "CompletionRequest",
    "ChatMessage",
    "ChatCompletionRequest",
    "parse_request",
    "Endpoint",
]

Endpoint = Literal["completions", "chat"]

MAX_TOKENS_LIMIT = 1 << 24
"""Largest ``max_tokens`` accepted before the model's context is known (16 Mi tokens, above any model's)."""

Number = Annotated[float, Field(strict=True)]
TokenId = Annotated[int, Field(strict=True, ge=0)]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Open):
    """``stream_options``: ``include_usage`` adds a final chunk with token counts."""

    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None


class _Common(_Open):
    model: StrictStr | None = None
    max_tokens: Annotated[int, Field(strict=True, ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    min_tokens: Annotated[int, Field(strict=True, ge=0, le=MAX_TOKENS_LIMIT)] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(strict=True, ge=0.0)] | None = None
    n: Annotated[int, Field(strict=True, ge=1, le=128)] | None = 1
    kv_transfer_params: None = Field(default=None, description="set by the router only; a client's is refused")


class CompletionRequest(_Common):
    """``POST /v1/completions``: one prompt (text or token ids)."""

    prompt: StrictStr | list[TokenId] | list[StrictStr] | list[list[TokenId]]
    echo: StrictBool | None = False
    logprobs: Annotated[int, Field(strict=True, ge=0)] | None = None
    suffix: StrictStr | None = None
    best_of: Annotated[int, Field(strict=True, ge=1)] | None = None

    def single_prompt(self) -> str | list[int]:
        """The one prompt of the request.

        Raises:
            BadRequest: a batch of several prompts, or an empty list.
        """
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise BadRequest("prompt must not be empty", param="prompt")
        if isinstance(p[0], int):
            return [int(t) for t in p]
        if len(p) > 1:
            raise BadRequest(
                f"batched prompts ({len(p)}) are not supported by the router: send one request per prompt",
                param="prompt",
            )
        inner = p[0]
        if isinstance(inner, list) and not inner:
            raise BadRequest("prompt must not be empty", param="prompt")
        return inner if isinstance(inner, str) else [int(t) for t in inner]


class ChatMessage(_Open):
    """One chat message; content is text, a list of parts, or null (assistant tool calls)."""

    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(strict=True, ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    logprobs: StrictBool | None = False
    top_logprobs: Annotated[int, Field(strict=True, ge=0)] | None = None

    def output_cap(self) -> int | None:
        """The client's cap on generated tokens: ``max_completion_tokens``, else ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "StreamOptions", "ChatMessage"})


def _first_error(err: ValidationError) -> BadRequest:
    e = err.errors(include_url=False)[0]
    raw_loc = list(e["loc"])
    # union members add their type as a location step ("str", "list[constrained-int]"): keep field names and indices
    parts = [str(raw_loc[0])] if raw_loc else []
    parts += [str(x) for x in raw_loc[1:] if isinstance(x, int) or (str(x).isidentifier() and str(x) not in _TYPE_TAGS)]
    loc = ".".join(parts)
    msg = e["msg"]
    if e["type"] == "none_required" and loc == "kv_transfer_params":
        msg = "kv_transfer_params is set by the router, not by clients"
    return BadRequest(f"{loc}: {msg}" if loc else msg, param=loc or None)


def parse_request(raw: bytes, endpoint: Endpoint) -> tuple[CompletionRequest | ChatCompletionRequest, dict[str, Any]]:
    """Parse and validate a request body.

    Returns:
        the validated model and the body as a plain dict (what is forwarded, unknown fields kept).

    Raises:
        BadRequest: not UTF-8 JSON, not an object, or a field missing, mistyped or out of range.
    """
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise BadRequest(f"request body is not valid JSON: {str(err)[:200]}") from err
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    cls: type[CompletionRequest] | type[ChatCompletionRequest]
    cls = CompletionRequest if endpoint == "completions" else ChatCompletionRequest
    try:
        req = cls.model_validate(body)
    except ValidationError as err:
        raise _first_error(err) from err
    except RecursionError as err:
        raise BadRequest("request body is nested too deeply") from err
    return req, body
