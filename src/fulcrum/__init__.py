"""Fulcrum: elastic prefill/decode (P/D) serving of LLMs on Kubernetes.

The package is layered (see ``.importlinter``):

- planning, pure (no I/O): ``fulcrum.forecast`` (ARIMA and baselines), ``fulcrum.ratio`` (performance
  profiles, P/D ratio, TP and instance counts), ``fulcrum.scaling`` (the planner loop and the reference
  planners), ``fulcrum.simulator`` (a discrete-event cluster timed by a profile);
- shared vocabulary: ``fulcrum.api`` (the ``LLMServe`` resource), ``fulcrum.observation``,
  ``fulcrum.target``, ``fulcrum.errors``;
- adapters and entry points at the edges: ``fulcrum.traces`` (trace files), ``fulcrum.replay`` (the
  planner loop against the simulator, reports), ``fulcrum.cli``.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
