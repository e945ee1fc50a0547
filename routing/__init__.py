"""Routing policies: given a request and the instances' state, decide where it runs and how it is split.

Pure: policies import no HTTP, NATS, etcd or Kubernetes code and perform no I/O (``.importlinter``). Each
policy lives in a module named after it, with the paper section in its docstring; all implement
:class:`fulcrum.routing.base.Policy`.
"""
