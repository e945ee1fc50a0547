"""PerformanceProfile: interpolation, extrapolation, loading and clear errors for bad tables."""

from __future__ import annotations

import json

import pytest
import yaml

from fulcrum.errors import ProfileError
from fulcrum.ratio.profile import DecodeTable, PrefillTable, load_profile, profile_from_dict
from fulcrum.ratio.profiles import BUILTIN_PROFILES, builtin_profile, resolve_profile


def small_profile_dict() -> dict:
    return {
        "name": "tiny",
        "model": "m",
        "gpu": {"type": "X", "memoryGiB": 80, "hbmBandwidthGBps": 2000},
        "weightBytes": 20e9,
        "kvBytesPerToken": 100_000,
        "activationReserveGiB": 4,
        "cudaGraphMaxBatch": 128,
        "prefill": [{"tp": 1, "isl": [100, 1000, 2000], "ttftMs": [20, 110, 250]}],
        "decode": [{"tp": 1, "batch": [1, 64], "context": [100, 2000], "tpotMs": [[10, 12], [20, 40]]}],
    }


def test_table_i_prefill_is_interpolated_linearly_between_published_points(table_i):
    # 1000 tokens lies 3/5 of the way from 700 (125 ms) to 1200 (193 ms)
    assert table_i.ttft(1000, 1) == pytest.approx(0.125 + 0.6 * 0.068)
    assert table_i.ttft(1200, 1) == pytest.approx(0.193)


def test_table_i_decode_is_bilinear_in_batch_and_context(table_i):
    # batch 224 is halfway between 200 and 248; context 950 halfway between 700 and 1200
    expected = 0.5 * (0.5 * (47 + 50) + 0.5 * (53 + 57)) / 1e3
    assert table_i.tpot(224, 950, 2) == pytest.approx(expected)


def test_prefill_extrapolation_is_continuous_and_grows_past_the_table(table_i):
    t = table_i.prefill[1]
    assert t(1700) == pytest.approx(0.269)
    assert t(1700.001) == pytest.approx(0.269, rel=1e-4)
    assert t(4000) > t(3000) > t(1700)


def test_decode_extrapolates_linearly_above_and_holds_the_first_line_below(table_i):
    # above the largest batch: the slope of the last two batch lines continues
    at_248, at_200 = table_i.tpot(248, 1200, 2), table_i.tpot(200, 1200, 2)
    assert table_i.tpot(296, 1200, 2) == pytest.approx(at_248 + (at_248 - at_200))
    # below the smallest batch: never faster than the first measured line
    assert table_i.tpot(10, 1200, 2) == pytest.approx(table_i.tpot(104, 1200, 2))


def test_batched_prefill_costs_less_than_the_sum_and_no_less_than_the_longest():
    t = PrefillTable((100, 1000, 2000), (0.02, 0.11, 0.25))
    batch = t.batch([300, 300, 300])
    assert t(300) <= batch <= 3 * t(300)
    assert t.batch([]) == 0.0


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["prefill"][0].update(ttftMs=[20, 10, 250]), "must not decrease"),
        (lambda d: d["prefill"][0].update(isl=[100, 100, 2000]), "strictly increasing"),
        (lambda d: d["prefill"][0].update(ttftMs=[20, 110]), "3 ISL points but 2"),
        (lambda d: d["decode"][0].update(tpotMs=[[10, 12], [20]]), "expected 2×2"),
        (lambda d: d["decode"][0].update(tpotMs=[[10, 12], [5, 40]]), "must not decrease"),
        (lambda d: d.pop("kvBytesPerToken"), "missing field 'kvBytesPerToken'"),
        (lambda d: d["prefill"][0].update(isl=["a", 2, 3]), "expected a number"),
        (lambda d: d["prefill"][0].update(ttftMs=[0, 1, 2]), "finite positive"),
        (lambda d: d.update(prefill=[]), r"^profile: prefill: expected a list of at least one table .*empty list$"),
    ],
)
def test_bad_profiles_are_rejected_with_the_reason(mutate, message):
    d = small_profile_dict()
    mutate(d)
    with pytest.raises(ProfileError, match=message):
        profile_from_dict(d)


