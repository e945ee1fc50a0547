"""vLLM's default scheduler vs Fulcrum's SLO-aware scheduler (Libra §4.2, Alg. 2) on one real vLLM CPU engine.

Run (real engines: hold the shared lock; one engine at a time):

    flock /tmp/fulcrum-vllm.lock python benchmarks/bench_slo_scheduler.py [--slo-ms 6] [--decodes 8]
        [--decode-tokens 1000] [--long-prompts 16] [--long-tokens 1536] [--long-gap-s 0.1] [--work DIR] [--json]

The same engine configuration (tiny model of ``tests/integration/tiny_model.py``, core 0, no KV connector,
``--max-num-batched-tokens 2048``, ``--enforce-eager``) runs three times, one engine after the other:

- ``default``: vLLM's own scheduler (chunked prefill, up to 2048 tokens per step);
- ``recording``: ``--scheduler-cls fulcrum.worker.slo_scheduler.SLOAwareScheduler`` without an SLO — vLLM's
  batching unchanged (no reordering, no budget), but every step timed into ``FULCRUM_STEP_LOG``: the
  instrumented twin of ``default``;
- ``fulcrum``: the same class with ``FULCRUM_TPOT_SLO_MS=--slo-ms``; its table starts empty and learns online
  (the warm-up round fills it).

Each engine gets the same warm-up (one round of the load), then the measured round: ``--decodes`` streaming
requests with 32-token prompts and ``--decode-tokens`` output tokens each, and, once they all stream,
``--long-prompts`` prompts of ``--long-tokens`` tokens ``--long-gap-s`` apart (2 output tokens each).

Reported per variant:

- decode TBT p50/p99/max from the step log: the measured time of each step that carried decodes, counted once
  per decode in it (the gap every decode token waits for; exact, but only where the scheduler class runs);
- vLLM's own ``vllm:inter_token_latency_seconds`` p50/p99 (increase over the measured round,
  ``histogram_quantile`` with linear interpolation inside vLLM's coarse buckets: 10, 25, 50, 75, 100 ms …);
- TTFT p50/p99 of the long prompts (client side), the load's wall time, steps, mixed steps, the largest
  prefill beside decodes, budget violations, measured table buckets;
- the p99 ratios fulcrum/default (vLLM histogram) and fulcrum/recording (step log).

Client-side gaps between streamed chunks are not reported: on the shared 2-core machine the client reads
the streams in bursts (median gap in the microseconds), which measures the client, not the engine.
Numbers depend on the machine and on what else runs on it: compare the columns of one run only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from integration.engines import Engine, EngineSpec, build_tiny_model, free_port, venv_python  # noqa: E402
from integration.test_slo_scheduler_vllm import fulcrum_worker_pythonpath  # noqa: E402

from fulcrum.vllm_plugin import SCHEDULER_CLS  # noqa: E402
from fulcrum.worker.step_profiler import run_mixed_load, table_from_metrics_text  # noqa: E402


def percentile(values: list[float], q: float, weights: list[float] | None = None) -> float:
    """The q-th percentile (0–100) of ``values`` (each counted ``weights[i]`` times); NaN for no values."""
    if not values:
        return float("nan")
    pairs = sorted(zip(values, weights or [1.0] * len(values)))
    total = sum(w for _, w in pairs)
    target, acc = total * q / 100, 0.0
    for v, w in pairs:
        acc += w
        if acc >= target:
            return v
    return pairs[-1][0]


def histogram(text: str, name: str) -> dict[float, float]:
    """Cumulative bucket counts ``{le: count}`` of a Prometheus histogram, summed over label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name + "_bucket":
                le = float(s.labels["le"])
                out[le] = out.get(le, 0.0) + s.value
    return out


