"""``fulcrum replay``: the planner loop against a simulated cluster on a real trace (driver), and how the
results are shown (table, report). Adapters only: the planning itself lives in ``fulcrum.scaling`` and
``fulcrum.ratio``, the cluster model in ``fulcrum.simulator``.
"""
