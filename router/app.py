"""The router's HTTP application: OpenAI-compatible endpoints in front of the upstream pool.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed or not), ``GET /v1/models``,
``GET /health`` (liveness: 200 while the process serves), ``GET /ready`` (503 while no instance is available),
``GET /metrics`` (``fulcrum_router_*``).

One request: validate (400) → count the prompt (``fulcrum.router.tokens``) → context check (400) → the policy's
:class:`~fulcrum.routing.base.RouteDecision` (503 when it finds no instance) → execute it
(``fulcrum.router.handoff``) → relay. An instance that fails before anything reached the client is left out and
the request is routed again, up to ``max_retries`` times; then 502 with the engine's message (at once for a failure
that is not ``retryable``: a queued prefill job the workers refuse as malformed). An engine's 429 before anything
reached the client is routed again the same way (the instance left out, not recorded as failed); the last 429 is
relayed when no other instance takes the request, with the engine's ``Retry-After`` header where it sent a valid one
(the only upstream header passed on). Another 4xx of an engine is
the client's error and is relayed as is (a body that is not a JSON object is put in OpenAI's error shape); another
status that is not 200 (204, 3xx) carries no answer and is a 502. An instance the registry dropped after it was
chosen fails like one that refuses connections (``UpstreamFailure``, not recorded against it) and is routed around.
Once the stream began no status can change: any error ends it with an ``error`` event (the engine's message and
status) and ``[DONE]``, counted under that status. A body over :data:`MAX_BODY_BYTES` is a 413; a router bug is
logged and answered 502 in OpenAI's error shape (never aiohttp's bare 500); so are an unknown path (404) and a
route asked with another method (405, its ``Allow`` header kept), not aiohttp's plain text. A prompt the engine's
tokenizer makes 0 tokens is a 400 (vLLM refuses it).

Executing a decision: :data:`EXECUTORS` maps each decision kind to its executor (colocated, disaggregated, split);
steps common to every kind (a planned prefix pull) run before it. Calls reach the engines through the pool's
transport (``fulcrum.router.transport``). Prefill legs (router config ``prefill_queue``): ``direct`` POSTs them to
the policy's instance A; ``nats`` publishes each engine call that carries ``kv_transfer_params.do_remote_decode``
(the ``disaggregated`` prefill leg and the ``split`` A leg) as a job on the NATS JetStream prefill queue, awaits a
prefill worker's reply (the engine's answer with its ``kv_transfer_params``) and sends the decode leg as in the
direct case (:class:`fulcrum.router.transport.QueuedTransport`, DOPD §V-C). Draining (router config
``draining``): the listed instances are shown to every policy as draining, so they get no new requests, while the
calls in flight on them finish; a reload applies a new list at once.

Rebalancing in flight (router config ``rescheduling``, ``roles``, ``kv_connector``; docs/rebalancing.md): with
``rescheduling`` the requests that can move run through :func:`fulcrum.router.rescheduler.run_migratable` and a
loop runs ARES Alg. 1 every ``interval_s``; with ``roles`` every policy sees each ``both`` instance with its duty
(:class:`fulcrum.router.roles.RoleBalancer`, re-evaluated every ``interval_s``); a policy that plans prefix pulls
(``load_aware`` with ``prefix_pull``) has them executed by :func:`_run_with_prefix_pull` where the engines take a
partial prefix.

Client disconnects cancel the upstream calls (their connections are closed, which aborts the work in vLLM):
while streaming the failed write notices it; before that, the server must run with ``handler_cancellation=True``
(``fulcrum router`` does; so do the tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
from aiohttp import web

from fulcrum.cancellation import cancel_and_wait
from fulcrum.routing.length_predictor import BucketedQuantilePredictor, OutputLengthPredictor, PerModelLengthPredictors
from fulcrum.router.config import ConfigWatcher, RouterConfig
from fulcrum.router.errors import BadRequest, ModelNotFound, NoHealthyInstance, RouterHTTPError, UpstreamError, error_body
from fulcrum.router.handoff import (
    DO_REMOTE_DECODE,
    completions_body,
    disagg_blocker,
    prompt_ids,
    run_colocated,
    run_disaggregated,
    run_split,
)
from fulcrum.router.relay import relay
from fulcrum.router.metrics import CONTENT_TYPE, RouterMetrics
from fulcrum.routing.base import InstanceView, NoInstanceError, Policy, RequestInfo, RouteDecision
from fulcrum.routing.predictor import ExecutionPredictor
from fulcrum.routing.prefix import PrefixIndex, PrefixPull, prompt_block_hashes, pull_costs
from fulcrum.routing.registry import make_policy, reconfigured
from fulcrum.router.prefill_gate import PrefillGate
from fulcrum.router.registry import InstanceRecord, Registry, StaticRegistry
from fulcrum.router.relay import ClientGone, ClientSink, Exchange, Outcome, error_outcome_message
from fulcrum.routing.remaining_length import RemainingLength, RemainingLengthPredictor
from fulcrum.router.rescheduler import Rescheduler, migratable, run_disaggregated_migratable, run_migratable
from fulcrum.router.roles import RoleBalancer
from fulcrum.router.schemas import ChatCompletionRequest, CompletionRequest, Endpoint, parse_request
from fulcrum.router.sse import DONE, encode_event
from fulcrum.router.tokens import count_prompt
from fulcrum.router.transport import HttpTransport, QueuedTransport, new_session, retire_queue
from fulcrum.router.upstream import UpstreamFailure, UpstreamPool, retry_after_of, upstream_message

__all__ = [
    "PolicyFactory",
    "Executor",
    "EXECUTORS",
    "OutputLengthPredictor",
    "RouterState",
    "ROUTER",
    "create_app",
    "default_policy_factory",
    "apply_draining",
    "forget_instance",
]

log = logging.getLogger(__name__)

PolicyFactory = Callable[[str, Mapping[str, Any]], Policy]
"""Builds the policy named in the config with its parameters."""

_ID_PREFIX = uuid.uuid4().hex[:12]
_ID_COUNTER = itertools.count()
"""Request ids: a random per-process prefix and a counter (unique, and cheaper than a uuid per request)."""

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's (and vLLM's) ``max_tokens`` when a completions request leaves it out."""

