"""Is Fulcrum's planner on the Pareto front? Issue 13's acceptance matrix in one command.

For every shipped example with a profile Fulcrum can resolve without a cluster (``examples/*.yaml``; or the files
given with ``--llmserve``) and every trace (``--traces``, default the Azure conversation and code traces of 2023
and ``synthetic-burst-steady``), it runs ``fulcrum replay --trace T --llmserve E --compare --json`` in a child
process (``--jobs`` at a time) and prints, per cell, SLO attainment / GPU-hours of every policy, the deployment
``static-best`` found, and the policies that dominate ``fulcrum`` (at least its attainment at no more GPU-hours,
one of the two strictly: :mod:`fulcrum.replay.pareto`). The last line counts the cells where ``fulcrum`` is not
dominated (the target: all of them) and those where its SLO attainment reaches the spec's percentile. The baseline
measured in the same run is the ``dopd`` reference planner (DOPD Alg. 2): the same two counts for it. Being on the
front alone says nothing about the SLO: a planner that holds few GPUs and misses most requests is on it too, which
is why the second count is there.

``--seeds 1,2,3,4`` adds, for each synthetic trace among them, the same cells with the trace drawn at those seeds
(``fulcrum replay --seed``; shown as ``NAME@SEED``) and counts them apart: the default seed is the matrix, the
others say whether a cell's verdict is the planner's or the draw's (about 1 minute per seed).

Then, for each ``mode: Auto`` example, the criterion "Auto is at least as good as the better of its two modes":
the same example with ``mode`` pinned to Disaggregated and to Unified, ``--policy fulcrum`` on each trace, and
whether either pinned mode dominates Auto (about 1 minute more).

    python benchmarks/bench_pareto.py [--jobs 2] [--traces azure-conv-2023,...] [--llmserve FILE ...]
                                      [--seeds 1,2,...] [--json OUT]

About 7 minutes for the 12 default cells on a 2-core machine at ``--jobs 2`` (the code trace's ``static-best``
sweeps are the long ones). Every number comes from the replay's own ``--json``; ``--json OUT`` writes them all.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TRACES = ("azure-conv-2023", "azure-code-2023", "synthetic-burst-steady")
JUDGED = ("fulcrum", "dopd")


def resolvable(path: Path) -> bool:
    """Whether the example's profile resolves here (a built-in or a file; not a ConfigMap in a cluster)."""
    from fulcrum.api.llmserve import load_llmserve
    from fulcrum.ratio.profiles import resolve_spec_profile
    from fulcrum.errors import ProfileError

    try:
        resolve_spec_profile(load_llmserve(path).spec, path, None)
    except ProfileError:
        return False
    return True


def trace_args(trace: str) -> list[str]:
    """``fulcrum replay`` arguments of a cell's trace: ``NAME`` → ``--trace NAME``, ``NAME@SEED`` (a synthetic
    trace drawn at another seed) → ``--trace NAME --seed SEED``."""
    name, _, seed = trace.partition("@")
    return ["--trace", name, *(["--seed", seed] if seed else [])]


def run_cell(spec: Path, trace: str, policy_args: tuple[str, ...] = ("--compare",)) -> dict[str, Any]:
    """One ``fulcrum replay --compare --json`` (or other ``policy_args``) in a child process; its parsed output
    plus the wall time.

    Raises:
        RuntimeError: the replay failed (its stderr in the message).
    """
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "fulcrum", "replay", *trace_args(trace), "--llmserve", str(spec), *policy_args,
           "--json", "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    out: dict[str, Any] = json.loads(done.stdout)
    out["wall_s"] = time.perf_counter() - t0
    return out


def score(policy: dict[str, Any]) -> Any:
    """A policy's ``--json`` entry as a :class:`fulcrum.replay.pareto.Score` (null attainment: no request scored)."""
    from fulcrum.replay.pareto import Score

    a = policy["slo_attainment"]
    return Score(float("nan") if a is None else a, policy["gpu_hours"])


def dominated_by(policies: dict[str, dict[str, Any]], judged: str) -> list[str]:
    """The policies that dominate ``judged`` in one cell's ``--json`` ``policies`` (see the module doc)."""
    from fulcrum.replay.pareto import dominators

    return dominators({name: score(p) for name, p in policies.items()}, judged)


def cell_text(policy: dict[str, Any]) -> str:
    """``attainment / GPU-hours`` of a policy's ``--json`` entry, as the tables show it."""
    a = policy["slo_attainment"]
    return f"{'n/a' if a is None else f'{a:.1%}'} / {policy['gpu_hours']:.2f}"


