"""The sim-worker's engine model: continuous batching timed by a :class:`~fulcrum.ratio.profile.PerformanceProfile`.

Pure: no I/O, no clock of its own (every call that needs the time takes ``now``, seconds on any monotonic
scale). :mod:`fulcrum.worker.sim_server` drives it over HTTP; tests drive it directly.

What one :meth:`SimEngine.step` does (the readable part of vLLM v1's ``Scheduler.schedule``, STYLE §6):

1. **Running requests first**, in admission order. Each is scheduled ``len(tokens) − num_computed`` tokens,
   capped by the step's token budget ``max_num_batched_tokens`` (chunked prefill): 1 token for a decode, the
   rest of its prompt (or a chunk of it) for a prefill. Its KV blocks (``block_size`` tokens each) are allocated
   for the tokens it will hold; when the pool has too few free blocks, the **last** running request is
   preempted (recompute: its blocks are freed, it goes back to the head of the waiting queue and later
   recomputes prompt + generated tokens as one prefill), exactly as vLLM v1 does.
2. **Waiting requests** next (only in a step without preemption), in FIFO order, while fewer than
   ``max_num_seqs`` run, budget is left and their blocks fit. A request whose remote KV is still "in transfer"
   (``ready_at`` in the future) is skipped, not blocking the queue (vLLM's ``WAITING_FOR_REMOTE_KVS``).
3. **Sampling.** A request whose tokens are all computed after the step samples one token — the greedy
   :func:`greedy_token` of its whole sequence — so a request's output is the same whether one engine or two
   (disaggregated, split after k tokens) compute it. It finishes at ``max_tokens`` generated tokens.

Step time (documented choice; DESIGN principle 4, the profile is the only source of latency): the shared
step-cost model :class:`fulcrum.ratio.step_cost.StepCost` with its defaults — the simulator's — so the emulator
and ``fulcrum replay`` time the same step alike:

- **prefill part** (:meth:`~fulcrum.ratio.step_cost.StepCost.prefill_part_s`): chunks starting at offset 0 cost
  ``prefill_batch_s([chunk lengths])`` together (DOPD Alg. 1's batched prefill model); a chunk of n tokens
  continuing at offset o > 0 (chunked prefill, a recompute after remote KV, the last prompt token after a KV
  pull) costs the increment ``ttft(o + n) − ttft(o)``. So a prompt of P tokens costs exactly ``ttft(P)`` whether
  it is prefilled in one step or chunked over several.
- **decode part** (:meth:`~fulcrum.ratio.step_cost.StepCost.decode_step_s`): ``tpot(d, mean context)`` for the
  d requests that decode one token in the step (context = tokens they attend to, prompt + generated).
- A mixed step costs the **sum** of the two parts. Real engines overlap some of it (one weight read serves
  both), so the sum is an upper bound; it makes prefill interference with decodes (DistServe's, DOPD §II-B)
  visible to the router and the planner, which is what the emulator is for.
- Everything is multiplied by ``time_scale`` (tests use e.g. 0.01 to run a minute of traffic in a second).

TP: the prefill part uses the profile's prefill table at ``tp`` and the decode part its decode table at ``tp``;
a profile without a table at that TP (DOPD Table I has prefill only at TP 1 and decode only at TP 2) uses the
nearest measured TP instead (:func:`fulcrum.ratio.step_cost.nearest_tp`, smaller on a tie; the ``"nearest"`` TP
rule of both tables) — :attr:`SimEngine.prefill_tp` /
:attr:`SimEngine.decode_tp` say which, and the server logs it.

KV transfer (the NIXL ``kv_transfer_params`` protocol, see the server): a request added with
``computed_tokens = c`` already holds the KV of its first c tokens (pulled from another engine); it computes only
the rest (at least its last token, as vLLM's decode side does). ``keep_kv`` keeps a finished request's blocks
(``do_remote_decode``) until :meth:`SimEngine.take_kv` or :meth:`SimEngine.release_kv` frees them.
"""

