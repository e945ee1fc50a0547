"""Decode rescheduling in the live router: ARES Algorithm 1 over the router's own view of running requests, and
the recompute migration that executes its decisions without breaking the client's stream (ARES §5.2; issue 5).

**What is tracked.** With router config ``rescheduling.enabled``, every request that can be continued elsewhere
(the conditions of a split past the prompt, :func:`migratable`) runs through :func:`run_migratable`: the engine
is called on ``/v1/completions`` with the prompt's token ids, ``stream = true`` and ``return_token_ids``, whatever
the client asked, so the router knows each generated token id as it comes; the client gets its own format
(streamed events or one whole answer, completions or chat) under the router's id. The :class:`Rescheduler` keeps
one :class:`TrackedRequest` per such request: its instance, P, the tokens generated so far g (N(r) = P + g) and
N̂(r) from :class:`~fulcrum.routing.remaining_length.RemainingLengthPredictor`, which every finished request feeds.
Requests the router does not track (prefill legs, requests that cannot migrate) are counted on their instance
as one pinned pseudo-request holding the rest of the router's ``running_tokens`` for it, so the loads stay true.

**The loop** (``interval_s``, default 1 s, ARES's period): :meth:`Rescheduler.step` builds one
:class:`~fulcrum.rebalancing.decode_rescheduling.DecodeInstanceLoad` per decode-capable instance (role "decode"
or "both", after role reassignment's duty; draining ones as sources only), with T_exec = the instance's measured
inter-token time (EWMA over the tracked streams) and C_mem = its ``kv_capacity_tokens``, calls
:func:`~fulcrum.rebalancing.decode_rescheduling.plan_migration` with the planner's own hysteresis (``min_gain``,
``request_cooldown_s``, ``instance_cooldown_s``) and marks the chosen request for migration.

**The migration is a recompute.** vLLM 0.32 cannot hand over the KV of a request that is running: the NIXL
connector exports KV only for requests that were *started* with ``kv_transfer_params.do_remote_decode`` and
only once they *finish* (``request_finished`` → ``delay_free_blocks``; an abort frees the blocks at once), so a
request can neither keep decoding on A while B pulls, nor be stopped on A with its blocks kept. So the relay of A
stops at a token boundary k (the next event after the mark whose text is complete: no UTF-8 character
half-sent), the connection to A is closed (vLLM aborts the request and frees its KV), and B gets
``prompt = P ids + the k generated ids``, ``max_tokens`` = the remainder (``min_tokens`` reduced by k), streamed;
its events continue the client's stream (or answer). Cost: B prefills P + k tokens (prefix caching on B does not
help the first time; ``fulcrum_router_migrated_tokens`` counts them) and the client's stream pauses for that
prefill (``fulcrum_router_migration_seconds``). Greedy decoding continues exactly; sampled decoding continues
from the same context (the client never sees a token A generated after the cut).

**Failures never lose the stream.** When the target fails before or while continuing (A is aborted by then), the
same continuation (P + tokens so far) is resumed on another decode-capable instance (least loaded first; the
instance it was moved away from only when no other is left), up to ``max_retries`` times (``fulcrum_router_migration_fallbacks{to}``); the same holds for an
instance that fails mid-stream after its first token. Only when every instance fails does the client get the
error event, as without rescheduling. A streamed chunk whose shape the leg cannot read is such a failure ("broken",
recorded against the instance), checked as on the split path (``fulcrum.router.handoff``: ``choices`` a non-empty
list of objects, ``text`` a string, ``token_ids`` non-negative integers); before the first token the router routes
the request again, as after any failure of a first leg.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from fulcrum.rebalancing.decode_rescheduling import DecodeInstanceLoad, DecodeRequestLoad, Migration, plan_migration
from fulcrum.router.config import ReschedulingSection, RouterConfig
from fulcrum.router.handoff import _one_choice as one_choice  # the split path's checks of an engine's answer
from fulcrum.router.handoff import _token_ids as token_ids
from fulcrum.router.handoff import (
    AnswerShape,
    completions_body,
    disagg_blocker,
    handoff_is_safe,
    prefill_body,
    remote_block_count,
    remote_token_count,
    run_prefill,
    split_blocker,
    whole_usage,
)
from fulcrum.router.metrics import RouterMetrics
from fulcrum.routing.base import InstanceView
from fulcrum.router.relay import ClientSink, Exchange, Outcome, stream_timeout
from fulcrum.routing.remaining_length import RemainingLength
from fulcrum.router.sse import EventSplitter, encode_event, event_payload, is_usage_only
from fulcrum.router.upstream import Ticket, UpstreamFailure, UpstreamPool, upstream_message

__all__ = [
    "MigrationReason",
    "TrackedRequest",
    "Rescheduler",
    "migratable",
    "run_migratable",
    "run_disaggregated_migratable",
]

log = logging.getLogger(__name__)

MigrationReason = Literal["load", "duty", "forced"]
"""Why a request moves: ARES Alg. 1 (load), its instance took prefill duty (duty), or a caller asked (forced)."""

_STEP_EWMA = 0.2
"""Weight of the newest inter-token gap in an instance's measured step time."""


