"""``fulcrum operator``: the Kubernetes operator — reconciles ``LLMServe`` resources and runs their control loops.

Each LLMServe gets its pools, router and router config (server-side apply, owner references), and every
``spec.scaling.intervalSeconds`` one control-loop interval: observe (Prometheus) → forecast → plan → scale
(scale-ins drained first). Status, Events and ``fulcrum_operator_*`` metrics show every decision
(docs/operator.md).

Credentials: in a pod, the service account; elsewhere the kubeconfig ``KUBECONFIG`` names (or
``~/.kube/config``). Several replicas coordinate through kopf peering (``--peering NAME``; the
``ClusterKopfPeering``/``KopfPeering`` CRDs must be installed); without it the operator runs standalone.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
from typing import Any

import yaml

from fulcrum.commands import bind_host
from fulcrum.errors import yaml_problem

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Register ``fulcrum operator`` and its flags."""
    p = sub.add_parser("operator", help="run the Kubernetes operator (LLMServe → pools, router, control loop)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--namespace", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeatable); default: the pod's namespace or 'default'")
    scope.add_argument("--all-namespaces", action="store_true", help="watch every namespace (cluster-wide)")
    p.add_argument("--prometheus-url", default="",
                   help="Prometheus base URL the control loop observes (e.g. http://prometheus:9090); "
                        "without it every interval holds the pools and reports Degraded")
    p.add_argument("--image", default=os.environ.get("FULCRUM_IMAGE", "ghcr.io/fulcrum-llm/fulcrum:0.1.0"),
                   help="Fulcrum control-plane image for router and sim-worker pods (default: $FULCRUM_IMAGE or "
                        "ghcr.io/fulcrum-llm/fulcrum:0.1.0)")
    p.add_argument("--etcd-endpoint", default=os.environ.get("FULCRUM_ETCD_ENDPOINT", ""),
                   help="etcd for LLMServes whose spec.connectors.etcd is empty (default: $FULCRUM_ETCD_ENDPOINT; "
                        "the Helm chart sets it to its bundled etcd); \"\" = none")
    p.add_argument("--nats-url", default=os.environ.get("FULCRUM_NATS_URL", ""),
                   help="NATS for LLMServes whose spec.connectors.nats is empty (default: $FULCRUM_NATS_URL); \"\" = none")
    p.add_argument("--liveness-port", type=int, default=8080, help="port of kopf's liveness endpoint /healthz (0 = off)")
    p.add_argument("--metrics-port", type=int, default=9090, help="port of the fulcrum_operator_* metrics (0 = off)")
    p.add_argument("--peering", default="", metavar="NAME",
                   help="kopf peering name (several operator replicas, one active); default: standalone")
    p.add_argument("--log-format", choices=["json", "text"], default="json", help="log format (default json)")
    p.add_argument("--verbose", action="store_true", help="debug logs")
    p.add_argument("--drain-poll-seconds", type=float, default=5.0,
                   help="seconds between reads of a draining pod's /metrics (default 5)")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, else $KUBECONFIG)")
    p.set_defaults(func=run)


def _raised_in_yaml(err: BaseException) -> bool:
    """Whether ``err`` was raised inside PyYAML (a value its constructor cannot build), not by the caller of it."""
    tb = err.__traceback__
    while tb is not None:
        if str(tb.tb_frame.f_globals.get("__name__", "")).startswith("yaml."):
            return True
        tb = tb.tb_next
    return False


def _api_client(kubeconfig: str | None) -> Any:
    from kubernetes import client, config

    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig)  # type: ignore[no-untyped-call]
    else:
        try:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
        except config.ConfigException:
            config.load_kube_config()  # type: ignore[no-untyped-call]
    return client.ApiClient()


def run(args: argparse.Namespace) -> int:
    """Run the operator until interrupted (exit 0), or exit 2 on bad flags/credentials."""
    import kopf
    from prometheus_client import start_http_server

    from fulcrum.controller.apply import KubeClient
    from fulcrum.controller.handlers import Controller, ControllerSettings, register
    from fulcrum.controller.metrics import OperatorMetrics
    from fulcrum.controller.objects import ApiObjects

    for name in ("liveness_port", "metrics_port"):
        port = getattr(args, name)
        if not 0 <= port <= 65535:
            raise ValueError(f"--{name.replace('_', '-')} must be in 0..65535, got {port}")
    if not (math.isfinite(args.drain_poll_seconds) and args.drain_poll_seconds > 0):
        raise ValueError(f"--drain-poll-seconds must be a finite number of seconds > 0, got {args.drain_poll_seconds:g}")
    url = args.prometheus_url.strip()
    if url and not url.startswith(("http://", "https://")):
        raise ValueError(f"--prometheus-url must start with http:// or https://, got {url!r}")
    if not args.image.strip():
        raise ValueError("--image must not be empty")
    if args.kubeconfig:
        if not os.path.isfile(args.kubeconfig):
            raise ValueError(f"--kubeconfig {args.kubeconfig}: no such file")
        os.environ["KUBECONFIG"] = args.kubeconfig  # kopf's own login reads it (the CLI is where env is touched)
    try:
        api_client = _api_client(args.kubeconfig)
    except yaml.MarkedYAMLError as err:  # one line: file:line:column and the problem, not YAML's caret diagram
        where, what = yaml_problem(err)
        source = args.kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        raise ValueError(f"no Kubernetes credentials: {source}{where}: not valid YAML: {what}") from err
    except ValueError as err:
        text = " ".join(str(err).split())
        if _raised_in_yaml(err):  # a timestamp PyYAML matches but cannot build (2024-13-45): no YAMLError, no mark
            source = args.kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
            raise ValueError(f"no Kubernetes credentials: {source}: not valid YAML: {text}") from err
        raise ValueError(f"no Kubernetes credentials: {text}") from err  # e.g. certificate data that is no base64
    except Exception as err:  # kubernetes.config.ConfigException, a missing or malformed file
        raise ValueError(f"no Kubernetes credentials: {' '.join(str(err).split())}") from err
    # Only once the command line and the credentials are good: kopf.configure adds a handler to the root logger
    # (bound to the stderr of the moment) and sets levels process-wide, which a rejected command must not leave.
    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.JSON if args.log_format == "json"
                   else kopf.LogFormat.FULL)
    logging.getLogger("fulcrum").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    host = bind_host("0.0.0.0")  # metrics and liveness: every address, or $FULCRUM_BIND_HOST
    metrics = OperatorMetrics()
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=host, registry=metrics.registry)
    controller = Controller(ApiObjects(KubeClient(api_client)),
                            ControllerSettings(image=args.image, prometheus_url=url or None,
                                               drain_poll_s=args.drain_poll_seconds,
                                               default_etcd=args.etcd_endpoint, default_nats=args.nats_url),
                            metrics=metrics)
    registry = kopf.OperatorRegistry()
    register(registry, controller)
    namespaces = args.namespace or ([] if args.all_namespaces else [os.environ.get("POD_NAMESPACE", "default")])
    try:
        asyncio.run(kopf.operator(
            registry=registry,
            clusterwide=bool(args.all_namespaces),
            namespaces=namespaces,
            standalone=not args.peering,
            peering_name=args.peering or None,
            liveness_endpoint=f"http://{host}:{args.liveness_port}/healthz" if args.liveness_port else None,
        ))
    except KeyboardInterrupt:
        return 0
    return 0
