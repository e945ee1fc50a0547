"""The kopf handlers: reconcile an ``LLMServe`` and run its control loop every ``spec.scaling.intervalSeconds``.

:class:`Controller` holds the logic as plain async methods over :class:`~fulcrum.controller.objects.KubeObjects`
(the objects it reads and writes: the Kubernetes API in the operator, an in-memory store in the logic tests, which
call the methods directly); :func:`register` binds them to kopf:

- **create / update (spec) / resume** → :meth:`Controller.reconcile`: validate the spec with the pydantic model
  (a bad spec that slipped past the CRD schema → condition Degraded/InvalidSpec, a Warning Event, nothing
  applied), build every object (``resources.build_objects``) for the target in force — read back from
  ``status.pools`` after an operator restart, so a restart converges instead of resetting the pools — and
  server-side apply it (``apply.py``), then write the status.
- **daemon** (one per LLMServe) → :meth:`Controller.interval` every interval:
  :meth:`fulcrum.scaling.loop.ControlLoop.run_interval` — the loop ``fulcrum replay`` runs — on
  :class:`KubernetesCluster` (the :class:`fulcrum.cluster.Cluster` over this API): observe (Prometheus) →
  forecast → plan (the planner ``spec.scaling.planner`` names) → apply scale-outs at once, drain scale-ins
  (``drain.py``) → Events for every scale decision with its reason → status and metrics. Prometheus down or
  empty → Degraded and the target held (never scale in blind).
- **delete** → :meth:`Controller.deleted`: the children carry ownerReferences, so Kubernetes' garbage collector
  deletes them; the handler only forgets the loop and its metrics (optional: deletion never waits for the
  operator).

Errors: Kubernetes API failures (after ``apply.py``'s retries: 409, 429, 5xx, no answer) raise
``kopf.TemporaryError`` from the create/update handlers (kopf retries with backoff) and are counted in
``fulcrum_operator_reconcile_errors_total``; the daemon logs them and tries again at the next interval. An apply
the API server *rejects* (any other 4xx but 401 and 408, e.g. 422 Invalid: a pod template Kubernetes refuses) is
permanent for that generation: the same objects would be refused again, so it is not retried by kopf — the handler
returns, the status says Degraded/``ApplyRejected`` with the API server's message, and one Warning Event is
posted per generation (as for an invalid spec). The daemon still tries once per interval (an admission policy or
RBAC fixed meanwhile is picked up); a new generation is reconciled at once.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, TypeVar

import yaml

from fulcrum.api.llmserve import API_VERSION, KIND, LLMServe, parse_llmserve
from fulcrum.cancellation import cancel_and_wait
from fulcrum.cluster import ObservationError
from fulcrum.errors import FulcrumError, ProfileError, SpecError, safe_yaml, yaml_problem
from fulcrum.observation import Observation, ReadyCounts
from fulcrum.ratio.feasibility import condition_reason
from fulcrum.ratio.profile import PerformanceProfile, load_profile, profile_from_dict
from fulcrum.ratio.profiles import builtin_profile
from fulcrum.scaling.loop import ControlLoop, LoopOutcome, distribute, external_replicas
from fulcrum.target import ClusterTarget, Pool

from fulcrum.controller.apply import RETRY_STATUSES, ApplyReport, KubeApiError
from fulcrum.controller.drain import (DELETION_COST_ANNOTATION, DrainResult, PodLoad, drain_pool, draining_from_metrics,
                                     load_from_metrics)
from fulcrum.controller.metrics import OperatorMetrics
from fulcrum.controller.objects import KubeObjects
from fulcrum.controller.observe import PrometheusObserver, QueryClient, Selectors
from fulcrum.controller.resources import (
    LABEL_COMPONENT,
    LABEL_LLMSERVE,
    LABEL_POOL,
    MODE_POOLS,
    build_objects,
    initial_target,
    pool_deployment_name,
    router_name,
    worker_selector,
)
from fulcrum.controller.status import (build_status, degraded_reason, get_condition, slo_infeasibility,
                                      target_from_status)

__all__ = ["GROUP", "VERSION", "PLURAL", "ControllerSettings", "Controller", "KubernetesCluster", "register",
           "fetch_text", "in_cluster_server"]

GROUP, VERSION, PLURAL = "fulcrum.dev", "v1alpha1", "llmserves"
_A = TypeVar("_A")
_R = TypeVar("_R")
log = logging.getLogger("fulcrum.operator")
_NO_EVENT = object()  # no InvalidSpec Event posted yet (a generation may be None)


@dataclass(frozen=True)
class ControllerSettings:
    """Operator-wide settings (from ``fulcrum operator`` flags).

    Attributes:
        image: the Fulcrum control-plane image (router and sim-worker pods).
        prometheus_url: where to observe; None = no observation (every interval is Degraded, nothing scales).
        drain_poll_s: seconds between polls of a draining pod's ``/metrics`` (short enough to notice an idle
            pod within a few seconds, long enough not to load the pods).
        metrics_timeout_s: one ``/metrics`` read of a worker pod, seconds.
        default_etcd / default_nats: connectors for LLMServes whose ``spec.connectors.etcd`` / ``.nats`` is empty
            (the Helm chart's bundled etcd and NATS); "" = none. A spec's own value always wins.
    """

    image: str
    prometheus_url: str | None = None
    drain_poll_s: float = 5.0
    metrics_timeout_s: float = 3.0
    default_etcd: str = ""
    default_nats: str = ""


async def fetch_text(url: str, timeout_s: float) -> str:
    """GET ``url`` (a pod's ``/metrics``) with aiohttp; raises ``OSError`` on any failure."""
    import aiohttp

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
            async with s.get(url) as resp:
                if resp.status != 200:
                    raise OSError(f"GET {url}: HTTP {resp.status}")
                return await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        raise OSError(f"GET {url}: {err}") from err


@dataclass
class _Runtime:
    """What the operator keeps per LLMServe between intervals (rebuilt from status after a restart)."""

    serve: LLMServe
    generation: int | None
    loop: ControlLoop
    applied: ClusterTarget
    profile: PerformanceProfile
    observer: PrometheusObserver | None
    draining: list[str] = field(default_factory=list)
    degraded: str | None = None
    loop_previous: ClusterTarget = field(default_factory=ClusterTarget)
    apply_rejected: str | None = None
    """Why the API server rejected this generation's objects (the Degraded/ApplyRejected message), or None."""
    apply_rejected_event: int | None = None
    """The generation whose ApplyRejected Event was posted (one per generation)."""
    warmed: bool = False
    drains: dict[Pool, asyncio.Task[None]] = field(default_factory=dict)
    """Drains in flight, by pool (background tasks: the control loop goes on meanwhile). Shared by the
    runtimes of one LLMServe across spec generations, like ``apply_lock`` and ``drain_notes``."""
    apply_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Serialises applies: an interval's and a drain's never interleave (a pool's replicas have one writer)."""
    drain_notes: list[str] = field(default_factory=list)
    """Drain timeouts and failures since the last interval (its Degraded message)."""
    drain_plans: dict[Pool, tuple[int, int, str]] = field(default_factory=dict)
    """What each drain in flight does: pool → (replicas before, replicas after, the plan's reason). Shared like
    ``drains``."""
    grown: dict[Pool, tuple[int, int]] = field(default_factory=dict)
    """The pools the interval's apply grew: pool → (replicas before, after) (its ScaledOut Events)."""
    loop_degraded: str | None = None
    """The Degraded reason of the last interval's own outcome (ObservationUnavailable, PlanningFailed), None when it
    planned: its Warning Event is posted once per cause, whatever drain notes say meanwhile."""


#: 4xx answers that are not a rejection of the objects: credentials to refresh, a request that timed out.
_TRANSIENT_4XX = frozenset({401, 408})


def _rejected(err: KubeApiError) -> bool:
    """The API server refused the objects themselves (400, 403 from an admission policy, 404, 422 Invalid…): applying
    them again cannot succeed. Not 409/429 (``apply.py`` retries them) nor :data:`_TRANSIENT_4XX`."""
    return 400 <= err.status < 500 and err.status not in RETRY_STATUSES and err.status not in _TRANSIENT_4XX


def _key(body: Mapping[str, Any]) -> str:
    meta = body.get("metadata", {})
    return f"{meta.get('namespace', 'default')}/{meta.get('name', '')}"


def _ready(pod: Mapping[str, Any]) -> bool:
    for c in (pod.get("status") or {}).get("conditions") or ():
        if c.get("type") == "Ready":
            return bool(c.get("status") == "True")
    return False


def _http_port(pod: Mapping[str, Any]) -> int:
    for c in (pod.get("spec") or {}).get("containers") or ():
        for p in c.get("ports") or ():
            if p.get("name") == "http" and isinstance(p.get("containerPort"), int):
                return int(p["containerPort"])
    return 8000


class Controller:
    """The reconcile and interval logic (module doc); one per operator process.

    Args:
        objects: the Kubernetes objects it reads and writes (:class:`~fulcrum.controller.objects.ApiObjects` in
            the operator, :class:`~fulcrum.controller.objects.InMemoryObjects` in the logic tests).
        settings: operator-wide settings.
        metrics: where ``fulcrum_operator_*`` go.
        prometheus: makes a query client for a URL (default ``prometheus_api_client.PrometheusConnect``).
        clock: wall-clock seconds (the planner's time axis: cooldowns, stabilisation windows).
        monotonic: monotonic seconds (drain timeouts); sleep: async sleep (drain polling).
        now: the current UTC time (condition transition times, event timestamps).
        fetch: GETs a URL's text (pod ``/metrics``).
    """

    def __init__(
        self,
        objects: KubeObjects,
        settings: ControllerSettings,
        *,
        metrics: OperatorMetrics | None = None,
        prometheus: Callable[[str], QueryClient] | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        now: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
        fetch: Callable[[str, float], Awaitable[str]] = fetch_text,
    ) -> None:
        self.objects = objects
        self.settings = settings
        self.metrics = metrics or OperatorMetrics()
        self._prometheus = prometheus or _prometheus_connect
        self.clock = clock
        self.monotonic = monotonic
        self.sleep = sleep
        self.now = now
        self.fetch = fetch
        self.runtimes: dict[str, _Runtime] = {}
        self.invalid_spec_events: dict[str, Any] = {}
        """Per LLMServe (``namespace/name``): the generation whose InvalidSpec Event was posted (one per generation,
        kept here rather than on its runtime, which an LLMServe invalid from the start never gets)."""

    # ----------------------------------------------------------------------------------------- parsing
    def _parse(self, body: Mapping[str, Any]) -> LLMServe:
        meta = body.get("metadata", {})
        spec = dict(body.get("spec") or {})
        connectors = dict(spec.get("connectors") or {})
        for key, default in (("etcd", self.settings.default_etcd), ("nats", self.settings.default_nats)):
            if default and not connectors.get(key):
                connectors[key] = default  # the operator-wide connector (the chart's bundled one)
        if connectors:
            spec["connectors"] = connectors
        serve = parse_llmserve({"apiVersion": API_VERSION, "kind": KIND,
                                "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace", "default")},
                                "spec": spec})
        # checked here, after the operator-wide default, not by the CRD or the model: a spec may leave the URL to
        # the operator (the chart's bundled NATS), and fulcrum replay/plan never use the queue
        if serve.spec.router.prefill_queue == "nats" and not serve.spec.connectors.nats:
            raise SpecError("router.prefillQueue nats needs a NATS URL: set spec.connectors.nats, or give the "
                            "operator one (--nats-url, FULCRUM_NATS_URL; the Helm chart's nats.enabled)")
        return serve

    def _profile(self, serve: LLMServe) -> PerformanceProfile:
        ref = serve.spec.profile
        if ref.name:
            return builtin_profile(ref.name)
        if ref.path:
            return load_profile(ref.path)
        return self._configmap_profile(serve.metadata.namespace, str(ref.config_map))

    def _configmap_profile(self, namespace: str, name: str, key: str = "profile.yaml") -> PerformanceProfile:
        """The profile in ConfigMap ``namespace/name`` under ``key`` (``spec.profile.configMap``).

        Every problem is one line naming the ConfigMap and the key — a YAML error with its line and column, as the
        file readers word it (:func:`fulcrum.errors.yaml_problem`), not PyYAML's caret diagram — so the condition
        and the Event say where to look.

        Raises:
            ProfileError: the ConfigMap or its key is missing, the text is empty, only comments, not valid YAML,
                nested too deeply or not a mapping, or the profile in it is invalid.
        """
        cm = self.objects.get("v1", "ConfigMap", namespace, name)
        if cm is None:
            raise ProfileError(f"profile ConfigMap {namespace}/{name} not found")
        data = cm.get("data") or {}
        if key not in data:
            raise ProfileError(f"profile ConfigMap {namespace}/{name} has no key {key}: put the profile's YAML there")
        where = f"profile ConfigMap {namespace}/{name} key {key}"
        text = data[key]
        if not isinstance(text, str):
            raise ProfileError(f"{where}: expected the profile's YAML text, got {type(text).__name__}")
        try:
            doc = safe_yaml(text)
        except yaml.YAMLError as err:  # one line: key:line:column and the problem (a timestamp PyYAML cannot build too)
            line, what = yaml_problem(err)
            raise ProfileError(f"{where}{line}: not valid YAML: {what}") from err
        except RecursionError as err:
            raise ProfileError(f"{where}: not valid YAML: nested too deeply") from err
        if doc is None:
            raise ProfileError(f"{where}: holds no profile (empty or only comments): expected a mapping of the "
                               "profile's fields")
        if not isinstance(doc, dict):
            raise ProfileError(f"{where}: expected a mapping of the profile's fields, got {type(doc).__name__}")
        if doc.get("name") is None:  # the name it always had (the router's inline copy of the profile carries it)
            doc["name"] = f"configmap/{name}"
        return profile_from_dict(doc, origin=where)

    def _runtime(self, body: Mapping[str, Any], serve: LLMServe) -> _Runtime:
        """The runtime of this LLMServe; (re)built on first sight and on every new generation (spec change)."""
        key = _key(body)
        meta = body.get("metadata", {})
        gen = meta.get("generation")
        rt = self.runtimes.get(key)
        if rt is not None and rt.generation == gen:
            return rt
        profile = self._profile(serve)
        if rt is not None and rt.serve.spec.mode == serve.spec.mode:
            current = rt.loop.current
        elif rt is not None:  # a mode switch replaces the pools: start from the new mode's initial pools
            current = initial_target(serve, profile)
        else:
            # an operator restart: the target in force as last written to status (converge, do not reset)
            current = target_from_status(body.get("status")) or initial_target(serve, profile)
            if not any(size.replicas for _, size in current.pools()):
                current = initial_target(serve, profile)
        total = external_replicas(serve.spec)
        if total is not None:
            current = distribute(total, current, max_gpus=serve.spec.scaling.max_gpus)
        loop = ControlLoop(serve.spec, profile, current)
        observer = None
        if self.settings.prometheus_url:
            slo = serve.spec.slo
            observer = PrometheusObserver(self._prometheus(self.settings.prometheus_url),
                                          Selectors.for_llmserve(serve.metadata.name, serve.metadata.namespace),
                                          ttft_slo_s=slo.ttft_ms / 1000.0, tpot_slo_s=slo.tpot_ms / 1000.0,
                                          percentile=slo.percentile, max_model_len=serve.spec.engine.max_model_len)
        new = _Runtime(serve=serve, generation=gen, loop=loop, applied=rt.applied if rt else current,
                       profile=profile, observer=observer, draining=list(rt.draining) if rt else [],
                       degraded=rt.degraded if rt else None, loop_degraded=rt.loop_degraded if rt else None)
        if rt is not None:  # drains in flight go on under the new spec (they look the runtime up by key)
            new.drains, new.apply_lock, new.drain_notes = rt.drains, rt.apply_lock, rt.drain_notes
            new.drain_plans = rt.drain_plans
        self.runtimes[key] = new
        return new

    # ----------------------------------------------------------------------------------------- I/O helpers
    def _objects(self, rt: _Runtime, body: Mapping[str, Any], target: ClusterTarget) -> list[dict[str, Any]]:
        uid = str(body.get("metadata", {}).get("uid") or "")
        objs: list[dict[str, Any]] = build_objects(rt.serve, target, uid=uid, image=self.settings.image, draining=rt.draining,
                             profile=None if rt.serve.spec.profile.name else rt.profile)
        return objs

    async def _apply(self, rt: _Runtime, body: Mapping[str, Any], target: ClusterTarget) -> ApplyReport:
        """Apply every object for ``target``, never scaling a pool in: a pool of the spec's mode that
        ``target`` shrinks (:func:`_shrinking`), or whose drain is in flight, keeps the replicas last applied —
        only its drain lowers them (through :meth:`_apply_locked`). Pools outside the mode are not deployed
        and follow ``target``. Serialised per LLMServe (``apply_lock``); ``rt.applied`` is what was applied."""
        async with rt.apply_lock:
            for pool in _shrinking(rt, target) | set(rt.drains):
                target = target.with_replicas(pool, rt.applied.pool(pool).replicas)
            return await self._apply_locked(rt, body, target)

    async def _apply_locked(self, rt: _Runtime, body: Mapping[str, Any], target: ClusterTarget) -> ApplyReport:
        objs = self._objects(rt, body, target)
        report = await asyncio.to_thread(self.objects.apply_all, objs)
        rt.applied = target
        pruned = await asyncio.to_thread(self.objects.prune, rt.serve.metadata.namespace,
                                         f"{LABEL_LLMSERVE}={rt.serve.metadata.name}", objs)
        for what in pruned:
            log.info("%s: deleted %s (no longer part of the spec)", _key(body), what)
        for dep, live, want in report.reverted:
            owner = ("spec.router.replicas sets the router's count: change it there"
                     if dep == router_name(rt.serve.metadata.name)
                     else "set spec.scaling.replicaOwner: External to own the count")
            msg = f"Deployment {dep}: replicas edited to {live} outside the operator; reverted to {want} ({owner})"
            log.warning(msg)
            await self.event(body, "Warning", "ReplicasReverted", msg)
        return report

    def read_ready(self, serve: LLMServe) -> ReadyCounts:
        """Ready instances per pool: the pool Deployments' ``status.readyReplicas`` (blocking API reads).

        Raises:
            KubeApiError: the API failed after retries.
        """
        counts: dict[str, int] = {}
        for pool in Pool:
            dep = self.objects.get("apps/v1", "Deployment", serve.metadata.namespace,
                                   pool_deployment_name(serve.metadata.name, pool))
            counts[pool.value] = int(((dep or {}).get("status") or {}).get("readyReplicas") or 0)
        return ReadyCounts(**counts)

    async def _ready_counts(self, serve: LLMServe) -> ReadyCounts:
        return await asyncio.to_thread(self.read_ready, serve)

    async def event(self, body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        """Post a core/v1 Event on the LLMServe; failures are logged, never raised."""
        meta = body.get("metadata", {})
        ns = str(meta.get("namespace", "default"))
        ts = self.now().astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        ev = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta.get('name')}.", "namespace": ns},
            "involvedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": meta.get("name"), "namespace": ns,
                               "uid": meta.get("uid"), "resourceVersion": meta.get("resourceVersion")},
            "reason": reason, "message": message[:1024], "type": type_,
            "source": {"component": "fulcrum-operator"}, "reportingComponent": "fulcrum-operator",
            "firstTimestamp": ts, "lastTimestamp": ts, "count": 1,
        }
        try:
            await asyncio.to_thread(self.objects.post_event, ev)
        except KubeApiError as err:
            log.warning("could not post event %s on %s: %s", reason, _key(body), err)

    async def _write_status(self, body: Mapping[str, Any], status: Mapping[str, Any]) -> bool:
        """Merge-patch the status subresource; False when the LLMServe is gone (404)."""
        meta = body.get("metadata", {})
        return await asyncio.to_thread(self.objects.write_status, str(meta.get("namespace", "default")),
                                       str(meta.get("name")), status)

    async def _invalid(self, body: Mapping[str, Any], err: Exception) -> None:
        key = _key(body)
        gen = body.get("metadata", {}).get("generation")
        log.error("%s: invalid spec, nothing applied: %s", key, err)
        st = build_status(previous=body.get("status"), generation=gen, target=ClusterTarget(),
                          ready=ReadyCounts(), selector="", now=self.now(), spec_error=str(err))
        if self.invalid_spec_events.get(key, _NO_EVENT) != gen:
            await self.event(body, "Warning", "InvalidSpec", str(err))
            self.invalid_spec_events[key] = gen
        await self._write_status(body, st)

    async def _apply_rejected(self, body: Mapping[str, Any], rt: _Runtime, err: KubeApiError) -> None:
        """The API server rejected this generation's objects (:func:`_rejected`): Degraded/ApplyRejected with its
        message, one Warning Event per generation, the error counted; nothing raised (no retry of the same
        objects by kopf)."""
        key = _key(body)
        where = f" on {err.path}" if err.path else ""
        msg = f"the API server rejected the objects of generation {rt.generation} (HTTP {err.status}{where}): {err.reason}"
        log.error("%s: %s", key, msg)
        self.metrics.reconcile_errors.inc()
        rt.apply_rejected = msg
        if rt.apply_rejected_event != rt.generation:
            await self.event(body, "Warning", "ApplyRejected", msg)
            rt.apply_rejected_event = rt.generation
        ready = await self._ready_counts(rt.serve)
        await self._write_status(body, self._status(rt, body, ready, degraded=rt.degraded))

    # ----------------------------------------------------------------------------------------- handlers
    async def reconcile(self, body: Mapping[str, Any]) -> bool:
        """Create/update/resume: validate, apply every object for the target in force, write status.

        Returns:
            True when applied; False when the spec (or its profile) is invalid (status says why; nothing applied)
            or the API server rejected its objects (status Degraded/ApplyRejected, one Warning Event per
            generation; :meth:`_apply_rejected`).

        Raises:
            KubeApiError: the API failed after retries (the kopf wrapper turns it into a TemporaryError).
        """
        try:
            serve = self._parse(body)
            rt = await asyncio.to_thread(self._runtime, body, serve)
        except (SpecError, ProfileError, ValueError) as err:
            await self._invalid(body, err)
            return False
        # a spec change never scales in (``_apply``): a shrinking pool keeps its replicas until an interval drains it
        try:
            report = await self._apply(rt, body, rt.loop.current)
        except KubeApiError as err:
            if not _rejected(err):
                raise
            await self._apply_rejected(body, rt, err)
            return False
        rt.apply_rejected = None
        log.info("%s: reconciled generation %s: %d written, %d unchanged", _key(body),
                 rt.generation, len(report.written), len(report.unchanged))
        ready = await self._ready_counts(serve)
        self.metrics.record_target(_key(body), rt.applied, ready)
        await self._write_status(body, self._status(rt, body, ready, degraded=rt.degraded))
        return True

    def interval_of(self, body: Mapping[str, Any]) -> float:
        """The LLMServe's planner interval, seconds (60 when its spec cannot be read)."""
        try:
            return float((body.get("spec") or {}).get("scaling", {}).get("intervalSeconds", 60.0))
        except (TypeError, ValueError, AttributeError):
            return 60.0

    async def interval(self, body: Mapping[str, Any]) -> bool:
        """One control-loop interval (module doc). Returns False when the LLMServe is gone (the daemon ends).

        Raises:
            KubeApiError: the API failed after retries while applying (the daemon logs it and goes on); an apply
                the API server rejects is reported in the status instead (:meth:`_apply_rejected`).
        """
        key = _key(body)
        try:
            serve = self._parse(body)
            rt = await asyncio.to_thread(self._runtime, body, serve)
        except (SpecError, ProfileError, ValueError) as err:
            await self._invalid(body, err)
            return True
        ready = await self._ready_counts(serve)
        if rt.observer is not None and not rt.warmed:
            rt.warmed = True
            await self._warm_start(key, rt, rt.observer, ready)
        rt.loop_previous = rt.loop.current
        rt.grown = {}
        cluster = KubernetesCluster(self, rt, body, asyncio.get_running_loop())
        try:
            outcome = await _in_own_thread(rt.loop.run_interval, cluster, name=f"interval {key}")
        except KubeApiError as err:
            if not _rejected(err):
                raise
            await self._apply_rejected(body, rt, err)
            return True
        rt.apply_rejected = None
        await self._events(body, rt, outcome)
        degraded = outcome.degraded
        drain_msgs, rt.drain_notes[:] = list(rt.drain_notes), []
        if drain_msgs:
            degraded = "; ".join(([degraded] if degraded else []) + drain_msgs)
        rt.degraded = degraded
        self.metrics.record_interval(key, outcome, ready, count_plan_changes=False)  # resizes: record_scale
        log.info("%s: %s", key, outcome.reason)
        return await self._write_status(body, self._status(rt, body, ready, degraded=degraded, outcome=outcome))

    async def _events(self, body: Mapping[str, Any], rt: _Runtime, outcome: LoopOutcome) -> None:
        """The Events of one interval, after its target was applied: ObservationUnavailable (first blind
        interval) or PlanningFailed (first interval the planner failed on) — once per cause: judged against the
        previous interval's own outcome, not against a drain's note —, SLOInfeasible/SLOFeasible
        (:meth:`_slo_event`), ScaledOut per pool the plan grows and the apply grew (``rt.grown``: the replicas
        before and after; a pool whose drain the plan only shortened grew nothing), TensorParallelChanged per pool
        whose TP changed (its pods roll)."""
        cause = degraded_reason(outcome.degraded, outcome) if outcome.degraded else None
        if cause is not None and cause != rt.loop_degraded:
            await self.event(body, "Warning", cause, f"holding the current pools: {outcome.degraded}")
        rt.loop_degraded = cause
        await self._slo_event(body, rt, outcome)
        for pool in outcome.scale_out:
            if pool in rt.grown:
                old, new = rt.grown[pool]
                await self.event(body, "Normal", "ScaledOut", f"{pool}: {old}→{new} instances: {outcome.reason}")
                self.metrics.record_scale(_key(body), pool, old, new)
        for pool in Pool:
            was, now = rt.loop_previous.pool(pool), outcome.target.pool(pool)
            if was.tp != now.tp and (was.replicas or now.replicas):
                await self.event(body, "Normal", "TensorParallelChanged",
                                 f"{pool}: TP {was.tp}→{now.tp} ({now.replicas} instances, pods roll): {outcome.reason}")

    async def _slo_event(self, body: Mapping[str, Any], rt: _Runtime, outcome: LoopOutcome) -> None:
        """A Warning Event ``SLOInfeasible`` when the plan finds an SLO target out of the profile's reach at the
        forecast lengths (and again when which targets changes), a Normal ``SLOFeasible`` when both are in reach
        again. Judged against the ``SLOFeasible`` condition last written to ``body``'s status, so one Event per
        change, across operator restarts too. Nothing for planners that do not judge feasibility."""
        found = slo_infeasibility(outcome)
        if found is None:
            return
        prev = get_condition((body.get("status") or {}).get("conditions"), "SLOFeasible")
        if prev is not None and prev.get("reason") == condition_reason(found):
            return
        if found:
            await self.event(body, "Warning", "SLOInfeasible",
                             "; ".join(f.message() for f in found)
                             + f", within maxGPUs={rt.serve.spec.scaling.max_gpus}")
        elif prev is not None:
            await self.event(body, "Normal", "SLOFeasible", "both SLO targets can be met again at the forecast lengths")

    def _status(self, rt: _Runtime, body: Mapping[str, Any], ready: ReadyCounts, *, degraded: str | None,
                outcome: LoopOutcome | None = None) -> dict[str, Any]:
        """The status of ``rt`` now (``build_status``): the pools as applied, the pods draining, ``body``'s
        status as the previous one."""
        return build_status(previous=body.get("status"), generation=rt.generation, target=rt.applied, ready=ready,
                            selector=worker_selector(rt.serve.metadata.name), now=self.now(), outcome=outcome,
                            degraded=degraded, draining=rt.draining, apply_rejected=rt.apply_rejected)

    async def _warm_start(self, key: str, rt: _Runtime, observer: PrometheusObserver, ready: ReadyCounts) -> None:
        """Fit a new loop's forecaster on the intervals Prometheus kept (``ControlLoop.warm_start``), so that an
        operator restart or a spec change does not restart forecasting cold. The interval observed next is not
        history: the newest one read ends an interval before now. Prometheus failing here is logged, not fatal."""
        wanted = rt.loop.history_wanted
        if wanted <= 0:
            return
        interval = rt.loop.interval_s
        try:
            history = await asyncio.to_thread(observer.history, self.clock() - interval, interval, wanted, ready)
        except ObservationError as err:
            log.warning("%s: the forecaster starts cold: no history from Prometheus (%s)", key, err)
            return
        fed = rt.loop.warm_start(history)
        log.info("%s: forecaster warm-started on %d of the last %d intervals", key, fed, wanted)

    async def _act(self, body: Mapping[str, Any], rt: _Runtime, target: ClusterTarget, reason: str) -> None:
        """Apply scale-outs (and everything else) at once; start a background drain for every pool that shrinks
        (:meth:`KubernetesCluster.apply`).

        A pool is scaled in only by its drain (``drain.py``), which runs as a task while the control loop goes
        on: a burst during a drain is planned for at the next interval, not after the drain timeout. A plan
        that wants a draining pool back at its size (or larger) stops the drain (its pods are unmarked) and
        applies at once; a plan that wants it smaller than the drain goes still waits for the drain, then drains
        again. A plan between the two (a drain 4→2, then a plan for 3) stops the drain — its victims serve again —
        and drains again to the new count at once (:meth:`_retarget_drains`): no drained pod is removed only for
        a cold one to start. Drain timeouts and failures are left in ``rt.drain_notes`` (the next status's
        Degraded message). The pools the apply grew are left in ``rt.grown`` (their ScaledOut Events).
        """
        await self._retarget_drains(body, rt, target, reason)
        before = rt.applied
        shrinking = _shrinking(rt, target)
        await self._apply(rt, body, target)  # holds the shrinking pools at their replicas: their drains lower them
        rt.grown = {p: (before.pool(p).replicas, rt.applied.pool(p).replicas) for p in Pool
                    if rt.applied.pool(p).replicas > before.pool(p).replicas}
        key = _key(body)
        for pool in sorted(shrinking - set(rt.drains)):
            old, new = rt.applied.pool(pool).replicas, target.pool(pool).replicas
            rt.drain_plans[pool] = (old, new, reason)
            rt.drains[pool] = asyncio.create_task(self._drain(key, body, rt, pool, old, new, reason),
                                                  name=f"drain {key} {pool}")

    async def _retarget_drains(self, body: Mapping[str, Any], rt: _Runtime, target: ClusterTarget,
                               reason: str) -> None:
        """Stop every drain in flight that ``target`` wants fewer victims of: the pool back at its size or larger,
        or at more instances than the drain leaves (``drain_pool`` unmarks its victims and resets their
        pod-deletion cost when cancelled: they serve again; :meth:`_act` then drains again to ``target``'s count).
        A drain a plan wants smaller still goes on (the next interval drains again).

        Events say what happened: ``DrainCancelled`` when the drain was stopped before it lowered the replicas;
        ``ScaledIn`` when its replicas write had already been sent (``drain_pool`` waits for it: it cannot be
        called back), so the pool did shrink; nothing when the drain ended by itself meanwhile (it posted its own).
        """
        for pool, task in list(rt.drains.items()):
            want, have = target.pool(pool).replicas, rt.applied.pool(pool).replicas
            old, to, why = rt.drain_plans.get(pool, (have, have, reason))
            if want < have and want <= to:
                continue
            await cancel_and_wait([task], recancel_after_s=30.0)  # drain_pool unmarks its pods when cancelled
            rt.drains.pop(pool, None)
            rt.drain_plans.pop(pool, None)
            if not task.cancelled():
                continue  # it ended by itself meanwhile: its ScaledIn (or its failure note) is its own
            now = rt.applied.pool(pool).replicas
            if now < have:
                await self.event(body, "Normal", "ScaledIn",
                                 f"{pool}: {have}→{now} instances (the drain's replicas write was already sent when "
                                 f"the plan changed to {want}): {why}")
                self.metrics.record_scale(_key(body), pool, have, now)
            elif want >= have:
                await self.event(body, "Normal", "DrainCancelled",
                                 f"{pool}: the plan wants {want} instances again; drain stopped: {reason}")
            else:
                await self.event(body, "Normal", "DrainCancelled",
                                 f"{pool}: the plan wants {want} instances, not {to}: drain {old}→{to} stopped, "
                                 f"draining {have}→{want} instead: {reason}")

    async def _drain(self, key: str, body: Mapping[str, Any], rt: _Runtime, pool: Pool, old: int, new: int,
                     reason: str) -> None:
        """One pool's drain, in the background (:meth:`_act`): ``drain_pool``, then the ScaledIn Event; a
        timeout or a failure is left in ``drain_notes`` for the next interval's status."""
        io = _KubeDrainIO(self, rt, body, key)
        t0 = self.monotonic()
        started = self.metrics.drain_started.labels(key, pool.value)
        started.set(self.clock())  # a drain that hangs shows here (FulcrumDrainStuck) before it ends
        try:
            result: DrainResult = await drain_pool(
                io, pool, new, timeout_s=float(rt.serve.spec.scaling.drain_timeout_seconds),
                poll_s=self.settings.drain_poll_s, clock=self.monotonic, sleep=self.sleep)
        except FulcrumError as err:  # the API failed after retries: the pool keeps its replicas, the next interval retries
            log.error("%s: drain of %s failed: %s", key, pool, err)
            rt.drain_notes.append(f"{pool}: drain failed: {err}")
            return
        except Exception as err:  # noqa: BLE001 - a bug must not die unseen in a background task
            log.exception("%s: drain of %s failed unexpectedly", key, pool)
            rt.drain_notes.append(f"{pool}: drain failed: {type(err).__name__}: {err}")
            return
        finally:
            started.set(0.0)
            if rt.drains.get(pool) is asyncio.current_task():
                del rt.drains[pool]
                rt.drain_plans.pop(pool, None)
        self.metrics.drain_seconds.observe(max(self.monotonic() - t0, 0.0))
        drained = ", ".join(result.victims) or "none"
        await self.event(body, "Normal", "ScaledIn", f"{pool}: {old}→{new} instances after draining {drained}: {reason}")
        self.metrics.record_scale(key, pool, old, new)
        if result.timed_out:
            rt.drain_notes.append(f"{pool}: drain timed out with requests left on {', '.join(sorted(result.busy))}")
        await self._status_now(key)

    async def _status_now(self, key: str) -> None:
        """Write the status of the LLMServe ``key`` as it is now, between intervals (a drain has ended: its
        pools, ``draining`` list and Degraded condition); the forecast and plan of the last interval are kept.
        A failing API is logged: the next interval writes the status anyway."""
        rt = self.runtimes.get(key)
        if rt is None:
            return
        ns, name = key.split("/", 1)
        try:
            body = await asyncio.to_thread(self.objects.get, API_VERSION, KIND, ns, name)
            if body is None:
                return
            ready = await self._ready_counts(rt.serve)
            degraded = "; ".join([d for d in (rt.degraded, *rt.drain_notes) if d]) or None
            await self._write_status(body, self._status(rt, body, ready, degraded=degraded))
        except FulcrumError as err:
            log.warning("%s: status not written after the drain (%s); the next interval writes it", key, err)

    async def settle(self, key: str) -> None:
        """Wait until the drains in flight of the LLMServe ``key`` (``namespace/name``) have ended."""
        rt = self.runtimes.get(key)
        while rt is not None and rt.drains:
            await asyncio.gather(*list(rt.drains.values()), return_exceptions=True)

    async def deleted(self, body: Mapping[str, Any]) -> list[str]:
        """The LLMServe is being deleted: its children go with it (ownerReferences → garbage collector).

        Confirms it: lists the children (by the ``fulcrum.dev/llmserve`` label) and returns — and logs as a
        warning — any that do not name this LLMServe's uid as owner (they would outlive it). A failing API only
        skips the check: deletion never waits for the operator.
        """
        key = _key(body)
        rt = self.runtimes.pop(key, None)
        self.invalid_spec_events.pop(key, None)
        if rt is not None and rt.drains:  # nothing left to drain: the pods go with the LLMServe
            await cancel_and_wait(list(rt.drains.values()), recancel_after_s=30.0)
        self.metrics.forget(key)
        meta = body.get("metadata", {})
        ns, uid = str(meta.get("namespace", "default")), meta.get("uid")
        sel = f"{LABEL_LLMSERVE}={meta.get('name')}"
        orphans: list[str] = []

        def check() -> None:
            for api_version, kind in (("apps/v1", "Deployment"), ("v1", "Service"), ("v1", "ConfigMap"),
                                      ("v1", "ServiceAccount"), ("rbac.authorization.k8s.io/v1", "Role"),
                                      ("rbac.authorization.k8s.io/v1", "RoleBinding")):
                for obj in self.objects.list(api_version, kind, ns, sel):
                    owners = (obj.get("metadata") or {}).get("ownerReferences") or ()
                    if not any(o.get("uid") == uid for o in owners):
                        orphans.append(f"{kind}/{obj['metadata']['name']}")

        try:
            await asyncio.to_thread(check)
        except KubeApiError as err:
            log.warning("%s deleted; could not confirm its children are owned: %s", key, err)
            return []
        if orphans:
            log.warning("%s deleted, but these objects carry no ownerReference to it and stay: %s", key,
                        ", ".join(orphans))
        else:
            log.info("%s deleted; its Deployments, Services, ConfigMap and RBAC are owned by it and garbage-collected",
                     key)
        return orphans