MAX_BODY_BYTES: Final = 64 * 1024 * 1024
"""The largest request body the router reads (aiohttp's ``client_max_size``); a larger one is a 413."""


def default_policy_factory(name: str, params: Mapping[str, Any]) -> Policy:
    """Fulcrum's policy ``name`` built with ``params`` (``fulcrum.routing.registry.make_policy``).

    Raises:
        ValueError: unknown policy or parameter.
    """
    return make_policy(name, params)


@dataclass
class RouterState:
    """Everything one router process holds (one per application)."""

    config: RouterConfig
    registry: Registry
    policy_factory: PolicyFactory
    policy: Policy
    metrics: RouterMetrics
    predictor: PerModelLengthPredictors
    """Output-length predictors, one per served model (Libra §4.1: per-model quantile estimate + margin)."""
    clock: Callable[[], float]
    config_path: Path | None = None
    pool: UpstreamPool | None = None
    transport: QueuedTransport | None = None
    """The pool's transport: direct HTTP, prefill legs through the NATS prefill queue while one is in use."""
    watcher: ConfigWatcher | None = None
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    owns_registry: bool = False
    rescheduler: Rescheduler | None = None
    """Decode rescheduling (router config ``rescheduling``): tracked requests and the ARES loop."""
    roles: RoleBalancer | None = None
    """Duties of ``both`` instances (router config ``roles``)."""
    prefill_gate: PrefillGate | None = None
    """DOPD Alg. 1 grouping of short prompts before their prefill legs (policies whose ``capabilities.prefill_batcher`` is set)."""

    def views(self, exclude: list[str] | tuple[str, ...] = ()) -> list[InstanceView]:
        """The instances as the policies see them: with role reassignment on, ``both`` instances show their duty."""
        assert self.pool is not None
        views = self.pool.views(exclude)
        if self.config.roles.enabled and self.roles is not None:
            return self.roles.apply(views)
        return views

    def apply_config(self, new: RouterConfig) -> None:
        """Switch to a new config: the policy reconfigured in place or a new one from ``policy_factory`` if its
        section changed (:func:`fulcrum.routing.registry.reconfigured`; new prefill gates only when a new policy
        or new DOPD Alg. 1 grouping comes with it), new static instances, new timeouts.

        A policy that cannot be built keeps the old one (logged)."""
        if new.policy != self.config.policy:
            grouping = self.policy.capabilities
            try:
                self.policy = reconfigured(self.policy, new.policy.name, new.policy.params, self.policy_factory)
            except Exception as err:  # noqa: BLE001 - any failure keeps the running policy
                log.error("cannot build policy %r: %s; keeping %r", new.policy.name, err, self.policy.name)
                new = new.model_copy(update={"policy": self.config.policy})
            else:
                if self.policy.capabilities is not grouping:  # a new policy, or new DOPD Alg. 1 grouping
                    self.reset_prefill_gate()
        if self.owns_registry and isinstance(self.registry, StaticRegistry) and new.instances != self.config.instances:
            self.registry.replace(new.records())
        old = self.config
        self.config = new
        if self.pool is not None:
            self.pool.update_config(new)
            apply_draining(self.pool, new.draining)
        if self.transport is not None and new.prefill_queue != old.prefill_queue:
            retired = self.transport.use_queue(new.prefill_queue)
            if retired is not None:
                self.tasks.append(asyncio.create_task(retire_queue(retired, old.prefill_queue.timeout_s),
                                                      name="router-prefill-queue-retire"))

    def reset_prefill_gate(self) -> None:
        """A new DOPD Alg. 1 gate for the current policy (none when it groups no prefills); prompts waiting at
        the old gate are released."""
        if self.prefill_gate is not None:
            self.prefill_gate.close()
        policy = self.policy
        make_batcher = policy.capabilities.prefill_batcher
        self.prefill_gate = (PrefillGate(make_batcher, on_release=self.metrics.prefill_group)
                             if make_batcher is not None else None)


ROUTER: web.AppKey[RouterState] = web.AppKey("fulcrum_router", RouterState)


# ------------------------------------------------------------------------------------------ draining
def apply_draining(pool: UpstreamPool, draining: tuple[str, ...] | list[str]) -> None:
    """Mark exactly the instances in ``draining`` as draining (ids not registered are ignored).

    A draining instance is shown to the policies with ``draining = True`` (every policy skips it) and is left
    out of the fallback and side calls; the calls already in flight on it are untouched and finish."""
    names = set(draining)
    for iid in pool.ids():
        st = pool.state(iid)
        was, st.draining = st.draining, iid in names
        if st.draining != was:
            log.info("instance %s %s", iid, "draining: no new requests" if st.draining else "no longer draining")


_JSON_HEADERS: Final = {"Content-Type": "application/json"}


# ------------------------------------------------------------------------------------------ membership
def forget_instance(policy: Policy, iid: str) -> None:
    """Drop what ``policy`` keeps about instance ``iid``, which left the registry: its prefix-index entry
    (:meth:`fulcrum.routing.prefix.PrefixIndex.forget`; ``load_aware`` and ``disaggregated``, up to
    ``index_blocks_per_instance`` block hashes) and its virtual queue
    (:meth:`fulcrum.routing.predictor.ExecutionPredictor.forget`; ``split``). Without it a departed pod's state
    stays for the router's lifetime and grows with pod churn; an instance that returns under the same id starts
    afresh. Called where the pool drops instances (:func:`_set_records`), never in a policy's ``route()``, whose
    ``instances`` may be a subset of the fleet (the simulator's). Policies holding neither are left as they are."""
    index = getattr(policy, "index", None)
    if isinstance(index, PrefixIndex):
        index.forget(iid)
    predictor = getattr(policy, "predictor", None)
    if isinstance(predictor, ExecutionPredictor):
        predictor.forget(iid)


