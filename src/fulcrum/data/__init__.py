"""Request traces bundled with Fulcrum, so that ``fulcrum replay`` runs offline out of the box.

Only data files and the lookup of their paths belong here; parsing lives in :mod:`fulcrum.traces`.
Each file's origin, licence and citation are in ``README.md`` beside this module:

- ``azure-conv-2023``: Azure LLM inference trace 2023, conversation service (CC-BY-4.0; Patel et al.,
  Splitwise, ISCA 2024), 19,366 requests over 58.4 min;
- ``azure-code-2023``: the same, code-completion service, 8,819 requests over 57.3 min;
- ``mooncake-conv``: Mooncake conversation trace (Apache-2.0; Qin et al., Mooncake, FAST 2025),
  12,031 long-context requests over 59 min with prefix KV block ids.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from fulcrum.errors import TraceError

__all__ = ["BUNDLED_TRACES", "bundled_trace_path"]

BUNDLED_TRACES: dict[str, str] = {
    "azure-conv-2023": "azure_conv_2023.csv.gz",
    "azure-code-2023": "azure_code_2023.csv.gz",
    "mooncake-conv": "mooncake_conversation.jsonl.gz",
}
"""Bundled trace name → file name inside this package (gzip -9 of the verbatim source file)."""


def bundled_trace_path(name: str) -> Path:
    """Return the filesystem path of the bundled trace ``name`` (a key of :data:`BUNDLED_TRACES`).

    Raises:
        TraceError: ``name`` is not a bundled trace (the message lists the names), or the package was
            installed without its data file.
    """
    try:
        file_name = BUNDLED_TRACES[name]
    except KeyError:
        names = ", ".join(sorted(BUNDLED_TRACES))
        raise TraceError(f"unknown bundled trace {name!r}; bundled traces: {names}") from None
    resource = resources.files(__name__).joinpath(file_name)
    # The package is installed as plain files (setuptools package-data), so the traversable is a path.
    path = Path(str(resource))
    if not path.is_file():
        raise TraceError(f"bundled trace {name!r} is missing its data file {path} (broken installation?)")
    return path
