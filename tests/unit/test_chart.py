"""The Helm chart (charts/fulcrum): rendered by Helm's own engine for three value sets, checked against the
Kubernetes schemas, the values schema, least-privilege RBAC, the contracts, and the repository's CRD.

Value sets: the defaults, ``ci/full-values.yaml`` (everything on) and ``ci/namespaced-values.yaml`` (a minimal
namespaced install). Rendering needs ``helm-python-sdk`` (Helm v4's Go engine through ctypes, see
tests/helm_render.py); without it the rendering tests skip and say how to install it. Prometheus Operator objects
(ServiceMonitor, PodMonitor, PrometheusRule) and kopf peering objects are custom resources whose CRDs are not
available here: they are checked for apiVersion, kind and the fields the Operator requires.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

import helm_render

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "fulcrum"
K8S_VERSION = "1.28"  # the chart's lowest supported release (Chart.yaml kubeVersion)
VALUE_SETS = {
    "default": None,
    "full": CHART / "ci" / "full-values.yaml",
    "namespaced": CHART / "ci" / "namespaced-values.yaml",
}
CUSTOM_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("kopf.dev/v1", "ClusterKopfPeering"),
    ("kopf.dev/v1", "KopfPeering"),
}
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "ClusterKopfPeering"}


def _values(name: str) -> dict[str, Any] | None:
    path = VALUE_SETS[name]
    return None if path is None else yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def helm() -> None:
    reason = helm_render.helm_missing()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def rendered(helm: None) -> dict[str, list[dict[str, Any]]]:
    return {name: helm_render.objects(helm_render.render(_values(name))) for name in VALUE_SETS}


def _one(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind} {name}: {[o['metadata']['name'] for o in found]}"
    return found[0]


def _args(objs: list[dict[str, Any]]) -> list[str]:
    dep = _one(objs, "Deployment", "fulcrum-operator")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["fulcrum"]
    return list(c["args"])


# ------------------------------------------------------------------ values and schema (no Helm needed)
def test_values_yaml_and_every_ci_value_set_satisfy_the_values_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator(schema).validate(defaults)
    for name, path in VALUE_SETS.items():
        if path is not None:
            merged = _deep_merge(copy.deepcopy(defaults), yaml.safe_load(path.read_text()))
            jsonschema.Draft7Validator(schema).validate(merged)


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    for k, v in over.items():
        base[k] = _deep_merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return base


@pytest.mark.parametrize(
    ("patch", "where"),
    [
        ({"operatr": {}}, "operatr"),  # a typo'd top-level key
        ({"operator": {"logFormat": "xml"}}, "xml"),
        ({"operator": {"namespaces": ["Bad_NS"]}}, "Bad_NS"),
        ({"prometheusRule": {"thresholds": {"sloAttainmentTarget": 1.5}}}, "1.5"),
        ({"nats": {"url": "http://nats:4222"}}, "http://nats:4222"),
        ({"metrics": {"podMonitor": {"interval": "fast"}}}, "fast"),
        ({"image": {"pullPolicy": "Sometimes"}}, "Sometimes"),
    ],
)
def test_the_values_schema_rejects_typos_and_bad_settings(patch: dict[str, Any], where: str) -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = _deep_merge(yaml.safe_load((CHART / "values.yaml").read_text()), patch)
    with pytest.raises(jsonschema.ValidationError) as e:
        jsonschema.Draft7Validator(schema).validate(values)
    assert where in str(e.value)


def test_chart_metadata_pins_versions_and_the_lowest_kubernetes() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["version"] == "0.1.0" and chart["appVersion"] == "0.1.0"
    assert chart["kubeVersion"].startswith(">=1.28")
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for image in (values["nats"]["image"], values["etcd"]["image"]):
        assert image["tag"] and image["tag"] != "latest"  # bundled third-party images are pinned
    assert values["etcd"]["image"]["repository"] in ("registry.k8s.io/etcd", "quay.io/coreos/etcd")
    assert values["nats"]["image"]["repository"] == "nats"


def test_the_chart_crd_is_exactly_the_repository_crd() -> None:
    repo_crd = (REPO / "crds" / "llmserve.yaml").read_text()
    chart_crd = (CHART / "crds" / "llmserve.yaml").read_text()
    assert chart_crd == repo_crd, "charts/fulcrum/crds/llmserve.yaml is stale: run scripts/sync-chart-crd.sh"


# ------------------------------------------------------------------ rendering (Helm's engine)
@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_every_rendered_object_passes_the_kubernetes_schemas(rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    objs = rendered[name]
    assert objs
    for obj in objs:
        meta = obj["metadata"]
        assert meta["labels"]["app.kubernetes.io/name"] == "fulcrum", meta["name"]
        assert meta["labels"]["app.kubernetes.io/instance"] == helm_render.RELEASE
        if obj["kind"] not in CLUSTER_SCOPED:
            assert meta.get("namespace"), f"{obj['kind']} {meta['name']} has no namespace"
        if (obj["apiVersion"], obj["kind"]) in CUSTOM_KINDS:
            _check_custom(obj)
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def _check_custom(obj: dict[str, Any]) -> None:
    """Fields the Prometheus Operator's CRDs require (its CRD schemas are not available offline)."""
    kind, spec = obj["kind"], obj.get("spec", {})
    if kind == "ServiceMonitor":
        assert spec["selector"]["matchLabels"] and spec["endpoints"]
        assert all(ep["port"] for ep in spec["endpoints"])
    elif kind == "PodMonitor":
        assert spec["selector"] and spec["podMetricsEndpoints"]
        for ep in spec["podMetricsEndpoints"]:
            # the contract's container port names: http (routers, workers), scheduler (vLLM workers' scheduler)
            assert ep["port"] in ("http", "scheduler")
            for r in ep.get("relabelings", []):
                assert set(r) <= {"sourceLabels", "separator", "targetLabel", "regex", "modulus", "replacement", "action"}
    elif kind == "PrometheusRule":
        for group in spec["groups"]:
            assert group["name"] and group["rules"]
            for rule in group["rules"]:
                assert rule["alert"] and rule["expr"] and rule["for"]
    else:  # kopf peering objects: no spec, kopf writes their status
        assert "spec" not in obj


