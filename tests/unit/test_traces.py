"""Trace readers (Azure CSV, Mooncake JSONL, ServeGen rate series), bundled traces and interval series."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path
from typing import Any

import pytest

from fulcrum.data import BUNDLED_TRACES, bundled_trace_path
from fulcrum.errors import TraceError, as_float
from fulcrum.traces import detect_format, interval_series, load_rate_series, load_trace
from fulcrum.workload import Request

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _shared_data() -> Path | None:
    """The project's shared data folder (beside the repository, or /work/shared), if present."""
    for root in (Path(__file__).resolve().parents[3] / "shared", Path("/work/shared")):
        if (root / "data" / "README.md").is_file():
            return root / "data"
    return None


def _write(tmp_path: Path, name: str, text: str, *, gz: bool = False) -> Path:
    path = tmp_path / name
    data = text.encode("utf-8")
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


# --- bundled traces ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "fmt", "count", "span_s"),
    [
        # Counts and spans as documented in shared/data/README.md (conv 18:15:46.68 -> 19:14:08.40,
        # code 18:17:03.98 -> 19:14:19.93, Mooncake 0 -> 3537.0 s).
        ("azure-conv-2023", "azure", 19366, 3501.72),
        ("azure-code-2023", "azure", 8819, 3435.95),
        ("mooncake-conv", "mooncake", 12031, 3537.0),
    ],
)
def test_each_bundled_trace_loads_by_name_with_its_documented_size_and_span(
    name: str, fmt: str, count: int, span_s: float
) -> None:
    trace = load_trace(name)
    assert trace.name == name
    assert trace.fmt == fmt
    assert len(trace.requests) == count
    assert trace.span_s == pytest.approx(span_s, abs=0.01)
    assert trace.requests[0].arrival_s == 0.0
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals == sorted(arrivals)
    assert all(r.isl >= 1 and r.osl >= 1 for r in trace.requests)
    assert trace.clamped == 0
    assert "bundled trace" in trace.source


def test_bundled_azure_conversation_trace_has_the_published_length_means() -> None:
    trace = load_trace("azure-conv-2023")
    mean_isl = sum(r.isl for r in trace.requests) / len(trace.requests)
    mean_osl = sum(r.osl for r in trace.requests) / len(trace.requests)
    # shared/data/README.md: input mean 1154.7, output mean 211.1
    assert mean_isl == pytest.approx(1154.7, abs=0.05)
    assert mean_osl == pytest.approx(211.1, abs=0.05)


def test_mooncake_trace_keeps_prefix_block_ids_that_requests_share() -> None:
    trace = load_trace("mooncake-conv")
    first, second = trace.requests[0], trace.requests[1]
    assert first.prefix_ids[:3] == (0, 1, 2)
    assert second.prefix_ids[0] == 0  # both start with block 0: a shared prefix
    # 512-token blocks: a prompt of isl tokens spans ceil(isl / 512) blocks
    assert len(first.prefix_ids) == math.ceil(first.isl / 512)


def test_bundled_files_are_byte_identical_to_the_shared_source_data() -> None:
    data = _shared_data()
    if data is None:
        pytest.skip("shared/data is not beside the repository")
    sources = {
        "azure-conv-2023": data / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv",
        "azure-code-2023": data / "azure_llm_2023" / "AzureLLMInferenceTrace_code.csv",
        "mooncake-conv": data / "mooncake_fast25" / "conversation_trace.jsonl.gz",
    }
    assert set(sources) == set(BUNDLED_TRACES)
    for name, source in sources.items():
        bundled = gzip.decompress(bundled_trace_path(name).read_bytes())
        original = source.read_bytes()
        if source.suffix == ".gz":
            original = gzip.decompress(original)
        assert bundled == original, name


def test_unknown_bundled_name_lists_the_bundled_traces() -> None:
    with pytest.raises(TraceError, match="azure-code-2023, azure-conv-2023, mooncake-conv"):
        bundled_trace_path("burstgpt")
    with pytest.raises(TraceError, match="no such trace file.*bundled traces: azure-code-2023"):
        load_trace("no/such/file.csv")


def test_a_folder_is_named_as_a_folder_not_as_a_missing_file(tmp_path: Path) -> None:
    (tmp_path / "somedir").mkdir()
    with pytest.raises(TraceError, match=r"somedir is a directory, not a trace file$"):
        load_trace(tmp_path / "somedir")


