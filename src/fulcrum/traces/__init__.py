"""Request traces: reading trace files into ``Request`` tuples and deriving per-interval load series.

This package is an adapter at the edge: it does file I/O (CSV, JSON lines, gzip) so that the planning
packages never do. Readers return immutable values (:class:`Trace`, :class:`RateSeries`) and raise
:class:`fulcrum.errors.TraceError` on bad input. Nothing here plans, simulates or talks to a cluster.
Bundled traces (``azure-conv-2023``, ``azure-code-2023``, ``mooncake-conv``) are read by name; their
files live in :mod:`fulcrum.data`.
"""

from fulcrum.traces.reader import (
    TRACE_FORMATS,
    RateSeries,
    Trace,
    detect_format,
    load_rate_series,
    load_trace,
)
from fulcrum.traces.series import interval_series

__all__ = [
    "TRACE_FORMATS",
    "RateSeries",
    "Trace",
    "detect_format",
    "interval_series",
    "load_rate_series",
    "load_trace",
]
