"""A discrete-event simulator of a P/D serving cluster, timed by a performance profile.

It is the cluster of ``fulcrum replay``: the planner loop ``observe → plan → apply`` runs against it on real
traces, with no GPU. What belongs here: the event kernel (``kernel``), instance models (``instances``: P
instances, decode and unified engines with continuous batching, chunked prefill, KV memory and preemption),
the cluster with its scaling rules, routing every request through the router's own policies and DOPD Alg. 1
batcher from :mod:`fulcrum.routing` (``cluster``), measurements (``metrics``) and the
per-request records (``records``). What does not: planning (``fulcrum.scaling``, ``fulcrum.ratio``), trace
parsing (``fulcrum.traces``), reports (``fulcrum.replay``), and any I/O, clock or randomness — a run is a
pure function of its inputs, so two runs give identical records.

A :class:`Simulation` is a :class:`fulcrum.cluster.Cluster` (``observe``, ``apply``, ``ready``, ``draining``);
``fulcrum replay`` runs the operator's control loop on it (:mod:`fulcrum.replay.driver`). Usage::

    sim = Simulation(requests, profile, slo, initial_target, SimConfig(pod_startup_s=120))
    loop = ControlLoop(spec, profile, initial_target)  # fulcrum.scaling.loop
    for k in range(1, n_ticks + 1):
        sim.run_until(k * 60.0)
        loop.run_interval(sim)  # observe → plan → apply
    result = sim.finish()
    result.summary(slo)
"""

from fulcrum.simulator.cluster import (
    DutyBalancer,
    PolicyFactory,
    Rescheduler,
    RoleBalancer,
    SimConfig,
    SimResult,
    Simulation,
    default_policy,
    next_policy,
    policy_config,
)
from fulcrum.simulator.kernel import Kernel, Priority
from fulcrum.simulator.metrics import ClusterSnapshot, MetricsRecorder, percentile, summarize
from fulcrum.simulator.records import DecodeInstanceView, DecodeRequestView, InstanceStatus, RequestRecord, RoleView

__all__ = [
    "SimConfig",
    "SimResult",
    "Simulation",
    "Rescheduler",
    "RoleBalancer",
    "DutyBalancer",
    "RoleView",
    "DecodeInstanceView",
    "DecodeRequestView",
    "PolicyFactory",
    "default_policy",
    "next_policy",
    "policy_config",
    "RequestRecord",
    "InstanceStatus",
    "Kernel",
    "Priority",
    "ClusterSnapshot",
    "MetricsRecorder",
    "percentile",
    "summarize",
]
