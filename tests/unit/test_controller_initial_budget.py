"""``initial_target`` under an external replica owner keeps the split within ``spec.scaling.maxGPUs``
(the budget the user set; docs/operator.md, "Who owns the replica count")."""

from __future__ import annotations

import logging

import pytest

from fulcrum.api.llmserve import parse_llmserve
from fulcrum.controller.resources import initial_target


def _serve(**scaling: object):
    return parse_llmserve({"metadata": {"name": "x", "namespace": "ns"},
                           "spec": {"model": {"name": "m"}, "engine": {"kind": "vllm"},
                                    "profile": {"name": "dopd-llama70b-fp8-h100"},
                                    "scaling": {"tpPrefill": 1, "tpDecode": 2, **scaling}}})


def test_an_external_total_over_max_gpus_is_cut_to_it_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    t = initial_target(_serve(replicaOwner="External", replicas=8, maxGPUs=8))
    assert t.gpus <= 8, t
    assert t.prefill.replicas >= 1 and t.decode.replicas >= 1 and (t.prefill.tp, t.decode.tp) == (1, 2)
    assert "maxGPUs=8" in caplog.text and "ns/x" in caplog.text


def test_an_external_total_within_max_gpus_is_split_as_before() -> None:
    t = initial_target(_serve(replicaOwner="External", replicas=8, maxGPUs=16))
    assert t.prefill.replicas + t.decode.replicas == 8 and t.gpus <= 16
