"""``fulcrum worker`` leftovers: the chunked-prefill budget rule shared by the LLMServe model and ``WorkerConfig``,
``--disable-log-stats`` refused among the extra vLLM arguments, port collisions with ``--health-port``, and a
health port in use named by its flag."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from fulcrum.cli import main
from fulcrum.errors import SpecError
from fulcrum.worker.vllm_args import WorkerConfig

REPO = Path(__file__).resolve().parents[2]


def parse_engine(engine: dict[str, object]) -> Any:
    from fulcrum.api import parse_llmserve
    return parse_llmserve({"spec": {"model": {"name": "m"}, "engine": engine}}).spec.engine


# ------------------------------------------------------------------ 1. chunked prefill off, budget below max-model-len
@pytest.mark.parametrize("off", ["--no-enable-chunked-prefill", "--no_enable_chunked_prefill"])
def test_the_worker_refuses_a_budget_below_max_model_len_with_chunked_prefill_off(off: str) -> None:
    """vLLM's SchedulerConfig refuses max_num_batched_tokens < max_model_len without chunked prefill: the engine
    would exit at start. The LLMServe model refused it already; ``fulcrum worker`` now does too."""
    with pytest.raises(SpecError, match=r"--max-num-batched-tokens 8192 is below --max-model-len 16384 while an "
                                        r"extra vLLM argument turns chunked prefill off: vLLM then requires "
                                        r"max_num_batched_tokens >= max_model_len \(raise --max-num-batched-tokens, "
                                        r"lower --max-model-len, or keep chunked prefill\)"):
        WorkerConfig(model="m", max_model_len=16384, extra_args=(off,))


@pytest.mark.parametrize("kwargs", [
    {"max_model_len": 16384},  # chunked prefill on (vLLM's default)
    {"max_model_len": 8192, "extra_args": ("--no-enable-chunked-prefill",)},  # = the budget
    {"max_model_len": 16384, "extra_args": ("--no-enable-chunked-prefill", "--enable-chunked-prefill")},  # last wins
    {"extra_args": ("--no-enable-chunked-prefill",)},  # --max-model-len not given: the model's, unknown here
])
def test_the_worker_takes_budgets_vllm_takes(kwargs: dict[str, Any]) -> None:
    assert WorkerConfig(model="m", **kwargs).max_num_batched_tokens == 8192


def test_the_cli_refuses_it_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["worker", "--model", "m", "--device", "cpu", "--max-model-len", "16384", "--max-num-batched-tokens",
               "4096", "--", "--no-enable-chunked-prefill"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and "--max-num-batched-tokens 4096 is below --max-model-len 16384" in err[0], err


def test_the_model_and_the_worker_share_one_rule() -> None:
    """One check, two vocabularies: field names in the spec, flag names on the CLI."""
    from fulcrum.api.llmserve import (SPEC_BATCH_LIMIT_NAMES, WORKER_BATCH_LIMIT_NAMES, chunked_prefill,
                                      chunked_prefill_off_problem)
    assert chunked_prefill([]) and not chunked_prefill(["--no-enable-chunked-prefill"])
    assert chunked_prefill(["--no-enable-chunked-prefill", "--enable-chunked-prefill"])
    spec = chunked_prefill_off_problem(4096, 8192, ["--no-enable-chunked-prefill"], SPEC_BATCH_LIMIT_NAMES)
    assert spec is not None and spec.startswith("maxNumBatchedTokens 4096 is below maxModelLen 8192 while extraArgs "
                                                "turns chunked prefill off")
    cli = chunked_prefill_off_problem(4096, 8192, ["--no-enable-chunked-prefill"], WORKER_BATCH_LIMIT_NAMES)
    assert cli is not None and cli.startswith("--max-num-batched-tokens 4096 is below --max-model-len 8192")
    assert chunked_prefill_off_problem(4096, None, ["--no-enable-chunked-prefill"], WORKER_BATCH_LIMIT_NAMES) is None
    assert chunked_prefill_off_problem(4096, 8192, [], SPEC_BATCH_LIMIT_NAMES) is None


# ------------------------------------------------------------------ 2. --disable-log-stats
@pytest.mark.parametrize("arg", ["--disable-log-stats", "--disable_log_stats", "--disable-log-st"])
def test_the_worker_refuses_disable_log_stats_and_says_why(arg: str) -> None:
    """Without vLLM's stat loggers /metrics has no vllm:num_requests_* gauges: the drain cannot see the engine idle
    (it always runs to --drain-timeout-s) and the router's load view loses them."""
    with pytest.raises(SpecError, match=r"extra vLLM argument .*--disable-log-stats.* vllm:num_requests_\* gauges"):
        WorkerConfig(model="m", extra_args=("--enforce-eager", arg))