def _set_records(st: RouterState, records: list[InstanceRecord]) -> None:
    """The registry's instance list into the pool, then the policy forgets the instances that left."""
    assert st.pool is not None
    for iid in st.pool.set_records(records):
        forget_instance(st.policy, iid)
        log.info("instance %s left the registry", iid)


def _json_response(status: int, data: Any) -> web.Response:
    return web.Response(status=status, body=json.dumps(data).encode(), content_type="application/json")


def _error_response(err: RouterHTTPError) -> web.Response:
    return web.Response(status=err.status, body=err.body_bytes(), content_type="application/json")


# ------------------------------------------------------------------------------------------ unmatched requests
def _unmatched_error(request: web.Request, err: web.HTTPNotFound | web.HTTPMethodNotAllowed) -> web.Response:
    """aiohttp's 404 (no route for the path) or 405 (the path's routes take other methods) in OpenAI's error shape
    (OpenAI's own wording for a 404: "Invalid URL (GET /path)"); a 405 keeps its ``Allow`` header."""
    where = f"{request.method} {request.path}"
    if isinstance(err, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(err.allowed_methods))
        body = error_body(f"method not allowed ({where}): {request.path} takes {allowed}", "invalid_request_error")
        headers = {"Allow": err.headers["Allow"]}
    else:
        served = ", ".join(f"{r.method} {r.resource.canonical}" for r in request.app.router.routes()
                           if r.method != "HEAD" and r.resource is not None)
        body = error_body(f"Invalid URL ({where}): the router serves {served}", "invalid_request_error")
        headers = {}
    return web.Response(status=err.status, body=json.dumps(body).encode(), content_type="application/json",
                        headers=headers)


@web.middleware
async def _openai_unmatched(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                            ) -> web.StreamResponse:
    """Answer requests no route matches in OpenAI's error shape (:func:`_unmatched_error`). A matched request
    only passes through (no work beyond the call); the router's own handlers never raise these exceptions."""
    try:
        return await handler(request)
    except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as err:
        return _unmatched_error(request, err)


# ------------------------------------------------------------------------------------------ admission
class _UnreadableBody(BadRequest):
    """400: the request body cannot be read (e.g. it fails its ``Content-Encoding``); the connection is closed
    after the answer, since the rest of the body on it cannot be told from a next request."""


class _BodyTooLarge(RouterHTTPError):
    """413: the request body is larger than :data:`MAX_BODY_BYTES` (in OpenAI's error shape, not aiohttp's
    plain-text 413)."""

    status = 413
    type_ = "invalid_request_error"


async def _admit(st: RouterState, request: web.Request, endpoint: Endpoint, t0: float) -> Exchange:
    assert st.pool is not None
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as err:
        raise _BodyTooLarge(f"the request body is larger than the router's limit of {MAX_BODY_BYTES} bytes "
                            f"({MAX_BODY_BYTES // (1024 * 1024)} MiB)") from err
    except (web.RequestPayloadError, aiohttp.ClientPayloadError) as err:  # e.g. a Content-Encoding that fails
        # nothing more can be read: without this aiohttp would try to drain the rest after the answer, meet the
        # same error again and log it as unhandled (the connection is closed after the answer, _UnreadableBody)
        request.content.feed_eof()
        raise _UnreadableBody(f"cannot read the request body: {' '.join(str(err).split())}") from err
    req, body = parse_request(raw, endpoint)
    cfg = st.config
    if isinstance(req, CompletionRequest):
        req.single_prompt()  # batches and empty prompts are 400s before any work
    model = req.model
    if cfg.model is not None:
        if model is not None and model != cfg.model:
            raise ModelNotFound(f"the model {model!r} does not exist; this router serves {cfg.model!r}",
                                param="model", code="model_not_found")
        model = cfg.model
    as_sent = "kv_transfer_params" not in body and (model is None or body.get("model") == model)
    if model is not None:
        body["model"] = model
    body.pop("kv_transfer_params", None)
    prompt = await count_prompt(st.pool, req, body, model, cfg.token_count)
    if prompt.exact and prompt.count == 0:  # vLLM refuses a prompt of no tokens ("The decoder prompt cannot be empty")
        field_ = "prompt" if endpoint == "completions" else "messages"
        raise BadRequest(f"prompt must not be empty: {field_} has no tokens once tokenized, and the engine refuses "
                         "an empty prompt; send at least one token", param=field_)
    cap = req.output_cap() if isinstance(req, ChatCompletionRequest) else (req.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS)
    max_len = cfg.max_model_len or prompt.max_model_len
    if max_len is not None:
        if cap is not None and cap > max_len:
            raise BadRequest(f"max_tokens is {cap}, more than the model's context of {max_len} tokens",
                             param="max_tokens")
        if prompt.exact and prompt.count >= max_len:
            raise BadRequest(f"the prompt is {prompt.count} tokens; the model's context is {max_len} tokens",
                             param="prompt" if endpoint == "completions" else "messages", code="context_length_exceeded")
        if prompt.exact and cap is not None and prompt.count + cap > max_len:
            raise BadRequest(f"this model's maximum context length is {max_len} tokens; the request asks for "
                             f"{prompt.count + cap} ({prompt.count} in the prompt, {cap} to generate)",
                             param="max_tokens", code="context_length_exceeded")
    stream = req.stream is True
    client_usage = bool(stream and req.stream_options is not None and req.stream_options.include_usage)
    if stream:
        so = dict(body.get("stream_options") or {})
        so["include_usage"] = True
        body["stream_options"] = so
    return Exchange(
        request_id=f"{_ID_PREFIX}{next(_ID_COUNTER):x}", endpoint=endpoint, req=req, body=body, stream=stream,
        client_usage=client_usage, prompt=prompt, max_tokens=cap, model=model or "", created=int(time.time()), t0=t0,
        raw=raw if as_sent and not stream else None,
    )