def histogram_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """Prometheus' ``histogram_quantile`` over the increase between two scrapes (linear within a bucket)."""
    les = sorted(after)
    counts = [after[le] - before.get(le, 0.0) for le in les]
    if not counts or counts[-1] <= 0:
        return float("nan")
    rank = counts[-1] * q
    prev_le, prev_count = 0.0, 0.0
    for le, count in zip(les, counts):
        if count >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_count) / max(count - prev_count, 1e-12)
        prev_le, prev_count = le, count
    return les[-2]


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def step_lines(path: Path, skip: int) -> list[dict[str, Any]]:
    """The scheduler's step log (``FULCRUM_STEP_LOG``) after its first ``skip`` lines."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()[skip:] if line.strip()]


def run_variant(name: str, args: argparse.Namespace, model: Path, work: Path) -> dict[str, Any]:
    """Start the engine of one variant, warm it up, measure the mixed load, stop it."""
    extra_args: tuple[str, ...] = ("--max-num-batched-tokens", str(args.max_batched_tokens))
    env: dict[str, str] = {}
    metrics_port = free_port()
    log = work / f"steps-{name}.jsonl"
    if name != "default":
        extra_args += ("--scheduler-cls", SCHEDULER_CLS)
        env = {"FULCRUM_SCHEDULER_METRICS_PORT": str(metrics_port), "FULCRUM_STEP_LOG": str(log),
               **fulcrum_worker_pythonpath(work)}
        if name == "fulcrum":
            env["FULCRUM_TPOT_SLO_MS"] = str(args.slo_ms)
    spec = EngineSpec(name, cpu=0, kv_role=None, max_model_len=args.max_model_len, extra_args=extra_args, extra_env=env)
    load = dict(model="tiny", decodes=args.decodes, decode_prompt_tokens=32, decode_max_tokens=args.decode_tokens,
                long_prompts=args.long_prompts, long_prompt_tokens=args.long_tokens, long_max_tokens=2,
                long_gap_s=args.long_gap_s)
    with Engine(spec, model, work) as engine:
        print(f"[{name}] ready after {engine.ready_after_s:.0f} s; warm-up", flush=True)
        asyncio.run(run_mixed_load(engine.url, seed=1, **load))  # type: ignore[arg-type]
        skip = len(step_lines(log, 0))
        before = scrape(engine.url + "/metrics")
        print(f"[{name}] measuring", flush=True)
        result = asyncio.run(run_mixed_load(engine.url, seed=2, **load))  # type: ignore[arg-type]
        after = scrape(engine.url + "/metrics")
        steps = step_lines(log, skip)
        ours = scrape(f"http://127.0.0.1:{metrics_port}/metrics") if name != "default" else ""
    h0 = histogram(before, "vllm:inter_token_latency_seconds")
    h1 = histogram(after, "vllm:inter_token_latency_seconds")
    ttft = [t.ttft_s for t in result.long_prompts]
    out: dict[str, Any] = {
        "vllm_itl_p50_ms": histogram_quantile(h0, h1, 0.5) * 1e3,
        "vllm_itl_p99_ms": histogram_quantile(h0, h1, 0.99) * 1e3,
        "long_ttft_p50_ms": percentile(ttft, 50) * 1e3, "long_ttft_p99_ms": percentile(ttft, 99) * 1e3,
        "wall_s": result.wall_s,
    }
    if steps:
        # the TBT each decode token saw: the time of the step that produced it, counted once per decode
        decode_steps = [s for s in steps if s["decodes"] > 0]
        secs = [s["seconds"] for s in decode_steps]
        weights = [float(s["decodes"]) for s in decode_steps]
        out.update({
            "step_itl_p50_ms": percentile(secs, 50, weights) * 1e3, "step_itl_p99_ms": percentile(secs, 99, weights) * 1e3,
            "step_itl_max_ms": max(secs) * 1e3, "steps": len(steps),
            "mixed_steps": sum(1 for s in decode_steps if s["prefill"] > 0),
            "max_prefill_beside_decodes": max((s["prefill"] for s in decode_steps), default=0),
            "budget_violations": sum(1 for s in steps if s["budget"] is not None and s["prefill"] > s["budget"]),
        })
    if ours:
        out["table_measured_buckets"] = table_from_metrics_text(ours).measured_entries
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slo-ms", type=float, default=6.0, help="Fulcrum's TPOT SLO, ms")
    p.add_argument("--decodes", type=int, default=8)
    p.add_argument("--decode-tokens", type=int, default=1000)
    p.add_argument("--long-prompts", type=int, default=16)
    p.add_argument("--long-tokens", type=int, default=1536)
    p.add_argument("--long-gap-s", type=float, default=0.1)
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--work", type=Path, default=None, help="work directory (default: a temporary one)")
    p.add_argument("--json", action="store_true", help="also print the raw numbers as JSON")
    args = p.parse_args(argv)
    if not venv_python().is_file():
        print(f"no vLLM environment at {venv_python()}: run scripts/install-vllm-cpu.sh", file=sys.stderr)
        return 2
    if args.long_tokens >= args.max_model_len:
        print("--long-tokens must be below --max-model-len", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-slo-") as tmp:
        work = args.work or Path(tmp)
        model = build_tiny_model(work / "tiny-model")
        results = {name: run_variant(name, args, model, work) for name in ("default", "recording", "fulcrum")}
    names = list(results)
    print(f"\n{args.decodes} decodes x {args.decode_tokens} tokens, {args.long_prompts} long prompts x "
          f"{args.long_tokens} tokens {args.long_gap_s:g} s apart; Fulcrum TPOT SLO {args.slo_ms:g} ms")
    print(f"{'':40}" + "".join(f"{n:>12}" for n in names))
    rows = (("step_itl_p50_ms", "decode TBT p50, step log (ms)"), ("step_itl_p99_ms", "decode TBT p99, step log (ms)"),
            ("step_itl_max_ms", "decode TBT max, step log (ms)"), ("vllm_itl_p50_ms", "vLLM ITL p50, histogram (ms)"),
            ("vllm_itl_p99_ms", "vLLM ITL p99, histogram (ms)"), ("long_ttft_p50_ms", "long-prompt TTFT p50 (ms)"),
            ("long_ttft_p99_ms", "long-prompt TTFT p99 (ms)"), ("wall_s", "load wall time (s)"), ("steps", "steps"),
            ("mixed_steps", "steps with decodes + prefill"), ("max_prefill_beside_decodes", "max prefill beside decodes"),
            ("budget_violations", "budget violations"), ("table_measured_buckets", "measured table buckets"))
    for key, label in rows:
        print(f"{label:40}" + "".join(f"{results[n][key]:12.1f}" if key in results[n] else f"{'-':>12}" for n in names))
    d, r, f = results["default"], results["recording"], results["fulcrum"]
    print(f"p99 ITL ratio fulcrum/default (vLLM histogram): {f['vllm_itl_p99_ms'] / d['vllm_itl_p99_ms']:.2f}")
    print(f"p99 TBT ratio fulcrum/recording (step log, same batching as default): "
          f"{f['step_itl_p99_ms'] / r['step_itl_p99_ms']:.2f}")
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
