"""Readers of request traces (Azure 2023 CSV, Mooncake JSONL) and of ServeGen rate series.

A trace file becomes a :class:`Trace`: an immutable, arrival-sorted tuple of
:class:`fulcrum.workload.Request` whose first request arrives at 0 s. Files may be gzip-compressed
(detected by the gzip magic bytes ``1f 8b``, whatever the file name); the format is detected from the
content unless given.

Formats:

- ``azure`` — CSV with the header ``TIMESTAMP,ContextTokens,GeneratedTokens`` (extra columns are
  ignored): arrival as a wall-clock date-time ``YYYY-MM-DD HH:MM:SS[.fffffff]`` (any number of
  fractional digits, ``T`` or a space between date and time, optional ``Z``/``±HH:MM`` offset;
  naive times are taken as UTC), prompt tokens, output tokens. Source: the Azure LLM inference
  traces 2023 (Patel et al., Splitwise, ISCA 2024).
- ``mooncake`` — JSON lines with ``timestamp`` (ms from the trace start), ``input_length``,
  ``output_length`` and optionally ``hash_ids`` (ids of the prompt's 512-token KV blocks). Source:
  Qin et al., Mooncake, FAST 2025.

Zero-length requests: a row whose input or output length is 0 is kept (its arrival is real load)
and its length is clamped to 1 token, because a request has at least one prompt and one output token
(``Request`` invariants). The number of such rows in the returned trace is ``Trace.clamped`` and is
stated in ``Trace.source``. Negative, non-integer or non-finite lengths are errors, and so are lengths above
``2**31 - 1`` tokens (no engine takes such a request; beyond float range they would also break the per-interval
means of :mod:`fulcrum.traces.series`).

Span: a file whose arrivals span more than a year (366 days) is refused. Every published LLM trace spans hours to
a few months; a longer span is a timestamp unit error (Mooncake ns or µs where ms belong, a stray date in an Azure
file), and replaying it would simulate for hours or years of empty intervals.

Every malformed input raises :class:`fulcrum.errors.TraceError` naming the file and, for a bad row,
its line number (1-based, the header being line 1 of a CSV).
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import IO, Any

from fulcrum.csv_records import CsvRecords
from fulcrum.data import BUNDLED_TRACES, bundled_trace_path
from fulcrum.errors import TraceError, as_float, clipped
from fulcrum.traces.synthetic import SYNTHETIC_TRACES, synthetic_trace
from fulcrum.workload import Request

__all__ = ["TRACE_FORMATS", "Trace", "RateSeries", "load_trace", "load_rate_series", "detect_format"]

TRACE_FORMATS: tuple[str, ...] = ("azure", "mooncake")
"""Names accepted by ``load_trace(..., fmt=...)``."""

_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")
_SERVEGEN_COLUMNS = ("window_start_s", "total_rate_rps")
_GZIP_MAGIC = b"\x1f\x8b"
_MAX_TOKENS = 2**31 - 1
"""The most tokens a trace row may give a prompt or an output (module doc)."""
_MAX_SPAN_S = 366 * 86_400.0
"""The longest span of arrivals a trace file may have, seconds (module doc)."""
_TIMESTAMP_RE = re.compile(
    r"^(\d{4})-(\d{2})-(\d{2})[T ](\d{2}):(\d{2}):(\d{2})(?:[.,](\d+))?\s*(Z|[+-]\d{2}:?\d{2})?$"
)


@dataclass(frozen=True)
class Trace:
    """A request trace, ready for replay.

    Attributes:
        name: short name: the bundled name (``azure-conv-2023``) or the file name without its
            ``.csv``/``.jsonl``/``.gz`` suffixes.
        requests: requests sorted by ``arrival_s`` (seconds); the first arrives at 0.0. Never empty.
        fmt: the format the file was read as, one of :data:`TRACE_FORMATS`, or ``"synthetic"`` for a generated
            trace (:mod:`fulcrum.traces.synthetic`).
        source: where the requests came from, for reports: file, window, limit, clamped rows.
        clamped: requests whose input or output length was 0 in the file and was clamped to 1 token.
    """

    name: str
    requests: tuple[Request, ...]
    fmt: str
    source: str
    clamped: int = 0

    @property
    def span_s(self) -> float:
        """Seconds from the first to the last arrival (0.0 for a single request)."""
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0

    def __len__(self) -> int:
        return len(self.requests)


@dataclass(frozen=True)
class RateSeries:
    """A request-rate time series at a fixed interval (ServeGen aggregates).

    Attributes:
        name: file name without its ``.csv``/``.gz`` suffixes.
        interval_s: length of each window, seconds (600 for the ServeGen 10-min aggregates).
        values: mean request rate of each window, requests/s, in time order from the first window.
            ``nan`` marks a window with zero total rate: in ServeGen those are collection gaps (whole
            windows where no client reported), not idle periods, so forecasters must mask them.
    """

    name: str
    interval_s: float
    values: tuple[float, ...]

    @property
    def gaps(self) -> int:
        """Number of windows that are collection gaps (``nan``)."""
        return sum(1 for v in self.values if math.isnan(v))


@dataclass(frozen=True, slots=True)
class _Row:
    """One parsed row before windowing: arrival in seconds relative to the file's first row; ``line``: its line in
    the file (1-based; 0 for a generated trace)."""

    arrival_s: float
    isl: int
    osl: int
    prefix_ids: tuple[int, ...]
    line: int = 0


def load_trace(
    path: str | Path,
    fmt: str | None = None,
    *,
    start_s: float = 0.0,
    duration_s: float | None = None,
    limit: int | None = None,
    seed: int | None = None,
) -> Trace:
    """Read a request trace file (or a bundled trace by name) into a :class:`Trace`.

    Args:
        path: a file path, or the name of a bundled trace (a key of ``fulcrum.data.BUNDLED_TRACES``) or of a
            synthetic one (a key of ``fulcrum.traces.synthetic.SYNTHETIC_TRACES``), used when no file of that
            name exists.
        fmt: ``"azure"`` or ``"mooncake"``; detected from the content when ``None``.
        start_s: keep requests arriving at or after this offset, seconds from the first request of
            the file.
        duration_s: keep requests arriving before ``start_s + duration_s``; ``None`` = to the end.
        limit: keep at most this many requests (the earliest ones of the window).
        seed: for a synthetic trace, the seed its requests are drawn with (None: its default seed); a file or a
            bundled trace has no seed.

    Returns:
        the windowed requests, sorted by arrival and re-based so the first arrives at 0.0 s.

    Raises:
        TraceError: the file is missing, unreadable, empty, has no requests, or a row is malformed
            (the message names the file and line); the format is unknown or cannot be detected; the
            window arguments are invalid or the window holds no request; a ``seed`` is given for a trace that is
            not synthetic; the file's arrivals span more than a year (a timestamp unit error, module doc).
    """
    if start_s < 0 or not math.isfinite(start_s):
        raise TraceError(f"start_s must be a finite number >= 0, got {start_s}")
    if duration_s is not None and not duration_s > 0:
        raise TraceError(f"duration_s must be > 0, got {duration_s}")
    if limit is not None and limit < 1:
        raise TraceError(f"limit must be >= 1, got {limit}")
    if isinstance(path, str) and path in SYNTHETIC_TRACES and not Path(path).is_file():
        how = "default seed" if seed is None else f"seed {seed}"
        file, name, origin = Path(path), path, f"synthetic trace {path} (generated, {how})"
        fmt = "synthetic"
        rows = [_Row(r.arrival_s, r.isl, r.osl, ()) for r in synthetic_trace(path, seed)]
    elif seed is not None:
        raise TraceError(
            f"{path}: a seed applies only to a synthetic trace ({', '.join(sorted(SYNTHETIC_TRACES))}); "
            "a file or a bundled trace is what it is"
        )
    else:
        file, name, origin = _resolve(path)
        fmt = _check_format(fmt) if fmt is not None else detect_format(file)
        rows = _read_azure(file) if fmt == "azure" else _read_mooncake(file)
    if not rows:
        raise TraceError(f"{file}: no requests (empty file or header only)")
    total = len(rows)
    rows.sort(key=lambda r: r.arrival_s)
    t0 = rows[0].arrival_s
    _check_span(rows, file)
    end_s = math.inf if duration_s is None else start_s + duration_s
    window = [r for r in rows if start_s <= r.arrival_s - t0 < end_s]
    if limit is not None:
        window = window[:limit]
    if not window:
        label = file if origin == str(file) else name  # a bundled or synthetic trace by its name, not a path
        raise TraceError(
            f"{label}: no request in the window [{start_s:g}, {end_s:g}) s "
            f"(the trace spans {rows[-1].arrival_s - t0:.1f} s)"
        )
    base = window[0].arrival_s
    clamped = sum(1 for r in window if r.isl == 0 or r.osl == 0)
    requests = tuple(
        Request(arrival_s=r.arrival_s - base, isl=max(r.isl, 1), osl=max(r.osl, 1), prefix_ids=r.prefix_ids)
        for r in window
    )
    notes = [origin, f"{len(requests)} of {total} requests"]
    if start_s > 0 or duration_s is not None:
        notes.append(f"window [{start_s:g}, {end_s:g}) s")
    if limit is not None:
        notes.append(f"limit {limit}")
    if clamped:
        notes.append(f"{clamped} requests with 0 input or output tokens clamped to 1")
    return Trace(name=name, requests=requests, fmt=fmt, source="; ".join(notes), clamped=clamped)


def _check_span(rows: list[_Row], file: Path) -> None:
    """Refuse arrival-sorted ``rows`` spanning more than :data:`_MAX_SPAN_S` (module doc), naming both lines."""
    first, last = rows[0], rows[-1]
    span = last.arrival_s - first.arrival_s
    if span > _MAX_SPAN_S:
        raise TraceError(
            f"{file}: arrivals span {span:.3g} s ({span / (365.25 * 86_400):.3g} years) from line {first.line} to line "
            f"{last.line}, more than a year: check the timestamp unit (mooncake: ms from the trace start; azure: "
            "a date-time)"
        )


def detect_format(path: str | Path) -> str:
    """Detect a trace file's format from its first non-blank line.

    A JSON object with ``timestamp``, ``input_length`` and ``output_length`` is ``mooncake`` (so is a line that
    names the three keys but does not parse: reading it then says why); a CSV header holding ``TIMESTAMP``,
    ``ContextTokens`` and ``GeneratedTokens`` is ``azure``.

    Raises:
        TraceError: the file is unreadable or empty, or its first line matches neither format (the
            message lists the known formats).
    """
    file = Path(path)
    with _open_text(file) as fh:
        first = next((line for line in _guard(fh, file) if line.strip()), None)
    if first is None:
        raise TraceError(f"{file}: empty file")
    line = first.strip()
    if line.startswith("{"):
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):  # JSONDecodeError, a too-long integer, nesting too deep
            obj = None
        if isinstance(obj, dict) and all(k in obj for k in _MOONCAKE_KEYS):
            return "mooncake"
        if obj is None and all(f'"{k}"' in line for k in _MOONCAKE_KEYS):
            return "mooncake"  # a Mooncake line that does not parse: the reader says why, naming the line
    else:
        try:
            header = {c.strip() for c in next(csv.reader([line]))}
        except csv.Error:  # e.g. a field over the csv module's limit: not a header
            header = set()
        if all(c in header for c in _AZURE_COLUMNS):
            return "azure"
    raise TraceError(
        f"{file}: unknown trace format (first line {line[:80]!r}); known formats: "
        f"azure (CSV header {','.join(_AZURE_COLUMNS)}), mooncake (JSON lines with "
        f"{', '.join(_MOONCAKE_KEYS)}, hash_ids)"
    )


def load_rate_series(path: str | Path) -> RateSeries:
    """Read a ServeGen aggregate rate CSV (``window_start_s,total_rate_rps,active_clients``).

    The interval is the (constant) step between consecutive ``window_start_s``. Windows whose total
    rate is 0 become ``nan``: in ServeGen they are collection gaps, not idle time (see
    ``/work/shared/data/README.md``: m-mid has 84 such windows, m-small 37).

    Raises:
        TraceError: the file is missing, unreadable or empty; a column is missing; a value is
            non-numeric or negative; there are fewer than 2 windows; every window is a gap (no rate to forecast);
            or the windows are not evenly spaced (the message names file and line).
    """
    file = Path(path)
    if not file.is_file():
        raise TraceError(f"no such rate-series file: {file}")
    starts: list[float] = []
    values: list[float] = []
    with _open_text(file) as fh:
        reader = CsvRecords(_guard(fh, file), file, TraceError)
        index = _csv_header(reader, file, _SERVEGEN_COLUMNS)
        for record in reader:
            if not record or all(not c.strip() for c in record):
                continue
            line = reader.line
            start = _float_field(record, index["window_start_s"], "window_start_s", file, line)
            rate = _float_field(record, index["total_rate_rps"], "total_rate_rps", file, line)
            if rate < 0:
                raise TraceError(f"{file}:{line}: total_rate_rps must be >= 0, got {rate:g}")
            starts.append(start)
            values.append(rate if rate > 0 else math.nan)
    if len(values) < 2:
        raise TraceError(f"{file}: a rate series needs at least 2 windows, found {len(values)}")
    if all(math.isnan(v) for v in values):
        raise TraceError(f"{file}: every window's total_rate_rps is 0: all {len(values)} windows are collection gaps, "
                         "no rate to forecast")
    interval = starts[1] - starts[0]
    if not interval > 0:
        raise TraceError(f"{file}: window_start_s must increase, got {starts[0]:g} then {starts[1]:g}")
    for k in range(1, len(starts)):
        if not math.isclose(starts[k] - starts[k - 1], interval, rel_tol=1e-9, abs_tol=1e-6):
            raise TraceError(
                f"{file}: windows are not evenly spaced: step {starts[k] - starts[k - 1]:g} s after "
                f"window {k - 1}, expected {interval:g} s"
            )
    return RateSeries(name=_stem(file), interval_s=interval, values=tuple(values))


# ---------------------------------------------------------------------------------------------------
# Opening files


def _resolve(path: str | Path) -> tuple[Path, str, str]:
    """Return (file, trace name, origin text) for a path or a bundled trace name."""
    file = Path(path)
    if file.is_file():
        return file, _stem(file), str(file)
    if isinstance(path, str) and path in BUNDLED_TRACES:
        bundled = bundled_trace_path(path)
        return bundled, path, f"bundled trace {path} ({bundled.name})"
    if file.is_dir():
        raise TraceError(f"{file} is a directory, not a trace file")
    names = ", ".join(sorted(BUNDLED_TRACES) + sorted(SYNTHETIC_TRACES))
    raise TraceError(f"no such trace file: {file} (bundled traces: {names})")


def _stem(file: Path) -> str:
    name = file.name
    for suffix in (".gz", ".csv", ".jsonl", ".json"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name or file.name


def _open_text(file: Path) -> IO[str]:
    """Open ``file`` as UTF-8 text, decompressing when it starts with the gzip magic bytes."""
    try:
        with open(file, "rb") as raw:
            magic = raw.read(2)
        if magic == _GZIP_MAGIC:
            return io.TextIOWrapper(gzip.open(file, "rb"), encoding="utf-8-sig", newline="")
        return open(file, encoding="utf-8-sig", newline="")
    except OSError as err:
        raise TraceError(f"cannot read trace file {file}: {err.strerror or err}") from err


def _guard(lines: IO[str], file: Path) -> Iterator[str]:
    """Yield the lines of ``lines``, turning decompression and decoding failures into TraceError."""
    try:
        yield from lines
    except (OSError, EOFError, zlib.error) as err:  # gzip.BadGzipFile is an OSError
        raise TraceError(f"{file}: corrupt or truncated gzip data: {err}") from err
    except UnicodeDecodeError as err:
        raise TraceError(f"{file}: not UTF-8 text ({err.reason} at byte {err.start})") from err


# ---------------------------------------------------------------------------------------------------
# Azure CSV


def _read_azure(file: Path) -> list[_Row]:
    rows: list[_Row] = []
    first_time: datetime | None = None
    with _open_text(file) as fh:
        reader = CsvRecords(_guard(fh, file), file, TraceError)
        index = _csv_header(reader, file, _AZURE_COLUMNS)
        for record in reader:
            if not record or all(not c.strip() for c in record):
                continue
            line = reader.line
            when = _parse_timestamp(_field(record, index["TIMESTAMP"], "TIMESTAMP", file, line), file, line)
            if first_time is None:
                first_time = when
            isl = _token_field(record, index["ContextTokens"], "ContextTokens", file, line)
            osl = _token_field(record, index["GeneratedTokens"], "GeneratedTokens", file, line)
            rows.append(_Row((when - first_time) / timedelta(seconds=1), isl, osl, (), line))
    return rows


def _csv_header(reader: CsvRecords, file: Path, required: tuple[str, ...]) -> dict[str, int]:
    """Read the header row; return column name → index for the required columns, each present exactly once."""
    header = next((r for r in reader if r and any(c.strip() for c in r)), None)
    if header is None:
        raise TraceError(f"{file}: empty file")
    names = [c.strip() for c in header]
    missing = [c for c in required if c not in names]
    if missing:
        raise TraceError(
            f"{file}:{reader.line}: missing column(s) {', '.join(missing)} "
            f"(header has {', '.join(names)})"
        )
    for c in required:
        if names.count(c) > 1:
            raise TraceError(f"{file}:{reader.line}: column {c} appears {names.count(c)} times: which is meant?")
    return {c: names.index(c) for c in required}


def _field(record: list[str], i: int, column: str, file: Path, line: int) -> str:
    """The stripped value of column ``column`` (index ``i``) of the record starting on ``line``; a TraceError when it
    is missing or a quote opened on ``line`` carried it over later lines (closed by a stray quote further on)."""
    if i >= len(record) or not record[i].strip():
        raise TraceError(f"{file}:{line}: missing value for {column}")
    value = record[i].strip()
    if "\n" in value or "\r" in value:
        raise TraceError(
            f"{file}:{line}: malformed CSV: unterminated quote: the quoted {column} value opened on this line runs on "
            f"over {len(value.splitlines())} lines"
        )
    return value


def _token_field(record: list[str], i: int, column: str, file: Path, line: int) -> int:
    text = _field(record, i, column, file, line)
    try:
        number = float(text)  # "12", "12.0" and "1e3" alike; never the int-digit limit of int(text)
    except ValueError:
        raise TraceError(f"{file}:{line}: {column} is not a number: {clipped(text)!r}") from None
    return _tokens(number, column, file, line, text)


def _tokens(number: float, column: str, file: Path, line: int, raw: Any) -> int:
    """``number`` as a token count in [0, :data:`_MAX_TOKENS`], else a TraceError quoting ``raw``, the value as the
    file gives it (``inf`` stands for any number too large for a float, and is too many tokens like them)."""
    if 0 <= number <= _MAX_TOKENS and number.is_integer():  # not nan
        return int(number)
    shown = clipped(raw if isinstance(raw, str) else repr(raw))
    if number < 0:
        raise TraceError(f"{file}:{line}: {column} must be >= 0 tokens, got {shown}")
    if number > _MAX_TOKENS:
        raise TraceError(f"{file}:{line}: {column} must be at most {_MAX_TOKENS} tokens, got {shown}")
    raise TraceError(f"{file}:{line}: {column} must be a whole number of tokens, got {shown}")


def _float_field(record: list[str], i: int, column: str, file: Path, line: int) -> float:
    text = _field(record, i, column, file, line)
    try:
        value = float(text)
    except ValueError:
        raise TraceError(f"{file}:{line}: {column} is not a number: {clipped(text)!r}") from None
    if not math.isfinite(value):
        raise TraceError(f"{file}:{line}: {column} must be finite, got {clipped(text)!r}")
    return value


def _parse_timestamp(text: str, file: Path, line: int) -> datetime:
    """Parse ``YYYY-MM-DD HH:MM:SS[.f…]`` with any number of fractional digits (Azure writes 7)."""
    match = _TIMESTAMP_RE.match(text)
    if match is None:
        raise TraceError(f"{file}:{line}: unparsable TIMESTAMP {text!r} (expected YYYY-MM-DD HH:MM:SS.fffffff)")
    year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
    fraction, offset = match.group(7), match.group(8)
    tz = timezone.utc
    if offset and offset != "Z":
        sign = 1 if offset[0] == "+" else -1
        digits = offset[1:].replace(":", "")
        try:
            tz = timezone(sign * timedelta(hours=int(digits[:2]), minutes=int(digits[2:])))
        except ValueError:
            raise TraceError(
                f"{file}:{line}: invalid TIMESTAMP {clipped(text)!r}: UTC offset {offset} is not within ±24:00"
            ) from None
    try:
        when = datetime(year, month, day, hour, minute, second, tzinfo=tz)
    except ValueError as err:
        raise TraceError(f"{file}:{line}: invalid TIMESTAMP {clipped(text)!r}: {err}") from None
    if fraction:
        # Microseconds hold 6 digits; keep the 7th (100 ns) as a rounded microsecond. float(), not int(): a
        # fraction of thousands of digits is still a fraction, not Python's int-digit limit.
        when += timedelta(microseconds=round(float(f"0.{fraction}") * 1e6))
    return when


# ---------------------------------------------------------------------------------------------------
# Mooncake JSONL


def _read_mooncake(file: Path) -> list[_Row]:
    rows: list[_Row] = []
    with _open_text(file) as fh:
        for line, text in enumerate(_guard(fh, file), start=1):
            if not text.strip():
                continue
            obj = _json_line(text, file, line)
            if not isinstance(obj, dict):
                raise TraceError(f"{file}:{line}: expected a JSON object, got {type(obj).__name__}")
            missing = [k for k in _MOONCAKE_KEYS if k not in obj]
            if missing:
                raise TraceError(f"{file}:{line}: missing key(s) {', '.join(missing)}")
            stamp = _json_number(obj["timestamp"])
            if stamp is None or not 0 <= stamp < math.inf:  # nan too; inf: Infinity or an int beyond float range
                what = "finite" if stamp == math.inf else "a number of ms >= 0"
                raise TraceError(f"{file}:{line}: timestamp must be {what}, got {clipped(repr(obj['timestamp']))}")
            isl = _json_tokens(obj, "input_length", file, line)
            osl = _json_tokens(obj, "output_length", file, line)
            rows.append(_Row(stamp / 1000.0, isl, osl, _json_hash_ids(obj, file, line), line))
    return rows


def _json_line(text: str, file: Path, line: int) -> Any:
    """One JSON line parsed; a TraceError naming file and line when it is not JSON (or nests or counts past what
    Python's parser takes)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise TraceError(f"{file}:{line}: broken JSON line: {err.msg} (column {err.colno})") from None
    except RecursionError:
        raise TraceError(f"{file}:{line}: broken JSON line: nested too deeply") from None
    except ValueError as err:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise TraceError(f"{file}:{line}: broken JSON line: {err}") from None


def _json_number(value: Any) -> float | None:
    """A JSON number as a float (``inf`` or ``-inf`` by its sign for an integer beyond float range); None for anything
    else (bool too)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return as_float(value)


def _json_tokens(obj: dict[str, Any], key: str, file: Path, line: int) -> int:
    value = obj[key]
    number = _json_number(value)
    if number is None:
        raise TraceError(f"{file}:{line}: {key} must be a whole number of tokens, got {clipped(repr(value))}")
    return _tokens(number, key, file, line, value)


def _json_hash_ids(obj: dict[str, Any], file: Path, line: int) -> tuple[int, ...]:
    ids = obj.get("hash_ids", [])
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TraceError(f"{file}:{line}: hash_ids must be a list of integers")
    return tuple(ids)


def _check_format(fmt: str) -> str:
    if fmt not in TRACE_FORMATS:
        raise TraceError(f"unknown trace format {fmt!r}; known formats: {', '.join(TRACE_FORMATS)}")
    return fmt
