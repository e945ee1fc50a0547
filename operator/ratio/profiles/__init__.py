"""Built-in performance profiles shipped with Fulcrum (data files beside this module).

- ``dopd-llama70b-fp8-h100``: DOPD Table I as published (prefill TP=1, decode TP=2).
- ``splitwise-llama2-70b-h100``: Llama-2-70B on H100 at TP 2/4/8 from Splitwise's measurements
  (``scripts/build_splitwise_profile.py``).
- ``splitwise-llama2-70b-a100``: the same model and measurements on A100-80GB (DGX-A100).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from fulcrum.errors import ProfileError
from fulcrum.ratio.profile import PerformanceProfile, load_profile

__all__ = ["BUILTIN_PROFILES", "builtin_profile", "resolve_profile"]

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
