"""``fulcrum worker``'s vLLM command line and environment (fulcrum.worker.vllm_args), and its bad-input errors."""

from __future__ import annotations

import json

import pytest

from fulcrum.cli import main
from fulcrum.errors import SpecError
from fulcrum.worker.vllm_args import (
    MANAGED_FLAGS,
    SLO_SCHEDULER_CLS,
    WorkerConfig,
    instance_record,
    resolve_device,
    vllm_argv,
    vllm_env,
)

PY = "/opt/vllm/bin/python"


def flag(argv: list[str], name: str) -> str:
    """The value after ``name`` in ``argv`` (fails when the flag is absent or repeated)."""
    assert argv.count(name) == 1, f"{name} appears {argv.count(name)} times in {argv}"
    return argv[argv.index(name) + 1]


def kv_config(argv: list[str]) -> dict[str, str]:
    return dict(json.loads(flag(argv, "--kv-transfer-config")))


def test_the_engine_runs_as_vllms_openai_server_module_with_every_managed_flag() -> None:
    c = WorkerConfig(model="/models/llama", served_model_name="llama", tp=2, port=8100, max_model_len=4096,
                     block_size=16, max_num_seqs=128, max_num_batched_tokens=2048)
    argv = vllm_argv(c, PY)
    assert argv[:3] == [PY, "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(argv, "--model") == "/models/llama"
    assert flag(argv, "--served-model-name") == "llama"
    assert flag(argv, "--tensor-parallel-size") == "2"
    assert (flag(argv, "--host"), flag(argv, "--port")) == ("0.0.0.0", "8100")
    assert flag(argv, "--max-model-len") == "4096"
    assert flag(argv, "--block-size") == "16"
    assert flag(argv, "--max-num-seqs") == "128"
    assert flag(argv, "--max-num-batched-tokens") == "2048"
    assert "--enable-prefix-caching" in argv


def test_the_served_name_defaults_to_the_model_and_unset_lengths_are_left_to_vllm() -> None:
    argv = vllm_argv(WorkerConfig(model="meta/llama"), PY)
    assert flag(argv, "--served-model-name") == "meta/llama"
    assert "--max-model-len" not in argv and "--block-size" not in argv


@pytest.mark.parametrize(("role", "kv_role"), [("both", "kv_both"), ("prefill", "kv_producer"),
                                                ("decode", "kv_consumer")])
def test_each_role_gets_its_nixl_kv_role(role: str, kv_role: str) -> None:
    c = WorkerConfig(model="m", role=role, device="cuda")  # type: ignore[arg-type]
    assert kv_config(vllm_argv(c, PY)) == {"kv_connector": "NixlConnector", "kv_role": kv_role,
                                           "kv_buffer_device": "cuda"}


def test_the_kv_buffer_lives_on_the_cpu_when_the_engine_does() -> None:
    assert kv_config(vllm_argv(WorkerConfig(model="m", device="cpu"), PY))["kv_buffer_device"] == "cpu"


def test_without_a_kv_connector_there_is_no_transfer_config_and_no_nixl_environment() -> None:
    c = WorkerConfig(model="m", kv_connector="none", scheduler="vllm")
    assert "--kv-transfer-config" not in vllm_argv(c, PY)
    assert vllm_env(c) == {}


def test_nixl_side_channel_is_published_at_the_pod_ip_and_port() -> None:
    env = vllm_env(WorkerConfig(model="m", nixl_host="10.1.2.3", nixl_port=5601, scheduler="vllm"))
    assert env == {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.1.2.3", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5601"}


def test_fulcrum_scheduler_plugs_the_slo_aware_class_and_carries_the_tpot_slo() -> None:
    c = WorkerConfig(model="m", scheduler="fulcrum", tpot_slo_ms=40.0)
    assert flag(vllm_argv(c, PY), "--scheduler-cls") == SLO_SCHEDULER_CLS
    assert vllm_env(c)["FULCRUM_TPOT_SLO_MS"] == "40"


def test_vllm_scheduler_leaves_vllms_own_and_sets_no_slo() -> None:
    c = WorkerConfig(model="m", scheduler="vllm", tpot_slo_ms=40.0)
    assert "--scheduler-cls" not in vllm_argv(c, PY)
    assert "FULCRUM_TPOT_SLO_MS" not in vllm_env(c)


def test_extra_arguments_are_appended_verbatim_and_last() -> None:
    extra = ("--enforce-eager", "--dtype", "float32", '--compilation-config={"level": 0}')
    argv = vllm_argv(WorkerConfig(model="m", extra_args=extra), PY)
    assert tuple(argv[-len(extra):]) == extra


@pytest.mark.parametrize("extra", [("--port", "9"), ("--port=9",), ("--model", "x"), ("-tp", "4"),
                                   ("--kv-transfer-config", "{}"), ("--scheduler-cls", "x.Y")])
def test_an_extra_argument_that_repeats_a_managed_flag_is_refused_with_the_flag_to_use(extra: tuple[str, ...]) -> None:
    with pytest.raises(SpecError, match=r"is set by fulcrum worker: use --"):
        WorkerConfig(model="m", extra_args=extra)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"model": ""}, "--model is required"),
    ({"tp": 0}, "--tp must be >= 1"),
    ({"port": 70000}, "--port must be in 1..65535"),
    ({"port": 5600, "nixl_port": 5600}, "must differ"),
    ({"max_num_seqs": 0}, "--max-num-seqs must be >= 1"),
    ({"role": "router"}, "--role must be prefill, decode or both"),
    ({"role": "decode", "kv_connector": "none"}, "needs a KV connector"),
    ({"device": "cpu", "block_size": 16}, "multiple of 32 on the CPU"),
    ({"tpot_slo_ms": 0.0}, "--tpot-slo-ms must be > 0"),
])
def test_a_config_that_cannot_run_is_refused_with_the_reason(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"model": "m", **kwargs}
    with pytest.raises(SpecError, match=message):
        WorkerConfig(**args)  # type: ignore[arg-type]


