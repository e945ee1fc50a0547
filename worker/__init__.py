"""The worker side: ``fulcrum worker`` (vLLM with NIXL, registration, drain), Fulcrum's SLO-aware vLLM scheduler
(Libra §4.2, Alg. 2), ``fulcrum sim-worker`` (an engine emulator timed by a profile) and ``fulcrum profile``.

Adapter code: it talks HTTP, etcd and vLLM. Pure pieces (the latency table, the emulator's clock model) import
nothing from the edges.
"""
