"""``fulcrum profile``: measure a running OpenAI-compatible engine (vLLM) and write a performance profile.

TTFT over an ISL sweep (one request at a time, ``max_tokens=1``, prompts of exact token lengths from the
engine's ``/tokenize``) and TPOT over a (batch, context) grid (``batch`` concurrent streamed requests with
``ignore_eos``; median inter-token gap in the steady state), each point ``--repeats`` times (median kept).
Failed points are retried, then reported and skipped; points beyond ``max_model_len`` are dropped with a
warning. Memory facts come from flags, ``--model-path`` and the engine's ``/metrics`` (docs/profiles.md).

Writes the profile YAML (``--out``; loads with ``fulcrum plan --profile FILE``) and, with ``--configmap NAME``,
a v1 ConfigMap holding it under ``profile.yaml`` (``--configmap-out FILE``, default standard output).

With ``--step-table FILE`` it runs the offline mode of the SLO-aware scheduler's step latency table instead
(Libra Alg. 2, docs/scheduler.md): the engine must run ``--scheduler-cls
fulcrum.worker.slo_scheduler.SLOAwareScheduler`` with ``FULCRUM_SCHEDULER_METRICS_PORT`` and no
``FULCRUM_TPOT_SLO_MS``; mixed loads over ``--step-prefill`` × ``--step-decodes`` × ``--step-contexts`` make it
record every step, and the table it recorded (read from ``--scheduler-metrics``) is written as JSON, ready for
``FULCRUM_STEP_TABLE``. A composition whose mixed step is missing is rerun with a larger decode cap, ``--retries``
times at most (default 4 in this mode). Each composition has a wall-clock budget (``--point-timeout-s``, default 2 ×
``--request-timeout-s``); one that spends it, or whose request times out, is abandoned, and ``--stop-after-timeouts``
in a row stop the run (exit 1); a composition that fails otherwise (an HTTP error, no mixed step after every
rerun) ends it too (exit 1). A run that ends early once a composition was sent (those, or Ctrl-C: exit 130) reads
the table the engine recorded so far and writes it to ``<name>.partial.json`` beside ``--step-table``, marked
partial (top-level ``partial``, ``stopped``, ``note`` and ``notMeasured``, which the table loader ignores); one line
says why, and where, or that nothing was kept and why.

Each point has a wall-clock budget (``--point-timeout-s``, default ``(--repeats + 1) × --request-timeout-s``):
when it is spent the point is abandoned and reported (kept if some repeats were measured, else skipped). After
``--stop-after-timeouts`` points in a row failed by timeout or a refused connection (default 3; 0 = never) the run
stops: the engine stopped answering.

A run that ends early — Ctrl-C, or the engine stopped answering — keeps what it measured: when that is enough
for a profile (2 ISLs, a complete 2 × 2 decode grid) it is written to ``<out>.partial.yaml`` beside ``--out``
(an older ``--out`` is left as it was; ``-``: standard output), marked partial (a comment, ``source`` and the
``measurement`` section's ``partial``, ``stopped`` and ``notMeasured``), and one line says where; otherwise one
line says that nothing was kept and why. No ConfigMap is rendered for a partial profile. A second Ctrl-C while
it is written aborts.

Exit codes: 0 written; 1 the run measured too little for a profile (fewer than 2 points on an axis; the
message says which points failed and why), or the engine stopped answering (a partial profile may have been
written), or (``--step-table``) a composition failed (a partial step table may have been written); 2 bad input or
an unreachable endpoint; 130 interrupted (Ctrl-C; a partial profile may have been written).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from fulcrum.commands import check_writable_file
from fulcrum.errors import FulcrumError, ProfileError
from fulcrum.worker.profiler import (
    GPU_PRESETS,
    MeasureLog,
    Measurements,
    MemoryFacts,
    ProfileGrid,
    assemble_profile,
    dump_yaml,
    measure,
    model_dir_facts,
    partial_note,
    profile_document,
    render_configmap,
    render_profile_yaml,
    resolve_memory,
)

if TYPE_CHECKING:  # the step-table mode imports its module when it runs
    from fulcrum.worker.step_profiler import StepLog

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Register ``fulcrum profile`` on ``sub`` (from ``ArgumentParser.add_subparsers``)."""
    p = sub.add_parser("profile", help="measure a running engine and write a performance profile",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="base URL of the engine, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="served model name (as /v1/models lists it)")
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel size of the measured engine (a label)")
    p.add_argument("--isl", default="128,256,512,1024,2048", help="ISLs of the TTFT sweep, tokens, comma-separated")
    p.add_argument("--batch", default="1,2,4,8,16", help="batch sizes of the TPOT grid, comma-separated")
    p.add_argument("--context", default="128,512,1024,2048", help="mean contexts of the TPOT grid, tokens, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="measurements per point, median kept (default 3)")
    p.add_argument("--decode-tokens", type=int, default=64, help="output tokens per TPOT request (default 64)")
    p.add_argument("--retries", type=int,
                   help="extra attempts after a failed measurement (default 2); with --step-table: reruns of a "
                        "composition whose mixed step is missing, each with twice the decode cap (default 4)")
    p.add_argument("--retry-backoff-s", type=float, default=0.5, help="pause before retry k: k × this, s (default 0.5)")
    p.add_argument("--request-timeout-s", type=float, default=300.0, help="limit per request or batch, s (default 300)")
    p.add_argument("--point-timeout-s", type=float,
                   help="wall-clock budget of one point (every repeat and retry), s; when spent the point is "
                        "abandoned (default (--repeats + 1) × --request-timeout-s); with --step-table: of one "
                        "composition (every rerun; default 2 × --request-timeout-s)")
    p.add_argument("--stop-after-timeouts", type=int, default=3, metavar="N",
                   help="stop the run, keeping what was measured, after N points (--step-table: compositions) in a "
                        "row failed by timeout or, for points, a refused connection (the engine stopped answering; default 3, "
                        "0 = never)")
    p.add_argument("--warmup", type=int, default=1, help="unrecorded warm-up requests (default 1)")
    p.add_argument("--out", default="profile.yaml", help="profile file to write, .yaml (default profile.yaml; - = stdout)")
    p.add_argument("--name", help="profile name (default <model>-tp<tp>, made a valid name)")
    p.add_argument("--configmap", metavar="NAME", help="also render a v1 ConfigMap NAME with key profile.yaml")
    p.add_argument("--configmap-out", metavar="FILE", help="where the ConfigMap goes (default stdout)")
    p.add_argument("--namespace", help="namespace of the ConfigMap (default: none, kubectl's current)")
    mem = p.add_argument_group("memory facts (flags win; else --model-path; else the engine's /metrics)")
    mem.add_argument("--gpu", help=f"GPU preset for type, memory and bandwidth: {', '.join(GPU_PRESETS)}")
    mem.add_argument("--gpu-type", help="GPU type label, e.g. H100 (default: --gpu)")
    mem.add_argument("--gpu-memory-gib", type=float, help="memory per GPU, GiB")
    mem.add_argument("--hbm-bandwidth-gbps", type=float, help="memory bandwidth per GPU, GB/s")
    mem.add_argument("--weight-gib", type=float, help="model weights, whole model, GiB")
    mem.add_argument("--kv-bytes-per-token", type=float, help="KV cache bytes per token, whole model")
    mem.add_argument("--activation-reserve-gib", type=float,
                     help="per-GPU reserve M' (default: calibrated to the engine's reported KV capacity, else 4)")
    mem.add_argument("--cuda-graph-max-batch", type=int, help="largest captured decode batch cc_g (default 512)")
    mem.add_argument("--model-path", type=Path, help="local model folder: weights from file sizes, KV bytes from config.json")
    steps = p.add_argument_group("step latency table of the SLO-aware scheduler (offline mode; docs/scheduler.md)")
    steps.add_argument("--step-table", metavar="FILE", help="write the scheduler's step latency table (JSON) instead of a profile")
    steps.add_argument("--scheduler-metrics", metavar="URL",
                       help="the engine core's scheduler metrics, http://HOST:$FULCRUM_SCHEDULER_METRICS_PORT/metrics")
    steps.add_argument("--step-prefill", default="64,256,1024", help="prefill tokens beside the decodes, comma-separated")
    steps.add_argument("--step-decodes", default="1,4,16", help="running decodes, comma-separated")
    steps.add_argument("--step-contexts", default="128,1024", help="decode contexts, tokens, comma-separated")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _run_step_table(args: argparse.Namespace) -> int:
    """The offline mode of the step latency table (Libra Alg. 2): sweep mixed loads, write the recorded table.

    Each composition has a wall-clock budget of ``--point-timeout-s`` (default 2 × ``--request-timeout-s``: the
    first try may use a whole request timeout, plus one rerun's worth); after ``--stop-after-timeouts``
    compositions in a row failed by timeout the run stops. A composition whose mixed step is missing is rerun
    ``--retries`` times at most (default 4). A run that ends early once a composition was sent (Ctrl-C: 130; the
    engine stopped answering, or a composition failed: 1) keeps what the engine recorded
    (:func:`_keep_partial_steps`); one that fails before (bad flags, an unreachable engine) raises (exit 2)."""
    from fulcrum.worker.step_profiler import StepLog, profile_steps

    if not args.scheduler_metrics or not args.scheduler_metrics.startswith(("http://", "https://")):
        raise ValueError("--step-table needs --scheduler-metrics http://HOST:PORT/metrics (the engine core's "
                         "FULCRUM_SCHEDULER_METRICS_PORT)")
    if Path(args.step_table).suffix.lower() != ".json":
        raise ValueError(f"--step-table must be a .json file, got {args.step_table!r}")
    # --request-timeout-s, --point-timeout-s, --stop-after-timeouts and --retries are checked by profile_steps,
    # before anything is sent (a bad --request-timeout-s is named before the budget derived from it)
    budget = args.point_timeout_s if args.point_timeout_s is not None else 2 * args.request_timeout_s
    retries = args.retries if args.retries is not None else _STEP_RETRIES
    check_writable_file(args.step_table, "--step-table")

    def warn(msg: str) -> None:
        print(f"fulcrum profile: warning: {msg}", file=sys.stderr)

    log = StepLog()  # filled as compositions finish: Ctrl-C keeps what the engine recorded
    try:
        table = asyncio.run(profile_steps(
            args.url, args.scheduler_metrics, model=args.model,
            prefill_tokens=_ints("step-prefill", args.step_prefill),
            decode_counts=_ints("step-decodes", args.step_decodes),
            contexts=_ints("step-contexts", args.step_contexts),
            timeout_s=args.request_timeout_s, retries=retries, point_timeout_s=budget,
            stop_after_timeouts=args.stop_after_timeouts, log=log, warn=warn,
        ))
    except KeyboardInterrupt:
        # asyncio.run has cancelled the run (its decodes are cancelled); a second Ctrl-C from here on aborts
        log.stopped = "interrupted (Ctrl-C)"
        return _keep_partial_steps(args, log, 130)
    except FulcrumError as err:
        # the engine stopped answering (StepProfileStopped), a composition failed (an HTTP error, no mixed step
        # after every rerun) or the table could not be read at the end; before anything was sent (an unreachable
        # engine, a model it does not serve) it stays an error of the command (exit 2)
        if not log.sent:
            raise
        log.stopped = log.stopped or str(err)
        return _keep_partial_steps(args, log, 1)
    # what table.save writes (the suffix is .json), through _write: a write that fails or is interrupted leaves an
    # older --step-table whole and no temporary file beside it
    _write(args.step_table, json.dumps(table.to_dict(), indent=1), "--step-table", announce=False,
           prefix="fulcrum-step-table-")
    abandoned = (f"; {len(log.abandoned)} of {len(log.compositions)} compositions abandoned by timeout, their mixed "
                 "steps may be missing" if log.abandoned else "")
    print(f"wrote {args.step_table}: {len(table.to_dict().get('entries', []))} step buckets measured{abandoned}",
          file=sys.stderr)
    return 0


_STEP_RETRIES = 4
"""``--retries`` of ``--step-table`` when the flag is not given: reruns of a composition whose mixed step is missing
(``profile_steps``' default; the profile mode's default is :class:`ProfileGrid`'s, 2)."""


def _keep_partial_steps(args: argparse.Namespace, log: StepLog, rc: int) -> int:
    """A step-table run that ended early (``log.stopped``, a :class:`~fulcrum.worker.step_profiler.StepLog`): read
    the table the engine recorded so far from ``--scheduler-metrics`` and write it beside ``--step-table`` as
    ``<name>.partial.json``, marked partial (top-level ``partial``, ``stopped``, ``note`` and ``notMeasured``, which
    the table loader ignores: JSON has no comments); print one line saying where, or that nothing was kept and
    why. Returns ``rc`` (130 interrupted, 1 the engine stopped answering or a composition failed)."""
    from fulcrum.worker.step_profiler import read_table

    head = "interrupted" if rc == 130 else "error"
    if not log.sent:
        print(f"fulcrum profile: {head}: {log.stopped}; nothing kept: no composition was sent", file=sys.stderr)
        return rc
    try:
        table = asyncio.run(read_table(args.scheduler_metrics, allow_empty=True))
    except FulcrumError as err:
        print(f"fulcrum profile: {head}: {log.stopped}; nothing kept: {err}", file=sys.stderr)
        return rc
    if not len(table):
        print(f"fulcrum profile: {head}: {log.stopped}; nothing kept: the engine has recorded no step yet",
              file=sys.stderr)
        return rc
    note = log.partial_note()
    text = json.dumps({**log.partial_marker(), **table.to_dict()}, indent=1)
    path = _partial_path(args.step_table)
    try:
        _write(path, text, "--step-table", announce=False, prefix="fulcrum-step-table-")
    except OSError as err:  # kept in the temporary folder; the message names the file
        print(f"fulcrum profile: {head}: {log.stopped}; partial step table not written to {path}: {err}",
              file=sys.stderr)
        return rc
    print(f"fulcrum profile: {head}: {log.stopped}; partial step table written to {path} ({len(table)} step "
          f"buckets); {note}", file=sys.stderr)
    return rc


def _ints(flag: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--{flag}: expected comma-separated integers, got {text!r}") from None
    return tuple(sorted(set(values)))


def _positive(flag: str, v: float | None) -> None:
    if v is not None and not (math.isfinite(v) and v > 0):
        raise ValueError(f"--{flag} must be a positive number, got {v}")


def _memory_flags(args: argparse.Namespace) -> MemoryFacts:
    for flag in ("gpu_memory_gib", "hbm_bandwidth_gbps", "weight_gib", "kv_bytes_per_token"):
        _positive(flag.replace("_", "-"), getattr(args, flag))
    if args.activation_reserve_gib is not None and not (math.isfinite(args.activation_reserve_gib)
                                                        and args.activation_reserve_gib >= 0):
        raise ValueError(f"--activation-reserve-gib must be >= 0, got {args.activation_reserve_gib}")
    if args.cuda_graph_max_batch is not None and args.cuda_graph_max_batch < 1:
        raise ValueError(f"--cuda-graph-max-batch must be >= 1, got {args.cuda_graph_max_batch}")
    mem_gib, bw = args.gpu_memory_gib, args.hbm_bandwidth_gbps
    gpu_type = args.gpu_type
    if args.gpu is not None:
        preset = next((k for k in GPU_PRESETS if k.lower() == args.gpu.lower()), None)
        if preset is None:
            raise ValueError(f"--gpu {args.gpu!r}: unknown preset; choose one of {', '.join(GPU_PRESETS)} "
                             "or pass --gpu-memory-gib and --hbm-bandwidth-gbps")
        mem_gib = mem_gib if mem_gib is not None else GPU_PRESETS[preset][0]
        bw = bw if bw is not None else GPU_PRESETS[preset][1]
        gpu_type = gpu_type or preset
    return MemoryFacts(
        gpu_type=gpu_type, gpu_memory_gib=mem_gib, hbm_bandwidth_gbps=bw,
        weight_bytes=args.weight_gib * float(1 << 30) if args.weight_gib is not None else None,
        kv_bytes_per_token=args.kv_bytes_per_token, activation_reserve_gib=args.activation_reserve_gib,
        cuda_graph_max_batch=args.cuda_graph_max_batch,
    )


def _default_name(model: str, tp: int) -> str:
    base = re.sub(r"[^a-z0-9.-]+", "-", model.lower().rsplit("/", 1)[-1]).strip("-.") or "profile"
    return f"{base}-tp{tp}"


def _save_or_keep(path: str, flag: str, prefix: str, save: Callable[[Path], None]) -> None:
    """``save(path)``; when that fails, ``save`` to a new file ``<prefix>*<suffix>`` in the temporary folder instead,
    so an hour of measuring is not lost.

    Raises:
        OSError: ``path`` cannot be written (its folder vanished or became read-only after the up-front check); the
            message names the flag and the file the result was saved to.
    """
    target = Path(path)
    try:
        save(target)
    except OSError as err:
        fd, saved = tempfile.mkstemp(prefix=prefix, suffix=target.suffix or ".yaml")
        os.close(fd)
        save(Path(saved))
        raise OSError(f"{flag} {path}: cannot write ({err.strerror or err}); saved to {saved} instead") from err


def _write(path: str, text: str, flag: str, *, announce: bool = True, prefix: str = "fulcrum-profile-") -> None:
    """Write ``text`` to ``path`` (``-``: standard output) through a sibling temporary file and a rename, so a
    failed (or interrupted) write never leaves half a file nor spoils an older one. ``announce``: print
    ``wrote PATH``; ``prefix``: of the file in the temporary folder when ``path`` cannot be written.

    Raises:
        OSError: the file cannot be written; the text is kept elsewhere (:func:`_save_or_keep`).
    """
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return

    def save(target: Path) -> None:
        tmp = target.with_name(f".{target.name}.tmp")
        try:
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(target)
        except BaseException:  # an OSError, or a second Ctrl-C: no temporary file left behind
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise

    _save_or_keep(path, flag, prefix, save)
    if announce:
        print(f"wrote {path}", file=sys.stderr)


def _partial_path(out: str) -> str:
    """Where a partial profile (or step table) goes: ``<out stem>.partial<suffix>`` beside ``--out`` (or
    ``--step-table``; ``-`` stays ``-``)."""
    if out == "-":
        return out
    p = Path(out)
    return str(p.with_name(f"{p.stem}.partial{p.suffix}"))


def _keep_partial(args: argparse.Namespace, measured: Measurements, memory_flags: MemoryFacts,
                  model_dir: tuple[float, float, str] | None, name: str, source: str, rc: int,
                  warn: Callable[[str], None]) -> int:
    """A run that ended early (``measured.stopped``): write what it measured as a partial profile beside
    ``--out`` when that is enough for a profile, and print one line saying where, or that nothing was kept and
    why. Returns ``rc`` (130 interrupted, 1 the engine stopped answering)."""
    head = "interrupted" if rc == 130 else "error"
    note = partial_note(measured)
    if not any(p.ok for p in (*measured.prefill, *measured.decode)):
        print(f"fulcrum profile: {head}: {measured.stopped}; nothing kept: no point was measured", file=sys.stderr)
        return rc
    try:
        memory = resolve_memory(memory_flags, measured.endpoint, args.tp, model_dir)
    except ProfileError as err:
        print(f"fulcrum profile: {head}: {measured.stopped}; nothing kept: {err}", file=sys.stderr)
        return rc
    try:
        assembled = assemble_profile(measured, memory.facts, name=name, model=args.model,
                                     source=f"{source}; {note}")
    except ProfileError as err:
        print(f"fulcrum profile: {head}: {measured.stopped}; nothing kept: too little measured for a profile ({err})",
              file=sys.stderr)
        return rc
    for line in assembled.notes:
        warn(line)
    text = f"# {note}\n" + render_profile_yaml(profile_document(assembled, measured, memory, args.url))
    path = _partial_path(args.out)
    where = "standard output" if path == "-" else path
    try:
        _write(path, text, "--out", announce=False)
    except OSError as err:  # kept in the temporary folder; the message names the file
        print(f"fulcrum profile: {head}: {measured.stopped}; partial profile not written to {where}: {err}",
              file=sys.stderr)
        return rc
    skipped = " (no ConfigMap: the profile is partial)" if args.configmap else ""
    print(f"fulcrum profile: {head}: {measured.stopped}; partial profile written to {where}{skipped}; {note}",
          file=sys.stderr)
    return rc


def run(args: argparse.Namespace) -> int:
    """Validate the flags, measure, assemble and write. Returns the exit code (see the module doc).

    Raises:
        ProfileError, ValueError, OSError: bad input, unreachable endpoint, unwritable output (exit 2 via the CLI).
    """
    if args.tp < 1:
        raise ValueError(f"--tp must be >= 1, got {args.tp}")
    if not args.url.startswith(("http://", "https://")):
        raise ValueError(f"--url must start with http:// or https://, got {args.url!r}")
    if args.step_table:
        return _run_step_table(args)
    if args.out != "-" and Path(args.out).suffix.lower() not in (".yaml", ".yml"):
        raise ValueError(f"--out must be a .yaml file (or -), got {args.out!r}")
    if args.configmap_out and not args.configmap:
        raise ValueError("--configmap-out needs --configmap NAME")
    for flag in ("retry_backoff_s", "request_timeout_s", "point_timeout_s"):
        if getattr(args, flag) is not None and not math.isfinite(getattr(args, flag)):
            raise ValueError(f"--{flag.replace('_', '-')} must be a finite number of seconds, got {getattr(args, flag)}")
    grid = ProfileGrid(isl=_ints("isl", args.isl), batch=_ints("batch", args.batch),
                       context=_ints("context", args.context), repeats=args.repeats,
                       decode_tokens=args.decode_tokens,
                       retries=args.retries if args.retries is not None else ProfileGrid.retries,
                       retry_backoff_s=args.retry_backoff_s, request_timeout_s=args.request_timeout_s,
                       warmup=args.warmup, point_timeout_s=args.point_timeout_s,
                       stop_after_timeouts=args.stop_after_timeouts)
    flags = _memory_flags(args)
    name = args.name or _default_name(args.model, args.tp)
    if args.configmap:
        render_configmap("", args.configmap)  # validates the name before an hour of measuring
    model_dir = None
    if args.model_path is not None:
        model_dir = model_dir_facts(args.model_path)
    # fail fast on missing memory facts: the endpoint may still supply some, so check what flags alone lack
    # after probing (inside measure); a run that cannot possibly complete is refused here
    if flags.gpu_memory_gib is None or flags.hbm_bandwidth_gbps is None:
        raise ProfileError("memory facts unknown: pass --gpu (a preset) or --gpu-memory-gib and --hbm-bandwidth-gbps")
    if flags.weight_bytes is None and model_dir is None:
        raise ProfileError("memory facts unknown: pass --weight-gib or --model-path")
    # an output that cannot be written fails now, not after an hour of measuring
    for flag, out in (("--out", args.out), ("--configmap-out", args.configmap_out)):
        if out and out != "-":
            check_writable_file(out, flag)

    def warn(msg: str) -> None:
        tqdm.write(f"fulcrum profile: warning: {msg}", file=sys.stderr)  # above the progress bar

    log = MeasureLog()  # filled as points finish: Ctrl-C keeps what was measured
    try:
        measured = asyncio.run(measure(args.url, args.model, args.tp, grid, progress=not args.no_progress, warn=warn,
                                       log=log))
        rc_early = 1
    except KeyboardInterrupt:
        # asyncio.run has cancelled the run (its requests are closed); a second Ctrl-C from here on aborts
        if log.endpoint is None:
            print("fulcrum profile: interrupted; nothing kept: no point was measured", file=sys.stderr)
            return 130
        measured = log.measurements(args.tp, grid, stopped="interrupted (Ctrl-C)")
        rc_early = 130
    if model_dir is not None and measured.endpoint.cache_dtype not in (None, "auto"):
        model_dir = model_dir_facts(args.model_path, measured.endpoint.cache_dtype)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    source = (f"fulcrum profile of {args.url} (model {args.model}, TP {args.tp}) at {stamp}; "
              f"median of {grid.repeats} repeat(s) per point")
    if measured.stopped:
        return _keep_partial(args, measured, flags, model_dir, name, source, rc_early, warn)
    memory = resolve_memory(flags, measured.endpoint, args.tp, model_dir)
    try:
        assembled = assemble_profile(measured, memory.facts, name=name, model=args.model, source=source)
    except ProfileError as err:
        print(f"fulcrum profile: error: {err}", file=sys.stderr)
        return 1
    for note in assembled.notes:
        warn(note)
    text = render_profile_yaml(profile_document(assembled, measured, memory, args.url))
    _write(args.out, text, "--out")
    if args.configmap:
        cm = render_configmap(text, args.configmap, args.namespace)
        _write(args.configmap_out or "-", dump_yaml(cm), "--configmap-out")
    p = assembled.profile
    ok_pre = sum(1 for x in measured.prefill if x.ok)
    ok_dec = sum(1 for x in measured.decode if x.ok)
    print(f"profile {p.name}: {ok_pre}/{len(measured.prefill)} ISL points, {ok_dec}/{len(measured.decode)} "
          f"decode points measured; TTFT {p.prefill[args.tp].seconds[0] * 1e3:.1f}–"
          f"{p.prefill[args.tp].seconds[-1] * 1e3:.1f} ms; KV capacity {p.kv_capacity_tokens(args.tp):.0f} tokens",
          file=sys.stderr)
    return 0
