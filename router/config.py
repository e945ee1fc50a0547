"""The router's configuration: a YAML file (the router ConfigMap the operator writes), reloaded live.

Example::

    model: meta-llama/Llama-3.1-8B-Instruct   # served model name; requests naming another model get 404
    max_model_len: 8192                       # context limit, tokens (else learnt from the engines' /tokenize)
    kv_block_size: 16                         # the engines' KV block size, tokens (handoff guard)
    token_count: tokenize                     # tokenize | estimate (see fulcrum.router.tokens)
    policy: {name: round_robin, params: {}}
    registry: static                          # static | etcd | kubernetes
    instances:
      - {id: w0, url: "http://10.0.0.5:8000", role: both}
    timeouts: {connect_s: 2, first_token_s: 60, idle_s: 60, request_s: 600}
    prefill_queue: {kind: nats, url: "nats://nats:4222", stream: PREFILL_PROD_LLAMA, subject_prefix: fulcrum.prefill.prod.llama}
    draining: [w3]                            # instances that get no new requests (scale-in); in-flight ones finish
    rescheduling: {enabled: true, interval_s: 1}   # ARES decode rescheduling in the router (docs/rebalancing.md)
    roles: {enabled: true, min_prefill: 1, min_decode: 1}   # BanaServe role reassignment of `both` instances
    kv_connector: {partial_prefix: false}     # whether the engines load a partial prompt prefix's KV safely

:class:`ConfigWatcher` polls the file's modification time with an injected clock (a ConfigMap mount changes by
an atomic symlink swap, which inotify-free polling sees); an invalid new file keeps the last good config and
is logged.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fulcrum.errors import FulcrumError, safe_yaml, yaml_problem
from fulcrum.rebalancing.decode_rescheduling import ReschedulingConfig
from fulcrum.router.registry import InstanceRecord

__all__ = [
    "RouterConfigError",
    "PolicyConfig",
    "InstanceConfig",
    "Timeouts",
    "EtcdConfig",
    "KubernetesConfig",
    "PrefillQueueConfig",
    "ReschedulingSection",
    "RolesSection",
    "KvConnectorSection",
    "RouterConfig",
    "load_config",
    "parse_config",
    "ConfigWatcher",
]

log = logging.getLogger(__name__)


class RouterConfigError(FulcrumError, ValueError):
    """The router configuration file is unreadable or invalid (the message names the field)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PolicyConfig(_Strict):
    """Which routing policy runs, and its parameters (passed to the policy's constructor)."""

    name: str = "round_robin"
    params: dict[str, Any] = Field(default_factory=dict)


class InstanceConfig(_Strict):
    """One static instance (fields as :class:`fulcrum.router.registry.InstanceRecord`)."""

    id: str
    url: str
    role: Literal["prefill", "decode", "both"] = "both"
    pool: str = "default"
    tp: int = Field(default=1, ge=1)
    max_concurrency: int = Field(default=256, ge=1)
    max_num_batched_tokens: int = Field(default=8192, ge=1)
    kv_capacity_tokens: int = Field(default=0, ge=0)
    model: str = ""

    def record(self) -> InstanceRecord:
        """The registry record."""
        return InstanceRecord(
            id=self.id, url=self.url.rstrip("/"), role=self.role, pool=self.pool, tp=self.tp,
            max_concurrency=self.max_concurrency, max_num_batched_tokens=self.max_num_batched_tokens,
            kv_capacity_tokens=self.kv_capacity_tokens, model=self.model,
        )


class EtcdConfig(_Strict):
    """Where the etcd instance registry is (``registry: etcd``); keys ``/fulcrum/<namespace>/<llmserve>/instances/``."""

    endpoint: str = "127.0.0.1:2379"
    namespace: str = "default"
    llmserve: str = ""


class KubernetesConfig(_Strict):
    """Where the Kubernetes instance registry looks (``registry: kubernetes``): the EndpointSlices of the pool
    Services selected by ``label_selector`` in ``namespace`` (see ``fulcrum.router.registry_k8s``)."""

    namespace: str = "default"
    label_selector: str = ""
    """Selects the pool Services' EndpointSlices (they carry their Service's labels), e.g.
    ``fulcrum.dev/llmserve=llama``; "" = every slice in the namespace."""
    port_name: str = "http"
    """The Service port of the OpenAI-compatible server."""
    role_label: str = "fulcrum.dev/role"
    pool_label: str = "fulcrum.dev/pool"
    tp_label: str = "fulcrum.dev/tp"


class Timeouts(_Strict):
    """Upstream time limits, seconds."""

    connect_s: float = Field(default=2.0, gt=0)
    """TCP connect to an engine; a dead pod refuses or times out fast, so short."""
    first_token_s: float = Field(default=60.0, gt=0)
    """Until the first streamed event (or a non-streamed answer's headers when ``request_s`` is larger): a
    queue of long prefills can take tens of seconds, past that the instance is treated as stuck."""
    idle_s: float = Field(default=60.0, gt=0)
    """Longest silence between two streamed events once streaming."""
    request_s: float = Field(default=600.0, gt=0)
    """Whole upstream call (non-streamed answers arrive only at the end)."""
    health_s: float = Field(default=2.0, gt=0)
    """One ``/health`` probe."""


_STREAM_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
_SUBJECT = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")


class PrefillQueueConfig(_Strict):
    """How prefill legs reach prefill instances (DOPD §V-C "Connector").

    ``kind: direct`` (default): the router POSTs each prefill leg to the instance the policy chose.
    ``kind: nats``: the prefill leg of a ``disaggregated`` decision (and the A leg of a ``split`` one: any engine
    call carrying ``kv_transfer_params.do_remote_decode``) is published as a job on a NATS JetStream work queue;
    prefill instances pull jobs (``fulcrum.router.prefill_queue.run_prefill_worker`` beside each engine), run
    them on their engine and reply with the engine's answer (its ``kv_transfer_params``); the decode leg is then
    sent as in the direct case. The names must match the workers' (``QueueLayout.for_llmserve`` derives them
    per LLMServe). The YAML shorthand ``prefill_queue: nats`` is ``{kind: nats}`` with every default.
    """

    kind: Literal["direct", "nats"] = "direct"
    url: str = "nats://127.0.0.1:4222"
    """NATS server URL(s), comma-separated for several."""
    stream: str = "FULCRUM_PREFILL"
    """JetStream stream (one per LLMServe; letters, digits, ``_`` and ``-``)."""
    subject_prefix: str = "fulcrum.prefill"
    """Jobs are published on ``<subject_prefix>.jobs``."""
    durable: str = "prefill-workers"
    """The one durable pull consumer every worker shares."""
    ack_wait_s: float = Field(default=30.0, gt=0)
    """A job held this long without an ack or heartbeat (its worker died) is redelivered, seconds."""
    max_deliver: int = Field(default=3, ge=1)
    """Deliveries of a failing job before the router gets the worker's error (502)."""
    timeout_s: float = Field(default=60.0, gt=0)
    """Longest wait for a worker's reply, publish included, seconds: as ``timeouts.first_token_s``, a queue of
    long prefills can take tens of seconds; past it the request gets 503 (or ``on_timeout: direct``)."""
    on_timeout: Literal["unavailable", "direct"] = "unavailable"
    """What a job nobody took in time (or an unreachable NATS) becomes: ``unavailable`` answers 503 with the
    reason (the operator scales prefill out on the queue depth); ``direct`` sends the prefill leg to the
    policy's chosen instance over HTTP instead."""
    depth_interval_s: float = Field(default=1.0, gt=0)
    """Period of the queue-depth read behind ``fulcrum_router_prefill_queue_depth``, seconds."""
    connect_timeout_s: float = Field(default=5.0, gt=0)
    """Longest wait for a NATS connection, seconds (retried on the next job or depth read when it fails)."""

    @field_validator("stream", "durable")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _STREAM_NAME.match(v):
            raise ValueError(f"{v!r} is not a JetStream name (letters, digits, '_' and '-' only)")
        return v

    @field_validator("subject_prefix")
    @classmethod
    def _subject(cls, v: str) -> str:
        if not _SUBJECT.match(v):
            raise ValueError(f"{v!r} is not a NATS subject prefix (dot-separated tokens, no wildcards)")
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        for u in v.split(","):
            if not u.strip().startswith(("nats://", "tls://", "ws://", "wss://")):
                raise ValueError(f"{u.strip()!r} is not a NATS URL (nats://host:port)")
        return v

    def servers(self) -> list[str]:
        """The NATS server URLs."""
        return [u.strip() for u in self.url.split(",") if u.strip()]


class ReschedulingSection(_Strict):
    """ARES decode rescheduling in the router (``fulcrum.router.rescheduler``; ARES §5.2, Alg. 1).

    The planner's parameters are those of :class:`fulcrum.rebalancing.decode_rescheduling.ReschedulingConfig`
    (same names, same defaults, same reasons); the rest says how the router measures and executes."""

    enabled: bool = False
    """Off by default: a migration recomputes the request's context on the target (docs/rebalancing.md)."""
    interval_s: float = Field(default=1.0, gt=0)
    """Period of Alg. 1, seconds (ARES §5.2 runs it every second)."""
    theta: float = Field(default=0.1, ge=0)
    horizon_steps: int = Field(default=512, ge=1)
    horizon_points: int = Field(default=8, ge=1)
    discount: float = Field(default=0.5, gt=0, le=1)
    kv_bytes_per_token: float = Field(default=327_680.0, gt=0)
    """KV bytes per token of the served model (the migration cost C_mig is computed from it)."""
    link_gbps: float = Field(default=25.0, gt=0)
    transfer_overhead_s: float = Field(default=0.005, ge=0)
    min_gain: float = Field(default=0.02, ge=0, lt=1)
    request_cooldown_s: float = Field(default=10.0, ge=0)
    instance_cooldown_s: float = Field(default=2.0, ge=0)
    default_step_time_s: float = Field(default=0.02, gt=0)
    """T_exec of an instance before the router has measured its inter-token time, seconds."""
    default_kv_capacity_tokens: int = Field(default=0, ge=0)
    """C_mem of an instance whose registry record has no ``kv_capacity_tokens``; 0 = unbounded (the memory
    filter of Alg. 1 line 21 then never refuses)."""
    recompute_tokens_per_s: float = Field(default=10_000.0, gt=0)
    """The targets' prefill throughput, tokens/s: the router's migrations recompute the request's context (prompt +
    generated so far) on the target, so C_mig of Alg. 1 lines 17–20 is those tokens over it, not a KV transfer
    (the operator writes the profile's; ``kv_bytes_per_token``/``link_gbps`` price KV moves in the simulator)."""

    def planner(self) -> ReschedulingConfig:
        """The pure planner's :class:`~fulcrum.rebalancing.decode_rescheduling.ReschedulingConfig`."""
        return ReschedulingConfig(
            theta=self.theta, horizon_steps=self.horizon_steps, horizon_points=self.horizon_points,
            discount=self.discount, kv_bytes_per_token=self.kv_bytes_per_token, link_gbps=self.link_gbps,
            transfer_overhead_s=self.transfer_overhead_s, min_gain=self.min_gain,
            request_cooldown_s=self.request_cooldown_s, instance_cooldown_s=self.instance_cooldown_s,
            recompute_tokens_per_s=self.recompute_tokens_per_s,
        )


class RolesSection(_Strict):
    """BanaServe role reassignment of ``both`` instances in the router (``fulcrum.router.roles``; BanaServe §4.3,
    Alg. 1 with a role flip). Bounds and thresholds are those of
    :class:`fulcrum.rebalancing.role_reassignment.RoleBounds` and ``RoleBalanceConfig``."""

    enabled: bool = False
    """Off by default: without it a ``both`` instance takes either part of any request (no duty)."""
    interval_s: float = Field(default=1.0, gt=0)
    """Period of the re-evaluation, seconds."""
    min_prefill: int = Field(default=1, ge=0)
    max_prefill: int = Field(default=1_000_000, ge=0)
    min_decode: int = Field(default=1, ge=0)
    max_decode: int = Field(default=1_000_000, ge=0)
    delta: float = Field(default=0.5, gt=0)
    """δ on the 0–2 utilisation scale (0.5: see RoleBalanceConfig for the measurement behind it)."""
    cooldown_s: float = Field(default=10.0, ge=0)
    dwell_s: float = Field(default=60.0, ge=0)
    ttft_slo_s: float = Field(default=2.0, gt=0)
    """TTFT SLO, seconds: a prefill-duty instance's memory pressure is its oldest queued prefill's wait over it."""
    decode_slo_batch: int | None = Field(default=None, ge=1)
    """Requests one instance decodes within the TPOT SLO (the plan's, written by the operator): a decode-duty
    instance's compute is full there (``fulcrum.rebalancing.duties``); unset: the engine's ``max_num_seqs``."""
    migrate_on_flip: bool = False
    """Move a decode instance's running requests away when it takes prefill duty (needs ``rescheduling``);
    otherwise they finish where they are."""

    @model_validator(mode="after")
    def _bounds(self) -> "RolesSection":
        if self.max_prefill < self.min_prefill or self.max_decode < self.min_decode:
            raise ValueError("max_prefill/max_decode must be >= min_prefill/min_decode")
        return self


