"""Every Kubernetes object of one ``LLMServe``, built from its spec and the plan: pure, no API calls.

:func:`build_objects` turns ``(LLMServe, ClusterTarget)`` into complete manifests ready for server-side apply:

========================  ==========================  ===================================================
object                    name                        why
========================  ==========================  ===================================================
Deployment + Service      ``<name>-prefill``          prefill pool (Disaggregated, Auto); role ``prefill``
Deployment + Service      ``<name>-decode``           decode pool (Disaggregated, Auto); role ``decode``
Deployment + Service      ``<name>-unified``          unified pool (Unified, Auto); role ``both``
ConfigMap                 ``<name>-router``           ``router.yaml``: a valid :class:`~fulcrum.router.config.RouterConfig`
Deployment + Service      ``<name>-router``           the OpenAI-compatible router (``fulcrum router``)
ServiceAccount, Role,     ``<name>-router``           the router's identity; the Role grants get/list/watch
RoleBinding                                           on EndpointSlices (the Kubernetes registry) and nothing else
========================  ==========================  ===================================================

Rules (docs/operator.md "Objects the operator creates"):

- Every object carries the labels ``app.kubernetes.io/name: fulcrum``, ``app.kubernetes.io/managed-by:
  fulcrum-operator``, ``fulcrum.dev/llmserve: <name>`` (+ ``app.kubernetes.io/component: worker|router``) and
  an ownerReference to the ``LLMServe`` (``controller: true``, ``blockOwnerDeletion: true``), so deleting the
  resource deletes them. Pools add ``fulcrum.dev/pool``, ``fulcrum.dev/role``, ``fulcrum.dev/tp``; the pool
  Services carry them too, and the EndpointSlice controller copies them onto the slices the router's
  Kubernetes registry reads (``fulcrum.router.registry_k8s``).
- Deployment selectors use only immutable facts (LLMServe, component, pool): a TP change rolls the pods,
  it never needs a new selector.
- Worker pods: ``nvidia.com/gpu`` = TP for engine kind ``vllm`` (none for ``sim``), node selector,
  tolerations and affinity from ``spec.placement``, a soft topology spread across nodes, readiness on
  ``GET /health`` (503 while draining), a startup probe sized from ``spec.scaling.podStartupSeconds``, a TCP
  liveness probe (a draining worker must not be killed by its liveness probe), and
  ``terminationGracePeriodSeconds = spec.scaling.drainTimeoutSeconds + 30``.
- Deterministic: the same inputs give equal lists (objects sorted by apply order, then name; no
  timestamps). ``fulcrum.dev/pod-spec-hash`` (on a pool Deployment and its pod template) fingerprints the pod
  template, and ``fulcrum.dev/desired-hash`` (on every object) the whole desired object, so the apply step
  can skip unchanged objects; a spec change that touches only the router leaves the pool Deployments equal.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from fulcrum.api.llmserve import API_VERSION, KIND, EngineKind, LLMServe, Mode, ReplicaOwner
from fulcrum.errors import ProfileError, SpecError
from fulcrum.ratio.profile import PerformanceProfile, recompute_tokens_per_s
from fulcrum.ratio.profiles import builtin_profile
from fulcrum.ratio.planner import initial_in_budget
from fulcrum.router.config import RouterConfigError, parse_config
from fulcrum.routing.registry import make_policy, policy_params
from fulcrum.router.prefill_queue import QueueLayout
from fulcrum.scaling.registry import make_planner
from fulcrum.target import ClusterTarget, Pool, PoolSize, RoutingParams, plan_role_bounds

_log = logging.getLogger(__name__)

__all__ = [
    "POOL_ROLES",
    "MODE_POOLS",
    "HTTP_PORT",
    "NIXL_PORT",
    "HEALTH_PORT",
    "SCHEDULER_METRICS_PORT",
    "ROUTER_CONFIG_KEY",
    "ROUTER_CONFIG_DIR",
    "PROFILE_DIR",
    "FIELD_MANAGER",
    "LABEL_NAME",
    "LABEL_MANAGED_BY",
    "LABEL_COMPONENT",
    "LABEL_LLMSERVE",
    "LABEL_POOL",
    "LABEL_ROLE",
    "LABEL_TP",
    "ANNOTATION_POD_SPEC_HASH",
    "ANNOTATION_DESIRED_HASH",
    "pool_deployment_name",
    "router_name",
    "common_labels",
    "pool_labels",
    "pool_selector",
    "worker_selector",
    "owner_reference",
    "object_hash",
    "router_config",
    "initial_target",
    "build_objects",
]

POOL_ROLES: Mapping[Pool, str] = {Pool.PREFILL: "prefill", Pool.DECODE: "decode", Pool.UNIFIED: "both"}
"""Pool → the ``--role`` of its workers and the ``fulcrum.dev/role`` label (``both`` = vLLM ``kv_both``)."""

MODE_POOLS: Mapping[Mode, tuple[Pool, ...]] = {
    Mode.DISAGGREGATED: Pool.disaggregated(),
    Mode.UNIFIED: (Pool.UNIFIED,),
    Mode.AUTO: tuple(Pool),
}
"""Pools each mode deploys. Auto deploys all three: the planner moves instances between them each interval."""

HTTP_PORT = 8000
"""Port of the OpenAI API, ``/health`` and ``/metrics`` of workers and router (container port name ``http``)."""
NIXL_PORT = 5600
"""NIXL side-channel port of vLLM workers (container port name ``nixl``)."""
SCHEDULER_METRICS_PORT = 8002
"""``fulcrum_scheduler_*`` of vLLM workers: the SLO-aware scheduler's budget, step times and latency table, served
from the engine-core process (container port name ``scheduler``; the chart's PodMonitor scrapes it)."""
HEALTH_PORT = 8001
"""Readiness endpoint of the ``fulcrum worker`` supervisor (container port name ``health``): ``GET /health`` is 200
only while serving, 503 while starting or draining (vLLM's own ``/health`` on 8000 stays 200 while it drains;
docs/worker.md). ``fulcrum sim-worker`` serves that behaviour on ``http`` itself."""
ROUTER_CONFIG_KEY = "router.yaml"
ROUTER_CONFIG_DIR = "/etc/fulcrum"
"""The router ConfigMap is mounted here as a directory (not ``subPath``), so its live updates reach the pod."""
PROFILE_DIR = "/etc/fulcrum/profile"
"""Where a ``spec.profile.configMap`` is mounted in sim-worker pods (key ``profile.yaml``)."""
FIELD_MANAGER = "fulcrum-operator"

LABEL_NAME = "app.kubernetes.io/name"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_LLMSERVE = "fulcrum.dev/llmserve"
LABEL_POOL = "fulcrum.dev/pool"
LABEL_ROLE = "fulcrum.dev/role"
LABEL_TP = "fulcrum.dev/tp"
ANNOTATION_POD_SPEC_HASH = "fulcrum.dev/pod-spec-hash"
ANNOTATION_DESIRED_HASH = "fulcrum.dev/desired-hash"

_GPU_RESOURCE = "nvidia.com/gpu"
_TERMINATION_MARGIN_S = 30
"""Grace beyond the drain timeout: deregistration, the engine's own shutdown, and the kubelet's SIGKILL margin."""
_ROUTER_RESOURCES = {"requests": {"cpu": "500m", "memory": "512Mi"}}
"""The router is an aiohttp proxy: half a core and 512 MiB serve thousands of streams; no limit, so bursts of
tokenisation are not throttled."""
_APPLY_ORDER = ("ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service", "Deployment")


# --- names and labels -------------------------------------------------------------------------------------


def pool_deployment_name(name: str, pool: str) -> str:
    """``<name>-<pool>``: the Deployment and Service of a pool.

    Raises:
        ValueError: ``pool`` is not a :class:`~fulcrum.target.Pool` value.
    """
    if pool not in set(Pool):
        raise ValueError(f"unknown pool {pool!r}; one of {', '.join(p.value for p in Pool)}")
    return f"{name}-{Pool(pool).value}"


def router_name(name: str) -> str:
    """``<name>-router``: the router's Deployment, Service, ConfigMap, ServiceAccount, Role and RoleBinding."""
    return f"{name}-router"


def common_labels(name: str) -> dict[str, str]:
    """Labels on every object of LLMServe ``name``."""
    return {LABEL_NAME: "fulcrum", LABEL_MANAGED_BY: "fulcrum-operator", LABEL_LLMSERVE: name}


def pool_selector(name: str, pool: str) -> dict[str, str]:
    """``matchLabels`` of pool ``pool``'s Deployment and Service (immutable facts only: no TP, no role)."""
    pool_deployment_name(name, pool)  # validates the pool
    return {LABEL_NAME: "fulcrum", LABEL_LLMSERVE: name, LABEL_COMPONENT: "worker", LABEL_POOL: pool}


def pool_labels(name: str, pool: str, tp: int) -> dict[str, str]:
    """Labels of a pool's Deployment, Service and pods: the common ones, component, pool, role and TP."""
    return {
        **common_labels(name),
        LABEL_COMPONENT: "worker",
        LABEL_POOL: pool,
        LABEL_ROLE: POOL_ROLES[Pool(pool)],
        LABEL_TP: str(tp),
    }


def worker_selector(name: str) -> str:
    """The label selector (string form) of every worker pod of ``name``: ``status.selector`` for the scale
    subresource, and the router's Kubernetes-registry selector of the pool Services' EndpointSlices."""
    labels = {LABEL_NAME: "fulcrum", LABEL_LLMSERVE: name, LABEL_COMPONENT: "worker"}
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def owner_reference(serve: LLMServe, uid: str) -> dict[str, Any]:
    """The ownerReference to the LLMServe: Kubernetes' garbage collector deletes the children with it."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": serve.metadata.name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def object_hash(obj: Any) -> str:
    """First 16 hex digits of the SHA-256 of ``obj`` as canonical JSON (sorted keys): a stable fingerprint."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _metadata(serve: LLMServe, name: str, labels: Mapping[str, str], uid: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": serve.metadata.namespace,
        "labels": dict(labels),
        "ownerReferences": [owner_reference(serve, uid)],
    }


