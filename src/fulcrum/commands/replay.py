"""``fulcrum replay``: run planners against a simulated cluster on a real trace and compare them.

The trace is a file (Azure CSV or Mooncake JSONL, gzip accepted, format detected or named) or the name of a
trace bundled with Fulcrum (``azure-conv-2023``, ``azure-code-2023``, ``mooncake-conv``). The ``LLMServe``
file gives the SLOs, limits, interval, start-up time and profile; without one, a default spec serving a
70B model on H100 with DOPD's Table I profile is used.

Output: one line per policy, then the comparison table (the spec's percentile); ``--percentiles`` adds a second
table with p50/p90/p99 of TTFT, TPOT, end-to-end latency and queueing time per policy; ``--records FILE`` writes
every request (CSV, or Parquet for a ``.parquet`` name). A warning line is printed for every SLO target a policy's
plans found out of the profile's reach at the forecast lengths (also under ``slo_infeasible`` in ``--json``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from fulcrum.api.llmserve import LLMServe, LLMServeSpec, ModelSpec, load_llmserve
from fulcrum.errors import ProfileError
from fulcrum.ratio.profile import PerformanceProfile
from fulcrum.ratio.profiles import BUILTIN_PROFILES, builtin_profile, resolve_profile
from fulcrum.replay.distribution import check_records_path, write_records
from fulcrum.replay.driver import POLICIES, ReplayOptions, run_policy, scale_arrivals, warmup_seconds
from fulcrum.replay.table import comparison_table, infeasible_lines, percentiles_table, summary_json
from fulcrum.traces import TRACE_FORMATS, load_trace

__all__ = ["add_parser", "run", "resolve_spec_profile"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("replay", help="replay a trace against a simulated cluster", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, help="trace file, or a bundled trace name (azure-conv-2023, azure-code-2023, mooncake-conv)")
    p.add_argument("--format", choices=sorted(TRACE_FORMATS), help="trace format (detected from the content when omitted)")
    p.add_argument("--llmserve", help="LLMServe YAML (SLOs, limits, interval, profile); a 70B/H100 default when omitted")
    p.add_argument("--profile", help=f"override the spec's profile: a file or a built-in name ({', '.join(BUILTIN_PROFILES)})")
    p.add_argument("--policy", default="fulcrum", choices=list(POLICIES), help="planner to run (default fulcrum)")
    p.add_argument("--compare", action="store_true", help="run every policy on the same trace and print one table")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times by X (< 1 = a denser trace)")
    p.add_argument("--start", type=float, default=0.0, help="start of the trace window, seconds")
    p.add_argument("--duration", type=float, help="length of the trace window, seconds (whole trace when omitted)")
    p.add_argument("--warmup", type=float, help="seconds at the start left out of scoring (default: pod start-up + 2 intervals; 0 = score all)")
    p.add_argument("--report", type=Path, help="write PNG plots, summary.json and comparison.txt into this folder")
    p.add_argument("--json", action="store_true", help='print {"policies": {NAME: {...}}} as JSON')
    p.add_argument("--percentiles", action="store_true",
                   help="also print p50/p90/p99 of TTFT, TPOT, end-to-end latency and queueing time per policy")
    p.add_argument("--records", type=Path, metavar="FILE",
                   help="write every request of every policy to FILE: CSV, or Parquet when it ends in .parquet")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _default_spec() -> LLMServeSpec:
    return LLMServe(spec=LLMServeSpec(model=ModelSpec(name="meta-llama/Llama-3.1-70B-Instruct-FP8"))).spec


def resolve_spec_profile(spec: LLMServeSpec, spec_path: Path | None, override: str | None) -> PerformanceProfile:
    """The profile a replay uses: ``--profile`` if given, else the spec's reference.

    A ``path`` reference is resolved relative to the LLMServe file's folder first, then the working directory.

    Raises:
        ProfileError: the spec names a ConfigMap (in-cluster only) or the file/name is unknown.
    """
    if override:
        return resolve_profile(override)
    ref = spec.profile
    if ref.name:
        return builtin_profile(ref.name)
    if ref.path:
        cand = Path(ref.path)
        if not cand.is_absolute() and spec_path is not None and (spec_path.parent / cand).is_file():
            cand = spec_path.parent / cand
        return resolve_profile(str(cand))
    raise ProfileError(
        f"the LLMServe's profile is the ConfigMap {ref.config_map!r}, which only exists in a cluster: "
        "pass --profile FILE or a built-in name to replay"
    )


def run(args: argparse.Namespace) -> int:
    if args.records is not None:
        check_records_path(args.records)  # a bad name or a missing pyarrow fails before a long replay
    spec_path = Path(args.llmserve) if args.llmserve else None
    spec = load_llmserve(spec_path).spec if spec_path else _default_spec()
    profile = resolve_spec_profile(spec, spec_path, args.profile)
    trace = load_trace(args.trace, args.format, start_s=args.start, duration_s=args.duration)
    requests = scale_arrivals(trace.requests, args.time_scale)
    policies = list(POLICIES) if args.compare else [args.policy]
    progress = not (args.no_progress or args.json) and sys.stderr.isatty()
    options = ReplayOptions(progress=progress, warmup_s=args.warmup)
    warmup = warmup_seconds(spec, options)
    if not args.json:
        print(f"trace {trace.name}: {len(requests)} requests over {requests[-1].arrival_s / 60:.1f} min "
              f"(time scale {args.time_scale:g}); profile {profile.name}; mode {spec.mode.value}; "
              f"SLO TTFT {spec.slo.ttft_ms:g} ms, TPOT {spec.slo.tpot_ms:g} ms at P{spec.slo.percentile:g}",
              flush=True)
        print(f"scoring from t = {warmup:g} s (warm-up: the cold start of the initial pools, alike for every policy)")
    runs = []
    for name in policies:
        runs.append(run_policy(name, requests, spec, profile, options))
        if not args.json:
            s = runs[-1].summary
            print(f"  {name:<12} SLO attainment {s.slo_attainment:6.1%}  GPU-hours {s.gpu_hours:7.2f}  "
                  f"({runs[-1].wall_s:.1f} s)", flush=True)
            for line in infeasible_lines(runs[-1:]):
                print(f"  {line}", flush=True)
    extra = {"profile": profile.name, "mode": spec.mode.value, "time_scale": args.time_scale, "warmup_s": warmup}
    if args.report:
        from fulcrum.replay.report import write_report

        paths = write_report(runs, args.report, trace_name=trace.name, slo=spec.slo)
        if not args.json:
            print(f"report: {len(paths)} files in {args.report}")
    if args.records is not None:
        write_records(runs, args.records, spec.slo)
        if not args.json:
            print(f"records: {sum(len(r.records) for r in runs)} requests in {args.records}")
    if args.json:
        print(json.dumps(summary_json(runs, trace_name=trace.name, slo=spec.slo, extra=extra), indent=2, allow_nan=False))
    else:
        print()
        print(comparison_table(runs, spec.slo, trace_name=trace.name))
        if args.percentiles:
            print(percentiles_table(runs, trace_name=trace.name))
    return 0
