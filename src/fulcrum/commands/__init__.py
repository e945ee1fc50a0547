"""Subcommands of the ``fulcrum`` CLI, one module each: ``add_parser(subparsers)`` registers it and sets
``func`` to its ``run(args) -> int``. Commands are adapters: they read files and print; the work is done by
the planning packages.
"""
