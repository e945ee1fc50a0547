"""Fulcrum's router: an OpenAI-compatible global scheduler in front of the worker instances.

- ``fulcrum.routing``: per-request routing and split decisions (pure: no HTTP, no I/O);
- the rest of the package is the data plane: the HTTP server, upstream connection pools, the handoff protocol
  over vLLM's NIXL ``kv_transfer_params``, the instance registry (static list, etcd, Kubernetes endpoints), the
  NATS prefill queue, and the router's Prometheus metrics.
"""
