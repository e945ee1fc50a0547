"""Operator values the chart rendered into manifests that cannot work (rendered by Helm's engine,
tests/helm_render.py); ``helm install`` now refuses them with a message that names the value and the fix.

- ``operator.replicas`` > 1 with ``operator.peering.enabled: false``: every pod runs kopf standalone, so each
  one reconciles, scales and drains every LLMServe at once;
- ``operator.metricsPort`` equal to ``operator.livenessPort``: kopf's /healthz server and the metrics server both
  bind the one port, and the operator cannot start;
- ``operator.podLabels`` setting one of the pod's selector labels (``app.kubernetes.io/name``, ``instance``,
  ``component``): the label was written twice into the pod template (a duplicate YAML key), and the one that won
  no longer matched the Deployment's selector.
"""

from __future__ import annotations

from typing import Any

import pytest

import helm_render


@pytest.fixture(scope="module")
def helm() -> None:
    reason = helm_render.helm_missing()
    if reason:
        pytest.skip(reason)


@pytest.mark.parametrize(
    ("values", "words"),
    [
        ({"operator": {"replicas": 2, "peering": {"enabled": False}}}, ["operator.replicas", "2", "peering"]),
        ({"operator": {"metricsPort": 8080}}, ["operator.metricsPort", "operator.livenessPort", "8080"]),
        ({"operator": {"podLabels": {"app.kubernetes.io/component": "x"}}},
         ["operator.podLabels", "app.kubernetes.io/component"]),
        ({"operator": {"podLabels": {"app.kubernetes.io/instance": "other"}}},
         ["operator.podLabels", "app.kubernetes.io/instance"]),
    ],
    ids=["replicas-without-peering", "one-port-for-two-servers", "podlabels-component", "podlabels-instance"],
)
def test_helm_refuses_operator_values_that_cannot_work_and_names_the_value(
        helm: None, values: dict[str, Any], words: list[str]) -> None:
    import helm_python

    with pytest.raises(helm_python.HelmError) as e:
        helm_render.render(values)
    for word in words:
        assert word in str(e.value)


@pytest.mark.parametrize(
    "values",
    [
        {"operator": {"replicas": 2}},  # peering on (the default): one active operator
        {"operator": {"replicas": 1, "peering": {"enabled": False}}},
        {"operator": {"replicas": 0}},  # the operator stopped
        {"operator": {"podLabels": {"team": "ml"}}},
    ],
)
def test_the_settings_next_to_them_still_render(helm: None, values: dict[str, Any]) -> None:
    objs = helm_render.objects(helm_render.render(values))
    dep = next(o for o in objs if o["kind"] == "Deployment")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in dep["spec"]["selector"]["matchLabels"].items())