def test_profiles_load_from_yaml_json_and_csv_and_round_trip(tmp_path):
    d = small_profile_dict()
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(d))
    (tmp_path / "p.json").write_text(json.dumps(d))
    a, b = load_profile(tmp_path / "p.yaml"), load_profile(tmp_path / "p.json")
    assert a.ttft(500, 1) == b.ttft(500, 1) == pytest.approx(0.02 + 0.09 * 400 / 900)
    assert profile_from_dict(a.to_dict()).tpot(30, 700, 1) == pytest.approx(a.tpot(30, 700, 1))
    meta = {k: v for k, v in d.items() if k not in ("prefill", "decode")}
    (tmp_path / "p.meta.yaml").write_text(yaml.safe_dump(meta))
    rows = ["kind,tp,isl,batch,context,ms", "prefill,1,100,,,20", "prefill,1,1000,,,110", "prefill,1,2000,,,250"]
    rows += ["decode,1,,1,100,10", "decode,1,,1,2000,12", "decode,1,,64,100,20", "decode,1,,64,2000,40"]
    (tmp_path / "p.csv").write_text("\n".join(rows) + "\n")
    c = load_profile(tmp_path / "p.csv")
    assert c.ttft(500, 1) == pytest.approx(a.ttft(500, 1))
    assert c.tpot(30, 700, 1) == pytest.approx(a.tpot(30, 700, 1))


def test_csv_profile_with_a_hole_in_the_decode_grid_names_the_missing_point(tmp_path):
    d = small_profile_dict()
    meta = {k: v for k, v in d.items() if k not in ("prefill", "decode")}
    (tmp_path / "p.meta.yaml").write_text(yaml.safe_dump(meta))
    rows = ["kind,tp,isl,batch,context,ms", "prefill,1,100,,,20", "decode,1,,1,100,10", "decode,1,,1,2000,12", "decode,1,,64,100,20"]
    (tmp_path / "p.csv").write_text("\n".join(rows) + "\n")
    with pytest.raises(ProfileError, match=r"missing points .*64\.0, 2000\.0"):
        load_profile(tmp_path / "p.csv")


def test_missing_files_unknown_formats_and_unknown_builtins_fail_clearly(tmp_path):
    with pytest.raises(ProfileError, match="not found"):
        load_profile(tmp_path / "nope.yaml")
    (tmp_path / "p.txt").write_text("x")
    with pytest.raises(ProfileError, match="unknown profile format"):
        load_profile(tmp_path / "p.txt")
    (tmp_path / "bad.yaml").write_text("a: [1, 2")
    with pytest.raises(ProfileError, match="not valid YAML"):
        load_profile(tmp_path / "bad.yaml")
    with pytest.raises(ProfileError, match="unknown built-in profile"):
        builtin_profile("nope")


def test_asking_for_an_unmeasured_tp_raises(table_i):
    with pytest.raises(ProfileError, match="no decode table for TP=4"):
        table_i.tpot(10, 100, 4)


def test_every_shipped_profile_loads_and_is_monotone():
    for name in BUILTIN_PROFILES:
        p = resolve_profile(name)
        for tp in p.prefill_tps:
            assert p.ttft(4000, tp) > p.ttft(100, tp) > 0
        for tp in p.decode_tps:
            assert p.tpot(64, 2000, tp) >= p.tpot(1, 100, tp) > 0


def test_kv_capacity_follows_eq_11(table_i):
    # (80 GiB − 4 GiB) × 2 GPUs − 72 GB of weights, over 327,680 bytes per token
    expected = ((80 - 4) * 2 * 2**30 - 72e9) / 327_680
    assert table_i.kv_capacity_tokens(2) == pytest.approx(expected)


def test_decode_table_rejects_an_empty_axis():
    with pytest.raises(ProfileError, match="no points"):
        DecodeTable((), (1.0,), ())


def test_a_folder_or_invalid_yaml_is_one_line_naming_the_file_line_and_column(tmp_path):
    (tmp_path / "somedir").mkdir()
    with pytest.raises(ProfileError, match=r"somedir is a directory, not a profile file$"):
        load_profile(tmp_path / "somedir")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\nb: : x\n")
    with pytest.raises(ProfileError) as err:
        load_profile(bad)
    assert str(err.value) == f"{bad}:2:2: not valid YAML: while parsing a flow sequence, expected ',' or ']', but got ':'"
    # a CSV profile's scalars come from its .meta.yaml: that is the file named
    (tmp_path / "c.csv").write_text("kind,tp,isl,batch,context,ms\n")
    (tmp_path / "c.meta.yaml").write_text("name: [x\n")
    with pytest.raises(ProfileError, match=r"c\.meta\.yaml:2:1: not valid YAML: "):
        load_profile(tmp_path / "c.csv")


