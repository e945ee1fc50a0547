"""CsvRecords: the line each CSV record starts on, and an unterminated quote named at the line it opens on."""

from __future__ import annotations

import io

import pytest

from fulcrum.csv_records import CsvRecords
from fulcrum.errors import ProfileError, TraceError


def _records(text: str, error: type[Exception] = TraceError) -> CsvRecords:
    return CsvRecords(io.StringIO(text, newline=""), "f.csv", error)


def test_each_record_knows_the_lines_it_starts_and_ends_on():
    records = _records('a,b\n1,"two\nlines"\n\n3,"x\r\ny\r\nz"\n4,4')
    got = [(record, records.line, records.end_line) for record in records]
    assert got == [
        (["a", "b"], 1, 1),
        (["1", "two\nlines"], 2, 3),
        ([], 4, 4),  # a blank line is an empty record, as csv.reader gives it
        (["3", "x\r\ny\r\nz"], 5, 7),
        (["4", "4"], 8, 8),  # the last line needs no newline
    ]


@pytest.mark.parametrize("text", ['a,b\n1,2\n3,"open\n4,5\n6,7\n', 'a,b\n1,2\n3,"open'], ids=["runs-on", "last-line"])
def test_a_quote_open_at_the_end_of_the_file_is_named_at_the_line_it_opens_on(text):
    records = _records(text)
    assert next(records) == ["a", "b"] and next(records) == ["1", "2"]
    with pytest.raises(TraceError, match=r"^f\.csv:3: malformed CSV: unterminated quote: the quoted field opened on "
                                         r"this line runs to the end of the file$"):
        next(records)


def test_a_csv_error_past_the_opening_line_names_both_lines():
    text = 'a,b\n1,"open\n' + "2,2\n" * 70_000  # the open field grows past csv's 128 KiB field limit
    with pytest.raises(TraceError, match=r"^f\.csv:2: malformed CSV: unterminated quote: the quoted field opened on "
                                         r"this line runs on to line \d+ \(field larger than field limit"):
        list(_records(text))


def test_a_csv_error_on_the_records_own_line_names_that_line():
    with pytest.raises(TraceError, match=r"^f\.csv:3: malformed CSV: field larger than field limit"):
        list(_records("a,b\n\n1," + "9" * 200_000 + "\n"))


def test_the_error_class_given_is_the_one_raised():
    with pytest.raises(ProfileError, match=r"f\.csv:1: malformed CSV: unterminated quote") as caught:
        list(_records('"a,b\n', ProfileError))
    assert not isinstance(caught.value, TraceError)
    records = _records('a\n"b\nc"\n', ProfileError)
    assert list(records) == [["a"], ["b\nc"]]
    err = records.unterminated(f"on to line {records.end_line}")
    assert type(err) is ProfileError
    assert str(err) == ("f.csv:2: malformed CSV: unterminated quote: the quoted field opened on this line runs on to "
                        "line 3")


def test_other_errors_of_the_lines_pass_through():
    def lines():
        yield "a,b\n"
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    records = CsvRecords(lines(), "f.csv", TraceError)
    assert next(records) == ["a", "b"]
    with pytest.raises(UnicodeDecodeError):
        next(records)