def _num(x: float) -> str:
    """A number as a flag value: ``80`` rather than ``80.0``."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


# --- the initial plan -------------------------------------------------------------------------------------


def _split_total(total: int, weights: Mapping[str, int]) -> dict[str, int]:
    """``total`` instances over the pools of ``weights`` in proportion (largest remainder, ties by order), each
    pool getting at least one while ``total`` allows."""
    pools = [p for p, w in weights.items() if w > 0] or list(weights)
    out = {p: 0 for p in weights}
    if total <= 0 or not pools:
        return out
    floor = 1 if total >= len(pools) else 0
    rest = total - floor * len(pools)
    w_sum = sum(max(weights[p], 1) for p in pools)
    shares = {p: rest * max(weights[p], 1) / w_sum for p in pools}
    for p in pools:
        out[p] = floor + math.floor(shares[p])
    left = total - sum(out.values())
    for p in sorted(pools, key=lambda q: (-(shares[q] - math.floor(shares[q])), pools.index(q)))[:left]:
        out[p] += 1
    return out


def initial_target(serve: LLMServe, profile: PerformanceProfile | None = None) -> ClusterTarget:
    """The pools to create before the first observation.

    With a profile (``profile``, else the built-in one ``spec.profile.name`` names) it is the starting point of the
    planner ``spec.scaling.planner`` names (:func:`fulcrum.scaling.registry.make_planner`, its ``initial()``; for
    ``fulcrum``, :meth:`fulcrum.scaling.fulcrum.FulcrumPlanner.initial` — the spec's initial counts with the TP and
    routing parameters the plan chooses), the same as ``fulcrum replay`` starts from. Without one (a profile file or
    ConfigMap the caller has not loaded) it is the initial counts (at least 1 each) with the fixed TPs of
    ``spec.scaling`` (1 where unset) and default routing; Auto mode then starts disaggregated. Either way counts
    that need more than ``spec.scaling.maxGPUs`` GPUs are cut to it, as the planner cuts them
    (:func:`fulcrum.ratio.planner.initial_in_budget`), and the cut is logged.

    With ``spec.scaling.replicaOwner: External`` the total ``spec.scaling.replicas`` is split between the
    started pools in proportion to those counts (at least one each while the total allows); a split that needs
    more than ``spec.scaling.maxGPUs`` GPUs at the pools' TPs (e.g. 8 instances as 4 prefill TP 1 + 4 decode TP 2 =
    12 GPUs) is cut to it the same way (:func:`~fulcrum.ratio.planner.initial_in_budget`), and the cut is logged.

    Returns:
        a :class:`~fulcrum.target.ClusterTarget`; pools the mode does not start have 0 replicas.

    Raises:
        PlanningError: with a profile, the planner cannot be built or cannot plan its start for this spec (e.g. no
            TP within ``spec.gpu.gpusPerNode`` holds ``spec.engine.maxModelLen``; :func:`make_planner`).
    """
    spec = serve.spec
    sc = spec.scaling
    if profile is None and spec.profile.name:
        try:
            profile = builtin_profile(spec.profile.name)
        except ProfileError:
            profile = None
    if profile is not None:
        target = make_planner(sc.planner, spec, profile).initial()
    else:
        tp_p, tp_d, tp_u = sc.tp_prefill or 1, sc.tp_decode or 1, sc.tp_unified or 1
        if spec.mode is Mode.UNIFIED:
            counts, note = initial_in_budget({"u": max(sc.initial_unified, 1)}, {"u": tp_u}, sc.max_gpus)
            target = ClusterTarget(unified=PoolSize(counts["u"], tp_u), decode=PoolSize(0, tp_d),
                                   prefill=PoolSize(0, tp_p))
        else:
            counts, note = initial_in_budget({"p": max(sc.initial_prefill, 1), "d": max(sc.initial_decode, 1)},
                                             {"p": tp_p, "d": tp_d}, sc.max_gpus)
            target = ClusterTarget(prefill=PoolSize(counts["p"], tp_p),
                                   decode=PoolSize(counts["d"], tp_d), unified=PoolSize(0, tp_u))
        if note is not None:
            _log.warning("LLMServe %s/%s (no profile loaded): %s", serve.metadata.namespace, serve.metadata.name, note)
    if sc.replica_owner is ReplicaOwner.EXTERNAL and sc.replicas is not None:
        counts = _split_total(sc.replicas, {p.value: size.replicas for p, size in target.pools()})
        target = ClusterTarget.of({p: PoolSize(counts[p.value], size.tp) for p, size in target.pools()},
                                  target.routing)
        target = _external_in_budget(serve, target)
    return target


_BUDGET_KEYS = {Pool.PREFILL: "p", Pool.DECODE: "d", Pool.UNIFIED: "u"}
"""The pool keys of :func:`fulcrum.ratio.planner.initial_in_budget`."""


def _external_in_budget(serve: LLMServe, target: ClusterTarget) -> ClusterTarget:
    """``target`` (an external total split over the pools) cut to ``spec.scaling.maxGPUs`` at its TPs
    (:func:`~fulcrum.ratio.planner.initial_in_budget`); a cut is logged with the LLMServe's name."""
    started = {p: size for p, size in target.pools() if size.replicas > 0}
    counts, note = initial_in_budget({_BUDGET_KEYS[p]: size.replicas for p, size in started.items()},
                                     {_BUDGET_KEYS[p]: size.tp for p, size in started.items()},
                                     serve.spec.scaling.max_gpus)
    if note is None:
        return target
    _log.warning("LLMServe %s/%s: replicaOwner External, spec.scaling.replicas %d: %s", serve.metadata.namespace,
                 serve.metadata.name, serve.spec.scaling.replicas, note)
    for p in started:
        target = target.with_replicas(p, counts[_BUDGET_KEYS[p]])
    return target


