"""Built-in performance profiles shipped with Fulcrum (data files beside this module).

- ``dopd-llama70b-fp8-h100``: DOPD Table I as published (prefill TP=1, decode TP=2).
- ``splitwise-llama2-70b-h100``: Llama-2-70B on H100 at TP 2/4/8 from Splitwise's measurements
  (``scripts/build_splitwise_profile.py``).
- ``splitwise-llama2-70b-a100``: the same model and measurements on A100-80GB (DGX-A100).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from fulcrum.errors import ProfileError
from fulcrum.ratio.profile import PerformanceProfile, load_profile

if TYPE_CHECKING:
    from fulcrum.api.llmserve import LLMServeSpec

__all__ = ["BUILTIN_PROFILES", "builtin_profile", "resolve_profile", "resolve_spec_profile"]

BUILTIN_PROFILES: tuple[str, ...] = ("dopd-llama70b-fp8-h100", "splitwise-llama2-70b-h100", "splitwise-llama2-70b-a100")


def builtin_profile(name: str) -> PerformanceProfile:
    """Load a shipped profile by name.

    Raises:
        ProfileError: no built-in profile has that name.
    """
    if name not in BUILTIN_PROFILES:
        raise ProfileError(f"unknown built-in profile {name!r}; choose one of {', '.join(BUILTIN_PROFILES)}")
    with resources.as_file(resources.files(__name__) / f"{name}.yaml") as path:
        return load_profile(path)


def resolve_profile(name_or_path: str) -> PerformanceProfile:
    """A built-in profile name, or a path to a YAML/JSON/CSV profile file."""
    if name_or_path in BUILTIN_PROFILES:
        return builtin_profile(name_or_path)
    if not Path(name_or_path).exists():
        raise ProfileError(
            f"no profile file {name_or_path!r} and no built-in profile of that name "
            f"(built-ins: {', '.join(BUILTIN_PROFILES)})"
        )
    return load_profile(name_or_path)


def resolve_spec_profile(spec: LLMServeSpec, spec_path: Path | None, override: str | None) -> PerformanceProfile:
    """The profile an ``LLMServe`` read from a file is planned with outside a cluster (``fulcrum replay``,
    ``fulcrum plan --llmserve``, the benchmarks): ``override`` (a ``--profile`` flag: a file or a built-in name) if
    given, else the spec's reference.

    A ``path`` reference is resolved relative to the LLMServe file's folder first, then the working directory.

    Raises:
        ProfileError: the spec names a ConfigMap (in-cluster only) or the file/name is unknown.
    """
    if override:
        return resolve_profile(override)
    ref = spec.profile
    if ref.name:
        return builtin_profile(ref.name)
    if ref.path:
        cand = Path(ref.path)
        if not cand.is_absolute() and spec_path is not None and (spec_path.parent / cand).is_file():
            cand = spec_path.parent / cand
        return resolve_profile(str(cand))
    raise ProfileError(
        f"the LLMServe's profile is the ConfigMap {ref.config_map!r}, which only exists in a cluster: "
        "pass --profile FILE or a built-in name"
    )