def print_table(header: list[str], rows: list[list[str]]) -> None:
    """Left-aligned columns under a dashed rule."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llmserve", action="append", type=Path,
                    help="LLMServe file (repeatable; default: every examples/*.yaml whose profile resolves)")
    ap.add_argument("--traces", default=",".join(TRACES), help="comma-separated trace names or files")
    ap.add_argument("--jobs", type=int, default=2, help="replays run at once (default 2)")
    ap.add_argument("--seeds", default="", help="comma-separated seeds: also run each synthetic trace drawn at "
                    "these seeds, counted apart (default: none)")
    ap.add_argument("--json", type=Path, help="write every cell's --json output here")
    args = ap.parse_args(argv)
    specs = args.llmserve or [p for p in sorted((REPO / "examples").glob("llmserve-*.yaml")) if resolvable(p)]
    traces = [t for t in args.traces.split(",") if t]
    from fulcrum.traces.synthetic import SYNTHETIC_TRACES

    seeded = [f"{t}@{int(n)}" for n in args.seeds.split(",") if n.strip() for t in traces if t in SYNTHETIC_TRACES]
    cells = [(s, t) for s in specs for t in [*traces, *seeded]]
    also = f" + {len(specs) * len(seeded)} at other seeds" if seeded else ""
    print(f"{len(specs) * len(traces)} cells: {len(specs)} LLMServe examples × {len(traces)} traces{also}, "
          f"{args.jobs} at a time", flush=True)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        results = list(pool.map(lambda c: run_cell(*c), cells))
    names = [n for n in results[0]["policies"]]
    header = ["spec × trace", *names, "static-best is", "fulcrum dominated by"]
    rows = []
    free = dict.fromkeys(JUDGED, 0)
    met = dict.fromkeys(JUDGED, 0)
    seeded_free = 0
    for (spec, trace), res in zip(cells, results, strict=True):
        pol = res["policies"]
        if "@" in trace:  # a synthetic trace at another seed: counted apart from the matrix
            seeded_free += not dominated_by(pol, "fulcrum")
        else:
            for judged in JUDGED:
                free[judged] += not dominated_by(pol, judged)
                a = pol[judged]["slo_attainment"]
                met[judged] += a is not None and a >= res["slo"]["percentile"] / 100.0
        cell = [f"{spec.stem.removeprefix('llmserve-')} × {trace}", *(cell_text(pol[n]) for n in names)]
        cell.append(res["static_best"]["deployment"])
        cell.append(", ".join(dominated_by(pol, "fulcrum")) or "none")
        rows.append(cell)
    print_table(header, rows)
    n = len(specs) * len(traces)
    print(f"\nfulcrum not dominated in {free['fulcrum']} of {n} cells (target: all), SLO attainment at or above the "
          f"spec's percentile in {met['fulcrum']} of {n}; baseline dopd: not dominated in {free['dopd']} of {n}, "
          f"at the percentile in {met['dopd']} of {n}; {time.perf_counter() - t0:.0f} s")
    if seeded:
        print(f"synthetic traces at other seeds ({args.seeds}): fulcrum not dominated in {seeded_free} of "
              f"{len(specs) * len(seeded)} cells")
    modes = auto_against_modes(specs, traces, args.jobs)
    if args.json:
        args.json.write_text(json.dumps(
            {"cells": [{**r, "llmserve": str(s), "trace": t} for (s, t), r in zip(cells, results, strict=True)],
             "auto_against_modes": modes}, indent=2))
    return 0


def auto_against_modes(specs: list[Path], traces: list[str], jobs: int) -> list[dict[str, Any]]:
    """Issue 13's second criterion: each ``mode: Auto`` example against itself with the mode pinned to
    Disaggregated and to Unified (``--policy fulcrum``), per trace; prints a table and returns its rows."""
    import tempfile

    import yaml

    docs = {s: yaml.safe_load(s.read_text()) for s in specs}
    autos = [s for s in specs if (docs[s].get("spec") or {}).get("mode") == "Auto"]
    if not autos:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        runs: list[tuple[Path, str, str, Path]] = []
        for spec in autos:
            doc = docs[spec]
            for mode in ("Auto", "Disaggregated", "Unified"):
                doc["spec"]["mode"] = mode
                path = Path(tmp) / f"{spec.stem}-{mode}.yaml"
                path.write_text(yaml.safe_dump(doc))
                runs += [(spec, trace, mode, path) for trace in traces]
        with ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:
            outs = list(pool.map(lambda r: run_cell(r[3], r[1], ("--policy", "fulcrum")), runs))
    got = {(s, t, m): o["policies"]["fulcrum"] for (s, t, m, _), o in zip(runs, outs, strict=True)}
    rows = []
    print("\nAuto against its two modes (fulcrum planner; SLO attainment / GPU-hours):")
    header = ["spec × trace", "Auto", "Disaggregated", "Unified", "Auto dominated by"]
    table = []
    for spec in autos:
        for trace in traces:
            pol = {m: got[(spec, trace, m)] for m in ("Auto", "Disaggregated", "Unified")}
            by = dominated_by(pol, "Auto")
            rows.append({"llmserve": str(spec), "trace": trace, "policies": pol, "dominated_by": by})
            table.append([f"{spec.stem.removeprefix('llmserve-')} × {trace}", *(cell_text(p) for p in pol.values()),
                          ", ".join(by) or "none"])
    print_table(header, table)
    free = sum(not r["dominated_by"] for r in rows)
    print(f"Auto not dominated by either of its modes in {free} of {len(rows)} cells (target: all)")
    return rows


if __name__ == "__main__":
    sys.exit(main())
