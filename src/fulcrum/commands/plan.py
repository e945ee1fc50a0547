"""``fulcrum plan``: one P/D plan from a performance profile and a load (DOPD §IV-B, Alg. 2).

- ``--decode-concurrency C``: one D-instance of capacity C; prints the eq. (15) ratio (DOPD §VI-A3's check).
- ``--concurrency C``: C concurrent requests in decode; n_d = ⌈C/cc_d⌉ (cc_d by eqs. 11–14), n_p = ⌈ratio·n_d⌉.
- ``--rate R``: the full planner for R requests/s (TP choice, Kingman headroom, ultra-short threshold). A TTFT or
  TPOT target the profile cannot meet at these lengths whatever the count is printed as a warning (and listed
  under ``slo_infeasible`` with ``--json``: metric, target_s, best_s, at_isl, at_osl, tp, planned_for_s); the plan
  is sized for the best achievable value instead. ``--min-gpus``/``--max-gpus`` bound the plan's GPUs as an
  ``LLMServe``'s ``scaling.minGPUs``/``maxGPUs`` do: over the budget both pools shrink in proportion to their need,
  and the plan says ``feasible: false`` with a note. ``--mode Unified`` plans one pool of unified (``kv_both``)
  instances instead (``--tp-unified`` to pin its TP); ``--mode Auto`` plans both and picks as an ``LLMServe`` in
  Auto mode does for one interval (the cheaper feasible plan; a tie goes to Disaggregated), printing both. The Auto
  planner of the operator and of ``fulcrum replay`` switches mode only with hysteresis (docs/planner.md); this is
  the one-shot comparison.

``--llmserve FILE`` takes the profile, SLOs, mode, TP pins, GPU limits, ``engine.maxModelLen`` and
``gpu.gpusPerNode`` from an ``LLMServe``: what the operator would plan for that resource at this load. A flag given
as well overrides the file's value. Every TP planned must hold one ``--max-model-len`` sequence (default 8192, or
the LLMServe's ``engine.maxModelLen``) in its KV cache, as vLLM requires to start (docs/planner.md, "TP and
``maxModelLen``"); a profile measured on a memory-tight engine is planned with the engine's own ``--max-model-len``.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fulcrum.api.llmserve import LLMServeSpec, Mode, SLOSpec, load_llmserve
from fulcrum.errors import PlanningError
from fulcrum.ratio.planner import (
    NO_GPU_BOUND,
    Plan,
    PlannerSettings,
    WorkloadEstimate,
    plan_disaggregated,
    plan_ratio,
    plan_unified,
)
from fulcrum.ratio.profile import PerformanceProfile
from fulcrum.ratio.profiles import BUILTIN_PROFILES, resolve_profile, resolve_spec_profile

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="compute a P/D plan from a profile", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", help=f"profile file (YAML/JSON/CSV) or built-in name ({', '.join(BUILTIN_PROFILES)}); "
                   "required unless --llmserve names one")
    p.add_argument("--llmserve", type=Path, help="LLMServe YAML: its profile, SLOs, mode, TP pins and GPU limits "
                   "(a flag given as well wins)")
    p.add_argument("--isl", type=float, required=True, help="mean input length, tokens")
    p.add_argument("--osl", type=float, required=True, help="mean output length, tokens")
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=float, help="request rate, requests/s")
    load.add_argument("--concurrency", type=float, help="concurrent requests in decode")
    load.add_argument("--decode-concurrency", type=float, help="capacity of one D-instance (cc_d), requests")
    p.add_argument("--tp-prefill", type=int, help="TP of P-instances (chosen by eq. 16 when omitted)")
    p.add_argument("--tp-decode", type=int, help="TP of D-instances (chosen by eqs. 11-14 when omitted)")
    p.add_argument("--mode", choices=[m.value for m in (Mode.DISAGGREGATED, Mode.UNIFIED, Mode.AUTO)],
                   help="with --rate: plan P and D pools (the default without --llmserve), one unified pool, or "
                   "both and pick (Auto)")
    p.add_argument("--tp-unified", type=int, help="with --mode Unified/Auto: TP of the unified instances "
                   "(the most requests per GPU when omitted)")
    p.add_argument("--ttft-ms", type=float, help="TTFT SLO, ms (default 2000, or the LLMServe's)")
    p.add_argument("--tpot-ms", type=float, help="TPOT SLO, ms (default 80, or the LLMServe's)")
    p.add_argument("--percentile", type=float, help="SLO percentile (default 90, or the LLMServe's)")
    p.add_argument("--min-gpus", type=int, help="with --rate: least GPUs of the plan (an LLMServe's "
                   "scaling.minGPUs; default 0)")
    p.add_argument("--max-gpus", type=int, help="with --rate: most GPUs of the plan (an LLMServe's scaling.maxGPUs); "
                   "over it the pools shrink and the plan is marked infeasible (default: no bound)")
    p.add_argument("--max-model-len", type=int, help="the engines' --max-model-len, tokens: every TP planned must "
                   "hold one such sequence in its KV cache (default 8192, or the LLMServe's engine.maxModelLen)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


@dataclass(frozen=True)
class _Inputs:
    """What the plan is made with: each a flag's value, else the LLMServe's (``--llmserve``), else the default.

    Attributes:
        name: the LLMServe's ``metadata.name`` (None without ``--llmserve``).
        mode: ``Disaggregated``, ``Unified`` or ``Auto`` (the concurrency forms plan P and D pools whatever it is).
        min_gpus, max_gpus: the GPU budget of a rate's plan (0 and :data:`NO_GPU_BOUND` without one).
    """

    name: str | None
    profile: PerformanceProfile
    slo: SLOSpec
    mode: str
    tp_prefill: int | None
    tp_decode: int | None
    tp_unified: int | None
    min_gpus: int
    max_gpus: int
    settings: PlannerSettings


def _pick(flag: Any, from_spec: Any, default: Any) -> Any:
    """The flag's value if given, else the LLMServe's, else ``default``."""
    if flag is not None:
        return flag
    return from_spec if from_spec is not None else default


def _check(args: argparse.Namespace) -> None:
    """Refuse flags that are out of range or do not apply, before anything is read (each a one-line error)."""
    for name in ("isl", "osl", "rate", "concurrency", "decode_concurrency", "ttft_ms", "tpot_ms"):
        v = getattr(args, name)
        if v is not None and not (math.isfinite(v) and v > 0):
            raise ValueError(f"--{name.replace('_', '-')} must be a positive number, got {v}")
    if args.percentile is not None and not 0 < args.percentile <= 100:
        raise ValueError(f"--percentile must be in (0, 100], got {args.percentile}")
    if args.min_gpus is not None and args.min_gpus < 0:
        raise ValueError(f"--min-gpus must be >= 0, got {args.min_gpus}")
    if args.max_model_len is not None and args.max_model_len < 1:
        raise ValueError(f"--max-model-len must be a positive number of tokens, got {args.max_model_len}")
    if args.max_gpus is not None and args.max_gpus < 1:
        raise ValueError(f"--max-gpus must be >= 1, got {args.max_gpus}")
    if args.rate is None and (args.min_gpus is not None or args.max_gpus is not None):
        raise ValueError("--min-gpus and --max-gpus bound the planner of --rate; --concurrency and "
                         "--decode-concurrency size the pools for a count given, without a budget")
    if args.rate is None and args.mode not in (None, Mode.DISAGGREGATED.value):
        raise ValueError(f"--mode {args.mode} plans for --rate; --concurrency and --decode-concurrency size P and D pools")
    if args.profile is None and args.llmserve is None:
        raise ValueError("--profile is required (a file or a built-in name), or --llmserve naming one")


def _inputs(args: argparse.Namespace) -> _Inputs:
    """The flags resolved against the LLMServe of ``--llmserve`` (module doc).

    Raises:
        SpecError: the LLMServe file is unreadable or invalid.
        ProfileError: the profile named (by the flag or the LLMServe) is unknown, or is a ConfigMap without
            ``--profile``.
        ValueError: the GPU budget resolved has minGPUs above maxGPUs.
    """
    spec: LLMServeSpec | None = None
    name = None
    if args.llmserve is not None:
        res = load_llmserve(args.llmserve)
        spec, name = res.spec, res.metadata.name
    if spec is not None:
        profile = resolve_spec_profile(spec, args.llmserve, args.profile)
    else:
        profile = resolve_profile(args.profile)
    base = spec.slo if spec is not None else SLOSpec()  # SLOSpec's defaults: TTFT 2 s and TPOT 80 ms at P90
    slo = SLOSpec(ttft_ms=_pick(args.ttft_ms, base.ttft_ms, None), tpot_ms=_pick(args.tpot_ms, base.tpot_ms, None),
                  percentile=_pick(args.percentile, base.percentile, None))
    sc = spec.scaling if spec is not None else None
    mode = _pick(args.mode, spec.mode.value if spec is not None else None, Mode.DISAGGREGATED.value)
    if args.rate is None:
        mode = Mode.DISAGGREGATED.value  # the concurrency forms size P and D pools (DOPD Alg. 2)
    if args.tp_unified is not None and mode == Mode.DISAGGREGATED.value:
        raise ValueError("--tp-unified pins the unified pool of --mode Unified or Auto (with --rate)")
    if mode == Mode.UNIFIED.value and (args.tp_prefill is not None or args.tp_decode is not None):
        raise ValueError("--tp-prefill and --tp-decode pin P and D pools; --mode Unified plans one unified pool "
                         "(--tp-unified)")
    lo = _pick(args.min_gpus, sc.min_gpus if sc is not None else None, 0)
    hi = _pick(args.max_gpus, sc.max_gpus if sc is not None else None, NO_GPU_BOUND)
    if lo > hi:
        raise ValueError(f"minGPUs {lo} exceeds maxGPUs {hi} (--min-gpus / --max-gpus, or the LLMServe's)")
    settings = PlannerSettings.from_spec(spec) if spec is not None else PlannerSettings()
    if args.max_model_len is not None:
        settings = replace(settings, max_model_len=args.max_model_len)
    # a pin of the other mode's pools does not apply (an LLMServe in Unified mode may keep tpPrefill set)
    return _Inputs(
        name=name, profile=profile, slo=slo, mode=mode,
        tp_prefill=_pick(args.tp_prefill, sc.tp_prefill if sc is not None else None, None),
        tp_decode=_pick(args.tp_decode, sc.tp_decode if sc is not None else None, None),
        tp_unified=_pick(args.tp_unified, sc.tp_unified if sc is not None else None, None),
        min_gpus=lo, max_gpus=hi, settings=settings,
    )


#: The LLMServe fields the planner's errors name, and the flag of this command that sets each.
_FLAG_OF_FIELD = {
    "spec.engine.maxModelLen": "max_model_len", "spec.scaling.tpPrefill": "tp_prefill",
    "spec.scaling.tpDecode": "tp_decode", "spec.scaling.tpUnified": "tp_unified",
}


def _in_flags(err: PlanningError, args: argparse.Namespace) -> PlanningError:
    """``err`` with the LLMServe fields it names replaced by this command's flags where the value came from a flag,
    or from the default because no ``--llmserve`` was given (the planner names the fields the operator reads)."""
    text = str(err)
    for field, dest in _FLAG_OF_FIELD.items():
        if getattr(args, dest) is not None or args.llmserve is None:
            text = text.replace(field, "--" + dest.replace("_", "-"))
    return err if text == str(err) else PlanningError(text)


def _clean(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def _plan_dict(p: Plan, profile_name: str) -> dict[str, Any]:
    """One plan as ``fulcrum plan`` prints it (``--json``): pools, TPs, times, feasibility, the inputs (NaN and
    infinities as null)."""
    return _clean({
        "mode": p.mode, "ratio": p.ratio, "balanced_ratio": p.balanced_ratio, "prefill_replicas": p.prefill.replicas,
        "decode_replicas": p.decode.replicas, "unified_replicas": p.unified.replicas,
        "decode_concurrency": p.decode_concurrency, "tp_prefill": p.prefill.tp, "tp_decode": p.decode.tp,
        "tp_unified": p.unified.tp, "gpus": p.gpus, "feasible": p.feasible, "expected_ttft_s": p.expected_ttft_s,
        "t_p_s": p.t_p_s, "t_d_s": p.t_d_s, "ultra_short_tokens": p.routing.ultra_short_tokens,
        "long_request_tokens": p.routing.long_request_tokens, "batch_timeout_s": p.routing.batch_timeout_s,
        "notes": list(p.notes), "slo_infeasible": [_clean(f.as_dict()) for f in p.slo_infeasible],
        "inputs": _clean({**{k: v for k, v in p.inputs.items() if k != "slo_infeasible"}, "profile": profile_name}),
    })


def run(args: argparse.Namespace) -> int:
    _check(args)
    got = _inputs(args)
    try:
        return _run(args, got)
    except PlanningError as err:
        raise _in_flags(err, args) from err


def _run(args: argparse.Namespace, got: _Inputs) -> int:
    profile, slo = got.profile, got.slo
    if args.rate is not None:
        workload = WorkloadEstimate.from_means(args.rate, args.isl, args.osl)
        lo, hi, settings = got.min_gpus, got.max_gpus, got.settings
        plans: dict[str, Plan] = {}
        if got.mode != Mode.UNIFIED.value:
            plans[Mode.DISAGGREGATED.value] = plan_disaggregated(
                workload, profile, slo, tp_prefill=got.tp_prefill, tp_decode=got.tp_decode, min_gpus=lo,
                max_gpus=hi, settings=settings)
        unified_skipped: str | None = None
        if got.mode != Mode.DISAGGREGATED.value:
            try:
                plans[Mode.UNIFIED.value] = plan_unified(workload, profile, slo, tp_unified=got.tp_unified,
                                                         min_gpus=lo, max_gpus=hi, settings=settings)
            except PlanningError as err:
                if got.mode == Mode.UNIFIED.value:
                    raise
                unified_skipped = str(err)  # Auto plans Disaggregated alone, as fulcrum.ratio.planner.plan_modes
        # as fulcrum.ratio.planner.plan in Auto mode: feasible first, then fewer GPUs, a tie to Disaggregated
        p = min(plans.values(), key=lambda x: (not x.feasible, x.gpus, x.mode != Mode.DISAGGREGATED.value))
        out: dict[str, Any] = _plan_dict(p, profile.name)
        if got.mode == Mode.AUTO.value:
            out["plans"] = {mode: _plan_dict(x, profile.name) for mode, x in plans.items()}
            if unified_skipped is not None:
                out["unified_skipped"] = unified_skipped
    else:
        r = plan_ratio(profile, args.isl, args.osl, tp_prefill=got.tp_prefill, tp_decode=got.tp_decode,
                       tpot_slo_s=slo.tpot_ms / 1e3, decode_concurrency=args.decode_concurrency,
                       concurrency=args.concurrency, settings=got.settings)
        c = r.capacity
        out = {
            "ratio": r.ratio, "prefill_replicas": r.prefill_replicas, "decode_replicas": r.decode_replicas,
            "decode_concurrency": r.decode_concurrency, "tp_prefill": r.tp_prefill, "tp_decode": r.tp_decode,
            "gpus": r.prefill_replicas * r.tp_prefill + r.decode_replicas * r.tp_decode,
            "t_p_s": r.t_p_s, "t_d_s": r.t_d_s,
            "inputs": _clean({
                "profile": profile.name, "isl": args.isl, "osl": args.osl, "concurrency": args.concurrency,
                "decode_concurrency_given": args.decode_concurrency, "context_tokens": c.context_tokens,
                "v_mem_bytes": c.v_mem_bytes, "v_bw_bytes": c.v_bw_bytes, "cc_mem": c.cc_mem, "cc_bw": c.cc_bw,
                "cc_graph": c.cc_graph, "cc_slo": c.cc_slo, "cc_limited_by": c.limited_by,
            }),
        }
    out = _clean(out)
    if args.json:
        print(json.dumps(out, indent=2, allow_nan=False))
        return 0
    if got.name is not None or args.llmserve is not None:
        budget = f"GPUs {got.min_gpus}–{got.max_gpus}" if args.rate is not None else "no GPU budget (a count given)"
        print(f"LLMServe {got.name or args.llmserve}: mode {got.mode}, TTFT {slo.ttft_ms:g} ms and TPOT "
              f"{slo.tpot_ms:g} ms at P{slo.percentile:g}, {budget}")
    print(f"profile {profile.name}: ISL {args.isl:g} / OSL {args.osl:g} tokens")
    infeasible_lines = [f.message() for f in p.slo_infeasible] if args.rate is not None else []
    for line in infeasible_lines:
        print(f"warning: SLO infeasible: {line}")
    if "plans" in out:
        both = ", ".join(f"{mode} {x['gpus']} GPUs{'' if x['feasible'] else ' (infeasible)'}"
                         for mode, x in out["plans"].items())
        print(f"  Auto: {both} → {out['mode']}")
        if "unified_skipped" in out:
            print(f"  Auto: no Unified plan: {out['unified_skipped']}")
    if out.get("mode") == Mode.UNIFIED.value:
        print(f"  unified instances  {out['unified_replicas']} × TP{out['tp_unified']}  "
              f"(cc = {out['decode_concurrency']} requests each)")
    else:
        ratio = out["ratio"]
        print(f"  P/D ratio          {ratio:.3f}" if ratio is not None else "  P/D ratio          n/a")
        print(f"  prefill instances  {out['prefill_replicas']} × TP{out['tp_prefill']}")
        print(f"  decode instances   {out['decode_replicas']} × TP{out['tp_decode']}  "
              f"(cc_d = {out['decode_concurrency']} requests each)")
    print(f"  GPUs               {out['gpus']}")
    step = "decode step" if out.get("mode") != Mode.UNIFIED.value else "step (decode with prefill chunks)"
    print(f"  t_p = {out['t_p_s'] * 1e3:.1f} ms per prefill, t_d = {out['t_d_s'] * 1e3:.1f} ms per {step}")
    for k, v in out["inputs"].items():
        print(f"    {k:<24} {v:.4g}" if isinstance(v, float) else f"    {k:<24} {v}")
    for note in out.get("notes", []):
        if note not in infeasible_lines:
            print(f"  note: {note}")
    return 0
