"""The step-cost model: what one engine step costs, in seconds, from a :class:`PerformanceProfile`.

The one place that turns a profile's latency tables into engine-step times. The simulator
(:mod:`fulcrum.simulator.instances`), the sim-worker's engine (:mod:`fulcrum.worker.sim_engine`), the router's
execution predictor (:mod:`fulcrum.routing.predictor`, Libra §4.1) and the local scheduler's latency-table priors
(:mod:`fulcrum.worker.latency_table`, Libra §4.2 Alg. 2) all call :class:`StepCost`; none of them reads a
profile's latencies itself (``tests/unit/test_architecture_step_cost.py`` keeps it so).

Sources. The tables are the profile's (DOPD Table I, Splitwise's Llama-2-70B runs; :mod:`fulcrum.ratio.profile`):
``ttft(x)`` — prefill latency of one prompt of x tokens, piecewise-linear inside the table and extended by the
NNLS fit ``τ + κ1·x + κ2·x²`` outside it (DOPD eqs. 2–5) — and ``tpot(b, c)`` — one decode step of b requests
at mean context c tokens, bilinear in the measured grid. The step model built on them:

- **Prefill chunk** (chunked prefill, Sarathi/vLLM): prompt tokens o..o+q of one request cost the marginal
  ``ttft(o + q) − ttft(o)``, so the chunks of one prompt add up to ``ttft(P) − ttft(0)`` and the quadratic
  attention term lands on the later chunks (:meth:`StepCost.prefill_chunk_s`).
- **Batched prefill** (DOPD Alg. 1): prompts started together cost ``ttft(Σx) − κ2·((Σx)² − Σx²)``, at least the
  longest alone (:meth:`StepCost.prefill_batch_s`, the profile's own formula).
- **Decode step**: ``tpot(b, c̄)`` for b decoding requests at mean context c̄ = Σcontext / b
  (:meth:`StepCost.decode_step_s`).
- **A step** (:meth:`StepCost.step_s`): the prefill part plus the decode part. By default
  (``pass_intercept="per_part"``) the chunks that start a prompt are one batched prefill (intercept
  included), continuations cost their marginals, and a mixed step costs the sum of the prefill part and a
  decode step — an upper bound (a real engine reads the weights once for both), which makes prefill
  interference with decodes (DistServe; DOPD §II-B) visible.

Deliberate differences are named parameters, each with the simulator's behaviour as its default:

- ``decode_model``: ``"table"`` (default) reads the decode grid; ``"linear"`` uses the non-negative
  least-squares fit ``tpot(b, c) ≈ w + m·b + k·b·c`` of that grid (rows weighted by 1/t, so the fit minimises
  relative error; :class:`DecodeFit`), whose cost is a sum over requests — what the execution predictor needs
  for O(log n) probes (Libra §4.1). Its worst relative error on the grid is :attr:`DecodeFit.max_rel_error`.
- ``pass_intercept``: ``"per_part"`` (default, above) or ``"per_pass"``: a step is one forward pass and pays one
  fixed cost — every prompt chunk costs its marginal, and the prefill intercept ``ttft(0)`` is added only when
  the step decodes nothing (the decode step's intercept covers a mixed step). The two differ by at most
  ``ttft(0)`` per mixed step, plus where the prefill table departs from its quadratic fit in a batch.
- the tensor-parallel rule per table (``prefill_tp_rule`` / ``decode_tp_rule``): ``"exact"`` raises
  :class:`~fulcrum.errors.ProfileError` for a TP the profile did not measure; ``"nearest"`` borrows the
  nearest measured TP's table (ties: the smaller, slower one), unscaled, i.e. conservatively. DOPD's profile,
  for instance, has prefill only at TP 1 and decode only at TP 2. ``prefill_tp`` names the prefill table to read
  instead (the planner reads its P pool's), and ``scale_borrowed_prefill=True`` scales a prefill table borrowed
  from TP t' by t'/tp (ideal tensor-parallel speedup, the planner's estimate in DOPD §V-E) — the TP factor
  :attr:`StepCost.prefill_scale`.
- :meth:`StepCost.prefill_fit_marginal_s`: the compute ``κ1·x + κ2·x²`` a prompt of x tokens adds to a step that
  runs anyway (DOPD eq. 5 without its intercept τ) — the planner's price of an ultra-short prompt prefilled
  locally on a decode instance (DOPD §V-E). The simulator instead charges such a prompt as a batched prefill
  (intercept included) beside the decode step, i.e. more: the planner's threshold is optimistic by up to τ.

Chunk size (vLLM ``max_num_batched_tokens``) is the caller's: it decides the chunks, this module prices them.

Pure: no I/O, no clock; numpy is used only by the decode fit (and SciPy's NNLS, imported when a linear model is
built, so the latency table's vLLM process imports neither).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from fulcrum.errors import ProfileError

if TYPE_CHECKING:  # annotations only: the vLLM-side latency table imports this module without SciPy
    from fulcrum.ratio.profile import DecodeTable, PerformanceProfile, PrefillTable

__all__ = ["DecodeModel", "PassIntercept", "TpRule", "DecodeFit", "StepCost", "nearest_tp", "fit_decode"]

DecodeModel = Literal["table", "linear"]
"""How a decode step is priced: the profile's grid, or its linear fit (:class:`DecodeFit`)."""
PassIntercept = Literal["per_part", "per_pass"]
"""Fixed cost of a mixed step: one per part (prefill batch + decode step) or one per forward pass."""
TpRule = Literal["exact", "nearest"]
"""A TP the profile did not measure: raise (``exact``) or borrow the nearest measured table (``nearest``)."""