@dataclass(slots=True)
class TrackedRequest:
    """One running request the rescheduler may move.

    Attributes:
        request_id: the router's id. model: the served model name (the predictor's key).
        instance: where it runs now. prompt_tokens: P, tokens. generated: g, tokens relayed so far.
        max_tokens: the output cap, tokens. movable: False while the engine gives no token ids.
        target: the instance it is to move to (set by the loop, taken by the relay at the next boundary).
        reason: why it moves. moves: migrations done so far.
    """

    request_id: str
    model: str
    instance: str
    prompt_tokens: int
    max_tokens: int
    generated: int = 0
    movable: bool = True
    target: str | None = None
    reason: MigrationReason = "load"
    moves: int = 0

    @property
    def tokens(self) -> int:
        """N(r) = P + g, tokens of KV it holds."""
        return self.prompt_tokens + self.generated


class Rescheduler:
    """The router's decode rescheduler: tracked requests, measured step times and the ARES loop (module doc).

    Args:
        predictor: remaining-length predictor (ARES §4), fed by :meth:`observe_finished`.
        clock: monotonic seconds (injected).
    """

    def __init__(self, predictor: RemainingLength, clock: Callable[[], float]) -> None:
        self.predictor = predictor
        self.clock = clock
        self.requests: dict[str, TrackedRequest] = {}
        self.step_time_s: dict[str, float] = {}
        self.last_moved_s: dict[str, float] = {}
        self.last_received_s: dict[str, float] = {}
        self.migrations: list[Migration] = []
        """Every plan the loop executed, newest last (bounded to the last 1,000)."""

    # ------------------------------------------------------------------ tracking
    def track(self, request_id: str, model: str, instance: str, prompt_tokens: int, max_tokens: int) -> TrackedRequest:
        """Start tracking a running request."""
        tr = TrackedRequest(request_id, model, instance, prompt_tokens, max_tokens)
        self.requests[request_id] = tr
        return tr

    def untrack(self, request_id: str) -> None:
        """Stop tracking (the request ended, however)."""
        self.requests.pop(request_id, None)
        self.last_moved_s.pop(request_id, None)

    def observe_gap(self, instance: str, gap_s: float) -> None:
        """One measured inter-token gap on ``instance``, seconds (EWMA → T_exec)."""
        if gap_s <= 0 or not math.isfinite(gap_s):
            return
        old = self.step_time_s.get(instance)
        self.step_time_s[instance] = gap_s if old is None else (1 - _STEP_EWMA) * old + _STEP_EWMA * gap_s

    def observe_finished(self, model: str, prompt_tokens: int, output_tokens: int) -> None:
        """A request finished: feed the remaining-length predictor (every request, tracked or not)."""
        self.predictor.observe(model, prompt_tokens, output_tokens)

    def request_migration(self, request_id: str, target: str, reason: MigrationReason = "forced") -> bool:
        """Mark a tracked request to move to ``target`` at its next token boundary; False when it cannot."""
        tr = self.requests.get(request_id)
        if tr is None or not tr.movable or target == tr.instance:
            return False
        tr.target, tr.reason = target, reason
        return True

    def on(self, instance: str) -> list[TrackedRequest]:
        """The tracked requests running on ``instance``."""
        return [t for t in self.requests.values() if t.instance == instance]

    # ------------------------------------------------------------------ planning
    def loads(self, views: Sequence[InstanceView], section: ReschedulingSection,
              now: float) -> tuple[list[DecodeInstanceLoad], dict[str, float]]:
        """Alg. 1's "Collect States": one load per decode-capable instance, and the requests the planner must
        not move (pinned: already marked, without token ids, or the untracked rest), as a cooldown map. The untracked
        rest of an instance (its ``running_tokens`` beyond the tracked requests' tokens) is one entry with
        N̂ = ``horizon_steps`` + 1: it counts at every horizon point, t = H included (ARES eq. 4, Alg. 1 line 13)."""
        pinned: dict[str, float] = dict(self.last_moved_s)  # a pinned request never passes the cooldown: +inf
        by_inst: dict[str, list[DecodeRequestLoad]] = {}
        for tr in self.requests.values():
            g = tr.generated
            rem = self.predictor.predict_remaining(tr.model, tr.prompt_tokens, g, tr.max_tokens)
            by_inst.setdefault(tr.instance, []).append(DecodeRequestLoad(tr.request_id, tr.tokens, float(rem)))
            if not tr.movable or tr.target is not None:
                pinned[tr.request_id] = math.inf
        out = []
        for v in views:
            if v.role == "prefill" or not v.healthy:
                continue
            reqs = by_inst.get(v.id, [])
            rest = v.running_tokens - sum(r.tokens for r in reqs)
            if rest > 0:  # untracked work on the instance: counted, never moved
                rid = f"_untracked:{v.id}"
                # its length is unknown: it outlives the horizon, so N̂ = H + 1 keeps it in N̂_i(t) up to t = H
                # inclusive (ARES Alg. 1 line 13 sums t = 1..H; a request counts while t < N̂), as the replay's
                # current_only (fulcrum.replay.rescheduling) does
                reqs = [*reqs, DecodeRequestLoad(rid, rest, float(section.horizon_steps + 1))]
                pinned[rid] = math.inf
            cap = v.kv_capacity_tokens or section.default_kv_capacity_tokens or math.inf
            # b_t of the recompute filter: every request in flight there, tracked or not (the untracked rest is
            # one entry above, however many requests it holds)
            out.append(DecodeInstanceLoad(v.id, tuple(reqs), float(cap),
                                          self.step_time_s.get(v.id, section.default_step_time_s),
                                          accepting=v.available, batch=max(v.inflight, len(reqs))))
        return out, pinned

    def step(self, views: Sequence[InstanceView], section: ReschedulingSection, now: float) -> Migration | None:
        """One period of ARES Alg. 1: plan and mark at most one migration (None when nothing should move)."""
        loads, pinned = self.loads(views, section, now)  # pinned requests ride on the request cooldown map
        cfg = section.planner()
        plan = plan_migration(loads, cfg, now_s=now, last_moved_s=pinned, last_received_s=self.last_received_s)
        if plan is None or not self.request_migration(plan.request_id, plan.target, "load"):
            return None
        self.last_moved_s[plan.request_id] = now
        self.last_received_s[plan.target] = now
        self.migrations.append(plan)
        del self.migrations[:-1000]
        log.info("migrating %s from %s to %s (%d tokens): %s", plan.request_id, plan.source, plan.target,
                 plan.tokens, plan.reason)
        return plan