# --- malformed profile files: one ProfileError naming the file and the key or line, never a traceback or a guess ---

HUGE = 10**400  # an integer no float holds


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        pytest.param(lambda d: d["prefill"][0].update(tp=1.5), r"prefill\[0\]\.tp: expected a whole number, got 1\.5",
                     id="tp-not-whole"),
        pytest.param(lambda d: d["prefill"][0].update(tp=True), r"prefill\[0\]\.tp: expected a number, got True",
                     id="tp-bool"),
        pytest.param(lambda d: d["decode"][0].update(tp=0), r"decode\[0\]\.tp: a TP must be from 1 to 64, got 0",
                     id="tp-zero"),
        pytest.param(lambda d: d["decode"][0].update(tp=-2), r"decode\[0\]\.tp: a TP must be from 1 to 64, got -2",
                     id="tp-negative"),
        pytest.param(lambda d: d["prefill"][0].update(tp=HUGE), r"prefill\[0\]\.tp: expected a finite number",
                     id="tp-beyond-float"),
        pytest.param(lambda d: d["prefill"].append({"tp": 1, "isl": [100], "ttftMs": [5]}),
                     r"prefill\[1\]: a second table for TP=1 \(the first is prefill\[0\]\)", id="tp-twice"),
        pytest.param(lambda d: d["prefill"][0].update(ttftMs=[20, HUGE, 250]),
                     r"prefill\[0\]\.ttftMs\[1\]: expected a finite number", id="latency-beyond-float"),
        pytest.param(lambda d: d.update(weightBytes=HUGE), r"weightBytes: expected a finite number",
                     id="weights-beyond-float"),
        pytest.param(lambda d: d.update(cudaGraphMaxBatch=HUGE), r"cudaGraphMaxBatch: expected a finite number",
                     id="graph-batch-beyond-float"),
        pytest.param(lambda d: d.update(cudaGraphMaxBatch=128.5),
                     r"cudaGraphMaxBatch: expected a whole number, got 128\.5", id="graph-batch-not-whole"),
        pytest.param(lambda d: d["gpu"].update(memoryGiB=True), r"gpu\.memoryGiB: expected a number, got True",
                     id="memory-bool"),
        pytest.param(lambda d: d.update(prefill=[None]), r"prefill\[0\]: expected a mapping, got NoneType",
                     id="entry-null"),
        pytest.param(lambda d: d.update(decode=[5]), r"decode\[0\]: expected a mapping, got int", id="entry-scalar"),
        pytest.param(lambda d: d.update(prefill={"tp": 1}), r"prefill: expected a list of tables, got dict",
                     id="tables-a-mapping"),
        pytest.param(lambda d: d["prefill"][0].update(isl=[-100, 1000, 2000]),
                     r"prefill\[0\] \(TP=1\): prefill table ISL: every point must be > 0, got -100", id="isl-negative"),
        pytest.param(lambda d: d["prefill"][0].update(isl=[0], ttftMs=[5]),
                     r"prefill table ISL: every point must be > 0, got 0", id="isl-zero"),
        pytest.param(lambda d: d["decode"][0].update(batch=[0, 64]),
                     r"decode\[0\] \(TP=1\): decode table batch: every point must be > 0, got 0", id="batch-zero"),
        pytest.param(lambda d: d["decode"][0].update(context=[-100, 2000]),
                     r"decode table context: every point must be > 0, got -100", id="context-negative"),
    ],
)
def test_malformed_profile_values_are_rejected_naming_the_key(mutate, message):
    d = small_profile_dict()
    mutate(d)
    with pytest.raises(ProfileError, match=message):
        profile_from_dict(d)


@pytest.mark.parametrize("key", ["name", "model", "source", "gpu.type"])
@pytest.mark.parametrize(
    ("value", "shown"),
    [([1, 2], r"list \[1, 2\]"), ({"a": 1}, r"dict \{'a': 1\}"), (True, r"bool True \(quote it"),
     (4090, r"int 4090 \(quote it")],
    ids=["list", "mapping", "bool", "number"],
)
def test_a_string_field_holding_a_list_mapping_or_number_is_refused_not_stringified(key, value, shown):
    d = small_profile_dict()
    (d["gpu"] if key == "gpu.type" else d)[key.removeprefix("gpu.")] = value
    with pytest.raises(ProfileError, match=rf"^profile: {key}: expected a string, got {shown}"):
        profile_from_dict(d)