def _shrinking(rt: _Runtime, target: ClusterTarget) -> set[Pool]:
    """The pools of the spec's mode to which ``target`` gives fewer replicas than were applied (a scale-in)."""
    return {p for p in MODE_POOLS[rt.serve.spec.mode] if target.pool(p).replicas < rt.applied.pool(p).replicas}


class KubernetesCluster:
    """:class:`fulcrum.cluster.Cluster` over the Kubernetes API for one LLMServe, for one interval.

    Its methods block (API calls, Prometheus queries): :meth:`Controller.interval` runs
    :meth:`~fulcrum.scaling.loop.ControlLoop.run_interval` on it in a thread of its own (:func:`_in_own_thread`);
    :meth:`apply` hands the apply back to the operator's event loop (``loop``) and waits for it, so applies stay
    serialised with the drains under the LLMServe's apply lock. Never call its methods on the event loop's thread
    (``apply`` would wait for the loop it blocks).

    Args:
        controller: the operator's controller (API client, settings, clock).
        rt: the LLMServe's runtime (its observer, loop, applied target, drains).
        body: the LLMServe object as the daemon last read it.
        loop: the operator's event loop.
    """

    def __init__(self, controller: Controller, rt: _Runtime, body: Mapping[str, Any],
                 loop: asyncio.AbstractEventLoop) -> None:
        self.c = controller
        self.rt = rt
        self.body = body
        self.loop = loop

    def observe(self, interval_s: float) -> Observation:
        """The router's and the engines' metrics over the last ``interval_s`` seconds (Prometheus).

        Raises:
            ObservationError: no Prometheus configured, or it failed or had no router series.
        """
        if self.rt.observer is None:
            raise ObservationError("no Prometheus configured (--prometheus-url)")
        return self.rt.observer.observe(self.c.clock(), interval_s, self.ready())

    def apply(self, target: ClusterTarget, reason: str = "") -> None:
        """Apply every object for ``target``: scale-outs at once, a background drain per shrinking pool
        (:meth:`Controller._act`; ``reason`` goes into its Events).

        Raises:
            KubeApiError: the API failed after retries.
        """
        asyncio.run_coroutine_threadsafe(self.c._act(self.body, self.rt, target, reason), self.loop).result()

    def ready(self) -> ReadyCounts:
        """The pool Deployments' ``status.readyReplicas``."""
        return self.c.read_ready(self.rt.serve)

    def draining(self) -> dict[Pool, int]:
        """Instances being drained per pool: what a drain in flight will remove (applied − wanted replicas)."""
        out = {p: self.rt.applied.pool(p).replicas - self.rt.loop.current.pool(p).replicas for p in self.rt.drains}
        return {p: n for p, n in out.items() if n > 0}


