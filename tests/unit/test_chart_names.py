"""Object names of the chart for long release names (rendered by Helm's engine, tests/helm_render.py).

Helm accepts release names of up to 53 characters. Every name the chart derives from one must still be valid:
Services (and the other objects) at most 63 characters (a DNS-1035 label), StatefulSets at most 52 (their pods'
``controller-revision-hash`` label is the name plus ``-`` and a 10-character hash, at most 63), distinct per
kind, and the connector URLs handed to the operator must name the Services the chart creates.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

import helm_render

CHART = Path(__file__).resolve().parents[2] / "charts" / "fulcrum"
LONGEST_RELEASE = "r" * 53  # helm install refuses longer release names


@pytest.fixture(scope="module")
def helm() -> None:
    reason = helm_render.helm_missing()
    if reason:
        pytest.skip(reason)


def _full(**extra: Any) -> dict[str, Any]:
    values = yaml.safe_load((CHART / "ci" / "full-values.yaml").read_text())
    values.update(extra)
    return values


@pytest.mark.parametrize(
    ("release", "values"),
    [
        (LONGEST_RELEASE, _full()),
        ("fulcrum", _full(fullnameOverride="f" * 63)),
        (LONGEST_RELEASE, _full(operator={"namespaces": ["team-a", "team-b"]})),
    ],
    ids=["longest-release", "longest-fullname-override", "longest-release-namespaced"],
)
def test_every_name_fits_its_kubernetes_limit_for_the_longest_release_names(
        helm: None, release: str, values: dict[str, Any]) -> None:
    objs = helm_render.objects(helm_render.render(values, release=release))
    seen: set[tuple[str, str | None, str]] = set()
    for obj in objs:
        name, kind = obj["metadata"]["name"], obj["kind"]
        limit = 52 if kind == "StatefulSet" else 63
        assert len(name) <= limit, f"{kind} {name}: {len(name)} characters, more than {limit}"
        assert not name.endswith("-"), f"{kind} {name}"
        key = (kind, obj["metadata"].get("namespace"), name)
        assert key not in seen, f"two {kind}s named {name}"
        seen.add(key)
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    dep = next(o for o in objs if o["kind"] == "Deployment")
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    for var, scheme in (("FULCRUM_ETCD_ENDPOINT", "http://"), ("FULCRUM_NATS_URL", "nats://")):
        host = env[var].removeprefix(scheme).split(".", 1)[0]
        assert ("Service", host) in names, f"{var}={env[var]} names no Service of the chart"
    for sts in (o for o in objs if o["kind"] == "StatefulSet"):
        assert ("Service", sts["spec"]["serviceName"]) in names
    rendered = helm_render.render(values, release=release)
    notes = next(text for path, text in rendered.items() if path.endswith("NOTES.txt"))
    assert f"deployment/{dep['metadata']['name']}" in notes
