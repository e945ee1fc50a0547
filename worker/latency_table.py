"""The step latency table of Libra's local scheduler: (prefill tokens, mean decode context, decodes) → step seconds.

Libra §4.2, Algorithm 2 keeps a *profile table* T of measured batch latencies keyed by the batch's composition
— prefill tokens ``plen``, mean decode context ``ctx`` and number of decodes ``dnum`` — records every executed
batch into it (line 1, ``RECORD(T, B.PLEN, B.CTX, B.DNUM, B.TIME)``: online refinement) and asks it for the
largest prefill budget M that keeps the next batch within the TBT SLO (line 3, ``MAXPREFILLALLOWED``).
:class:`StepLatencyTable` is that table; it is pure (no I/O except the explicit ``save``/``load``, no clock, no
vLLM) so the vLLM scheduler (``slo_scheduler.py``), the offline profiler (``step_profiler.py``) and the tests
share it.

Layout (documented contract):

- **Buckets.** Each coordinate is snapped to the nearest point of a geometric grid (in log2 space; 0 is its own
  point): prefill tokens on :data:`PREFILL_GRID`, context tokens on :data:`CONTEXT_GRID`, decodes on
  :data:`DECODE_GRID`. One bucket holds an exponentially weighted moving average (EWMA, weight ``alpha`` for the
  newest sample) of the step time in seconds, the EWMA of the exact prefill tokens of its samples (the bucket's
  x-coordinate for interpolation) and a sample count. A bucket with ``samples == 0`` is a *prior* (seeded from a
  :class:`~fulcrum.ratio.profile.PerformanceProfile`); its first measurement replaces it outright.
- **Prediction** for (p, c, d): take the *slice* of buckets with the snapped (c, d); if it is empty, the
  nearest non-empty slice (log2 distance over (c, d); ties go to the larger, slower slice — conservative).
  Along p, interpolate piecewise-linearly between the slice's buckets at their mean prefill tokens, after a
  weighted isotonic regression (pool adjacent violators, weights = sample counts) that makes the curve
  **non-decreasing in p** (more prefill never predicts a faster step, which the budget's binary search
  needs) without letting one noisy slow bucket lift every larger prefill. Below the first bucket: the first bucket's value;
  above the last: linear extrapolation with the slope of the last two points, never below the last value.
  A slice of one bucket (typically decode-only steps at a new context) borrows the *increase* over its point
  from the nearest slice that has two or more buckets; with no such slice anywhere it stays flat (no
  evidence yet: the next mixed step supplies it). An empty table predicts ``None``.
- **Budget** (``MAXPREFILLALLOWED``): the largest M in [0, max_tokens] whose predicted step time is ≤ the SLO,
  by binary search; then at least ``min_prefill_tokens`` (the *floor*: when the decodes alone already exceed
  the SLO, prefills still advance by the floor each step and never starve), and ``max_tokens`` when the step
  has no decodes (no TBT to protect) or the table is empty (no evidence to limit by).
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import yaml

from fulcrum.errors import ProfileError, as_float, clipped, number_problem, safe_yaml, yaml_problem
from fulcrum.ratio.step_cost import StepCost

if TYPE_CHECKING:  # only for the annotation: the engine's environment need not import scipy
    from fulcrum.ratio.profile import PerformanceProfile

__all__ = [
    "CONTEXT_GRID",
    "DECODE_GRID",
    "PREFILL_GRID",
    "StepKey",
    "StepEntry",
    "StepLatencyTable",
    "snap",
]

PREFILL_GRID: tuple[int, ...] = (0,) + tuple(2**k for k in range(4, 18))
"""Prefill-token bucket points: 0, 16, 32, …, 131072 tokens (x2 steps: step time is close to linear in p)."""
CONTEXT_GRID: tuple[int, ...] = (0,) + tuple(2**k for k in range(6, 18))
"""Mean-decode-context bucket points: 0, 64, 128, …, 131072 tokens."""
DECODE_GRID: tuple[int, ...] = (0,) + tuple(2**k for k in range(0, 11))
"""Decode-count bucket points: 0, 1, 2, 4, …, 1024 requests."""

_FORMAT_VERSION = 1


def snap(value: float, grid: Sequence[int]) -> int:
    """The point of ``grid`` (ascending, starting at 0) nearest to ``value`` in log2 space; 0 only for 0.

    Values below 0 snap to 0, values beyond the last point to the last point. ``value`` in tokens or requests.
    """
    if value <= 0:
        return grid[0]
    positive = [g for g in grid if g > 0]
    if value <= positive[0]:
        return positive[0]
    if value >= positive[-1]:
        return positive[-1]
    j = bisect.bisect_left(positive, value)
    lo, hi = positive[j - 1], positive[j]
    return lo if math.log2(value) - math.log2(lo) < math.log2(hi) - math.log2(value) else hi


@dataclass(frozen=True, order=True)
class StepKey:
    """A bucket: prefill tokens, mean decode context tokens and decodes, each a grid point."""

    prefill_tokens: int
    context_tokens: int
    decodes: int


@dataclass(frozen=True)
class StepEntry:
    """One bucket's statistics.

    Attributes:
        key: the bucket.
        seconds: EWMA of the measured step time, seconds (or the prior when ``samples == 0``).
        mean_prefill_tokens: EWMA of the exact prefill tokens of the samples (interpolation x), tokens.
        samples: measured steps recorded into the bucket (0 = seeded prior).
    """

    key: StepKey
    seconds: float
    mean_prefill_tokens: float
    samples: int


def _finite_non_negative(name: str, value: float) -> float:
    v = as_float(value)
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {clipped(repr(value))}")
    return v


def _file_number(name: str, value: Any) -> float | int:
    """A number as a table file holds it: a JSON/YAML int or float, as :meth:`StepLatencyTable.to_dict` writes it.
    A bool (YAML's ``true``/``yes``: ``float(True)`` would read 1) or a string (``"0.5"``: text where a number
    belongs), a null (``seconds:`` with no value), a list or a mapping is refused, worded as the profile loader
    words it (``expected a number, got True``). A plain exponent number (``seconds: 5e-3``) is a float already
    (:func:`fulcrum.errors.safe_yaml`)."""
    problem = number_problem(value)
    if problem is not None:
        raise ValueError(f"{name}: {problem}")
    return cast("float | int", value)  # number_problem let through an int or a float only


def _file_non_negative(name: str, value: Any) -> float:
    """A finite number >= 0 (tokens, decodes, seconds) from a table file."""
    return _finite_non_negative(name, _file_number(name, value))


def _count(name: str, value: Any) -> int:
    """A whole number >= 0 (a sample count, a token floor) from a table file."""
    v = as_float(_file_number(name, value))
    if not (v >= 0 and v.is_integer()):  # not inf, not nan
        raise ValueError(f"{name} must be a whole number >= 0, got {clipped(repr(value))}")
    return int(v)


class StepLatencyTable:
    """Libra's profile table T (Alg. 2): bucketed step latencies with online EWMA refinement.

    Args:
        alpha: EWMA weight of a new measurement in (0, 1]; 0.25 follows a change within a few steps while
            smoothing the CPU's scheduling noise.
        min_prefill_tokens: the budget's floor in tokens (>= 0), see the module doc.

    Raises:
        ValueError: ``alpha`` outside (0, 1] or a negative floor.
    """

    def __init__(self, *, alpha: float = 0.25, min_prefill_tokens: int = 16) -> None:
        if not (0.0 < alpha <= 1.0):
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        if min_prefill_tokens < 0:
            raise ValueError(f"min_prefill_tokens must be >= 0, got {min_prefill_tokens!r}")
        self.alpha = float(alpha)
        self.min_prefill_tokens = int(min_prefill_tokens)
        self._entries: dict[StepKey, StepEntry] = {}
        # (context, decodes) → entries of that slice sorted by prefill tokens; rebuilt lazily
        self._slices: dict[tuple[int, int], list[StepEntry]] | None = None

    # ------------------------------------------------------------------------------------------ contents
    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[StepEntry]:
        return iter(sorted(self._entries.values(), key=lambda e: e.key))

    @property
    def measured_entries(self) -> int:
        """Buckets holding at least one measured step (not only a prior)."""
        return sum(1 for e in self._entries.values() if e.samples > 0)

    @staticmethod
    def key_for(prefill_tokens: float, context_tokens: float, decodes: float) -> StepKey:
        """The bucket of a step with these prefill tokens, mean decode context (tokens) and decodes."""
        return StepKey(
            snap(prefill_tokens, PREFILL_GRID), snap(context_tokens, CONTEXT_GRID), snap(decodes, DECODE_GRID)
        )

    def entry(self, key: StepKey) -> StepEntry | None:
        """The bucket's statistics, or ``None`` when nothing was recorded or seeded there."""
        return self._entries.get(key)

    # ------------------------------------------------------------------------------------------ updates
    def record(self, prefill_tokens: float, context_tokens: float, decodes: float, seconds: float) -> StepEntry:
        """Record one executed step (Alg. 2 line 1): EWMA into its bucket; returns the updated bucket.

        Args:
            prefill_tokens: prompt tokens computed in the step (all prefill chunks together), tokens.
            context_tokens: mean KV context of the step's decodes, tokens (0 without decodes).
            decodes: decode requests in the step.
            seconds: measured step time, seconds.

        Raises:
            ValueError: a negative or non-finite argument.
        """
        p = _finite_non_negative("prefill_tokens", prefill_tokens)
        c = _finite_non_negative("context_tokens", context_tokens)
        d = _finite_non_negative("decodes", decodes)
        s = _finite_non_negative("seconds", seconds)
        key = self.key_for(p, c, d)
        old = self._entries.get(key)
        if old is None or old.samples == 0:
            new = StepEntry(key, s, p, 1)
        else:
            a = self.alpha
            new = StepEntry(
                key, (1 - a) * old.seconds + a * s, (1 - a) * old.mean_prefill_tokens + a * p, old.samples + 1
            )
        self._entries[key] = new
        self._slices = None
        return new

    def seed_from_profile(
        self, profile: PerformanceProfile, tp: int, *, max_prefill_tokens: int = 16384,
        max_context_tokens: int = 32768, max_decodes: int = 512,
    ) -> int:
        """Fill empty buckets with priors from a performance profile; returns how many were added.

        The prior of a step is :meth:`fulcrum.ratio.step_cost.StepCost.step_s` with its defaults (the
        simulator's and the sim-worker's model) for one prompt of ``p`` tokens started in the step beside ``d``
        decodes at mean context ``c``: ``TTFT(p) + TPOT(d, c)`` (each term only when present) — an upper
        estimate, as both terms carry the fixed per-step cost (conservative: it leaves the SLO margin). Both
        tables must be measured at ``tp`` (``"exact"`` TP rule). Buckets already holding a measurement or a prior are kept; grid points above the ``max_*``
        limits are skipped (they would only be extrapolation). Source: DESIGN principle 4 (profiles are data);
        the profile's tables (DOPD Table I, Splitwise) stand in until the engine measures its own steps.

        Raises:
            ProfileError: the profile has no prefill or decode table for ``tp``.
        """
        cost = StepCost.from_profile(profile, tp, prefill_tp_rule="exact", decode_tp_rule="exact")
        added = 0
        for d in (g for g in DECODE_GRID if g <= max_decodes):
            for c in (g for g in CONTEXT_GRID if g <= max_context_tokens):
                if (d == 0) != (c == 0):
                    continue  # a step without decodes has no context, and decodes always have one
                for p in (g for g in PREFILL_GRID if g <= max_prefill_tokens):
                    if p == 0 and d == 0:
                        continue
                    key = StepKey(p, c, d)
                    if key in self._entries:
                        continue
                    prior = cost.step_s([(0, p)] if p > 0 else [], d, c)
                    self._entries[key] = StepEntry(key, prior, float(p), 0)
                    added += 1
        self._slices = None
        return added

    # ------------------------------------------------------------------------------------------ queries
    def _slice_map(self) -> dict[tuple[int, int], list[StepEntry]]:
        if self._slices is None:
            slices: dict[tuple[int, int], list[StepEntry]] = {}
            for e in self._entries.values():
                slices.setdefault((e.key.context_tokens, e.key.decodes), []).append(e)
            for entries in slices.values():
                entries.sort(key=lambda e: e.key.prefill_tokens)
            self._slices = slices
        return self._slices

    def _nearest_slices(self, context_tokens: float, decodes: float) -> list[list[StepEntry]]:
        """All slices, nearest first: log2 distance over (context, decodes); ties go to the slower slice
        (more decodes, then more context) — the conservative choice."""
        slices = self._slice_map()
        c = snap(context_tokens, CONTEXT_GRID)
        d = snap(decodes, DECODE_GRID)

        def lg(x: int) -> float:
            return math.log2(x) if x > 0 else -1.0

        def distance(k: tuple[int, int]) -> tuple[float, int, int]:
            return (abs(lg(k[0]) - lg(c)) + abs(lg(k[1]) - lg(d)), -k[1], -k[0])

        return [slices[k] for k in sorted(slices, key=distance)]

    @staticmethod
    def _curve(entries: Sequence[StepEntry]) -> tuple[list[float], list[float]]:
        """A slice as points (mean prefill tokens, seconds) made non-decreasing by weighted isotonic
        regression (pool adjacent violators; weight = samples, priors 1): a noisy slow bucket is averaged
        with its faster right-hand neighbours instead of lifting every larger prefill."""
        xs: list[float] = []
        for e in entries:
            x = e.mean_prefill_tokens
            xs.append(x if not xs or x > xs[-1] else xs[-1] + 1e-9)  # disjoint buckets: only guards rounding
        blocks: list[list[float]] = []  # [mean seconds, weight, points]
        for e in entries:
            blocks.append([e.seconds, float(max(e.samples, 1)), 1.0])
            while len(blocks) >= 2 and blocks[-2][0] > blocks[-1][0]:
                y2, w2, n2 = blocks.pop()
                y1, w1, n1 = blocks.pop()
                blocks.append([(y1 * w1 + y2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
        ys = [y for y, _, n in blocks for _ in range(int(n))]
        return xs, ys

    @staticmethod
    def _interpolate(xs: Sequence[float], ys: Sequence[float], p: float) -> float:
        """Piecewise-linear inside ``xs``; the first value below; the last slope above (>= 2 points)."""
        if p <= xs[0]:
            return ys[0]
        if p >= xs[-1]:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) >= 2 else 0.0
            return ys[-1] + max(slope, 0.0) * (p - xs[-1])
        j = bisect.bisect_right(xs, p)
        x0, x1, y0, y1 = xs[j - 1], xs[j], ys[j - 1], ys[j]
        return y0 + (y1 - y0) * (p - x0) / (x1 - x0)

    def predict(self, prefill_tokens: float, context_tokens: float, decodes: float) -> float | None:
        """Predicted step time in seconds for the composition; ``None`` when the table is empty.

        Non-decreasing in ``prefill_tokens`` for fixed (context, decodes) (see the module doc).
        """
        if not self._entries:
            return None
        slices = self._nearest_slices(context_tokens, decodes)
        xs, ys = self._curve(slices[0])
        p = max(float(prefill_tokens), 0.0)
        if p <= xs[-1] or len(xs) >= 2:
            return self._interpolate(xs, ys, p)
        # one point and p beyond it: the slice says nothing about what more prefill costs; add the increase
        # the nearest slice with a prefill curve (>= 2 points) measured over the same range
        for other in slices[1:]:
            if len(other) >= 2:
                oxs, oys = self._curve(other)
                return ys[-1] + max(self._interpolate(oxs, oys, p) - self._interpolate(oxs, oys, xs[-1]), 0.0)
        return ys[-1]  # no slice has a prefill curve yet: no evidence (the next mixed step provides it)

    def prefill_budget(self, num_decodes: int, mean_context: float, slo_s: float, max_tokens: int) -> int:
        """Alg. 2 line 3, ``MAXPREFILLALLOWED``: the prefill token budget M for the next step, tokens.

        The largest M in [0, ``max_tokens``] with ``predict(M, mean_context, num_decodes) <= slo_s`` (binary
        search over the monotone prediction), raised to ``min(min_prefill_tokens, max_tokens)`` (the floor).
        Returns ``max_tokens`` when ``num_decodes == 0`` or the table is empty.

        Raises:
            ValueError: a negative or non-finite argument, or ``slo_s <= 0``.
        """
        if num_decodes < 0 or max_tokens < 0:
            raise ValueError(f"num_decodes and max_tokens must be >= 0, got {num_decodes}, {max_tokens}")
        _finite_non_negative("mean_context", mean_context)
        if not (math.isfinite(slo_s) and slo_s > 0):
            raise ValueError(f"slo_s must be a finite number > 0, got {slo_s!r}")
        if num_decodes == 0 or not self._entries:
            return max_tokens
        floor = min(self.min_prefill_tokens, max_tokens)

        def fits(m: int) -> bool:
            predicted = self.predict(m, mean_context, num_decodes)
            return predicted is not None and predicted <= slo_s

        if fits(max_tokens):
            return max_tokens
        if not fits(0):
            return floor
        lo, hi = 0, max_tokens  # invariant: fits(lo) and not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        return max(lo, floor)

    # ------------------------------------------------------------------------------------------ files
    def to_dict(self) -> dict[str, Any]:
        """The table as a plain mapping (the JSON/YAML file format)::

            version: 1; alpha: float; minPrefillTokens: int
            entries: [{prefillTokens, contextTokens, decodes, seconds, meanPrefillTokens, samples}]
        """
        return {
            "version": _FORMAT_VERSION,
            "alpha": self.alpha,
            "minPrefillTokens": self.min_prefill_tokens,
            "entries": [
                {
                    "prefillTokens": e.key.prefill_tokens,
                    "contextTokens": e.key.context_tokens,
                    "decodes": e.key.decodes,
                    "seconds": e.seconds,
                    "meanPrefillTokens": e.mean_prefill_tokens,
                    "samples": e.samples,
                }
                for e in self
            ],
        }

    @classmethod
    def from_dict(cls, data: Any, *, origin: str = "step table") -> StepLatencyTable:
        """Build a table from :meth:`to_dict`'s mapping. Entries are re-snapped to the grid.

        Every number must be a JSON/YAML number, as :meth:`to_dict` writes it: a bool (``seconds: true``) or a
        string (``"0.5"``) is refused, not read as 1.0 or 0.5.

        Raises:
            ProfileError: not a mapping, an unknown version, a bool or a string where a number belongs, or a
                malformed entry.
        """
        if data is None:  # an empty YAML document (or JSON null)
            raise ProfileError(f"{origin}: holds no table (empty, only comments, or null): expected a mapping")
        if not isinstance(data, dict):
            raise ProfileError(f"{origin}: expected a mapping, got {type(data).__name__}")
        version = data.get("version", _FORMAT_VERSION)
        if isinstance(version, bool) or version != _FORMAT_VERSION:  # True == 1 in Python
            raise ProfileError(f"{origin}: unknown version {clipped(repr(version))} (expected {_FORMAT_VERSION})")
        try:
            table = cls(alpha=as_float(_file_number("alpha", data.get("alpha", 0.25))),
                        min_prefill_tokens=_count("minPrefillTokens", data.get("minPrefillTokens", 16)))
        except (TypeError, ValueError) as err:
            raise ProfileError(f"{origin}: {err}") from err
        entries = data.get("entries", [])
        if not isinstance(entries, list):
            raise ProfileError(f"{origin}: entries must be a list")
        table.load_entries(entries, origin=origin)
        return table

    def load_entries(self, entries: Iterable[Any], *, origin: str = "step table") -> None:
        """Add entries in :meth:`to_dict`'s entry format (replacing buckets with the same key).

        Raises:
            ProfileError: a malformed entry, including a ``meanPrefillTokens`` that snaps to another prefill bucket
                than ``prefillTokens`` (a bucket's mean lies in the bucket; one outside it would reorder the
                interpolation points and predict absurd step times).
        """
        for i, raw in enumerate(entries):
            where = f"{origin}: entries[{i}]"
            if not isinstance(raw, dict):
                raise ProfileError(f"{where}: expected a mapping")
            try:
                p = _file_non_negative("prefillTokens", raw["prefillTokens"])
                key = self.key_for(p, _file_non_negative("contextTokens", raw["contextTokens"]),
                                   _file_non_negative("decodes", raw["decodes"]))
                seconds = _file_non_negative("seconds", raw["seconds"])
                mean_p = _file_non_negative("meanPrefillTokens", raw.get("meanPrefillTokens", p))
                if snap(mean_p, PREFILL_GRID) != key.prefill_tokens:  # the curve's x must follow the buckets' order
                    raise ValueError(f"meanPrefillTokens {mean_p:g} lies outside its bucket (prefillTokens {p:g} → "
                                     f"bucket {key.prefill_tokens}): it is the mean prefill tokens of the bucket's "
                                     "steps, so it snaps to the same bucket; correct it or leave it out")
                samples = _count("samples", raw.get("samples", 1))
            except KeyError as err:
                raise ProfileError(f"{where}: missing field {err.args[0]!r}") from None
            except (TypeError, ValueError) as err:
                raise ProfileError(f"{where}: {err}") from None
            self._entries[key] = StepEntry(key, seconds, mean_p, samples)
        self._slices = None

    def save(self, path: str | Path) -> None:
        """Write the table to ``path``: YAML for ``.yaml``/``.yml``, else JSON. Writes a sibling temporary
        file first and renames it, so a reader never sees half a table. Raises ``OSError`` from the OS."""
        path = Path(path)
        data = self.to_dict()
        text = yaml.safe_dump(data, sort_keys=False) if path.suffix in (".yaml", ".yml") else json.dumps(data, indent=1)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> StepLatencyTable:
        """Read a table written by :meth:`save` (JSON or YAML, by suffix).

        Raises:
            ProfileError: the file is missing, unreadable or malformed.
        """
        path = Path(path)
        kind = "YAML" if path.suffix in (".yaml", ".yml") else "JSON"
        try:
            text = path.read_text()
            empty = not text.strip()  # said as such, not as JSON's "Expecting value" or YAML's null
            data = None if empty else safe_yaml(text) if kind == "YAML" else json.loads(text)
        except OSError as err:
            raise ProfileError(f"step table {path}: cannot read: {err.strerror or err}") from err
        except RecursionError as err:
            raise ProfileError(f"step table {path}: not valid {kind}: nested too deeply") from err
        except yaml.YAMLError as err:  # one line: file:line:column and the problem, not YAML's caret diagram
            where, what = yaml_problem(err)
            raise ProfileError(f"step table {path}{where}: not valid YAML: {what}") from err
        except ValueError as err:  # not JSON (its message has the line and column), or not UTF-8
            raise ProfileError(f"step table {path}: not valid {kind}: {' '.join(str(err).split())}") from err
        if empty:
            raise ProfileError(f"step table {path}: the file is empty")
        return cls.from_dict(data, origin=f"step table {path}")
