"""Subcommands of the ``fulcrum`` CLI, one module each: ``add_parser(subparsers)`` registers it and sets
``func`` to its ``run(args) -> int``. Commands are adapters: they read files and print; the work is done by
the planning packages.

Listening address: a server command listens on its ``--host``; when that is a wildcard (``0.0.0.0``, ``::`` or
empty) and ``$FULCRUM_BIND_HOST`` names an address, on that address instead (:func:`bind_host`). A pod gets its
own network namespace, so the wildcard is right there; the e2e tests' process node agent runs pods as host
processes on loopback addresses of their own and sets ``FULCRUM_BIND_HOST`` to the pod's, so that two pods'
equal ports do not clash (docs/e2e.md).
"""

from __future__ import annotations

import os

from fulcrum.outputs import check_writable_file

__all__ = ["BIND_HOST_ENV", "bind_host", "check_writable_file"]

BIND_HOST_ENV = "FULCRUM_BIND_HOST"
"""Environment variable naming the address a wildcard ``--host`` stands for."""

_WILDCARDS = frozenset({"", "0.0.0.0", "::"})


def bind_host(host: str) -> str:
    """The address to listen on: ``host``, unless it is a wildcard and ``$FULCRUM_BIND_HOST`` is set (then that).

    An explicit address (``--host 127.0.0.1``) always wins; the variable only narrows a wildcard.
    """
    override = os.environ.get(BIND_HOST_ENV, "").strip()
    return override if host.strip() in _WILDCARDS and override else host