# ---------------------------------------------------------------------------------------------- execution
def migratable(ex: Exchange, config: RouterConfig) -> str | None:
    """Why ``ex`` cannot run migratable (None when it can): the split's conditions (:func:`split_blocker`), no
    client ``return_token_ids``/``prompt_logprobs``, and a known output cap."""
    why = disagg_blocker(ex) or split_blocker(ex)
    if why is not None:
        return why
    if ex.body.get("return_token_ids") or ex.body.get("prompt_logprobs"):
        return "token ids or prompt logprobs asked"
    if ex.max_tokens is None and not (config.max_model_len or ex.prompt.max_model_len):
        return "no output cap"
    return None


@dataclass(slots=True)
class _Progress:
    """What the client has of the answer so far (tokens up to the last clean boundary)."""

    ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finish: Any = None
    stop_reason: Any = None
    first_sent: bool = False
    pending_ids: list[int] = field(default_factory=list)
    pending_text: str = ""
    last_token_at: float | None = None


async def _leg(pool: UpstreamPool, ex: Exchange, iid: str, body: dict[str, Any], sink: ClientSink, ticket: Ticket,
               pr: _Progress, tr: TrackedRequest, shape: AnswerShape, resched: Rescheduler, on_first: Callable[[], None],
               relay_4xx: bool) -> bool | Outcome:
    """Relay one engine's part; True when it finished the request, False when it stopped for a migration, the
    engine's 4xx answer as an :class:`Outcome` when ``relay_4xx`` (nothing was done yet: the client's error).

    Raises:
        UpstreamFailure: the engine failed (5xx, cut, timeout, error event, an event that is not JSON or whose
            shape :func:`_take` cannot read, or a 4xx; the caller decides). A failure raised while the answer is
            read is recorded against ``iid`` once, by :meth:`UpstreamPool.open` around it.
    """
    loop = asyncio.get_running_loop()
    t = pool.config.timeouts
    # as fulcrum.router.relay: first_token_s from the call's start until the first token, then idle_s from the
    # engine's latest bytes (paused while the client takes a token); the socket's read limit is only a backstop
    deadline = asyncio.timeout_at(loop.time() + t.first_token_s)
    first = True
    try:
        async with deadline:
            async with pool.open(iid, "/v1/completions", body, stream=True) as resp:
                if resp.status != 200:
                    raw = await resp.read()
                    if relay_4xx:
                        return Outcome(resp.status, raw, instance=iid)
                    # a busy instance (429) is not a broken one: resumed elsewhere, not recorded against it
                    raise UpstreamFailure(iid, "status", upstream_message(raw, resp.status), resp.status,
                                          instance_fault=resp.status != 429)
                splitter = EventSplitter()
                done = False
                async for chunk in resp.content.iter_any():
                    if not first:  # the engine sent bytes: it is not silent
                        deadline.reschedule(loop.time() + t.idle_s)
                    for ev in splitter.feed(chunk):
                        if ev.startswith(b"data: [DONE]"):
                            done = True
                            continue
                        payload = event_payload(ev)
                        if payload is None:
                            continue
                        try:
                            obj = json.loads(payload)
                        except ValueError as err:
                            raise UpstreamFailure(iid, "broken", f"{iid} sent an event that is not JSON") from err
                        if not isinstance(obj, dict) or is_usage_only(obj):
                            continue
                        if "error" in obj and not obj.get("choices"):
                            err_ = obj["error"]
                            msg = err_.get("message") if isinstance(err_, dict) else str(err_)
                            raise UpstreamFailure(iid, "status", str(msg)[:500] or "engine error in stream", 500)
                        if first:
                            first = False
                            on_first()
                        deadline.reschedule(None)  # the client's pace is not the engine's
                        await _take(obj, ex, sink, ticket, pr, tr, shape, resched, iid)
                        deadline.reschedule(loop.time() + t.idle_s)
                        if pr.finish is None and tr.target is not None and not pr.pending_ids and tr.movable:
                            resp.close()  # vLLM aborts the request and frees its KV
                            return False
                if not done:
                    raise UpstreamFailure(iid, "broken", f"{iid} ended the stream before [DONE]")
    except TimeoutError as err:
        if not deadline.expired():
            raise
        raise stream_timeout(pool, iid, started=not first) from err
    return True