# ------------------------------------------------------------------------------------------ routing
def _route(st: RouterState, info: RequestInfo, exclude: list[str]) -> RouteDecision:
    assert st.pool is not None
    views = st.views(exclude)
    try:
        decision = st.policy.route(info, views, st.clock())
    except NoInstanceError:
        raise
    except Exception:  # noqa: BLE001 - a policy bug must not take requests down
        log.exception("policy %s failed; routing %s to the least loaded instance", st.policy.name, info.request_id)
        return _fallback_decision(st, exclude, "policy-error")
    pool = st.pool
    if decision.first not in pool or (decision.second is not None and decision.second not in pool):
        log.error("policy %s chose an unknown instance (%s, %s)", st.policy.name, decision.first, decision.second)
        return _fallback_decision(st, exclude, "policy-error")
    if decision.kind not in EXECUTORS:
        log.error("policy %s made a decision of unknown kind %r", st.policy.name, decision.kind)
        return _fallback_decision(st, exclude, "policy-error")
    if st.config.draining and any(i is not None and st.pool.state(i).draining for i in (decision.first, decision.second)):
        log.error("policy %s chose a draining instance (%s, %s)", st.policy.name, decision.first, decision.second)
        return _fallback_decision(st, exclude, "policy-error")
    return decision


def _fallback_decision(st: RouterState, exclude: list[str], reason: str) -> RouteDecision:
    assert st.pool is not None
    ids = st.pool.available_ids(exclude)
    if not ids:
        raise NoInstanceError("no available instance")
    return RouteDecision(kind="colocated", first=ids[0], reason=reason)


Executor = Callable[["RouterState", Exchange, RouteDecision, ClientSink], Awaitable[Outcome]]
"""Runs one decision of its kind: (state, exchange, decision, the client's sink) → the outcome to answer.

Raises :class:`UpstreamFailure` (the caller retries while nothing was streamed), :class:`RouterHTTPError`
(answered as is) or :class:`ClientGone`."""


async def _execute(st: RouterState, ex: Exchange, d: RouteDecision, sink: ClientSink) -> Outcome:
    """Run a decision: a prefix pull the policy planned for it (any kind may have one; the policy forgets it once
    taken), else the executor of its kind (:data:`EXECUTORS`)."""
    take = st.policy.capabilities.take_prefix_pull
    pull = take(ex.request_id) if take is not None else None
    if pull is not None and d.kind == "colocated" and pull.target == d.first:
        out = await _run_with_prefix_pull(st, ex, pull, sink)
        if out is not None:
            return out
    return await EXECUTORS[d.kind](st, ex, d, sink)


async def _execute_colocated(st: RouterState, ex: Exchange, d: RouteDecision, sink: ClientSink) -> Outcome:
    """``colocated``: instance A runs the whole request (migratable when decode rescheduling is on)."""
    assert st.pool is not None
    out = await _execute_migratable(st, ex, d, sink)
    if out is not None:
        return out
    return await run_colocated(st.pool, ex, d.first, sink)


async def _execute_disaggregated(st: RouterState, ex: Exchange, d: RouteDecision, sink: ClientSink) -> Outcome:
    """``disaggregated``: A prefills, B decodes on A's KV (``fulcrum.router.handoff.run_disaggregated``); a short
    prompt first waits at the DOPD Alg. 1 gate when the policy groups prefills. Without B it runs colocated on A;
    a request that cannot be handed off runs colocated on B (``handoff_guard{action="not-handed-off"}``)."""
    assert st.pool is not None
    if d.second is not None and st.prefill_gate is not None and disagg_blocker(ex) is None:
        view = st.pool.view_of(d.first)
        idle = view is None or view.queued_prefill_tokens == 0
        await st.prefill_gate.admit(d.first, ex.prompt.count, idle=idle)
    out = await _execute_migratable(st, ex, d, sink)
    if out is not None:
        return out
    if d.second is None:
        return await run_colocated(st.pool, ex, d.first, sink)
    if disagg_blocker(ex) is not None:
        st.metrics.child(st.metrics.handoff_guard, "not-handed-off").inc()
        return await run_colocated(st.pool, ex, d.second, sink)
    return await run_disaggregated(st.pool, ex, d.first, d.second, sink, st.metrics, st.config.kv_block_size)


async def _execute_split(st: RouterState, ex: Exchange, d: RouteDecision, sink: ClientSink) -> Outcome:
    """``split`` at token s (Libra §4.1): past the prompt (k = s − P > 0) A generates k tokens and B continues
    (``run_split``); inside the prompt (s < P) A prefills the head and B the rest (:func:`_run_partial_split`);
    at the prompt's end as ``disaggregated``. Migratable (decode rescheduling) only when k = 0."""
    assert st.pool is not None
    if d.handoff_after == 0:
        out = await _execute_migratable(st, ex, d, sink)
        if out is not None:
            return out
    if d.second is None:
        return await run_colocated(st.pool, ex, d.first, sink)
    if disagg_blocker(ex) is not None:
        st.metrics.child(st.metrics.handoff_guard, "not-handed-off").inc()
        return await run_colocated(st.pool, ex, d.second, sink)
    bs = st.config.kv_block_size
    if d.handoff_after > 0:
        return await run_split(st.pool, ex, d.first, d.second, d.handoff_after, sink, st.metrics, bs)
    if d.split_token < ex.prompt.count:
        out = await _run_partial_split(st, ex, d, sink)
        if out is not None:
            return out
        st.metrics.child(st.metrics.handoff_guard, "partial-prefix").inc()
    return await run_disaggregated(st.pool, ex, d.first, d.second, sink, st.metrics, bs)


EXECUTORS: Final[Mapping[str, Executor]] = {
    "colocated": _execute_colocated,
    "disaggregated": _execute_disaggregated,
    "split": _execute_split,
}
"""Decision kind (:attr:`RouteDecision.kind`) → its executor; a decision of another kind is a policy error
(``_route`` falls back to the least loaded instance)."""