def test_an_empty_string_field_takes_its_default():
    d = small_profile_dict()
    d.update(name=None, model=None, source=None)
    d["gpu"]["type"] = None
    p = profile_from_dict(d, origin="x.yaml")
    assert (p.name, p.model, p.source, p.gpu_type) == ("x.yaml", "", "", "")


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("e.yaml", "", r"e\.yaml: the file is empty"),
        ("e.yaml", "\n  \n", r"e\.yaml: the file is empty"),
        ("e.json", "", r"e\.json: the file is empty"),
        ("c.yaml", "# nothing yet\n", r"c\.yaml: holds no profile fields \(empty, only comments, or null\)"),
        ("n.json", "null", r"n\.json: holds no profile fields"),
    ],
)
def test_an_empty_profile_file_says_so_in_plain_words(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(ProfileError, match=message) as info:
        load_profile(tmp_path / name)
    assert "NoneType" not in str(info.value) and "Expecting value" not in str(info.value)


def test_an_empty_csv_profile_or_meta_file_says_so(tmp_path):
    path = _csv_profile(tmp_path, CSV_ROWS, meta="# to do\n")
    with pytest.raises(ProfileError, match=r"p\.meta\.yaml: holds no fields \(empty or only comments\)"):
        load_profile(path)
    path = _csv_profile(tmp_path, CSV_ROWS)
    path.write_text("")
    with pytest.raises(ProfileError, match=r"p\.csv: the file is empty \(a CSV profile needs the columns"):
        load_profile(path)


def test_a_profile_number_below_float_range_is_refused_as_not_finite():
    d = small_profile_dict()
    d.update(weightBytes=-HUGE)
    with pytest.raises(ProfileError, match=r"weightBytes: expected a finite number, got -10{38}…$"):
        profile_from_dict(d)


def test_a_profile_nested_or_numbered_past_the_parsers_limits_is_one_line_naming_the_file(tmp_path):
    for name in ("deep.json", "deep.yaml"):
        (tmp_path / name).write_text("[" * 100_000 + "]" * 100_000)
        with pytest.raises(ProfileError, match=rf"{name}: cannot parse: nested too deeply"):
            load_profile(tmp_path / name)
    digits = tmp_path / "digits.json"
    digits.write_text(json.dumps(small_profile_dict()).replace('"kvBytesPerToken": 100000',
                                                                '"kvBytesPerToken": ' + "9" * 5000))
    with pytest.raises(ProfileError, match=r"digits\.json: cannot parse: .*digits"):
        load_profile(digits)


def _csv_profile(tmp_path, rows, meta=None):
    """Write ``p.csv`` (header + rows) and ``p.meta.yaml`` (the small profile's scalars, or the text ``meta``)."""
    d = small_profile_dict()
    scalars = {k: v for k, v in d.items() if k not in ("prefill", "decode")}
    (tmp_path / "p.meta.yaml").write_text(yaml.safe_dump(scalars) if meta is None else meta)
    (tmp_path / "p.csv").write_text("\n".join(["kind,tp,isl,batch,context,ms", *rows]) + "\n", encoding="utf-8")
    return tmp_path / "p.csv"


CSV_ROWS = ["prefill,1,100,,,20", "prefill,1,1000,,,110", "decode,1,,1,100,10", "decode,1,,1,2000,12",
            "decode,1,,64,100,20", "decode,1,,64,2000,40"]


@pytest.mark.parametrize(
    ("rows", "meta", "message"),
    [
        pytest.param(CSV_ROWS + ["prefill,1,100,,,25"], None,
                     r"p\.csv:8: prefill point TP=1, isl 100 is given twice \(first on line 2\)", id="point-twice"),
        pytest.param(CSV_ROWS + ["decode,1,,64,100,30"], None,
                     r"p\.csv:8: decode point TP=1, batch 64, context 100 is given twice \(first on line 6\)",
                     id="decode-point-twice"),
        pytest.param([r.replace("prefill,1,", "prefill,1.5,") for r in CSV_ROWS], None,
                     r"p\.csv:2 tp: expected a whole number, got '1\.5'", id="tp-not-whole"),
        pytest.param(CSV_ROWS + ["prefill,1," + "1" * 200_000 + ",,,5"], None,
                     r"p\.csv:8: malformed CSV: field larger than field limit", id="field-over-csv-limit"),
        pytest.param(CSV_ROWS[:2] + ['prefill,1,"2000,,,250'] + CSV_ROWS[2:], None,
                     r"p\.csv:4: malformed CSV: unterminated quote: the quoted field opened on this line runs to the "
                     r"end of the file$", id="unterminated-quote"),
        pytest.param(CSV_ROWS[:2] + ['prefill,1,"2000,,,250'] + CSV_ROWS[2:4] + ['decode,1,,64,"100",20'], None,
                     r"p\.csv:4: malformed CSV: unterminated quote: the quoted field opened on this line runs on to "
                     r"line 7$", id="quote-closed-by-a-stray-quote"),
        pytest.param(CSV_ROWS[:2] + ['prefill,1,"2000,,,250'] + ["decode,1,,1,100,10"] * 9_000, None,
                     r"p\.csv:4: malformed CSV: unterminated quote: .* runs on to line \d+ \(field larger than field "
                     r"limit", id="quote-swallows-past-the-field-limit"),
        pytest.param(CSV_ROWS, "- 1\n- 2\n",
                     r"p\.meta\.yaml: expected a mapping of the profile's scalar fields, got list", id="meta-a-list"),
        pytest.param(CSV_ROWS, "hello\n", r"p\.meta\.yaml: expected a mapping of the profile's scalar fields, got str",
                     id="meta-a-string"),
    ],
)
def test_malformed_csv_profiles_are_one_line_naming_the_file_and_line(tmp_path, rows, meta, message):
    with pytest.raises(ProfileError, match=message):
        load_profile(_csv_profile(tmp_path, rows, meta))


def test_csv_profile_rows_read_as_dict_reader_did(tmp_path):
    # blank lines are skipped (a bad row's line is still its own), cells past the header's are ignored, and a
    # short row's missing cells are None
    rows = [r + ",extra" for r in CSV_ROWS[:3]] + ["", ""] + CSV_ROWS[3:]
    assert load_profile(_csv_profile(tmp_path, rows)).ttft(100, 1) == pytest.approx(0.02)
    with pytest.raises(ProfileError, match=r"p\.csv:10 tp: expected a number, got 'x'$"):
        load_profile(_csv_profile(tmp_path, [*CSV_ROWS, "", "", "prefill,x,1,,,2"]))
    with pytest.raises(ProfileError, match=r"p\.csv:8 ms: expected a number, got None$"):
        load_profile(_csv_profile(tmp_path, [*CSV_ROWS, "prefill,1"]))


def test_a_quote_in_a_csv_profiles_header_left_open_is_named_at_line_1(tmp_path):
    path = _csv_profile(tmp_path, CSV_ROWS)
    path.write_text('kind,tp,isl,batch,context,ms,"note\n' + "\n".join(CSV_ROWS) + "\n")
    with pytest.raises(ProfileError, match=r"p\.csv:1: malformed CSV: unterminated quote: the quoted field opened on "
                                           r"this line runs to the end of the file$"):
        load_profile(path)


def test_a_csv_profile_saved_with_a_byte_order_mark_loads(tmp_path):
    path = _csv_profile(tmp_path, CSV_ROWS)
    path.write_text(path.read_text(), encoding="utf-8-sig")  # Excel's "CSV UTF-8"
    assert load_profile(path).ttft(100, 1) == pytest.approx(0.02)


def _meta_without(key):
    scalars = {k: v for k, v in small_profile_dict().items() if k not in ("prefill", "decode")}
    if "." in key:
        outer, inner = key.split(".")
        scalars[outer] = {k: v for k, v in scalars[outer].items() if k != inner}
    else:
        scalars.pop(key)
    return yaml.safe_dump(scalars)


def _meta_with(**fields):
    scalars = {k: v for k, v in small_profile_dict().items() if k not in ("prefill", "decode")}
    for key, value in fields.items():
        if key.startswith("gpu_"):
            scalars["gpu"][key.removeprefix("gpu_")] = value
        else:
            scalars[key] = value
    return yaml.safe_dump(scalars)


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        pytest.param(_meta_without("gpu"), r"missing field 'gpu'$", id="gpu-missing"),
        pytest.param(_meta_without("gpu.memoryGiB"), r"gpu: missing field 'memoryGiB'$", id="memory-missing"),
        pytest.param(_meta_without("weightBytes"), r"missing field 'weightBytes'$", id="weights-missing"),
        pytest.param(_meta_with(gpu="H100"), r"gpu: expected a mapping, got str$", id="gpu-not-a-mapping"),
        pytest.param(_meta_with(gpu_memoryGiB=True), r"gpu\.memoryGiB: expected a number, got True$",
                     id="memory-bool"),
        pytest.param(_meta_with(kvBytesPerToken="lots"), r"kvBytesPerToken: expected a number, got 'lots'$",
                     id="kv-bytes-text"),
        pytest.param(_meta_with(cudaGraphMaxBatch=1.5), r"cudaGraphMaxBatch: expected a whole number, got 1\.5$",
                     id="graph-batch-not-whole"),
        pytest.param(_meta_with(name=[1]), r"name: expected a string, got list \[1\]$", id="name-a-list"),
        pytest.param(_meta_with(gpu_memoryGiB=-80), r"gpu\.memoryGiB: expected a number > 0, got -80$",
                     id="memory-negative"),
        pytest.param(_meta_with(activationReserveGiB=-1), r"activationReserveGiB: expected a number >= 0, got -1$",
                     id="reserve-negative"),
        pytest.param(_meta_with(cudaGraphMaxBatch=0), r"cudaGraphMaxBatch: expected a whole number >= 1, got 0$",
                     id="graph-batch-zero"),
        pytest.param(_meta_with(prefill=[{"tp": 1, "isl": [100], "ttftMs": [5]}]),
                     r"prefill: a CSV profile's tables are the rows of p\.csv, not a field of its \.meta\.yaml",
                     id="tables-in-the-meta-file"),
    ],
)
def test_a_missing_or_bad_scalar_of_a_csv_profile_names_its_meta_file(tmp_path, meta, message):
    """The scalars of a CSV profile live in its .meta.yaml: that is the file to fix, so the message names it and the
    key (it named the .csv, where no such field can go)."""
    with pytest.raises(ProfileError, match=r"^\S*p\.meta\.yaml: " + message):
        load_profile(_csv_profile(tmp_path, CSV_ROWS, meta))


