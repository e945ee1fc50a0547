"""Fulcrum's exception hierarchy.

::

    FulcrumError                 every error Fulcrum raises on purpose
    ├── SpecError                an LLMServe spec is invalid (field path in the message)
    ├── ProfileError             a performance profile is missing points, non-monotone or unreadable
    ├── TraceError               a request trace is empty, malformed or of an unknown format
    └── PlanningError            no plan satisfies the constraints (e.g. the model does not fit the GPUs)

Foreign errors (pydantic, yaml, json, csv, OS) are translated at the boundary with ``raise ... from``.
"""

from __future__ import annotations

import math
import re
from typing import Any

__all__ = ["FulcrumError", "SpecError", "ProfileError", "TraceError", "PlanningError", "as_float", "clipped",
           "number_problem", "safe_yaml", "yaml_problem"]


class FulcrumError(Exception):
    """Base class of every error Fulcrum raises deliberately."""


class SpecError(FulcrumError, ValueError):
    """An ``LLMServe`` spec is invalid; the message names the offending field."""


class ProfileError(FulcrumError, ValueError):
    """A ``PerformanceProfile`` cannot be built: missing, non-monotone or unparsable points."""


class TraceError(FulcrumError, ValueError):
    """A request trace cannot be read: empty, malformed rows, or an unknown format."""


class PlanningError(FulcrumError, ValueError):
    """No deployment satisfies the constraints (memory, GPU budget, TP limits)."""


def yaml_problem(err: Any) -> tuple[str, str]:
    """A PyYAML error as one line: (``":LINE:COLUMN"`` of the problem, 1-based, or ``""`` without a mark; what is
    wrong, PyYAML's context and problem joined, e.g. ``"expected a single document in the stream, but found another
    document"``), for a message ``f"{path}{where}: not valid YAML: {what}"`` instead of PyYAML's caret diagram."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
    parts = [str(p) for p in (getattr(err, "context", None), getattr(err, "problem", None)) if p]
    return where, ", ".join(parts) if parts else " ".join(str(err).split())


_YAML12_FLOAT = re.compile(r"^[-+]?(?:\.[0-9][0-9_]*|[0-9][0-9_]*(?:\.[0-9_]*)?)(?:[eE][-+]?[0-9]+)?$")
"""A float as YAML 1.2 (and JSON, and kubectl's YAML) reads it, beside YAML 1.1's: ``72.0e9``, ``1e9``, ``5e-3``
and ``+.5`` are numbers there, while PyYAML's YAML 1.1 resolver reads them as text."""
_SAFE_LOADER: Any = None


def _loader() -> Any:
    """``yaml.SafeLoader`` that also resolves :data:`_YAML12_FLOAT` plain scalars as floats (built once)."""
    global _SAFE_LOADER
    if _SAFE_LOADER is None:
        import yaml

        class Loader(yaml.SafeLoader):
            pass

        # checked after YAML 1.1's own resolvers (bool, int, float, ...), so ints stay ints; a quoted scalar is
        # never resolved, so "72.0e9" in quotes stays text
        Loader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML12_FLOAT, list("-+0123456789."))
        _SAFE_LOADER = Loader
    return _SAFE_LOADER


def safe_yaml(text: str, *, documents: bool = False) -> Any:
    """``yaml.safe_load(text)`` (``documents``: the list of ``yaml.safe_load_all``'s documents), with two changes
    every Fulcrum YAML reader shares:

    - plain exponent numbers that YAML 1.1 leaves as text are floats, as in YAML 1.2, JSON and ``kubectl``
      (``weightBytes: 72.0e9``, ``seconds: 5e-3``, ``+.5``; :data:`_YAML12_FLOAT`);
    - the ``ValueError`` of a timestamp PyYAML matches but cannot build (``2024-13-45``: "month must be in 1..12")
      is raised as a ``yaml.YAMLError``, so that a reader names the file for it as for any other YAML problem.

    Raises:
        yaml.YAMLError: not valid YAML (with :func:`yaml_problem`'s mark when PyYAML gives one).
        RecursionError: nested deeper than the parser goes.
    """
    import yaml

    try:
        return list(yaml.load_all(text, Loader=_loader())) if documents else yaml.load(text, Loader=_loader())
    except ValueError as err:
        raise yaml.YAMLError(" ".join(str(err).split())) from err


_NUMBER_TEXT = re.compile(r"[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?")


def number_problem(value: Any, *, text: bool = False) -> str | None:
    """What is wrong with ``value`` where a file must hold a number, as the profile loader and the step table word
    it (``"expected a number, got True"``), or None when it is a number. A bool is refused (``float(True)`` would
    read 1: YAML's ``true``/``yes``), and so is a string unless ``text`` (a CSV cell, whose numbers are text: the
    caller converts it); a quoted number in YAML or JSON (``"20"``) gets the hint ``(a string: write the number
    without quotes)`` — a plain ``72.0e9`` is a float already (:func:`safe_yaml`). Anything else that is no int or
    float (a list, a mapping, null) is refused too.
    """
    if isinstance(value, bool):
        return f"expected a number, got {value!r}"
    if isinstance(value, str):
        if text:
            return None
        hint = " (a string: write the number without quotes)" if _NUMBER_TEXT.fullmatch(value.strip()) else ""
        return f"expected a number, got {clipped(repr(value))}{hint}"
    if not isinstance(value, (int, float)):
        return f"expected a number, got {clipped(repr(value))}"
    return None


def clipped(text: str, keep: int = 40) -> str:
    """``text`` cut to ``keep`` characters with an ellipsis, for a message quoting an input that may be huge (a
    400-digit number, a 128-KiB field)."""
    return text if len(text) <= keep else f"{text[:keep]}…"


def as_float(value: Any) -> float:
    """``float(value)`` for a number read from a JSON, YAML or CSV file, with a number beyond float range (an integer
    of 400 digits) as ``inf`` or ``-inf`` by its sign instead of ``OverflowError``, for the caller's range check to
    refuse with its own message (``-10**400`` is below every lower bound, not above every upper one).

    Accepts what ``float()`` accepts (an ``int`` of any size, a ``float``, a numeric string: a string beyond range
    already reads as ``±inf``); each reader decides beforehand which of these its format allows (a bool, say).

    Raises:
        TypeError, ValueError: ``value`` is no number (as ``float()`` raises them).
    """
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf
