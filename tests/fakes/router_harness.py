"""A router in front of FAKE engines, all in one event loop: what the router tests and the fuzz test drive.

Not a real deployment: the engines are :class:`fakes.fake_engine.FakeEngine`, the policy a
:class:`fakes.fake_policy.FakePolicy` unless another is given.
"""

from __future__ import annotations

from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from fakes.fake_engine import FakeCluster, FakeEngine, FakeEngineSettings
from fakes.fake_policy import FakePolicy
from fulcrum.router.app import ROUTER, RouterState, create_app
from fulcrum.router.config import parse_config
from fulcrum.routing.base import Policy

__all__ = ["RouterHarness"]


class RouterHarness:
    """``await start(...)`` builds n fake engines (ids e0, e1, ...) and a router over them with a test client;
    ``instance_fields`` are added to every static instance entry (role, max_concurrency, kv_capacity_tokens...),
    ``roles`` gives each engine its own role."""

    def __init__(self) -> None:
        self.cluster = FakeCluster()
        self.engines: list[FakeEngine] = []
        self.policy: Any = None
        self.client: TestClient[Any, Any] | None = None
        self.config: dict[str, Any] = {}

    async def start(self, n: int = 2, *, settings: FakeEngineSettings | None = None, policy: Policy | None = None,
                    config: dict[str, Any] | None = None, health_checks: bool = False,
                    instance_fields: dict[str, Any] | None = None, roles: list[str] | None = None,
                    **app_kwargs: Any) -> "RouterHarness":
        for i in range(n):
            eng = FakeEngine(settings, self.cluster, engine_id=f"e{i}")
            await eng.start()
            self.engines.append(eng)
        self.policy = policy if policy is not None else FakePolicy()
        cfg: dict[str, Any] = {
            "model": "fake-model", "kv_block_size": (settings or FakeEngineSettings()).block_size,
            "instances": [{"id": e.engine_id, "url": e.url, **(instance_fields or {}),
                           **({"role": roles[i]} if roles else {})} for i, e in enumerate(self.engines)],
            "timeouts": {"connect_s": 1.0, "first_token_s": 5.0, "idle_s": 5.0, "request_s": 10.0, "health_s": 1.0},
        }
        cfg.update(config or {})
        self.config = cfg
        app = create_app(parse_config(cfg), policy_factory=lambda name, params: self.policy,
                         health_checks=health_checks, **app_kwargs)
        self.client = TestClient(TestServer(app, handler_cancellation=True))
        await self.client.start_server()
        return self

    @property
    def state(self) -> RouterState:
        assert self.client is not None
        return self.client.app[ROUTER]  # type: ignore[index]

    def engine(self, iid: str) -> FakeEngine:
        return next(e for e in self.engines if e.engine_id == iid)

    def router_inflight(self) -> int:
        pool = self.state.pool
        assert pool is not None
        return sum(pool.state(i).inflight for i in pool.ids())

    def router_tokens(self) -> tuple[int, int]:
        pool = self.state.pool
        assert pool is not None
        return (sum(pool.state(i).queued_prefill_tokens for i in pool.ids()),
                sum(pool.state(i).running_tokens for i in pool.ids()))

    def engines_active(self) -> int:
        return sum(len(e.active) for e in self.engines)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
        for e in self.engines:
            await e.stop()
