"""Role reassignment against fixed roles, on a real trace whose ISL/OSL mix shifts (issue 5, item 4).

The trace: the first ``--minutes`` of the Azure code-completion trace of 2023 (long prompts, short outputs:
mean ISL 2047, mean OSL 27) followed, without a gap, by the first ``--minutes`` of the Azure conversation trace
(mean ISL 1154, mean OSL 211) — a prefill-heavy hour turning into a decode-heavy one. Both are bundled
(``fulcrum.data``). Arrival rates are scaled by ``--scale`` to load the cluster.

Cluster: a pool of same-TP ``kv_both`` instances (Splitwise's Llama-2-70B H100 profile at TP 4), started as
``--prefill`` P + ``--decode`` D, or as one unified pool of as many instances. Seven runs on the same GPUs, all
routed by the router's ``disaggregated`` policy:

- ``fixed``: roles never change (what a planner that restarts pods does between its intervals);
- ``roles``: BanaServe Alg. 1 with a role flip (``fulcrum.rebalancing.role_reassignment``) every second:
  an instance moves duty in place, a decode instance handing its requests over first (the simulator's P/D
  flips; the live router does not flip P or D instances);
- ``roles+ares``: the same plus ARES decode rescheduling with the oracle remaining length;
- ``both``: a unified pool, each instance taking either part of any request (the router without ``roles``);
- ``duties``: the same pool with the live router's role reassignment (``roles``: a duty per instance, the
  router's :class:`~fulcrum.rebalancing.duties.DutyBook`, as ``fulcrum replay`` runs it), a decode-duty
  instance's compute counted against ``max_num_seqs`` (no plan);
- ``duties@slo-batch``: the same, counted against the batch at which TPOT reaches the SLO at the trace's mean
  lengths (what the operator writes from a Unified plan, ``RoutingParams.decode_concurrency``);
- ``duties+ares``: the same plus ARES with the learnt remaining length, migrating by recompute as the router
  does (a new prefill-duty instance keeps its decodes, the router config the operator writes);
- ``duties+ares+mof``: the same with ``migrate_on_flip``: a new prefill-duty instance's decodes move off.

Printed: SLO attainment (TTFT and TPOT at the 90th percentile), TTFT/TPOT p90, goodput, role changes, and the
ratio of each run's attainment to the fixed baseline measured in the same run.

Run: ``python benchmarks/bench_role_reassignment.py [--minutes 20] [--scale 1.0] [--prefill 3 --decode 3]``.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import Any

from fulcrum.api.llmserve import SLOSpec
from fulcrum.data import bundled_trace_path
from fulcrum.ratio.capacity import decode_capacity
from fulcrum.ratio.profiles import builtin_profile
from fulcrum.replay.rescheduling import ares_rescheduler, learned_remaining, oracle_remaining
from fulcrum.replay.roles import SimulatedDuties, role_balancer
from fulcrum.rebalancing.decode_rescheduling import ReschedulingConfig
from fulcrum.rebalancing.role_reassignment import RoleBalanceConfig
from fulcrum.simulator import SimConfig, Simulation
from fulcrum.target import ClusterTarget, PoolSize, RoutingParams
from fulcrum.traces.reader import load_trace
from fulcrum.workload import Request


def shifted_trace(minutes: float, scale: float) -> list[Request]:
    """Azure code (first ``minutes``) then Azure conversation (first ``minutes``), arrivals ÷ ``scale``."""
    window = minutes * 60.0
    out: list[Request] = []
    offset = 0.0
    for name in ("azure-code-2023", "azure-conv-2023"):
        reqs = [r for r in load_trace(bundled_trace_path(name)).requests if r.arrival_s < window]
        out.extend(Request(arrival_s=offset + r.arrival_s / scale, isl=r.isl, osl=r.osl) for r in reqs)
        offset += window / scale
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0, help="minutes of each trace (default 20)")
    ap.add_argument("--scale", type=float, default=1.0, help="arrival-rate multiplier (default 1)")
    ap.add_argument("--prefill", type=int, default=2, help="initial prefill instances (default 2)")
    ap.add_argument("--decode", type=int, default=2, help="initial decode instances (default 2)")
    ap.add_argument("--tp", type=int, default=4, help="TP of every instance (default 4)")
    args = ap.parse_args()

    profile = builtin_profile("splitwise-llama2-70b-h100")
    slo = SLOSpec(ttft_ms=2000, tpot_ms=100, percentile=90)
    reqs = shifted_trace(args.minutes, args.scale)
    target = ClusterTarget(prefill=PoolSize(args.prefill, args.tp), decode=PoolSize(args.decode, args.tp))
    cfg = SimConfig(pod_startup_s=0, reschedule_interval_s=1.0)
    print(f"trace: {len(reqs)} requests over {reqs[-1].arrival_s / 60:.1f} min (azure-code then azure-conv, "
          f"×{args.scale}); cluster {args.prefill}P+{args.decode}D at TP {args.tp} = "
          f"{(args.prefill + args.decode) * args.tp} GPUs; SLO TTFT {slo.ttft_ms:.0f} ms, TPOT {slo.tpot_ms:.0f} ms @ p{slo.percentile:.0f}")
    unified = ClusterTarget(unified=PoolSize(args.prefill + args.decode, args.tp))
    # what the operator writes from a Unified plan: the batch at which one instance's TPOT reaches the SLO, at the
    # trace's mean lengths (decode-duty compute counts against it: fulcrum.rebalancing.duties)
    cc = decode_capacity(profile, args.tp, sum(r.isl for r in reqs) / len(reqs), sum(r.osl for r in reqs) / len(reqs),
                         slo.tpot_ms / 1000.0).cc
    slo_unified = replace(unified, routing=RoutingParams(decode_concurrency=cc))
    recompute = replace(cfg, migration="recompute")
    rate = profile.prefill_tokens_per_s(args.tp)
    predict, feed = learned_remaining("bench")
    predict2, feed2 = learned_remaining("bench")
    runs: dict[str, tuple[ClusterTarget, SimConfig, dict[str, Any]]] = {
        "fixed": (target, cfg, {}),
        "roles": (target, cfg, {"role_balancer": role_balancer(RoleBalanceConfig())}),
        "roles+ares": (target, cfg, {"role_balancer": role_balancer(RoleBalanceConfig()),
                                     "rescheduler": ares_rescheduler(oracle_remaining, ReschedulingConfig(),
                                                                     profile=profile, link_gbps=cfg.kv_link_gbps)}),
        "both": (unified, cfg, {}),
        "duties": (unified, cfg, {"duties": SimulatedDuties(slo.ttft_ms / 1000.0)}),
        "duties@slo-batch": (slo_unified, cfg, {"duties": SimulatedDuties(slo.ttft_ms / 1000.0)}),
        "duties+ares": (unified, recompute, {"duties": SimulatedDuties(slo.ttft_ms / 1000.0), "on_finished": feed,
                                             "rescheduler": ares_rescheduler(predict, profile=profile,
                                                                             recompute_tokens_per_s=lambda: rate)}),
        "duties+ares+mof": (unified, recompute, {
            "duties": SimulatedDuties(slo.ttft_ms / 1000.0, migrate_on_flip=True), "on_finished": feed2,
            "rescheduler": ares_rescheduler(predict2, profile=profile, recompute_tokens_per_s=lambda: rate)}),
    }
    print(f"{'run':<16} {'SLO att.':>9} {'TTFT p90 s':>11} {'TPOT p90 ms':>12} {'goodput tok/s':>14} "
          f"{'role chg':>9} {'migr.':>6} {'wall s':>7} {'vs fixed':>9}")
    base = None
    for name, (start, config, hooks) in runs.items():
        t0 = time.perf_counter()
        res = Simulation(reqs, profile, slo, start, config, **hooks).finish()
        wall = time.perf_counter() - t0
        s = res.summary(slo)
        if base is None:
            base = s["slo_attainment"]
        ratio = s["slo_attainment"] / base if base > 0 else float("inf")
        print(f"{name:<16} {s['slo_attainment']:>9.3f} {s['ttft_p_s']:>11.2f} {s['tpot_p_s'] * 1000:>12.1f} "
              f"{s['goodput_tokens_per_s']:>14.0f} {res.role_changes:>9d} {res.migrations:>6d} {wall:>7.1f} {ratio:>8.2f}×")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