def test_an_empty_window_of_a_bundled_trace_names_the_trace_not_its_file() -> None:
    with pytest.raises(TraceError) as err:
        load_trace("azure-conv-2023", start_s=100_000)
    assert str(err.value).startswith("azure-conv-2023: no request in the window [100000, inf) s")


# --- Azure CSV -----------------------------------------------------------------------------------


def test_azure_timestamps_with_seven_fractional_digits_become_exact_relative_seconds(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "t.csv",
        AZURE_HEADER
        + "2023-11-16 18:15:46.6805900,374,44\n"
        + "2023-11-16 18:15:50.9951690,396,109\n"
        + "2023-11-16 18:16:46.6805901,10,2\n",
    )
    trace = load_trace(path)
    assert trace.fmt == "azure"
    assert [r.arrival_s for r in trace.requests] == pytest.approx([0.0, 4.314579, 60.0], abs=1e-6)
    assert trace.requests[1] == Request(arrival_s=trace.requests[1].arrival_s, isl=396, osl=109)


def test_azure_reader_accepts_iso_t_separator_offsets_and_extra_columns(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "t.csv",
        "ContextTokens,TIMESTAMP,GeneratedTokens,Extra\n"
        "100,2023-11-16T18:00:00Z,5,x\n"
        "200,2023-11-16T19:00:01.5+01:00,6,y\n",  # = 18:00:01.5 UTC
    )
    trace = load_trace(path)
    assert [r.arrival_s for r in trace.requests] == pytest.approx([0.0, 1.5])
    assert [(r.isl, r.osl) for r in trace.requests] == [(100, 5), (200, 6)]


def test_unsorted_rows_are_sorted_by_arrival_and_rebased_to_zero(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "t.csv",
        AZURE_HEADER + "2023-11-16 18:00:10,3,3\n2023-11-16 18:00:05,1,1\n2023-11-16 18:00:07,2,2\n",
    )
    trace = load_trace(path)
    assert [(r.arrival_s, r.isl) for r in trace.requests] == [(0.0, 1), (2.0, 2), (5.0, 3)]


def test_zero_token_rows_are_kept_clamped_to_one_token_and_counted(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "t.csv",
        AZURE_HEADER + "2023-11-16 18:00:00,0,5\n2023-11-16 18:00:01,7,0\n2023-11-16 18:00:02,8,9\n",
    )
    trace = load_trace(path)
    assert [(r.isl, r.osl) for r in trace.requests] == [(1, 5), (7, 1), (8, 9)]
    assert trace.clamped == 2
    assert "2 requests with 0 input or output tokens clamped to 1" in trace.source


def test_gzip_is_detected_by_magic_bytes_not_by_file_name(tmp_path: Path) -> None:
    text = AZURE_HEADER + "2023-11-16 18:00:00,10,5\n2023-11-16 18:00:02,20,6\n"
    compressed_without_suffix = _write(tmp_path, "trace.csv", text, gz=True)
    plain_with_gz_suffix = _write(tmp_path, "plain.csv.gz", text)
    a, b = load_trace(compressed_without_suffix), load_trace(plain_with_gz_suffix)
    assert a.requests == b.requests
    assert len(a.requests) == 2
    assert b.name == "plain"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", r"empty file"),
        ("\n\n", r"empty file"),
        (AZURE_HEADER, r"no requests \(empty file or header only\)"),
        ("TIMESTAMP,ContextTokens\n2023-11-16 18:00:00,1\n", r"unknown trace format"),
        (AZURE_HEADER + "2023-11-16 18:00:00,1,1\n2023-11-16 18:00:01,abc,1\n", r":3: ContextTokens is not a number"),
        (AZURE_HEADER + "2023-11-16 18:00:00,1,-4\n", r":2: GeneratedTokens must be >= 0 tokens, got -4"),
        (AZURE_HEADER + "2023-11-16 18:00:00,1.5,4\n", r":2: ContextTokens must be a whole number"),
        (AZURE_HEADER + "yesterday,1,4\n", r":2: unparsable TIMESTAMP 'yesterday'"),
        (AZURE_HEADER + "2023-02-30 18:00:00,1,4\n", r":2: invalid TIMESTAMP"),
        (AZURE_HEADER + "2023-11-16 18:00:00,1\n", r":2: missing value for GeneratedTokens"),
    ],
)
def test_malformed_azure_files_raise_trace_error_naming_file_and_line(
    tmp_path: Path, text: str, message: str
) -> None:
    path = _write(tmp_path, "bad.csv", text)
    with pytest.raises(TraceError, match=message) as info:
        load_trace(path)
    assert "bad.csv" in str(info.value)


