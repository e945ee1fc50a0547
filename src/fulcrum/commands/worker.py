"""``fulcrum worker``: run a real vLLM engine (with NIXL KV transfer) under Fulcrum's supervisor.

The supervisor starts ``<vllm-python> -m vllm.entrypoints.openai.api_server ...`` as a child in its own process
group, waits until it serves (``/health``, then ``/v1/models``), registers the instance in etcd under a lease
(``--etcd``; "" = do not register), and on SIGTERM/SIGINT deregisters, drains (until the engine has no running
or waiting request, or ``--drain-timeout-s``), stops the engine and exits 0. An engine that exits on its own
makes the worker exit non-zero. docs/worker.md has the lifecycle, the ports and the images.

Ports: ``--port`` (8000) is vLLM's: the OpenAI API, ``/health`` (liveness), ``/metrics``. ``--health-port``
(8001) is the supervisor's readiness endpoint ``GET /health``: 200 while serving, 503 while starting, draining
or while vLLM's ``/health`` is not 200. ``--nixl-port`` (5600) is NIXL's side channel (KV handshakes between
engines). ``--scheduler-metrics-port`` (off) serves the SLO-aware scheduler's metrics. Each needs its own port: a
collision is refused (exit 2), and so is a health port another process holds.

Identity (read here, once): instance id = env ``POD_NAME`` (else the host name), address = env ``POD_IP`` (else
127.0.0.1), namespace = ``--namespace`` or env ``POD_NAMESPACE`` (else ``default``), LLMServe = ``--llmserve`` or
env ``FULCRUM_LLMSERVE``. Device: ``--device auto`` (the default) runs on the GPU when one is visible
(``/dev/nvidia[0-9]*`` present and ``CUDA_VISIBLE_DEVICES`` not "" or "-1"), else on the CPU.

Extra vLLM arguments follow ``--``: ``fulcrum worker --model m -- --enforce-eager --dtype float32``. They are
appended verbatim, except that a flag the worker sets itself (``--port``, ``--tensor-parallel-size``,
``--kv-transfer-config``, ...; use the worker's flag) and ``--disable-log-stats`` (it removes the
``vllm:num_requests_*`` gauges the drain waits on) are refused. Bad input exits 2 with one line.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import logging
import math
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["add_parser", "gpu_visible", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("worker", help="run a vLLM engine with NIXL: register in etcd, drain on SIGTERM",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    engine = p.add_argument_group("engine (vLLM)")
    engine.add_argument("--model", required=True, help="model path or Hugging Face id")
    engine.add_argument("--served-model-name", default="", help="name clients use (default: --model)")
    engine.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    engine.add_argument("--host", default="0.0.0.0", help="vLLM's listen address (default 0.0.0.0)")
    engine.add_argument("--port", type=int, default=8000, help="vLLM's port: OpenAI API, /health, /metrics (8000)")
    engine.add_argument("--role", default="both", choices=["prefill", "decode", "both"],
                        help="prefill (kv_producer), decode (kv_consumer) or both (kv_both, the default)")
    engine.add_argument("--max-model-len", type=int, default=None, help="context length cap, tokens")
    engine.add_argument("--block-size", type=int, default=None,
                        help="KV block size, tokens (a multiple of 32 on the CPU)")
    engine.add_argument("--max-num-seqs", type=int, default=256, help="sequences per engine step (256)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=8192,
                        help="tokens per engine step (8192); at least --max-num-seqs, and at least --max-model-len "
                             "when an extra argument turns chunked prefill off (vLLM requires both)")
    engine.add_argument("--kv-connector", default="nixl", choices=["nixl", "none"],
                        help="KV transfer between instances (default nixl)")
    engine.add_argument("--nixl-port", type=int, default=5600, help="NIXL side-channel port (5600)")
    engine.add_argument("--kv-prefix-pull", action="store_true",
                        help="NIXL bidirectional_kv_xfer: other instances may pull this engine's cached prefixes "
                             "(BanaServe prefix pulls; router policy load_aware with prefix_pull)")
    engine.add_argument("--scheduler", default="fulcrum", choices=["fulcrum", "vllm"],
                        help="fulcrum: the SLO-aware scheduler (Libra Alg. 2); vllm: vLLM's own")
    engine.add_argument("--scheduler-metrics-port", type=int, default=None,
                        help="serve the SLO-aware scheduler's fulcrum_scheduler_* metrics on this port (with "
                             "--scheduler fulcrum; default: off)")
    engine.add_argument("--tpot-slo-ms", type=float, default=None,
                        help="TPOT SLO for the SLO-aware scheduler, ms (with --scheduler fulcrum; default: the "
                             "scheduler's)")
    engine.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto (the default): cuda when a GPU is visible, else cpu")
    engine.add_argument("--vllm-python", default=None,
                        help="interpreter with vLLM installed (default: env FULCRUM_VLLM_PYTHON, else this one)")
    reg = p.add_argument_group("registration")
    reg.add_argument("--etcd", default="", help='etcd endpoint(s) host:port[,...]; "" = do not register (default)')
    reg.add_argument("--namespace", default=None, help="namespace of the LLMServe (default: env POD_NAMESPACE)")
    reg.add_argument("--llmserve", default=None, help="LLMServe name (default: env FULCRUM_LLMSERVE)")
    reg.add_argument("--pool", default="default", help="the pool this instance belongs to (default 'default')")
    reg.add_argument("--gpu-type", default="", help="GPU type published in the registration, e.g. H100")
    reg.add_argument("--nats", default=None,
                     help="NATS URL of the LLMServe's prefill queue (default: env FULCRUM_NATS_URL; unset = none): a "
                          "prefill or both worker pulls prefill jobs from it (DOPD §V-C)")
    reg.add_argument("--prefill-concurrency", type=int, default=4, help="prefill jobs in hand at once (4)")
    life = p.add_argument_group("lifecycle")
    life.add_argument("--health-port", type=int, default=8001,
                      help="supervisor readiness endpoint GET /health (8001; 0 = none)")
    life.add_argument("--drain-timeout-s", type=float, default=300.0, help="longest drain on SIGTERM, s (300)")
    life.add_argument("--kill-grace-s", type=float, default=20.0, help="SIGTERM → SIGKILL for the engine, s (20)")
    life.add_argument("--startup-timeout-s", type=float, default=1800.0,
                      help="longest wait for the engine to serve, s (1800)")
    life.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("vllm_args", nargs=argparse.REMAINDER,
                   help="-- then extra vLLM arguments, passed verbatim (flags the worker sets and --disable-log-stats "
                        "are refused)")
    p.set_defaults(func=run)


def gpu_visible() -> bool:
    """Whether this container sees an NVIDIA GPU: a ``/dev/nvidia<N>`` device node exists and
    ``CUDA_VISIBLE_DEVICES`` (when set) does not hide every device ("" or "-1")."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def _check_lifecycle(args: argparse.Namespace) -> None:
    """Refuse lifecycle flags out of range (each a one-line error naming the flag); the engine's own flags are
    checked by :class:`fulcrum.worker.vllm_args.WorkerConfig`.

    Raises:
        ValueError: ``--health-port`` outside 0..65535; ``--startup-timeout-s`` not a finite number > 0;
            ``--drain-timeout-s`` or ``--kill-grace-s`` not a finite number >= 0 (nan included).
    """
    if not 0 <= args.health_port <= 65535:
        raise ValueError(f"--health-port must be in 0..65535, got {args.health_port}")
    if not (math.isfinite(args.startup_timeout_s) and args.startup_timeout_s > 0):
        raise ValueError(f"--startup-timeout-s must be a finite number of seconds > 0, got {args.startup_timeout_s:g}")
    for flag in ("drain_timeout_s", "kill_grace_s"):
        v = getattr(args, flag)
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"--{flag.replace('_', '-')} must be a finite number of seconds >= 0, got {v:g}")
    if args.tpot_slo_ms is not None and not (math.isfinite(args.tpot_slo_ms) and args.tpot_slo_ms > 0):
        raise ValueError(f"--tpot-slo-ms must be a finite number > 0, got {args.tpot_slo_ms:g}")


