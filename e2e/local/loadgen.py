"""Load for the local-cluster scenarios (e2e/test_local_load.py, e2e/test_local_faults.py, docs/e2e.md "Load and
faults"): a window of a bundled trace, thinned and time-compressed to a bounded request count, driven through
the router's Service proxy by an asyncio/aiohttp client that times every request (TTFT, TPOT from a stream);
and the same window through ``fulcrum replay``'s simulator for the live-vs-replay comparison.

Everything here talks only to loopback addresses the harness handed out.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

__all__ = ["ClientResult", "LoadReport", "TraceWindow", "drive", "replay_window", "slo_attainment",
           "window_requests"]


@dataclass(frozen=True)
class TraceWindow:
    """``[start_s, start_s + duration_s)`` of ``trace``, every ``keep_every``-th request kept, arrivals (from the
    window's start) multiplied by ``time_scale``, prompt lengths capped at ``max_isl`` and outputs at
    ``max_tokens``."""

    trace: str = "azure-code-2023"
    start_s: float = 150.0
    duration_s: float = 240.0
    keep_every: int = 3
    time_scale: float = 0.5
    max_isl: int = 4000
    max_tokens: int = 32


def window_requests(w: TraceWindow) -> list[Any]:
    """The window's requests (``fulcrum.workload.Request``), arrivals from 0, lengths capped."""
    from fulcrum.traces import load_trace

    reqs = load_trace(w.trace, None, start_s=w.start_s, duration_s=w.duration_s).requests
    t0 = w.start_s if reqs and reqs[0].arrival_s >= w.start_s else 0.0
    out = []
    for i, r in enumerate(reqs):
        if i % w.keep_every:
            continue
        out.append(replace(r, arrival_s=(r.arrival_s - t0) * w.time_scale, isl=max(1, min(r.isl, w.max_isl)),
                           osl=max(1, min(r.osl, w.max_tokens))))
    return out


@dataclass
class ClientResult:
    """One request as the client saw it (times in seconds; ``start`` is wall-clock)."""

    index: int
    start: float
    status: int | str
    ok: bool
    ttft_s: float = math.nan
    tpot_s: float = math.nan
    e2e_s: float = math.nan
    tokens: int = 0
    expected_tokens: int = 0
    error: str = ""


@dataclass
class LoadReport:
    results: list[ClientResult] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0

    @property
    def failed(self) -> list[ClientResult]:
        return [r for r in self.results if not r.ok]

    def summary(self, ttft_slo_s: float, tpot_slo_s: float) -> dict[str, Any]:
        ok = [r for r in self.results if r.ok]
        return {"requests": len(self.results), "ok": len(ok), "failed": len(self.failed),
                **slo_attainment([(r.ttft_s, r.tpot_s) for r in ok], ttft_slo_s, tpot_slo_s),
                "duration_s": round(self.ended - self.started, 1)}

    def to_json(self) -> str:
        return json.dumps([asdict(r) for r in self.results])


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(x for x in xs if not math.isnan(x))
    if not xs:
        return math.nan
    k = min(len(xs) - 1, max(0, int(math.ceil(p / 100 * len(xs))) - 1))
    return xs[k]


def slo_attainment(pairs: list[tuple[float, float]], ttft_slo_s: float, tpot_slo_s: float,
                   percentile: float = 90.0) -> dict[str, Any]:
    """Share of requests meeting TTFT, TPOT, both (a request with one output token has no TPOT: it meets it)."""
    if not pairs:
        return {"slo_attainment": math.nan}
    t_ok = [t <= ttft_slo_s for t, _ in pairs]
    p_ok = [math.isnan(p) or p <= tpot_slo_s for _, p in pairs]
    n = len(pairs)
    return {"slo_attainment": round(sum(a and b for a, b in zip(t_ok, p_ok)) / n, 4),
            "ttft_attainment": round(sum(t_ok) / n, 4), "tpot_attainment": round(sum(p_ok) / n, 4),
            f"ttft_p{percentile:g}_s": round(_pct([t for t, _ in pairs], percentile), 3),
            f"tpot_p{percentile:g}_s": round(_pct([p for _, p in pairs], percentile), 4)}


async def _one(session: Any, url: str, model: str, i: int, delay: float, isl: int, osl: int,
               t0: float, out: list[ClientResult]) -> None:
    await asyncio.sleep(max(0.0, t0 + delay - time.monotonic()))
    # the emulator's tokenizer is byte-level: ``isl`` bytes are ``isl`` prompt tokens
    body = {"model": model, "prompt": "x" * isl, "max_tokens": osl, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    start_wall, start = time.time(), time.monotonic()
    res = ClientResult(i, start_wall, "", False, expected_tokens=osl)
    first = last = math.nan
    chunks = 0
    done = False
    try:
        async with session.post(url, json=body) as resp:
            res.status = resp.status
            if resp.status != 200:
                res.error = (await resp.text())[:300]
            else:
                buf = b""
                async for data in resp.content.iter_any():
                    buf += data
                    while b"\n\n" in buf:
                        event, buf = buf.split(b"\n\n", 1)
                        line = event.decode(errors="replace").strip()
                        if not line.startswith("data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == "[DONE]":
                            done = True
                            continue
                        msg = json.loads(payload)
                        if msg.get("usage"):
                            res.tokens = int(msg["usage"].get("completion_tokens") or 0)
                        if any((c.get("text") or "") for c in msg.get("choices") or []):
                            now = time.monotonic()
                            if chunks == 0:
                                first = now
                            last = now
                            chunks += 1
    except Exception as err:  # noqa: BLE001 (every client-visible failure is counted, by kind)
        res.status = type(err).__name__
        res.error = str(err)[:300]
    end = time.monotonic()
    res.e2e_s = end - start
    if not math.isnan(first):
        res.ttft_s = first - start
        n = res.tokens or chunks
        res.tpot_s = (last - first) / (n - 1) if n > 1 else math.nan
    res.ok = res.status == 200 and done and res.tokens == osl
    if res.status == 200 and not res.ok and not res.error:
        res.error = f"incomplete body: done={done} tokens={res.tokens}/{osl} chunks={chunks}"
    out.append(res)


def drive(router_url: str, model: str, requests: list[Any], timeout_s: float = 300.0) -> LoadReport:
    """Send ``requests`` at their arrival times (streamed completions) to ``router_url``; every result."""
    import aiohttp

    report = LoadReport()

    async def run() -> None:
        conn = aiohttp.TCPConnector(limit=0, force_close=False)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
            t0 = time.monotonic() + 0.5
            report.started = time.time() + 0.5
            await asyncio.gather(*(_one(s, router_url.rstrip("/") + "/v1/completions", model, i, r.arrival_s,
                                        r.isl, r.osl, t0, report.results) for i, r in enumerate(requests)))
            report.ended = time.time()

    asyncio.run(run())
    report.results.sort(key=lambda r: r.index)
    return report


def replay_window(requests: list[Any], spec_doc: dict[str, Any], warmup_s: float = 0.0) -> Any:
    """The same requests through ``fulcrum replay``'s simulator (policy ``fulcrum``) with the same spec: the
    ``PolicyRun`` (``summary.slo_attainment``, ``summary.gpu_hours``, ``timeline``)."""
    from fulcrum.api.llmserve import LLMServeSpec
    from fulcrum.ratio.profiles import builtin_profile
    from fulcrum.replay.driver import ReplayOptions, run_policy

    spec = LLMServeSpec.model_validate(spec_doc)
    profile = builtin_profile(spec.profile.name)
    return run_policy("fulcrum", requests, spec, profile, ReplayOptions(warmup_s=warmup_s))
