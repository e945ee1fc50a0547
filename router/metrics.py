"""The router's Prometheus metrics, ``fulcrum_router_*``, on a registry of their own.

Demand is measured where it arrives (DESIGN, "Everything observable"): the operator's observe step reads the
admitted rate, ISL and OSL histograms from here, and the per-instance load gauges show what the policies saw.

Per-instance gauges are read from the upstream pool at scrape time (a custom collector), so dispatching a
request costs no gauge update. Latencies are seconds, lengths tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from fulcrum.routing.base import InstanceView

__all__ = ["RouterMetrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TOKENS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_PHI = tuple(i / 20 for i in range(1, 21))


class _InstanceCollector(Collector):
    """Per-instance gauges from the pool's live views."""

    def __init__(self, views: Callable[[], Sequence[InstanceView]]) -> None:
        self._views = views

    def collect(self) -> Iterable[GaugeMetricFamily]:
        views = list(self._views())
        fams = {
            "inflight": GaugeMetricFamily("fulcrum_router_instance_inflight", "Requests dispatched and not finished", labels=["instance", "role"]),
            "queued": GaugeMetricFamily("fulcrum_router_instance_queued_prefill_tokens", "Prompt tokens dispatched and not yet prefilled", labels=["instance", "role"]),
            "running": GaugeMetricFamily("fulcrum_router_instance_running_tokens", "KV tokens of running requests (context so far)", labels=["instance", "role"]),
            "healthy": GaugeMetricFamily("fulcrum_router_instance_healthy", "1 when healthy and not ejected", labels=["instance", "role"]),
            "draining": GaugeMetricFamily("fulcrum_router_instance_draining", "1 while the router config lists the instance as draining (no new requests)", labels=["instance", "role"]),
        }
        available = GaugeMetricFamily("fulcrum_router_instances_available",
                                      "Instances that may take new requests (healthy, not ejected, not draining); 0 with none known")
        available.add_metric([], float(sum(1 for v in views if v.available)))
        for v in views:
            lab = [v.id, v.role]
            fams["inflight"].add_metric(lab, v.inflight)
            fams["queued"].add_metric(lab, v.queued_prefill_tokens)
            fams["running"].add_metric(lab, v.running_tokens)
            fams["healthy"].add_metric(lab, 1.0 if v.available else 0.0)
            fams["draining"].add_metric(lab, 1.0 if v.draining else 0.0)
        return [*fams.values(), available]


