"""The operator's kopf login in a pod: the API server's address comes from KUBERNETES_SERVICE_HOST/PORT (as the
kubernetes client's in-cluster config reads it), not from kopf's fixed ``https://kubernetes.default.svc``."""

from __future__ import annotations

import pytest

kopf = pytest.importorskip("kopf")

from kopf._cogs.structs.credentials import ConnectionInfo  # noqa: E402 (after the skip)

from fulcrum.controller.handlers import in_cluster_server  # noqa: E402


def kopf_info() -> ConnectionInfo:
    return ConnectionInfo(server="https://kubernetes.default.svc", ca_path="/ca.crt", token="t",
                          default_namespace="fulcrum-system", priority=10)


def test_the_service_host_and_port_replace_kopfs_dns_name_and_everything_else_is_kept() -> None:
    info = in_cluster_server(kopf_info(), {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "6443"})
    assert info.server == "https://10.96.0.1:6443"
    assert (info.ca_path, info.token, info.default_namespace, info.priority) == ("/ca.crt", "t", "fulcrum-system", 10)


def test_an_ipv6_service_host_is_bracketed() -> None:
    info = in_cluster_server(kopf_info(), {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"})
    assert info.server == "https://[fd00::1]:443"


@pytest.mark.parametrize("env", [{}, {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}, {"KUBERNETES_SERVICE_PORT": "443"}])
def test_without_both_variables_kopfs_address_stays(env: dict[str, str]) -> None:
    assert in_cluster_server(kopf_info(), env).server == "https://kubernetes.default.svc"


def test_outside_a_pod_there_is_nothing_to_change() -> None:
    assert in_cluster_server(None, {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}) is None