# --- worker pools -----------------------------------------------------------------------------------------


def _profile_arg(serve: LLMServe) -> str:
    ref = serve.spec.profile
    if ref.name:
        return ref.name
    if ref.path:
        return ref.path
    return f"{PROFILE_DIR}/profile.yaml"


def _batch_limit_args(serve: LLMServe) -> list[str]:
    """``--max-num-seqs`` / ``--max-num-batched-tokens`` from ``spec.engine`` when set (unset: the worker's defaults,
    and no change to the pod template of an LLMServe that sets neither)."""
    engine = serve.spec.engine
    out: list[str] = []
    if engine.max_num_seqs is not None:
        out += ["--max-num-seqs", str(engine.max_num_seqs)]
    if engine.max_num_batched_tokens is not None:
        out += ["--max-num-batched-tokens", str(engine.max_num_batched_tokens)]
    return out


def _worker_args(serve: LLMServe, pool: str, tp: int) -> list[str]:
    """``fulcrum worker …`` / ``fulcrum sim-worker …`` arguments (the contract flags)."""
    spec = serve.spec
    name, namespace = serve.metadata.name, serve.metadata.namespace
    served = spec.model.served_name or spec.model.name
    etcd = ["--etcd", spec.connectors.etcd] if spec.connectors.etcd else []
    # prefill-capable pools pull the LLMServe's prefill jobs from NATS when the router queues them (DOPD §V-C)
    nats = (["--nats", spec.connectors.nats]
            if spec.router.prefill_queue == "nats" and POOL_ROLES[Pool(pool)] in ("prefill", "both") else [])
    common_tail = [
        *etcd,
        *nats,
        "--namespace", namespace,
        "--llmserve", name,
        "--drain-timeout-s", str(spec.scaling.drain_timeout_seconds),
    ]
    if spec.engine.kind is EngineKind.SIM:
        return [
            "sim-worker",
            "--profile", _profile_arg(serve),
            "--tp", str(tp),
            "--model", served,
            "--host", "0.0.0.0",
            "--port", str(HTTP_PORT),
            "--role", POOL_ROLES[Pool(pool)],
            "--pool", pool,
            "--max-model-len", str(spec.engine.max_model_len),  # as vLLM's: the emulator refuses longer requests
            "--block-size", str(spec.engine.block_size),
            *_batch_limit_args(serve),
            *common_tail,
            *spec.engine.extra_args,
        ]
    args = [
        "worker",
        "--model", spec.model.name,
        "--served-model-name", served,
        "--tp", str(tp),
        "--host", "0.0.0.0",
        "--port", str(HTTP_PORT),
        "--role", POOL_ROLES[Pool(pool)],
        "--pool", pool,
        "--gpu-type", spec.gpu.type,
        "--max-model-len", str(spec.engine.max_model_len),
        "--block-size", str(spec.engine.block_size),
        *_batch_limit_args(serve),
        "--kv-connector", "nixl",
        *(["--kv-prefix-pull"] if spec.router.prefix_pull else []),
        "--nixl-port", str(NIXL_PORT),
        "--scheduler", "fulcrum",
        "--scheduler-metrics-port", str(SCHEDULER_METRICS_PORT),
        "--tpot-slo-ms", _num(spec.slo.tpot_ms),
        "--health-port", str(HEALTH_PORT),
        *common_tail,
    ]
    if spec.engine.extra_args:
        args += ["--", *spec.engine.extra_args]
    return args