_TTFT_MEMO = 1 << 16  # prompt lengths memoised per model


def nearest_tp(measured: Sequence[int], tp: int) -> int:
    """``tp`` when measured, else the measured TP closest to it (the smaller, slower one on a tie).

    Raises:
        ProfileError: nothing measured.
    """
    if not measured:
        raise ProfileError("the profile measures no TP for this table")
    if tp in measured:
        return tp
    return min(measured, key=lambda m: (abs(m - tp), m))


@dataclass(frozen=True, slots=True)
class DecodeFit:
    """Linear decode-step model ``t(b, c) = w + m·b + k·b·c`` fitted to a profile's decode grid.

    Attributes:
        fixed_s: w, fixed cost of a step that decodes (weights read once per step), s.
        per_seq_s: m, added per decoding request, s.
        per_context_token_s: k, added per context token a decoding request attends to, s.
        max_rel_error: largest ``|fit − table| / table`` over the grid's points (dimensionless).
    """

    fixed_s: float
    per_seq_s: float
    per_context_token_s: float
    max_rel_error: float


def fit_decode(table: DecodeTable) -> DecodeFit:
    """NNLS fit of ``t = w + m·b + k·b·c`` to a decode grid, rows weighted by 1/t (relative error).

    A grid the fit explains without an intercept keeps the fastest measured step as ``w`` (a step never costs
    less than the fastest one measured).
    """
    import numpy as np
    from scipy.optimize import nnls

    rows: list[list[float]] = []
    for bi, b in enumerate(table.batch):
        for ci, c in enumerate(table.context):
            t = table.seconds[bi][ci]
            rows.append([1.0 / t, b / t, b * c / t])
    coef, _ = nnls(np.asarray(rows), np.ones(len(rows)))
    w, m, k = (float(x) for x in coef)
    if w <= 0.0:
        w = min(min(r) for r in table.seconds)
    err = max(
        abs(w + m * b + k * b * c - table.seconds[bi][ci]) / table.seconds[bi][ci]
        for bi, b in enumerate(table.batch)
        for ci, c in enumerate(table.context)
    )
    return DecodeFit(w, m, k, float(err))


