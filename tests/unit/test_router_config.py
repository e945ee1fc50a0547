"""The router config: validation, live reload on file change (injected clock), and what a reload changes."""

from __future__ import annotations

import asyncio
import os

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("pytest_asyncio")

from fakes.fake_policy import FakePolicy  # noqa: E402
from fulcrum.cli import build_parser  # noqa: E402
from fulcrum.router.config import ConfigWatcher, RouterConfigError, load_config, parse_config  # noqa: E402

GOOD = """
model: m
max_model_len: 2048
policy: {name: round_robin}
instances:
  - {id: a, url: "http://127.0.0.1:9001/"}
"""


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def write(path, text, bump):
    path.write_text(text)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + bump * 1_000_000_000))


def test_a_config_file_is_read_and_validated(tmp_path):
    p = tmp_path / "router.yaml"
    p.write_text(GOOD)
    cfg = load_config(p)
    assert cfg.model == "m" and cfg.max_model_len == 2048 and cfg.kv_block_size == 16
    assert cfg.records()[0].url == "http://127.0.0.1:9001"  # trailing slash dropped
    assert cfg.timeouts.first_token_s == 60.0


@pytest.mark.parametrize("text,field", [
    ("policy: {name: x, params: 3}", "policy.params"),
    ("max_model_len: -5", "max_model_len"),
    ("token_count: guess", "token_count"),
    ("instances: [{id: a}]", "instances.0.url"),
    ("timeouts: {connect_s: 0}", "timeouts.connect_s"),
    ("unknown_key: 1", "unknown_key"),
    ("- a list", "mapping"),
])
def test_invalid_configs_are_refused_naming_the_field(tmp_path, text, field):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(RouterConfigError, match=field.replace(".", r"\.")):
        load_config(p)


def test_missing_or_unparsable_files_are_config_errors(tmp_path):
    with pytest.raises(RouterConfigError):
        load_config(tmp_path / "absent.yaml")
    (tmp_path / "x.yaml").write_text("a: [")
    with pytest.raises(RouterConfigError, match="YAML"):
        load_config(tmp_path / "x.yaml")