from __future__ import annotations

import math
import zlib
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from fulcrum.ratio.profile import PerformanceProfile
from fulcrum.ratio.step_cost import StepCost

__all__ = [
    "VOCAB_SIZE",
    "greedy_token",
    "encode_text",
    "chat_token_ids",
    "SimEngineConfig",
    "TokenOutput",
    "StepOutput",
    "HeldKV",
    "SimEngine",
]

VOCAB_SIZE = 256
"""The byte-level tokenizer's vocabulary: token id = one UTF-8 byte."""

_ALPHABET = "abcdefghijklmnopqrstuvwxyz "


def greedy_token(seq: Sequence[int]) -> int:
    """The emulated model's greedy next token after ``seq`` (token ids): an ASCII letter or a space, picked by a
    CRC-32 of the last 8 tokens. A pure function of the sequence, so any engine that continues a sequence
    continues it identically (the same choice as the router tests' fake engine, so their outputs agree)."""
    h = zlib.crc32(array("I", seq[-8:]).tobytes(), 0)
    return ord(_ALPHABET[h % len(_ALPHABET)])


def encode_text(text: str) -> list[int]:
    """The byte-level tokenizer: one token per UTF-8 byte of ``text``."""
    return list(text.encode())


def chat_token_ids(messages: Sequence[object], add_generation_prompt: bool = True) -> list[int]:
    """The chat template: ``<|role|>content\\n`` per message, then ``<|assistant|>``, byte-tokenized.

    ``content`` may be a string or a list of ``{"type": "text", "text": ...}`` parts (other parts are ignored).

    Raises:
        ValueError: a message is not an object, or its ``role`` is not a string.
    """
    parts: list[str] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError("each message must be an object with role and content")
        if not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}].role: a string is required, got {m.get('role')!r}")
        c = m.get("content")
        if isinstance(c, list):
            c = "".join(str(p.get("text", "")) for p in c if isinstance(p, dict))
        parts.append(f"<|{m.get('role')}|>{c or ''}\n")
    if add_generation_prompt:
        parts.append("<|assistant|>")
    return encode_text("".join(parts))


@dataclass(frozen=True)
class SimEngineConfig:
    """Shape of one emulated engine (the vLLM settings of the same names).

    Attributes:
        tp: tensor-parallel size the profile's tables are read at (see module doc for unmeasured TPs).
        kv_capacity_tokens: KV cache capacity, tokens (rounded down to whole blocks). The server's default is
            ``profile.kv_capacity_tokens(tp)`` (DOPD eq. 11).
        max_num_seqs: most requests running at once (vLLM's default 256).
        max_num_batched_tokens: tokens computed per step, prefill chunks and decodes together (8192: vLLM's
            default for chunked prefill on large GPUs).
        block_size: tokens per KV block (vLLM's default 16).
        time_scale: multiplies every step time (1.0 = the profile's real time).
    """

    tp: int
    kv_capacity_tokens: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.tp < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.block_size < 1:
            raise ValueError("tp, max_num_seqs, max_num_batched_tokens and block_size must be >= 1")
        if self.kv_capacity_tokens < self.block_size:
            raise ValueError(f"kv_capacity_tokens must hold at least one block ({self.block_size} tokens), "
                             f"got {self.kv_capacity_tokens}")
        if not (math.isfinite(self.time_scale) and self.time_scale > 0):
            raise ValueError(f"time_scale must be a finite positive number, got {self.time_scale}")

    @property
    def num_blocks(self) -> int:
        """KV blocks in the pool."""
        return self.kv_capacity_tokens // self.block_size


@dataclass(frozen=True, slots=True)
class TokenOutput:
    """One token a step produced.

    Attributes:
        request_id: whose token.
        token: the token id (0..255).
        finished: the request reached ``max_tokens`` with this token.
    """

    request_id: str
    token: int
    finished: bool


