"""Fulcrum's SLO-aware local batch scheduler for vLLM: Libra §4.2, Algorithm 2, as a vLLM ``Scheduler`` subclass.

Use: ``--scheduler-cls fulcrum.worker.slo_scheduler.SLOAwareScheduler`` (vLLM resolves the qualified name in the
engine-core process). Per engine step, before vLLM's own ``Scheduler.schedule()`` runs:

1. (Alg. 2 line 1, RECORD) the previous step's measured time is already in the :class:`StepLatencyTable`
   (recorded in ``update_from_output``, see "Measuring a step" below);
2. (line 2, ``B ← D``) the running queue is stably reordered so that every running decode comes before every
   running prefill chunk — vLLM walks ``self.running`` in order with one token budget, so this is what makes
   "all decodes first" true; the order inside each group is kept;
3. (line 3, MAXPREFILLALLOWED) from the decodes' count d and mean KV context c the table gives the prefill
   budget M (largest M whose predicted step time ≤ the TPOT SLO, at least the floor);
4. (lines 4–10) vLLM's ``schedule()`` then runs with ``self.max_num_scheduled_tokens`` lowered to
   ``decode tokens + M`` (never raised above the engine's own limit) and restored afterwards: decodes take
   their tokens first, prefill chunks (running ones, then waiting ones in arrival order, each chunk
   ``min(remaining prompt, remaining budget)``) share the rest — exactly the greedy loop of lines 4–10.

Without ``FULCRUM_TPOT_SLO_MS`` the scheduler does not touch the queue or the budget (the base scheduler's
behaviour) but still measures and records every step, which is the offline profiling mode
(``step_profiler.py``).

Measuring a step: the time from the end of ``schedule()`` to the start of ``update_from_output()`` for the same
``SchedulerOutput`` — the engine core's ``step()`` runs the model and samples in between. With vLLM's async
scheduling (GPU default, ``step_with_batch_queue``) the next ``schedule()`` overlaps this interval; the interval
is then the batch's time in the pipeline, still the quantity that spaces its tokens.

Which base class: vLLM picks ``AsyncScheduler`` when ``scheduler_config.async_scheduling`` is true (GPU
default) and ``Scheduler`` otherwise (the CPU platform forces it off). ``SLOAwareScheduler`` subclasses
``Scheduler``; its ``__new__`` returns an ``SLOAwareAsyncScheduler`` (a subclass of both ``SLOAwareScheduler``
and ``AsyncScheduler``) when the config asks for async scheduling, so one ``--scheduler-cls`` value serves
both platforms. The classes are built on first access (module ``__getattr__``), so importing this module
does not import vLLM.

Settings, read once from the engine's environment when the scheduler is built (vLLM builds it; there is no
CLI of ours in that process):

- ``FULCRUM_TPOT_SLO_MS``: the TBT/TPOT SLO in ms; unset or empty = record only.
- ``FULCRUM_STEP_TABLE``: JSON/YAML path; loaded at start if it exists, saved (when new steps were
  recorded) every ``FULCRUM_STEP_TABLE_SAVE_S`` seconds (default 10) while busy, whenever the engine runs out
  of requests, and at shutdown (which vLLM may not reach on SIGTERM: hence the save when idle).
- ``FULCRUM_SCHEDULER_METRICS_PORT``: serve the metrics below with prometheus-client on this port (all
  interfaces); unset = no server (the metrics are still kept).
- ``FULCRUM_SCHEDULER_MIN_PREFILL_TOKENS``: the budget floor (default 16 tokens).
- ``FULCRUM_SCHEDULER_SLO_HEADROOM``: the fraction of the SLO a step is planned to use (default 0.8).
- ``FULCRUM_STEP_LOG``: a JSON-lines file that gets one line per executed step: ``{"t": monotonic s,
  "prefill": tokens, "decodes": n, "context": mean tokens, "budget": M or null, "seconds": measured,
  "predicted": s or null}`` (for benchmarks and debugging; a few microseconds per step).
- ``FULCRUM_STEP_PROFILE`` / ``FULCRUM_STEP_PROFILE_TP``: a performance profile (built-in name or file) and
  TP to seed empty buckets from (see ``StepLatencyTable.seed_from_profile``).

Metrics (own registry): ``fulcrum_scheduler_prefill_budget_tokens`` (gauge, M of the last step),
``fulcrum_scheduler_scheduled_prefill_tokens`` (histogram), ``fulcrum_scheduler_step_seconds`` (histogram),
``fulcrum_scheduler_predicted_step_seconds`` (gauge, the table's prediction for the last executed step),
``fulcrum_scheduler_budget_violations_total`` (steps whose scheduled prefill tokens exceeded their budget),
``fulcrum_scheduler_slo_violations_total`` (steps slower than the SLO), ``fulcrum_scheduler_steps_total``,
``fulcrum_scheduler_table_entries`` (measured buckets), and the table itself:
``fulcrum_scheduler_step_table_seconds``, ``…_step_table_samples`` and ``…_step_table_mean_prefill_tokens``
with labels ``prefill_tokens``, ``context_tokens``, ``decodes`` (the bucket).

Adapter code (worker layer): vLLM is imported lazily; the pure logic is :class:`StepPlanner`.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from fulcrum.errors import FulcrumError
from fulcrum.worker.latency_table import StepLatencyTable

__all__ = [
    "SchedulerMetrics",
    "SchedulerSettings",
    "StepPlan",
    "StepPlanner",
    "SLOAwareScheduler",
    "SLOAwareAsyncScheduler",
    "partition_decodes_first",
]

log = logging.getLogger("vllm.fulcrum_scheduler")  # a child of vLLM's logger: shows in the engine log


# ----------------------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class SchedulerSettings:
    """The scheduler's settings (see the module doc for the environment variables).

    Attributes:
        tpot_slo_s: TBT/TPOT SLO in seconds, or ``None`` to record only (base scheduler behaviour).
        table_path: where the table is loaded from and saved to, or ``None``.
        metrics_port: prometheus-client port in the engine-core process, or ``None``.
        save_interval_s: seconds between periodic saves of the table (10 s: a crash loses little, a save
            of a few hundred buckets costs well under a millisecond of engine time).
        min_prefill_tokens: the budget floor, tokens (16: one small chunk per step keeps prefills moving
            when decodes alone reach the SLO).
        seed_profile: a profile name or path to seed empty buckets from, or ``None``.
        seed_tp: tensor-parallel size of the seed profile's tables.
        step_log: a JSON-lines file that gets one line per executed step, or ``None``.
        slo_headroom: fraction of the SLO a step is planned to use (``FULCRUM_SCHEDULER_SLO_HEADROOM``, default
            0.8: the budget aims at the table's mean step time, and on the CPU benchmark planning to the full SLO
            left 415 of 1,017 decode steps over it).
    """

    tpot_slo_s: float | None = None
    table_path: Path | None = None
    metrics_port: int | None = None
    save_interval_s: float = 10.0
    min_prefill_tokens: int = 16
    seed_profile: str | None = None
    seed_tp: int = 1
    step_log: Path | None = None
    slo_headroom: float = 0.8

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SchedulerSettings:
        """Read the ``FULCRUM_*`` variables from ``env``.

        Raises:
            FulcrumError: a malformed or out-of-range value (the message names the variable), including an SLO
                so small that it is 0 in seconds and a metrics port past 65535.
        """

        def get(name: str) -> str | None:
            value = env.get(name, "").strip()
            return value or None

        def number(name: str, kind: type[float] | type[int], default: Any, *, positive: bool) -> Any:
            raw = get(name)
            if raw is None:
                return default
            try:
                value = kind(raw)
            except ValueError:
                raise FulcrumError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {raw!r}") from None
            if not math.isfinite(value) or value < 0 or (positive and value == 0):
                raise FulcrumError(f"{name} must be {'> 0' if positive else '>= 0'}, got {raw!r}")
            return value

        slo_ms = number("FULCRUM_TPOT_SLO_MS", float, None, positive=True)
        if slo_ms is not None and not slo_ms / 1e3 > 0:  # 1e-322 ms is 0 s: every planned step would fail
            raise FulcrumError(f"FULCRUM_TPOT_SLO_MS must be > 0 in seconds too, got {get('FULCRUM_TPOT_SLO_MS')!r}")
        table = get("FULCRUM_STEP_TABLE")
        port = number("FULCRUM_SCHEDULER_METRICS_PORT", int, None, positive=True)
        if port is not None and port > 65535:  # bind() would raise OverflowError in the engine core, naming nothing
            raise FulcrumError(
                f"FULCRUM_SCHEDULER_METRICS_PORT must be in 1..65535, got {get('FULCRUM_SCHEDULER_METRICS_PORT')!r}")
        return cls(
            tpot_slo_s=None if slo_ms is None else slo_ms / 1e3,
            table_path=None if table is None else Path(table),
            step_log=None if get("FULCRUM_STEP_LOG") is None else Path(str(get("FULCRUM_STEP_LOG"))),
            metrics_port=port,
            save_interval_s=number("FULCRUM_STEP_TABLE_SAVE_S", float, 10.0, positive=True),
            min_prefill_tokens=number("FULCRUM_SCHEDULER_MIN_PREFILL_TOKENS", int, 16, positive=False),
            seed_profile=get("FULCRUM_STEP_PROFILE"),
            seed_tp=number("FULCRUM_STEP_PROFILE_TP", int, 1, positive=True),
            slo_headroom=_headroom(number("FULCRUM_SCHEDULER_SLO_HEADROOM", float, 0.8, positive=True)),
        )


def _headroom(value: float) -> float:
    if value > 1:
        raise FulcrumError(f"FULCRUM_SCHEDULER_SLO_HEADROOM must be in (0, 1], got {value!r}")
    return value


# ----------------------------------------------------------------------------------------------- pure core
def partition_decodes_first(running: Sequence[Any], is_decode: Any) -> list[Any]:
    """Stable partition: the items for which ``is_decode(item)`` holds, then the rest, each in their order.

    Alg. 2 line 2 (``B ← D``): vLLM serves ``self.running`` front to back with one budget.
    """
    decodes = [r for r in running if is_decode(r)]
    others = [r for r in running if not is_decode(r)]
    return decodes + others


@dataclass(frozen=True)
class StepPlan:
    """The budget chosen for one step (before vLLM's ``schedule()``).

    Attributes:
        decodes: running decode requests, d.
        decode_tokens: tokens the decodes need this step (1 each, more with speculative tokens).
        mean_context: mean KV context of the decodes, tokens (0 without decodes), c.
        prefill_budget: M, prefill tokens allowed, or ``None`` without an SLO.
        token_budget: the step's ``max_num_scheduled_tokens``: ``min(engine limit, decode tokens + M)``.
    """

    decodes: int
    decode_tokens: int
    mean_context: float
    prefill_budget: int | None
    token_budget: int


class StepPlanner:
    """The pure part of Alg. 2 around a :class:`StepLatencyTable` (no vLLM, no clock).

    Args:
        table: the latency table (shared with the metrics; callers hold ``lock`` while it changes).
        tpot_slo_s: SLO in seconds or ``None`` (record only).
        headroom: the fraction of the SLO a step is planned to use (0 < headroom <= 1). The table predicts a
            bucket's mean step time; steps scatter around it, so planning to the full SLO puts about half the
            mixed steps over it. A fixed margin, not a measured quantile.
    """

    def __init__(self, table: StepLatencyTable, tpot_slo_s: float | None, headroom: float = 1.0) -> None:
        if not 0 < headroom <= 1:
            raise ValueError(f"headroom must be in (0, 1], got {headroom!r}")
        self.table = table
        self.tpot_slo_s = tpot_slo_s
        self.headroom = headroom
        self.lock = threading.Lock()

    def plan(self, decode_contexts: Sequence[int], decode_tokens: int, engine_max_tokens: int) -> StepPlan:
        """Alg. 2 line 3: the budget for a step whose running decodes have these KV contexts (tokens).

        ``decode_tokens`` is what the decodes will schedule; ``engine_max_tokens`` the engine's own
        ``max_num_scheduled_tokens``. The token budget never exceeds the engine's limit.
        """
        d = len(decode_contexts)
        c = sum(decode_contexts) / d if d else 0.0
        if self.tpot_slo_s is None:
            return StepPlan(d, decode_tokens, c, None, engine_max_tokens)
        room = max(engine_max_tokens - decode_tokens, 0)
        with self.lock:
            m = self.table.prefill_budget(d, c, self.tpot_slo_s * self.headroom, room)
        return StepPlan(d, decode_tokens, c, m, min(engine_max_tokens, decode_tokens + m))

    def predict(self, prefill_tokens: int, mean_context: float, decodes: int) -> float | None:
        """The table's prediction (seconds) for an executed composition, ``None`` for an empty table."""
        with self.lock:
            return self.table.predict(prefill_tokens, mean_context, decodes)

    def record(self, prefill_tokens: int, mean_context: float, decodes: int, seconds: float) -> None:
        """Alg. 2 line 1: record a measured step."""
        with self.lock:
            self.table.record(prefill_tokens, mean_context, decodes, seconds)


# ----------------------------------------------------------------------------------------------- metrics
_TOKEN_BUCKETS = (0, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)


class _TableCollector(Collector):
    """Exposes the table's buckets as gauges, read under the planner's lock at scrape time."""

    def __init__(self, planner: StepPlanner) -> None:
        self.planner = planner

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["prefill_tokens", "context_tokens", "decodes"]
        seconds = GaugeMetricFamily("fulcrum_scheduler_step_table_seconds", "Step time of a table bucket (EWMA), s", labels=labels)
        samples = GaugeMetricFamily("fulcrum_scheduler_step_table_samples", "Measured steps in a table bucket (0 = prior)", labels=labels)
        mean_p = GaugeMetricFamily("fulcrum_scheduler_step_table_mean_prefill_tokens", "Mean prefill tokens of a bucket's steps", labels=labels)
        with self.planner.lock:
            entries = list(self.planner.table)
            measured = self.planner.table.measured_entries
        for e in entries:
            values = [str(e.key.prefill_tokens), str(e.key.context_tokens), str(e.key.decodes)]
            seconds.add_metric(values, e.seconds)
            samples.add_metric(values, e.samples)
            mean_p.add_metric(values, e.mean_prefill_tokens)
        count = GaugeMetricFamily("fulcrum_scheduler_table_entries", "Table buckets holding a measured step")
        count.add_metric([], measured)
        yield from (seconds, samples, mean_p, count)


class SchedulerMetrics:
    """The scheduler's prometheus-client metrics in their own registry (see the module doc for names)."""

    def __init__(self, planner: StepPlanner) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.budget = Gauge("fulcrum_scheduler_prefill_budget_tokens", "Prefill token budget M of the last step", registry=r)
        self.prefill = Histogram("fulcrum_scheduler_scheduled_prefill_tokens", "Prefill tokens scheduled per step",
                                 buckets=_TOKEN_BUCKETS, registry=r)
        self.step = Histogram("fulcrum_scheduler_step_seconds", "Measured step time, s", buckets=_SECONDS_BUCKETS, registry=r)
        self.predicted = Gauge("fulcrum_scheduler_predicted_step_seconds", "Predicted time of the last executed step, s", registry=r)
        self.budget_violations = Counter("fulcrum_scheduler_budget_violations", "Steps whose prefill tokens exceeded their budget", registry=r)
        self.slo_violations = Counter("fulcrum_scheduler_slo_violations", "Steps slower than the TPOT SLO", registry=r)
        self.steps = Counter("fulcrum_scheduler_steps", "Steps scheduled with at least one token", registry=r)
        self.slo = Gauge("fulcrum_scheduler_tpot_slo_seconds", "TPOT SLO the budget targets (0 = none), s", registry=r)
        r.register(_TableCollector(planner))

    def serve(self, port: int) -> None:
        """Serve ``/metrics`` on ``port`` in a daemon thread. Raises ``OSError`` when the port is taken."""
        start_http_server(port, registry=self.registry)


# ----------------------------------------------------------------------------------------------- vLLM glue
@dataclass
class _Pending:
    """A scheduled step waiting for its output: its composition, budget and the time schedule() ended."""

    prefill_tokens: int
    decodes: int
    mean_context: float
    prefill_budget: int | None
    scheduled_at: float


class _SLOAwareMixin:
    """The vLLM-facing behaviour; combined with vLLM's ``Scheduler``/``AsyncScheduler`` on first access."""

    # attributes of vLLM's Scheduler this mixin relies on (for readers; set by the base class)
    running: list[Any]
    requests: dict[str, Any]
    max_num_scheduled_tokens: int
    scheduler_config: Any
    has_requests: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = SchedulerSettings.from_env(os.environ)
        table = _initial_table(settings)
        self._fulcrum_settings = settings
        self._fulcrum_planner = StepPlanner(table, settings.tpot_slo_s, settings.slo_headroom)
        self._fulcrum_metrics = SchedulerMetrics(self._fulcrum_planner)
        self._fulcrum_metrics.slo.set(settings.tpot_slo_s or 0.0)
        self._fulcrum_pending: OrderedDict[int, tuple[Any, _Pending]] = OrderedDict()
        self._fulcrum_last_save = time.monotonic()
        self._fulcrum_dirty = False  # measurements not yet saved
        self._fulcrum_log = None if settings.step_log is None else open(settings.step_log, "a", buffering=1)
        self._fulcrum_chunked = bool(getattr(self.scheduler_config, "enable_chunked_prefill", True))
        if settings.tpot_slo_s is not None and not self._fulcrum_chunked:
            log.warning("fulcrum: chunked prefill is off, so a prompt longer than the budget could never run; "
                        "recording steps without lowering the budget")
        if settings.metrics_port is not None:
            try:
                self._fulcrum_metrics.serve(settings.metrics_port)
            except OSError as err:
                log.warning("fulcrum: cannot serve scheduler metrics on port %d: %s", settings.metrics_port, err)
        log.info("fulcrum: SLO-aware scheduler (%s) with TPOT SLO %s, %d table buckets (%d measured)%s",
                 _base_name(type(self)),
                 "none (recording only)" if settings.tpot_slo_s is None else f"{settings.tpot_slo_s * 1e3:g} ms",
                 len(table), table.measured_entries,
                 "" if settings.metrics_port is None else f", metrics on port {settings.metrics_port}")

    @staticmethod
    def _fulcrum_is_decode(request: Any) -> bool:
        """A running request whose known tokens are all computed but the last: it needs one decode step."""
        return bool(request.num_computed_tokens >= request.num_tokens - 1)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        decode_ctx: dict[str, int] = {}
        decode_tokens = 0
        for r in self.running:
            if self._fulcrum_is_decode(r):
                decode_ctx[r.request_id] = int(r.num_computed_tokens)
                decode_tokens += 1 + len(getattr(r, "spec_token_ids", None) or ())
        engine_max = self.max_num_scheduled_tokens
        plan = self._fulcrum_planner.plan(list(decode_ctx.values()), decode_tokens, engine_max)
        steer = plan.prefill_budget is not None and self._fulcrum_chunked
        if steer:
            self.running[:] = partition_decodes_first(self.running, lambda r: r.request_id in decode_ctx)
            self.max_num_scheduled_tokens = plan.token_budget
        try:
            output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        finally:
            self.max_num_scheduled_tokens = engine_max
        self._fulcrum_after_schedule(output, decode_ctx, plan.prefill_budget if steer else None)
        return output

    def _fulcrum_after_schedule(self, output: Any, decode_ctx: dict[str, int], budget: int | None) -> None:
        scheduled: dict[str, int] = output.num_scheduled_tokens
        if not scheduled:
            return
        contexts = [decode_ctx[rid] for rid in scheduled if rid in decode_ctx]
        prefill = sum(n for rid, n in scheduled.items() if rid not in decode_ctx)
        m = self._fulcrum_metrics
        m.steps.inc()
        m.prefill.observe(prefill)
        if budget is not None:
            m.budget.set(budget)
            if prefill > budget:
                m.budget_violations.inc()
        mean_ctx = sum(contexts) / len(contexts) if contexts else 0.0
        self._fulcrum_pending[id(output)] = (output, _Pending(prefill, len(contexts), mean_ctx, budget, time.monotonic()))
        while len(self._fulcrum_pending) > 16:  # outputs the engine dropped (aborted steps) must not pile up
            self._fulcrum_pending.popitem(last=False)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        now = time.monotonic()
        item = self._fulcrum_pending.pop(id(scheduler_output), None)
        if item is not None and item[0] is scheduler_output:
            self._fulcrum_record(item[1], now - item[1].scheduled_at)
            self._fulcrum_dirty = True
        result = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        if self._fulcrum_settings.table_path is not None and self._fulcrum_dirty and (
            now - self._fulcrum_last_save >= self._fulcrum_settings.save_interval_s
            or not self.has_requests()  # the end of a burst: the engine may now idle (or be stopped) for long
        ):
            self._fulcrum_save()
        return result

    def _fulcrum_record(self, step: _Pending, seconds: float) -> None:
        planner, m = self._fulcrum_planner, self._fulcrum_metrics
        predicted = planner.predict(step.prefill_tokens, step.mean_context, step.decodes)
        if predicted is not None:
            m.predicted.set(predicted)
        planner.record(step.prefill_tokens, step.mean_context, step.decodes, seconds)
        if self._fulcrum_log is not None:
            self._fulcrum_log.write(json.dumps({
                "t": round(step.scheduled_at, 6), "prefill": step.prefill_tokens, "decodes": step.decodes,
                "context": round(step.mean_context, 1), "budget": step.prefill_budget,
                "seconds": round(seconds, 6), "predicted": None if predicted is None else round(predicted, 6),
            }) + "\n")
        m.step.observe(seconds)
        slo = self._fulcrum_settings.tpot_slo_s
        if slo is not None and step.decodes > 0 and seconds > slo:
            m.slo_violations.inc()

    def _fulcrum_save(self) -> None:
        path = self._fulcrum_settings.table_path
        self._fulcrum_last_save = time.monotonic()
        if path is None or not self._fulcrum_dirty:
            return
        self._fulcrum_dirty = False
        try:
            with self._fulcrum_planner.lock:
                self._fulcrum_planner.table.save(path)
        except OSError as err:
            log.warning("fulcrum: cannot save the step table to %s: %s", path, err)

    def shutdown(self) -> None:
        self._fulcrum_save()
        if self._fulcrum_log is not None:
            self._fulcrum_log.close()
            self._fulcrum_log = None
        super().shutdown()  # type: ignore[misc]


def _base_name(cls: type) -> str:
    """The name of the vLLM class the mixin extends in ``cls`` (``Scheduler`` or ``AsyncScheduler``)."""
    mro = cls.__mro__
    return mro[mro.index(_SLOAwareMixin) + 1].__name__


def _initial_table(settings: SchedulerSettings) -> StepLatencyTable:
    """The table at start: the saved file if it exists, else empty; then seeded from the profile if asked."""
    path = settings.table_path
    if path is not None and path.is_file():
        table = StepLatencyTable.load(path)
        table.min_prefill_tokens = settings.min_prefill_tokens
    else:
        table = StepLatencyTable(min_prefill_tokens=settings.min_prefill_tokens)
    if settings.seed_profile is not None:
        from fulcrum.ratio.profile import load_profile
        from fulcrum.ratio.profiles import builtin_profile

        name = settings.seed_profile
        profile = load_profile(Path(name)) if Path(name).is_file() else builtin_profile(name)
        table.seed_from_profile(profile, settings.seed_tp)
    return table


@functools.cache
def _scheduler_classes() -> dict[str, type]:
    """Build the vLLM scheduler classes (imports vLLM)."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        config = kwargs.get("vllm_config", args[0] if args else None)
        if cls is sync_cls and getattr(getattr(config, "scheduler_config", None), "async_scheduling", False):
            cls = async_cls
        return object.__new__(cls)

    doc = "Libra Alg. 2 on vLLM's {}: decodes first, prefill budget from the step latency table (module doc)."
    sync_cls = type("SLOAwareScheduler", (_SLOAwareMixin, Scheduler),
                    {"__new__": __new__, "__module__": __name__, "__doc__": doc.format("Scheduler")})
    async_cls = type("SLOAwareAsyncScheduler", (sync_cls, AsyncScheduler),
                     {"__module__": __name__, "__doc__": doc.format("AsyncScheduler")})
    return {"SLOAwareScheduler": sync_cls, "SLOAwareAsyncScheduler": async_cls}


def __getattr__(name: str) -> Any:
    """``SLOAwareScheduler`` and ``SLOAwareAsyncScheduler`` are built (importing vLLM) on first access."""
    if name in ("SLOAwareScheduler", "SLOAwareAsyncScheduler"):
        return _scheduler_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
