"""The Kubernetes operator: kopf handlers that reconcile an ``LLMServe`` into worker pools, a router and status.

``fulcrum.controller.resources`` builds every object from the spec and the plan (pure: no API calls);
the handlers run :class:`fulcrum.scaling.loop.ControlLoop` — the loop ``fulcrum replay`` runs — on
``handlers.KubernetesCluster`` (observe through Prometheus, apply through the API, drain through the router).
"""
