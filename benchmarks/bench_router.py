"""Router overhead against a fast FAKE backend, side by side with the Rust ``vllm-router`` from PyPI.

Run: ``python benchmarks/bench_router.py [--requests 5000] [--concurrency 32] [--stream-tokens 2000]``

Three targets serve the same requests from the same backend:

- ``direct``: the backend itself (the baseline every "added" number is measured against);
- ``fulcrum``: ``fulcrum router`` (``python -m fulcrum router``) with the ``round_robin`` policy, with
  ``token_count: estimate`` (no extra round trip: like for like with vllm-router, which does not tokenize) on
  uvloop (when installed) and on the standard asyncio loop, and with ``token_count: tokenize`` (one
  ``/tokenize`` call per request, the default, for exact lengths);
- ``aiohttp floor (bare proxy)``: the least an aiohttp server and client can do per relayed request (read the
  body, post it on a pooled session, answer the bytes; no validation, routing, metrics or retries) on uvloop:
  the floor of the project's rule to use aiohttp for HTTP rather than code of its own, measured so that the
  ratios say how much of the gap to vllm-router is the library and how much is Fulcrum;
- ``vllm-router``: ``vllm-router --policy round_robin`` (``pip install vllm-router``; when it cannot be started
  the benchmark says so and prints only ours).

The backend is a FAKE engine built for speed (raw asyncio HTTP/1.1, keep-alive, answers at once): a
non-streamed completion is a fixed JSON; a streamed one sends ``max_tokens`` SSE events, one write each.
Each target runs in its own process, all started before measuring; the load generator (aiohttp, keep-alive)
runs in this one and interleaves the targets over ``--rounds`` rounds, so that a slow spell of a shared machine
falls on all of them alike.

Measured per target:

- latency, one request at a time (``--latency-requests``): p50 and p99; "added" = target − direct;
- throughput at ``--concurrency`` requests in flight (``--requests`` in all): requests/s;
- streaming relay: ``--stream-requests`` streams of ``--stream-tokens`` events, 4 at a time: events (tokens)/s
  received by the client;
- CPU time of the target's process per request in the throughput run (``direct``: the backend's own), read
  from ``/proc`` — steadier than requests/s on a shared machine.

Aims (issue 12, measured side by side in one run): at least 0.75× vllm-router's requests/s, CPU per request at
most 2× vllm-router's, streaming relay ahead of vllm-router's (tokens/s), at most 1 ms p99 added latency.
Numbers depend on the machine; every process shares its cores (on a 2-core machine, backend, router and load
generator compete), so read them side by side, never alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLOOR = "aiohttp floor (bare proxy)"


# ----------------------------------------------------------------------------------------------- fake backend
_MAX_TOKENS = re.compile(rb'"max_tokens"\s*:\s*(\d+)')
_STREAM = re.compile(rb'"stream"\s*:\s*true')
_WHOLE = json.dumps({
    "id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "fake-model",
    "choices": [{"index": 0, "text": "abcdefghijklmnop", "logprobs": None, "finish_reason": "length", "stop_reason": None}],
    "usage": {"prompt_tokens": 8, "completion_tokens": 16, "total_tokens": 24},
}).encode()
_EVENT = b'data: {"id":"cmpl-fake","object":"text_completion","created":0,"model":"fake-model","choices":[{"index":0,"text":"a","logprobs":null,"finish_reason":null}]}\n\n'
_USAGE = b'data: {"id":"cmpl-fake","object":"text_completion","created":0,"model":"fake-model","choices":[],"usage":{"prompt_tokens":8,"completion_tokens":%d,"total_tokens":%d}}\n\n'


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class FastFakeBackend(asyncio.Protocol):
    """A FAKE OpenAI-compatible backend answering as fast as asyncio can (benchmark only)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t: asyncio.Transport = transport  # type: ignore[assignment]
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buf[:head_end]
            m = re.search(rb"(?i)content-length:\s*(\d+)", head)
            n = int(m.group(1)) if m else 0
            if len(self.buf) < head_end + 4 + n:
                return
            body = self.buf[head_end + 4 : head_end + 4 + n]
            self.buf = self.buf[head_end + 4 + n :]
            self.answer(head.split(b" ", 2)[:2], body)

    def answer(self, line: list[bytes], body: bytes) -> None:
        method, path = line[0], line[1]
        if method == b"GET":
            payload = b"{}" if path != b"/v1/models" else json.dumps(
                {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}).encode()
            self.t.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload))
            return
        if path == b"/tokenize":
            payload = b'{"count":8,"max_model_len":4096,"tokens":[1,2,3,4,5,6,7,8]}'
            self.t.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload))
            return
        if not _STREAM.search(body):
            self.t.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(_WHOLE), _WHOLE))
            return
        m = _MAX_TOKENS.search(body)
        n = int(m.group(1)) if m else 16
        self.t.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(n):
            self.t.write(_chunk(_EVENT))
        self.t.write(_chunk(_USAGE % (n, n + 8)) + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")


def serve_backend(port: int) -> None:
    """Run the fake backend until killed."""
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(loop.create_server(FastFakeBackend, "127.0.0.1", port, backlog=1024))
    try:
        loop.run_forever()
    finally:
        server.close()


def serve_floor(port: int, backend: str) -> None:
    """Run the aiohttp floor until killed: the least an aiohttp server + client can do per relayed request (read
    the body, post it upstream on a pooled session, answer the upstream's bytes; streams relayed chunk by chunk).
    No validation, routing, metrics or retries: what Fulcrum's router adds is its cost over this."""
    import aiohttp
    from aiohttp import web

    async def relay(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        session: aiohttp.ClientSession = request.app["session"]
        async with session.post(backend + request.path, data=raw, headers={"Content-Type": "application/json"}) as r:
            if r.content_type != "text/event-stream":
                return web.Response(status=r.status, body=await r.read(), content_type="application/json")
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def startup(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False,
                                               cookie_jar=aiohttp.DummyCookieJar())

    async def cleanup(app: web.Application) -> None:
        await app["session"].close()

    app = web.Application()
    app.on_startup.append(startup)
    app.on_cleanup.append(cleanup)
    app.router.add_post("/v1/completions", relay)
    app.router.add_get("/health", health)
    loop = None
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        pass
    web.run_app(app, host="127.0.0.1", port=port, print=None, loop=loop)


# ----------------------------------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes]) -> bool:
    import urllib.request

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return True
        except OSError:
            time.sleep(0.2)
    return False


def start(cmd: list[str], health_url: str, timeout: float = 60.0, env: dict[str, str] | None = None) -> subprocess.Popen[bytes] | None:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, start_new_session=True)
    if wait_http(health_url, timeout, proc):
        return proc
    stop(proc)
    return None


def stop(proc: subprocess.Popen[bytes] | None) -> str:
    if proc is None:
        return ""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    return err[-2000:]


# ----------------------------------------------------------------------------------------------- load
@dataclass
class Result:
    p50_ms: float = float("nan")
    p99_ms: float = float("nan")
    rps: float = float("nan")
    tokens_per_s: float = float("nan")
    errors: int = 0
    cpu_us: float = float("nan")
    """The target process's CPU time per request in the throughput phase, microseconds (all its threads)."""


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of a process (all threads), seconds; NaN when unknown."""
    if pid is None:
        return float("nan")
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def _latency(session, url: str, n: int) -> tuple[list[float], int]:
    body = {"model": "fake-model", "prompt": "hello there, benchmark", "max_tokens": 16}
    lat, errors = [], 0
    for _ in range(n):
        t = time.perf_counter()
        async with session.post(url, json=body) as r:
            await r.read()
            errors += r.status != 200
        lat.append(time.perf_counter() - t)
    return lat, errors


async def _throughput(session, url: str, n: int, conc: int) -> tuple[float, int]:
    body = {"model": "fake-model", "prompt": "hello there, benchmark", "max_tokens": 16}
    left = n
    errors = 0

    async def worker() -> None:
        nonlocal left, errors
        while left > 0:
            left -= 1
            async with session.post(url, json=body) as r:
                await r.read()
                errors += r.status != 200

    t = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    return n / (time.perf_counter() - t), errors


async def _stream(session, url: str, n: int, tokens: int, conc: int = 4) -> tuple[float, int]:
    body = {"model": "fake-model", "prompt": "stream", "max_tokens": tokens, "stream": True}
    left, got, errors = n, 0, 0

    async def worker() -> None:
        nonlocal left, got, errors
        while left > 0:
            left -= 1
            async with session.post(url, json=body) as r:
                errors += r.status != 200
                buf = b""
                async for chunk in r.content.iter_any():
                    buf += chunk
                    got += chunk.count(b'"text":"a"')
    t = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    return got / (time.perf_counter() - t), errors


async def measure_all(targets: dict[str, str], pids: dict[str, int], args: argparse.Namespace) -> dict[str, Result]:
    """Every phase interleaved over the targets in ``args.rounds`` rounds (so a slow spell of the shared
    machine hits all of them alike); latencies pooled, rates averaged."""
    import aiohttp

    lat: dict[str, list[float]] = {t: [] for t in targets}
    rps: dict[str, list[float]] = {t: [] for t in targets}
    tps: dict[str, list[float]] = {t: [] for t in targets}
    errors = dict.fromkeys(targets, 0)
    cpu = dict.fromkeys(targets, 0.0)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        for name, base in targets.items():
            await _latency(session, base + "/v1/completions", 50)  # warm-up: connections, caches
        for _ in range(args.rounds):
            for name, base in targets.items():
                url = base + "/v1/completions"
                xs, e = await _latency(session, url, args.latency_requests // args.rounds)
                lat[name] += xs
                errors[name] += e
            for name, base in targets.items():
                c0 = cpu_seconds(pids.get(name))
                r, e = await _throughput(session, base + "/v1/completions", args.requests // args.rounds, args.concurrency)
                cpu[name] += cpu_seconds(pids.get(name)) - c0
                rps[name].append(r)
                errors[name] += e
            for name, base in targets.items():
                t, e = await _stream(session, base + "/v1/completions", max(1, args.stream_requests // args.rounds), args.stream_tokens)
                tps[name].append(t)
                errors[name] += e
    n_req = (args.requests // args.rounds) * args.rounds
    return {n: Result(pct(lat[n], 0.5) * 1e3, pct(lat[n], 0.99) * 1e3, statistics.mean(rps[n]), statistics.mean(tps[n]),
                      errors[n], cpu[n] / n_req * 1e6) for n in targets}


# ----------------------------------------------------------------------------------------------- main
def fulcrum_config(path: Path, backend: str, token_count: str) -> None:
    path.write_text(
        "model: fake-model\n"
        f"token_count: {token_count}\n"
        "policy: {name: round_robin}\n"
        f"instances:\n  - {{id: b0, url: \"{backend}\"}}\n"
        "health_interval_s: 30\n"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=5000, help="requests in the throughput run")
    ap.add_argument("--concurrency", type=int, default=32, help="requests in flight in the throughput run")
    ap.add_argument("--latency-requests", type=int, default=500, help="sequential requests in the latency run")
    ap.add_argument("--stream-requests", type=int, default=10, help="streams in the relay run")
    ap.add_argument("--stream-tokens", type=int, default=2000, help="events per stream in the relay run")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds over the targets")
    ap.add_argument("--serve-backend", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--serve-floor", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--floor-backend", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_backend:
        serve_backend(args.serve_backend)
        return 0
    if args.serve_floor:
        serve_floor(args.serve_floor, args.floor_backend)
        return 0

    bport = free_port()
    backend = f"http://127.0.0.1:{bport}"
    procs: list[subprocess.Popen[bytes]] = []
    targets: dict[str, str] = {"direct": backend}
    pids: dict[str, int] = {}
    notes: list[str] = []
    tmp = Path(tempfile.mkdtemp(prefix="bench-router-"))
    try:
        bp = start([sys.executable, __file__, "--serve-backend", str(bport)], backend + "/health", 20)
        if bp is None:
            print("could not start the fake backend", file=sys.stderr)
            return 1
        procs.append(bp)
        pids["direct"] = bp.pid
        try:
            import uvloop  # noqa: F401

            loops = ["uvloop", "asyncio"]
        except ImportError:
            loops = ["asyncio"]
            notes.append("uvloop is not installed: Fulcrum's router ran on the standard asyncio loop only")
        def add_target(name: str, cmd: list[str], port: int, timeout: float, failed: str) -> None:
            p = start(cmd, f"http://127.0.0.1:{port}/health", timeout)
            if p is None:
                notes.append(failed)
                return
            procs.append(p)
            targets[name] = f"http://127.0.0.1:{port}"
            pids[name] = p.pid

        for mode, loop in [("estimate", lp) for lp in loops] + [("tokenize", loops[0])]:
            port = free_port()
            cfg = tmp / f"router-{mode}.yaml"
            fulcrum_config(cfg, backend, mode)
            name = f"fulcrum ({mode}, {loop})"
            add_target(name, [sys.executable, "-m", "fulcrum", "router", "--config", str(cfg), "--host", "127.0.0.1",
                              "--port", str(port), "--log-level", "warning", "--loop", loop],
                       port, 60, f"{name} did not start")
        port = free_port()
        add_target(FLOOR, [sys.executable, __file__, "--serve-floor", str(port), "--floor-backend", backend],
                   port, 30, "the aiohttp floor did not start")
        exe = shutil.which("vllm-router")
        if exe is None:
            notes.append("vllm-router is not installed (pip install vllm-router): only Fulcrum's router was measured")
        else:
            port = free_port()
            add_target("vllm-router", [exe, "--worker-urls", backend, "--policy", "round_robin", "--host", "127.0.0.1",
                                       "--port", str(port), "--log-level", "error", "--disable-retries",
                                       "--disable-circuit-breaker", "--health-check-interval-secs", "30"],
                       port, 60, "vllm-router could not be started: only Fulcrum's router was measured")
        results = asyncio.run(measure_all(targets, pids, args))
    finally:
        for p in reversed(procs):
            err = stop(p)
            if "Traceback" in err:
                notes.append(f"a process logged errors:\n{err}")
        shutil.rmtree(tmp, ignore_errors=True)

    d = results["direct"]
    print(f"router overhead against a fast fake backend (cpu cores: {os.cpu_count()}; "
          f"latency: {args.latency_requests} sequential requests; throughput: {args.requests} requests at "
          f"concurrency {args.concurrency}; relay: {args.stream_requests} streams x {args.stream_tokens} tokens, 4 at a time; {args.rounds} interleaved rounds)")
    print(f"{'target':<30}{'p50 ms':>9}{'p99 ms':>9}{'+p50 ms':>9}{'+p99 ms':>9}{'req/s':>9}{'relay tok/s':>13}{'cpu us/req':>12}{'errors':>8}")
    for name, r in results.items():
        added50 = r.p50_ms - d.p50_ms
        added99 = r.p99_ms - d.p99_ms
        print(f"{name:<30}{r.p50_ms:9.3f}{r.p99_ms:9.3f}{added50:9.3f}{added99:9.3f}{r.rps:9.0f}{r.tokens_per_s:13.0f}{r.cpu_us:12.0f}{r.errors:8d}")
    ours = next((n for n in results if n.startswith("fulcrum (estimate")), None)
    if ours is not None:
        o = results[ours]
        if "vllm-router" in results:
            v = results["vllm-router"]
            print(f"{ours} / vllm-router requests/s: {o.rps / v.rps:.2f}x (aim >= 0.75x)")
            print(f"{ours} / vllm-router CPU per request: {o.cpu_us / v.cpu_us:.2f}x (aim <= 2x)")
            print(f"{ours} / vllm-router relay tokens/s: {o.tokens_per_s / v.tokens_per_s:.2f}x (aim > 1x)")
            if FLOOR in results:
                f = results[FLOOR]
                print(f"aiohttp floor / vllm-router: requests/s {f.rps / v.rps:.2f}x, CPU per request "
                      f"{f.cpu_us / v.cpu_us:.2f}x (the least any aiohttp server + client relay costs)")
        if FLOOR in results:
            f = results[FLOOR]
            print(f"{ours} / aiohttp floor: requests/s {o.rps / f.rps:.2f}x, CPU per request {o.cpu_us / f.cpu_us:.2f}x "
                  f"(what routing, validation, metrics and retries add)")
        print(f"{ours} added p99 latency: {o.p99_ms - d.p99_ms:.3f} ms (aim <= 1 ms)")
    for n in notes:
        print("note:", n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