async def _run_partial_split(st: RouterState, ex: Exchange, d: RouteDecision, sink: ClientSink) -> Outcome | None:
    """A split inside the prompt (Libra §4.1, s < P): A prefills the prompt's first s tokens (rounded down to
    whole KV blocks) and B loads that KV, prefills the rest and decodes — the prefix-pull path with A as the
    holder. Only when both instances load partial prefixes (the split policy decides s < P only then); None =
    run it as s = P (the caller counts ``handoff_guard{action="partial-prefix"}``)."""
    assert st.pool is not None and d.second is not None
    aligned = d.split_token // st.config.kv_block_size * st.config.kv_block_size
    a, b = st.pool.view_of(d.first), st.pool.view_of(d.second)
    if aligned <= 0 or a is None or b is None or not (a.supports_partial_prefix and b.supports_partial_prefix):
        return None
    out = await _run_with_prefix_pull(st, ex, PrefixPull(d.first, d.second, aligned, 0), sink, priced=False)
    if out is not None:
        st.metrics.child(st.metrics.handoff_guard, "partial-split").inc()
    return out


async def _run_with_prefix_pull(st: RouterState, ex: Exchange, pull: PrefixPull, sink: ClientSink,
                                priced: bool = True) -> Outcome | None:
    """BanaServe §4.2 over the engines' caches: the holder hands over the KV of the prompt's first ``pull.tokens``
    tokens (``max_tokens = 1`` on the block-aligned prefix, ``do_remote_decode``) and the chosen instance runs the
    whole request on it, computing the rest (``kv_transfer_params`` with ``do_remote_decode`` and the holder's
    blocks: vLLM's NIXL ``bidirectional_kv_xfer`` path, the only one that loads a partial prefix without
    tripping the decode side's block assertion). None = recompute instead (the reason is counted in
    ``fulcrum_router_prefix_pulls_total{outcome}``): the engines do not support partial prefixes
    (``kv_connector.partial_prefix: false``), recomputing is cheaper, the request cannot be handed off, or the
    holder failed. ``priced=False`` (a split inside the prompt, whose instances already support partial prefixes):
    no support or cost check — the split policy chose where the prompt is cut for balance, not for the transfer."""
    assert st.pool is not None
    m, kvc = st.metrics, st.config.kv_connector
    ids = ex.prompt.ids
    if priced and not kvc.partial_prefix:
        m.child(m.prefix_pulls, "recompute-unsupported").inc()
        return None
    if priced:
        pull_s, recompute_s = pull_costs(pull.tokens - pull.local_tokens, kvc.kv_bytes_per_token, kvc.link_gbps,
                                         kvc.transfer_overhead_s, kvc.prefill_tokens_per_s)
        if pull_s >= recompute_s:
            m.child(m.prefix_pulls, "recompute-cheaper").inc()
            return None
    if ids is None or disagg_blocker(ex) is not None or pull.holder not in st.pool.ids():
        m.child(m.prefix_pulls, "recompute-ineligible").inc()
        return None
    body = dict(completions_body(ex), prompt=list(ids[: pull.tokens]), max_tokens=1, stream=False,
                kv_transfer_params=dict(DO_REMOTE_DECODE))
    body.pop("min_tokens", None)
    try:  # straight to the holder (never through the prefill queue: only the holder has the prefix)
        status, _, data = await st.pool.post_json(pull.holder, "/v1/completions", body, queueable=False)
    except UpstreamFailure as err:
        log.warning("prefix pull from %s failed (%s); recomputing", pull.holder, err.message)
        status, data = 0, None
    kv = data.get("kv_transfer_params") if isinstance(data, dict) else None
    if status != 200 or not isinstance(kv, dict):
        m.child(m.prefix_pulls, "recompute-holder-failed").inc()
        return None
    x_body = dict(ex.body, kv_transfer_params={**kv, "do_remote_decode": True, "do_remote_prefill": False})
    m.child(m.prefix_pulls, "pulled").inc()
    m.prefix_pull_tokens.inc(pull.tokens)
    ticket = st.pool.acquire(pull.target, ex.prompt.count - pull.tokens, ex.prompt.count)
    try:
        return await relay(st.pool, ex, pull.target, ex.path, x_body, sink, ticket,
                           None if ex.stream else _drop_kv_params)
    finally:
        ticket.release()


def _drop_kv_params(obj: dict[str, Any]) -> dict[str, Any]:
    """The engine's whole answer without its ``kv_transfer_params`` (the router's business, not the client's)."""
    return {k: v for k, v in obj.items() if k != "kv_transfer_params"}


async def _execute_migratable(st: RouterState, ex: Exchange, d: RouteDecision, sink: ClientSink) -> Outcome | None:
    """With decode rescheduling on (router config ``rescheduling``), run a colocated or disaggregated decision so
    that its decode part can move (``fulcrum.router.rescheduler``); None when rescheduling is off or the request
    cannot move (it then runs as usual, untracked)."""
    assert st.pool is not None
    if not st.config.rescheduling.enabled or st.rescheduler is None or migratable(ex, st.config) is not None:
        return None
    ids = await prompt_ids(st.pool, ex)
    if ids is None:
        return None
    cfg = st.config
    roles_on = cfg.roles.enabled and st.roles is not None

    def decode_capable(v: InstanceView) -> bool:
        role = st.roles.duties.get(v.id, v.role) if roles_on and st.roles is not None and v.role == "both" else v.role
        return role != "prefill"

    kw: dict[str, Any] = dict(max_model_len=cfg.max_model_len or ex.prompt.max_model_len,
                              max_resumes=cfg.max_retries, decode_capable=decode_capable)
    if d.kind == "colocated" or d.second is None:
        return await run_migratable(st.pool, ex, d.first, sink, st.metrics, st.rescheduler, ids, **kw)
    if d.kind == "split" and d.split_token < ex.prompt.count:
        st.metrics.child(st.metrics.handoff_guard, "partial-prefix").inc()
    return await run_disaggregated_migratable(st.pool, ex, d.first, d.second, sink, st.metrics, st.rescheduler, ids,
                                              block_size=cfg.kv_block_size, **kw)