def test_a_csv_profile_still_names_the_csv_for_its_tables_and_takes_its_name_from_the_csv(tmp_path):
    path = _csv_profile(tmp_path, CSV_ROWS[:1] + ["prefill,1,1000,,,10"] + CSV_ROWS[2:])
    with pytest.raises(ProfileError, match=r"^\S*p\.csv: prefill\[0\] \(TP=1\): prefill table: latency must not "):
        load_profile(path)
    _csv_profile(tmp_path, CSV_ROWS, _meta_with(name=None))
    assert load_profile(path).name == str(path)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        pytest.param(lambda d: d["gpu"].update(hbmBandwidthGBps=0),
                     r"gpu\.hbmBandwidthGBps: expected a number > 0, got 0$", id="bandwidth-zero"),
        pytest.param(lambda d: d.update(weightBytes=-1.5), r"weightBytes: expected a number > 0, got -1\.5$",
                     id="weights-negative"),
        pytest.param(lambda d: d.update(kvBytesPerToken=0), r"kvBytesPerToken: expected a number > 0, got 0$",
                     id="kv-bytes-zero"),
        pytest.param(lambda d: d.update(cudaGraphMaxBatch=-4),
                     r"cudaGraphMaxBatch: expected a whole number >= 1, got -4$", id="graph-batch-negative"),
    ],
)
def test_an_out_of_range_scalar_names_the_file_and_its_key(tmp_path, mutate, message):
    d = small_profile_dict()
    mutate(d)
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(d))
    with pytest.raises(ProfileError, match=r"^\S*p\.yaml: " + message):
        load_profile(tmp_path / "p.yaml")


