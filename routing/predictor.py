"""Execution predictor of the split policy: when will each instance have finished all the work it was given?

Libra §4.1 ("Execution predictor within global scheduler", Alg. 1 line 6 ``PREDICT``): the global scheduler keeps
a virtual queue of micro-requests per instance and simulates virtual batches under the engine's limits — a token
budget per pass (vLLM ``max_num_batched_tokens``), at most ``max_num_seqs`` running requests, first come first
served, one prompt chunk or one decode token per request per pass. A probe asks "if this micro-request joined
instance *i* now, when would *i* drain?"; the binary search over the split ratio makes up to 2·K probes per
request, so a probe must cost O(log n), not a re-simulation of the queue ("subsequent requests reuse the
existing timing prefix and simulate only the delta").

Cost of one engine step (pass): :class:`fulcrum.ratio.step_cost.StepCost`, the step-cost model the simulator, the
sim-worker and the local scheduler use too, built by :func:`predictor_step_cost` with two named choices that make
it additive over requests (``decode_model="linear"``, ``pass_intercept="per_pass"``)::

    step = fixed + Σ_chunks [ttft(o + q) − ttft(o)] + m·b + k·Σ_decoding context
    fixed = w        if the step decodes anything (b > 0)      — decode intercept of the fitted TPOT
          = ttft(0)  if it only prefills                          — prefill intercept of the profile

where a prompt chunk covers prompt tokens o..o+q, b is the number of decoding requests and w, m, k come from a
non-negative least-squares fit ``TPOT(b, c) ≈ w + m·b + k·b·c`` of the profile's decode grid (relative error
reported in :attr:`fulcrum.ratio.step_cost.DecodeFit.max_rel_error`). Every term except ``fixed`` is a sum over
requests, so a request's own token costs do not depend on whom it shares a step with; only the NUMBER of steps
does.

Why a probe is cheap (the incremental part). Under FCFS a request that joins the tail of the queue takes only
the budget and the slots the earlier requests leave over, so it never changes at which step an earlier request
gets which tokens: the existing timeline is a fixed prefix. Each instance keeps a summary of it —

- the sorted end steps of its live micro-requests (gives the step at which a slot frees up: an order
  statistic, O(1) after O(log n) pruning),
- the prefill frontier (the step position where the committed prompt tokens are done; later prompts queue
  behind it and share the leftover budget ``max_num_batched_tokens − b``),
- the last step with decode work, and its remaining busy time at an anchor instant —

and a probe places the new micro-request in step space (admission, end of prefill, end of decode), adds its own
token costs, and adds the fixed cost of the steps it appends past the end of the timeline (w per decode step,
ttft(0) per prefill-only step) plus ``w − ttft(0)`` for each prefill-only step it turns into a decode step.

Time moves the queue on: between commits the instance is assumed to run through its predicted steps at the
predicted pace (remaining busy time falls one second per second; the step position moves in proportion).
:meth:`InstancePredictor.finish` removes a micro-request that finished before its predicted end (an early EOS,
or an over-predicted output length) and takes its remaining cost off the instance.

Approximations (tested against :func:`simulate_virtual_batches`, the pass-by-pass reference: over 300 random
queues of up to 64 micro-requests the drain time agreed to 0.2% on average, worst 7% with a 128-token budget,
within 1% at budgets of 2048 and 8192): the decode-bearing steps of the timeline are taken to be contiguous from
now; the leftover prefill budget during a new prompt's prefill is the one at its admission step; the step
position moves linearly in time over the queue's horizon (a slow first step, e.g. a long prefill, puts it a few
steps ahead); the KV-cache capacity is not modelled (the engine's concurrency limit is); decode tokens never
starve (budget ≥ ``max_num_seqs``, as vLLM requires by default). A step mixing prompt chunks and decode tokens
pays one fixed cost (one forward pass, ``pass_intercept="per_pass"``); the simulator's default
(``"per_part"``) charges a decode step plus the chunk's prefill time, intercept included for a prompt's first
chunk, so the two differ by up to ``ttft(0)`` per such step, plus the decode fit's error
(``tests/unit/test_step_cost.py`` bounds both).

Pure: no I/O, no clock (``now`` is passed in, seconds on the router's monotonic clock).
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from fulcrum.errors import ProfileError
from fulcrum.ratio.profile import PerformanceProfile
from fulcrum.ratio.step_cost import StepCost

__all__ = [
    "MicroRequest",
    "split_micro_requests",
    "Part",
    "split_parts",
    "predictor_step_cost",
    "Probe",
    "InstancePredictor",
    "QueueSnapshot",
    "ExecutionPredictor",
    "VirtualRun",
    "simulate_virtual_batches",
]


@dataclass(frozen=True, slots=True)
class MicroRequest:
    """The part of a request one instance runs (Libra §3, "micro-request").

    Attributes:
        prefill_tokens: p, prompt tokens this instance computes, tokens (0: it receives the KV of all of them).
        cached_tokens: o, tokens whose KV the instance already holds or receives before it starts (the prompt
            prefix computed elsewhere, or prompt + generated tokens on a handoff), tokens.
        decode_steps: g, decode steps after the prefill (the step finishing the prefill samples one token
            itself), steps.

    Raises:
        ValueError: a negative field, or nothing to do (p = g = 0).
    """

    prefill_tokens: int
    cached_tokens: int = 0
    decode_steps: int = 0

    def __post_init__(self) -> None:
        if self.prefill_tokens < 0 or self.cached_tokens < 0 or self.decode_steps < 0:
            raise ValueError(f"micro-request fields must be >= 0, got {self}")
        if self.prefill_tokens == 0 and self.decode_steps == 0:
            raise ValueError("a micro-request must prefill or decode something")


def split_micro_requests(
    prompt_tokens: int, output_tokens: int, split_token: int
) -> tuple[MicroRequest | None, MicroRequest | None]:
    """The two micro-requests (α on instance A, β on instance B) of a request split at token s.

    DESIGN, "The split of one request" (Libra §3): P = ``prompt_tokens``, D = ``output_tokens`` (≥ 1 assumed;
    smaller values are raised to 1), L = P + D.

    - s ≥ L: colocated on A: α = (P, 0, D − 1), β = None;
    - s ≤ 0: colocated on B: α = None, β = (P, 0, D − 1);
    - 0 < s < P: α prefills s prompt tokens, β loads them and prefills the rest: α = (s, 0, 0),
      β = (P − s, s, D − 1);
    - s = P + k, 0 ≤ k < D: α prefills and decodes k tokens, β continues from prompt + k tokens:
      α = (P, 0, k), β = (0, s, D − k).

    Returns:
        (α, β), either of which is None when that side gets no work.
    """
    p = max(int(prompt_tokens), 0)
    d = max(int(output_tokens), 1)
    s = int(split_token)
    if p == 0:
        return (MicroRequest(0, 0, d), None) if s > 0 else (None, MicroRequest(0, 0, d))
    if s >= p + d:
        return MicroRequest(p, 0, d - 1), None
    if s <= 0:
        return None, MicroRequest(p, 0, d - 1)
    if s < p:
        return MicroRequest(s, 0, 0), MicroRequest(p - s, s, d - 1)
    k = s - p
    return MicroRequest(p, 0, k), MicroRequest(0, s, d - k)


Part = tuple[int, int, int]
"""(prefill tokens p, cached tokens o, decode steps g) of a micro-request, as plain integers."""


def split_parts(prompt_tokens: int, output_tokens: int, split_token: int) -> tuple[Part | None, Part | None]:
    """:func:`split_micro_requests` as plain (p, o, g) tuples, without validation (the search's hot path).

    Expects P ≥ 1 and D ≥ 1.
    """
    p, d, s = prompt_tokens, output_tokens, split_token
    if s >= p + d:
        return (p, 0, d - 1), None
    if s <= 0:
        return None, (p, 0, d - 1)
    if s < p:
        return (s, 0, 0), (p - s, s, d - 1)
    return (p, 0, s - p), (0, s, d - s + p)


def predictor_step_cost(profile: PerformanceProfile, tp: int) -> StepCost:
    """The execution predictor's step cost of TP ``tp`` (module doc): the shared model with the decode step as its
    linear fit and one fixed cost per forward pass, so that every other term is a sum over requests.

    A table the profile lacks at this TP is taken from the nearest measured TP (ties: the smaller, slower one),
    unscaled: DOPD's profile, for instance, has prefill only at TP=1 and decode only at TP=2.
    :attr:`~fulcrum.ratio.step_cost.StepCost.prefill_tp` and ``decode_tp`` say which tables were used.

    Raises:
        ProfileError: ``tp < 1``.
    """
    return StepCost.from_profile(
        profile, tp, decode_model="linear", pass_intercept="per_pass", prefill_tp_rule="nearest",
        decode_tp_rule="nearest",
    )


@dataclass(frozen=True, slots=True)
class Probe:
    """Where a micro-request would land on one instance (the answer of :meth:`InstancePredictor.probe`).

    Attributes:
        finish_s: absolute time at which the instance would have drained all its work including this
            micro-request, s (same clock as ``now``) — T_i of Libra Alg. 1 line 6.
        added_s: busy time the micro-request adds to the instance, s.
        busy_s: busy time the instance had left before it, s.
        step: the instance's step position at ``now`` (fractional).
        start_step: step position at which its prefill (or, without prefill, its decoding) starts.
        prefill_end: step position where its last prompt token is computed (= start_step without prefill).
        decode_start: first decode step (the step after the one finishing the prefill).
        end_step: the step after its last one.
    """

    finish_s: float
    added_s: float
    busy_s: float
    step: float
    start_step: float
    prefill_end: float
    decode_start: int
    end_step: int


@dataclass(slots=True)
class _Entry:
    micro: MicroRequest
    start_step: float
    prefill_end: float
    decode_start: int
    end_step: int


class InstancePredictor:
    """Virtual queue of one instance and its incremental drain-time prediction (module doc; Libra §4.1).

    Args:
        costs: the step cost model of the instance's TP.
        max_num_batched_tokens: the engine's per-step token budget, tokens (≥ 1).
        max_num_seqs: the engine's concurrency limit, requests (≥ 1).
        max_entries: soft bound on remembered micro-requests whose ``finish`` never came: beyond it, the
            oldest are forgotten as soon as they are predicted done.

    Raises:
        ValueError: a limit below 1.
    """

    __slots__ = (
        "costs", "max_num_batched_tokens", "max_num_seqs", "max_entries", "_ends", "_entries", "_frontier",
        "_decode_end", "_anchor_t", "_anchor_step", "_anchor_busy",
    )

    def __init__(
        self, costs: StepCost, max_num_batched_tokens: int = 8192, max_num_seqs: int = 256, *, max_entries: int = 100_000
    ) -> None:
        if max_num_batched_tokens < 1 or max_num_seqs < 1 or max_entries < 1:
            raise ValueError("max_num_batched_tokens, max_num_seqs and max_entries must be >= 1")
        self.costs = costs
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.max_num_seqs = int(max_num_seqs)
        self.max_entries = int(max_entries)
        self._ends: list[int] = []  # sorted end steps of micro-requests not yet predicted done
        self._entries: dict[str, _Entry] = {}
        self._frontier = 0.0  # step position where the committed prompt tokens are all computed
        self._decode_end = 0  # the step after the last committed decode step
        self._anchor_t = 0.0  # instant of the last commit/finish, s
        self._anchor_step = 0.0  # step position then
        self._anchor_busy = 0.0  # busy time left then, s

    def __len__(self) -> int:
        """Micro-requests remembered (committed and not finished)."""
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def _last_end(self) -> int:
        last = self._ends[-1] if self._ends else 0
        return max(last, math.ceil(self._frontier), self._decode_end)

    def busy_s(self, now: float) -> float:
        """Predicted busy time left at ``now``, s (0 when the instance has drained)."""
        return max(self._anchor_busy - max(now - self._anchor_t, 0.0), 0.0)

    def step_at(self, now: float) -> float:
        """Predicted step position at ``now``: the committed steps run at their predicted pace."""
        last = float(self._last_end())
        busy = self._anchor_busy
        elapsed = max(now - self._anchor_t, 0.0)
        if busy <= 0.0 or elapsed >= busy:
            return max(last, self._anchor_step)
        return self._anchor_step + (last - self._anchor_step) * (elapsed / busy)

    def snapshot(self, now: float) -> "QueueSnapshot":
        """The queue's state at ``now``, for probing several micro-requests against it (O(log n) once)."""
        return QueueSnapshot(self, now)

    def probe(self, micro: MicroRequest, now: float) -> Probe:
        """Predict the drain time if ``micro`` joined the tail of the queue at ``now``. No side effect.

        Cost: two binary searches over the live end steps and O(1) arithmetic.
        """
        snap = QueueSnapshot(self, now)
        start, prefill_end, decode_start, end, added = snap.place(
            micro.prefill_tokens, micro.cached_tokens, micro.decode_steps
        )
        return Probe(
            finish_s=now + snap.busy + added, added_s=added, busy_s=snap.busy, step=snap.step, start_step=start,
            prefill_end=prefill_end, decode_start=decode_start, end_step=end,
        )

    def commit(self, request_id: str, micro: MicroRequest, now: float) -> Probe:
        """Add ``micro`` to the tail of the queue at ``now`` (Libra Alg. 1 line 11, COMMIT) and return its probe.

        Committing an id twice replaces the earlier entry (its remaining cost is taken off first).

        Raises:
            ValueError: ``request_id`` is empty.
        """
        if not request_id:
            raise ValueError("request_id must be non-empty")
        if request_id in self._entries:
            self.finish(request_id, now)
        pr = self.probe(micro, now)
        ends = self._ends
        del ends[: bisect_right(ends, math.floor(pr.step))]
        insort(ends, pr.end_step)
        if micro.prefill_tokens > 0:
            self._frontier = max(self._frontier, pr.prefill_end)
        if micro.decode_steps > 0:
            self._decode_end = max(self._decode_end, pr.end_step)
        self._anchor_t, self._anchor_step, self._anchor_busy = now, pr.step, pr.busy_s + pr.added_s
        self._entries[request_id] = _Entry(micro, pr.start_step, pr.prefill_end, pr.decode_start, pr.end_step)
        if len(self._entries) > self.max_entries:
            self._forget_done(math.floor(pr.step))
        assert self._anchor_busy >= 0.0 and (not ends or ends[-1] <= self._last_end())
        return pr

    def _forget_done(self, sigma: int) -> None:
        """Drop the oldest remembered micro-requests while they are predicted done (amortised O(1))."""
        entries = self._entries
        while len(entries) > self.max_entries:
            oldest = next(iter(entries))
            if entries[oldest].end_step > sigma:
                break
            del entries[oldest]

    def finish(self, request_id: str, now: float) -> None:
        """The micro-request ``request_id`` finished at ``now``; forget it.

        If it finished before its predicted end, its remaining predicted cost (token costs of the steps it had
        left, and the fixed cost of the steps by which the timeline shrinks) is taken off the busy time; when no
        other micro-request is left running, the instance is idle (busy time 0). Unknown ids are ignored.
        """
        e = self._entries.pop(request_id, None)
        if e is None:
            return
        step = self.step_at(now)
        sigma = math.floor(step)
        if e.end_step <= sigma:
            return
        busy = self.busy_s(now)
        costs = self.costs
        m = e.micro
        removed = 0.0
        rem = e.end_step - max(sigma, e.decode_start)
        if rem > 0:
            removed += costs.decode_request_s(m.cached_tokens + m.prefill_tokens + (m.decode_steps - rem), rem)
        if m.prefill_tokens > 0 and step < e.prefill_end:
            span = e.prefill_end - e.start_step
            left = 1.0 if span <= 0 else min(max((e.prefill_end - max(step, e.start_step)) / span, 0.0), 1.0)
            removed += left * costs.prefill_chunk_s(m.cached_tokens, m.prefill_tokens)
        ends = self._ends
        i = bisect_left(ends, e.end_step)
        if i < len(ends) and ends[i] == e.end_step:
            del ends[i]
        last_before = max(e.end_step, math.ceil(self._frontier))
        new_decode_end = max(ends[-1] if ends else sigma, sigma)
        self._decode_end = min(self._decode_end, new_decode_end)
        new_last = max(self._last_end(), sigma)
        if last_before > new_last:
            removed += costs.decode_fixed_s * (last_before - max(new_last, e.decode_start))
        self._anchor_t, self._anchor_step = now, step
        # nothing left that ends after now: the instance is idle, whatever the pace interpolation said
        self._anchor_busy = max(busy - removed, 0.0) if bisect_right(ends, sigma) < len(ends) else 0.0

    def live_end_steps(self) -> tuple[int, ...]:
        """End steps of the micro-requests not yet predicted done, ascending (for inspection and tests)."""
        return tuple(self._ends)


class QueueSnapshot:
    """An instance's virtual queue frozen at one instant: probes against it are pure arithmetic.

    Valid until the queue changes (a commit or finish); the split search takes one per instance per request
    and probes it up to K times. See :meth:`place` for the placement rules (module doc).
    """

    __slots__ = (
        "now", "busy", "step", "join", "slot", "old_end", "decode_floor", "frontier", "ends", "n", "cap", "budget",
        "w", "f0", "upgrade", "costs",
    )

    def __init__(self, pred: InstancePredictor, now: float) -> None:
        self.now = now
        self.busy = pred.busy_s(now)
        self.step = step = pred.step_at(now)
        sigma = math.floor(step)  # steps before this one are done
        self.join = join = math.ceil(step - 1e-9)  # the first step a newcomer can share (the current one is underway)
        self.ends = ends = pred._ends
        self.n = n = len(ends)
        self.cap = cap = pred.max_num_seqs
        live = n - bisect_right(ends, sigma)
        self.slot = max(ends[n - cap], join) if live >= cap else join  # first step with a free slot
        self.old_end = max(pred._last_end(), join)
        self.decode_floor = max(pred._decode_end, join)
        self.frontier = pred._frontier
        self.budget = pred.max_num_batched_tokens
        costs = self.costs = pred.costs
        self.w, self.f0 = costs.decode_fixed_s, costs.prefill_fixed_s
        self.upgrade = max(self.w - self.f0, 0.0)

    def place(self, p: int, o: int, g: int) -> tuple[float, float, int, int, float]:
        """Place a micro-request (p prompt tokens to compute after o cached ones, then g decode steps) at the
        tail: (start step, prefill end, first decode step, end step, added busy time in s)."""
        if p > 0:
            start = self.slot if self.slot > self.frontier else self.frontier
            ends = self.ends
            running = self.n - bisect_right(ends, math.floor(start))
            per_step = self.budget - min(running, self.cap - 1)
            prefill_end = start + p / (per_step if per_step > 1 else 1)
            decode_start = math.ceil(prefill_end)
        else:
            decode_start = self.slot
            start = prefill_end = float(decode_start)
        end = decode_start + g
        # fixed step costs: steps appended past the end of the timeline, and prefill-only steps turned decoding
        old_end = self.old_end
        fixed = 0.0
        if end > old_end:
            dec_from = decode_start if decode_start > old_end else old_end
            fixed = self.w * (end - dec_from) + self.f0 * (dec_from - old_end)
        if g > 0 and self.upgrade > 0.0:
            lo = decode_start if decode_start > self.decode_floor else self.decode_floor
            overlap = (end if end < old_end else old_end) - lo
            if overlap > 0:
                fixed += self.upgrade * overlap
        costs = self.costs
        added = fixed + costs.prefill_chunk_s(o, p) + costs.decode_request_s(o + p, g)
        return start, prefill_end, decode_start, end, added

    def finish_s(self, p: int, o: int, g: int) -> float:
        """T of Libra Alg. 1 line 6: when the instance would drain with this micro-request added, s (absolute)."""
        return self.now + self.busy + self.place(p, o, g)[4]


class ExecutionPredictor:
    """The per-instance predictors of a fleet, built from one profile (Libra §4.1).

    Args:
        profile: the model's performance profile; None = no timing data, every lookup answers None (the
            split policy then takes its cold-start path). A TP the profile did not measure borrows the nearest
            measured TP's tables (:func:`predictor_step_cost`).
        max_entries: passed to each :class:`InstancePredictor`.
    """

    def __init__(self, profile: PerformanceProfile | None, *, max_entries: int = 100_000) -> None:
        self.profile = profile
        self.max_entries = max_entries
        self._costs: dict[int, StepCost | None] = {}
        self._instances: dict[str, InstancePredictor] = {}

    def costs(self, tp: int) -> StepCost | None:
        """The step cost model of TP ``tp``, or None when there is no profile (or ``tp`` < 1)."""
        if tp not in self._costs:
            model: StepCost | None = None
            if self.profile is not None:
                try:
                    model = predictor_step_cost(self.profile, tp)
                except ProfileError:
                    model = None
            self._costs[tp] = model
        return self._costs[tp]

    def instance(
        self, instance_id: str, tp: int = 1, max_num_batched_tokens: int = 8192, max_num_seqs: int = 256
    ) -> InstancePredictor | None:
        """The predictor of one instance (created on first use; limits refreshed), or None without cost data."""
        pred = self._instances.get(instance_id)
        if pred is not None and pred.costs.tp == tp:
            if pred.max_num_batched_tokens != max_num_batched_tokens or pred.max_num_seqs != max_num_seqs:
                pred.max_num_batched_tokens = max(int(max_num_batched_tokens), 1)
                pred.max_num_seqs = max(int(max_num_seqs), 1)
            return pred
        costs = self.costs(tp)
        if costs is None:
            return None
        pred = InstancePredictor(costs, max(max_num_batched_tokens, 1), max(max_num_seqs, 1), max_entries=self.max_entries)
        self._instances[instance_id] = pred
        return pred

    def get(self, instance_id: str) -> InstancePredictor | None:
        """The predictor of an instance seen before, without creating one."""
        return self._instances.get(instance_id)

    def forget(self, instance_id: str) -> None:
        """Drop an instance's virtual queue (it left the fleet)."""
        self._instances.pop(instance_id, None)


@dataclass(frozen=True, slots=True)
class VirtualRun:
    """Outcome of :func:`simulate_virtual_batches`.

    Attributes:
        steps: engine steps (passes) until the queue drained.
        seconds: their total cost, s.
        end_steps: per micro-request in input order, the step after its last one.
    """

    steps: int
    seconds: float
    end_steps: tuple[int, ...]


@dataclass(slots=True)
class _SimReq:
    idx: int
    o: int
    p: int
    prefill_left: int
    decode_left: int
    context: int


def simulate_virtual_batches(
    micros: Sequence[MicroRequest], costs: StepCost, *, max_num_batched_tokens: int, max_num_seqs: int
) -> VirtualRun:
    """Reference virtual-batch simulation of a queue, pass by pass (Libra §4.1), all requests present at step 0.

    Each pass: the running requests in admission order each get one prompt chunk (as much of the remaining
    prompt as the budget leaves) or one decode token; then waiting requests are admitted FCFS while a slot
    and budget remain, and get the same; the pass costs :meth:`~fulcrum.ratio.step_cost.StepCost.step_s`. Passes
    where nobody prefills and nobody can be admitted are identical up to context growth and are taken in one
    stride up to the next completion (:meth:`~fulcrum.ratio.step_cost.StepCost.decode_run_s`). O(events) strides; for tests and calibration,
    not for the per-request path.

    Raises:
        ValueError: a limit below 1.
    """
    if max_num_batched_tokens < 1 or max_num_seqs < 1:
        raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
    waiting = deque(
        _SimReq(i, m.cached_tokens, m.prefill_tokens, m.prefill_tokens, m.decode_steps, m.cached_tokens + m.prefill_tokens)
        for i, m in enumerate(micros)
    )
    running: list[_SimReq] = []
    ends = [0] * len(micros)
    step, seconds = 0, 0.0
    budget_cap, cap = max_num_batched_tokens, max_num_seqs

    def serve(r: _SimReq, budget: int, chunks: list[tuple[int, int]]) -> tuple[int, int, int]:
        """Give r its share of this pass: (tokens used, decoding 0/1, context attended); a prompt chunk is
        appended to ``chunks`` as (offset, tokens)."""
        if r.prefill_left > 0:
            q = min(r.prefill_left, budget)
            done = r.p - r.prefill_left
            r.prefill_left -= q
            chunks.append((r.o + done, q))
            return q, 0, 0
        ctx = r.context
        r.context += 1
        r.decode_left -= 1
        return 1, 1, ctx

    while running or waiting:
        stride_ok = all(r.prefill_left == 0 for r in running) and (not waiting or len(running) >= cap)
        if stride_ok and running and len(running) <= budget_cap:
            k = min(r.decode_left for r in running)
            b = len(running)
            seconds += costs.decode_run_s(b, sum(r.context for r in running), k)
            for r in running:
                r.context += k
                r.decode_left -= k
            step += k
        else:
            budget = budget_cap
            chunks: list[tuple[int, int]] = []
            decoding, ctx_sum = 0, 0
            for r in running:
                if budget <= 0:
                    break
                used, dec, ctx = serve(r, budget, chunks)
                budget -= used
                decoding += dec
                ctx_sum += ctx
            while waiting and len(running) < cap and budget > 0:
                r = waiting.popleft()
                running.append(r)
                used, dec, ctx = serve(r, budget, chunks)
                budget -= used
                decoding += dec
                ctx_sum += ctx
            assert budget >= 0
            seconds += costs.step_s(chunks, decoding, ctx_sum / decoding if decoding else 0.0)
            step += 1
        still: list[_SimReq] = []
        for r in running:
            if r.prefill_left == 0 and r.decode_left == 0:
                ends[r.idx] = step
            else:
                still.append(r)
        running = still
    return VirtualRun(steps=step, seconds=seconds, end_steps=tuple(ends))
