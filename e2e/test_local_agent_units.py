"""The process node agent's pure parts, without a cluster: Kubernetes ``$(VAR)`` expansion, fieldRefs and the
loopback address allocator (e2e/local; docs/e2e.md)."""

from __future__ import annotations

import socket

import pytest
from local.node_agent import CannotRun, _field, expand
from local.service_proxy import LoopbackAllocator


@pytest.mark.parametrize(("text", "expected"), [
    ("--bind $(POD_IP)", "--bind 127.0.3.4"),
    ("$(POD_IP):$(PORT)", "127.0.3.4:8000"),
    ("$(UNDEFINED) stays", "$(UNDEFINED) stays"),
    ("$$(POD_IP) is escaped", "$(POD_IP) is escaped"),
    ("$$ alone", "$ alone"),
    ("no $ref here", "no $ref here"),
    ("$POD_IP (shell syntax) is not expanded", "$POD_IP (shell syntax) is not expanded"),
])
def test_expansion_follows_kubernetes_rules(text: str, expected: str) -> None:
    assert expand(text, {"POD_IP": "127.0.3.4", "PORT": "8000"}) == expected


def test_field_refs_read_the_pod() -> None:
    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": "u", "labels": {"app": "web"}},
           "spec": {"nodeName": "n1", "serviceAccountName": "sa"}, "status": {"podIP": "127.0.9.9"}}
    assert [_field(pod, f) for f in ("metadata.name", "metadata.namespace", "spec.nodeName", "status.podIP",
                                     "metadata.labels['app']")] == ["p", "ns", "n1", "127.0.9.9", "web"]
    with pytest.raises(CannotRun, match="not supported"):
        _field(pod, "spec.nope")


def test_the_allocator_skips_an_address_whose_port_is_taken() -> None:
    alloc = LoopbackAllocator("127.0", seed=7)
    first = alloc.allocate([8000])
    alloc.release(first)
    with socket.socket() as busy:
        busy.bind((first, 8000))
        busy.listen()
        again = LoopbackAllocator("127.0", seed=7).allocate([8000])
    assert again != first and again.startswith("127.0.")
    assert alloc.allocate() != "127.0.0.1"