class RouterMetrics:
    """All ``fulcrum_router_*`` metrics. ``attach_pool`` adds the per-instance gauges."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.admitted = Counter("fulcrum_router_requests_admitted", "Requests that passed validation", ["endpoint"], registry=r)
        self.responses = Counter("fulcrum_router_responses", "Answers by HTTP status", ["endpoint", "status"], registry=r)
        self.input_tokens = Histogram("fulcrum_router_input_tokens", "Prompt length (ISL), tokens", buckets=_TOKENS, registry=r)
        self.predicted_output_tokens = Histogram("fulcrum_router_predicted_output_tokens", "Predicted output length, tokens", buckets=_TOKENS, registry=r)
        self.output_tokens = Histogram("fulcrum_router_output_tokens", "Generated length (OSL), tokens", buckets=_TOKENS, registry=r)
        self.ttft = Histogram("fulcrum_router_ttft_seconds", "Time to first token seen by the client", buckets=_SECONDS, registry=r)
        self.itl = Histogram("fulcrum_router_itl_seconds", "Gap between successive writes of tokens to the client (events an upstream read delivered together leave in one write)", buckets=_ITL, registry=r)
        self.tpot = Histogram("fulcrum_router_tpot_seconds", "Time per output token after the first", buckets=_ITL, registry=r)
        self.e2e = Histogram("fulcrum_router_e2e_seconds", "Request latency end to end", buckets=_SECONDS, registry=r)
        self.routed = Counter("fulcrum_router_routed_requests", "Requests by how they ran", ["kind"], registry=r)
        self.decisions = Counter("fulcrum_router_policy_decisions", "Policy decisions by policy, kind and reason (first word)", ["policy", "kind", "reason"], registry=r)
        self.split_ratio = Histogram("fulcrum_router_split_ratio", "Split ratio phi = s / L of split requests", buckets=_PHI, registry=r)
        self.handoff = Histogram("fulcrum_router_handoff_seconds", "From engine A's answer to engine B's first token", ["kind"], buckets=_SECONDS, registry=r)
        self.kv_transfer = Histogram("fulcrum_router_kv_transfer_seconds", "Engine B's time to first token on transferred KV (an upper bound of the transfer)", ["kind"], buckets=_SECONDS, registry=r)
        self.handoff_guard = Counter("fulcrum_router_handoff_guard", "Handoffs the block-coverage guard changed", ["action"], registry=r)
        self.ejections = Counter("fulcrum_router_ejections", "Instances ejected", ["instance", "cause"], registry=r)
        self.retries = Counter("fulcrum_router_retries", "Upstream calls retried on another instance", ["stage"], registry=r)
        self.aborts = Counter("fulcrum_router_client_aborts", "Requests whose client went away (upstream work cancelled)", registry=r)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._decisions: dict[tuple[str, str, str], Any] = {}
        self.upstream_errors = Counter("fulcrum_router_upstream_errors", "Upstream failures by cause", ["cause"], registry=r)
        # the NATS prefill queue (router config prefill_queue.kind: nats)
        self.prefill_queue_depth = Gauge("fulcrum_router_prefill_queue_depth", "Prefill jobs in the NATS queue not yet taken by any prefill worker (demand at admission)", registry=r)
        self.prefill_jobs_waiting = Gauge("fulcrum_router_prefill_jobs_waiting", "Prefill jobs this router submitted and awaits a reply for", registry=r)
        self.prefill_jobs = Counter("fulcrum_router_prefill_jobs", "Prefill jobs by outcome: ok, failed (the workers' error), timeout (no worker replied), unavailable (NATS unreachable), direct (fell back to HTTP)", ["outcome"], registry=r)
        # DOPD Alg. 1 prefill grouping (policy disaggregated, batch_timeout_s > 0)
        self.prefill_groups = Counter("fulcrum_router_prefill_groups", "Prefill groups released by DOPD Alg. 1, by cause: long, full, budget, timeout, flush (the prefill instance was idle)", ["cause"], registry=r)
        self.prefill_group_prompts = Histogram("fulcrum_router_prefill_group_prompts", "Prompts per released prefill group", buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.prefill_group_wait = Histogram("fulcrum_router_prefill_group_wait_seconds", "How long a released prefill group's first prompt waited at the gate", buckets=_SECONDS, registry=r)
        self.prefill_job_seconds = Histogram("fulcrum_router_prefill_job_seconds", "From publishing a prefill job to its reply (queueing + prefill)", buckets=_SECONDS, registry=r)
        # in-flight rebalancing (router config rescheduling / roles / kv_connector; docs/rebalancing.md)
        self.migrations = Counter("fulcrum_router_migrations", "Running requests migrated to another instance (recompute migration), by reason: load (ARES Alg. 1), duty (the source took prefill duty), forced", ["reason"], registry=r)
        self.migration_seconds = Histogram("fulcrum_router_migration_seconds", "From cutting a migrated request on its source to the target's first token (the client's pause)", buckets=_SECONDS, registry=r)
        self.migrated_tokens = Counter("fulcrum_router_migrated_tokens", "Context tokens (prompt + generated so far) the targets of migrations recomputed", registry=r)
        self.migration_fallbacks = Counter("fulcrum_router_migration_fallbacks", "Continuations whose instance failed and were resumed elsewhere, by where: other, source", ["to"], registry=r)
        self.role_changes = Counter("fulcrum_router_role_changes", "Duty changes of `both` instances (BanaServe Alg. 1 role flips)", ["to_duty"], registry=r)
        self.instance_duty = Gauge("fulcrum_router_instance_duty", "1 for the duty a `both` instance currently has (role reassignment)", ["instance", "duty"], registry=r)
        self.prefix_pulls = Counter("fulcrum_router_prefix_pulls", "Cached prefixes held by another instance: pulled over the KV connector, or recomputed and why", ["outcome"], registry=r)
        self.prefix_pull_tokens = Counter("fulcrum_router_prefix_pull_tokens", "Prefix tokens whose KV was pulled from the instance holding them", registry=r)

    def child(self, metric: Counter | Histogram, *labels: str) -> Any:
        """``metric.labels(*labels)``, cached (the lookup costs more than the increment on the hot path)."""
        key = (id(metric), labels)
        got = self._children.get(key)
        if got is None:
            got = self._children[key] = metric.labels(*labels)
        return got

    def attach_pool(self, views: Callable[[], Sequence[InstanceView]]) -> None:
        """Expose per-instance gauges read from ``views()`` at scrape time."""
        self.registry.register(_InstanceCollector(views))

    def prefill_group(self, batch: Any) -> None:
        """Count one released DOPD Alg. 1 group (a :class:`fulcrum.routing.batcher.PrefillBatch`)."""
        self.child(self.prefill_groups, batch.cause).inc()
        self.prefill_group_prompts.observe(len(batch.items))
        self.prefill_group_wait.observe(max(0.0, batch.released_at - batch.opened_at))

    def decision(self, policy: str, kind: str, reason: str, phi: float | None) -> None:
        """Count one policy decision (reason: its first word)."""
        key = (policy, kind, reason)
        counter = self._decisions.get(key)
        if counter is None:
            word = reason.split(maxsplit=1)[0].strip(":,;.").lower() if reason.strip() else "none"
            counter = self.child(self.decisions, policy, kind, word[:40])
            if len(self._decisions) < 4096:  # reasons with numbers in them would grow it without end
                self._decisions[key] = counter
        counter.inc()
        if phi is not None and kind == "split":
            self.split_ratio.observe(phi)

    def exposition(self) -> bytes:
        """The text exposition format of every metric."""
        return generate_latest(self.registry)
