"""Errors the router answers its clients with, in OpenAI's error shape.

::

    RouterHTTPError            an answer other than 2xx, with an OpenAI-shaped body
    ├── BadRequest             400: malformed JSON, missing or mistyped fields, a prompt too long for the model
    ├── ModelNotFound          404: the request names a model this router does not serve
    ├── NoHealthyInstance      503: no instance can take the request now
    └── UpstreamError          502: the engine failed; the message is the engine's own

The body is ``{"error": {"message", "type", "param", "code"}}`` (OpenAI API reference, "Error codes").
Validation (``fulcrum.router.schemas``) raises :class:`BadRequest`; the upstream pool translates connection
failures and engine 5xx into :class:`UpstreamError` once retries are spent.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = [
    "RouterHTTPError",
    "BadRequest",
    "ModelNotFound",
    "NoHealthyInstance",
    "UpstreamError",
    "error_body",
]


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    """The OpenAI error object ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class RouterHTTPError(Exception):
    """An error answered to the client with ``status`` and an OpenAI-shaped JSON body."""

    status: int = 500
    type_: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body."""
        return error_body(self.message, self.type_, self.param, self.code)

    def body_bytes(self) -> bytes:
        """The JSON body, encoded."""
        return json.dumps(self.body()).encode()


class BadRequest(RouterHTTPError):
    """400: the request cannot be served as written (``param`` names the field)."""

    status = 400
    type_ = "invalid_request_error"


class ModelNotFound(RouterHTTPError):
    """404: the request names a model the router does not serve."""

    status = 404
    type_ = "invalid_request_error"


class NoHealthyInstance(RouterHTTPError):
    """503: no healthy, non-draining instance can take the request."""

    status = 503
    type_ = "service_unavailable"


class UpstreamError(RouterHTTPError):
    """502: the engine failed (connection refused or reset, timeout, 5xx); ``message`` is the engine's."""

    status = 502
    type_ = "upstream_error"
