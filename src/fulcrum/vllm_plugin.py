"""A vLLM general plugin: NIXL without its UCX progress thread when vLLM runs on the CPU.

vLLM calls ``register()`` in every engine process through the ``vllm.general_plugins`` entry point
(``fulcrum = "fulcrum.vllm_plugin:register"`` in pyproject.toml), before the KV connector is built.
On the CPU platform it makes every ``nixl_agent_config`` that vLLM creates default to
``enable_prog_thread=False``: NIXL's UCX backend otherwise runs a progress thread that busy-polls a
whole core per engine even when idle, which on a small CPU host starves the engines themselves
(docs/vllm-cpu.md has the measurement). Transfers still complete: vLLM's NIXL connector polls
``check_xfer_state`` from its own loop, which progresses UCX.

Adapter code, not planning code: it imports vLLM, lazily, inside the function, so importing this
module needs neither vLLM nor NIXL. ``FULCRUM_NIXL_PROG_THREAD=1`` in the engine's environment keeps
NIXL's default (read once, in ``register``, as the plugin is the engine's entry point here).
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable

__all__ = ["register", "without_progress_thread"]

# modules that bind ``nixl_agent_config`` at import time with ``from vllm.distributed.nixl_utils import ...``
_BINDERS = (
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker",
    "vllm.distributed.ec_transfer.ec_connector.cpu.data.nixl",
    "vllm.v1.kv_offload.tiering.obj.manager",
    "vllm.v1.kv_offload.tiering.p2p.data.nixl",
)


def without_progress_thread(config_cls: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap NIXL's ``nixl_agent_config`` so that ``enable_prog_thread`` defaults to ``False``.

    A caller that passes ``enable_prog_thread`` explicitly keeps its value. Wrapping twice is a no-op.
    """
    if getattr(config_cls, "_fulcrum_no_prog_thread", False):
        return config_cls

    @functools.wraps(config_cls)
    def make(*args: Any, **kwargs: Any) -> Any:
        if not args:  # enable_prog_thread is the first positional parameter
            kwargs.setdefault("enable_prog_thread", False)
        return config_cls(*args, **kwargs)

    make._fulcrum_no_prog_thread = True  # type: ignore[attr-defined]
    return make


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group; idempotent (vLLM may call it several times).

    On the CPU platform, patches ``vllm.distributed.nixl_utils`` so that the ``nixl_agent_config`` it
    hands out (lazily, at first use) is wrapped by ``without_progress_thread``; modules that already
    bound the name are patched too. Does nothing on other platforms, when vLLM's NIXL helper module is
    missing (older vLLM), or when ``FULCRUM_NIXL_PROG_THREAD=1``.
    """
    if os.environ.get("FULCRUM_NIXL_PROG_THREAD") == "1":
        return
    from vllm.logger import init_logger
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    try:
        from vllm.distributed import nixl_utils
    except ImportError:  # a vLLM without the helper module: nothing to patch
        return
    if getattr(nixl_utils, "_fulcrum_patched", False):
        return

    original_load: Callable[[str], Any] = nixl_utils._load_nixl_attr

    def load(name: str) -> Any:
        value = original_load(name)
        if name == "nixl_agent_config" and value is not None:
            value = without_progress_thread(value)
            setattr(nixl_utils, name, value)
        return value

    nixl_utils._load_nixl_attr = load
    if nixl_utils.__dict__.get("nixl_agent_config") is not None:  # already resolved before the plugin ran
        nixl_utils.nixl_agent_config = without_progress_thread(nixl_utils.__dict__["nixl_agent_config"])
    for module_name in _BINDERS:
        module = sys.modules.get(module_name)
        if module is not None and getattr(module, "nixl_agent_config", None) is not None:
            module.nixl_agent_config = without_progress_thread(module.nixl_agent_config)
    nixl_utils._fulcrum_patched = True
    # a child of vLLM's logger, so the line shows in the engine's log with vLLM's format
    init_logger("vllm.fulcrum_plugin").info("fulcrum: NIXL agents on CPU start without the UCX progress thread (enable_prog_thread=False)")