def test_a_yaml_timestamp_python_cannot_build_is_a_yaml_problem_naming_the_file(tmp_path):
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(small_profile_dict()) + "measured: 2024-13-45\n")
    with pytest.raises(ProfileError, match=r"^\S*p\.yaml: not valid YAML: month must be in 1\.\.12$"):
        load_profile(tmp_path / "p.yaml")
    path = _csv_profile(tmp_path, CSV_ROWS, "name: tiny\nmeasured: 2024-13-45\n")
    with pytest.raises(ProfileError, match=r"^\S*p\.meta\.yaml: not valid YAML: month must be in 1\.\.12$"):
        load_profile(path)


# --- a quoted number in a YAML or JSON profile is refused (a CSV cell is text and may hold one) ---

QUOTED = r" \(a string: write the number without quotes\)$"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        pytest.param(lambda d: d["prefill"][0]["ttftMs"].__setitem__(0, "20"), r"prefill\[0\]\.ttftMs\[0\]: expected "
                     r"a number, got '20'", id="latency"),
        pytest.param(lambda d: d["prefill"][0]["isl"].__setitem__(1, "1000"),
                     r"prefill\[0\]\.isl\[1\]: expected a number, got '1000'", id="isl"),
        pytest.param(lambda d: d["decode"][0]["tpotMs"][1].__setitem__(0, "20.5"),
                     r"decode\[0\]\.tpotMs\[1\]\[0\]: expected a number, got '20\.5'", id="grid-cell"),
        pytest.param(lambda d: d["decode"][0]["context"].__setitem__(0, "100"),
                     r"decode\[0\]\.context\[0\]: expected a number, got '100'", id="context"),
        pytest.param(lambda d: d["decode"][0].update(tp="1"), r"decode\[0\]\.tp: expected a number, got '1'", id="tp"),
        pytest.param(lambda d: d["gpu"].update(memoryGiB="80"), r"gpu\.memoryGiB: expected a number, got '80'",
                     id="memory"),
        pytest.param(lambda d: d.update(kvBytesPerToken=" 100000 "),
                     r"kvBytesPerToken: expected a number, got ' 100000 '", id="kv-bytes-spaced"),
        pytest.param(lambda d: d.update(weightBytes="2.0e+10"), r"weightBytes: expected a number, got '2\.0e\+10'",
                     id="weights-exponent"),
        pytest.param(lambda d: d.update(activationReserveGiB="4"), r"activationReserveGiB: expected a number, got '4'",
                     id="reserve"),
        pytest.param(lambda d: d.update(cudaGraphMaxBatch="128"), r"cudaGraphMaxBatch: expected a number, got '128'",
                     id="graph-batch"),
    ],
)
@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_a_quoted_number_in_a_yaml_or_json_profile_is_refused_naming_the_file_and_key(tmp_path, fmt, mutate, message):
    d = small_profile_dict()
    mutate(d)
    path = tmp_path / f"p.{fmt}"
    path.write_text(yaml.safe_dump(d) if fmt == "yaml" else json.dumps(d))  # safe_dump quotes the text "20"
    with pytest.raises(ProfileError, match=rf"^\S*p\.{fmt}: {message}{QUOTED}"):
        load_profile(path)


