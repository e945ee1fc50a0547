"""P/D ratio planning (DOPD §IV-B–C, §V-D, Alg. 2): performance profiles, D-instance capacity, the P/D
balance, TP choice, Kingman headroom for TTFT, and integer instance counts under a GPU budget; and the one
step-cost model (``step_cost.py``) that prices an engine step from a profile for the simulator, the sim-worker,
the router's execution predictor and the local scheduler's latency table.

Pure: inputs in, a plan out. Nothing here performs I/O except loading profile files in ``profile.py``,
and nothing imports Kubernetes, HTTP, NATS, etcd or vLLM (enforced by ``.importlinter``).
"""