def test_invalid_yaml_is_one_line_naming_the_file_line_and_column(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("a: [1, 2\nb: : x\n")
    with pytest.raises(RouterConfigError) as err:
        load_config(p)
    assert str(err.value) == f"router config {p}:2:2 is not valid YAML: while parsing a flow sequence, expected ',' or ']', but got ':'"


def test_the_watcher_reloads_on_change_and_keeps_the_last_good_config(tmp_path):
    p = tmp_path / "router.yaml"
    p.write_text(GOOD)
    clock = Clock()
    applied = []
    w = ConfigWatcher(p, load_config(p), applied.append, clock)
    assert not w.poll()  # unchanged
    assert not w.due()
    clock.t += 2.0
    assert w.due()
    write(p, GOOD.replace("max_model_len: 2048", "max_model_len: 4096"), 1)
    assert w.poll() and applied[-1].max_model_len == 4096
    write(p, "max_model_len: [broken", 2)
    assert not w.poll()
    assert w.current.max_model_len == 4096 and "YAML" in (w.last_error or "")
    write(p, GOOD.replace("policy: {name: round_robin}", "policy: {name: least_loaded}"), 3)
    assert w.poll() and applied[-1].policy.name == "least_loaded" and w.last_error is None
    assert len(applied) == 2


@pytest.mark.asyncio
async def test_a_reload_switches_policy_instances_and_timeouts_live(router_harness, tmp_path):
    built = []

    def factory(name, params):
        built.append((name, dict(params)))
        return FakePolicy(**params)

    h = await router_harness(n=2)
    st = h.state
    st.policy_factory = factory
    new = parse_config({**h.config, "policy": {"name": "fake", "params": {"kind": "disaggregated"}},
                        "instances": h.config["instances"][:1], "timeouts": {"connect_s": 0.5}})
    st.owns_registry = True
    st.apply_config(new)
    assert built == [("fake", {"kind": "disaggregated"})] and st.policy.kind == "disaggregated"
    assert st.pool.config.timeouts.connect_s == 0.5
    # the static registry's watcher hands the new instance list to the pool
    for _ in range(50):
        if st.pool.ids() == ["e0"]:
            break
        await asyncio.sleep(0.01)
    assert st.pool.ids() == ["e0"]
    r = await h.client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    assert r.status == 200


@pytest.mark.asyncio
async def test_a_policy_that_cannot_be_built_keeps_the_running_one(router_harness):
    h = await router_harness()
    st = h.state
    old = st.policy

    def factory(name, params):
        raise ValueError("unknown routing policy 'nope'")

    st.policy_factory = factory
    st.apply_config(parse_config({**h.config, "policy": {"name": "nope"}}))
    assert st.policy is old and st.config.policy.name == "round_robin"


def test_the_cli_has_a_router_command():
    args = build_parser().parse_args(["router", "--config", "r.yaml", "--port", "9000"])
    assert args.command == "router" and args.port == 9000 and args.host == "0.0.0.0"


def test_the_prefill_queue_defaults_to_direct_and_nats_takes_a_shorthand_or_a_section():
    assert parse_config({}).prefill_queue.kind == "direct"
    short = parse_config({"prefill_queue": "nats"}).prefill_queue
    assert short.kind == "nats" and short.servers() == ["nats://127.0.0.1:4222"] and short.on_timeout == "unavailable"
    full = parse_config({"prefill_queue": {"kind": "nats", "url": "nats://a:4222, nats://b:4222", "stream": "PREFILL_NS_X",
                                           "subject_prefix": "fulcrum.prefill.ns.x", "timeout_s": 5, "on_timeout": "direct"}})
    pq = full.prefill_queue
    assert pq.servers() == ["nats://a:4222", "nats://b:4222"] and pq.stream == "PREFILL_NS_X" and pq.timeout_s == 5.0
    assert pq.on_timeout == "direct"


@pytest.mark.parametrize("section,field", [
    ({"kind": "kafka"}, "prefill_queue.kind"),
    ({"kind": "nats", "url": "http://nats:4222"}, "prefill_queue.url"),
    ({"kind": "nats", "stream": "has.dots"}, "prefill_queue.stream"),
    ({"kind": "nats", "subject_prefix": "fulcrum.>"}, "prefill_queue.subject_prefix"),
    ({"kind": "nats", "timeout_s": 0}, "prefill_queue.timeout_s"),
    ({"kind": "nats", "on_timeout": "retry"}, "prefill_queue.on_timeout"),
    ({"kind": "nats", "surprise": 1}, "prefill_queue.surprise"),
])
def test_a_bad_prefill_queue_section_is_refused_naming_the_field(section, field):
    with pytest.raises(RouterConfigError, match=field.replace(".", r"\.")):
        parse_config({"prefill_queue": section})


def test_draining_lists_instance_ids_once_each_and_null_means_none():
    assert parse_config({}).draining == ()
    assert parse_config({"draining": None}).draining == ()
    assert parse_config({"draining": ["w3", "w1", "w3"]}).draining == ("w3", "w1")
    with pytest.raises(RouterConfigError, match="draining"):
        parse_config({"draining": [""]})
    with pytest.raises(RouterConfigError, match="draining"):
        parse_config({"draining": "w3"})


def test_the_prefill_queue_names_of_an_llmserve_are_valid_config_values():
    pytest.importorskip("nats")
    from fulcrum.router.prefill_queue import QueueLayout

    layout = QueueLayout.for_llmserve("prod", "llama-3.1")
    cfg = parse_config({"prefill_queue": {"kind": "nats", "stream": layout.stream, "subject_prefix": layout.subject_prefix}})
    assert cfg.prefill_queue.stream == "PREFILL_PROD_LLAMA-3_1"
    assert cfg.prefill_queue.subject_prefix == "fulcrum.prefill.prod.llama-3_1"



# ------------------------------------------------------------------------------------ files that are not YAML text
def write_bytes(path, data, bump):
    path.write_bytes(data)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + bump * 1_000_000_000))