@dataclass(frozen=True)
class StepOutput:
    """What one step did (STYLE §7: one output object per decision).

    Attributes:
        duration: the step's emulated time, seconds, ``time_scale`` applied.
        prefill_seconds: its prefill part before ``time_scale``, seconds.
        decode_seconds: its decode part before ``time_scale``, seconds.
        scheduled: request id → tokens computed in the step.
        num_prefill_tokens: tokens computed as prefill (chunks), tokens.
        num_decodes: requests that decoded one token.
        outputs: tokens sampled at the end of the step, in scheduling order.
        preempted: requests preempted (recompute) in the step.
    """

    duration: float
    prefill_seconds: float
    decode_seconds: float
    scheduled: dict[str, int]
    num_prefill_tokens: int
    num_decodes: int
    outputs: tuple[TokenOutput, ...]
    preempted: tuple[str, ...]


@dataclass(frozen=True)
class HeldKV:
    """KV blocks a finished ``keep_kv`` request still holds for a remote decode.

    Attributes:
        tokens: the tokens whose KV the blocks hold (prompt + generated − 1: the last sampled token was never
            computed), token ids.
        block_ids: the blocks, ``ceil(len(tokens) / block_size)`` of them.
    """

    tokens: tuple[int, ...]
    block_ids: tuple[int, ...]


@dataclass(eq=False)
class _Req:
    id: str
    tokens: list[int]
    prompt_len: int
    max_tokens: int
    keep_kv: bool
    ready_at: float
    num_computed: int = 0
    generated: int = 0
    blocks: list[int] = field(default_factory=list)
    preemptions: int = 0


