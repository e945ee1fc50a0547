"""The ``fulcrum worker`` process supervisor: run vLLM as a child, register it, drain it, stop it.

Lifecycle (DESIGN.md principle 3: scale in gracefully, never drop an in-flight request; DOPD §V-C for the
instance registry)::

    starting ── child /health 200, then /v1/models 200 ──► serving ── SIGTERM/SIGINT ──► draining ──► stopped
       │                                                     │                              │
       └─ child exits / start-up timeout: exit 1             └─ child exits: exit ≠ 0       └─ exit 0

1. **start**: the engine command (``fulcrum.worker.vllm_args.vllm_argv``) runs as a child in its own process
   group (``start_new_session``): a terminal's Ctrl-C or Kubernetes' SIGTERM reaches only the supervisor (PID 1
   in the container), which decides when the engine stops; and stopping the group ends vLLM's API server,
   engine core and workers together. The child inherits stdout/stderr (the pod log). The readiness endpoint
   (below) listens first: a ``health_port`` it cannot bind raises :class:`HealthServerError` (an ``OSError``)
   before the engine starts.
2. **ready**: poll the engine's ``/health`` until 200, then ``/v1/models`` until 200 with a model listed.
3. **register**: read the KV capacity from ``/metrics`` (``vllm:cache_config_info``: ``num_gpu_blocks`` ×
   ``block_size``), then start the registration (``fulcrum.router.registry_etcd.EtcdRegistration``: a lease
   refreshed every TTL/3 in the background; etcd unreachable is logged and retried with backoff, never fatal).
4. **serve** until a stop signal or the child's exit. A child that exits on its own (crash, OOM, engine dead)
   makes the worker exit non-zero, so Kubernetes restarts the pod; the lease is revoked first.
5. **drain** on SIGTERM/SIGINT: readiness turns 503, the registration is revoked (the router's etcd watch drops
   the instance at once), then the engine's ``/metrics`` is polled until ``vllm:num_requests_running`` +
   ``vllm:num_requests_waiting`` = 0 at a poll taken at least ``drain_settle_s`` after deregistration (a request
   the router sent just before it saw the deletion still counts), or until ``drain_timeout_s`` (what was left
   is logged; the timeout counts from the stop request, deregistration included). A second signal while
   draining (deregistration included) skips the rest of the drain.
6. **stop**: SIGTERM to the child's process group, SIGKILL after ``kill_grace_s``; exit 0.

Readiness: vLLM's own ``/health`` stays 200 while the engine drains, so the supervisor serves a small readiness
endpoint of its own (``GET /health`` on ``health_port``, default 8001): 200 only while *serving* and the
engine's ``/health`` answers 200; 503 while starting, draining or when the engine is unhealthy (a JSON body
says which). The Deployment's readiness probe targets that port; liveness can target vLLM's ``/health``.
Kubernetes' ``terminationGracePeriodSeconds`` must exceed ``drain_timeout_s + kill_grace_s``.

Adapter code: aiohttp (client and the readiness server), signals, a child process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from fulcrum.cancellation import cancel_and_wait
from fulcrum.router.registry import InstanceRecord

__all__ = [
    "HealthServerError",
    "signal_process_group",
    "process_group_alive",
    "reap_orphans",
    "group_members",
    "EngineLoad",
    "Registration",
    "Supervisor",
    "SupervisorSettings",
    "kv_capacity_tokens",
    "parse_engine_load",
]

log = logging.getLogger(__name__)

State = Literal["starting", "serving", "draining", "stopped"]


class HealthServerError(OSError):
    """The readiness endpoint cannot listen on ``host:port`` (the port is in use, or not ours to bind); raised by
    :meth:`Supervisor.run` before the engine starts, translated from the socket's ``OSError`` (``__cause__``).

    Attributes:
        host: the address it tried (``SupervisorSettings.health_host``).
        port: the port it tried (``SupervisorSettings.health_port``).
        reason: the socket's error in words, e.g. "... address already in use".
    """

    def __init__(self, host: str, port: int, err: OSError) -> None:
        self.host, self.port = host, port
        self.reason = err.strerror or str(err)
        super().__init__(f"cannot listen on {host}:{port}: {self.reason}")
        self.errno = err.errno  # kept for callers; str() stays the one-line message above


class Registration(Protocol):
    """What the supervisor needs of a registration (``EtcdRegistration`` has it)."""

    async def start(self) -> bool: ...

    async def stop(self) -> None: ...


@dataclass(frozen=True, slots=True)
class SupervisorSettings:
    """Timings and ports of the supervisor, with the reason for each default.

    Attributes:
        engine_url: where the supervisor reaches the engine, e.g. ``http://127.0.0.1:8000`` (loopback: the engine
            listens on 0.0.0.0 in a pod).
        health_host: address of the readiness endpoint.
        health_port: port of the readiness endpoint (``GET /health``); 0 = none. 8001: next to vLLM's 8000.
        startup_timeout_s: longest wait for the engine to become ready, seconds. 1800: a 70B model's weights
            load in minutes from a cold cache; a hung start must still end (the pod restarts).
        poll_interval_s: period of the readiness polls during start-up, seconds.
        drain_timeout_s: longest drain, seconds (``--drain-timeout-s``), counted from the stop request, so the
            time deregistration takes is part of it. 300: a long generation finishes.
        drain_poll_s: period of the ``/metrics`` polls while draining, seconds.
        drain_settle_s: the drain ends only at a poll at least this long after deregistration, seconds. 1.0: the
            router's etcd watch sees the deletion within milliseconds; a request it sent just before counts by then.
        kill_grace_s: time between SIGTERM and SIGKILL for the engine's process group, seconds. 20: vLLM frees
            its GPU memory and NIXL agents in a few seconds, and drain + 20 s stays inside the pod's termination
            grace period, which the operator sets to the drain timeout + 30 s.
        request_timeout_s: timeout of each HTTP call to the engine, seconds.

    Raises:
        ValueError: a period or timeout not > 0, a drain timeout, settle time or kill grace not >= 0 (NaN is
            neither), or ``health_port`` outside 0..65535.
    """

    engine_url: str = "http://127.0.0.1:8000"
    health_host: str = "0.0.0.0"
    health_port: int = 8001
    startup_timeout_s: float = 1800.0
    poll_interval_s: float = 1.0
    drain_timeout_s: float = 300.0
    drain_poll_s: float = 0.5
    drain_settle_s: float = 1.0
    kill_grace_s: float = 20.0
    request_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("startup_timeout_s", "poll_interval_s", "drain_poll_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        for name in ("drain_timeout_s", "drain_settle_s", "kill_grace_s"):
            if not getattr(self, name) >= 0:  # NaN too: a NaN drain timeout never ended the drain
                raise ValueError(f"{name} must be >= 0")
        if not 0 <= self.health_port <= 65535:
            raise ValueError("health_port must be in 0..65535")


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """The engine's queue from ``/metrics``: requests running and waiting (summed over engines and models)."""

    running: float
    waiting: float

    @property
    def total(self) -> float:
        return self.running + self.waiting