async def _take(obj: dict[str, Any], ex: Exchange, sink: ClientSink, ticket: Ticket, pr: _Progress,
                tr: TrackedRequest, shape: AnswerShape, resched: Rescheduler, iid: str) -> None:
    """One engine event: hold its tokens until their text is whole, then pass them on.

    Raises:
        UpstreamFailure: "broken" (recorded by the pool: :func:`_leg` reads inside ``UpstreamPool.open``): the
            event's shape is not an answer's, checked as on the split path (``fulcrum.router.handoff``):
            ``choices`` is not a non-empty list of objects, the text is not a string, or ``token_ids`` is not a
            list of non-negative integers.
    """
    ch = one_choice(obj, iid)
    ids = token_ids(ch.get("token_ids"), iid, "token_ids")
    text = ch.get("text") or ""
    finish = ch.get("finish_reason")
    if ids is not None:
        pr.pending_ids.extend(ids)
    elif text:
        tr.movable = False  # the engine gives no token ids: the request can finish here only
        pr.pending_ids.append(-1)
    pr.pending_text += text
    whole = bool(pr.pending_text) and not pr.pending_text.endswith("\ufffd")
    if not (whole or finish is not None):
        return
    n = len(pr.pending_ids)
    out_text, pr.pending_text = pr.pending_text, ""
    pr.ids.extend(pr.pending_ids)
    pr.pending_ids.clear()
    pr.text.append(out_text)
    tr.generated = len(pr.ids)
    if n:
        ticket.add_tokens(n)
        now = sink.clock()
        if pr.last_token_at is not None:
            resched.observe_gap(iid, (now - pr.last_token_at) / n)
        pr.last_token_at = now
    if finish is not None:
        pr.finish, pr.stop_reason = finish, ch.get("stop_reason")
    if ex.stream and (out_text or finish is not None or n):
        first = not pr.first_sent
        pr.first_sent = True
        await sink.send(encode_event(shape.chunk(out_text, finish, pr.stop_reason if finish is not None else None,
                                                 first=first)), tokens=n)


