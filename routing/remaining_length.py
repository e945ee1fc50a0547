"""Remaining-length prediction for decode rescheduling (ARES §4): how many more tokens a running request makes.

ARES §4 predicts the remaining generation length Y of a request from the sequence so far and re-predicts it at
regular intervals during decode ("continuous prediction"): later predictions see more of the request and are more
precise (§4, Fig. 7). Its predictor is a 4-layer MLP over the last-layer hidden state of the last token, trained
offline (§4.2); Fulcrum states that interface (:class:`HiddenStateLengthPredictor`) but ships no MLP — the router
sees no hidden states. What the router can compute without the engine's internals, and what this module does:

**The conditional remaining length.** For a request of prompt length P that has generated g tokens and is still
running (so its output length L exceeds g), the remaining length is ``L − g``, and given only P and g the
estimate is a statistic of the observed output-length distribution *conditioned on L > g* — the mean residual
life ``E[L − g | L > g]`` (default; ``statistic="median"`` gives the conditional median, the point that minimises
the absolute error). Heavy-tailed output lengths (ShareGPT, Azure) make this grow with g: a request that has
already run long is likely a long one — exactly the information a prompt-only estimate ``max(L̂ − g, 1)`` throws
away.

The distribution is kept online per served model and per ISL bucket (the buckets of
:data:`fulcrum.routing.length_predictor.DEFAULT_ISL_BUCKET_EDGES`) over a sliding window of the most recent
finished requests (so it follows drift), and estimates fall back, in order, to:

1. the request's ISL bucket when at least ``min_samples`` of its observations exceed g;
2. the model's whole window when at least ``min_samples`` of those exceed g;
3. past the observed tail (fewer than ``min_samples`` observations above g): a memoryless (exponential) tail —
   the mean (or median) excess over the threshold u that leaves ``min_samples`` observations above it, which an
   exponential tail keeps constant beyond u; a window of at most ``min_samples`` observations has its u at its
   shortest length, and below that (g < u, not past the tail) the excess over g of all its observations answers;
4. nothing observed for the model yet: ``max_tokens − g`` when the request has a cap, else ``prior_tokens``.

Estimates are rounded and clamped to ``[1, max_tokens − g]`` (0 once ``g ≥ max_tokens``: the request is done).

Pure: no I/O, no clock. ``observe`` costs O(log window) plus a list insertion; a prediction O(log window) after
the first one following a change to its window (which rebuilds that window's prefix sums, O(window)).
"""

from __future__ import annotations

import math
from bisect import bisect_right, insort
from collections import deque
from collections.abc import Sequence
from itertools import accumulate
from typing import Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from fulcrum.routing.length_predictor import DEFAULT_ISL_BUCKET_EDGES

__all__ = [
    "RemainingLength",
    "HiddenStateLengthPredictor",
    "ExcessWindow",
    "RemainingLengthPredictor",
]

Statistic = Literal["mean", "median"]


@runtime_checkable
class RemainingLength(Protocol):
    """Predicts a running request's remaining output length and learns from finished requests."""

    def predict_remaining(self, model: str, prompt_tokens: int, generated_tokens: int,
                          max_tokens: int | None = None) -> int:
        """Tokens the request will still generate, given P prompt tokens and g generated so far, tokens."""
        ...

    def observe(self, model: str, prompt_tokens: int, output_tokens: int) -> None:
        """Record a finished request's prompt and output lengths, tokens."""
        ...