def test_the_cli_refuses_disable_log_stats_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["worker", "--model", "m", "--device", "cpu", "--", "--disable-log-stats"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and "--disable-log-stats" in err[0] and "drain" in err[0], err


@pytest.mark.parametrize("arg", ["--disable-log-stats", "--disable_log_stats"])
def test_the_llmserve_model_refuses_disable_log_stats_and_says_why(arg: str) -> None:
    with pytest.raises(SpecError, match=r"spec\.engine\.extraArgs: .*--disable-log-stats.* vllm:num_requests_\* "
                                        r"gauges"):
        parse_engine({"extraArgs": [arg]})


def test_no_shipped_example_chart_or_fixture_passes_disable_log_stats() -> None:
    """Only the code that refuses the flag (and the worker's --help), the docs, the generated CRDs (their extraArgs
    description) and the tests that speak of it name it; no example, chart value, image entrypoint, e2e setup or
    fixture passes it."""
    allowed = {"src/fulcrum/api/llmserve.py", "worker/vllm_args.py", "worker/supervisor.py",
               "src/fulcrum/commands/worker.py",
               "tests/unit/test_worker_supervisor_stop.py", Path(__file__).resolve().relative_to(REPO).as_posix(),
               "crds/llmserve.yaml", "charts/fulcrum/crds/llmserve.yaml"}
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    hits = []
    for name in files:
        path = REPO / name
        if name in allowed or name.startswith("docs/") or not path.is_file() or path.stat().st_size > 2_000_000:
            continue
        if "disable-log-stats" in path.read_text(errors="replace").replace("_", "-"):
            hits.append(name)
    assert hits == []


# ------------------------------------------------------------------ 3. ports the worker binds
@pytest.mark.parametrize(("flags", "message"), [
    (["--health-port", "18123", "--scheduler-metrics-port", "18123"],
     "--health-port 18123 collides with --scheduler-metrics-port 18123: give each its own port"),
    (["--health-port", "8000"], "--health-port 8000 collides with --port 8000: give each its own port"),
    (["--health-port", "5600"], "--health-port 5600 collides with --nixl-port 5600: give each its own port"),
])
def test_the_cli_refuses_a_health_port_another_port_of_the_worker_uses(
        flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["worker", "--model", "m", "--device", "cpu", "--vllm-python", "/nonexistent/python", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err == [f"fulcrum worker: error: {message}"]


def test_the_engine_ports_collide_with_each_other_as_before() -> None:
    with pytest.raises(SpecError, match=r"--scheduler-metrics-port must differ from --port and --nixl-port"):
        WorkerConfig(model="m", scheduler_metrics_port=8000)
    with pytest.raises(SpecError, match=r"--port and --nixl-port must differ"):
        WorkerConfig(model="m", port=5600)


# ------------------------------------------------------------------ 4. health port in use
def test_a_health_port_in_use_is_named_by_its_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        rc = main(["worker", "--model", "m", "--device", "cpu", "--vllm-python", "/nonexistent/python",
                   "--health-port", str(port), "--log-level", "error"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1, err
    assert err[0].startswith(f"fulcrum worker: error: --health-port {port}: cannot listen on 0.0.0.0:{port}: "), err
    assert "address already in use" in err[0] and "[Errno" not in err[0], err