def _resume_target(pool: UpstreamPool, failed: Sequence[str], views_filter: Callable[[InstanceView], bool],
                   source: str | None) -> str | None:
    """The least-loaded available decode-capable instance not in ``failed``, other than ``source`` (the instance
    the request was moved away from) when there is one; else ``source``."""
    allowed = {v.id for v in pool.views(failed) if v.available and views_filter(v)}
    ordered = [i for i in pool.available_ids(failed) if i in allowed]
    others = [i for i in ordered if i != source]
    return others[0] if others else (ordered[0] if ordered else None)


async def run_migratable(pool: UpstreamPool, ex: Exchange, iid: str, sink: ClientSink, metrics: RouterMetrics,
                         resched: Rescheduler, ids: Sequence[int], *, max_model_len: int | None,
                         max_resumes: int, kv: dict[str, Any] | None = None,
                         decode_capable: Callable[[InstanceView], bool] = lambda v: v.role != "prefill") -> Outcome:
    """Run ``ex`` on ``iid`` so that it can move mid-way (module doc); the answer in the client's format.

    Args:
        ids: the prompt's token ids (chat: templated). max_model_len: the context limit, tokens (caps a request
            without ``max_tokens``). max_resumes: continuations after failures. kv: A's ``kv_transfer_params``
            for the first leg (a disaggregated decode leg), or None. decode_capable: which instances may take a
            resumed continuation.

    Raises:
        UpstreamFailure: the first leg failed before any token (the caller retries elsewhere as usual), or every
            resume failed for a non-streamed request.
    """
    p = len(ids)
    cap = ex.max_tokens if ex.max_tokens is not None else max(1, (max_model_len or p + 16) - p)
    base = completions_body(ex)
    shape = AnswerShape(ex)
    pr = _Progress()
    tr = resched.track(ex.request_id, ex.model, iid, p, cap)
    current, resumes = iid, 0
    failed: list[str] = []
    cut_at: float | None = None
    source: str | None = None
    try:
        while True:
            k = len(pr.ids)
            body = dict(base, prompt=[*ids, *pr.ids], stream=True, return_token_ids=True,
                        stream_options={"include_usage": True}, max_tokens=cap - k)
            if isinstance(ex.body.get("min_tokens"), int):
                body["min_tokens"] = max(0, ex.body["min_tokens"] - k)
            queued = p + k
            if kv is not None and k == 0 and source is None:
                body["kv_transfer_params"] = kv
                queued = 0
            tr.instance = current
            t_cut: float | None = cut_at

            def first_token(t: float | None = t_cut) -> None:
                if t is not None:
                    metrics.migration_seconds.observe(max(0.0, sink.clock() - t))

            fresh = not pr.ids and source is None and not pr.first_sent
            ticket: Ticket | None = None
            try:
                # inside the try: a resume target the registry dropped a moment ago is an UpstreamFailure
                # ("no longer registered"), and the request resumes on the next target
                ticket = pool.acquire(current, queued, p + k)
                finished = await _leg(pool, ex, current, body, sink, ticket, pr, tr, shape, resched, first_token, fresh)
            except UpstreamFailure as err:
                if fresh and not pr.ids and not pr.first_sent:  # checked now: the leg may have sent tokens
                    raise  # nothing done yet: the router's ordinary retry on another instance
                if not tr.movable or resumes >= max_resumes:
                    raise
                failed.append(current)
                nxt = _resume_target(pool, failed, decode_capable, source)
                if nxt is None:
                    raise
                resumes += 1
                metrics.child(metrics.migration_fallbacks, "source" if nxt == source else "other").inc()
                log.warning("%s failed under %s after %d tokens (%s); resuming on %s", current, ex.request_id,
                            len(pr.ids), err.message, nxt)
                pr.pending_ids.clear()
                pr.pending_text = ""
                source, current, cut_at = current, nxt, sink.clock()
                continue
            finally:
                if ticket is not None:
                    ticket.release()
            if isinstance(finished, Outcome):
                return finished
            if finished:
                break
            target = tr.target
            assert target is not None
            tr.target = None
            tr.moves += 1
            metrics.child(metrics.migrations, tr.reason).inc()
            metrics.migrated_tokens.inc(p + len(pr.ids))
            source, current, cut_at = current, target, sink.clock()
    finally:
        resched.untrack(ex.request_id)
    n = len(pr.ids)
    usage = whole_usage(p, n)
    if ex.stream:
        if ex.client_usage:
            await sink.send(encode_event(shape.usage_chunk(usage)), tokens=0)
        return Outcome(200, None, n, p)
    data = shape.whole("".join(pr.text), pr.finish, pr.stop_reason, usage)
    return Outcome(200, json.dumps(data).encode(), n, p, data)