async def _serve(st: RouterState, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    t0 = st.clock()
    try:
        ex = await _admit(st, request, endpoint, t0)
    except RouterHTTPError as err:
        st.metrics.child(st.metrics.responses, endpoint, str(err.status)).inc()
        refusal = _error_response(err)
        if isinstance(err, _UnreadableBody):
            refusal.force_close()
        return refusal
    except Exception:  # noqa: BLE001 - last resort: a router bug is a 502 in OpenAI's shape, never a bare 500
        log.exception("admitting a %s request failed unexpectedly", endpoint)
        st.metrics.child(st.metrics.responses, endpoint, "502").inc()
        return _error_response(_internal_error())
    st.metrics.child(st.metrics.admitted, endpoint).inc()
    cap = ex.max_tokens if ex.max_tokens is not None else max(1, (st.config.max_model_len or ex.prompt.max_model_len or 4096) - ex.prompt.count)
    hashes: tuple[int, ...] = ()
    block_tokens = st.policy.capabilities.prefix_block_tokens
    if ex.prompt.ids is not None and block_tokens is not None:
        hashes = prompt_block_hashes(ex.prompt.ids, block_tokens)
    info = RequestInfo(request_id=ex.request_id, prompt_tokens=ex.prompt.count, max_tokens=cap,
                       predicted_output_tokens=st.predictor.predict(ex.model, ex.prompt.count, cap), prefix_hashes=hashes)
    st.metrics.input_tokens.observe(ex.prompt.count)
    st.metrics.predicted_output_tokens.observe(info.predicted_output_tokens)
    sink = ClientSink(request, st.metrics, st.clock, t0)
    try:
        resp = await _attempts(st, ex, info, sink)
    except ClientGone:
        st.metrics.aborts.inc()
        st.metrics.child(st.metrics.responses, endpoint, "499").inc()
        return sink.response if sink.response is not None else web.Response(status=499)
    except asyncio.CancelledError:
        st.metrics.aborts.inc()
        st.metrics.child(st.metrics.responses, endpoint, "499").inc()
        raise
    except Exception:  # noqa: BLE001 - last resort: a router bug is a 502 in OpenAI's shape, never a bare 500
        log.exception("request %s failed unexpectedly", ex.request_id)
        bug = _internal_error()
        if sink.started:
            await _stream_error(sink, bug)
            _observe_done(st, ex, sink, None, str(bug.status))
            return sink.answer()
        return _finish_error(st, ex, bug)
    return resp


def _internal_error() -> UpstreamError:
    """The answer to a request that failed on a router bug (logged with its traceback where it is caught)."""
    return UpstreamError("the router failed to serve the request (internal error; see the router's log)")


async def _attempts(st: RouterState, ex: Exchange, info: RequestInfo, sink: ClientSink) -> web.StreamResponse:
    """Route and execute ``ex``, again on another instance (up to ``max_retries`` times) after a retryable
    :class:`UpstreamFailure` or an engine's 429 while nothing was streamed; then the answer, or the last failure
    (502) or 429 as it came."""
    assert st.pool is not None
    exclude: list[str] = []
    last: UpstreamFailure | None = None
    busy: Outcome | None = None  # the latest engine's 429 (too many requests): relayed if no other instance takes it
    for attempt in range(st.config.max_retries + 1):
        try:
            d = _route(st, info, exclude)
        except NoInstanceError as err:
            if busy is not None:
                return await _finish(st, ex, sink, busy)
            if last is not None:
                return _finish_error(st, ex, UpstreamError(last.message))
            return _finish_error(st, ex, NoHealthyInstance(f"no healthy instance can take the request: {err}"))
        if attempt:  # counted once it is actually sent: a retry that finds no instance is none
            st.metrics.child(st.metrics.retries, "before-stream").inc()
        st.metrics.decision(st.policy.name, d.kind, d.reason, d.phi)
        st.metrics.child(st.metrics.routed, d.kind).inc()
        st.policy.on_start(info, d, st.clock())
        try:
            out = await _execute(st, ex, d, sink)
        except UpstreamFailure as err:
            last, busy = err, None
            if sink.started:
                await _stream_error(sink, UpstreamError(err.message))
                _observe_done(st, ex, sink, None, "502")
                return sink.answer()
            if not err.retryable:  # routing it again would fail the same way
                return _finish_error(st, ex, UpstreamError(err.message))
            exclude.append(err.instance)
            continue
        except RouterHTTPError as err:
            if sink.started:
                await _stream_error(sink, err)
                _observe_done(st, ex, sink, None, str(err.status))
                return sink.answer()
            return _finish_error(st, ex, err)
        finally:
            st.policy.on_finish(info.request_id, st.clock())
        if out.status == 429 and not sink.started and attempt < st.config.max_retries:
            # the engine is busy, not broken (not recorded against it): another instance may take the request
            last, busy = None, out
            exclude.extend(i for i in ((out.instance,) if out.instance is not None else (d.first, d.second))
                           if i is not None)
            continue
        return await _finish(st, ex, sink, out)
    assert last is not None
    return _finish_error(st, ex, UpstreamError(last.message))


async def _finish(st: RouterState, ex: Exchange, sink: ClientSink, out: Outcome) -> web.StreamResponse:
    if out.status != 200:
        if sink.started:  # a later leg's answer (a split's B) after the first leg's tokens were streamed
            if out.status >= 400:  # the engine's 4xx: its message and status in the error event
                await _stream_error_event(sink, error_outcome_message(out), "invalid_request_error", out.status)
                status = out.status
            else:  # 204, 3xx ...: no answer
                await _stream_error(sink, UpstreamError(f"the engine answered HTTP {out.status} instead of an answer"))
                status = UpstreamError.status
            _observe_done(st, ex, sink, None, str(status))
            return sink.answer()
        if out.status < 400:  # 204, 3xx ...: no answer to relay
            what = "with no body" if not out.body else "instead of an answer"
            return _finish_error(st, ex, UpstreamError(f"the engine answered HTTP {out.status} {what}"))
        st.metrics.child(st.metrics.responses, ex.endpoint, str(out.status)).inc()
        retry_after = retry_after_of(out.body) if out.status == 429 else None  # the engine's, when it sent one
        headers = _JSON_HEADERS if retry_after is None else {**_JSON_HEADERS, "Retry-After": retry_after}
        return web.Response(status=out.status, body=_error_answer(out), headers=headers)
    _observe_done(st, ex, sink, out, "200")
    if not ex.stream:
        return web.Response(status=200, body=out.body or b"", headers=_JSON_HEADERS)
    await sink.send(DONE, tokens=0)
    await sink.close()
    return sink.answer()


def _observe_done(st: RouterState, ex: Exchange, sink: ClientSink, out: Outcome | None, status: str) -> None:
    m = st.metrics
    m.child(m.responses, ex.endpoint, status).inc()
    now = st.clock()
    m.e2e.observe(now - ex.t0)
    if out is None:
        return
    n = out.completion_tokens
    m.output_tokens.observe(n)
    st.predictor.observe(ex.model, out.prompt_tokens or ex.prompt.count, n)
    if st.rescheduler is not None:
        st.rescheduler.observe_finished(ex.model, out.prompt_tokens or ex.prompt.count, n)
    if sink.first_token_at is not None and n > 1:
        m.tpot.observe((now - sink.first_token_at) / (n - 1))


def _error_answer(out: Outcome) -> bytes:
    """An engine's 4xx body as relayed: a JSON object as it came; anything else (text, HTML, another JSON value,
    nothing) as the OpenAI error object carrying the engine's message."""
    raw = out.body or b""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        data = None
    if isinstance(data, dict):
        return raw
    return json.dumps(error_body(upstream_message(raw, out.status), "invalid_request_error", None, out.status)).encode()


def _finish_error(st: RouterState, ex: Exchange, err: RouterHTTPError) -> web.Response:
    st.metrics.child(st.metrics.responses, ex.endpoint, str(err.status)).inc()
    return _error_response(err)


async def _stream_error(sink: ClientSink, err: RouterHTTPError) -> None:
    """An error after the stream began: an ``error`` event (as vLLM sends), then ``[DONE]``."""
    await _stream_error_event(sink, err.message, err.type_, err.status)


async def _stream_error_event(sink: ClientSink, message: str, type_: str, status: int) -> None:
    """An ``error`` event with ``message``, ``type_`` and ``status`` as its code, then ``[DONE]``."""
    with contextlib.suppress(ClientGone):
        await sink.send(encode_event(error_body(message, type_, None, status)), tokens=0)
        await sink.send(DONE, tokens=0)
        await sink.close()


# ------------------------------------------------------------------------------------------ handlers
async def _completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request.app[ROUTER], request, "completions")


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _serve(request.app[ROUTER], request, "chat")