@dataclass(frozen=True, slots=True)
class StepCost:
    """Cost in seconds of the engine steps of one model at one TP (module doc for the model and its sources).

    Build it with :meth:`from_profile`. Prompt chunks are ``(offset, tokens)`` pairs: ``tokens`` prompt tokens
    computed after ``offset`` tokens whose KV is already there (offset 0: the chunk starts the prompt).

    Attributes:
        tp: the instance's tensor-parallel size.
        prefill_tp: the TP whose prefill table is used (``tp`` when the profile measured it).
        decode_tp: the TP whose decode table is used (``tp`` when the profile measured it).
        prefill_table: the profile's prefill table at ``prefill_tp``.
        decode_table: the profile's decode table at ``decode_tp``.
        decode_model: ``"table"`` or ``"linear"`` (module doc).
        pass_intercept: ``"per_part"`` or ``"per_pass"`` (module doc).
        decode_fit: the linear decode model; set when ``decode_model == "linear"``, else None.
        prefill_scale: multiplies every prefill time (1.0 unless a borrowed table is scaled, module doc).
    """

    tp: int
    prefill_tp: int
    decode_tp: int
    prefill_table: PrefillTable
    decode_table: DecodeTable
    decode_model: DecodeModel = "table"
    pass_intercept: PassIntercept = "per_part"
    decode_fit: DecodeFit | None = None
    prefill_scale: float = 1.0
    _ttft_memo: dict[float, float] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_profile(
        cls,
        profile: PerformanceProfile,
        tp: int,
        *,
        decode_model: DecodeModel = "table",
        pass_intercept: PassIntercept = "per_part",
        prefill_tp_rule: TpRule = "nearest",
        decode_tp_rule: TpRule = "nearest",
        prefill_tp: int | None = None,
        scale_borrowed_prefill: bool = False,
    ) -> StepCost:
        """The step cost of a TP-``tp`` instance of ``profile``'s model.

        Args:
            profile: the latency tables.
            tp: tensor-parallel size (>= 1).
            decode_model, pass_intercept: module doc; the defaults are the simulator's model.
            prefill_tp_rule, decode_tp_rule: ``"exact"`` or ``"nearest"`` for a TP the table lacks (module doc).
            prefill_tp: read the prefill table measured at this TP (overrides ``prefill_tp_rule``).
            scale_borrowed_prefill: scale a prefill table read at TP t' != ``tp`` by t'/``tp`` (default: unscaled).

        Raises:
            ProfileError: ``tp < 1``, or a table (an ``"exact"`` one, or ``prefill_tp``) the profile lacks.
        """
        if tp < 1:
            raise ProfileError(f"tensor-parallel size must be >= 1, got {tp}")
        if prefill_tp is None:
            prefill_tp = tp if prefill_tp_rule == "exact" else nearest_tp(profile.prefill_tps, tp)
        decode_tp = tp if decode_tp_rule == "exact" else nearest_tp(profile.decode_tps, tp)
        for kind, tables, used in (("prefill", profile.prefill, prefill_tp), ("decode", profile.decode, decode_tp)):
            if used not in tables:
                raise ProfileError(
                    f"profile {profile.name!r} has no {kind} table for TP={tp} (has {tuple(sorted(tables))})"
                )
        dec = profile.decode[decode_tp]
        return cls(
            tp=tp,
            prefill_tp=prefill_tp,
            decode_tp=decode_tp,
            prefill_table=profile.prefill[prefill_tp],
            decode_table=dec,
            decode_model=decode_model,
            pass_intercept=pass_intercept,
            decode_fit=fit_decode(dec) if decode_model == "linear" else None,
            prefill_scale=prefill_tp / tp if scale_borrowed_prefill and prefill_tp != tp else 1.0,
        )

    def with_model(self, *, decode_model: DecodeModel, pass_intercept: PassIntercept) -> StepCost:
        """The same tables priced under other named choices (a fresh memo; the fit made when needed)."""
        fit = self.decode_fit
        if decode_model == "linear" and fit is None:
            fit = fit_decode(self.decode_table)
        return replace(
            self, decode_model=decode_model, pass_intercept=pass_intercept,
            decode_fit=fit if decode_model == "linear" else None, _ttft_memo={},
        )

    # ---- prefill -----------------------------------------------------------------------------------------

    def prefill_s(self, tokens: float) -> float:
        """Prefill latency of one whole prompt of ``tokens`` tokens, s: ``ttft(tokens)`` (batch of one).

        Memoised per length (at most 65,536 lengths, then the memo starts over): the predictor probes the same
        few thousand prompt lengths over and over.
        """
        memo = self._ttft_memo
        v = memo.get(tokens)
        if v is None:
            if len(memo) >= _TTFT_MEMO:
                memo.clear()
            v = memo[tokens] = self.prefill_table(float(tokens)) * self.prefill_scale
        return v

    @property
    def prefill_fixed_s(self) -> float:
        """``ttft(0)``: the prefill table's intercept, s (the fixed cost of a step that only prefills)."""
        return self.prefill_s(0)

    @property
    def decode_fixed_s(self) -> float:
        """Fixed cost of a step that decodes, s: the fit's ``w`` under ``"linear"``, else ``tpot(1, 1)``."""
        if self.decode_fit is not None:
            return self.decode_fit.fixed_s
        return self.decode_table(1.0, 1.0)

    def prefill_chunk_s(self, offset: int, tokens: int) -> float:
        """Marginal cost of prompt tokens ``offset .. offset + tokens`` of one request, s (0 for no tokens):
        ``ttft(offset + tokens) − ttft(offset)``, never negative."""
        if tokens <= 0:
            return 0.0
        v = self.prefill_s(offset + tokens) - self.prefill_s(offset)
        return v if v > 0.0 else 0.0

    def prefill_batch_s(self, lengths: Sequence[float]) -> float:
        """One batch of whole prompts of these lengths (tokens) started together, s (0 for none): the profile's
        batched-prefill formula (DOPD Alg. 1; :meth:`~fulcrum.ratio.profile.PrefillTable.batch`)."""
        return self.prefill_table.batch(lengths) * self.prefill_scale

    def prefill_fit_marginal_s(self, tokens: float) -> float:
        """Compute a prompt of ``tokens`` tokens adds to a step that runs anyway, s: ``κ1·x + κ2·x²`` of the
        prefill table's NNLS fit (DOPD eq. 5 without τ), times :attr:`prefill_scale`. The planner's price of a
        local (ultra-short) prefill on a decode instance (DOPD §V-E)."""
        _, k1, k2 = self.prefill_table.quadratic
        scale = self.prefill_scale
        if scale != 1.0:
            k1, k2 = k1 * scale, k2 * scale
        x = float(tokens)
        return k1 * x + k2 * x * x

    def prefill_part_s(self, chunks: Sequence[tuple[int, int]], decodes: int = 0) -> float:
        """The prefill part of a step that computes these prompt chunks ``(offset, tokens)``, s.

        ``"per_part"``: the chunks at offset 0 as one batched prefill plus the marginals of the others.
        ``"per_pass"``: the marginals of all chunks, plus ``ttft(0)`` when ``decodes == 0`` and there is a chunk
        (the step's one fixed cost; with decodes the decode step carries it).
        """
        if not chunks:
            return 0.0
        if self.pass_intercept == "per_pass":
            s = sum(self.prefill_chunk_s(o, q) for o, q in chunks)
            return s + self.prefill_fixed_s if decodes <= 0 else s
        fresh: list[float] = []
        cont = 0.0
        for o, q in chunks:
            if o == 0:
                fresh.append(float(q))
            else:
                cont += self.prefill_chunk_s(o, q)
        return (self.prefill_table.batch(fresh) * self.prefill_scale if fresh else 0.0) + cont

    # ---- decode ------------------------------------------------------------------------------------------

    def decode_step_s(self, batch: float, mean_context: float) -> float:
        """One decode step of ``batch`` requests at mean context ``mean_context`` tokens, s.

        ``"table"``: ``tpot(batch, mean_context)`` (batch and context below 1 read as 1, as the table does);
        ``"linear"``: ``w + m·b + k·b·c̄`` with b at least 1.
        """
        fit = self.decode_fit
        if fit is None:
            return self.decode_table(batch, mean_context)
        b = max(float(batch), 1.0)
        return fit.fixed_s + b * fit.per_seq_s + b * max(float(mean_context), 1.0) * fit.per_context_token_s

    def decode_request_s(self, context: float, steps: int) -> float:
        """Per-request part of ``steps`` decode steps of one request from ``context`` tokens, s (no fixed cost).

        ``Σ_j (m + k·(context + j))`` over the steps (the context grows a token a step): only the linear model
        splits a step's cost over its requests.

        Raises:
            ValueError: ``decode_model`` is ``"table"``.
        """
        fit = self.decode_fit
        if fit is None:
            raise ValueError("per-request decode cost needs decode_model='linear'")
        if steps <= 0:
            return 0.0
        return steps * fit.per_seq_s + fit.per_context_token_s * (steps * context + steps * (steps - 1) / 2.0)

    def decode_run_s(self, batch: int, context_sum: float, steps: int) -> float:
        """``steps`` consecutive decode steps of a constant batch of ``batch`` requests attending to
        ``context_sum`` tokens at the first, each context growing one token a step, s (0 for none)."""
        if batch <= 0 or steps <= 0:
            return 0.0
        fit = self.decode_fit
        if fit is not None:
            return steps * (fit.fixed_s + batch * fit.per_seq_s) + fit.per_context_token_s * (
                steps * context_sum + batch * steps * (steps - 1) / 2.0
            )
        return sum(self.decode_table(batch, context_sum / batch + j) for j in range(steps))

    # ---- a step ------------------------------------------------------------------------------------------

    def step_s(self, chunks: Sequence[tuple[int, int]], decodes: int, mean_context: float) -> float:
        """One engine step: these prompt chunks ``(offset, tokens)`` and ``decodes`` requests decoding one token
        each at mean context ``mean_context`` tokens, s (0 for an empty step).

        ``prefill_part_s(chunks, decodes) + decode_step_s(decodes, mean_context)`` (the latter only with decodes).
        """
        d = self.decode_step_s(decodes, mean_context) if decodes > 0 else 0.0
        return self.prefill_part_s(chunks, decodes) + d
