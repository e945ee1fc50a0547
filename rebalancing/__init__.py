"""Rebalancing in flight: pure planners that move work while it runs, between the planner's intervals.

- ``decode_rescheduling``: ARES §5.2 Algorithm 1 — migrate one running decode request from an overloaded to an
  underloaded decode instance, chosen to minimise the time-weighted token-load variance.
- ``role_reassignment``: BanaServe §4.3 Algorithm 1 with a role flip — move a ``kv_both`` instance between
  prefill and decode duty from measured utilisation, with hysteresis.
- ``duties``: the book of which ``both`` instance holds which duty, their measured utilisations and the flips —
  what the live router and ``fulcrum replay``'s simulated router both keep.

Pure: inputs in, decisions out, no I/O. The router executes the decisions (through its handoff protocol) and
``fulcrum replay`` / the benchmarks drive them against the simulator (``fulcrum.replay.rescheduling``,
``fulcrum.replay.roles``).
"""