def test_explicit_azure_format_on_a_file_without_the_columns_names_the_missing_ones(tmp_path: Path) -> None:
    path = _write(tmp_path, "bad.csv", "TIMESTAMP,Prompt,GeneratedTokens\n2023-11-16 18:00:00,1,1\n")
    with pytest.raises(TraceError, match=r"bad.csv:1: missing column\(s\) ContextTokens"):
        load_trace(path, fmt="azure")


def test_unknown_format_names_are_rejected_with_the_known_ones(tmp_path: Path) -> None:
    path = _write(tmp_path, "t.csv", AZURE_HEADER + "2023-11-16 18:00:00,1,1\n")
    with pytest.raises(TraceError, match="unknown trace format 'burstgpt'; known formats: azure, mooncake"):
        load_trace(path, fmt="burstgpt")


def test_corrupt_gzip_raises_trace_error(tmp_path: Path) -> None:
    data = gzip.compress((AZURE_HEADER + "2023-11-16 18:00:00,1,1\n" * 200).encode())
    path = tmp_path / "cut.csv.gz"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match="corrupt or truncated gzip"):
        load_trace(path)


# --- Mooncake JSONL ------------------------------------------------------------------------------


def _jsonl(*objs: object) -> str:
    return "".join(json.dumps(o) + "\n" for o in objs)