def _downward_env() -> list[dict[str, Any]]:
    return [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]


def _worker_resources(serve: LLMServe, tp: int) -> dict[str, Any]:
    res = serve.spec.engine.resources
    out: dict[str, Any] = {}
    for part in ("requests", "limits"):
        q = getattr(res, part).model_dump(exclude_none=True)
        if serve.spec.engine.kind is EngineKind.VLLM:
            q[_GPU_RESOURCE] = str(tp)
        if q:
            out[part] = dict(sorted(q.items()))
    return out


def _worker_pod_spec(serve: LLMServe, pool: str, tp: int) -> dict[str, Any]:
    spec = serve.spec
    vllm = spec.engine.kind is EngineKind.VLLM
    name = serve.metadata.name
    ports = [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}]
    if vllm:
        ports.append({"name": "nixl", "containerPort": NIXL_PORT, "protocol": "TCP"})
        ports.append({"name": "health", "containerPort": HEALTH_PORT, "protocol": "TCP"})
        ports.append({"name": "scheduler", "containerPort": SCHEDULER_METRICS_PORT, "protocol": "TCP"})
    # readiness: 200 only while serving, 503 while starting or draining (vllm: the supervisor's port; sim: http)
    ready_port = "health" if vllm else "http"
    # liveness must not restart a draining worker: vLLM's own /health stays 200 while draining; the sim-worker's
    # /health turns 503, so it gets a TCP check
    liveness: dict[str, Any] = (
        {"httpGet": {"path": "/health", "port": "http"}} if vllm else {"tcpSocket": {"port": "http"}}
    )
    # the engine is up when /health answers 200; a 70B model loads in minutes: allow twice the expected start-up
    startup_failures = max(30, math.ceil(2 * spec.scaling.pod_startup_seconds / 10))
    container: dict[str, Any] = {
        "name": "worker",
        "image": spec.engine.image if vllm else "",  # the sim image is filled by build_objects
        "imagePullPolicy": "IfNotPresent",
        "command": ["fulcrum"],
        "args": _worker_args(serve, pool, tp),
        "env": _downward_env(),
        "ports": ports,
        "resources": _worker_resources(serve, tp),
        "startupProbe": {
            "httpGet": {"path": "/health", "port": ready_port},
            "periodSeconds": 10,
            "failureThreshold": startup_failures,
        },
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": ready_port},
            "periodSeconds": 5,
            "failureThreshold": 2,
        },
        "livenessProbe": {**liveness, "periodSeconds": 20, "failureThreshold": 3},
        "securityContext": {"allowPrivilegeEscalation": False},
        # an engine that dies (OOM, a bad flag) shows its last log lines in `kubectl describe pod`
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if vllm:  # NCCL and vLLM's shared-memory broadcast need more than the container runtime's 64 MiB /dev/shm
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    elif spec.profile.config_map:
        volumes.append({"name": "profile", "configMap": {"name": spec.profile.config_map}})
        mounts.append({"name": "profile", "mountPath": PROFILE_DIR, "readOnly": True})
    if mounts:
        container["volumeMounts"] = mounts
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,  # workers never call the Kubernetes API
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": spec.scaling.drain_timeout_seconds + _TERMINATION_MARGIN_S,
        "containers": [container],
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",  # spread when possible, never leave GPUs idle for it
                "labelSelector": {"matchLabels": pool_selector(name, pool)},
            }
        ],
    }
    selector = dict(spec.placement.node_selector)
    if vllm and spec.placement.gpu_type_label:
        selector[spec.placement.gpu_type_label] = spec.gpu.type
    if selector:
        pod["nodeSelector"] = dict(sorted(selector.items()))
    if spec.placement.tolerations:
        pod["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.placement.tolerations]
    affinity = spec.placement.affinity.model_dump(by_alias=True, exclude_none=True)
    if affinity:
        pod["affinity"] = affinity
    if volumes:
        pod["volumes"] = volumes
    return pod


def _pool_objects(serve: LLMServe, pool: str, size: PoolSize, *, uid: str, image: str) -> list[dict[str, Any]]:
    name = serve.metadata.name
    obj_name = pool_deployment_name(name, pool)
    labels = pool_labels(name, pool, size.tp)
    pod_spec = _worker_pod_spec(serve, pool, size.tp)
    if serve.spec.engine.kind is EngineKind.SIM:
        pod_spec["containers"][0]["image"] = image
    template = {
        "metadata": {
            "labels": labels,
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(HTTP_PORT),
                "prometheus.io/path": "/metrics",
            },
        },
        "spec": pod_spec,
    }
    pod_hash = object_hash(template)
    template["metadata"]["annotations"][ANNOTATION_POD_SPEC_HASH] = pod_hash
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {**_metadata(serve, obj_name, labels, uid), "annotations": {ANNOTATION_POD_SPEC_HASH: pod_hash}},
        "spec": {
            "replicas": size.replicas,
            "selector": {"matchLabels": pool_selector(name, pool)},
            # a new pod is ready before an old one goes: never fewer instances than planned during a roll
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 3,
            "template": template,
        },
    }
    ports = [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}]
    if serve.spec.engine.kind is EngineKind.VLLM:
        ports.append({"name": "nixl", "port": NIXL_PORT, "targetPort": "nixl", "protocol": "TCP"})
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(serve, obj_name, labels, uid),
        "spec": {
            # headless: the router addresses pods one by one (from the EndpointSlices), never a virtual IP
            "clusterIP": "None",
            "selector": pool_selector(name, pool),
            "ports": ports,
            "publishNotReadyAddresses": False,
        },
    }
    return [deployment, service]


