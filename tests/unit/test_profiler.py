"""``fulcrum profile``: the pure assembly of a profile from measurements, and the CLI against the FAKE engine.

The fake engine (tests/fakes/fake_engine.py) is not vLLM: its latencies are sleeps, so these tests check the
method (exact prompt lengths, retries, dropped points, the file format), not any number.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from fakes.fake_engine import FakeEngine, FakeEngineSettings
from fakes.interrupt import interrupt_when
from fulcrum.cli import main
from fulcrum.errors import ProfileError
from fulcrum.ratio.profile import load_profile
from fulcrum.worker.profiler import (
    EndpointFacts,
    MeasureLog,
    Measurements,
    MemoryFacts,
    PointResult,
    ProfileGrid,
    assemble_profile,
    endpoint_facts,
    model_dir_facts,
    parse_cache_config_info,
    partial_note,
    point_name,
    profile_document,
    render_configmap,
    render_profile_yaml,
    resolve_memory,
    steady_tpot,
)

GiB = float(1 << 30)
MEMORY = MemoryFacts(gpu_type="H100", gpu_memory_gib=80, hbm_bandwidth_gbps=3350, weight_bytes=16 * GiB,
                     kv_bytes_per_token=131072, activation_reserve_gib=4, cuda_graph_max_batch=512)


def _pre(isl: int, *ms: float) -> PointResult:
    return PointResult("prefill", (isl,), tuple(v / 1e3 for v in ms))


def _dec(b: int, c: int, *ms: float) -> PointResult:
    return PointResult("decode", (b, c), tuple(v / 1e3 for v in ms))


def _measurements(prefill: list[PointResult], decode: list[PointResult], tp: int = 2) -> Measurements:
    return Measurements(tp=tp, prefill=tuple(prefill), decode=tuple(decode), decode_tokens=16)


def _grid_points() -> list[PointResult]:
    return [_dec(1, 128, 10, 11, 12), _dec(1, 512, 12, 13, 50), _dec(4, 128, 14, 15, 16), _dec(4, 512, 17, 17, 18)]


# ------------------------------------------------------------------------------------------------ pure assembly
def test_assembly_takes_the_median_of_each_point_and_files_the_tables_under_the_measured_tp() -> None:
    m = _measurements([_pre(128, 30, 20, 25), _pre(512, 60, 61, 200)], _grid_points())
    out = assemble_profile(m, MEMORY, name="x", model="m", source="test")
    p = out.profile
    assert p.prefill_tps == (2,) and p.decode_tps == (2,)
    assert p.ttft(128, 2) == pytest.approx(0.025)
    assert p.ttft(512, 2) == pytest.approx(0.061)
    assert p.tpot(1, 512, 2) == pytest.approx(0.013)  # the 50 ms outlier does not move the median
    assert p.tpot(4, 512, 2) == pytest.approx(0.017)
    assert out.notes == ()


def test_a_latency_that_falls_as_load_grows_is_raised_to_the_envelope_and_noted() -> None:
    m = _measurements([_pre(128, 30), _pre(256, 28), _pre(512, 60)],
                      [_dec(1, 128, 10), _dec(1, 512, 9), _dec(4, 128, 8), _dec(4, 512, 20)])
    out = assemble_profile(m, MEMORY, name="x", model="m", source="test")
    assert out.profile.prefill[2].seconds == pytest.approx((0.030, 0.030, 0.060))
    assert out.profile.decode[2].seconds[0] == pytest.approx((0.010, 0.010))
    assert out.profile.decode[2].seconds[1] == pytest.approx((0.010, 0.020))
    assert any("ISL 256 raised from 28.000 to 30.000 ms" in n for n in out.notes)
    assert any("batch 1 context 512 raised" in n for n in out.notes)
    assert any("batch 4 context 128 raised" in n for n in out.notes)


def test_an_unmeasured_cell_drops_its_context_column_so_the_decode_grid_stays_complete() -> None:
    dec = [_dec(1, 128, 10), _dec(1, 512, 12), _dec(1, 2048, 20), _dec(2, 128, 11), _dec(2, 512, 13),
           PointResult("decode", (2, 2048), dropped="needs 2056 tokens > max_model_len 2048"),
           _dec(8, 128, 14), _dec(8, 512, 16), PointResult("decode", (8, 2048), failures=("HTTP 500",))]
    out = assemble_profile(_measurements([_pre(128, 30), _pre(512, 60)], dec), MEMORY, name="x", model="m",
                           source="test")
    t = out.profile.decode[2]
    assert t.batch == (1.0, 2.0, 8.0) and t.context == (128.0, 512.0)
    assert any("context 2048 dropped" in n for n in out.notes)


def test_fewer_than_two_measured_points_on_an_axis_is_a_clear_error_naming_the_failures() -> None:
    pre = [_pre(128, 30), PointResult("prefill", (512,), failures=("attempt 3: HTTP 500: boom",))]
    with pytest.raises(ProfileError, match=r"prefill: only 1 ISL point\(s\) measured.*failed: prefill ISL 512: attempt 3: "
                                           r"HTTP 500"):
        assemble_profile(_measurements(pre, _grid_points()), MEMORY, name="x", model="m", source="t")
    dec = [_dec(1, 128, 10), _dec(4, 128, 12)]
    with pytest.raises(ProfileError, match=r"decode: the complete measured grid has 2 batch\(es\) × 1 context"):
        assemble_profile(_measurements([_pre(128, 30), _pre(512, 60)], dec), MEMORY, name="x", model="m", source="t")


def test_the_grid_refuses_axes_of_fewer_than_two_points_and_unsorted_or_repeated_values() -> None:
    with pytest.raises(ProfileError, match="--batch: need at least 2 points"):
        ProfileGrid(isl=(128, 256), batch=(4,), context=(128, 512))
    with pytest.raises(ProfileError, match="--isl: values must be strictly increasing"):
        ProfileGrid(isl=(256, 128), batch=(1, 2), context=(128, 512))
    assert ProfileGrid(isl=(1, 2, 3), batch=(1, 2), context=(8, 16), repeats=2).total_points == (3 + 4) * 2


def test_the_written_document_loads_with_load_profile_and_keeps_every_sample(tmp_path: Path) -> None:
    m = _measurements([_pre(128, 30, 20, 25), _pre(512, 60, 61, 200)], _grid_points())
    out = assemble_profile(m, MEMORY, name="x", model="m", source="test")
    mem = resolve_memory(MEMORY, EndpointFacts(), tp=2)
    doc = profile_document(out, m, mem, "http://e:8000")
    path = tmp_path / "p.yaml"
    path.write_text(render_profile_yaml(doc))
    loaded = load_profile(path)
    assert loaded.ttft(512, 2) == pytest.approx(0.061)
    assert loaded.kv_bytes_per_token == 131072
    raw = yaml.safe_load(path.read_text())
    assert raw["measurement"]["prefill"][1]["samplesMs"] == [60.0, 61.0, 200.0]
    assert raw["measurement"]["memorySources"]["kv_bytes_per_token"] == "flag"


def test_steady_tpot_is_the_time_per_token_while_every_request_of_the_batch_decodes() -> None:
    # request A starts early (gaps of 0.05 s before B joins), B joins at t=1.0; both step every 0.01 s together
    a = [(0.0, 1), (0.05, 2), (0.10, 3)] + [(1.0 + 0.01 * k, 4 + k) for k in range(10)]
    b = [(1.0 + 0.01 * k, 1 + k) for k in range(10)] + [(1.2, 11)]  # B's last chunk comes after A has finished
    assert steady_tpot([a, b]) == pytest.approx(0.01)
    # a chunk carrying two tokens counts as two steps
    assert steady_tpot([[(0.0, 1), (0.02, 3), (0.04, 5)]]) == pytest.approx(0.01)
    # chunks delivered in bursts (several at one instant) still give the steady rate, not a gap of ~0
    burst = [(0.0, 1)] + [(0.04 * (k // 4 + 1), k + 2) for k in range(16)]
    assert steady_tpot([burst]) == pytest.approx(0.16 / 16)


# ------------------------------------------------------------------------------------------------ facts
def test_cache_config_info_labels_and_models_give_block_size_blocks_and_max_model_len() -> None:
    text = ("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
            "# TYPE vllm:cache_config_info gauge\n"
            'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",gpu_memory_utilization="0.9",'
            'num_gpu_blocks="2000",kv_cache_memory_bytes="None"} 1.0\n'
            'vllm:num_requests_running{model_name="m"} 0.0\n')
    labels = parse_cache_config_info(text)
    assert labels["num_gpu_blocks"] == "2000"
    facts = endpoint_facts({"data": [{"id": "m", "max_model_len": 4096}]}, "m", labels)
    assert (facts.max_model_len, facts.block_size, facts.kv_capacity_tokens) == (4096, 16, 32000)
    assert facts.kv_cache_memory_bytes is None
    assert parse_cache_config_info("vllm:num_requests_running 0\n") == {}
    with pytest.raises(ProfileError, match=r"does not serve model 'other' \(it serves \['m'\]\)"):
        endpoint_facts({"data": [{"id": "m"}]}, "other", {})


def test_the_activation_reserve_is_calibrated_so_the_profile_has_the_engines_kv_capacity() -> None:
    flags = MemoryFacts(gpu_memory_gib=80, hbm_bandwidth_gbps=3350, weight_bytes=40 * GiB, kv_bytes_per_token=327680)
    endpoint = EndpointFacts(block_size=16, num_gpu_blocks=5000)
    mem = resolve_memory(flags, endpoint, tp=1)
    assert mem.facts.activation_reserve_gib == pytest.approx(80 - (80000 * 327680 + 40 * GiB) / GiB)
    m = _measurements([_pre(128, 30), _pre(512, 60)], _grid_points(), tp=1)
    profile = assemble_profile(m, mem.facts, name="x", model="m", source="t").profile
    assert profile.kv_capacity_tokens(1) == pytest.approx(80000)
    assert "calibrated" in mem.sources["activation_reserve_gib"]
    # a flag wins over the calibration; without a reported capacity the default is 4 GiB
    assert resolve_memory(MemoryFacts(**{**flags.__dict__, "activation_reserve_gib": 2.0}), endpoint, 1).facts.activation_reserve_gib == 2.0
    assert resolve_memory(flags, EndpointFacts(), 1).facts.activation_reserve_gib == 4.0


def test_kv_bytes_come_from_the_engines_kv_memory_when_no_flag_or_model_folder_gives_them() -> None:
    flags = MemoryFacts(gpu_memory_gib=80, hbm_bandwidth_gbps=3350, weight_bytes=40 * GiB)
    endpoint = EndpointFacts(block_size=16, num_gpu_blocks=1000, kv_cache_memory_bytes=16000 * 4096)
    mem = resolve_memory(flags, endpoint, tp=2)
    assert mem.facts.kv_bytes_per_token == pytest.approx(4096 * 2)
    with pytest.raises(ProfileError, match=r"pass --kv-bytes-per-token \(or --model-path\)"):
        resolve_memory(flags, EndpointFacts(block_size=16, num_gpu_blocks=1000), tp=2)


def test_a_model_folder_gives_weight_bytes_from_its_files_and_kv_bytes_from_its_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 128,
                                                      "num_attention_heads": 4, "num_key_value_heads": 2,
                                                      "torch_dtype": "float32"}))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 12345)
    weight, kv, how = model_dir_facts(tmp_path)
    assert weight == 12345
    assert kv == 2 * 2 * 2 * 32 * 4  # K and V × layers × KV heads × head dim × 4 bytes
    assert model_dir_facts(tmp_path, cache_dtype="fp8_e4m3")[1] == 2 * 2 * 2 * 32 * 1
    with pytest.raises(ProfileError, match="no \\*.safetensors"):
        (tmp_path / "model.safetensors").unlink()
        model_dir_facts(tmp_path)


def test_the_configmap_is_a_valid_v1_configmap_holding_the_profile_under_profile_yaml() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    cm = render_configmap("name: x\n", "llama-h100-profile", namespace="serving")
    kubernetes_validate.validate(cm, kubernetes_validate.latest_version(), strict=True)
    assert cm["data"] == {"profile.yaml": "name: x\n"}
    with pytest.raises(ProfileError, match="not a valid Kubernetes name"):
        render_configmap("", "Bad_Name")


# ------------------------------------------------------------------------------------------------ CLI on the fake
FLAGS = ["--model", "fake-model", "--tp", "1", "--isl", "16,64,200", "--batch", "1,3", "--context", "40,120",
         "--repeats", "2", "--decode-tokens", "8", "--retry-backoff-s", "0", "--no-progress",
         "--gpu", "H100", "--weight-gib", "1", "--kv-bytes-per-token", "4096"]


async def _engine(**settings: Any) -> FakeEngine:
    eng = FakeEngine(FakeEngineSettings(token_delay_s=0.001, **settings))
    return eng


def _flaky(eng: FakeEngine, every: int) -> dict[str, int]:
    """Make every ``every``-th generation request of ``eng`` answer 500 (an aiohttp middleware on its app)."""
    seen = {"n": 0, "failed": 0}

    @web.middleware
    async def fail_some(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path == "/v1/completions":
            seen["n"] += 1
            if seen["n"] % every == 0:
                seen["failed"] += 1
                return web.json_response({"error": {"message": "injected failure"}}, status=500)
        return await handler(request)

    eng.app.middlewares.append(fail_some)
    return seen


@pytest.mark.asyncio
async def test_the_cli_writes_a_profile_that_loads_and_that_fulcrum_plan_accepts(tmp_path: Path, capsys: Any) -> None:
    eng = await _engine(max_model_len=1024)
    url = await eng.start()
    out, cm_out = tmp_path / "p.yaml", tmp_path / "cm.yaml"
    try:
        rc = await asyncio.to_thread(main, ["profile", "--url", url, *FLAGS, "--out", str(out),
                                            "--configmap", "fake-profile", "--configmap-out", str(cm_out)])
    finally:
        await eng.stop()
    assert rc == 0, capsys.readouterr().err
    profile = load_profile(out)
    assert profile.prefill[1].isl == (16.0, 64.0, 200.0)
    assert profile.decode[1].batch == (1.0, 3.0) and profile.decode[1].context == (40.0, 120.0)
    assert profile.gpu_memory_gib == 80.0 and profile.kv_bytes_per_token == 4096
    # prompts were exact: every TTFT request (max_tokens 1) had one of the ISLs, and no two were alike
    ttft_prompts = [r["prompt"] for r in eng.requests if r["max_tokens"] == 1]
    assert sorted({len(p) for p in ttft_prompts}) == [16, 64, 200]
    assert len({tuple(p) for p in ttft_prompts}) == len(ttft_prompts)
    # TPOT prompts: context − decode_tokens / 2 tokens, requests launched concurrently with ignore_eos
    tpot = [r for r in eng.requests if r["max_tokens"] == 8]
    assert {len(r["prompt"]) for r in tpot} == {36, 116} and all(r["ignore_eos"] for r in tpot)
    capsys.readouterr()
    assert main(["plan", "--profile", str(out), "--isl", "100", "--osl", "50", "--concurrency", "4"]) == 0
    assert "P/D ratio" in capsys.readouterr().out
    cm = yaml.safe_load(cm_out.read_text())
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(cm, kubernetes_validate.latest_version(), strict=True)
    assert yaml.safe_load(cm["data"]["profile.yaml"]) == yaml.safe_load(out.read_text())


@pytest.mark.asyncio
async def test_failed_requests_are_retried_and_recorded_and_points_beyond_max_model_len_dropped(
        tmp_path: Path, capsys: Any) -> None:
    eng = await _engine(max_model_len=150)
    seen = _flaky(eng, every=7)  # 3 attempts of a 3-request batch cannot all hit a multiple of 7
    url = await eng.start()
    out = tmp_path / "p.yaml"
    try:
        rc = await asyncio.to_thread(main, ["profile", "--url", url, *FLAGS, "--isl", "16,64,100,200",
                                            "--context", "40,120,400", "--out", str(out)])
    finally:
        await eng.stop()
    err = capsys.readouterr().err
    assert rc == 0, err
    assert seen["failed"] > 0
    profile = load_profile(out)
    assert profile.prefill[1].isl == (16.0, 64.0, 100.0)  # 200 + 1 > 150: dropped
    assert profile.decode[1].context == (40.0, 120.0)  # 396 + 8 > 150: dropped
    meas = yaml.safe_load(out.read_text())["measurement"]
    failures = [f for p in meas["prefill"] + meas["decode"] for f in p.get("failures", [])]
    assert any("injected failure" in f for f in failures)
    assert all(len(p["samplesMs"]) == 2 for p in meas["prefill"] + meas["decode"] if "dropped" not in p)
    assert "needs 201 tokens > max_model_len 150; dropped" in err


@pytest.mark.asyncio
async def test_an_engine_that_fails_every_generation_ends_in_a_clear_error_not_a_crash(
        tmp_path: Path, capsys: Any) -> None:
    eng = await _engine()
    eng.mode = "error500"
    url = await eng.start()
    try:
        rc = await asyncio.to_thread(main, ["profile", "--url", url, *FLAGS, "--retries", "1", "--out",
                                            str(tmp_path / "p.yaml")])
    finally:
        await eng.stop()
    err = capsys.readouterr().err
    assert rc == 1
    assert "fulcrum profile: error: prefill: only 0 ISL point(s) measured, need at least 2" in err
    assert "every repeat failed" in err
    assert not (tmp_path / "p.yaml").exists()


@pytest.mark.asyncio
@pytest.mark.parametrize(("extra", "message"), [
    (["--batch", "4"], "--batch: need at least 2 points"),
    (["--isl", "12,abc"], "--isl: expected comma-separated integers"),
    (["--gpu", "TPU"], "--gpu 'TPU': unknown preset"),
    (["--model", "other"], "does not serve model 'other'"),
    (["--configmap", "Not_Valid"], "not a valid Kubernetes name"),
])
async def test_bad_input_exits_2_with_one_line(tmp_path: Path, capsys: Any, extra: list[str], message: str) -> None:
    eng = await _engine()
    url = await eng.start()
    try:
        rc = await asyncio.to_thread(main, ["profile", "--url", url, *FLAGS, "--out", str(tmp_path / "p.yaml"), *extra])
    finally:
        await eng.stop()
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("fulcrum profile: error:") and message in err[0]


def test_missing_memory_facts_and_an_unreachable_endpoint_exit_2_before_measuring(tmp_path: Path, capsys: Any) -> None:
    base = ["profile", "--url", "http://127.0.0.1:9", "--model", "m", "--tp", "1", "--out", str(tmp_path / "p.yaml")]
    assert main([*base, "--weight-gib", "1"]) == 2
    assert "pass --gpu (a preset) or --gpu-memory-gib" in capsys.readouterr().err
    assert main([*base, "--gpu", "H100", "--weight-gib", "1", "--kv-bytes-per-token", "1"]) == 2
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err


def test_the_step_table_mode_needs_the_scheduler_metrics_url_and_a_json_file(tmp_path: Path, capsys: Any) -> None:
    base = ["profile", "--url", "http://127.0.0.1:9", "--model", "m", "--tp", "1"]
    assert main([*base, "--step-table", str(tmp_path / "t.json")]) == 2
    assert "--scheduler-metrics" in capsys.readouterr().err
    assert main([*base, "--step-table", str(tmp_path / "t.yaml"), "--scheduler-metrics", "http://127.0.0.1:9/metrics"]) == 2
    assert ".json" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ broken engines
def _replace(eng: FakeEngine, path: str, answer: Any) -> None:
    """Make ``eng`` answer ``path`` with ``await answer(request)`` instead (an aiohttp middleware on its app)."""

    @web.middleware
    async def swap(request: web.Request, handler: Any) -> web.StreamResponse:
        return await answer(request) if request.path == path else await handler(request)

    eng.app.middlewares.append(swap)


async def _profile_cli(eng: FakeEngine, out: Path, *extra: str) -> int:
    url = await eng.start()
    try:
        return await asyncio.to_thread(main, ["profile", "--url", url, *FLAGS, "--retries", "0", "--out", str(out),
                                              *extra])
    finally:
        await eng.stop()


@pytest.mark.asyncio
@pytest.mark.parametrize("chunk", ['[1, 2]', '{"choices": ["text"]}', "null"])
async def test_stream_chunks_that_are_not_completion_objects_fail_the_point_with_a_message_not_a_traceback(
        tmp_path: Path, capsys: Any, chunk: str) -> None:
    eng = await _engine()

    async def odd_stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(f"data: {chunk}\n\ndata: [DONE]\n\n".encode())
        return resp

    _replace(eng, "/v1/completions", odd_stream)
    rc = await _profile_cli(eng, tmp_path / "p.yaml")
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err
    assert "not a JSON object" in err and not (tmp_path / "p.yaml").exists()


@pytest.mark.asyncio
async def test_a_usage_count_above_max_tokens_fails_the_point_instead_of_shrinking_its_tpot(
        tmp_path: Path, capsys: Any) -> None:
    eng = await _engine()

    async def inflated(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(body["max_tokens"]):  # claims 1000 tokens per chunk
            event = {"choices": [{"text": "a"}], "usage": {"completion_tokens": 1000 * (i + 1)}}
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    _replace(eng, "/v1/completions", inflated)
    rc = await _profile_cli(eng, tmp_path / "p.yaml")
    err = capsys.readouterr().err
    assert rc == 1 and "exceeds max_tokens" in err


@pytest.mark.asyncio
async def test_an_inter_token_histogram_whose_sum_does_not_grow_is_ignored_not_written_as_a_zero_tpot(
        tmp_path: Path, capsys: Any) -> None:
    eng = await _engine()
    scrapes = {"n": 0}

    async def broken_metrics(_: web.Request) -> web.Response:
        scrapes["n"] += 1  # the count grows, the sum falls: a broken exporter
        n = scrapes["n"]
        return web.Response(text=f"vllm:inter_token_latency_seconds_sum {-100.0 * n}\n"
                                 f"vllm:inter_token_latency_seconds_count {1000 * n}\n")

    _replace(eng, "/metrics", broken_metrics)
    out = tmp_path / "p.yaml"
    rc = await _profile_cli(eng, out)
    assert rc == 0, capsys.readouterr().err
    assert scrapes["n"] > 0
    doc = yaml.safe_load(out.read_text())
    assert min(v for row in doc["decode"][0]["tpotMs"] for v in row) >= 0.5  # the fake sleeps 1 ms a token


@pytest.mark.asyncio
@pytest.mark.parametrize(("status", "body", "needle"), [
    (500, "boom", "/v1/models answered HTTP 500: boom"),
    (200, "<html>hello</html>", "/v1/models answered non-JSON"),
])
async def test_a_models_endpoint_that_answers_badly_is_named_as_such_not_as_unreachable(
        tmp_path: Path, capsys: Any, status: int, body: str, needle: str) -> None:
    eng = await _engine()

    async def bad(_: web.Request) -> web.Response:
        return web.Response(status=status, text=body)

    _replace(eng, "/v1/models", bad)
    rc = await _profile_cli(eng, tmp_path / "p.yaml")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert needle in err[0] and "cannot reach" not in err[0]


@pytest.mark.asyncio
async def test_a_models_endpoint_that_never_answers_times_out_with_the_request_timeout(
        tmp_path: Path, capsys: Any) -> None:
    eng = await _engine()

    async def silent(_: web.Request) -> web.Response:
        await asyncio.sleep(60)
        return web.Response(text="{}")

    _replace(eng, "/v1/models", silent)
    rc = await _profile_cli(eng, tmp_path / "p.yaml", "--request-timeout-s", "0.5")
    err = capsys.readouterr().err
    assert rc == 2 and "did not answer within 0.5 s" in err


@pytest.mark.asyncio
async def test_an_output_folder_that_vanishes_mid_run_loses_nothing_the_profile_is_saved_elsewhere(
        tmp_path: Path, capsys: Any, monkeypatch: Any, spare_tmpdir: Path) -> None:
    import shutil

    eng = await _engine()
    folder = tmp_path / "out"
    folder.mkdir()

    @web.middleware
    async def remove_folder(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path == "/v1/completions":
            shutil.rmtree(folder, ignore_errors=True)
        return await handler(request)

    eng.app.middlewares.append(remove_folder)
    rc = await _profile_cli(eng, folder / "p.yaml")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("fulcrum profile: error: --out ")
    saved = list(spare_tmpdir.glob("fulcrum-profile-*.yaml"))
    assert len(saved) == 1 and str(saved[0]) in err[-1]
    assert load_profile(saved[0]).prefill[1].isl == (16.0, 64.0, 200.0)


@pytest.mark.asyncio
async def test_an_older_profile_is_replaced_whole_never_half_written(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "p.yaml"
    out.write_text("old: profile\n")
    rc = await _profile_cli(await _engine(), out)
    assert rc == 0, capsys.readouterr().err
    assert load_profile(out).prefill[1].isl == (16.0, 64.0, 200.0)
    assert [p.name for p in tmp_path.iterdir()] == ["p.yaml"]  # no temporary file left behind


def test_a_step_table_whose_folder_vanished_is_kept_in_the_temporary_folder(
        tmp_path: Path, spare_tmpdir: Path) -> None:
    from fulcrum.commands.profile import _save_or_keep
    from fulcrum.worker.latency_table import StepLatencyTable

    table = StepLatencyTable()
    table.record(128, 128, 2, 0.05)
    gone = tmp_path / "gone" / "steps.json"
    with pytest.raises(OSError, match=r"^--step-table .*steps\.json: cannot write \(No such file or directory\); "
                                      r"saved to .*fulcrum-step-table-.*\.json instead$") as err:
        _save_or_keep(str(gone), "--step-table", "fulcrum-step-table-", table.save)
    saved = list(spare_tmpdir.glob("fulcrum-step-table-*.json"))
    assert len(saved) == 1 and str(saved[0]) in str(err.value)
    assert StepLatencyTable.load(saved[0]).to_dict() == table.to_dict()


# ------------------------------------------------------------------------------------------------ hung engines, Ctrl-C
def _hang_decodes(eng: FakeEngine, *, after: int = 0, prompt_len: int | None = None) -> dict[str, int]:
    """Make ``eng`` never answer TPOT requests (``max_tokens`` 8): those after the first ``after`` of them, or only
    those whose prompt has ``prompt_len`` tokens (an aiohttp middleware; the fake cancels the sleep when the
    client goes away)."""
    seen = {"decodes": 0, "hung": 0}

    @web.middleware
    async def hang(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path == "/v1/completions":
            body = await request.json()
            if body.get("max_tokens") == 8:
                seen["decodes"] += 1
                if seen["decodes"] > after and (prompt_len is None or len(body["prompt"]) == prompt_len):
                    seen["hung"] += 1
                    await asyncio.sleep(3600)
        return await handler(request)

    eng.app.middlewares.append(hang)
    return seen


# FLAGS with a third batch: (1, 3) × (40, 120) is the first complete grid, measured with 2 × (1 + 1 + 3 + 3) = 16
# TPOT requests; batch 5 comes after it
WIDE = ["--batch", "1,3,5", "--context", "40,120"]


@pytest.mark.asyncio
async def test_a_point_the_engine_never_answers_is_abandoned_after_its_budget_not_after_every_request_timeout(
        tmp_path: Path, capsys: Any) -> None:
    import time

    eng = await _engine()
    seen = _hang_decodes(eng, prompt_len=116)  # context 120: prompt 120 − 8/2 tokens; context 40 and 80 answer
    out = tmp_path / "p.yaml"
    t0 = time.monotonic()
    # before: 2 points × 2 repeats × 3 attempts × the 20 s request timeout = 4 minutes
    rc = await _profile_cli(eng, out, "--context", "40,80,120", "--retries", "2", "--request-timeout-s", "20",
                            "--point-timeout-s", "0.5")
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert rc == 0, err
    assert took < 15, took
    assert seen["hung"] >= 2
    assert "decode batch 1 context 120: every repeat failed (point budget of 0.5 s spent (--point-timeout-s) after 0 of 2 " \
           "repeat(s); abandoned); skipped" in err
    assert load_profile(out).decode[1].context == (40.0, 80.0)  # the abandoned column is cut from the grid
    meas = yaml.safe_load(out.read_text())["measurement"]
    assert "partial" not in meas
    hung = [p for p in meas["decode"] if p["key"][1] == 120]
    assert len(hung) == 2 and all("abandoned" in p["failures"][-1] and "samplesMs" not in p for p in hung)


@pytest.mark.asyncio
async def test_an_engine_that_stops_answering_stops_the_run_and_keeps_what_was_measured(
        tmp_path: Path, capsys: Any) -> None:
    import time

    eng = await _engine()
    _hang_decodes(eng, after=16)  # batch 5 and later hang
    out = tmp_path / "p.yaml"
    out.write_text("old: profile\n")
    t0 = time.monotonic()
    rc = await _profile_cli(eng, out, "--batch", "1,3,5,7", "--request-timeout-s", "20", "--point-timeout-s", "0.3",
                            "--stop-after-timeouts", "2")
    took = time.monotonic() - t0
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1, err
    assert took < 15, took
    partial = tmp_path / "p.partial.yaml"
    assert err[-1].startswith("fulcrum profile: error: the engine stopped answering (2 points in a row failed by "
                              "timeout or a refused connection, the last decode batch 5 context 120); partial profile "
                              "written to " + str(partial))
    # the abandoned points (batch 5) are named beside those never reached (batch 7); before: only batch 7
    assert err[-1].endswith("7 of 11 points measured, not measured: decode batch 5 context 40, decode batch 5 context "
                            "120, decode batch 7 context 40, decode batch 7 context 120")
    assert out.read_text() == "old: profile\n"  # an older profile is not replaced by a partial one
    profile = load_profile(partial)
    assert profile.decode[1].batch == (1.0, 3.0) and profile.decode[1].context == (40.0, 120.0)
    assert "PARTIAL: the engine stopped answering" in profile.source
    text = partial.read_text()
    assert text.startswith("# PARTIAL: the engine stopped answering")
    meas = yaml.safe_load(text)["measurement"]
    assert meas["partial"] is True and meas["stopped"].startswith("the engine stopped answering")
    assert meas["notMeasured"] == {"prefill": [], "decode": [[5, 40], [5, 120], [7, 40], [7, 120]]}
    assert [w for w in meas["warnings"] if w.startswith("decode batch 5 ")] == [
        "decode batch 5 context 40: every repeat failed (point budget of 0.3 s spent (--point-timeout-s) after 0 of 2 "
        "repeat(s); abandoned); skipped",
        "decode batch 5 context 120: every repeat failed (point budget of 0.3 s spent (--point-timeout-s) after 0 of 2 "
        "repeat(s); abandoned); skipped"]


@pytest.mark.asyncio
async def test_an_engine_that_dies_stops_the_run_and_keeps_what_was_measured_not_a_cut_profile_over_out(
        tmp_path: Path, capsys: Any) -> None:
    # a dead engine refuses connections at once: before, no point counted as "stopped answering", the run walked the
    # rest of the grid and ended rc 0, writing a silently cut profile over an older --out (seen against a killed
    # sim-worker)
    eng = await _engine()
    seen = {"decodes": 0}

    @web.middleware
    async def die(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path == "/v1/completions" and (await request.json()).get("max_tokens") == 8:
            seen["decodes"] += 1
            if seen["decodes"] == 17:  # after the first complete grid (batch 1 and 3): the engine dies
                asyncio.get_running_loop().create_task(eng.stop())
        return await handler(request)

    eng.app.middlewares.append(die)
    out = tmp_path / "p.yaml"
    out.write_text("old: profile\n")
    rc = await _profile_cli(eng, out, "--batch", "1,3,5,7", "--request-timeout-s", "20", "--stop-after-timeouts", "2")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1, err
    assert err[-1].startswith("fulcrum profile: error: the engine stopped answering (2 points in a row failed by "
                              "timeout or a refused connection")
    assert out.read_text() == "old: profile\n"
    partial = tmp_path / "p.partial.yaml"
    assert load_profile(partial).decode[1].batch == (1.0, 3.0)


def _interrupt_after(monkeypatch: pytest.MonkeyPatch, streams: int) -> None:
    """Ctrl-C in the profiler: its ``streams + 1``-th streamed request raises KeyboardInterrupt (as a SIGINT does
    where Python delivers it; the CLI runs in a worker thread here, where no signal arrives)."""
    from fulcrum.worker import profiler

    real = profiler._Client.stream
    calls = {"n": 0}

    async def stream(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] > streams:
            raise KeyboardInterrupt
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(profiler._Client, "stream", stream)


@pytest.mark.asyncio
async def test_ctrl_c_writes_what_was_measured_as_a_partial_profile_and_exits_130(
        tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    eng = await _engine()
    _interrupt_after(monkeypatch, 1 + 6 + 16)  # warm-up, 3 ISLs × 2 repeats, then the (1, 3) × (40, 120) grid
    out = tmp_path / "p.yaml"
    out.write_text("old: profile\n")
    rc = await _profile_cli(eng, out, *WIDE, "--configmap", "fake-profile", "--configmap-out", str(tmp_path / "cm.yaml"))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 130, err
    partial = tmp_path / "p.partial.yaml"
    assert err[-1] == (f"fulcrum profile: interrupted: interrupted (Ctrl-C); partial profile written to {partial} "
                       "(no ConfigMap: the profile is partial); PARTIAL: interrupted (Ctrl-C); 7 of 9 points measured, "
                       "not measured: decode batch 5 context 40, decode batch 5 context 120")
    assert out.read_text() == "old: profile\n" and not (tmp_path / "cm.yaml").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.partial.yaml", "p.yaml"]  # no temporary file left
    profile = load_profile(partial)
    assert profile.prefill[1].isl == (16.0, 64.0, 200.0)
    assert profile.decode[1].batch == (1.0, 3.0) and profile.decode[1].context == (40.0, 120.0)
    meas = yaml.safe_load(partial.read_text())["measurement"]
    assert meas["partial"] is True and meas["stopped"] == "interrupted (Ctrl-C)"
    assert meas["notMeasured"]["decode"] == [[5, 40], [5, 120]]
    # the plan accepts it
    capsys.readouterr()
    assert main(["plan", "--profile", str(partial), "--isl", "100", "--osl", "50", "--concurrency", "2"]) == 0


@pytest.mark.asyncio
async def test_ctrl_c_before_a_profile_was_measured_says_nothing_was_kept_and_why(
        tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    eng = await _engine()
    _interrupt_after(monkeypatch, 1 + 6 + 2)  # the ISL sweep and one decode point
    rc = await _profile_cli(eng, tmp_path / "p.yaml", *WIDE)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 130
    assert err[-1].startswith("fulcrum profile: interrupted: interrupted (Ctrl-C); nothing kept: too little measured "
                              "for a profile (decode: the complete measured grid has 1 batch(es) × 1 context(s)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.asyncio
async def test_a_real_sigint_mid_run_keeps_the_measured_points_and_exits_130(tmp_path: Path) -> None:
    eng = await _engine()
    seen = _hang_decodes(eng, after=16)  # the run waits on batch 5 until interrupted
    url = await eng.start()
    out = tmp_path / "p.yaml"
    try:
        rc, err = await interrupt_when(["profile", "--url", url, *FLAGS, *WIDE, "--retries", "0", "--out", str(out)],
                                       lambda: bool(seen["hung"]), "the hung point")
    finally:
        await eng.stop()
    assert rc == 130, err
    assert "Traceback" not in err
    partial = tmp_path / "p.partial.yaml"
    assert f"partial profile written to {partial}" in err.strip().splitlines()[-1]
    assert load_profile(partial).decode[1].batch == (1.0, 3.0)
    assert not out.exists()


def test_the_point_budget_defaults_to_one_more_request_timeout_than_repeats_and_must_be_positive() -> None:
    grid = ProfileGrid(isl=(1, 2), batch=(1, 2), context=(8, 16), repeats=3, request_timeout_s=300)
    assert grid.point_budget_s == 1200 and grid.stop_after_timeouts == 3
    assert ProfileGrid(isl=(1, 2), batch=(1, 2), context=(8, 16), point_timeout_s=5).point_budget_s == 5
    with pytest.raises(ProfileError, match="--point-timeout-s must be a positive number"):
        ProfileGrid(isl=(1, 2), batch=(1, 2), context=(8, 16), point_timeout_s=0)
    with pytest.raises(ProfileError, match="--stop-after-timeouts must be >= 0"):
        ProfileGrid(isl=(1, 2), batch=(1, 2), context=(8, 16), stop_after_timeouts=-1)


def test_the_log_of_an_interrupted_run_marks_the_points_not_reached_and_keeps_the_point_in_progress() -> None:
    grid = ProfileGrid(isl=(128, 512), batch=(1, 4), context=(128, 512), repeats=3)
    log = MeasureLog(endpoint=EndpointFacts(max_model_len=4096), prefill=[_pre(128, 30), _pre(512, 60)],
                     decode=[_dec(1, 128, 10)], current=_dec(1, 512, 12, 13))
    m = log.measurements(2, grid, stopped="interrupted (Ctrl-C)")
    assert [p.key for p in m.decode] == [(1, 128), (1, 512), (4, 128), (4, 512)]
    assert m.decode[1].samples == (0.012, 0.013) and "after 2 of 3 repeat(s)" in m.decode[1].failures[-1]
    assert [p.key for p in m.unmeasured] == [(4, 128), (4, 512)]
    assert m.unmeasured[0].dropped == "not measured: interrupted (Ctrl-C)" and not m.unmeasured[0].ok
    # a point in progress with no repeat measured yet is not reached; a complete run has nothing unmeasured
    assert (1, 512) in [p.key for p in MeasureLog(prefill=log.prefill, decode=log.decode,
                                                  current=PointResult("decode", (1, 512))).measurements(2, grid, "x").unmeasured]
    assert MeasureLog(prefill=log.prefill, decode=_grid_points()).measurements(
        2, ProfileGrid(isl=(128, 512), batch=(1, 4), context=(128, 512))).unmeasured == ()


def test_the_partial_note_names_points_readably_and_lists_the_abandoned_ones_beside_those_never_reached() -> None:
    grid = ProfileGrid(isl=(128, 512), batch=(1, 4), context=(128, 512), repeats=3)
    abandoned = PointResult("prefill", (512,), failures=("attempt 3: HTTP 500: boom",))
    m = MeasureLog(prefill=[_pre(128, 30), abandoned], decode=[_dec(1, 128, 10)]).measurements(
        2, grid, stopped="interrupted (Ctrl-C)")
    # before: "2 of 6 points reached" (sic: 3 were) and "not measured: decode (1, 512), decode (4, 128), ..."
    assert partial_note(m) == ("PARTIAL: interrupted (Ctrl-C); 2 of 6 points measured, not measured: prefill ISL 512, "
                               "decode batch 1 context 512, decode batch 4 context 128, decode batch 4 context 512")
    assert point_name("prefill", (128,)) == "prefill ISL 128"
    assert point_name("decode", (8, 1024)) == "decode batch 8 context 1024"
    assert partial_note(MeasureLog(prefill=[_pre(128, 30)]).measurements(2, grid)) == ""
