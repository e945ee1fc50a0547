#!/usr/bin/env python3
"""Generate ``docs/reference/llmserve.md``, the LLMServe field reference, from the code that defines the resource.

Every row comes from the code, never from hand-written text, so the page cannot drift from the resource:

- the spec fields (path, type, default, constraints, description) from the structural schema that
  :func:`fulcrum.api.crd.spec_schema` derives from the pydantic model ``fulcrum.api.llmserve.LLMServe`` — the
  same schema ``kubectl apply`` validates against;
- ``metadata.name`` from ``fulcrum.api.llmserve.ObjectMeta``;
- the enumerations' meanings from the docstrings of ``Mode``, ``EngineKind``, ``ReplicaOwner``, ``RouterPolicy``,
  ``PlannerName`` and ``ForecasterMethod``;
- the cross-field CEL rules (``x-kubernetes-validations``) from :func:`fulcrum.api.crd.build_crd`;
- the printer columns and the scale subresource from ``fulcrum.api.crd.PRINTER_COLUMNS`` and
  ``SCALE_SUBRESOURCE``;
- the status layout from the module docstring of ``fulcrum.controller.status`` (what the operator writes) and its
  ``CONDITION_TYPES``.

Usage::

    python scripts/gen_llmserve_reference.py            # rewrite docs/reference/llmserve.md
    python scripts/gen_llmserve_reference.py --check    # exit 1 when the committed page is stale
    python scripts/gen_llmserve_reference.py --output -  # print it

``tests/unit/test_docs_reference.py`` runs :func:`render` and compares it with the committed page.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["REFERENCE_PATH", "render", "field_rows", "cel_rules", "status_block", "main"]

REPO = Path(__file__).resolve().parent.parent
REFERENCE_PATH = REPO / "docs" / "reference" / "llmserve.md"


def _md(text: str) -> str:
    """Docstring text (reStructuredText literals) as Markdown: ````x```` → ```x```."""
    return str(text).replace("``", "`")


def _cell(text: str) -> str:
    """One Markdown table cell: no newlines, pipes escaped."""
    return " ".join(_md(text).split()).replace("|", "\\|")


def _code(value: Any) -> str:
    """A value as inline code (JSON for non-strings)."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return f"`{text}`" if text != "" else '`""`'


