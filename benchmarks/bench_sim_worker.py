"""Concurrent streams per CPU core of ``fulcrum sim-worker``: does the emulator keep the profile's timing?

Run: ``python benchmarks/bench_sim_worker.py [--n 1,100,300,500] [--isl 128] [--osl 128] [--tp 8]``

For each N, one ``fulcrum sim-worker`` process is started pinned to one core (``taskset -c --core``), with
``--max-num-seqs`` ≥ N so that all N run in one batch; N streaming clients (aiohttp, in this process, pinned to
``--client-core``) each send one completion of ``--isl`` prompt tokens and ``--osl`` output tokens, all at
once. Measured per N:

- achieved tokens/s: output tokens received by the clients / wall time from the first request to the last
  ``[DONE]``;
- measured TPOT: per request (last token − first token) / (osl − 1), client-side, mean over requests;
- model TPOT: the same quantity in the engine model's virtual time (:class:`fulcrum.worker.sim_engine.SimEngine`
  run on the same workload without I/O) — what the profile says the emulated engine should show, prefill
  interference of the N arriving prompts included;
- profile tpot(N, isl + osl/2): the pure decode step of the profile, for reference.

The figure: the largest N whose measured TPOT stays within 10% of the model TPOT ("hundreds of concurrent
streams on one CPU core"), and each N's tokens/s as a ratio to N = 1's (the baseline, measured in the same run).
The KV capacity is set large enough for all N (``--kv-capacity-tokens``): this measures the emulator's CPU
cost, not KV pressure. Numbers depend on the machine; on a shared machine other processes steal from both cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

import aiohttp

from fulcrum.ratio.profiles import resolve_profile
from fulcrum.worker.sim_engine import SimEngine, SimEngineConfig


@dataclass
class Result:
    n: int
    tokens_per_s: float
    measured_tpot_s: float
    model_tpot_s: float
    profile_tpot_s: float
    measured_ttft_s: float
    model_ttft_s: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prompt_of(i: int, isl: int) -> list[int]:
    return [(31 * i + 7 * j) % 200 + 32 for j in range(isl)]


def model_run(args: argparse.Namespace, n: int) -> tuple[float, float]:
    """(mean TPOT, mean TTFT) in the engine model's virtual time, seconds."""
    profile = resolve_profile(args.profile)
    e = SimEngine(profile, SimEngineConfig(tp=args.tp, kv_capacity_tokens=args.kv_capacity_tokens,
                                           max_num_seqs=max(n, 1), max_num_batched_tokens=8192))
    for i in range(n):
        e.add_request(f"r{i}", prompt_of(i, args.isl), args.osl, now=0.0)
    t = 0.0
    times: dict[str, list[float]] = {}
    while (out := e.step(t)) is not None:
        t += out.duration
        for o in out.outputs:
            times.setdefault(o.request_id, []).append(t)
    tpots = [(v[-1] - v[0]) / (len(v) - 1) for v in times.values()]
    return sum(tpots) / len(tpots), sum(v[0] for v in times.values()) / len(times)


async def clients(url: str, n: int, isl: int, osl: int) -> tuple[float, list[float], list[float], int]:
    """(wall seconds, TPOT per request, TTFT per request, output tokens received)."""
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def one(i: int) -> tuple[float, float, int]:
            t0 = time.monotonic()
            stamps: list[float] = []
            async with session.post(url + "/v1/completions", json={
                    "prompt": prompt_of(i, isl), "max_tokens": osl, "stream": True}) as r:
                r.raise_for_status()
                async for line in r.content:
                    if line.startswith(b"data: {") and b'"finish_reason": null' in line:
                        stamps.append(time.monotonic())
            return (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1), stamps[0] - t0, len(stamps)

        start = time.monotonic()
        got = await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.monotonic() - start
    return wall, [g[0] for g in got], [g[1] for g in got], sum(g[2] for g in got)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sim-worker exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:  # noqa: S310 (loopback)
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("sim-worker did not become healthy")


def measure(args: argparse.Namespace, n: int) -> Result:
    port = free_port()
    cmd = [sys.executable, "-m", "fulcrum", "sim-worker", "--profile", args.profile, "--tp", str(args.tp),
           "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(max(n, 1)),
           "--kv-capacity-tokens", str(args.kv_capacity_tokens), "--log-level", "warning"]
    if args.core >= 0:
        cmd = ["taskset", "-c", str(args.core), *cmd]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        wall, tpots, ttfts, tokens = asyncio.run(clients(url, n, args.isl, args.osl))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    model_tpot, model_ttft = model_run(args, n)
    profile = resolve_profile(args.profile)
    return Result(n, tokens / wall, sum(tpots) / len(tpots), model_tpot,
                  profile.tpot(n, args.isl + args.osl / 2, args.tp), sum(ttfts) / len(ttfts), model_ttft)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", default="1,100,300,500", help="comma-separated stream counts (the first is the baseline)")
    p.add_argument("--profile", default="splitwise-llama2-70b-h100")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--isl", type=int, default=128)
    p.add_argument("--osl", type=int, default=128)
    p.add_argument("--kv-capacity-tokens", type=int, default=2_000_000)
    p.add_argument("--core", type=int, default=0, help="core the sim-worker is pinned to (-1: not pinned)")
    p.add_argument("--client-core", type=int, default=1, help="core the clients are pinned to (-1: not pinned)")
    args = p.parse_args()
    if args.client_core >= 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.client_core})
    ns = [int(x) for x in args.n.split(",") if x.strip()]
    print(f"sim-worker on core {args.core}, clients on core {args.client_core}; profile {args.profile} TP {args.tp}; "
          f"ISL {args.isl}, OSL {args.osl}, time scale 1")
    print(f"{'N':>5} {'tokens/s':>10} {'x base':>7} {'TPOT ms':>8} {'model ms':>9} {'ratio':>6} "
          f"{'profile ms':>11} {'TTFT ms':>8} {'model ms':>9}")
    results: list[Result] = []
    for n in ns:
        r = measure(args, n)
        results.append(r)
        base = results[0].tokens_per_s
        print(f"{r.n:>5} {r.tokens_per_s:>10.0f} {r.tokens_per_s / base:>7.1f} {r.measured_tpot_s * 1e3:>8.1f} "
              f"{r.model_tpot_s * 1e3:>9.1f} {r.measured_tpot_s / r.model_tpot_s:>6.3f} "
              f"{r.profile_tpot_s * 1e3:>11.1f} {r.measured_ttft_s * 1e3:>8.1f} {r.model_ttft_s * 1e3:>9.1f}",
              flush=True)
    ok = [r.n for r in results if r.measured_tpot_s <= 1.10 * r.model_tpot_s]
    print(f"largest N with measured TPOT within 10% of the model's: {max(ok) if ok else 'none'} "
          f"(of {', '.join(str(n) for n in ns)}) on one core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
