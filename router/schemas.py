"""The request bodies the router accepts: OpenAI ``/v1/completions`` and ``/v1/chat/completions``.

Only the fields the router reads are declared, strictly typed (a string where a number belongs is a 400, as
OpenAI answers); every other field is kept as written and passed to the engine untouched (``extra="allow"``),
so sampling options the router does not know (``top_k``, ``ignore_eos``, ``structured_outputs`` ...) work.

Batches: ``prompt`` may be a string, a list of token ids, or a list of one of those; a batch of more than one
prompt is a 400 (send one request per prompt) — routing and splitting are decisions about one sequence.

``kv_transfer_params`` from a client is refused (400): it steers the engines' KV connector, and malformed values
kill a decode engine (vLLM advisories on incomplete ``kv_transfer_params``); only the router sets it.

Numbers must be finite anywhere in the body, fields the router does not know included: ``NaN``, ``Infinity`` and
literals that overflow a double (``1e999``) are a 400 naming the field. Prompt text (``prompt``, each message's
``content``) must be valid Unicode: JSON's ``\\udXXX`` escapes can write a lone UTF-16 surrogate, which no
tokenizer can encode, so it is a 400 naming where it is.
"""

from __future__ import annotations

import json
import math
import re
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
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


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


def _non_finite(value: Any, loc: str) -> tuple[str, float] | None:
    """The first non-finite float in ``value`` (depth first) as (its dotted path, the value), or None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (loc, value)
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for k, v in items:
        if isinstance(v, (float, dict, list)):
            found = _non_finite(v, f"{loc}.{k}" if loc else str(k))
            if found is not None:
                return found
    return None


_SURROGATE = re.compile("[\ud800-\udfff]")
"""A UTF-16 surrogate code point: in a ``str`` from ``json.loads`` always a lone one (a pair becomes one code point)."""


def _prompt_texts(req: CompletionRequest | ChatCompletionRequest) -> list[tuple[str, str]]:
    """The prompt's texts with their locations: ``prompt`` (or ``prompt.i``), or each message's ``content`` text."""
    if isinstance(req, CompletionRequest):
        p = req.prompt
        if isinstance(p, str):
            return [("prompt", p)]
        return [(f"prompt.{i}", x) for i, x in enumerate(p) if isinstance(x, str)]
    out: list[tuple[str, str]] = []
    for i, m in enumerate(req.messages):
        c = m.content
        if isinstance(c, str):
            out.append((f"messages.{i}.content", c))
        elif isinstance(c, list):
            out += [(f"messages.{i}.content.{j}.text", part["text"]) for j, part in enumerate(c)
                    if isinstance(part.get("text"), str)]
    return out


def _check_unicode(req: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuse a prompt holding a lone surrogate (module docstring).

    Raises:
        BadRequest: naming the field, the character's index and its code point.
    """
    for loc, text in _prompt_texts(req):
        m = _SURROGATE.search(text)
        if m is not None:
            raise BadRequest(f"prompt contains a lone surrogate (invalid Unicode) at {loc}, character {m.start()}: "
                             f"U+{ord(m.group()):04X}", param=loc)


def parse_request(raw: bytes, endpoint: Endpoint) -> tuple[CompletionRequest | ChatCompletionRequest, dict[str, Any]]:
    """Parse and validate a request body.

    Returns:
        the validated model and the body as a plain dict (what is forwarded, unknown fields kept).

    Raises:
        BadRequest: not UTF-8 JSON, not an object, a number that is not finite, a field missing, mistyped or out
            of range, or a prompt that is not valid Unicode.
    """
    non_finite = False

    def finite_or_flag(text: str) -> float:
        nonlocal non_finite
        v = float(text)
        if not math.isfinite(v):
            non_finite = True
        return v

    try:
        # the hooks only flag: the (rare) body with a non-finite number is walked afterwards to name the field
        body = json.loads(raw, parse_float=finite_or_flag, parse_constant=finite_or_flag)
    except (ValueError, RecursionError) as err:
        raise BadRequest(f"request body is not valid JSON: {str(err)[:200]}") from err
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if non_finite:
        try:
            found = _non_finite(body, "")
        except RecursionError as err:
            raise BadRequest("request body is nested too deeply") from err
        if found is not None:
            loc, value = found
            raise BadRequest(f"{loc}: must be a finite number, got {value}", param=loc)
    cls: type[CompletionRequest] | type[ChatCompletionRequest]
    cls = CompletionRequest if endpoint == "completions" else ChatCompletionRequest
    try:
        req = cls.model_validate(body)
    except ValidationError as err:
        raise _first_error(err) from err
    except RecursionError as err:
        raise BadRequest("request body is nested too deeply") from err
    _check_unicode(req)
    return req, body