async def run_disaggregated_migratable(pool: UpstreamPool, ex: Exchange, a: str, b: str, sink: ClientSink,
                                       metrics: RouterMetrics, resched: Rescheduler, ids: Sequence[int], *,
                                       block_size: int, max_model_len: int | None, max_resumes: int,
                                       decode_capable: Callable[[InstanceView], bool] = lambda v: v.role != "prefill") -> Outcome:
    """A prefills (as :func:`fulcrum.router.handoff.run_disaggregated`), B decodes on A's KV through
    :func:`run_migratable`, so the decode part can move later.

    Raises:
        UpstreamFailure: A failed, or B failed before its first token.
    """
    out = await run_prefill(pool, a, ex.path, prefill_body(ex.body, ex.endpoint == "chat"), ex.prompt.count)
    if out.status != 200 or out.data is None:
        return out
    kv = out.data.get("kv_transfer_params")
    ok = isinstance(kv, dict) and handoff_is_safe(len(ids), 0, block_size, remote_block_count(kv), remote_token_count(kv))
    if not ok:
        metrics.child(metrics.handoff_guard, "no-kv" if not isinstance(kv, dict) else "fallback").inc()
    return await run_migratable(pool, ex, b, sink, metrics, resched, ids, max_model_len=max_model_len,
                                max_resumes=max_resumes, kv=kv if ok else None, decode_capable=decode_capable)