class _KubeDrainIO:
    """:class:`fulcrum.controller.drain.DrainIO` over the Controller's Kubernetes objects (the router ConfigMap,
    the pods, their deletion cost) and the pods' and routers' ``/metrics`` (its ``fetch``)."""

    def __init__(self, controller: Controller, rt: _Runtime, body: Mapping[str, Any], key: str) -> None:
        self.c = controller
        self._rt = rt
        self.key = key
        self.body = body
        self.ns = rt.serve.metadata.namespace
        self.name = rt.serve.metadata.name

    @property
    def rt(self) -> _Runtime:
        """The LLMServe's runtime now: a spec change during the drain rebuilds it, and applies use the new spec."""
        return self.c.runtimes.get(self.key, self._rt)

    async def _pods(self, pool: str | None = None) -> list[dict[str, Any]]:
        sel = f"{LABEL_LLMSERVE}={self.name}" + (f",{LABEL_POOL}={pool}" if pool else "")
        pods = await asyncio.to_thread(self.c.objects.list, "v1", "Pod", self.ns, sel)
        return [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]

    async def _load(self, pod: Mapping[str, Any]) -> float:
        ip = (pod.get("status") or {}).get("podIP")
        if not ip:
            return math.nan
        try:
            text = await self.c.fetch(f"http://{ip}:{_http_port(pod)}/metrics", self.c.settings.metrics_timeout_s)
            return float(load_from_metrics(text))
        except (OSError, ValueError) as err:
            log.info("%s: /metrics of %s unreadable: %s", self.name, pod["metadata"]["name"], err)
            return math.nan

    async def pod_loads(self, pool: str) -> list[PodLoad]:
        out = []
        for p in await self._pods(pool):
            load = await self._load(p)
            out.append(PodLoad(p["metadata"]["name"], _ready(p), load, 0.0))
        return out

    async def loads(self, pods: Sequence[str]) -> Mapping[str, float]:
        live = {p["metadata"]["name"]: p for p in await self._pods()}
        out: dict[str, float] = {}
        for name in pods:
            pod = live.get(name)
            v = await self._load(pod) if pod is not None else 0.0
            out[name] = v if math.isfinite(v) else 0.0  # gone or unreadable: nothing left to wait for
        return out

    async def mark_draining(self, pods: Sequence[str]) -> None:
        # Shielded: the API write runs in a thread that a cancellation cannot stop, so the write finishes under the
        # apply lock even when the drain is cancelled meanwhile; the unmark that follows a cancel then waits for
        # the lock and its write lands after the mark's (it could land before, leaving the pods marked).
        inner = asyncio.ensure_future(self._set_draining(pods, draining=True))
        inner.add_done_callback(_consume_failure)
        await asyncio.shield(inner)

    async def unmark_draining(self, pods: Sequence[str]) -> None:
        await self._set_draining(pods, draining=False)

    async def routers_lagging(self, pods: Sequence[str]) -> list[str]:
        sel = f"{LABEL_LLMSERVE}={self.name},{LABEL_COMPONENT}=router"
        routers = await asyncio.to_thread(self.c.objects.list, "v1", "Pod", self.ns, sel)
        lagging = []
        for r in routers:
            ip = (r.get("status") or {}).get("podIP")
            if (r.get("metadata") or {}).get("deletionTimestamp") or not ip or not _ready(r):
                continue  # a router out of its Service gets no requests; one that starts reads the list first
            rname = r["metadata"]["name"]
            try:
                text = await self.c.fetch(f"http://{ip}:{_http_port(r)}/metrics", self.c.settings.metrics_timeout_s)
                seen = draining_from_metrics(text)
            except (OSError, ValueError) as err:
                log.info("%s: /metrics of router %s unreadable: %s", self.name, rname, err)
                lagging.append(rname)
                continue
            if any(not seen.get(p, True) for p in pods):
                lagging.append(rname)
        return lagging

    async def _set_draining(self, pods: Sequence[str], *, draining: bool) -> None:
        """Add ``pods`` to (or remove them from) the router's draining list and apply the router config."""
        rt = self.rt
        async with rt.apply_lock:
            rt.draining = sorted(set(rt.draining) | set(pods) if draining else set(rt.draining) - set(pods))
            await self.c._apply_locked(rt, self.body, rt.applied)

    async def set_deletion_cost(self, pods: Sequence[str], cost: int) -> None:
        for name in pods:  # a pod already gone needs no cost (annotate_pod returns False)
            await asyncio.to_thread(self.c.objects.annotate_pod, self.ns, name, {DELETION_COST_ANNOTATION: str(cost)})

    async def scale(self, pool: str, replicas: int) -> None:
        rt = self.rt
        async with rt.apply_lock:
            await self.c._apply_locked(rt, self.body, rt.applied.with_replicas(Pool(pool), replicas))

    async def event(self, type_: str, reason: str, message: str) -> None:
        await self.c.event(self.body, type_, reason, message)