def test_a_hand_written_quoted_number_is_refused_and_text_that_is_no_number_gets_no_hint(tmp_path):
    path = tmp_path / "p.yaml"
    text = yaml.safe_dump(small_profile_dict())
    assert "ttftMs:\n  - 20\n" in text
    path.write_text(text.replace("ttftMs:\n  - 20\n", 'ttftMs:\n  - "20"\n'))
    with pytest.raises(ProfileError, match=rf"^\S*p\.yaml: prefill\[0\]\.ttftMs\[0\]: expected a number, got '20'"
                                           rf"{QUOTED}"):
        load_profile(path)
    d = small_profile_dict()
    d["prefill"][0]["ttftMs"][0] = "20 ms"
    with pytest.raises(ProfileError, match=r"^profile: prefill\[0\]\.ttftMs\[0\]: expected a number, got '20 ms'$"):
        profile_from_dict(d)


def test_a_quoted_number_in_a_csv_profiles_meta_file_is_refused_naming_the_meta_file(tmp_path):
    meta = _meta_with(kvBytesPerToken="100000")
    assert "'100000'" in meta
    with pytest.raises(ProfileError, match=rf"^\S*p\.meta\.yaml: kvBytesPerToken: expected a number, got '100000'"
                                           rf"{QUOTED}"):
        load_profile(_csv_profile(tmp_path, CSV_ROWS, meta))


def test_a_csv_profiles_cells_are_text_and_may_hold_quoted_numbers(tmp_path):
    rows = ['prefill,"1"," 100",,,"20"', *CSV_ROWS[1:4], 'decode,1,,"64","100",20.0', CSV_ROWS[5]]
    p = load_profile(_csv_profile(tmp_path, rows))
    assert p.ttft(100, 1) == pytest.approx(0.02)
    assert p.tpot(64, 100, 1) == pytest.approx(0.02)