def test_mooncake_lines_become_requests_with_millisecond_timestamps(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "mc",  # no extension: detected from the content
        _jsonl(
            {"timestamp": 1000, "input_length": 600, "output_length": 20, "hash_ids": [4, 5]},
            {"timestamp": 4500, "input_length": 30, "output_length": 7, "hash_ids": [4]},
        ),
        gz=True,
    )
    assert detect_format(path) == "mooncake"
    trace = load_trace(path)
    assert trace.requests == (
        Request(arrival_s=0.0, isl=600, osl=20, prefix_ids=(4, 5)),
        Request(arrival_s=3.5, isl=30, osl=7, prefix_ids=(4,)),
    )


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (_jsonl({"timestamp": 0, "input_length": 1, "output_length": 1}) + '{"timestamp": 5, "input_len\n', r":2: broken JSON line"),
        (_jsonl({"timestamp": 0, "input_length": 1, "output_length": 1}, {"timestamp": 1, "input_length": 2}), r":2: missing key\(s\) output_length"),
        (_jsonl({"timestamp": 0, "input_length": -3, "output_length": 1}), r":1: input_length must be >= 0 tokens"),
        (_jsonl({"timestamp": 0, "input_length": "12", "output_length": 1}), r":1: input_length must be a whole number"),
        (_jsonl({"timestamp": "soon", "input_length": 1, "output_length": 1}), r":1: timestamp must be a number"),
        (_jsonl({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": ["a"]}), r":1: hash_ids must be a list of integers"),
        (_jsonl({"timestamp": 0, "input_length": 1, "output_length": 1}, [1, 2]), r":2: expected a JSON object"),
    ],
)
def test_malformed_mooncake_lines_raise_trace_error_naming_file_and_line(
    tmp_path: Path, lines: str, message: str
) -> None:
    path = _write(tmp_path, "bad.jsonl", lines)
    with pytest.raises(TraceError, match=message) as info:
        load_trace(path, fmt="mooncake")
    assert "bad.jsonl" in str(info.value)


def test_a_file_in_neither_format_is_rejected_with_the_known_formats(tmp_path: Path) -> None:
    path = _write(tmp_path, "x.txt", '{"arrival": 1, "prompt": 3}\n')
    with pytest.raises(TraceError, match=r"unknown trace format.*known formats: azure.*mooncake"):
        load_trace(path)


# --- windowing -----------------------------------------------------------------------------------


def test_window_and_limit_select_requests_relative_to_the_trace_start_and_rebase_them(tmp_path: Path) -> None:
    rows = "".join(f"2023-11-16 18:00:{s:02d},{s + 1},1\n" for s in range(0, 60, 5))  # t = 0, 5, ..., 55
    path = _write(tmp_path, "t.csv", AZURE_HEADER + rows)
    window = load_trace(path, start_s=12, duration_s=20)  # arrivals 15, 20, 25, 30
    assert [(r.arrival_s, r.isl) for r in window.requests] == [(0.0, 16), (5.0, 21), (10.0, 26), (15.0, 31)]
    assert "window [12, 32) s" in window.source
    limited = load_trace(path, start_s=12, limit=2)
    assert [r.isl for r in limited.requests] == [16, 21]
    assert "2 of 12 requests" in limited.source


def test_a_window_without_requests_is_an_error(tmp_path: Path) -> None:
    path = _write(tmp_path, "t.csv", AZURE_HEADER + "2023-11-16 18:00:00,1,1\n2023-11-16 18:00:10,1,1\n")
    with pytest.raises(TraceError, match=r"no request in the window \[100, 110\) s"):
        load_trace(path, start_s=100, duration_s=10)
    with pytest.raises(TraceError, match="no request in the window"):
        load_trace(path, start_s=1, duration_s=5)


@pytest.mark.parametrize(
    "kwargs", [{"start_s": -1.0}, {"duration_s": 0.0}, {"limit": 0}, {"start_s": math.nan}]
)
def test_invalid_window_arguments_are_rejected(kwargs: dict[str, Any]) -> None:
    with pytest.raises(TraceError):
        load_trace("azure-code-2023", **kwargs)


# --- malformed contents: one TraceError naming file and line, never a traceback, hang or silent guess ----------

DEEP_JSON = "[" * 100_000 + "]" * 100_000  # nested past Python's recursion limit
HUGE = "9" * 400  # an integer no float holds (1e400 is inf)
ROW = "2023-11-16 18:00:00"  # an Azure TIMESTAMP
ONE = {"timestamp": 0, "input_length": 1, "output_length": 1}  # a Mooncake line


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        pytest.param("big.csv", AZURE_HEADER + f"{ROW},{HUGE},1\n",
                     r"big.csv:2: ContextTokens must be at most 2147483647 tokens", id="csv-tokens-beyond-float"),
        pytest.param("big.csv", AZURE_HEADER + f"{ROW},1,1e30\n",
                     r"big.csv:2: GeneratedTokens must be at most 2147483647 tokens", id="csv-tokens-1e30"),
        pytest.param("big.csv", AZURE_HEADER + f"{ROW},1,inf\n",
                     r"big.csv:2: GeneratedTokens must be at most 2147483647 tokens, got inf", id="csv-tokens-inf"),
        pytest.param("big.jsonl", _jsonl({**ONE, "input_length": int(HUGE)}),
                     r"big.jsonl:1: input_length must be at most 2147483647 tokens", id="jsonl-tokens-beyond-float"),
        pytest.param("big.jsonl", _jsonl({**ONE, "timestamp": int(HUGE)}),
                     r"big.jsonl:1: timestamp must be finite, got 9{40}…$", id="jsonl-timestamp-beyond-float"),
        pytest.param("big.jsonl", json.dumps(ONE).replace('"input_length": 1', '"input_length": ' + "9" * 5000) + "\n",
                     r"big.jsonl:1: broken JSON line: .*digits", id="jsonl-5000-digit-int"),
        pytest.param("deep.jsonl", _jsonl(ONE) + DEEP_JSON + "\n",
                     r"deep.jsonl:2: broken JSON line: nested too deeply", id="jsonl-nested-past-recursion-limit"),
        pytest.param("deep.jsonl", json.dumps(ONE)[:-1] + ', "x": ' + DEEP_JSON + "}\n",
                     r"deep.jsonl:1: broken JSON line: nested too deeply", id="first-line-nested-past-recursion-limit"),
        pytest.param("wide.txt", DEEP_JSON + "\n",
                     r"wide.txt: unknown trace format", id="first-line-over-csv-field-limit"),
        pytest.param("wide.csv", AZURE_HEADER + f"{ROW},1,1\n{ROW},1," + "1" * 200_000 + "\n",
                     r"wide.csv:3: malformed CSV: field larger than field limit", id="csv-field-over-csv-limit"),
        pytest.param("tz.csv", AZURE_HEADER + f"{ROW}+99:99,1,1\n",
                     r"tz.csv:2: invalid TIMESTAMP .*UTC offset", id="csv-utc-offset-out-of-range"),
        pytest.param("twice.csv", "TIMESTAMP,ContextTokens,GeneratedTokens,ContextTokens\n" + f"{ROW},1,1,5\n",
                     r"twice.csv:1: column ContextTokens appears 2 times", id="csv-required-column-twice"),
    ],
)
def test_malformed_contents_raise_one_trace_error_naming_file_and_line(
    tmp_path: Path, name: str, text: str, message: str
) -> None:
    with pytest.raises(TraceError, match=message):
        load_trace(_write(tmp_path, name, text))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param(_jsonl({**ONE, "input_length": -int(HUGE)}), r"big.jsonl:1: input_length must be >= 0 tokens, "
                     r"got -9{39}…$", id="tokens-below-float"),
        pytest.param(_jsonl(ONE, {**ONE, "output_length": -int(HUGE)}), r"big.jsonl:2: output_length must be >= 0 "
                     r"tokens", id="output-below-float"),
        pytest.param(_jsonl({**ONE, "timestamp": -int(HUGE)}), r"big.jsonl:1: timestamp must be a number of ms >= 0, "
                     r"got -9{39}…$", id="timestamp-below-float"),
    ],
)
def test_a_jsonl_integer_below_float_range_is_refused_as_negative_not_as_too_large(
    tmp_path: Path, text: str, message: str
) -> None:
    # -10**400 is -inf, below every lower bound; it was read as +inf ("at most 2147483647 tokens", "finite")
    with pytest.raises(TraceError, match=message):
        load_trace(_write(tmp_path, "big.jsonl", text))


