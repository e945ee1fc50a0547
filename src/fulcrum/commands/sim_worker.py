"""``fulcrum sim-worker``: an OpenAI-compatible engine emulator timed by a performance profile (no GPU).

It batches like vLLM (continuous batching, chunked prefill under a token budget, a KV cache in blocks with
preemption) and sleeps each step for the time the profile gives, so a router, an operator or a benchmark sees
the latencies of the profiled model and GPU. It speaks vLLM's NIXL ``kv_transfer_params`` protocol with other
sim-workers (KV pulled over HTTP), serves vLLM's metric names on ``/metrics``, registers in etcd with
``--etcd``, and drains on SIGTERM. See docs/sim-worker.md.

Identity (read here, once): instance id = env ``POD_NAME`` (else the host name), address = env ``POD_IP`` (else
127.0.0.1), namespace = ``--namespace`` or env ``POD_NAMESPACE`` (else ``default``), LLMServe = ``--llmserve`` or
env ``FULCRUM_LLMSERVE``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import socket
from typing import Any

from fulcrum.commands import bind_host

__all__ = ["add_parser", "run"]


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite positive number, got {text}")
    return v


def add_parser(sub: Any) -> None:
    p = sub.add_parser("sim-worker", help="run an OpenAI-compatible engine emulator timed by a profile",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", required=True,
                   help="performance profile: a built-in name (dopd-llama70b-fp8-h100, splitwise-llama2-70b-h100) "
                        "or a YAML/JSON/CSV file")
    p.add_argument("--tp", type=_positive_int, default=None,
                   help="tensor-parallel size whose tables time the engine (default: the profile's smallest decode "
                        "TP; an unmeasured TP uses the nearest measured one)")
    p.add_argument("--model", default=None, help="served model name (default: the profile's model)")
    p.add_argument("--host", default="0.0.0.0",
                   help="address to listen on (default 0.0.0.0; a wildcard means $FULCRUM_BIND_HOST when set)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--role", default="both", choices=["prefill", "decode", "both"],
                   help="role published in the registry (the router assigns work by it; default both)")
    p.add_argument("--pool", default="default", help="pool (Deployment) published in the registry")
    p.add_argument("--max-num-seqs", type=_positive_int, default=256, help="most running requests (default 256)")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=8192,
                   help="tokens per engine step (default 8192)")
    p.add_argument("--kv-capacity-tokens", type=_positive_int, default=None,
                   help="KV cache capacity, tokens (default: the profile's, DOPD eq. 11)")
    p.add_argument("--block-size", type=_positive_int, default=16, help="KV block size, tokens (default 16)")
    p.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="context limit, tokens (default: min(KV capacity, 32768))")
    p.add_argument("--time-scale", type=_positive_float, default=1.0,
                   help="multiplies every emulated latency (default 1.0; tests use e.g. 0.01)")
    p.add_argument("--kv-transfer-gbps", type=_positive_float, default=50.0,
                   help="bandwidth charged for KV pulled from another worker, GB/s (default 50)")
    p.add_argument("--etcd", default="", help='etcd endpoint(s) to register in ("" = do not register)')
    p.add_argument("--nats", default=None,
                   help="NATS URL of the LLMServe's prefill queue (default: env FULCRUM_NATS_URL; unset = none): a "
                        "prefill or both worker pulls prefill jobs from it (DOPD §V-C)")
    p.add_argument("--prefill-concurrency", type=int, default=4, help="prefill jobs in hand at once (4)")
    p.add_argument("--namespace", default=None, help="namespace of the LLMServe (default: env POD_NAMESPACE)")
    p.add_argument("--llmserve", default=None, help="LLMServe name (default: env FULCRUM_LLMSERVE)")
    p.add_argument("--drain-timeout-s", type=float, default=300.0,
                   help="after SIGTERM, longest wait for in-flight requests, seconds (default 300)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fulcrum.ratio.profiles import resolve_profile
    from fulcrum.ratio.step_cost import nearest_tp
    from fulcrum.router.registry import InstanceRecord
    from fulcrum.router.registry_etcd import EtcdRegistration
    from fulcrum.worker.sim_engine import SimEngineConfig
    from fulcrum.worker.prefill_puller import PrefillPuller, Registrations
    from fulcrum.worker.sim_server import SimServerSettings, SimWorker, serve

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if not (math.isfinite(args.drain_timeout_s) and args.drain_timeout_s >= 0):
        raise ValueError(f"--drain-timeout-s must be a finite number of seconds >= 0, got {args.drain_timeout_s:g}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("fulcrum.sim_worker")
    profile = resolve_profile(args.profile)
    tp = args.tp if args.tp is not None else min(profile.decode_tps)
    for kind, measured in (("prefill", profile.prefill_tps), ("decode", profile.decode_tps)):
        used = nearest_tp(measured, tp)
        if used != tp:
            log.warning("profile %s has no %s table at TP %d: timing %s with its TP %d table",
                        profile.name, kind, tp, kind, used)
    kv = args.kv_capacity_tokens if args.kv_capacity_tokens is not None else int(profile.kv_capacity_tokens(tp))
    if kv < args.block_size:
        raise ValueError(f"profile {profile.name} leaves no KV cache at TP {tp} (the weights do not fit); "
                         f"pass --kv-capacity-tokens or a larger --tp")
    kv_whole = kv // args.block_size * args.block_size  # the engine allocates whole blocks
    max_model_len = args.max_model_len if args.max_model_len is not None else min(kv_whole, 32768)
    if max_model_len > kv_whole:
        # vLLM refuses to start so; the emulator serves what its KV cache holds, so that a plan the operator made
        # (its TP choice does not check maxModelLen against the KV cache) still runs, and says so
        log.warning("--max-model-len %d is larger than the %d tokens the KV cache holds (profile %s at TP %d): serving "
                    "with a context of %d tokens (vLLM would refuse to start: lower maxModelLen or raise the TP)",
                    max_model_len, kv_whole, profile.name, tp, kv_whole)
        max_model_len = kv_whole
    engine_config = SimEngineConfig(tp=tp, kv_capacity_tokens=kv, max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                                    time_scale=args.time_scale)
    address = os.environ.get("POD_IP") or "127.0.0.1"
    instance_id = os.environ.get("POD_NAME") or socket.gethostname()
    namespace = args.namespace or os.environ.get("POD_NAMESPACE") or "default"
    llmserve = args.llmserve or os.environ.get("FULCRUM_LLMSERVE") or ""
    model = args.model or profile.model
    advertise_port = args.port if args.port else None
    settings = SimServerSettings(model=model, engine_id=instance_id, max_model_len=max_model_len,
                                 kv_transfer_gbps=args.kv_transfer_gbps,
                                 advertise_host=address if os.environ.get("POD_IP") else None,
                                 advertise_port=advertise_port)
    registration = None
    if args.etcd:
        if not llmserve:
            raise ValueError("--etcd needs the LLMServe name: --llmserve or env FULCRUM_LLMSERVE")
        if not args.port:
            raise ValueError("--etcd needs a fixed --port (the registered URL names it)")
        record = InstanceRecord(
            id=instance_id, url=f"http://{address}:{args.port}", role=args.role, pool=args.pool, tp=tp,
            gpu_type=profile.gpu_type, nixl_host=address, nixl_port=args.port, max_concurrency=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, kv_capacity_tokens=kv, model=model,
            labels={"engine": "sim", "profile": profile.name})
        registration = EtcdRegistration(args.etcd, namespace, llmserve, record)

    nats_url = args.nats if args.nats is not None else os.environ.get("FULCRUM_NATS_URL", "")
    pull = bool(nats_url) and args.role in ("prefill", "both")
    if pull:
        if not llmserve:
            raise ValueError("--nats needs the LLMServe name: --llmserve or env FULCRUM_LLMSERVE")
        if not args.port:
            raise ValueError("--nats needs a fixed --port (the puller calls the local engine on it)")
        if args.prefill_concurrency < 1:
            raise ValueError("--prefill-concurrency must be >= 1")

    host = bind_host(args.host)
    local = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host  # where this process reaches its own server

    async def main() -> int:
        worker = SimWorker(profile, engine_config, settings)
        reg: Any = registration
        if pull:
            puller = PrefillPuller(nats_url, f"http://{local}:{args.port}", namespace=namespace, llmserve=llmserve,
                                   worker_id=instance_id, concurrency=args.prefill_concurrency)
            log.info("pulling prefill jobs from %s (%s)", nats_url, puller.key)
            reg = puller if registration is None else Registrations([registration, puller])
        return await serve(worker, host, args.port, registration=reg, drain_timeout_s=args.drain_timeout_s)

    return asyncio.run(main())