def test_device_auto_follows_the_gpu_and_cuda_without_one_is_an_error() -> None:
    assert resolve_device("auto", gpu_visible=True) == "cuda"
    assert resolve_device("auto", gpu_visible=False) == "cpu"
    assert resolve_device("cpu", gpu_visible=True) == "cpu"
    with pytest.raises(SpecError, match="no GPU is visible"):
        resolve_device("cuda", gpu_visible=False)
    with pytest.raises(SpecError, match="auto, cpu or cuda"):
        resolve_device("tpu", gpu_visible=True)


def test_the_registration_record_names_the_engines_url_nixl_channel_and_limits() -> None:
    c = WorkerConfig(model="/m", served_model_name="llama", tp=4, port=8000, role="decode", pool="decode-tp4",
                     gpu_type="H100", nixl_host="10.0.0.7", nixl_port=5600, max_num_seqs=64,
                     max_num_batched_tokens=1024)
    r = instance_record(c, instance_id="llama-decode-0", address="10.0.0.7", kv_capacity_tokens=123_456)
    assert (r.id, r.url, r.role, r.pool, r.tp, r.gpu_type) == (
        "llama-decode-0", "http://10.0.0.7:8000", "decode", "decode-tp4", 4, "H100")
    assert (r.nixl_host, r.nixl_port, r.max_concurrency, r.max_num_batched_tokens) == ("10.0.0.7", 5600, 64, 1024)
    assert (r.kv_capacity_tokens, r.model) == (123_456, "llama")


def test_an_ipv6_pod_address_is_bracketed_and_no_connector_publishes_no_nixl_channel() -> None:
    r = instance_record(WorkerConfig(model="m", kv_connector="none"), instance_id="w", address="fd00::5")
    assert r.url == "http://[fd00::5]:8000"
    assert (r.nixl_host, r.nixl_port) == ("", 0)