def parse_engine_load(text: str) -> EngineLoad:
    """``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` from a Prometheus text exposition.

    Raises:
        ValueError: the text does not parse, or either gauge is missing.
    """
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            found[family.name] = found.get(family.name, 0.0) + sum(s.value for s in family.samples)
    missing = {"vllm:num_requests_running", "vllm:num_requests_waiting"} - found.keys()
    if missing:
        raise ValueError(f"engine metrics lack {', '.join(sorted(missing))}")
    return EngineLoad(found["vllm:num_requests_running"], found["vllm:num_requests_waiting"])


def kv_capacity_tokens(text: str) -> int:
    """KV cache capacity in tokens from ``vllm:cache_config_info`` (``num_gpu_blocks`` × ``block_size``); 0 when
    the metric or its labels are missing (vLLM's CPU build reports its blocks under the same label)."""
    with contextlib.suppress(ValueError):
        for family in text_string_to_metric_families(text):
            if family.name != "vllm:cache_config_info":
                continue
            for sample in family.samples:
                try:
                    return int(sample.labels["num_gpu_blocks"]) * int(sample.labels["block_size"])
                except (KeyError, ValueError):
                    continue
    return 0


class Supervisor:
    """Runs one engine child through start, registration, serving, drain and stop (see the module docstring).

    Args:
        argv: the engine's command line (``vllm_argv(...)``).
        env: the child's full environment.
        settings: ports and timings.
        record: the registry record to publish once ready (its ``kv_capacity_tokens`` is filled in from the
            engine's metrics when it reports one).
        registration: builds the registration from the final record (``EtcdRegistration(...)``); None = do not
            register (``--etcd ""``).
        cwd: the child's working directory (None = this process's).

    ``await run()`` returns the process exit code: 0 after a requested stop (drained or not), non-zero when the
    engine exited on its own or never became ready. ``request_stop()`` (also bound to SIGTERM/SIGINT by
    ``run(install_signal_handlers=True)``) starts the drain.
    """

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        settings: SupervisorSettings,
        *,
        record: InstanceRecord | None = None,
        registration: Callable[[InstanceRecord], Registration] | None = None,
        cwd: str | None = None,
    ) -> None:
        if not argv:
            raise ValueError("the engine command is empty")
        if registration is not None and record is None:
            raise ValueError("a registration needs a record")
        self._argv = list(argv)
        self._env = dict(env)
        self._settings = settings
        self._record = record
        self._make_registration = registration
        self._cwd = cwd
        self._state: State = "starting"
        self._stop = asyncio.Event()
        self._stop_now = asyncio.Event()  # a second stop request: end the drain now
        self._stop_count = 0
        self._registration: Registration | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._http: aiohttp.ClientSession | None = None

    @property
    def state(self) -> State:
        """``starting`` | ``serving`` | ``draining`` | ``stopped``."""
        return self._state

    @property
    def record(self) -> InstanceRecord | None:
        """The record published (after ``serving`` it carries the KV capacity read from the engine)."""
        return self._record

    @property
    def child_pid(self) -> int | None:
        """The engine child's pid (= its process group id), None before start."""
        return self._proc.pid if self._proc is not None else None

    def request_stop(self) -> None:
        """Begin the drain (or abort the start-up); a second call while draining cuts the drain short."""
        self._stop_count += 1
        if self._stop_count == 1:
            log.info("worker: stop requested (state %s)", self._state)
        else:
            log.warning("worker: second stop request: ending the drain now")
            self._stop_now.set()
        self._stop.set()

    async def run(self, *, install_signal_handlers: bool = False) -> int:
        """Run the child to the end; returns the worker's exit code (see the class docstring).

        Raises:
            HealthServerError: the readiness endpoint cannot listen on ``health_port`` (the engine is not started).
        """
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT) if install_signal_handlers else ()
        for sig in signals:
            loop.add_signal_handler(sig, self.request_stop)
        timeout = aiohttp.ClientTimeout(total=self._settings.request_timeout_s)
        runner: web.AppRunner | None = None
        exited: asyncio.Task[int] | None = None
        try:
            async with aiohttp.ClientSession(timeout=timeout) as http:
                self._http = http
                runner = await self._start_health_server()
                self._proc = await asyncio.create_subprocess_exec(
                    *self._argv, env=self._env, cwd=self._cwd, start_new_session=True
                )
                log.info("worker: engine started, pid %d: %s", self._proc.pid, " ".join(self._argv))
                exited = asyncio.create_task(self._proc.wait(), name="engine-exit")
                return await self._lifecycle(exited)
        finally:
            self._state = "stopped"
            if self._registration is not None:
                await self._registration.stop()
                self._registration = None
            if self._proc is not None and self._proc.returncode is None:
                await self._terminate()
            if exited is not None and not exited.done():
                exited.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await exited
            if runner is not None:
                await runner.cleanup()
            self._http = None
            for sig in signals:
                loop.remove_signal_handler(sig)

    async def _lifecycle(self, exited: asyncio.Task[int]) -> int:
        stop = asyncio.create_task(self._stop.wait(), name="stop-request")
        ready = asyncio.create_task(self._wait_ready(), name="engine-ready")
        try:
            await asyncio.wait({exited, stop, ready}, return_when=asyncio.FIRST_COMPLETED)
            if exited.done():
                return self._engine_died(exited.result(), "during start-up")
            if stop.done():
                log.info("worker: stopped during start-up; stopping the engine")
                return 0
            if not ready.result():
                log.error("worker: engine not ready after %.0f s; stopping it", self._settings.startup_timeout_s)
                return 1
            await self._register()
            self._state = "serving"
            log.info("worker: serving at %s", self._settings.engine_url)
            await asyncio.wait({exited, stop}, return_when=asyncio.FIRST_COMPLETED)
            if exited.done():
                return self._engine_died(exited.result(), "while serving")
            self._state = "draining"
            stop_at = time.monotonic()  # the drain timeout counts from here: deregistering is part of the drain
            await self._deregister()
            if not await self._drain(exited, since=stop_at):
                return self._engine_died(exited.result(), "while draining")
            return 0
        finally:
            await cancel_and_wait([stop, ready])

    @staticmethod
    def _engine_died(code: int, when: str) -> int:
        """Log how the engine ended and return the worker's exit code: the engine's own when > 0; 128 + N when
        signal N killed it (a shell's convention: SIGKILL, often the kernel's OOM killer, is 137); 1 for a clean
        exit (an engine should serve until told to stop)."""
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            hint = " (the kernel's OOM killer sends it when memory runs out)" if -code == signal.SIGKILL else ""
            log.error("worker: the engine was killed %s by %s%s; exiting with %d", when, name, hint, 128 - code)
            return 128 - code
        log.error("worker: the engine exited on its own %s with code %s; exiting non-zero", when, code)
        return code if code > 0 else 1

    async def _get(self, path: str) -> tuple[int, str]:
        """GET ``engine_url + path``; (status, body), or (0, reason) when the engine cannot be reached."""
        http = self._http
        if http is None or http.closed:  # shutting down
            return 0, "no HTTP session"
        try:
            async with http.get(self._settings.engine_url + path) as resp:
                return resp.status, await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return 0, f"{type(exc).__name__}: {exc}"

    async def _wait_ready(self) -> bool:
        """Poll ``/health`` then ``/v1/models``; True when both answer, False after the start-up timeout."""
        deadline = time.monotonic() + self._settings.startup_timeout_s
        path = "/health"
        while time.monotonic() < deadline:
            status, body = await self._get(path)
            if status == 200 and path == "/health":
                path = "/v1/models"
                continue
            if status == 200 and _lists_a_model(body):
                return True
            await asyncio.sleep(self._settings.poll_interval_s)
        return False

    async def _register(self) -> None:
        status, text = await self._get("/metrics")
        if status == 200:
            try:
                parse_engine_load(text)
            except ValueError as exc:  # vLLM's stat loggers are off: nothing tells the drain when it is done
                log.warning("worker: %s: a drain cannot see when the engine is idle and will run to --drain-timeout-s "
                            "(%g s); is --disable-log-stats among the extra vLLM arguments?", exc,
                            self._settings.drain_timeout_s)
        if self._record is None:
            return
        capacity = kv_capacity_tokens(text) if status == 200 else 0
        if capacity:
            self._record = dataclasses.replace(self._record, kv_capacity_tokens=capacity)
        if self._make_registration is None:
            return
        self._registration = self._make_registration(self._record)
        if await self._registration.start():
            log.info("worker: registered %s as %s", self._record.id, self._record.url)
        else:
            log.warning("worker: etcd unreachable; serving unregistered while the registration retries")

    async def _deregister(self) -> None:
        if self._registration is not None:
            await self._registration.stop()
            self._registration = None
            log.info("worker: deregistered; draining")

    async def _drain(self, exited: asyncio.Task[int], *, since: float) -> bool:
        """Wait until the engine has no request left (or the timeout, or a second stop request).

        Args:
            exited: the engine's exit task.
            since: ``time.monotonic()`` of the stop request, seconds. The deadline is ``since + drain_timeout_s``,
                so the time deregistration took (a prefill puller finishing its jobs in hand, a slow etcd) counts
                against the drain timeout and the pod's termination grace period holds; the settle time counts from
                now (after deregistration).

        Returns False when the engine exited during the drain.
        """
        s = self._settings
        started = time.monotonic()
        deadline = since + s.drain_timeout_s
        load: EngineLoad | None = None
        said = ""  # the last problem logged: each is said once, not at every poll
        while True:
            if exited.done():
                return False
            status, text = await self._get("/metrics")
            problem = ""
            if status == 200:
                try:
                    load = parse_engine_load(text)
                except ValueError as exc:
                    problem = f"cannot read the engine's load: {exc}"
            else:
                problem = f"/metrics answered {status or text}"
            if problem and problem != said:
                log.warning("worker: drain: %s", problem)
            said = problem
            now = time.monotonic()
            if load is not None and load.total == 0 and now - started >= s.drain_settle_s:
                log.info("worker: drained in %.1f s", now - since)
                return True
            if now >= deadline or self._stop_now.is_set():
                why = "drain timeout" if now >= deadline else "second stop request"
                left = f"{load.running:g} running, {load.waiting:g} waiting" if load else "unknown (no metrics)"
                log.warning("worker: %s after %.1f s with %s; stopping the engine", why, now - since, left)
                return True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop_now.wait(), timeout=min(s.drain_poll_s, max(0.0, deadline - now)))

    async def _terminate(self) -> None:
        """SIGTERM the child's process group; SIGKILL after ``kill_grace_s``; reap the child."""
        proc = self._proc
        assert proc is not None
        pgid = proc.pid
        signal_process_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + self._settings.kill_grace_s
        while time.monotonic() < deadline and process_group_alive(pgid):
            reap_orphans(pgid, keep=pgid)
            await asyncio.sleep(0.1)
        if process_group_alive(pgid):
            log.warning("worker: engine still running %.0f s after SIGTERM; SIGKILL", self._settings.kill_grace_s)
            signal_process_group(pgid, signal.SIGKILL)
        with contextlib.suppress(asyncio.TimeoutError, ProcessLookupError):
            await asyncio.wait_for(proc.wait(), timeout=10.0)
        reap_orphans(pgid, keep=pgid)
        log.info("worker: engine stopped (code %s)", proc.returncode)

    async def _start_health_server(self) -> web.AppRunner | None:
        if not self._settings.health_port:
            return None
        app = web.Application()
        app.router.add_get("/health", self._health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        host, port = self._settings.health_host, self._settings.health_port
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as err:
            await runner.cleanup()
            raise HealthServerError(host, port, err) from err
        return runner

    async def _health(self, request: web.Request) -> web.Response:
        """200 while serving with a healthy engine; 503 (and why) otherwise."""
        if self._state != "serving":
            return web.json_response({"status": self._state}, status=503)
        status, _ = await self._get("/health")
        if status != 200:
            return web.json_response({"status": "engine unhealthy", "engine_health": status}, status=503)
        return web.json_response({"status": "serving"})


def _lists_a_model(body: str) -> bool:
    try:
        data: Any = json.loads(body)
    except ValueError:
        return False
    return isinstance(data, dict) and bool(data.get("data"))


def signal_process_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to process group ``pgid``; a group that is gone (or not ours) is ignored."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def process_group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is still alive (one we may not signal counts as alive).

    A group whose remaining members are all zombies (exited, not yet reaped) is not alive: in the worker container
    the supervisor is PID 1 and inherits the engine's orphans (a GPU worker whose engine core exited first), which
    stay zombies until it reaps them (:func:`reap_orphans`); counting them held every stop for the whole kill
    grace. Without a readable ``/proc`` (or when it lists no member) the signal test alone decides.
    """
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    members = group_members(pgid)
    if not members:
        return True
    return any(state not in ("Z", "X") for _, state, _ in members)


def reap_orphans(pgid: int, *, keep: int) -> list[int]:
    """Reap the zombies of group ``pgid`` that are this process's children, except ``keep`` (the engine's own pid,
    which asyncio's child watcher reaps); returns their pids. They are the engine's processes re-parented to the
    supervisor as PID 1 (or a subreaper). Linux ``/proc``; elsewhere nothing is reaped."""
    me = os.getpid()
    reaped: list[int] = []
    for pid, state, ppid in group_members(pgid) or []:
        if state == "Z" and ppid == me and pid != keep:
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    reaped.append(pid)
    return reaped


def group_members(pgid: int) -> list[tuple[int, str, int]] | None:
    """``(pid, state, parent pid)`` of every process of group ``pgid``, from ``/proc/<pid>/stat`` (state as
    ``ps`` writes it: ``Z`` a zombie, ``R``/``S``/``D`` alive); None where ``/proc`` cannot be listed (not Linux)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    members: list[tuple[int, str, int]] = []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # exited meanwhile
            continue
        fields = stat[stat.rfind(b")") + 2:].split()  # after "pid (comm) ": the name may hold spaces and ")"
        try:
            state, ppid, pgrp = fields[0].decode(), int(fields[1]), int(fields[2])
        except (IndexError, ValueError):
            continue
        if pgrp == pgid:
            members.append((int(name), state, ppid))
    return members