def _num(x: float) -> str:
    """``2097152`` rather than ``2.09715e+06``; ``0.5`` stays ``0.5``."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _type_of(node: Mapping[str, Any]) -> str:
    """A YAML writer's name for the node's type."""
    if node.get("x-kubernetes-int-or-string"):
        return "int-or-string (quantity)"
    kind = node.get("type", "")
    if kind == "array":
        return f"array of {_type_of(node.get('items', {}))}"
    if kind == "object":
        if node.get("x-kubernetes-preserve-unknown-fields"):
            return "object (free-form)"
        if isinstance(node.get("additionalProperties"), Mapping):
            return f"map of string → {_type_of(node['additionalProperties'])}"
        return "object"
    return str(kind)


def _constraints(node: Mapping[str, Any], required: bool) -> str:
    """Bounds, lengths, patterns, enums and nullability, in words."""
    parts: list[str] = []
    if required:
        parts.append("required")
    if "enum" in node:
        parts.append("one of " + ", ".join(_code(v) for v in node["enum"]))
    if "minimum" in node:
        parts.append(("> " if node.get("exclusiveMinimum") is True else "≥ ") + _num(node["minimum"]))
    if "maximum" in node:
        parts.append(("< " if node.get("exclusiveMaximum") is True else "≤ ") + _num(node["maximum"]))
    lo, hi = node.get("minLength"), node.get("maxLength")
    if hi is not None:
        parts.append(f"length {lo or 0}–{hi}")
    elif lo is not None:
        parts.append(f"length ≥ {lo}")
    if "pattern" in node:
        parts.append(f"pattern `{node['pattern']}`")
    lo, hi = node.get("minItems"), node.get("maxItems")
    if lo is not None and lo == hi:
        parts.append(f"exactly {lo} items")
    elif hi is not None:
        parts.append(f"{lo or 0}–{hi} items")
    elif lo is not None:
        parts.append(f"≥ {lo} items")
    lo, hi = node.get("minProperties"), node.get("maxProperties")
    if hi is not None:
        parts.append(f"{lo or 0}–{hi} entries")
    elif lo is not None:
        parts.append(f"≥ {lo} entries")
    values = node.get("additionalProperties")
    if isinstance(values, Mapping) and (each := _constraints(values, False)):
        parts.append(f"each value: {each}")
    if node.get("nullable"):
        parts.append("may be null (= unset)")
    return "; ".join(parts)


def _default(node: Mapping[str, Any]) -> str:
    if "default" not in node:
        return "—"
    value = node["default"]
    if node.get("type") == "object" and isinstance(value, Mapping) and len(json.dumps(value)) > 60:
        return "its fields' defaults"
    return _code(value)


def field_rows(node: Mapping[str, Any], path: str, required: bool = False) -> Iterator[tuple[str, ...]]:
    """(path, type, default, constraints, description) for ``node`` and every field below it, depth first."""
    yield (f"`{path}`", _type_of(node), _default(node), _constraints(node, required), node.get("description", ""))
    props: Mapping[str, Any] = node.get("properties") or {}
    req = set(node.get("required") or ())
    for name, child in props.items():
        yield from field_rows(child, f"{path}.{name}", name in req)
    items = node.get("items")
    if isinstance(items, Mapping) and items.get("properties"):
        for name, child in items["properties"].items():
            yield from field_rows(child, f"{path}[].{name}", name in set(items.get("required") or ()))


def cel_rules(node: Mapping[str, Any], path: str) -> Iterator[tuple[str, str, str, str]]:
    """(node path, rule, message, field path) for every ``x-kubernetes-validations`` entry under ``node``."""
    for rule in node.get("x-kubernetes-validations") or ():
        yield (path, rule["rule"], rule.get("message", ""), rule.get("fieldPath", ""))
    for name, child in (node.get("properties") or {}).items():
        yield from cel_rules(child, f"{path}.{name}")
    items = node.get("items")
    if isinstance(items, Mapping):
        yield from cel_rules(items, f"{path}[]")


def status_block() -> tuple[str, tuple[str, ...]]:
    """The status layout the operator writes: the ``status:`` block of ``fulcrum.controller.status``'s docstring
    and the condition types. Raises ``ValueError`` when the docstring no longer holds a ``status:`` block."""
    from fulcrum.controller import status as st

    doc = inspect.getdoc(st) or ""
    lines = doc.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "status:")
    except StopIteration as err:
        raise ValueError("fulcrum.controller.status's docstring has no `status:` block") from err
    block: list[str] = []
    for line in lines[start:]:
        if line and not line.startswith(" "):
            break
        block.append(line)
    while block and not block[-1].strip():
        block.pop()
    indent = min(len(line) - len(line.lstrip()) for line in block if line.strip())
    return "\n".join(line[indent:] for line in block), tuple(st.CONDITION_TYPES)


def _table(header: tuple[str, ...], rows: Iterator[tuple[str, ...]] | list[tuple[str, ...]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return out


def render() -> str:
    """The whole Markdown page (deterministic: the same code gives the same text)."""
    from fulcrum.api import crd
    from fulcrum.api import llmserve as m

    spec = crd.spec_schema()
    built = crd.build_crd()
    version = built["spec"]["versions"][0]
    root = version["schema"]["openAPIV3Schema"]
    names = built["spec"]["names"]
    meta_schema = m.ObjectMeta.model_json_schema(by_alias=True)["properties"]
    out: list[str] = [
        "# LLMServe reference",
        "",
        "<!-- Generated by scripts/gen_llmserve_reference.py from src/fulcrum/api/llmserve.py, src/fulcrum/api/crd.py",
        "     and operator/controller/status.py. Do not edit: run `python scripts/gen_llmserve_reference.py`.",
        "     tests/unit/test_docs_reference.py fails when this page differs from the generator's output. -->",
        "",
        f"`apiVersion: {m.API_VERSION}`, `kind: {m.KIND}` — namespaced; plural `{names['plural']}`, singular "
        f"`{names['singular']}`, short name{'s' if len(names['shortNames']) > 1 else ''} "
        + ", ".join(f"`{s}`" for s in names["shortNames"]) + ". "
        "The CRD (`crds/llmserve.yaml`, `fulcrum crd`) is generated from the same pydantic model as this page; "
        "`fulcrum replay --llmserve FILE` reads the same resource. Field names are camelCase, as the API server "
        "takes them (a snake_case key in a document is refused, naming the camelCase one; Python code builds the "
        "model by its snake_case field names). Unknown fields are rejected by the model (`SpecError` naming the "
        "field) and pruned by the API server.",
        "",
        _cell(root.get("description", "")),
        "",
        "Units: lengths and capacities in tokens, latencies in milliseconds (`…Ms`) or seconds (`…Seconds`), "
        "memory in GiB, bandwidth in GB/s.",
        "",
        "A `null` (e.g. `mode:` left empty in YAML) for a field whose constraints do not say \"may be null\" is "
        "pruned by the API server: the field is then unset and takes its default (`fulcrum replay` and `fulcrum plan` "
        "read it the same way). `spec.scaling.replicas` is such a field, so that the scale subresource always reads "
        "an integer or nothing there: `replicas: null` means unset.",
        "",
        "## Contents",
        "",
        "- [metadata](#metadata)",
    ]
    sections = list(spec["properties"].items())
    out += [f"- [spec.{name}](#spec{name.lower()})" for name, _ in sections]
    out += [
        "- [Enumerations](#enumerations)",
        "- [Cross-field rules (CEL)](#cross-field-rules-cel)",
        "- [Status](#status)",
        "- [kubectl get columns](#kubectl-get-columns)",
        "- [Scale subresource](#scale-subresource)",
        "",
        "## metadata",
        "",
    ]
    header = ("field", "type", "default", "constraints", "description")
    out += _table(header, [
        (f"`metadata.{name}`", _type_of(node), _code(node["default"]) if "default" in node else "—",
         _constraints(node, False), node.get("description", ""))
        for name, node in meta_schema.items()
    ])
    out.append("")
    req = set(spec.get("required") or ())
    for name, node in sections:
        out += [f"## spec.{name}", ""]
        out += _table(header, field_rows(node, f"spec.{name}", name in req))
        out.append("")
    out += ["## Enumerations", ""]
    for enum in (m.Mode, m.EngineKind, m.ReplicaOwner, m.RouterPolicy, m.PlannerName, m.ForecasterMethod):
        values = ", ".join(f"`{e.value}`" for e in enum)
        out += [f"### {enum.__name__} ({values})", "", _md(inspect.getdoc(enum) or ""), ""]
    out += [
        "## Cross-field rules (CEL)",
        "",
        "Checked by the API server on `kubectl apply` (`x-kubernetes-validations`) and by the pydantic model's "
        "validators (the same rules, so `fulcrum replay` rejects what the cluster would). Single-field bounds are in "
        "the tables above.",
        "",
    ]
    out += _table(("on", "rule", "message", "field"),
                  [(f"`{p}`", f"`{r}`", msg, f"`{fp}`" if fp else "—")
                   for p, r, msg, fp in cel_rules(root["properties"]["spec"], "spec")])
    block, conditions = status_block()
    out += [
        "",
        "## Status",
        "",
        "Written by the operator through the status subresource (the CRD keeps `status` open: "
        "`x-kubernetes-preserve-unknown-fields`). The layout, as `operator/controller/status.py` documents it:",
        "",
        "```yaml",
        block,
        "```",
        "",
        "Condition types, in the order written: " + ", ".join(f"`{c}`" for c in conditions) + ".",
        "",
        "## kubectl get columns",
        "",
        f"`kubectl get {names['shortNames'][0]}` (or `{names['plural']}`) prints these columns; priority 1 columns "
        "only with `-o wide`:",
        "",
    ]
    out += _table(("column", "type", "JSONPath", "priority", "description"),
                  [(c["name"], c["type"], f"`{c['jsonPath']}`", str(c.get("priority", 0)), c.get("description", ""))
                   for c in crd.PRINTER_COLUMNS])
    out += [
        "",
        "## Scale subresource",
        "",
        "`kubectl scale llmserve/<name> --replicas N`, an HPA or KEDA write the total instance count; the operator "
        "obeys it only with `spec.scaling.replicaOwner: External` (see `spec.scaling.replicaOwner` above).",
        "",
    ]
    out += _table(("key", "path"), [(k, f"`{v}`") for k, v in crd.SCALE_SUBRESOURCE.items()])
    out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Write (default), print (``--output -``) or check (``--check``) the reference; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=str(REFERENCE_PATH), help="file to write, or - for standard output")
    parser.add_argument("--check", action="store_true", help="exit 1 when the file differs from the generated page")
    args = parser.parse_args(argv)
    text = render()
    if args.output == "-":
        sys.stdout.write(text)
        return 0
    path = Path(args.output)
    if args.check:
        current = path.read_text(encoding="utf-8") if path.exists() else ""
        if current != text:
            print(f"{path} is stale: run python scripts/gen_llmserve_reference.py", file=sys.stderr)
            return 1
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