@pytest.mark.parametrize(("argv", "message"), [
    (["worker", "--model", "m", "--tp", "0"], "--tp must be >= 1"),
    (["worker", "--model", "m", "--etcd", "etcd:x"], "port is not an integer"),
    (["worker", "--model", "m", "--etcd", "etcd:2379"], "--etcd needs --llmserve"),
    (["worker", "--model", "m", "--health-port", "8000"], "collides"),
    (["worker", "--model", "m", "--", "--port", "1"], "use --port instead"),
])
def test_the_cli_answers_bad_input_with_exit_2_and_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FULCRUM_LLMSERVE", raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fulcrum worker: error:") and message in err[0]


def test_prefix_pulls_turn_on_nixl_bidirectional_transfers() -> None:
    """BanaServe §4.2 prefix pulls: another instance's request loads a cached prefix from this engine (vLLM NIXL
    ``bidirectional_kv_xfer``); a worker without a KV connector cannot offer it."""
    on = json.loads(flag(vllm_argv(WorkerConfig(model="m", kv_prefix_pull=True), PY), "--kv-transfer-config"))
    assert on["kv_connector_extra_config"] == {"bidirectional_kv_xfer": True}
    off = json.loads(flag(vllm_argv(WorkerConfig(model="m"), PY), "--kv-transfer-config"))
    assert "kv_connector_extra_config" not in off
    with pytest.raises(SpecError, match="--kv-prefix-pull needs --kv-connector nixl"):
        WorkerConfig(model="m", kv_prefix_pull=True, kv_connector="none")


def test_the_scheduler_metrics_port_reaches_the_engine_core_only_with_fulcrums_scheduler() -> None:
    """``fulcrum_scheduler_*`` (the budget, step times and latency table) are served from the engine-core process
    on the port the worker names; vLLM's own scheduler has none to serve."""
    env = vllm_env(WorkerConfig(model="m", scheduler_metrics_port=8002))
    assert env["FULCRUM_SCHEDULER_METRICS_PORT"] == "8002"
    assert "FULCRUM_SCHEDULER_METRICS_PORT" not in vllm_env(WorkerConfig(model="m", scheduler="vllm",
                                                                        scheduler_metrics_port=8002))
    assert "FULCRUM_SCHEDULER_METRICS_PORT" not in vllm_env(WorkerConfig(model="m"))
    with pytest.raises(SpecError, match="--scheduler-metrics-port must differ"):
        WorkerConfig(model="m", scheduler_metrics_port=8000)
    with pytest.raises(SpecError, match="--scheduler-metrics-port must be in 1..65535"):
        WorkerConfig(model="m", scheduler_metrics_port=0)


@pytest.mark.parametrize("extra", [("--tensor_parallel_size", "4"), ("--tensor-parallel=4",), ("--max_model_len=9",),
                                   ("--kv-transfer-config.kv_role=kv_both",), ("--served-model", "x")])
def test_an_extra_argument_is_read_as_vllm_reads_it_underscores_abbreviations_and_dotted_fields(
        extra: tuple[str, ...]) -> None:
    with pytest.raises(SpecError, match=r"is set by fulcrum worker: use --"):
        WorkerConfig(model="m", extra_args=extra)