# --- the router -------------------------------------------------------------------------------------------


def _policy_params(
    serve: LLMServe, routing: RoutingParams, profile: PerformanceProfile | None
) -> dict[str, Any]:
    """The router policy's constructor parameters from the plan (:func:`fulcrum.routing.registry.policy_params`,
    which ``fulcrum replay`` uses too); the profile goes by built-in name, or inline."""
    spec = serve.spec
    ref: str | dict[str, Any] | None = spec.profile.name or (profile.to_dict() if profile is not None else None)
    return policy_params(
        spec.router.policy.value, routing, disaggregated=spec.mode is Mode.DISAGGREGATED,
        kv_block_tokens=spec.engine.block_size, profile=ref, prefix_pull=spec.router.prefix_pull,
    )


def _kv_connector(kind: EngineKind, target: ClusterTarget, profile: PerformanceProfile | None) -> dict[str, Any]:
    """The router's ``kv_connector`` section for prefix pulls (BanaServe §4.2): vLLM workers run NIXL with
    ``bidirectional_kv_xfer`` (partial prefixes load); the pull/recompute prices come from the profile: KV bytes
    per token, and the prefill throughput at a 2,048-token prompt on the serving TP. sim-workers load whole
    prompts only, so their prefixes are recomputed (and counted)."""
    kv: dict[str, Any] = {"partial_prefix": kind is not EngineKind.SIM}
    if profile is not None:
        kv["kv_bytes_per_token"] = float(profile.kv_bytes_per_token)
        kv["prefill_tokens_per_s"] = recompute_tokens_per_s(profile, target)
    return kv


