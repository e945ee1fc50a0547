"""The planner loop (observe → forecast → plan) and its scaling policy, plus the reference planners that
``fulcrum replay --compare`` measures it against; the control loop that drives a planner on a
:class:`~fulcrum.cluster.Cluster` (``loop``: the operator and ``fulcrum replay`` both run it), the planner registry
(``registry``: ``spec.scaling.planner`` → planner) and the in-memory cluster (``in_memory``: tests, dry runs).

Pure: a planner receives an :class:`~fulcrum.observation.Observation` per tick and returns a
:class:`~fulcrum.scaling.planner.Decision`. The operator and ``fulcrum replay`` call the very same planners;
nothing here performs I/O or imports Kubernetes, HTTP, NATS, etcd or vLLM (enforced by ``.importlinter``).
"""