@pytest.mark.parametrize("data,reason", [
    (b"model: \xff\n", "is not valid UTF-8"),
    (b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n", "is nested too deeply"),
    (b"a: 2024-13-45\n", "is not valid YAML: month must be in 1..12"),  # was a bare ValueError
])
def test_a_file_that_is_not_utf8_or_nested_too_deeply_is_a_config_error(tmp_path, data, reason):
    p = tmp_path / "bad.yaml"
    p.write_bytes(data)
    with pytest.raises(RouterConfigError, match=reason):
        load_config(p)


def test_the_watcher_survives_bad_bytes_and_deep_nesting_and_applies_the_next_good_file(tmp_path):
    p = tmp_path / "router.yaml"
    p.write_text(GOOD)
    clock = Clock()
    applied = []
    w = ConfigWatcher(p, load_config(p), applied.append, clock)
    write_bytes(p, b"model: \xff\n", 1)
    assert not w.poll() and "is not valid UTF-8" in (w.last_error or "")
    write(p, "a: " + "[" * 5000 + "]" * 5000 + "\n", 2)
    assert not w.poll() and "is nested too deeply" in (w.last_error or "")
    assert w.current.max_model_len == 2048 and applied == []
    write(p, GOOD.replace("max_model_len: 2048", "max_model_len: 4096"), 3)
    assert w.poll() and applied[-1].max_model_len == 4096 and w.last_error is None


async def _until(cond, timeout=5.0):
    for _ in range(int(timeout / 0.02)):
        if cond():
            return True
        await asyncio.sleep(0.02)
    return cond()


@pytest.mark.asyncio
async def test_a_live_router_keeps_watching_after_an_undecodable_config_and_applies_the_next_good_one(
        router_harness, tmp_path):
    import yaml

    p = tmp_path / "router.yaml"
    p.write_text("model: fake-model\n")
    h = await router_harness(n=1, config={"reload_interval_s": 0.02}, config_path=p)
    st = h.state
    (task,) = [t for t in st.tasks if t.get_name() == "router-config"]
    write(p, yaml.safe_dump(h.config), 1)  # the harness's own config (instances kept)
    assert await _until(lambda: st.watcher.current.reload_interval_s == 0.02 and st.watcher.last_error is None)
    write_bytes(p, b"model: \xff\n", 2)
    assert await _until(lambda: "is not valid UTF-8" in (st.watcher.last_error or ""))
    assert not task.done()
    write(p, yaml.safe_dump({**h.config, "max_retries": 5}), 3)
    assert await _until(lambda: st.config.max_retries == 5), st.watcher.last_error
    assert not task.done()
    r = await h.client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    assert r.status == 200


@pytest.mark.asyncio
async def test_an_unexpected_failure_of_one_reload_is_logged_and_the_watcher_polls_on(router_harness, tmp_path, caplog):
    import yaml

    p = tmp_path / "router.yaml"
    p.write_text("model: fake-model\n")
    h = await router_harness(n=1, config={"reload_interval_s": 0.02}, config_path=p)
    st = h.state
    (task,) = [t for t in st.tasks if t.get_name() == "router-config"]
    real_poll = st.watcher.poll
    calls = []

    def poll_failing_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("disk on fire")
        return real_poll()

    st.watcher.poll = poll_failing_once
    assert await _until(lambda: len(calls) >= 1)
    write(p, yaml.safe_dump({**h.config, "max_retries": 5}), 1)
    assert await _until(lambda: st.config.max_retries == 5)
    assert not task.done()
    (rec,) = [r for r in caplog.records if "router config reload failed unexpectedly" in r.getMessage()]
    assert rec.levelname == "ERROR" and rec.exc_info is not None and "disk on fire" in str(rec.exc_info[1])


def test_the_cli_refuses_a_wrongly_typed_policy_parameter_in_one_line(tmp_path, capsys):
    from fulcrum.cli import main

    p = tmp_path / "bad.yaml"
    p.write_text('model: m\npolicy: {name: load_aware, params: {load_threshold: "x"}}\n'
                 'instances: [{id: w0, url: "http://127.0.0.1:9"}]\n')
    assert main(["router", "--config", str(p), "--loop", "asyncio", "--log-level", "error"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        "fulcrum router: error: routing policy 'load_aware': parameter 'load_threshold' = 'x' is invalid: "
        "'>=' not supported between instances of 'str' and 'float'")
