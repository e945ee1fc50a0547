"""The operator's objects: what `build_objects` makes of each example, checked against Kubernetes' schemas,
golden files, the router's own config and registry parsers, and the ownership/RBAC/placement rules.

Golden files: tests/unit/golden/controller/<example>.yaml; rewrite them with FULCRUM_UPDATE_GOLDEN=1 (and read
the diff).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from fulcrum.api import LLMServe, load_llmserve, parse_llmserve
from fulcrum.controller.resources import (
    ANNOTATION_DESIRED_HASH,
    ANNOTATION_POD_SPEC_HASH,
    MODE_POOLS,
    POOL_ROLES,
    SCHEDULER_METRICS_PORT,
    build_objects,
    initial_target,
    pool_deployment_name,
    router_config,
    worker_selector,
)
from fulcrum.errors import SpecError
from fulcrum.router.config import RouterConfig, parse_config
from fulcrum.router.registry_k8s import records_from_slice
from fulcrum.target import ClusterTarget, PoolSize, RoutingParams

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
GOLDEN = Path(__file__).resolve().parent / "golden" / "controller"
UID = "0f6b7c1e-5d1a-4c55-9a0e-7d3f2b1c9e10"
IMAGE = "ghcr.io/fulcrum-llm/fulcrum:0.1.0"
EXAMPLE_NAMES = [
    "llmserve-disaggregated-70b-h100",
    "llmserve-unified-70b-a100",
    "llmserve-auto",
    "llmserve-sim",
]
K8S_VERSION = "1.33"  # a recent release kubernetes-validate ships (it has 1.28 … 1.37)


def _serve(name: str) -> LLMServe:
    return load_llmserve(EXAMPLES / f"{name}.yaml")


def _objects(serve: LLMServe, target: ClusterTarget | None = None, **kw: Any) -> list[dict[str, Any]]:
    return build_objects(serve, target or initial_target(serve), uid=UID, image=IMAGE, **kw)


def _by(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (obj,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def _with(serve: LLMServe, **spec_overrides: Any) -> LLMServe:
    """The example with some spec members replaced (a deep merge of mappings)."""
    doc = serve.model_dump(mode="json", by_alias=True, exclude_none=True)

    def merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
        for k, v in src.items():
            if isinstance(v, dict) and isinstance(dst.get(k), dict):
                merge(dst[k], v)
            else:
                dst[k] = v

    merge(doc["spec"], spec_overrides)
    return parse_llmserve(doc)


class _GoldenDumper(yaml.SafeDumper):
    """Multi-line strings (the router.yaml) as literal blocks, so golden files read like the ConfigMap."""


def _str_presenter(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    if "\n" in data:
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|")
    return dumper.represent_scalar("tag:yaml.org,2002:str", data)


_GoldenDumper.add_representer(str, _str_presenter)


def _render(objects: list[dict[str, Any]]) -> str:
    return yaml.dump_all(objects, Dumper=_GoldenDumper, sort_keys=False, width=120, allow_unicode=True)


# --- schemas and golden files ----------------------------------------------------------------------------


@pytest.mark.parametrize("example", EXAMPLE_NAMES)
def test_every_object_validates_against_the_kubernetes_openapi_schemas(example: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for obj in _objects(_serve(example)):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_kubernetes_validate_rejects_a_broken_deployment_so_the_schema_check_is_real() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    dep = copy.deepcopy(_by(_objects(_serve("llmserve-sim")), "Deployment", "sim-llama-70b-decode"))
    dep["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)


@pytest.mark.parametrize("example", EXAMPLE_NAMES)
def test_objects_equal_the_golden_file(example: str) -> None:
    text = _render(_objects(_serve(example)))
    path = GOLDEN / f"{example}.yaml"
    if os.environ.get("FULCRUM_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"{path} is missing: run with FULCRUM_UPDATE_GOLDEN=1"
    assert text == path.read_text(encoding="utf-8"), f"{path.name} differs: rerun with FULCRUM_UPDATE_GOLDEN=1 and review"


def test_building_twice_gives_equal_objects_in_apply_order() -> None:
    serve = _serve("llmserve-auto")
    first, second = _objects(serve), _objects(serve)
    assert first == second
    kinds = [o["kind"] for o in first]
    assert kinds == sorted(kinds, key=["ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service", "Deployment"].index)


# --- ownership and labels --------------------------------------------------------------------------------


@pytest.mark.parametrize("example", EXAMPLE_NAMES)
def test_every_object_is_owned_by_the_llmserve_and_labelled(example: str) -> None:
    serve = _serve(example)
    name = serve.metadata.name
    for obj in _objects(serve):
        meta = obj["metadata"]
        assert meta["namespace"] == serve.metadata.namespace
        assert meta["ownerReferences"] == [{
            "apiVersion": "fulcrum.dev/v1alpha1", "kind": "LLMServe", "name": name, "uid": UID,
            "controller": True, "blockOwnerDeletion": True,
        }]
        assert {k: meta["labels"][k] for k in ("app.kubernetes.io/name", "app.kubernetes.io/managed-by",
                                               "fulcrum.dev/llmserve")} == {
            "app.kubernetes.io/name": "fulcrum", "app.kubernetes.io/managed-by": "fulcrum-operator",
            "fulcrum.dev/llmserve": name,
        }
        assert len(meta["annotations"][ANNOTATION_DESIRED_HASH]) == 16


@pytest.mark.parametrize(
    ("example", "pools"),
    [
        ("llmserve-disaggregated-70b-h100", {"prefill", "decode"}),
        ("llmserve-unified-70b-a100", {"unified"}),
        ("llmserve-auto", {"prefill", "decode", "unified"}),
        ("llmserve-sim", {"prefill", "decode"}),
    ],
)
def test_only_the_pools_the_mode_uses_are_built_with_role_and_tp_labels(example: str, pools: set[str]) -> None:
    serve = _serve(example)
    target = initial_target(serve)
    objects = _objects(serve, target)
    name = serve.metadata.name
    deployments = {o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"}
    assert deployments == {pool_deployment_name(name, p) for p in pools} | {f"{name}-router"}
    assert set(MODE_POOLS[serve.spec.mode]) == pools
    for pool in pools:
        size = getattr(target, pool)
        for kind in ("Deployment", "Service"):
            labels = _by(objects, kind, f"{name}-{pool}")["metadata"]["labels"]
            assert (labels["fulcrum.dev/pool"], labels["fulcrum.dev/role"], labels["fulcrum.dev/tp"]) == (
                pool, POOL_ROLES[pool], str(size.tp))
        dep = _by(objects, "Deployment", f"{name}-{pool}")
        assert dep["spec"]["replicas"] == size.replicas
        assert dep["spec"]["template"]["metadata"]["labels"]["fulcrum.dev/tp"] == str(size.tp)
        # the selector never holds TP or role: changing them must not need a new (immutable) selector
        assert set(dep["spec"]["selector"]["matchLabels"]) == {
            "app.kubernetes.io/name", "fulcrum.dev/llmserve", "app.kubernetes.io/component", "fulcrum.dev/pool"}


# --- worker pods -----------------------------------------------------------------------------------------


def _worker(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    container = _by(objects, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]
    assert isinstance(container, dict)
    return container


def test_vllm_workers_request_tp_gpus_and_sim_workers_none() -> None:
    serve = _serve("llmserve-disaggregated-70b-h100")
    target = ClusterTarget(prefill=PoolSize(3, 1), decode=PoolSize(2, 4))
    objects = _objects(serve, target)
    for pool, tp in (("prefill", 1), ("decode", 4)):
        res = _worker(objects, f"llama-70b-fp8-{pool}")["resources"]
        assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == str(tp)
    sim = _objects(_serve("llmserve-sim"))
    for pool in ("prefill", "decode"):
        c = _worker(sim, f"sim-llama-70b-{pool}")
        assert "nvidia.com/gpu" not in str(c["resources"])
        assert c["resources"] == {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}}
        assert c["image"] == IMAGE


def test_vllm_worker_args_carry_the_contract_flags_and_extra_args_after_a_double_dash() -> None:
    serve = _with(_serve("llmserve-disaggregated-70b-h100"), connectors={"etcd": "etcd.fulcrum:2379"})
    target = ClusterTarget(prefill=PoolSize(1, 1), decode=PoolSize(1, 2))
    c = _worker(_objects(serve, target), "llama-70b-fp8-decode")
    assert c["command"] == ["fulcrum"]
    args = c["args"]
    assert args[0] == "worker"
    flags = dict(zip(args[1:args.index("--")][::2], args[1:args.index("--")][1::2]))
    assert flags == {
        "--model": "meta-llama/Llama-3.1-70B-Instruct", "--served-model-name": "llama-3.1-70b", "--tp": "2",
        "--host": "0.0.0.0", "--port": "8000", "--role": "decode", "--pool": "decode", "--gpu-type": "H100",
        "--max-model-len": "8192", "--block-size": "16", "--kv-connector": "nixl", "--nixl-port": "5600",
        "--scheduler": "fulcrum", "--scheduler-metrics-port": "8002", "--tpot-slo-ms": "80", "--health-port": "8001", "--etcd": "etcd.fulcrum:2379",
        "--namespace": "default",
        "--llmserve": "llama-70b-fp8", "--drain-timeout-s": "300",
    }
    assert args[args.index("--") + 1:] == ["--quantization", "fp8"]
    assert [e["name"] for e in c["env"]] == ["POD_NAME", "POD_NAMESPACE", "POD_IP"]
    assert c["env"][2]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8000, "nixl": 5600, "health": 8001,
                                                                    "scheduler": 8002}
    # readiness follows the supervisor (503 while starting or draining); liveness vLLM's own /health (200 while
    # draining), so a draining worker leaves the Service but is not restarted
    assert c["readinessProbe"]["httpGet"] == c["startupProbe"]["httpGet"] == {"path": "/health", "port": "health"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}


def test_without_an_etcd_connector_workers_get_no_etcd_flag_and_the_router_reads_endpointslices() -> None:
    serve = _serve("llmserve-unified-70b-a100")
    objects = _objects(serve)
    assert "--etcd" not in _worker(objects, "llama2-70b-a100-unified")["args"]
    assert "--" not in _worker(objects, "llama2-70b-a100-unified")["args"]
    assert _worker(objects, "llama2-70b-a100-unified")["args"][_worker(objects, "llama2-70b-a100-unified")["args"].index("--role") + 1] == "both"
    config = parse_config(yaml.safe_load(_by(objects, "ConfigMap", "llama2-70b-a100-router")["data"]["router.yaml"]))
    assert config.registry == "kubernetes"
    assert config.kubernetes.label_selector == worker_selector("llama2-70b-a100")


def test_sim_workers_run_fulcrum_sim_worker_with_the_profile_and_a_configmap_profile_is_mounted() -> None:
    c = _worker(_objects(_serve("llmserve-sim")), "sim-llama-70b-prefill")
    args = c["args"]
    assert args[0] == "sim-worker"
    flags = dict(zip(args[1::2], args[2::2]))
    assert (flags["--profile"], flags["--tp"], flags["--model"], flags["--role"], flags["--port"]) == (
        "dopd-llama70b-fp8-h100", "1", "llama-70b-sim", "prefill", "8000")
    assert "nixl" not in str(c["ports"])
    serve = _with(_serve("llmserve-sim"), profile={"name": None, "configMap": "my-profile"},
                  engine={"extraArgs": ["--time-scale", "0.1"]})
    dep = _by(_objects(serve), "Deployment", "sim-llama-70b-decode")
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["args"][c["args"].index("--profile") + 1] == "/etc/fulcrum/profile/profile.yaml"
    assert c["args"][-2:] == ["--time-scale", "0.1"]
    assert pod["volumes"] == [{"name": "profile", "configMap": {"name": "my-profile"}}]
    assert c["volumeMounts"] == [{"name": "profile", "mountPath": "/etc/fulcrum/profile", "readOnly": True}]


def test_worker_pods_probe_health_and_get_the_drain_timeout_plus_thirty_seconds_of_grace() -> None:
    serve = _with(_serve("llmserve-sim"), scaling={"drainTimeoutSeconds": 120})
    pod = _by(_objects(serve), "Deployment", "sim-llama-70b-decode")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 150
    c = pod["containers"][0]
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # /health answers 503 while draining: liveness must not restart a draining worker
    assert "httpGet" not in c["livenessProbe"] and c["livenessProbe"]["tcpSocket"] == {"port": "http"}
    (spread,) = pod["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["labelSelector"]["matchLabels"]["fulcrum.dev/pool"] == "decode"


def test_placement_reaches_every_worker_pod_and_not_the_router() -> None:
    placement = {
        "nodeSelector": {"cloud.example.com/pool": "gpu"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
        "gpuTypeLabel": "nvidia.com/gpu.product",
    }
    serve = _with(_serve("llmserve-auto"), placement=placement)
    objects = _objects(serve)
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for pool in ("prefill", "decode", "unified"):
        dep = _by(objects, "Deployment", f"llama2-70b-auto-{pool}")
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)
        pod = dep["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"cloud.example.com/pool": "gpu", "nvidia.com/gpu.product": "H100"}
        assert pod["tolerations"] == placement["tolerations"]
        assert pod["affinity"] == placement["affinity"]
    router_pod = _by(objects, "Deployment", "llama2-70b-auto-router")["spec"]["template"]["spec"]
    assert not {"nodeSelector", "tolerations", "affinity"} & router_pod.keys()
    # sim workers need no GPU node: the GPU-type selector is not added for them
    sim = _objects(_with(_serve("llmserve-sim"), placement=placement))
    pod = _by(sim, "Deployment", "sim-llama-70b-prefill")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.example.com/pool": "gpu"}


def test_pool_services_become_router_registry_records_with_role_pool_and_tp() -> None:
    """The EndpointSlice controller copies a Service's labels onto its slices; the router's parser reads them."""
    serve = _serve("llmserve-disaggregated-70b-h100")
    objects = _objects(serve, ClusterTarget(prefill=PoolSize(2, 1), decode=PoolSize(1, 2)))
    config = parse_config(yaml.safe_load(_by(objects, "ConfigMap", "llama-70b-fp8-router")["data"]["router.yaml"]))
    wanted = dict(kv.split("=") for kv in config.kubernetes.label_selector.split(","))
    for pool, role, tp in (("prefill", "prefill", 1), ("decode", "decode", 2)):
        svc = _by(objects, "Service", f"llama-70b-fp8-{pool}")
        assert svc["spec"]["clusterIP"] == "None"
        assert wanted.items() <= svc["metadata"]["labels"].items()
        assert svc["spec"]["selector"].items() <= _by(objects, "Deployment", f"llama-70b-fp8-{pool}")[
            "spec"]["template"]["metadata"]["labels"].items()
        endpoint_slice = {
            "metadata": {"name": f"{pool}-abc", "labels": {**svc["metadata"]["labels"],
                                                            "kubernetes.io/service-name": svc["metadata"]["name"]}},
            "ports": [{"name": p["name"], "port": p["port"]} for p in svc["spec"]["ports"]],
            "endpoints": [{"addresses": ["10.0.0.7"], "conditions": {"ready": True},
                           "targetRef": {"kind": "Pod", "name": f"llama-70b-fp8-{pool}-x"}}],
        }
        (record,) = records_from_slice(endpoint_slice, port_name=config.kubernetes.port_name,
                                       role_label=config.kubernetes.role_label,
                                       pool_label=config.kubernetes.pool_label, tp_label=config.kubernetes.tp_label)
        assert (record.role, record.pool, record.tp, record.url) == (role, pool, tp, "http://10.0.0.7:8000")
    router_svc = _by(objects, "Service", "llama-70b-fp8-router")
    assert not wanted.items() <= router_svc["metadata"]["labels"].items()  # the router is not an instance


# --- router ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("example", EXAMPLE_NAMES)
def test_router_configmap_is_a_valid_router_config_with_the_planned_routing(example: str) -> None:
    serve = _serve(example)
    target = initial_target(serve)
    objects = _objects(serve, target)
    cm = _by(objects, "ConfigMap", f"{serve.metadata.name}-router")
    config = parse_config(yaml.safe_load(cm["data"]["router.yaml"]))
    assert isinstance(config, RouterConfig)
    assert config.model == (serve.spec.model.served_name or serve.spec.model.name)
    assert config.max_model_len == serve.spec.engine.max_model_len
    assert config.kv_block_size == serve.spec.engine.block_size
    assert config.policy.name == serve.spec.router.policy.value
    if config.policy.name == "disaggregated":
        assert config.policy.params["ultra_short_tokens"] == target.routing.ultra_short_tokens
        assert config.policy.params["long_request_tokens"] == target.routing.long_request_tokens
    from fulcrum.routing.registry import make_policy

    make_policy(config.policy.name, config.policy.params)  # the router can build the policy from it
    dep = _by(objects, "Deployment", f"{serve.metadata.name}-router")
    assert dep["spec"]["replicas"] == serve.spec.router.replicas
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == IMAGE
    assert c["args"] == ["router", "--config", "/etc/fulcrum/router.yaml", "--port", "8000"]
    assert c["volumeMounts"][0]["mountPath"] == "/etc/fulcrum"  # a directory mount: live ConfigMap updates
    assert "annotations" not in dep["spec"]["template"]["metadata"] or not any(
        "checksum" in k for k in dep["spec"]["template"]["metadata"]["annotations"])


def test_routing_parameters_of_a_new_plan_reach_the_router_config() -> None:
    serve = _serve("llmserve-disaggregated-70b-h100")
    routing = RoutingParams(ultra_short_tokens=300, long_request_tokens=3000, batch_timeout_s=0.25,
                            length_aware_batching=True, max_prefill_batch_tokens=6000)
    doc = router_config(serve, ClusterTarget(prefill=PoolSize(1, 1), decode=PoolSize(1, 2), routing=routing))
    assert doc["policy"]["params"] == {"ultra_short_tokens": 300, "kv_block_tokens": 16, "long_request_tokens": 3000,
                                       "batch_timeout_s": 0.25, "max_batch_tokens": 6000}


def test_an_etcd_connector_switches_the_router_to_the_etcd_registry_and_drops_its_rbac_rules() -> None:
    serve = _with(_serve("llmserve-sim"), connectors={"etcd": "etcd:2379"})
    objects = _objects(serve)
    config = parse_config(yaml.safe_load(_by(objects, "ConfigMap", "sim-llama-70b-router")["data"]["router.yaml"]))
    assert (config.registry, config.etcd.endpoint, config.etcd.namespace, config.etcd.llmserve) == (
        "etcd", "etcd:2379", "default", "sim-llama-70b")
    assert _by(objects, "Role", "sim-llama-70b-router")["rules"] == []


def test_router_rbac_is_least_privilege_read_of_endpointslices_in_its_namespace() -> None:
    objects = _objects(_serve("llmserve-disaggregated-70b-h100"))
    kinds = {o["kind"] for o in objects}
    assert "ClusterRole" not in kinds and "ClusterRoleBinding" not in kinds
    role = _by(objects, "Role", "llama-70b-fp8-router")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    assert "*" not in str(role["rules"])
    binding = _by(objects, "RoleBinding", "llama-70b-fp8-router")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "llama-70b-fp8-router"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llama-70b-fp8-router", "namespace": "default"}]
    router_pod = _by(objects, "Deployment", "llama-70b-fp8-router")["spec"]["template"]["spec"]
    assert router_pod["serviceAccountName"] == "llama-70b-fp8-router"
    for pool in ("prefill", "decode"):  # workers never talk to the API
        pod = _by(objects, "Deployment", f"llama-70b-fp8-{pool}")["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False


def test_a_nats_prefill_queue_is_written_with_the_llmserve_stream_names() -> None:
    from fulcrum.router.prefill_queue import QueueLayout

    serve = _with(_serve("llmserve-sim"), router={"prefillQueue": "nats"}, connectors={"nats": "nats://nats:4222"})
    objects = _objects(serve)
    config = parse_config(yaml.safe_load(_by(objects, "ConfigMap", "sim-llama-70b-router")["data"]["router.yaml"]))
    # the prefill pool pulls the queue's jobs; the decode pool does not
    args = {pool: _by(objects, "Deployment", f"sim-llama-70b-{pool}")["spec"]["template"]["spec"]["containers"][0]["args"]
            for pool in ("prefill", "decode")}
    assert args["prefill"][args["prefill"].index("--nats") + 1] == "nats://nats:4222"
    assert "--nats" not in args["decode"]
    layout = QueueLayout.for_llmserve("default", "sim-llama-70b")
    queue = config.prefill_queue
    assert (queue.kind, queue.url, queue.stream, queue.subject_prefix) == (
        "nats", "nats://nats:4222", layout.stream, layout.subject_prefix)
    # no URL in the spec (the operator fills its own --nats-url before this): the spec parses, the objects refuse
    with pytest.raises(SpecError, match="connectors.nats"):
        _objects(_with(_serve("llmserve-sim"), router={"prefillQueue": "nats"}))


def test_draining_instances_are_written_sorted_into_the_router_config() -> None:
    serve = _serve("llmserve-sim")
    objects = _objects(serve, draining=["sim-llama-70b-decode-b", "sim-llama-70b-decode-a"])
    config = parse_config(yaml.safe_load(_by(objects, "ConfigMap", "sim-llama-70b-router")["data"]["router.yaml"]))
    assert list(config.draining) == ["sim-llama-70b-decode-a", "sim-llama-70b-decode-b"]


def test_a_router_config_the_router_would_reject_is_a_spec_error() -> None:
    serve = _serve("llmserve-sim")
    with pytest.raises(SpecError, match="router config"):
        # a plan the router's policy rejects (an empty prefill batch budget) never reaches the ConfigMap
        router_config(serve, ClusterTarget(routing=RoutingParams(max_prefill_batch_tokens=0)))
    with pytest.raises(ValueError, match="uid"):
        build_objects(serve, initial_target(serve), uid="", image=IMAGE)


# --- what changes when ----------------------------------------------------------------------------------


def test_a_router_only_spec_change_leaves_the_pool_deployments_unchanged() -> None:
    serve = _serve("llmserve-disaggregated-70b-h100")
    target = initial_target(serve)
    before = _objects(serve, target)
    changed = _with(serve, router={"replicas": 3, "policy": "load_aware"})
    after = _objects(changed, target)
    for pool in ("prefill", "decode"):
        for kind in ("Deployment", "Service"):
            assert _by(before, kind, f"llama-70b-fp8-{pool}") == _by(after, kind, f"llama-70b-fp8-{pool}")
    assert _by(before, "Deployment", "llama-70b-fp8-router") != _by(after, "Deployment", "llama-70b-fp8-router")
    assert _by(before, "ConfigMap", "llama-70b-fp8-router") != _by(after, "ConfigMap", "llama-70b-fp8-router")


def test_the_pod_spec_hash_follows_the_pod_template_and_ignores_the_replica_count() -> None:
    serve = _serve("llmserve-disaggregated-70b-h100")

    def pod_hash(s: LLMServe, target: ClusterTarget) -> str:
        dep = _by(_objects(s, target), "Deployment", "llama-70b-fp8-decode")
        assert dep["metadata"]["annotations"][ANNOTATION_POD_SPEC_HASH] == \
            dep["spec"]["template"]["metadata"]["annotations"][ANNOTATION_POD_SPEC_HASH]
        return str(dep["metadata"]["annotations"][ANNOTATION_POD_SPEC_HASH])

    base = pod_hash(serve, ClusterTarget(prefill=PoolSize(1, 1), decode=PoolSize(1, 2)))
    assert pod_hash(serve, ClusterTarget(prefill=PoolSize(5, 1), decode=PoolSize(4, 2))) == base
    assert pod_hash(serve, ClusterTarget(prefill=PoolSize(1, 1), decode=PoolSize(1, 4))) != base
    assert pod_hash(_with(serve, engine={"extraArgs": []}), ClusterTarget(prefill=PoolSize(1, 1),
                                                                         decode=PoolSize(1, 2))) != base


def test_initial_target_uses_the_planner_start_and_splits_an_external_total_by_the_ratio() -> None:
    serve = _serve("llmserve-disaggregated-70b-h100")
    t = initial_target(serve)
    assert (t.prefill.tp, t.decode.tp) == (1, 2)  # the spec's fixed TPs
    assert (t.prefill.replicas, t.decode.replicas, t.unified.replicas) == (1, 1, 0)
    external = _with(serve, scaling={"replicaOwner": "External", "replicas": 7, "initialPrefill": 3,
                                     "initialDecode": 1})
    t = initial_target(external)
    assert (t.prefill.replicas, t.decode.replicas) == (5, 2)
    assert t.prefill.replicas + t.decode.replicas == 7
    unified = initial_target(_with(_serve("llmserve-unified-70b-a100"),
                                   scaling={"replicaOwner": "External", "replicas": 3}))
    assert (unified.unified.replicas, unified.prefill.replicas, unified.decode.replicas) == (3, 0, 0)


def test_rescheduling_and_role_reassignment_reach_the_router_config_when_the_spec_asks() -> None:
    plain = parse_config(yaml.safe_load(_by(_objects(_serve("llmserve-sim")), "ConfigMap", "sim-llama-70b-router")["data"]["router.yaml"]))
    assert not plain.rescheduling.enabled and not plain.roles.enabled
    serve = _with(_serve("llmserve-sim"), router={"rescheduling": True, "roleReassignment": True})
    config = parse_config(yaml.safe_load(_by(_objects(serve), "ConfigMap", "sim-llama-70b-router")["data"]["router.yaml"]))
    assert config.rescheduling.enabled and config.roles.enabled
    assert not config.roles.migrate_on_flip  # recomputing a new prefill-duty instance's decodes costs more
    # the router's migrations recompute the context: C_mig is priced by the profile's prefill throughput
    rate = config.rescheduling.recompute_tokens_per_s
    assert rate > 1000 and config.rescheduling.planner().migration_seconds(4096) == pytest.approx(
        4096 / rate + config.rescheduling.transfer_overhead_s)
    assert config.roles.ttft_slo_s == serve.spec.slo.ttft_ms / 1000


def test_prefix_pulls_reach_the_workers_and_the_router_when_the_spec_asks() -> None:
    """router.prefixPull (BanaServe §4.2): vLLM workers run NIXL with bidirectional transfers, the load_aware
    policy plans pulls, and the router prices them from the profile; the router config stays valid."""
    serve = _with(_serve("llmserve-disaggregated-70b-h100"), router={"policy": "load_aware", "prefixPull": True})
    objects = _objects(serve)
    name = serve.metadata.name
    config = parse_config(yaml.safe_load(_by(objects, "ConfigMap", f"{name}-router")["data"]["router.yaml"]))
    assert config.policy.name == "load_aware" and config.policy.params["prefix_pull"] is True
    assert config.policy.params["kv_block_tokens"] == serve.spec.engine.block_size
    assert config.kv_connector.partial_prefix
    assert config.kv_connector.kv_bytes_per_token > 0 and config.kv_connector.prefill_tokens_per_s > 0
    workers = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] != f"{name}-router"]
    assert workers and all("--kv-prefix-pull" in o["spec"]["template"]["spec"]["containers"][0]["args"]
                           for o in workers)
    plain = _objects(_with(serve, router={"prefixPull": False}))
    assert all("--kv-prefix-pull" not in o["spec"]["template"]["spec"]["containers"][0]["args"]
               for o in plain if o["kind"] == "Deployment")


def test_role_reassignment_bounds_come_from_the_plans_duty_split() -> None:
    """A unified pool of 8 whose plan expects 0.8 of it on prefill duty: the router may flip within [3, 7]
    prefill instances; before any plan (no share) only one instance per duty is kept."""
    serve = _with(_serve("llmserve-unified-70b-a100"), router={"roleReassignment": True})
    name = serve.metadata.name
    base = initial_target(serve)
    planned = ClusterTarget(unified=PoolSize(8, base.unified.tp),
                            routing=RoutingParams(prefill_share=0.8, long_request_tokens=1000, decode_concurrency=88))
    roles = parse_config(yaml.safe_load(_by(_objects(serve, planned), "ConfigMap", f"{name}-router")["data"]["router.yaml"])).roles
    assert (roles.min_prefill, roles.max_prefill, roles.min_decode, roles.max_decode) == (3, 7, 1, 5)
    assert roles.decode_slo_batch == 88  # a decode-duty instance is full at the plan's SLO batch
    unplanned = ClusterTarget(unified=PoolSize(8, base.unified.tp))
    roles = parse_config(yaml.safe_load(_by(_objects(serve, unplanned), "ConfigMap", f"{name}-router")["data"]["router.yaml"])).roles
    assert (roles.min_prefill, roles.max_prefill, roles.min_decode, roles.max_decode) == (1, 7, 1, 7)
    assert roles.decode_slo_batch is None


def test_vllm_workers_serve_the_scheduler_metrics_on_a_named_port_the_pod_monitor_scrapes() -> None:
    serve = _serve("llmserve-disaggregated-70b-h100")
    workers = [o for o in _objects(serve) if o["kind"] == "Deployment" and o["metadata"]["name"] != f"{serve.metadata.name}-router"]
    assert workers
    for o in workers:
        (c,) = o["spec"]["template"]["spec"]["containers"]
        assert {"name": "scheduler", "containerPort": SCHEDULER_METRICS_PORT, "protocol": "TCP"} in c["ports"]
        assert c["args"][c["args"].index("--scheduler-metrics-port") + 1] == str(SCHEDULER_METRICS_PORT)
    sim = [o for o in _objects(_serve("llmserve-sim")) if o["kind"] == "Deployment"]
    assert all("--scheduler-metrics-port" not in o["spec"]["template"]["spec"]["containers"][0]["args"] for o in sim)


def test_the_router_has_a_startup_probe_so_a_slow_start_is_not_killed_by_liveness() -> None:
    """Found by the local-cluster load scenario (docs/e2e.md): on a busy node the router's Python start-up took
    over 30 s and its liveness probe (10 s × 3) killed it before it ever listened, again and again."""
    c = _by(_objects(_serve("llmserve-sim")), "Deployment", "sim-llama-70b-router")["spec"]["template"]["spec"][
        "containers"][0]
    probe = c["startupProbe"]
    assert probe["httpGet"] == c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 300