@pytest.mark.parametrize(("extra", "message"), [
    (("--dtype half",), "whitespace in the flag: write the flag and its value as two items"),
    (("--port 9",), "whitespace in the flag"),
    (("",), "item 0 is empty"),
    (("--dtype=half", " "), "item 1 is empty"),
])
def test_a_malformed_extra_argument_is_refused_saying_what_to_write(extra: tuple[str, ...], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        WorkerConfig(model="m", extra_args=extra)


def test_an_empty_value_after_a_flag_and_values_with_spaces_are_passed() -> None:
    extra = ("--chat-template", "", "--override-generation-config", '{"temperature": 0.5}', "--port-x=1")
    assert tuple(vllm_argv(WorkerConfig(model="m", extra_args=extra), PY)[-len(extra):]) == extra


def test_the_worker_and_the_llmserve_model_refuse_the_same_vllm_flags() -> None:
    from fulcrum.api.llmserve import VLLM_MANAGED_FLAGS
    assert set(MANAGED_FLAGS) == set(VLLM_MANAGED_FLAGS)


@pytest.mark.parametrize(("kind", "extra", "message"), [
    ("vllm", ["--tensor-parallel-size", "8"], r"'--tensor-parallel-size' sets --tensor-parallel-size, which Fulcrum "
                                               r"sets itself from the planner's TP"),
    ("vllm", ["--port=9"], r"'--port=9' sets --port"),
    ("vllm", ["--max_model_len", "9"], r"sets --max-model-len: set spec\.engine\.maxModelLen instead"),
    ("vllm", ["--dtype half"], "whitespace in the flag"),
    ("vllm", [""], "item 0 is empty"),
    ("sim", ["--port", "9"], r"'--port' sets --port"),
    # the operator passes the spec's maxModelLen to the sim-worker as to vLLM
    ("sim", ["--max-model-len", "4096"], r"sets --max-model-len: set spec\.engine\.maxModelLen instead"),
])
def test_the_llmserve_model_refuses_extra_args_that_override_fulcrums_flags(
        kind: str, extra: list[str], message: str) -> None:
    from fulcrum.api import parse_llmserve
    with pytest.raises(SpecError, match=r"spec\.engine\.extraArgs: .*" + message):
        parse_llmserve({"spec": {"model": {"name": "m"}, "engine": {"kind": kind, "extraArgs": extra}}})


@pytest.mark.parametrize(("kind", "extra"), [
    ("vllm", ["--enforce-eager", "--dtype", "float32", "--chat-template", ""]),
    ("sim", ["--time-scale", "0.1", "--kv-capacity-tokens", "100000"]),
])
def test_the_llmserve_model_passes_extra_args_fulcrum_does_not_set(kind: str, extra: list[str]) -> None:
    from fulcrum.api import parse_llmserve
    spec = parse_llmserve({"spec": {"model": {"name": "m"}, "engine": {"kind": kind, "extraArgs": extra}}}).spec
    assert spec.engine.extra_args == extra


@pytest.mark.parametrize("extra", [("--no-enable-prefix-caching",), ("--no_enable_prefix_caching",),
                                   ("--no-enable-prefix",)])
def test_the_no_twin_of_a_flag_the_worker_always_turns_on_is_refused(extra: tuple[str, ...]) -> None:
    """vLLM gives every boolean flag a ``--no-`` twin (BooleanOptionalAction): ``--no-enable-prefix-caching`` would
    silently turn off the prefix caching fulcrum worker turns on."""
    from fulcrum.api import parse_llmserve
    with pytest.raises(SpecError, match=r"is set by fulcrum worker \(always on; no worker flag turns it off\)"):
        WorkerConfig(model="m", extra_args=extra)
    with pytest.raises(SpecError, match=r"spec\.engine\.extraArgs: .*turns off --enable-prefix-caching, which Fulcrum always turns on"):
        parse_llmserve({"spec": {"model": {"name": "m"}, "engine": {"extraArgs": list(extra)}}})


def test_repeating_a_flag_the_worker_always_turns_on_is_accepted() -> None:
    # copied vLLM command lines carry it; it sets what the worker sets (refusing it broke such LLMServes on upgrade)
    from fulcrum.api import parse_llmserve
    extra = ("--enable-prefix-caching",)
    assert tuple(vllm_argv(WorkerConfig(model="m", extra_args=extra), PY)[-1:]) == extra
    spec = parse_llmserve({"spec": {"model": {"name": "m"}, "engine": {"extraArgs": list(extra)}}}).spec
    assert spec.engine.extra_args == list(extra)


def test_the_no_twin_of_an_unmanaged_boolean_flag_still_passes() -> None:
    extra = ("--no-enable-chunked-prefill", "--no-enforce-eager")
    assert tuple(vllm_argv(WorkerConfig(model="m", extra_args=extra), PY)[-2:]) == extra


def test_the_worker_table_is_the_llmserve_table() -> None:
    from fulcrum.api.llmserve import VLLM_MANAGED_FLAGS, VLLM_WORKER_FLAGS
    assert MANAGED_FLAGS is VLLM_WORKER_FLAGS
    assert "--no-enable-prefix-caching" in MANAGED_FLAGS
    assert VLLM_MANAGED_FLAGS["--max-num-seqs"].startswith("spec.engine.maxNumSeqs")
    assert VLLM_MANAGED_FLAGS["--max-num-batched-tokens"].startswith("spec.engine.maxNumBatchedTokens")


def test_the_default_batch_limits_are_unchanged() -> None:
    argv = vllm_argv(WorkerConfig(model="m"), PY)
    assert (flag(argv, "--max-num-seqs"), flag(argv, "--max-num-batched-tokens")) == ("256", "8192")


@pytest.mark.parametrize(("engine", "message"), [
    ({"maxNumSeqs": 0}, r"spec\.engine\.maxNumSeqs: Input should be greater than or equal to 1"),
    ({"maxNumSeqs": 65_537}, r"spec\.engine\.maxNumSeqs: Input should be less than or equal to 65536"),
    ({"maxNumBatchedTokens": 0}, r"spec\.engine\.maxNumBatchedTokens: Input should be greater than or equal to 1"),
    ({"maxNumSeqs": "64"}, r"spec\.engine\.maxNumSeqs: Input should be a number"),
    ({"maxNumBatchedTokens": 100}, r"maxNumBatchedTokens 100 is below maxNumSeqs 256 \(unset\)"),
    ({"maxNumSeqs": 9000}, r"maxNumBatchedTokens 8192 \(unset\) is below maxNumSeqs 9000"),
    ({"maxNumBatchedTokens": 4096, "extraArgs": ["--no-enable-chunked-prefill"]},
     r"maxNumBatchedTokens 4096 is below maxModelLen 8192 while extraArgs turns chunked prefill off"),
    ({"maxModelLen": 32768, "extraArgs": ["--no_enable_chunked_prefill"]},
     r"maxNumBatchedTokens 8192 \(unset\) is below maxModelLen 32768"),
    ({"kind": "sim", "maxNumSeqs": 8, "extraArgs": ["--max-num-seqs", "8"]},
     r"'--max-num-seqs' sets --max-num-seqs: set spec\.engine\.maxNumSeqs"),
    # unset field: the planner counts on 256 per instance, so a sim-worker flag behind its back is refused too
    ({"kind": "sim", "extraArgs": ["--max-num-seqs", "64"]},
     r"'--max-num-seqs' sets --max-num-seqs: set spec\.engine\.maxNumSeqs \(unset: 256\) instead"),
    ({"kind": "sim", "extraArgs": ["--max-num-batched-tokens=512"]}, r"sets --max-num-batched-tokens"),
])
def test_the_llmserve_model_refuses_batch_limits_vllm_would_refuse(engine: dict[str, object], message: str) -> None:
    from fulcrum.api import parse_llmserve
    with pytest.raises(SpecError, match=message):
        parse_llmserve({"spec": {"model": {"name": "m"}, "engine": engine}})


@pytest.mark.parametrize("engine", [
    {"maxNumSeqs": 64, "maxNumBatchedTokens": 2048},  # below maxModelLen: chunked prefill is on
    {"maxNumBatchedTokens": 4096, "maxModelLen": 32768},
    {"maxNumBatchedTokens": 8192, "extraArgs": ["--no-enable-chunked-prefill"]},  # = maxModelLen
    {"maxNumBatchedTokens": 4096, "extraArgs": ["--no-enable-chunked-prefill", "--enable-chunked-prefill"]},
    {"kind": "sim", "maxNumSeqs": 8, "maxNumBatchedTokens": 4096},
])
def test_the_llmserve_model_takes_batch_limits_vllm_takes(engine: dict[str, object]) -> None:
    from fulcrum.api import parse_llmserve
    spec = parse_llmserve({"spec": {"model": {"name": "m"}, "engine": engine}}).spec
    assert spec.engine.max_num_batched_tokens == engine.get("maxNumBatchedTokens")
