"""``fulcrum router``: the OpenAI-compatible router in front of the worker instances.

The config file (YAML, see ``fulcrum.router.config``) names the served model, the routing policy and its
parameters, where instances come from (``registry: static`` with ``instances:``, ``registry: etcd`` or ``registry: kubernetes``), and the
timeouts. The file is watched: a changed policy, instance list or timeout applies without a restart (a
Kubernetes ConfigMap mount); an invalid change is logged and the last good config kept.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
from typing import Any

from fulcrum.commands import bind_host

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("router", help="run the OpenAI-compatible router", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="router config YAML (reloaded when it changes)")
    p.add_argument("--host", default="0.0.0.0",
                   help="address to listen on (default 0.0.0.0; a wildcard means $FULCRUM_BIND_HOST when set)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--loop", default="auto", choices=["auto", "asyncio", "uvloop"],
                   help="event loop: uvloop where installed (auto, the default), or the standard asyncio loop")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    from aiohttp import web

    from fulcrum.router.app import create_app
    from fulcrum.router.config import load_config
    from fulcrum.router.registry import Registry

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_config(args.config)
    registry: Registry | None = None
    if config.registry == "etcd":
        from fulcrum.router.registry_etcd import EtcdRegistry

        if not config.etcd.llmserve:
            raise ValueError("router config: registry etcd needs etcd.llmserve")
        registry = EtcdRegistry(config.etcd.endpoint, config.etcd.namespace, config.etcd.llmserve)
    elif config.registry == "kubernetes":
        from fulcrum.router.registry_k8s import KubernetesRegistry

        k8s = config.kubernetes
        registry = KubernetesRegistry(k8s.namespace, k8s.label_selector, k8s.port_name, k8s.role_label,
                                      k8s.pool_label, k8s.tp_label)
    if args.loop != "asyncio":  # optional: uvloop makes aiohttp's loop faster where it is installed
        try:
            import uvloop

            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        except ImportError:
            if args.loop == "uvloop":
                raise ValueError("--loop uvloop: uvloop is not installed (pip install uvloop)") from None
    app = create_app(config, registry, config_path=args.config)

    async def freeze_heap(app: web.Application) -> None:
        # objects alive after start-up (modules, metrics, the app) never die: keep them out of the garbage
        # collector's scans, which otherwise stall a request now and then (tail latency)
        gc.collect()
        gc.freeze()

    app.on_startup.append(freeze_heap)
    if registry is not None:
        owned = registry

        async def close_registry(app: web.Application) -> None:
            await owned.close()

        app.on_cleanup.append(close_registry)
    # handler_cancellation: a client that goes away cancels its handler, which closes the upstream connections
    # and so aborts the engines' work (aiohttp >= 3.9 leaves it off by default)
    web.run_app(app, host=bind_host(args.host), port=args.port, handler_cancellation=True, access_log=None,
                print=lambda msg: logging.getLogger("fulcrum.router").info("%s", msg))
    return 0
