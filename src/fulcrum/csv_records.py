"""CSV records that know the line they start on, for errors that name the line a user must fix.

``csv.reader`` reports the line it has read up to (``line_num``), which for a record holding a quoted newline is
the record's last line, and it takes a quote left open as running to the end of the file without a word.
:class:`CsvRecords` reports the line each record starts on and refuses a quote left open, naming the line it opens
on (not the last line of the file it swallowed). The trace reader (:mod:`fulcrum.traces.reader`) and the CSV
profile loader (:mod:`fulcrum.ratio.profile`) read their CSV files through it, so both word these errors alike.
"""

from __future__ import annotations

import csv
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

__all__ = ["CsvRecords"]


class CsvRecords:
    """The records of a CSV file's lines, as ``csv.reader`` parses them (default dialect).

    Iterating yields each record as a list of strings, blank lines included (as ``[]``, which ``csv.reader`` gives
    for an empty line). After each record, :attr:`line` is the 1-based line it starts on and :attr:`end_line` the
    line it ends on (later than :attr:`line` when a quoted field holds a newline).

    Args:
        lines: the file's lines, newlines kept (a file opened with ``newline=""``); an exception the iterator raises
            (e.g. a decoding error) passes through unchanged.
        file: the file, named in error messages.
        error: the exception class to raise, called with the message (e.g. ``TraceError``, ``ProfileError``).

    Raises:
        error: ``"{file}:{line}: malformed CSV: {reason}"`` when ``csv.reader`` fails (e.g. a field over its 128 KiB
            limit), or ``"{file}:{start}: malformed CSV: unterminated quote: the quoted field opened on this line
            runs on to line {line} ({reason})"`` when it fails past the line the record starts on (a quote opened on
            ``start`` runs on); ``"{file}:{start}: malformed CSV: unterminated quote: the quoted field opened on this
            line runs to the end of the file"`` for a record still open at the end of the file (a record is complete
            at the end of a line; one that needed the end of the file is open).
    """

    def __init__(self, lines: Iterable[str], file: str | Path, error: Callable[[str], Exception]) -> None:
        self._at_end = False
        self._reader = csv.reader(self._watch(lines))
        self._file = file
        self._error = error
        self.line = 0
        """The line the record last returned (or refused, in an error) starts on; 1-based, 0 before the first."""

    def _watch(self, lines: Iterable[str]) -> Iterator[str]:
        yield from lines
        self._at_end = True  # csv.reader asked for a line past the last one

    @property
    def end_line(self) -> int:
        """The line the record last returned ends on (``csv.reader``'s ``line_num``)."""
        return self._reader.line_num

    def unterminated(self, runs: str) -> Exception:
        """The error for a quoted field opened on :attr:`line` that ``runs`` on (``"on to line 7"``): for a caller
        that finds a newline in a field a stray quote closed further on."""
        return self._error(
            f"{self._file}:{self.line}: malformed CSV: unterminated quote: the quoted field opened on this line runs "
            f"{runs}"
        )

    def __iter__(self) -> CsvRecords:
        return self

    def __next__(self) -> list[str]:
        start = self._reader.line_num + 1
        try:
            record = next(self._reader)
        except csv.Error as err:  # e.g. a field over the csv module's 128 KiB limit
            self.line = start
            if self._reader.line_num > start:  # raised past the record's first line: a quote opened there runs on
                raise self.unterminated(f"on to line {self._reader.line_num} ({err})") from err
            raise self._error(f"{self._file}:{self._reader.line_num}: malformed CSV: {err}") from err
        self.line = start
        if self._at_end:  # a record is complete at the end of a line; one that needed the end of the file is open
            raise self.unterminated("to the end of the file")
        return record