@runtime_checkable
class HiddenStateLengthPredictor(Protocol):
    """ARES §4.2's LLM-native predictor: an MLP over the target model's last-layer hidden state (interface only).

    ARES feeds ``h ∈ R^d``, the final transformer layer's hidden state of the last token (prompt and generated
    tokens so far), to a 4-layer MLP ``ŷ = w4 φ(W3 φ(W2 φ(W1 h)))`` with ReLU φ (§4.2, eq. 2; for
    DeepSeek-R1-Distill-Qwen-7B, d = 3584 and widths 2048, 512, 64) that regresses the remaining length; it is
    trained offline with an L1 loss on (h, remaining) pairs recorded at fixed decode intervals (every 20 tokens)
    of the serving model (§4.4), and re-run every k decode iterations (continuous prediction, §4.3; k = 20 keeps
    the overhead near 1.40 / (18.23 · k) of a step, §5.3). An implementation lives beside the engine (a vLLM
    plugin that can read the hidden states) and reports its predictions to the router; it must be side-effect
    free.

    Attributes:
        model: the served model whose hidden states it reads (predictors are model-specific).
        hidden_size: d, the model's hidden size.
    """

    model: str
    hidden_size: int

    def predict_remaining(self, hidden_states: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """Remaining lengths for a batch of requests.

        Args:
            hidden_states: shape (batch, hidden_size), the last token's final-layer hidden state per request.

        Returns:
            shape (batch,), predicted remaining output tokens (≥ 0; the caller rounds and caps them).

        Raises:
            ValueError: the second dimension is not ``hidden_size``.
        """
        ...


class ExcessWindow:
    """The last ``size`` output lengths, sorted, with prefix sums: excess statistics above any g.

    Raises:
        ValueError: ``size < 1``.
    """

    __slots__ = ("size", "_fifo", "_sorted", "_prefix")

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = int(size)
        self._fifo: deque[int] = deque()
        self._sorted: list[int] = []
        self._prefix: list[int] | None = None

    def __len__(self) -> int:
        return len(self._fifo)

    def add(self, value: int) -> None:
        """Add one output length, tokens, evicting the oldest beyond the window."""
        self._fifo.append(value)
        insort(self._sorted, value)
        if len(self._fifo) > self.size:
            old = self._fifo.popleft()
            del self._sorted[bisect_right(self._sorted, old) - 1]
        self._prefix = None

    def count_above(self, g: float) -> int:
        """Observations L > g."""
        return len(self._sorted) - bisect_right(self._sorted, g)

    def excess(self, g: float, statistic: Statistic) -> float | None:
        """``mean`` or ``median`` of L − g over the observations L > g, tokens; None when there are none."""
        s = self._sorted
        i = bisect_right(s, g)
        n = len(s) - i
        if n == 0:
            return None
        if statistic == "median":
            mid = i + (n - 1) // 2
            med = s[mid] if n % 2 else (s[mid] + s[mid + 1]) / 2.0
            return med - g
        if self._prefix is None:
            self._prefix = [0, *accumulate(s)]
        return (self._prefix[-1] - self._prefix[i]) / n - g

    def tail_threshold(self, k: int) -> float | None:
        """The value u with ``min(k, n − 1)`` observations above it (the (n − k)-th smallest); None when empty."""
        n = len(self._sorted)
        if n == 0:
            return None
        return float(self._sorted[max(n - 1 - k, 0)])


class _ModelWindows:
    __slots__ = ("buckets", "all")

    def __init__(self, n_buckets: int, window: int) -> None:
        self.buckets = [ExcessWindow(window) for _ in range(n_buckets)]
        self.all = ExcessWindow(4 * window)


class RemainingLengthPredictor:
    """``E[L − g | L > g]`` (or the conditional median) per model and ISL bucket, refreshed online (module doc).

    Args:
        statistic: ``"mean"`` (ARES's expected remaining work, what a load balancer sums) or ``"median"`` (least
            absolute error per request).
        bucket_edges: increasing ISL bucket edges, tokens.
        window: recent finished requests kept per bucket (4× that per model).
        min_samples: observations above g a window needs before it answers (fallback order in the module doc).
        prior_tokens: the estimate before anything was observed for the model, for requests without a cap.

    Raises:
        ValueError: an unknown statistic, edges not strictly increasing, ``window``/``min_samples``/
            ``prior_tokens`` < 1.
    """

    def __init__(
        self,
        *,
        statistic: Statistic = "mean",
        bucket_edges: Sequence[int] = DEFAULT_ISL_BUCKET_EDGES,
        window: int = 2048,
        min_samples: int = 16,
        prior_tokens: int = 512,
    ) -> None:
        if statistic not in ("mean", "median"):
            raise ValueError(f"statistic must be 'mean' or 'median', got {statistic!r}")
        edges = tuple(int(e) for e in bucket_edges)
        if any(b <= a for a, b in zip(edges, edges[1:])):
            raise ValueError(f"bucket_edges must be strictly increasing, got {edges}")
        if window < 1 or min_samples < 1 or prior_tokens < 1:
            raise ValueError("window, min_samples and prior_tokens must be >= 1")
        self.statistic: Statistic = statistic
        self.bucket_edges = edges
        self.window = int(window)
        self.min_samples = int(min_samples)
        self.prior_tokens = int(prior_tokens)
        self._models: dict[str, _ModelWindows] = {}

    def bucket(self, prompt_tokens: int) -> int:
        """Index of the ISL bucket of a prompt length."""
        return bisect_right(self.bucket_edges, prompt_tokens)

    def _windows(self, model: str) -> _ModelWindows:
        w = self._models.get(model)
        if w is None:
            w = self._models[model] = _ModelWindows(len(self.bucket_edges) + 1, self.window)
        return w

    def observe(self, model: str, prompt_tokens: int, output_tokens: int) -> None:
        """Record one finished request (negative lengths are ignored)."""
        if prompt_tokens < 0 or output_tokens < 0:
            return
        w = self._windows(model)
        w.buckets[self.bucket(prompt_tokens)].add(int(output_tokens))
        w.all.add(int(output_tokens))

    def estimate(self, model: str, prompt_tokens: int, generated_tokens: int) -> float | None:
        """The conditional statistic before rounding and capping, tokens; None when nothing was observed."""
        w = self._models.get(model)
        if w is None or len(w.all) == 0:
            return None
        g = max(0, int(generated_tokens))
        for win in (w.buckets[self.bucket(prompt_tokens)], w.all):
            if win.count_above(g) >= self.min_samples:
                return win.excess(g, self.statistic)
        # past the observed tail: a memoryless tail keeps the excess over a high threshold constant. A window of
        # at most min_samples observations puts u at its shortest length, which g may not have reached: g is not
        # past the tail then, and the excess over g itself (of the few observations above it) answers.
        u = w.all.tail_threshold(self.min_samples)
        assert u is not None
        est = w.all.excess(min(u, g), self.statistic)
        return est if est is not None else 1.0

    def predict_remaining(self, model: str, prompt_tokens: int, generated_tokens: int,
                          max_tokens: int | None = None) -> int:
        """Tokens still to come for a running request, in ``[1, max_tokens − g]`` (0 once g ≥ max_tokens).

        Args:
            model: served model name. prompt_tokens: P, tokens. generated_tokens: g, tokens (< 0 is read as 0).
            max_tokens: the request's output cap, tokens (None: no cap).
        """
        g = max(0, int(generated_tokens))
        cap = None if max_tokens is None else int(max_tokens) - g
        if cap is not None and cap <= 0:
            return 0
        est = self.estimate(model, prompt_tokens, g)
        if est is None:
            return cap if cap is not None else self.prior_tokens
        out = max(1, int(math.floor(est + 0.5)))
        return min(out, cap) if cap is not None else out