async def _models(request: web.Request) -> web.Response:
    st = request.app[ROUTER]
    assert st.pool is not None
    names = [st.config.model] if st.config.model else sorted({st.pool.state(i).record.model for i in st.pool.ids()} - {""})
    max_len = st.config.max_model_len or st.pool.learned_max_model_len
    if not names:  # told neither by its config nor by the instances' records: the engines' own answer
        names, engine_len = await st.pool.served_models()
        max_len = max_len or engine_len
    data = [{"id": n, "object": "model", "created": 0, "owned_by": "fulcrum", "max_model_len": max_len} for n in names]
    return _json_response(200, {"object": "list", "data": data})


async def _health(request: web.Request) -> web.Response:
    st = request.app[ROUTER]
    assert st.pool is not None
    avail = len(st.pool.available_ids())
    return _json_response(200, {"status": "ok", "instances": len(st.pool.ids()), "available": avail})


async def _ready(request: web.Request) -> web.Response:
    st = request.app[ROUTER]
    assert st.pool is not None
    avail = len(st.pool.available_ids())
    if avail == 0:
        return _json_response(503, error_body("no instance is available", "service_unavailable"))
    return _json_response(200, {"status": "ready", "available": avail})


async def _metrics(request: web.Request) -> web.Response:
    st = request.app[ROUTER]
    return web.Response(body=st.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})


# ------------------------------------------------------------------------------------------ lifecycle
async def _watch_registry(st: RouterState, sleep: Callable[[float], Any] = asyncio.sleep) -> None:
    """Follow the registry; a watch that fails is logged and started again a second later."""
    assert st.pool is not None
    while True:
        try:
            async for records in st.registry.watch():
                _set_records(st, records)
                apply_draining(st.pool, st.config.draining)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the router keeps its last instance list meanwhile
            log.exception("instance registry watch failed; keeping the last instance list and watching again")
        await sleep(1.0)


async def _watch_queue_depth(st: RouterState, sleep: Callable[[float], Any] = asyncio.sleep) -> None:
    """Every ``prefill_queue.depth_interval_s``: ``fulcrum_router_prefill_queue_depth`` = jobs not yet taken.

    Also connects a new queue ahead of the first request. Failures are logged once per outage; the gauge keeps
    its last value meanwhile."""
    failing = False
    while True:
        queue = st.transport.queue if st.transport is not None else None
        if queue is not None:
            try:
                st.metrics.prefill_queue_depth.set(await queue.depth())
                if failing:
                    log.info("prefill queue depth readable again")
                failing = False
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - NATS away: routing reports it per request
                if not failing:
                    log.warning("cannot read the prefill queue depth: %s", err)
                failing = True
        await sleep(st.config.prefill_queue.depth_interval_s)


async def _reschedule_loop(st: RouterState, sleep: Callable[[float], Any] = asyncio.sleep) -> None:
    """Every ``rescheduling.interval_s`` while enabled: one period of ARES Alg. 1 (``Rescheduler.step``). A
    failing period is logged and the loop goes on."""
    while True:
        cfg = st.config.rescheduling
        if cfg.enabled and st.pool is not None and st.rescheduler is not None:
            try:
                st.rescheduler.step(st.views(), cfg, st.clock())
            except Exception:  # noqa: BLE001 - a planning bug must not stop the router
                log.exception("decode rescheduling period failed")
        await sleep(cfg.interval_s)


