"""The planner loop (observe → forecast → plan) and its scaling policy, plus the reference planners that
``fulcrum replay --compare`` measures it against.

Pure: a planner receives an :class:`~fulcrum.observation.Observation` per tick and returns a
:class:`~fulcrum.scaling.planner.Decision`. The operator and ``fulcrum replay`` call the very same planners;
nothing here performs I/O or imports Kubernetes, HTTP, NATS, etcd or vLLM (enforced by ``.importlinter``).
"""