class SimEngine:
    """A continuous-batching engine model timed by a profile (module doc).

    Args:
        profile: the latency tables.
        config: the engine's shape.

    Raises:
        fulcrum.errors.ProfileError: never for the TP (the nearest measured TP is used), but the profile's own
            lookups raise it for malformed tables.
    """

    def __init__(self, profile: PerformanceProfile, config: SimEngineConfig) -> None:
        self.profile = profile
        self.config = config
        self.cost = StepCost.from_profile(profile, config.tp)
        """The step-cost model (both tables by the ``"nearest"`` TP rule)."""
        self.prefill_tp = self.cost.prefill_tp
        """The TP whose prefill table times prefill chunks."""
        self.decode_tp = self.cost.decode_tp
        """The TP whose decode table times decode steps."""
        self._free: list[int] = list(range(config.num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._reqs: dict[str, _Req] = {}
        self._running: list[_Req] = []
        self._waiting: deque[_Req] = deque()
        self._held: dict[str, HeldKV] = {}
        self.num_preemptions = 0
        """Preemptions so far (count)."""

    # ------------------------------------------------------------------ state
    @property
    def num_running(self) -> int:
        """Requests running (scheduled in steps, KV allocated)."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission (incl. preempted ones and ones whose KV is in transfer)."""
        return len(self._waiting)

    @property
    def num_held(self) -> int:
        """Finished requests whose KV is held for a remote decode."""
        return len(self._held)

    @property
    def free_blocks(self) -> int:
        """Free KV blocks."""
        return len(self._free)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use, 0..1 (vLLM's ``kv_cache_usage_perc``)."""
        return 1.0 - len(self._free) / self.config.num_blocks

    def has_request(self, request_id: str) -> bool:
        """Whether the request is running or waiting."""
        return request_id in self._reqs

    def blocks_for(self, tokens: int) -> int:
        """KV blocks that hold ``tokens`` tokens."""
        return -(-tokens // self.config.block_size)

    # ------------------------------------------------------------------ admission
    def add_request(self, request_id: str, prompt: Sequence[int], max_tokens: int, *, now: float,
                    computed_tokens: int = 0, ready_at: float | None = None, keep_kv: bool = False) -> None:
        """Queue a request.

        Args:
            request_id: unique among live requests.
            prompt: prompt token ids (at least one).
            max_tokens: tokens to generate (>= 1).
            now: the caller's clock, seconds (the request is schedulable from ``ready_at`` or now).
            computed_tokens: tokens whose KV the request already holds (a remote prefill's pulled KV); capped
                at ``len(prompt) − 1``: the last prompt token is always computed here, as vLLM does.
            ready_at: when a KV transfer completes, seconds on the same clock (None = now).
            keep_kv: hold the KV after it finishes for a remote decode (:meth:`take_kv`).

        Raises:
            ValueError: duplicate id, empty prompt, ``max_tokens < 1``, or prompt + max_tokens needs more KV
                blocks than the whole pool (the request could never finish).
        """
        if request_id in self._reqs or request_id in self._held:
            raise ValueError(f"request id {request_id!r} is already in use")
        if len(prompt) < 1:
            raise ValueError("the prompt must hold at least one token")
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        need = self.blocks_for(len(prompt) + max_tokens - 1)
        if need > self.config.num_blocks:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) needs {need} KV blocks, "
                             f"more than the {self.config.num_blocks} this engine has")
        r = _Req(request_id, list(prompt), len(prompt), max_tokens, keep_kv,
                 now if ready_at is None else ready_at,
                 num_computed=max(0, min(computed_tokens, len(prompt) - 1)))
        self._reqs[request_id] = r
        self._waiting.append(r)

    def abort(self, request_id: str) -> bool:
        """Drop a running or waiting request and free its blocks (client gone). True when it was live."""
        r = self._reqs.pop(request_id, None)
        if r is None:
            return False
        self._detach(r)
        self._free_blocks(r)
        return True

    def stop(self, request_id: str) -> bool:
        """End a request early as finished (a stop string matched): its KV is held when ``keep_kv``, else freed.

        True when it was live."""
        r = self._reqs.pop(request_id, None)
        if r is None:
            return False
        self._detach(r)
        self._finish(r)
        return True

    def take_kv(self, request_id: str) -> HeldKV | None:
        """Hand over a finished request's held KV and free its blocks (the remote side pulled it); None if
        nothing is held under that id (already pulled, released or never kept)."""
        held = self._held.pop(request_id, None)
        if held is not None:
            self._free.extend(held.block_ids)
        return held

    def release_kv(self, request_id: str) -> bool:
        """Free a held KV nobody pulled (timeout). True when something was held."""
        return self.take_kv(request_id) is not None

    def held_kv(self, request_id: str) -> HeldKV | None:
        """The KV held for a finished ``keep_kv`` request, without freeing it."""
        return self._held.get(request_id)

    def next_ready_at(self) -> float | None:
        """The earliest ``ready_at`` among waiting requests (when a transfer completes), or None. It may lie in
        the past (a ready request that waits for KV blocks): only a future one is a reason to step again."""
        return min((r.ready_at for r in self._waiting), default=None)

    # ------------------------------------------------------------------ the step
    def step(self, now: float) -> StepOutput | None:
        """Schedule, time and apply one engine step (module doc). None when nothing can run now (idle, only
        transfers pending — see :meth:`next_ready_at` — or the KV pool is held by finished requests)."""
        budget = self.config.max_num_batched_tokens
        sched: list[tuple[_Req, int, int]] = []  # (request, offset, tokens)
        preempted: list[str] = []
        budget = self._schedule_running(budget, sched, preempted)
        if not preempted:
            budget = self._schedule_waiting(now, budget, sched)
        assert budget >= 0 and len(self._running) <= self.config.max_num_seqs and self._free_ok()
        if not sched:
            return None
        prefill_s, decode_s, n_pre, n_dec = self._cost(sched)
        outputs = self._apply(sched)
        return StepOutput(
            duration=(prefill_s + decode_s) * self.config.time_scale, prefill_seconds=prefill_s,
            decode_seconds=decode_s, scheduled={r.id: n for r, _, n in sched}, num_prefill_tokens=n_pre,
            num_decodes=n_dec, outputs=tuple(outputs), preempted=tuple(preempted))

    def _schedule_running(self, budget: int, sched: list[tuple[_Req, int, int]], preempted: list[str]) -> int:
        i = 0
        while i < len(self._running) and budget > 0:
            r = self._running[i]
            n = min(len(r.tokens) - r.num_computed, budget)
            need = self.blocks_for(r.num_computed + n) - len(r.blocks)
            while need > len(self._free) and self._running[-1] is not r:
                victim = self._running.pop()
                self._preempt(victim)
                preempted.append(victim.id)
            if need > len(self._free):  # r is the last one running: it preempts itself
                self._running.pop()
                self._preempt(r)
                preempted.append(r.id)
                break
            self._alloc(r, need)
            sched.append((r, r.num_computed, n))
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, now: float, budget: int, sched: list[tuple[_Req, int, int]]) -> int:
        skipped: list[_Req] = []
        while self._waiting and budget > 0 and len(self._running) < self.config.max_num_seqs:
            r = self._waiting[0]
            if r.ready_at > now:  # its KV is still in transfer: let the others pass
                skipped.append(self._waiting.popleft())
                continue
            n = min(len(r.tokens) - r.num_computed, budget)
            need = self.blocks_for(r.num_computed + n) - len(r.blocks)
            if need > len(self._free):
                break  # FIFO: the head waits for blocks
            self._waiting.popleft()
            self._alloc(r, need)
            self._running.append(r)
            sched.append((r, r.num_computed, n))
            budget -= n
        self._waiting.extendleft(reversed(skipped))
        return budget

    def _cost(self, sched: list[tuple[_Req, int, int]]) -> tuple[float, float, int, int]:
        """(prefill seconds, decode seconds, prefill tokens, decodes) of the scheduled work, unscaled."""
        chunks: list[tuple[int, int]] = []
        n_pre = 0
        n_dec = 0
        ctx = 0
        for r, off, n in sched:
            if n == 1 and off >= r.prompt_len:
                n_dec += 1
                ctx += off + 1
                continue
            n_pre += n
            chunks.append((off, n))
        prefill_s = self.cost.prefill_part_s(chunks, n_dec)
        decode_s = self.cost.decode_step_s(n_dec, ctx / n_dec) if n_dec else 0.0
        return prefill_s, decode_s, n_pre, n_dec

    def _apply(self, sched: list[tuple[_Req, int, int]]) -> list[TokenOutput]:
        outputs: list[TokenOutput] = []
        for r, _, n in sched:
            r.num_computed += n
            if r.num_computed < len(r.tokens):
                continue  # a chunk of a longer prefill
            tok = greedy_token(r.tokens)
            r.tokens.append(tok)
            r.generated += 1
            done = r.generated >= r.max_tokens
            outputs.append(TokenOutput(r.id, tok, done))
            if done:
                del self._reqs[r.id]
                self._running.remove(r)
                self._finish(r)
        return outputs

    # ------------------------------------------------------------------ blocks
    def _alloc(self, r: _Req, n: int) -> None:
        for _ in range(max(n, 0)):
            r.blocks.append(self._free.pop())

    def _free_blocks(self, r: _Req) -> None:
        self._free.extend(reversed(r.blocks))
        r.blocks.clear()

    def _preempt(self, r: _Req) -> None:
        self._free_blocks(r)
        r.num_computed = 0
        r.preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(r)

    def _detach(self, r: _Req) -> None:
        if r in self._running:
            self._running.remove(r)
        elif r in self._waiting:
            self._waiting.remove(r)

    def _finish(self, r: _Req) -> None:
        if not r.keep_kv:
            self._free_blocks(r)
            return
        covered = r.num_computed
        keep = self.blocks_for(covered)
        extra = r.blocks[keep:]
        del r.blocks[keep:]
        self._free.extend(reversed(extra))
        self._held[r.id] = HeldKV(tuple(r.tokens[:covered]), tuple(r.blocks))

    def _free_ok(self) -> bool:
        used = sum(len(r.blocks) for r in self._running) + sum(len(r.blocks) for r in self._waiting)
        used += sum(len(h.block_ids) for h in self._held.values())
        return used + len(self._free) == self.config.num_blocks