async def _in_own_thread(fn: Callable[[_A], _R], arg: _A, *, name: str) -> _R:
    """``fn(arg)`` in a new daemon thread; its result or exception here.

    Not the default executor: an interval's thread waits for its apply on the event loop, and the apply needs the
    default executor for its API calls; intervals of enough LLMServes there at once would leave the applies no
    thread (a deadlock). A daemon thread: one left waiting for a loop that has stopped does not hold up the
    operator's exit. Cancelling the await leaves the thread to finish on its own (its result is dropped).
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[_R] = loop.create_future()

    def settle(result: _R | None, err: BaseException | None) -> None:
        if fut.done():
            return
        if err is not None:
            fut.set_exception(err)
        else:
            fut.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result, err = fn(arg), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            result, err = None, e
        try:
            loop.call_soon_threadsafe(settle, result, err)
        except RuntimeError:  # the loop has closed: nobody awaits any more
            pass

    threading.Thread(target=run, name=f"fulcrum {name}", daemon=True).start()
    return await fut


def _consume_failure(task: asyncio.Future[None]) -> None:
    """Log the failure of a shielded write whose awaiting drain was cancelled (nobody else reads its result)."""
    if not task.cancelled() and task.exception() is not None:
        log.warning("draining-list write failed: %s", task.exception())


def _prometheus_connect(url: str) -> QueryClient:
    from prometheus_api_client import PrometheusConnect
    from urllib3.util.retry import Retry

    # one quick retry: a down Prometheus must not stall the interval (the loop holds and reports Degraded)
    retry = Retry(total=1, backoff_factor=0.1, status_forcelist=(502, 503, 504), allowed_methods=("GET",))
    client: QueryClient = PrometheusConnect(url=url, disable_ssl=True, timeout=10, retry=retry)
    return client


def in_cluster_server(info: Any, environ: Mapping[str, str] | None = None) -> Any:
    """kopf's service-account login with the API server's address taken from ``KUBERNETES_SERVICE_HOST`` and
    ``KUBERNETES_SERVICE_PORT`` (as client-go's and the kubernetes client's in-cluster config do, and as this
    operator's own ``KubeClient`` does), instead of kopf's fixed ``https://kubernetes.default.svc`` (port 443),
    which needs cluster DNS: a ``hostNetwork`` pod or a cluster without DNS for the ``kubernetes`` Service could
    not log in, while the kubernetes client beside it could. ``info`` is kopf's ``ConnectionInfo`` (or None: not
    in a pod); without the variables it is returned unchanged."""
    env = os.environ if environ is None else environ
    host, port = env.get("KUBERNETES_SERVICE_HOST", "").strip(), env.get("KUBERNETES_SERVICE_PORT", "").strip()
    if info is None or not host or not port:
        return info
    if ":" in host and not host.startswith("["):  # an IPv6 address
        host = f"[{host}]"
    return replace(info, server=f"https://{host}:{port}")


def register(registry: Any, controller: Controller) -> None:
    """Register the handlers on a ``kopf.OperatorRegistry`` (module doc)."""
    import kopf

    res = dict(group=GROUP, version=VERSION, plural=PLURAL, registry=registry)

    def login(**kwargs: Any) -> Any:
        # a registry of our own has none of kopf's default login handlers: in a pod the service account,
        # elsewhere the kubeconfig ($KUBECONFIG or ~/.kube/config)
        return in_cluster_server(kopf.login_with_service_account(**kwargs)) or kopf.login_with_kubeconfig(**kwargs)

    kopf.on.login(id="login", registry=registry)(login)

    async def on_change(body: Mapping[str, Any], **_: Any) -> None:
        try:
            await controller.reconcile(body)
        except FulcrumError as err:
            controller.metrics.reconcile_errors.inc()
            raise kopf.TemporaryError(str(err), delay=10) from err

    kopf.on.resume(id="reconcile", **res)(on_change)
    kopf.on.create(id="reconcile", **res)(on_change)
    kopf.on.update(id="reconcile", field="spec", **res)(on_change)

    async def control_loop(body: Mapping[str, Any], stopped: Any, **_: Any) -> None:
        while not stopped:
            await stopped.wait(controller.interval_of(body))
            if stopped:
                break
            try:
                if not await controller.interval(body):
                    log.info("%s is gone; its control loop ends", _key(body))
                    return
            except FulcrumError as err:
                controller.metrics.reconcile_errors.inc()
                log.error("%s: interval failed, retrying at the next one: %s", _key(body), err)

    kopf.daemon(id="control-loop", cancellation_timeout=5.0, **res)(control_loop)

    async def on_delete(body: Mapping[str, Any], **_: Any) -> None:
        await controller.deleted(body)

    kopf.on.delete(id="forget", optional=True, **res)(on_delete)