async def _roles_loop(st: RouterState, sleep: Callable[[float], Any] = asyncio.sleep) -> None:
    """Every ``roles.interval_s`` while enabled: one role-reassignment evaluation (``RoleBalancer.step``); with
    ``migrate_on_flip`` the running requests of an instance that took prefill duty are marked to move."""
    while True:
        cfg = st.config.roles
        pool = st.pool
        if cfg.enabled and pool is not None and st.roles is not None:
            try:
                waits = pool.oldest_prefill_wait()
                change = st.roles.step(pool.views(), waits, cfg, st.clock())
                if change is not None and change.to_duty == "prefill" and cfg.migrate_on_flip:
                    _move_off(st, change.instance)
            except Exception:  # noqa: BLE001 - a planning bug must not stop the router
                log.exception("role reassignment period failed")
        await sleep(cfg.interval_s)


def _move_off(st: RouterState, iid: str) -> None:
    """Mark every tracked request on ``iid`` to move to the decode-capable instance holding the fewest tokens."""
    if st.rescheduler is None or not st.config.rescheduling.enabled:
        return
    targets = [v for v in st.views() if v.available and v.role != "prefill" and v.id != iid]
    load = {v.id: v.running_tokens for v in targets}
    for tr in st.rescheduler.on(iid):
        if not load:
            return
        to = min(load, key=lambda i: (load[i], i))
        if st.rescheduler.request_migration(tr.request_id, to, "duty"):
            load[to] += tr.tokens


async def _watch_config(st: RouterState, sleep: Callable[[float], Any]) -> None:
    """Poll the config file every ``reload_interval_s``; a poll that fails unexpectedly (an invalid file is the
    watcher's business, logged there) is logged and polling goes on, so a later valid file still applies."""
    assert st.watcher is not None
    while True:
        await sleep(st.config.reload_interval_s)
        try:
            if st.watcher.due():
                st.watcher.poll()
        except Exception:  # noqa: BLE001 - the watcher must outlive any one bad reload
            log.exception("router config reload failed unexpectedly; keeping the current config and watching on")


def create_app(
    config: RouterConfig,
    registry: Registry | None = None,
    policy_factory: PolicyFactory = default_policy_factory,
    *,
    config_path: str | Path | None = None,
    clock: Callable[[], float] = time.monotonic,
    predictor: OutputLengthPredictor | None = None,
    remaining_predictor: RemainingLength | None = None,
    metrics: RouterMetrics | None = None,
    health_checks: bool = True,
    session_factory: Callable[[RouterConfig], aiohttp.ClientSession] | None = None,
) -> web.Application:
    """The router application.

    Args:
        config: the router config (``config_path``, when given, is watched and reloaded live).
        registry: where instances come from; None = a :class:`StaticRegistry` of ``config.instances`` that
            follows config reloads.
        policy_factory: builds ``config.policy`` (and the new policy after a reload).
        clock: monotonic seconds for timing, ejection backoff and reload checks.
        predictor: one output-length predictor shared by every model (default: one per served model, each a
            per-ISL-bucket online quantile estimate plus Libra's 20-token margin,
            :class:`fulcrum.routing.length_predictor.BucketedQuantilePredictor`).
        remaining_predictor: the remaining-length predictor of decode rescheduling (default: ARES §4's
            ``E[L − g | L > g]``, :class:`fulcrum.routing.remaining_length.RemainingLengthPredictor`).
        metrics: the metrics (default: new ones on their own registry).
        health_checks: run the periodic ``/health`` probes.
        session_factory: builds the shared upstream ``ClientSession`` that carries every engine call (default:
            :func:`fulcrum.router.transport.new_session`, a pooled ``TCPConnector``).

    Raises:
        ValueError: the configured policy cannot be built.
    """
    owns = registry is None
    reg: Registry = registry if registry is not None else StaticRegistry(config.records())
    st = RouterState(
        config=config, registry=reg, policy_factory=policy_factory,
        policy=policy_factory(config.policy.name, config.policy.params), metrics=metrics or RouterMetrics(),
        predictor=PerModelLengthPredictors((lambda: predictor) if predictor is not None else BucketedQuantilePredictor),
        clock=clock, owns_registry=owns,
        config_path=Path(config_path) if config_path is not None else None,
    )
    st.rescheduler = Rescheduler(remaining_predictor or RemainingLengthPredictor(), clock)
    st.reset_prefill_gate()
    st.roles = RoleBalancer(st.metrics)
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_openai_unmatched])
    app[ROUTER] = st

    async def startup(app: web.Application) -> None:
        direct = HttpTransport(session_factory(st.config) if session_factory is not None
                               else new_session(st.config.connection_limit))
        st.transport = QueuedTransport(direct, st.metrics, clock,
                                       registered=lambda iid: st.pool is not None and iid in st.pool)
        st.transport.use_queue(st.config.prefill_queue)
        st.pool = UpstreamPool(st.transport, st.config, st.metrics, clock)
        _set_records(st, await st.registry.snapshot())
        apply_draining(st.pool, st.config.draining)
        st.metrics.attach_pool(lambda: st.pool.views() if st.pool is not None else [])
        st.tasks.append(asyncio.create_task(_watch_registry(st), name="router-registry"))
        if health_checks:
            st.tasks.append(asyncio.create_task(st.pool.health_loop(), name="router-health"))
        st.tasks.append(asyncio.create_task(_watch_queue_depth(st), name="router-prefill-queue-depth"))
        st.tasks.append(asyncio.create_task(_reschedule_loop(st), name="router-rescheduling"))
        st.tasks.append(asyncio.create_task(_roles_loop(st), name="router-roles"))
        if st.config_path is not None:
            st.watcher = ConfigWatcher(st.config_path, st.config, st.apply_config, clock)
            st.tasks.append(asyncio.create_task(_watch_config(st, asyncio.sleep), name="router-config"))

    async def cleanup(app: web.Application) -> None:
        if st.prefill_gate is not None:
            st.prefill_gate.close()
        await cancel_and_wait(st.tasks)  # the depth watcher's NATS calls can swallow one cancel (Python 3.11)
        st.tasks.clear()
        if st.transport is not None:
            await st.transport.close()
        if owns:
            await st.registry.close()

    app.on_startup.append(startup)
    app.on_cleanup.append(cleanup)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    app.router.add_get("/metrics", _metrics)
    return app