def test_as_float_keeps_the_sign_of_a_number_beyond_float_range() -> None:
    assert as_float(10**400) == math.inf
    assert as_float(-(10**400)) == -math.inf
    assert as_float("-1e400") == -math.inf  # a numeric string beyond range, as the CSV readers pass it
    assert as_float(" 12 ") == 12.0 and as_float(3) == 3.0 and as_float(-2.5) == -2.5
    for bad in ("x", None, [1]):
        with pytest.raises((TypeError, ValueError)):
            as_float(bad)


UNTERMINATED = [  # (the file after the header, the line the open quote is on)
    pytest.param(f"{ROW},1,1\n{ROW},\"374,44\n{ROW},1,1\n{ROW},1,1\n", 3, id="quote-runs-to-the-end"),
    pytest.param(f"{ROW},1,1\n{ROW},1,\"44", 3, id="quote-on-the-last-line-without-newline"),
    pytest.param(f"{ROW},\"1\n" + f"{ROW},1,1\n" * 9_000, 2, id="quote-swallows-past-the-field-limit"),
]


@pytest.mark.parametrize(("rows", "line"), UNTERMINATED)
def test_an_unterminated_quote_in_an_azure_csv_names_the_line_it_opens_on(
    tmp_path: Path, rows: str, line: int
) -> None:
    # the csv module reads an open quote on to the end of the file (or its field limit): the error named that line
    with pytest.raises(TraceError, match=rf"^[^\n]*q\.csv:{line}: malformed CSV: unterminated quote[^\n]*$"):
        load_trace(_write(tmp_path, "q.csv", AZURE_HEADER + rows))


def test_a_quote_closed_by_a_stray_quote_lines_later_names_the_line_it_opens_on(tmp_path: Path) -> None:
    rows = f"{ROW},1,1\n{ROW},\"374,44\n{ROW},1,1\n{ROW},\"1\",1\n{ROW},1,1\n"
    with pytest.raises(TraceError, match=r"q\.csv:3: malformed CSV: unterminated quote: the quoted ContextTokens value "
                       r"opened on this line runs on over 3 lines$"):
        load_trace(_write(tmp_path, "q.csv", AZURE_HEADER + rows))


def test_a_multi_line_quoted_value_in_an_ignored_column_is_still_read(tmp_path: Path) -> None:
    text = "TIMESTAMP,ContextTokens,GeneratedTokens,note\n" + f"{ROW},5,6,\"two\nlines\"\n2023-11-16 18:00:01,7,8,\n"
    trace = load_trace(_write(tmp_path, "notes.csv", text))
    assert [(r.isl, r.osl) for r in trace.requests] == [(5, 6), (7, 8)]


