"""The ``fulcrum`` command line.

Subcommands: ``replay`` (the planner against a simulated cluster on a real trace), ``plan`` (one P/D plan from
a profile), ``forecast`` (backtest every forecaster on a trace), ``crd`` (print the CRD generated from the
``LLMServe`` model), ``router`` (the OpenAI-compatible router), ``operator`` (the kopf operator), ``worker`` (a
worker pod's vLLM supervisor), ``sim-worker`` (the profile-timed engine emulator) and ``profile`` (measure an
endpoint into a performance profile). Each lives in ``fulcrum.commands.<name>``; a command's heavy imports
happen when it runs, so ``fulcrum --help`` works with the base install. Environment variables are read in the
command modules, never inside defaults.

Exit codes: 0 success, 1 a run that failed its own check, 2 bad input or a missing extra (a clear one-line error
on stderr; for a missing extra it names the ``pip install 'fulcrum[EXTRA]'`` to run).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from fulcrum import __version__
from fulcrum.errors import FulcrumError

__all__ = ["main", "build_parser", "missing_extra_message", "EXTRA_OF_COMMAND", "EXTRA_OF_MODULE"]

# subcommands, in the order ``fulcrum --help`` lists them; each module has ``add_parser(sub)``
_COMMANDS = ("replay", "plan", "forecast", "crd", "router", "operator", "worker", "sim_worker", "profile")

# the pip extra (pyproject.toml) that brings each command's libraries; commands not named need the base install
EXTRA_OF_COMMAND = {"router": "router", "operator": "operator", "worker": "worker", "sim-worker": "worker",
                    "profile": "worker"}
# the libraries the extras bring (top-level import names), and the extra that brings each
EXTRA_OF_MODULE = {"aiohttp": "router", "prometheus_client": "router", "aetcd": "router", "nats": "router",
                   "kubernetes": "router", "kopf": "operator", "prometheus_api_client": "operator"}


def missing_extra_message(command: str, err: ModuleNotFoundError) -> str | None:
    """The one-line hint for a command that stopped on a library of an extra that is not installed, e.g.
    ``needs the 'operator' extra (no module 'kopf'): pip install 'fulcrum[operator]'``; None when the missing
    module is none of the extras' (a broken install, not a missing extra)."""
    module = (err.name or "").split(".")[0]
    extra = EXTRA_OF_MODULE.get(module)
    if extra is None:
        return None
    # the command's own extra includes the module's (operator and worker include router)
    extra = EXTRA_OF_COMMAND.get(command, extra)
    return f"`fulcrum {command}` needs the '{extra}' extra (no module '{module}'): pip install 'fulcrum[{extra}]'"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand registered."""
    import importlib

    parser = argparse.ArgumentParser(
        prog="fulcrum",
        description="Elastic prefill/decode serving of LLMs: forecast, plan, split, reconcile.",
    )
    parser.add_argument("--version", action="version", version=f"fulcrum {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in _COMMANDS:
        importlib.import_module(f"fulcrum.commands.{name}").add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code.

    BLAS is limited to one thread: the forecaster's matrices are tiny, and several BLAS threads on a busy
    machine fight each other (a 20 ms ARIMA fit took seconds on 2 shared cores).
    """
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:
        # the reader went away (``fulcrum ... | head``): stop quietly, as Unix tools do
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - replaced for the interpreter's final flush
        except OSError:
            pass
        return 0
    except ModuleNotFoundError as err:
        hint = missing_extra_message(args.command, err)
        if hint is None:
            raise
        print(f"fulcrum {args.command}: error: {hint}", file=sys.stderr)
        return 2
    except (FulcrumError, ValueError, OSError) as err:
        print(f"fulcrum {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