def _check_health_port(args: argparse.Namespace) -> None:
    """Refuse a ``--health-port`` that another port of this worker uses (the supervisor's readiness endpoint and
    that listener could not both bind it); the engine's ports among themselves (``--port``, ``--nixl-port``,
    ``--scheduler-metrics-port``) are checked by :class:`fulcrum.worker.vllm_args.WorkerConfig`.

    Raises:
        ValueError: one line naming ``--health-port`` and the flag it collides with.
    """
    if not args.health_port:
        return
    for flag, port in (("--port", args.port), ("--nixl-port", args.nixl_port),
                       ("--scheduler-metrics-port", args.scheduler_metrics_port)):
        if port == args.health_port:
            raise ValueError(f"--health-port {args.health_port} collides with {flag} {port}: give each its own port")


def run(args: argparse.Namespace) -> int:
    _check_lifecycle(args)
    from fulcrum.router.registry import InstanceRecord
    from fulcrum.router.registry_etcd import EtcdRegistration, parse_endpoints
    from fulcrum.worker.prefill_puller import PrefillPuller, Registrations, Startable
    from fulcrum.worker.supervisor import HealthServerError, Registration, Supervisor, SupervisorSettings
    from fulcrum.worker.vllm_args import WorkerConfig, instance_record, resolve_device, vllm_argv, vllm_env

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    extra = list(args.vllm_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    pod_ip = os.environ.get("POD_IP") or "127.0.0.1"
    instance_id = os.environ.get("POD_NAME") or socket.gethostname()
    namespace = args.namespace or os.environ.get("POD_NAMESPACE") or "default"
    llmserve = args.llmserve or os.environ.get("FULCRUM_LLMSERVE") or ""
    python = args.vllm_python or os.environ.get("FULCRUM_VLLM_PYTHON") or sys.executable

    config = WorkerConfig(
        model=args.model, served_model_name=args.served_model_name, tp=args.tp, host=args.host, port=args.port,
        role=args.role, pool=args.pool, gpu_type=args.gpu_type, max_model_len=args.max_model_len,
        block_size=args.block_size, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_connector=args.kv_connector, kv_prefix_pull=args.kv_prefix_pull, nixl_host=pod_ip, nixl_port=args.nixl_port, scheduler=args.scheduler,
        tpot_slo_ms=args.tpot_slo_ms, scheduler_metrics_port=args.scheduler_metrics_port, device=resolve_device(args.device, gpu_visible=gpu_visible()),
        extra_args=tuple(extra),
    )
    _check_health_port(args)
    registration: Callable[[InstanceRecord], Registration] | None = None
    if args.etcd:
        parse_endpoints(args.etcd)  # a malformed endpoint is bad input (exit 2), not an outage to retry
        if not llmserve:
            raise ValueError("--etcd needs --llmserve (or env FULCRUM_LLMSERVE)")

    nats_url = args.nats if args.nats is not None else os.environ.get("FULCRUM_NATS_URL", "")
    local_url = "http://127.0.0.1:%d" % args.port
    puller = None
    if nats_url and args.role in ("prefill", "both"):
        if not llmserve:
            raise ValueError("--nats needs --llmserve (or env FULCRUM_LLMSERVE): the queue is the LLMServe's")
        if args.prefill_concurrency < 1:
            raise ValueError("--prefill-concurrency must be >= 1")
        puller = PrefillPuller(nats_url, local_url, namespace=namespace, llmserve=llmserve, worker_id=instance_id,
                               concurrency=args.prefill_concurrency)
    if args.etcd or puller is not None:

        def register(record: InstanceRecord) -> Registration:
            parts: list[Startable] = []
            if args.etcd:
                parts.append(EtcdRegistration(args.etcd, namespace, llmserve, record))
            if puller is not None:
                parts.append(puller)
            return parts[0] if len(parts) == 1 else Registrations(parts)

        registration = register

    local = "127.0.0.1" if args.host in ("0.0.0.0", "", "::") else args.host
    local = f"[{local}]" if ":" in local else local
    settings = SupervisorSettings(
        engine_url=f"http://{local}:{args.port}", health_port=args.health_port,
        startup_timeout_s=args.startup_timeout_s, drain_timeout_s=args.drain_timeout_s,
        kill_grace_s=args.kill_grace_s,
    )
    env = {**os.environ, **vllm_env(config)}
    supervisor = Supervisor(
        vllm_argv(config, python), env, settings,
        record=instance_record(config, instance_id=instance_id, address=pod_ip), registration=registration,
    )
    logging.getLogger("fulcrum.worker").info(
        "worker %s: %s on %s, role %s, pool %s, namespace %s, llmserve %s, etcd %s",
        instance_id, config.model_name, config.device, config.role, config.pool, namespace, llmserve or "-",
        args.etcd or "(not registering)",
    )
    if puller is not None:
        logging.getLogger("fulcrum.worker").info("worker %s: pulling prefill jobs from %s (%s)", instance_id,
                                                 nats_url, puller.key)
    try:
        return asyncio.run(supervisor.run(install_signal_handlers=True))
    except HealthServerError as err:
        raise OSError(f"--health-port {err.port}: {err} (free the port, choose another --health-port, or "
                      f"--health-port 0 for no readiness endpoint)") from err
