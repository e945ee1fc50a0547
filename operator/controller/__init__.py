"""The Kubernetes operator: kopf handlers that reconcile an ``LLMServe`` into worker pools, a router and status.

``fulcrum.controller.resources`` builds every object from the spec and the plan (pure: no API calls);
the handlers observe (Prometheus), forecast, plan (the same code path as ``fulcrum replay``) and apply.
"""