def test_helm_lint_strict_finds_no_warning_or_error(helm: None) -> None:
    for name in VALUE_SETS:
        report = helm_render.lint(_values(name))
        assert report["errors"] == []
        assert [m for m in report["messages"] if m["severity"] >= 2] == [], name


def test_helm_refuses_values_the_schema_rejects(helm: None) -> None:
    import helm_python

    with pytest.raises(helm_python.HelmError) as e:
        helm_render.render({"operator": {"logFormat": "xml"}})
    assert "logFormat" in str(e.value)


def test_the_default_install_watches_all_namespaces_with_cluster_peering(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objs = rendered["default"]
    args = _args(objs)
    assert args[0] == "operator" and "--all-namespaces" in args
    assert not any(a.startswith("--namespace") for a in args)
    assert "--peering=fulcrum" in args and "--liveness-port=8080" in args and "--metrics-port=9090" in args
    assert "--image=ghcr.io/fulcrum-llm/fulcrum:0.1.0" in args  # tag defaults to appVersion
    peering = _one(objs, "ClusterKopfPeering", "fulcrum")
    assert peering["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    crds = {o["metadata"]["name"] for o in objs if o["kind"] == "CustomResourceDefinition"}
    assert crds == {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}
    # no namespaced Roles: the ClusterRole carries everything
    assert not [o for o in objs if o["kind"] in ("Role", "RoleBinding")]
    # optional parts are off by default
    kinds = {o["kind"] for o in objs}
    assert not kinds & {"StatefulSet", "ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap"}


def test_the_operator_pod_runs_non_root_read_only_with_probes(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for objs in rendered.values():
        for pod_owner in [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]:
            spec = pod_owner["spec"]["template"]["spec"]
            assert spec["securityContext"]["runAsNonRoot"] is True
            for c in spec["containers"]:
                assert c["securityContext"]["allowPrivilegeEscalation"] is False
                assert c["securityContext"]["readOnlyRootFilesystem"] is True
                assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
                assert c["livenessProbe"] and c.get("resources")
    dep = _one(rendered["default"], "Deployment", "fulcrum-operator")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "liveness"}
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


def _rules(role: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]]


def test_a_namespaced_install_grants_writes_only_in_the_watched_namespaces(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objs = rendered["namespaced"]
    args = _args(objs)
    assert "--namespace=serving-a" in args and "--namespace=serving-b" in args and "--all-namespaces" not in args
    assert not any(a.startswith("--peering") for a in args)
    assert not any(a.startswith("--prometheus-url") for a in args)
    cluster = _one(objs, "ClusterRole")
    # cluster-wide: read-only discovery, nothing else
    assert {v for _, _, v in _rules(cluster)} <= {"get", "list", "watch"}
    assert {r for _, r, _ in _rules(cluster)} == {"customresourcedefinitions", "namespaces"}
    roles = [o for o in objs if o["kind"] == "Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["serving-a", "serving-b"]
    bindings = [o for o in objs if o["kind"] == "RoleBinding"]
    for b in bindings:
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": "fulcrum-operator", "namespace": helm_render.NAMESPACE}]
    assert not [o for o in objs if o["kind"] in ("CustomResourceDefinition", "KopfPeering", "ClusterKopfPeering")]
    env = {e["name"]: e.get("value") for e in _one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["FULCRUM_NATS_URL"] == "nats://nats.nats.svc:4222"
    assert env["FULCRUM_ETCD_ENDPOINT"] == "http://etcd.etcd.svc:2379"


# what the operator creates or patches, by (API group, resource): the objects of operator/controller/resources.py,
# the LLMServe and its status, pod-deletion-cost on pods, events
_OPERATOR_WRITES = {
    ("apps", "deployments"),
    ("", "services"),
    ("", "configmaps"),
    ("", "serviceaccounts"),
    ("rbac.authorization.k8s.io", "roles"),
    ("rbac.authorization.k8s.io", "rolebindings"),
    ("fulcrum.dev", "llmserves"),
    ("fulcrum.dev", "llmserves/status"),
    ("", "pods"),
    ("", "events"),
}
_KIND_RESOURCE = {
    "Deployment": ("apps", "deployments"),
    "Service": ("", "services"),
    "ConfigMap": ("", "configmaps"),
    "ServiceAccount": ("", "serviceaccounts"),
    "Role": ("rbac.authorization.k8s.io", "roles"),
    "RoleBinding": ("rbac.authorization.k8s.io", "rolebindings"),
}


def test_the_operator_may_patch_everything_it_builds_and_nothing_cluster_wide_beyond(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for name in ("default", "namespaced"):
        objs = rendered[name]
        roles = [o for o in objs if o["kind"] in ("Role", "ClusterRole")]
        granted = {(g, r) for role in roles for g, r, v in _rules(role) if v == "patch"}
        assert _OPERATOR_WRITES <= granted, _OPERATOR_WRITES - granted
        # no wildcards, no secrets
        for role in roles:
            for g, r, v in _rules(role):
                assert "*" not in (g, r, v)
                assert r != "secrets"
    # the kinds the operator's object builder emits are all covered (when that module is present)
    resources = pytest.importorskip("fulcrum.controller.resources")
    from fulcrum.api import load_llmserve

    for example in sorted((REPO / "examples").glob("llmserve-*.yaml")):
        serve = load_llmserve(example)
        built = resources.build_objects(serve, resources.initial_target(serve), uid="u", image="i")
        for obj in built:
            assert _KIND_RESOURCE[obj["kind"]] in _OPERATOR_WRITES, obj["kind"]


def test_the_full_install_bundles_nats_and_etcd_and_wires_them_into_the_operator(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objs = rendered["full"]
    nats = _one(objs, "StatefulSet", "fulcrum-nats")
    (c,) = nats["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "nats:2.10.22-alpine" and "--jetstream" in c["args"]
    assert nats["spec"]["volumeClaimTemplates"][0]["spec"]["storageClassName"] == "standard"
    etcd = _one(objs, "StatefulSet", "fulcrum-etcd")
    (c,) = etcd["spec"]["template"]["spec"]["containers"]
    assert c["image"].startswith("registry.k8s.io/etcd:3.5.")
    assert "--advertise-client-urls=http://fulcrum-etcd.fulcrum-system.svc:2379" in c["command"]
    dep = _one(objs, "Deployment", "fulcrum-operator")
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["FULCRUM_NATS_URL"] == "nats://fulcrum-nats.fulcrum-system.svc:4222"
    assert env["FULCRUM_ETCD_ENDPOINT"] == "http://fulcrum-etcd.fulcrum-system.svc:2379"
    assert env["FULCRUM_EXTRA"] == "1"
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"} and pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert "--log-format=text" in _args(objs) and "--verbose" in _args(objs)
    # the Services select the pods they front
    for svc_name, sts in (("fulcrum-nats", nats), ("fulcrum-etcd", etcd)):
        svc = _one(objs, "Service", svc_name)
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= labels.items()
    svc = _one(objs, "Service", "fulcrum-operator-metrics")
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_monitors_select_the_operator_and_the_pods_the_operator_creates(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objs = rendered["full"]
    sm = _one(objs, "ServiceMonitor")
    svc = _one(objs, "Service", "fulcrum-operator-metrics")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"]
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    pm = _one(objs, "PodMonitor")
    # the contract's labels on every pod the operator creates
    assert pm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/managed-by": "fulcrum-operator"}
    assert pm["spec"]["namespaceSelector"] == {"any": True}
    targets = {r["targetLabel"] for r in pm["spec"]["podMetricsEndpoints"][0]["relabelings"]}
    assert {"llmserve", "pool", "role", "namespace", "pod", "job"} <= targets


def test_the_dashboards_configmap_carries_the_committed_dashboard_for_the_sidecar(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objs = rendered["full"]
    cms = [o for o in objs if o["kind"] == "ConfigMap"]
    committed = sorted(p.name for p in (REPO / "dashboards").glob("*.json"))
    assert sorted(k for cm in cms for k in cm["data"]) == committed
    for cm in cms:
        assert cm["metadata"]["namespace"] == "monitoring"
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "Fulcrum"}
        for key, text in cm["data"].items():
            assert json.loads(text) == json.loads((REPO / "dashboards" / key).read_text())


def test_the_prometheus_rule_takes_its_thresholds_from_values(rendered: dict[str, list[dict[str, Any]]]) -> None:
    rule = _one(rendered["full"], "PrometheusRule")
    by_name = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert by_name["FulcrumSLOAttainmentLow"]["expr"].endswith("< 0.95")
    assert by_name["FulcrumPoolNotReady"]["for"] == "15m"
    assert by_name["FulcrumSLOAttainmentLow"]["for"] == "10m"
    # Prometheus' own templating survives Helm's
    assert "{{ $labels.llmserve }}" in by_name["FulcrumSLOAttainmentLow"]["annotations"]["summary"]


def test_notes_name_the_watched_namespaces_and_connectors(helm: None) -> None:
    notes = helm_render.render(_values("namespaced"))["fulcrum/templates/NOTES.txt"]
    assert "serving-a, serving-b" in notes
    assert "nats://nats.nats.svc:4222" in notes and "http://etcd.etcd.svc:2379" in notes
    notes = helm_render.render(None)["fulcrum/templates/NOTES.txt"]
    assert "all namespaces" in notes and "EndpointSlices" in notes
