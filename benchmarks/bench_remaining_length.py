"""Accuracy of the remaining-length predictor (ARES §4) on real output lengths, beside the prompt-only estimate.

Run: ``python benchmarks/bench_remaining_length.py [--g 0 16 64 256] [--window 2048] [--min-samples 16]``

Data (``/work/shared/data``, see its README; a missing file is skipped and said so): the Azure LLM inference
traces of 2023 (code and conversation; arrival order) and the ShareGPT length table (file order), each a list of
(prompt tokens P, output tokens L).

Protocol — online, as the router would learn: the requests are taken in order; for each request and each
generated-token count g with L > g (the request is still running after g tokens), every predictor estimates the
remaining length L − g from (P, g) alone; then the request's (P, L) is observed (it finished). The table gives the
mean absolute error (tokens) over those (request, g) pairs, per data set and g:

- ``cond mean``: :class:`fulcrum.routing.remaining_length.RemainingLengthPredictor`, E[L − g | L > g] per ISL
  bucket (the default, what ARES's load sums need);
- ``cond median``: the same, conditional median (the MAE-optimal point of the same conditional distribution);
- ``prompt-only``: the router's output-length predictor (``BucketedQuantilePredictor``: per-ISL-bucket median
  plus Libra's 20-token margin) minus g, at least 1 — the estimate available without conditioning on g;
- ``prompt-only (no margin)``: the same without the margin.

All four start from the same prior (512 tokens) before their first observation. No GPU or engine is involved:
ARES's hidden-state MLP is not reproduced (``HiddenStateLengthPredictor`` is only an interface).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import time
from collections.abc import Callable
from pathlib import Path

from fulcrum.routing.length_predictor import BucketedQuantilePredictor
from fulcrum.routing.remaining_length import RemainingLengthPredictor

DATA = Path("/work/shared/data")
DATASETS: dict[str, tuple[Path, str, str]] = {
    "azure-code-2023": (DATA / "azure_llm_2023/AzureLLMInferenceTrace_code.csv", "ContextTokens", "GeneratedTokens"),
    "azure-conv-2023": (DATA / "azure_llm_2023/AzureLLMInferenceTrace_conv.csv", "ContextTokens", "GeneratedTokens"),
    "sharegpt": (DATA / "lengths/sharegpt_8k_filtered_stats_llama2_tokenizer.csv.gz", "num_prefill_tokens",
                 "num_decode_tokens"),
}
PRIOR = 512


def load(path: Path, p_col: str, l_col: str) -> list[tuple[int, int]]:
    """[(prompt tokens, output tokens)] in file order (rows with a non-positive output are dropped)."""
    opener: Callable[..., object] = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as f:  # type: ignore[operator]
        rows = [(int(float(r[p_col])), int(float(r[l_col]))) for r in csv.DictReader(f)]  # type: ignore[arg-type]
    return [(p, n) for p, n in rows if n > 0 and p >= 0]


def evaluate(rows: list[tuple[int, int]], gs: list[int], window: int, min_samples: int) -> dict[int, dict[str, float]]:
    """{g: {method: MAE tokens, "n": pairs}} under the online protocol of the module doc."""
    mean = RemainingLengthPredictor(statistic="mean", window=window, min_samples=min_samples, prior_tokens=PRIOR)
    med = RemainingLengthPredictor(statistic="median", window=window, min_samples=min_samples, prior_tokens=PRIOR)
    po = BucketedQuantilePredictor(prior_tokens=PRIOR - 20)  # prior + margin = the same 512-token prior
    po0 = BucketedQuantilePredictor(margin_tokens=0, prior_tokens=PRIOR)
    cap = 1 << 30  # no client cap: the predictors' own estimates
    err = {g: {"cond mean": 0.0, "cond median": 0.0, "prompt-only": 0.0, "prompt-only (no margin)": 0.0, "n": 0.0}
           for g in gs}
    for p, n in rows:
        total, total0 = po.predict(p, cap), po0.predict(p, cap)
        for g in gs:
            if n <= g:
                continue
            truth = n - g
            e = err[g]
            e["cond mean"] += abs(mean.predict_remaining("m", p, g) - truth)
            e["cond median"] += abs(med.predict_remaining("m", p, g) - truth)
            e["prompt-only"] += abs(max(total - g, 1) - truth)
            e["prompt-only (no margin)"] += abs(max(total0 - g, 1) - truth)
            e["n"] += 1
        mean.observe("m", p, n)
        med.observe("m", p, n)
        po.observe(p, n)
        po0.observe(p, n)
    return {g: {k: (v if k == "n" else v / max(e["n"], 1.0)) for k, v in e.items()} for g, e in err.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--g", type=int, nargs="+", default=[0, 16, 64, 256], help="generated-token counts")
    ap.add_argument("--window", type=int, default=2048, help="per-bucket window of the remaining-length predictor")
    ap.add_argument("--min-samples", type=int, default=16)
    ap.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    methods = ["cond mean", "cond median", "prompt-only", "prompt-only (no margin)"]
    print(f"MAE of the remaining output length L − g, tokens (online; window {args.window}, "
          f"min_samples {args.min_samples}); 'vs prompt-only' = cond mean's error change against prompt-only\n")
    print("| data set | g | requests with L > g | " + " | ".join(methods) + " | vs prompt-only |")
    print("|---|---|---|" + "---|" * len(methods) + "---|")
    out: dict[str, object] = {}
    for name in args.datasets:
        path, pc, lc = DATASETS[name]
        if not path.exists():
            print(f"| {name} | — | file absent ({path}) |" + " |" * (len(methods) + 1))
            continue
        rows = load(path, pc, lc)
        t0 = time.perf_counter()
        res = evaluate(rows, sorted(set(args.g)), args.window, args.min_samples)
        took = time.perf_counter() - t0
        out[name] = {"rows": len(rows), "seconds": took, "by_g": res}
        for g, r in res.items():
            change = (r["cond mean"] - r["prompt-only"]) / r["prompt-only"] * 100 if r["prompt-only"] else 0.0
            cells = " | ".join(f"{r[m]:.1f}" for m in methods)
            print(f"| {name} | {g} | {int(r['n'])} | {cells} | {change:+.1f}% |")
    print("\nrows and time per data set: " + ", ".join(
        f"{k} {v['rows']} rows {v['seconds']:.1f} s" for k, v in out.items()  # type: ignore[index]
    ))
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