def router_config(
    serve: LLMServe,
    target: ClusterTarget,
    *,
    draining: Sequence[str] = (),
    profile: PerformanceProfile | None = None,
) -> dict[str, Any]:
    """The router's configuration (the ``router.yaml`` document) for ``serve`` under ``target``.

    Registry: ``etcd`` when ``spec.connectors.etcd`` is set (workers register with a lease), else ``kubernetes``
    (the pool Services' EndpointSlices, selected by :func:`worker_selector`). Policy: ``spec.router.policy``
    with the plan's routing parameters (:class:`~fulcrum.target.RoutingParams`; DOPD §V-E, Alg. 1, eq. 18).
    ``draining`` (instance ids, sorted and de-duplicated) is written only when non-empty; ``prefill_queue`` only
    when ``spec.router.prefillQueue`` is ``nats``; ``rescheduling`` (ARES) and ``roles`` (BanaServe role
    reassignment, without ``migrate_on_flip``: docs/rebalancing.md) only when the spec turns them on.

    Raises:
        SpecError: the document is not a valid :class:`~fulcrum.router.config.RouterConfig`, or its policy
            cannot be built (the router's own validation, :func:`~fulcrum.router.config.parse_config` and
            :func:`~fulcrum.routing.registry.make_policy`, names the field).
    """
    spec = serve.spec
    name, namespace = serve.metadata.name, serve.metadata.namespace
    doc: dict[str, Any] = {
        "model": spec.model.served_name or spec.model.name,
        "max_model_len": spec.engine.max_model_len,
        "kv_block_size": spec.engine.block_size,
        "policy": {"name": spec.router.policy.value, "params": _policy_params(serve, target.routing, profile)},
    }
    if spec.connectors.etcd:
        doc["registry"] = "etcd"
        doc["etcd"] = {"endpoint": spec.connectors.etcd, "namespace": namespace, "llmserve": name}
    else:
        doc["registry"] = "kubernetes"
        doc["kubernetes"] = {
            "namespace": namespace,
            "label_selector": worker_selector(name),
            "port_name": "http",
            "role_label": LABEL_ROLE,
            "pool_label": LABEL_POOL,
            "tp_label": LABEL_TP,
        }
    if spec.router.rescheduling:
        resched: dict[str, Any] = {"enabled": True}
        if profile is not None:
            resched["kv_bytes_per_token"] = float(profile.kv_bytes_per_token)
            resched["recompute_tokens_per_s"] = recompute_tokens_per_s(profile, target)
        doc["rescheduling"] = resched
    if spec.router.role_reassignment:
        # migrate_on_flip stays off (the router's default): moving a new prefill-duty instance's decodes away
        # recomputes each of them on its new instance, and in replay that cost 2-25 points of attainment on the
        # unified example (docs/rebalancing.md); they finish where they are instead
        doc["roles"] = {"enabled": True, "ttft_slo_s": spec.slo.ttft_ms / 1000.0}
        bounds = plan_role_bounds(target)
        if bounds is not None:  # the plan's duty split bounds the flips (BanaServe Alg. 1 within it)
            lo_p, hi_p, lo_d, hi_d = bounds
            doc["roles"].update(min_prefill=lo_p, max_prefill=hi_p, min_decode=lo_d, max_decode=hi_d)
        if target.routing.decode_concurrency is not None:  # a decode-duty instance's full compute (duties module)
            doc["roles"]["decode_slo_batch"] = target.routing.decode_concurrency
    if spec.router.prefix_pull:
        doc["kv_connector"] = _kv_connector(spec.engine.kind, target, profile)
    if spec.router.prefill_queue == "nats":
        if not spec.connectors.nats:  # the operator fills it from its --nats-url before this (handlers._parse)
            raise SpecError("router.prefillQueue nats needs a NATS URL: set spec.connectors.nats, or give the "
                            "operator one (--nats-url, FULCRUM_NATS_URL; the Helm chart's nats.enabled)")
        layout = QueueLayout.for_llmserve(namespace, name)  # the names the prefill pullers derive too
        doc["prefill_queue"] = {"kind": "nats", "url": spec.connectors.nats, "stream": layout.stream,
                                "subject_prefix": layout.subject_prefix}
    if draining:
        doc["draining"] = sorted(set(draining))
    try:
        config = parse_config(doc)
        make_policy(config.policy.name, config.policy.params)  # what the router does at start and on reload
    except (RouterConfigError, ValueError, TypeError, ProfileError) as err:
        raise SpecError(f"LLMServe {namespace}/{name}: the router config would be invalid: {err}") from err
    return doc


