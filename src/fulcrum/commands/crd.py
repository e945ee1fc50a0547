"""``fulcrum crd [--output FILE]``: print (or write) the LLMServe CRD generated from the pydantic model.

``crds/llmserve.yaml`` is this command's output; regenerate it after changing ``fulcrum.api.llmserve``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fulcrum.api.crd import render_crd_yaml

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``crd`` subcommand on ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "crd",
        help="print the LLMServe CustomResourceDefinition (YAML) generated from the model",
        description="Print the llmserves.fulcrum.dev CustomResourceDefinition generated from the LLMServe "
        "pydantic model, as YAML ready for `kubectl apply -f -`.",
    )
    parser.add_argument(
        "--output",
        "-o",
        metavar="FILE",
        type=Path,
        default=None,
        help="write the YAML to FILE instead of standard output (e.g. crds/llmserve.yaml)",
    )
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Print the CRD YAML, or write it to ``args.output``. Returns 0.

    Raises:
        OSError: ``args.output`` cannot be written (the CLI reports it and exits with 2).
    """
    text = render_crd_yaml()
    output: Path | None = args.output
    if output is None:
        sys.stdout.write(text)
    else:
        output.write_text(text, encoding="utf-8")
        print(f"wrote {output}", file=sys.stderr)
    return 0