def test_an_unterminated_quote_in_a_rate_series_names_the_line_it_opens_on(tmp_path: Path) -> None:
    text = "window_start_s,total_rate_rps\n0,1\n600,\"2\n1200,3\n1800,4\n"
    with pytest.raises(TraceError, match=r"rates\.csv:3: malformed CSV: unterminated quote"):
        load_rate_series(_write(tmp_path, "rates.csv", text))


def test_a_timestamp_fraction_of_thousands_of_digits_is_read_not_refused_by_the_int_digit_limit(
    tmp_path: Path,
) -> None:
    path = _write(tmp_path, "frac.csv", AZURE_HEADER + f"{ROW}." + "5" * 5000 + ",1,1\n2023-11-16 18:00:02,1,1\n")
    assert [r.arrival_s for r in load_trace(path).requests] == pytest.approx([0.0, 1.444444])


def test_a_trace_spanning_more_than_a_year_is_refused_as_a_timestamp_unit_error(tmp_path: Path) -> None:
    # ns where ms belong: one hour becomes 114 years, a replay that never ends and a forecast of 10^10 intervals
    ns = _jsonl({"timestamp": 0, "input_length": 1, "output_length": 1},
                {"timestamp": 3_600 * 10**9, "input_length": 1, "output_length": 1})
    with pytest.raises(TraceError, match=r"ns.jsonl: arrivals span 3\.6e\+09 s \(114 years\) from line 1 to line 2, "
                       r"more than a year"):
        load_trace(_write(tmp_path, "ns.jsonl", ns))
    years = AZURE_HEADER + "2023-11-16 18:00:00,1,1\n1999-01-01 00:00:00,1,1\n"
    with pytest.raises(TraceError, match=r"years.csv: arrivals span .* from line 3 to line 2"):
        load_trace(_write(tmp_path, "years.csv", years))
    week = _jsonl({"timestamp": 0, "input_length": 1, "output_length": 1},
                  {"timestamp": 7 * 86_400_000, "input_length": 1, "output_length": 1})
    assert load_trace(_write(tmp_path, "week.jsonl", week)).span_s == 7 * 86_400.0


# --- ServeGen rate series ------------------------------------------------------------------------


def test_servegen_aggregate_rates_load_with_zero_windows_as_gaps(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "servegen_x_aggregate_10min.csv",
        "window_start_s,total_rate_rps,active_clients\n0,10.5,3\n600,0,0\n1200,12,4\n",
    )
    series = load_rate_series(path)
    assert series.name == "servegen_x_aggregate_10min"
    assert series.interval_s == 600.0
    assert series.values[0] == 10.5 and series.values[2] == 12.0
    assert math.isnan(series.values[1])
    assert series.gaps == 1