def _router_objects(
    serve: LLMServe, target: ClusterTarget, *, uid: str, image: str, draining: Sequence[str],
    profile: PerformanceProfile | None,
) -> list[dict[str, Any]]:
    spec = serve.spec
    name = serve.metadata.name
    rname = router_name(name)
    labels = {**common_labels(name), LABEL_COMPONENT: "router"}
    selector = {LABEL_NAME: "fulcrum", LABEL_LLMSERVE: name, LABEL_COMPONENT: "router"}
    config = router_config(serve, target, draining=draining, profile=profile)
    header = (
        f"# Written by the Fulcrum operator for LLMServe {serve.metadata.namespace}/{name}; edits are overwritten.\n"
        "# The router reloads this file live (fulcrum.router.config.ConfigWatcher).\n"
    )
    config_text = header + yaml.safe_dump(config, sort_keys=False, default_flow_style=False)
    meta = _metadata(serve, rname, labels, uid)
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {ROUTER_CONFIG_KEY: config_text}}
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(serve, rname, labels, uid)}
    rules: list[dict[str, Any]] = []
    if config["registry"] == "kubernetes":  # least privilege: what fulcrum.router.registry_k8s reads, nothing else
        rules.append({"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                      "verbs": ["get", "list", "watch"]})
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _metadata(serve, rname, labels, uid),
        "rules": rules,
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(serve, rname, labels, uid),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": rname},
        "subjects": [{"kind": "ServiceAccount", "name": rname, "namespace": serve.metadata.namespace}],
    }
    container = {
        "name": "router",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["fulcrum"],
        "args": ["router", "--config", f"{ROUTER_CONFIG_DIR}/{ROUTER_CONFIG_KEY}", "--port", str(HTTP_PORT)],
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        "resources": _ROUTER_RESOURCES,
        # /health: the router process serves (it answers 503 with a reason itself when no instance is up)
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10,
                          "failureThreshold": 3},
        # liveness starts once the process serves: a router that imports slowly (a busy node) is not killed
        # every 30 s before it ever listens (up to 5 minutes, like the workers' start-up allowance)
        "startupProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 2,
                         "failureThreshold": 150},
        "volumeMounts": [{"name": "config", "mountPath": ROUTER_CONFIG_DIR, "readOnly": True}],
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(serve, rname, labels, uid),
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": selector},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(HTTP_PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": {
                    "serviceAccountName": rname,
                    "enableServiceLinks": False,
                    "containers": [container],
                    "volumes": [{"name": "config", "configMap": {"name": rname}}],
                    "topologySpreadConstraints": [
                        {
                            "maxSkew": 1,
                            "topologyKey": "kubernetes.io/hostname",
                            "whenUnsatisfiable": "ScheduleAnyway",
                            "labelSelector": {"matchLabels": selector},
                        }
                    ],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(serve, rname, labels, uid),
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }
    return [account, role, binding, config_map, deployment, service]


