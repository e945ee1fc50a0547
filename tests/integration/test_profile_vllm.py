"""``fulcrum profile`` against ONE real vLLM CPU engine (the tiny model of tiny_model.py), small grid.

Checks what the fake engine cannot: vLLM's ``/tokenize`` gives exact prompt lengths, vLLM's ``/v1/models`` and
``vllm:cache_config_info`` supply ``max_model_len``, block size and KV capacity, the written profile loads and
``fulcrum plan`` accepts it, and TTFT measured on a real engine grows with the ISL.

Opt-in: ``flock /tmp/fulcrum-vllm.lock python -m pytest -m vllm tests/integration/test_profile_vllm.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from fulcrum.cli import main
from fulcrum.ratio.profile import load_profile

from .engines import BLOCK_SIZE, Engine, EngineSpec, build_tiny_model, skip_unless_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """One engine without a KV connector (profiling measures one instance), stopped after the module."""
    skip_unless_vllm(request.config)
    work = tmp_path_factory.mktemp("vllm-profile")
    model = build_tiny_model(work / "tiny-model")
    with Engine(EngineSpec("profiled", cpu=0, kv_role=None, max_model_len=2048), model, work) as eng:
        yield eng


def test_a_profile_measured_on_a_real_engine_loads_is_planned_with_and_ttft_grows_with_isl(
        engine: Engine, tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "tiny.yaml"
    rc = main(["profile", "--url", engine.url, "--model", "tiny", "--tp", "1",
               "--isl", "32,512,2000", "--batch", "1,4", "--context", "64,256,3000",
               "--repeats", "3", "--decode-tokens", "16", "--no-progress", "--out", str(out),
               "--model-path", str(engine.model_dir), "--gpu-type", "cpu",
               "--gpu-memory-gib", "8", "--hbm-bandwidth-gbps", "50"])
    err = capsys.readouterr().err
    assert rc == 0, err
    profile = load_profile(out)
    doc = yaml.safe_load(out.read_text())
    meas = doc["measurement"]
    # what vLLM reported about itself was read
    assert meas["endpoint"]["maxModelLen"] == 2048
    assert meas["endpoint"]["blockSize"] == BLOCK_SIZE
    assert meas["endpoint"]["kvCapacityTokens"] > 0
    assert meas["memorySources"]["kv_bytes_per_token"].startswith("model dir config.json")
    assert "calibrated" in meas["memorySources"]["activation_reserve_gib"]
    assert profile.kv_bytes_per_token == 2 * 2 * 2 * 32 * 4  # float32, 2 layers, 2 KV heads, head dim 32
    assert profile.kv_capacity_tokens(1) == pytest.approx(meas["endpoint"]["kvCapacityTokens"], rel=1e-6)
    # context 3000 exceeds max_model_len 2048: dropped with a warning, the rest of the grid kept
    assert "max_model_len 2048; dropped" in err
    assert profile.decode[1].context == (64.0, 256.0) and profile.decode[1].batch == (1.0, 4.0)
    # TTFT grows with ISL in what was measured (raw medians, before any envelope)
    medians = {p["key"][0]: p["medianMs"] for p in meas["prefill"]}
    assert medians[2000] > medians[32], medians
    # decode steps are milliseconds on this CPU engine: a per-token time near 0 would mean bunched chunks were
    # read as single gaps (the API server forwards a tiny model's tokens in bursts)
    assert all(p["medianMs"] > 0.5 for p in meas["decode"] if "medianMs" in p), meas["decode"]
    capsys.readouterr()
    assert main(["plan", "--profile", str(out), "--isl", "200", "--osl", "50", "--concurrency", "8"]) == 0
    assert "P/D ratio" in capsys.readouterr().out