def test_an_exponent_yaml_reads_as_text_unquoted_is_still_a_number(tmp_path):
    """YAML 1.1 (PyYAML) reads ``72.0e9``, ``1e9`` and ``+.5`` as text; YAML 1.2, JSON and kubectl read numbers, and
    the documented example and a bundled profile write ``weightBytes: 72.0e9``: plain, they are numbers
    (fulcrum.errors.safe_yaml); quoted, they are the text the file says, refused with the hint."""
    text = yaml.safe_dump(small_profile_dict())
    assert "weightBytes: 20000000000.0\n" in text and "kvBytesPerToken: 100000\n" in text
    path = tmp_path / "p.yaml"
    path.write_text(text.replace("weightBytes: 20000000000.0", "weightBytes: 72.0e9")
                    .replace("kvBytesPerToken: 100000", "kvBytesPerToken: 1e5")
                    .replace("activationReserveGiB: 4\n", "activationReserveGiB: +.5\n"))
    p = load_profile(path)
    assert (p.weight_bytes, p.kv_bytes_per_token, p.activation_reserve_gib) == (72e9, 1e5, 0.5)
    assert builtin_profile("dopd-llama70b-fp8-h100").weight_bytes == 72e9
    path.write_text(text.replace("weightBytes: 20000000000.0", "weightBytes: '72.0e9'"))
    with pytest.raises(ProfileError, match=r"weightBytes: expected a number, got '72\.0e9' \(a string: write the "):
        load_profile(path)
    d = small_profile_dict()
    d["weightBytes"] = "72e9"  # JSON: a quoted value is always deliberate text
    (tmp_path / "p.json").write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=r"weightBytes: expected a number, got '72e9' \(a string"):
        load_profile(tmp_path / "p.json")


def test_every_shipped_and_every_written_profile_holds_numbers_not_quoted_numbers(tmp_path):
    from fulcrum.worker.profiler import render_profile_yaml

    for name in BUILTIN_PROFILES:
        p = resolve_profile(name)
        path = tmp_path / f"{name}.yaml"
        path.write_text(render_profile_yaml(p.to_dict()))  # as `fulcrum profile` writes it
        assert load_profile(path).to_dict() == p.to_dict()
    d = small_profile_dict()
    d.update(weightBytes=1e20, kvBytesPerToken=1.5e-3 * 1e8)
    d["prefill"][0]["ttftMs"] = [1e-5, 2e-5, 1e16]  # floats YAML writes in exponent notation
    path.write_text(render_profile_yaml(d))
    assert load_profile(path).prefill[1].seconds == pytest.approx((1e-8, 2e-8, 1e13))


# --- a `prefill:` or `decode:` key with no table names the file and the key ---

@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("prefill:\n", r"prefill: expected a list of at least one table \(tp, isl, ttftMs\), got null "
                                   r"\(the key has no value\)$", id="prefill-null"),
        pytest.param("prefill: []\n", r"prefill: expected a list of at least one table \(tp, isl, ttftMs\), got an "
                                      r"empty list$", id="prefill-empty"),
        pytest.param("decode:\n", r"decode: expected a list of at least one table \(tp, batch, context, tpotMs\), got "
                                  r"null \(the key has no value\)$", id="decode-null"),
        pytest.param("decode: []\n", r"decode: expected a list of at least one table \(tp, batch, context, tpotMs\), "
                                     r"got an empty list$", id="decode-empty"),
    ],
)
def test_an_empty_prefill_or_decode_key_names_the_file_and_the_key(tmp_path, text, message):
    d = small_profile_dict()
    key = text.split(":")[0]
    d.pop(key)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(d) + text)
    with pytest.raises(ProfileError, match=r"^\S*tiny\.yaml: " + message) as info:
        load_profile(path)
    assert "profile 'tiny'" not in str(info.value)
    d[key] = [] if "[]" in text else None
    (tmp_path / "tiny.json").write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=r"^\S*tiny\.json: " + message):
        load_profile(tmp_path / "tiny.json")


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_a_csv_profile_without_rows_of_a_kind_names_the_csv_and_the_kind(tmp_path, kind):
    path = _csv_profile(tmp_path, [r for r in CSV_ROWS if not r.startswith(kind)])
    with pytest.raises(ProfileError, match=rf"^\S*p\.csv: {kind}: no {kind} rows \(kind={kind}\): a profile needs at "
                                           rf"least one {kind} point$"):
        load_profile(path)