class KvConnectorSection(_Strict):
    """What the engines' KV connector can do, for BanaServe's prefix pulls (``load_aware`` with
    ``prefix_pull``; BanaServe §4.2)."""

    partial_prefix: bool = False
    """The engines accept a request whose prompt extends the pulled prefix (vLLM NIXL with
    ``bidirectional_kv_xfer``); False = a prefix held elsewhere is recomputed (counted)."""
    kv_bytes_per_token: float = Field(default=327_680.0, gt=0)
    """KV bytes per token of the served model."""
    link_gbps: float = Field(default=25.0, gt=0)
    """KV transfer bandwidth between instances, GB/s."""
    transfer_overhead_s: float = Field(default=0.005, ge=0)
    """Fixed cost of one pull (the holder's extra request and the handshake), seconds."""
    prefill_tokens_per_s: float = Field(default=10_000.0, gt=0)
    """Prefill throughput used to price recomputing a prefix, tokens per second (the profile's)."""


class RouterConfig(_Strict):
    """Everything the router reads from its config file."""

    model: str | None = None
    """Served model name; None = accept any and report the instances' names."""
    max_model_len: int | None = Field(default=None, ge=1)
    """Context limit, tokens; None = learn it from the engines' ``/tokenize`` answers."""
    kv_block_size: int = Field(default=16, ge=1)
    """The engines' KV block size, tokens (vLLM's default 16); the handoff guard depends on it."""
    token_count: Literal["tokenize", "estimate"] = "tokenize"
    """How the prompt length is known: an engine's ``/tokenize`` (exact) or a byte estimate (no round trip)."""
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    registry: Literal["static", "etcd", "kubernetes"] = "static"
    etcd: EtcdConfig = Field(default_factory=EtcdConfig)
    kubernetes: KubernetesConfig = Field(default_factory=KubernetesConfig)
    instances: tuple[InstanceConfig, ...] = ()
    timeouts: Timeouts = Field(default_factory=Timeouts)
    max_retries: int = Field(default=2, ge=0, le=10)
    """Other instances tried when one fails before anything was streamed."""
    eject_after_failures: int = Field(default=3, ge=1)
    """Consecutive 5xx answers that eject an instance (connect errors and timeouts eject at once)."""
    eject_base_s: float = Field(default=1.0, gt=0)
    """First ejection length; doubles on each ejection in a row, up to ``eject_max_s``."""
    eject_max_s: float = Field(default=30.0, gt=0)
    health_interval_s: float = Field(default=5.0, gt=0)
    """Period of the ``/health`` probes (ejected instances are re-admitted by a passing probe after backoff)."""
    connection_limit: int = Field(default=1000, ge=1)
    """Pooled upstream connections, all instances together (the router's one aiohttp client session)."""
    reload_interval_s: float = Field(default=2.0, gt=0)
    """Period of the config file's mtime check."""
    prefill_queue: PrefillQueueConfig = Field(default_factory=PrefillQueueConfig)
    """Direct HTTP prefill legs, or the NATS JetStream prefill queue (:class:`PrefillQueueConfig`)."""
    draining: tuple[str, ...] = ()
    """Instance ids that get no new requests from any policy while their in-flight requests finish; the operator
    writes them before scaling in (an id not registered is ignored)."""
    rescheduling: ReschedulingSection = Field(default_factory=ReschedulingSection)
    """ARES decode rescheduling of running requests between instances (:class:`ReschedulingSection`)."""
    roles: RolesSection = Field(default_factory=RolesSection)
    """Role reassignment of ``both`` instances between prefill and decode duty (:class:`RolesSection`)."""
    kv_connector: KvConnectorSection = Field(default_factory=KvConnectorSection)
    """KV connector capabilities and costs (:class:`KvConnectorSection`)."""

    @model_validator(mode="before")
    @classmethod
    def _shorthands(cls, data: Any) -> Any:
        if isinstance(data, dict):
            pq = data.get("prefill_queue")
            if isinstance(pq, str):
                data = {**data, "prefill_queue": {"kind": pq}}
            dr = data.get("draining")
            if dr is None and "draining" in data:
                data = {**data, "draining": ()}
        return data

    @field_validator("draining")
    @classmethod
    def _ids(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(not i for i in v):
            raise ValueError("instance ids must not be empty")
        return tuple(dict.fromkeys(v))

    def records(self) -> list[InstanceRecord]:
        """The static instance list as registry records."""
        return [i.record() for i in self.instances]


def parse_config(data: Any) -> RouterConfig:
    """Validate a parsed YAML document.

    Raises:
        RouterConfigError: not a mapping, or a field invalid (path in the message).
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RouterConfigError("router config must be a mapping")
    try:
        return RouterConfig.model_validate(data)
    except ValidationError as err:
        e = err.errors(include_url=False)[0]
        loc = ".".join(str(x) for x in e["loc"])
        raise RouterConfigError(f"router config: {loc}: {e['msg']}") from err


def load_config(path: str | Path) -> RouterConfig:
    """Read and validate a router config file.

    Raises:
        RouterConfigError: unreadable file, not UTF-8, invalid YAML (nested too deeply included), or an invalid
            field.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise RouterConfigError(f"cannot read router config {path}: {err}") from err
    except UnicodeDecodeError as err:
        raise RouterConfigError(f"router config {path} is not valid UTF-8: {err}") from err
    try:
        data = safe_yaml(text)
    except yaml.YAMLError as err:  # one line: file:line:column and the problem, not YAML's caret diagram
        where, what = yaml_problem(err)
        raise RouterConfigError(f"router config {path}{where} is not valid YAML: {what}") from err
    except RecursionError as err:
        raise RouterConfigError(f"router config {path} is nested too deeply") from err
    try:
        return parse_config(data)
    except RecursionError as err:
        raise RouterConfigError(f"router config {path} is nested too deeply") from err


class ConfigWatcher:
    """Reloads a config file when its modification time changes.

    ``poll()`` is synchronous and cheap (one ``stat``): the caller runs it every ``interval_s`` seconds of the
    injected clock. A changed, valid file calls ``on_change(new_config)``; an invalid one keeps the last good
    config, logs the reason, and is not retried until the file changes again.
    """

    def __init__(
        self,
        path: str | Path,
        current: RouterConfig,
        on_change: Callable[[RouterConfig], None],
        clock: Callable[[], float],
    ) -> None:
        self.path = Path(path)
        self.current = current
        self.last_error: str | None = None
        self._on_change = on_change
        self._clock = clock
        self._mtime = self._stat()
        self._last_poll = clock()

    def _stat(self) -> float | None:
        try:
            return self.path.stat().st_mtime_ns / 1e9
        except OSError:
            return None

    def due(self) -> bool:
        """Whether ``reload_interval_s`` has passed on the injected clock since the last poll."""
        return self._clock() - self._last_poll >= self.current.reload_interval_s

    def poll(self) -> bool:
        """Check the file now; returns True when a new valid config was applied."""
        self._last_poll = self._clock()
        mtime = self._stat()
        if mtime is None or mtime == self._mtime:
            return False
        self._mtime = mtime
        try:
            new = load_config(self.path)
        except RouterConfigError as err:
            self.last_error = str(err)
            log.error("router config reload failed, keeping the last good config: %s", err)
            return False
        self.last_error = None
        if new == self.current:
            return False
        self.current = new
        self._on_change(new)
        log.info("router config reloaded from %s (policy %s, %d static instances, %d draining, prefill %s)",
                 self.path, new.policy.name, len(new.instances), len(new.draining), new.prefill_queue.kind)
        return True