# --- everything -------------------------------------------------------------------------------------------


def build_objects(
    serve: LLMServe,
    target: ClusterTarget,
    *,
    uid: str,
    image: str,
    draining: Sequence[str] = (),
    profile: PerformanceProfile | None = None,
) -> list[dict[str, Any]]:
    """Every Kubernetes object of ``serve`` for the pools of ``target`` (module doc), ready for server-side apply.

    Args:
        serve: the validated resource (its ``metadata.name``/``namespace`` name and place the objects).
        target: pool sizes and TPs (``replicas`` of the pool Deployments, ``nvidia.com/gpu`` = TP, the
            ``fulcrum.dev/tp`` label) and the routing parameters written into the router config. Only the pools
            of :data:`MODE_POOLS` for ``spec.mode`` are built; a pool the target leaves at 0 gets a Deployment with
            0 replicas.
        uid: ``metadata.uid`` of the LLMServe (the ownerReference).
        image: the Fulcrum control-plane image (router pods, and worker pods of engine kind ``sim``).
        draining: instance ids (pod names) the router must give no new requests (scale-in, drain protocol).
        profile: the loaded performance profile, inlined into the router config for the ``split`` policy when
            ``spec.profile`` is a file or ConfigMap (a built-in profile is passed by name).

    Returns:
        complete manifests (apiVersion, kind, metadata with namespace, labels, ownerReference and
        ``fulcrum.dev/desired-hash``), sorted ServiceAccount, Role, RoleBinding, ConfigMap, Service, Deployment,
        then by name. Equal inputs give equal lists.

    Raises:
        ValueError: ``uid`` or ``image`` is empty.
        SpecError: the router config built from the spec is invalid (see :func:`router_config`).
    """
    if not uid:
        raise ValueError("build_objects needs the LLMServe's uid (the ownerReference)")
    if not image:
        raise ValueError("build_objects needs the Fulcrum image (router and sim-worker pods)")
    objects: list[dict[str, Any]] = []
    for pool in MODE_POOLS[serve.spec.mode]:
        objects += _pool_objects(serve, pool.value, target.pool(pool), uid=uid, image=image)
    objects += _router_objects(serve, target, uid=uid, image=image, draining=draining, profile=profile)
    for obj in objects:
        obj["metadata"].setdefault("annotations", {})[ANNOTATION_DESIRED_HASH] = object_hash(obj)
    objects.sort(key=lambda o: (_APPLY_ORDER.index(o["kind"]), o["metadata"]["name"]))
    return objects
