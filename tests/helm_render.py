"""Render the Helm chart with Helm's own engine, for tests (no ``helm`` binary, no cluster).

The renderer is Helm itself: ``helm-python-sdk`` (PyPI, import ``helm_python``) binds through ``ctypes`` to
``libhelm_c``, a C ABI over Helm v4's Go SDK, so Go's ``text/template``, every Sprig function, ``.Files``,
``values.schema.json`` validation and ``helm lint`` behave exactly as in ``helm template``/``helm install``.
A hand-written subset renderer could only approximate that. When the package is missing, ``helm_missing()``
says how to install it and the chart tests skip with that reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

__all__ = ["CHART", "RELEASE", "NAMESPACE", "HELM_PACKAGE", "helm_missing", "render", "objects", "lint", "merged_values"]

CHART = Path(__file__).resolve().parents[1] / "charts" / "fulcrum"
RELEASE = "fulcrum"
NAMESPACE = "fulcrum-system"
#: The pinned binding (Helm SDK v4.2.3 inside).
HELM_PACKAGE = "helm-python-sdk==0.2.2"


def helm_missing() -> str | None:
    """``None`` when Helm's engine is importable, else the reason and the install command."""
    try:
        import helm_python  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        return f"Helm's template engine is not installed ({e}): pip install '{HELM_PACKAGE}'"
    return None


def render(values: dict[str, Any] | None = None, *, release: str = RELEASE, namespace: str = NAMESPACE,
           upgrade: bool = False) -> dict[str, str]:
    """``helm template``: ``{template path: rendered text}`` for the chart with ``values`` over its defaults.

    Raises:
        helm_python.HelmValuesError: the values fail ``values.schema.json``.
        helm_python.HelmRenderError: a template fails to render.
    """
    import helm_python

    chart = helm_python.Chart.load(str(CHART))
    try:
        chart.validate_schema(chart.merge_values(values))
        return chart.render(values, name=release, namespace=namespace, is_install=not upgrade, is_upgrade=upgrade)
    finally:
        chart.close()


def merged_values(values: dict[str, Any] | None = None) -> dict[str, Any]:
    """The chart's defaults coalesced with ``values``, as an install would use them."""
    import helm_python

    chart = helm_python.Chart.load(str(CHART))
    try:
        return chart.merge_values(values)
    finally:
        chart.close()


def objects(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """Every Kubernetes object in the rendered templates (NOTES.txt and empty documents left out)."""
    out: list[dict[str, Any]] = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                out.append(doc)
    return out


def lint(values: dict[str, Any] | None = None) -> dict[str, Any]:
    """``helm lint --strict`` report: ``{"messages": [{"severity", "path", "error"}], "errors": [...]}``."""
    import helm_python

    return helm_python.lint(str(CHART), values, strict=True, kube_version="v1.30.0")