def test_the_real_servegen_m_mid_series_has_two_weeks_of_ten_minute_windows_and_84_gaps() -> None:
    data = _shared_data()
    if data is None:
        pytest.skip("shared/data is not beside the repository")
    series = load_rate_series(data / "servegen" / "servegen_m-mid_aggregate_10min.csv")
    assert series.interval_s == 600.0
    assert len(series.values) == 2016  # 14 days x 144
    assert series.gaps == 84  # as documented in shared/data/README.md


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("window_start_s,total_rate_rps\n0,1\n600,-2\n", r":3: total_rate_rps must be >= 0"),
        ("window_start_s,total_rate_rps\n0,1\n600,x\n", r":3: total_rate_rps is not a number"),
        ("window_start_s,total_rate_rps\n0,1\n600,2\n1300,2\n", r"not evenly spaced"),
        ("window_start_s,total_rate_rps\n0,1\n", r"at least 2 windows"),
        ("window_start_s,rate\n0,1\n", r"missing column\(s\) total_rate_rps"),
        ("", r"empty file"),
        pytest.param("window_start_s,total_rate_rps\n0,0\n600,0\n1200,0\n",
                     r"rates.csv: every window's total_rate_rps is 0", id="every-window-a-gap"),
        pytest.param("window_start_s,total_rate_rps\n0,1\n600," + "1" * 200_000 + "\n", r"rates.csv:3: malformed CSV",
                     id="field-over-csv-limit"),
    ],
)
def test_malformed_rate_series_raise_trace_error(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        load_rate_series(_write(tmp_path, "rates.csv", text))


# --- interval series -----------------------------------------------------------------------------


def test_interval_series_counts_rates_and_mean_lengths_per_interval() -> None:
    requests = [
        Request(0.0, 100, 10),
        Request(4.0, 300, 30),
        Request(25.0, 50, 5),  # interval 2; interval 1 is empty
    ]
    series = interval_series(requests, 10.0)
    assert series["rate"] == [0.2, 0.0, 0.1]
    assert series["isl"][0] == 200.0 and series["osl"][0] == 20.0
    assert math.isnan(series["isl"][1]) and math.isnan(series["osl"][1])
    assert series["isl"][2] == 50.0 and series["osl"][2] == 5.0


def test_interval_series_with_a_fixed_count_pads_and_truncates() -> None:
    requests = [Request(1.0, 10, 1), Request(35.0, 20, 2)]
    padded = interval_series(requests, 10.0, n_intervals=5)
    assert padded["rate"] == [0.1, 0.0, 0.0, 0.1, 0.0]
    truncated = interval_series(requests, 10.0, n_intervals=2)
    assert truncated["rate"] == [0.1, 0.0]
    assert interval_series([], 10.0) == {"rate": [], "isl": [], "osl": []}


def test_interval_series_of_a_bundled_trace_accounts_for_every_request() -> None:
    trace = load_trace("azure-code-2023")
    series = interval_series(trace.requests, 60.0)
    assert len(series["rate"]) == math.floor(trace.span_s / 60.0) + 1
    assert sum(rate * 60.0 for rate in series["rate"]) == pytest.approx(len(trace.requests))
    # the code trace is bursty: some minutes see no request at all (rate 0, lengths undefined)
    empty = [k for k, rate in enumerate(series["rate"]) if rate == 0.0]
    assert empty and all(math.isnan(series["isl"][k]) for k in empty)


@pytest.mark.parametrize("interval", [0.0, -5.0, math.inf])
def test_interval_series_rejects_a_non_positive_interval(interval: float) -> None:
    with pytest.raises(ValueError, match="interval_s"):
        interval_series([Request(0.0, 1, 1)], interval)


def assert_bursty_then_steady(requests: tuple[Request, ...]) -> None:
    """The shape of ``synthetic-burst-steady`` at any seed: lengths within their clips, a bursty first half hour
    and a steady second one (requests per minute)."""
    per_min = [0] * 60
    for r in requests:
        per_min[min(int(r.arrival_s // 60), 59)] += 1
        assert 16 <= r.isl <= 3000 and 8 <= r.osl <= 1000
    bursty, steady = per_min[:30], per_min[31:59]
    assert max(bursty) > 4 * min(bursty)  # 8 req/s bursts over a 1.5 req/s base
    assert max(steady) < 1.3 * min(steady)  # 5 req/s, Poisson noise only


def test_the_synthetic_burst_steady_trace_is_deterministic_bursty_then_steady() -> None:
    a = load_trace("synthetic-burst-steady")
    b = load_trace("synthetic-burst-steady")
    assert a.requests == b.requests and a.fmt == "synthetic" and a.name == "synthetic-burst-steady"
    assert a.requests[0].arrival_s == 0.0 and 3500.0 < a.span_s < 3600.0
    assert_bursty_then_steady(a.requests)
    assert load_trace("synthetic-burst-steady", duration_s=600.0).requests == a.requests[: len(
        [r for r in a.requests if r.arrival_s < 600.0])]


def test_a_synthetic_trace_draws_other_requests_at_another_seed_and_only_a_synthetic_trace_has_one() -> None:
    default = load_trace("synthetic-burst-steady")
    assert load_trace("synthetic-burst-steady", seed=13).requests == default.requests  # 13 is the default seed
    one = load_trace("synthetic-burst-steady", seed=1)
    assert one.requests == load_trace("synthetic-burst-steady", seed=1).requests
    assert one.requests != default.requests and "seed 1" in one.source
    assert_bursty_then_steady(one.requests)
    with pytest.raises(TraceError, match="seed applies only to a synthetic trace"):
        load_trace("azure-conv-2023", seed=1)

