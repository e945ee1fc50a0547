"""Output-length prediction for the split policy: D, the decode tokens a request will produce.

Libra §6 ("Length prediction discussion"): the global scheduler needs a rough D; decisions rest on relative
execution times, so errors are tolerated, and "to further guard against underestimation which could cause SLO
violations, we apply a conservative safety margin (20 tokens in our setup)". Table 5 shows goodput within 2.9%
under σ = 100 tokens of noise.

The protocol is :class:`OutputLengthPredictor`; the default, :class:`BucketedQuantilePredictor`, is an online
estimate per model: the q-quantile (default the median, the point that minimises the absolute error) of the
output lengths recently observed for prompts in the same ISL bucket (log-spaced buckets), over a sliding window
per bucket (so it follows drift), falling back to the window over all buckets while a bucket has too few
samples, and to a prior (or ``max_tokens``) before anything has been observed; plus the safety margin, capped
at the request's ``max_tokens``. :class:`PerModelLengthPredictors` keeps one per served model.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from bisect import bisect_right, insort
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

__all__ = [
    "OutputLengthPredictor",
    "SlidingQuantile",
    "BucketedQuantilePredictor",
    "PerModelLengthPredictors",
    "DEFAULT_ISL_BUCKET_EDGES",
]

DEFAULT_ISL_BUCKET_EDGES: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
"""Upper-exclusive ISL bucket edges, tokens: bucket 0 is ISL < 64, the last is ISL ≥ 32768."""


@runtime_checkable
class OutputLengthPredictor(Protocol):
    """Predicts how many tokens a request will generate and learns from finished requests."""

    def predict(self, prompt_tokens: int, max_tokens: int) -> int:
        """Predicted output length, tokens, in [1, max(max_tokens, 1)]."""
        ...

    def observe(self, prompt_tokens: int, output_tokens: int) -> None:
        """Record a finished request's prompt and output lengths, tokens."""
        ...


class SlidingQuantile:
    """Exact quantile of the last ``window`` values: a FIFO for age and a sorted list for rank.

    O(window) memory; ``add`` costs O(log window) comparisons plus a memmove; ``quantile`` is O(1).

    Raises:
        ValueError: ``window < 1``.
    """

    __slots__ = ("window", "_fifo", "_sorted")

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = int(window)
        self._fifo: deque[int] = deque()
        self._sorted: list[int] = []

    def __len__(self) -> int:
        return len(self._fifo)

    def add(self, value: int) -> None:
        """Add one value, evicting the oldest beyond the window."""
        self._fifo.append(value)
        insort(self._sorted, value)
        if len(self._fifo) > self.window:
            old = self._fifo.popleft()
            del self._sorted[bisect_right(self._sorted, old) - 1]

    def quantile(self, q: float) -> int:
        """Nearest-rank q-quantile (the ⌈q·n⌉-th smallest value).

        Raises:
            ValueError: the window is empty.
        """
        n = len(self._sorted)
        if n == 0:
            raise ValueError("no values yet")
        return self._sorted[min(max(math.ceil(q * n) - 1, 0), n - 1)]


class BucketedQuantilePredictor:
    """Online per-ISL-bucket quantile of output lengths plus a safety margin (module doc).

    Args:
        quantile: q in (0, 1): 0.5 = median (least absolute error); higher values under-predict less often.
        margin_tokens: added to the estimate (Libra: 20 tokens), tokens (≥ 0).
        bucket_edges: increasing ISL edges, tokens (:data:`DEFAULT_ISL_BUCKET_EDGES`).
        window: recent observations kept per bucket (and 4× that over all buckets).
        min_samples: a bucket answers once it holds this many observations; before that, all buckets together.
        prior_tokens: estimate before any observation (None: the request's ``max_tokens``, no margin).

    Raises:
        ValueError: q outside (0, 1), negative margin, edges not increasing, ``window``/``min_samples`` < 1.
    """

    def __init__(
        self,
        *,
        quantile: float = 0.5,
        margin_tokens: int = 20,
        bucket_edges: Sequence[int] = DEFAULT_ISL_BUCKET_EDGES,
        window: int = 512,
        min_samples: int = 16,
        prior_tokens: int | None = None,
    ) -> None:
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"quantile must be in (0, 1), got {quantile}")
        if margin_tokens < 0 or window < 1 or min_samples < 1:
            raise ValueError("margin_tokens must be >= 0, window and min_samples >= 1")
        edges = tuple(int(e) for e in bucket_edges)
        if any(b <= a for a, b in zip(edges, edges[1:])):
            raise ValueError(f"bucket_edges must be strictly increasing, got {edges}")
        self.quantile = float(quantile)
        self.margin_tokens = int(margin_tokens)
        self.bucket_edges = edges
        self.min_samples = int(min_samples)
        self.prior_tokens = prior_tokens
        self._buckets = [SlidingQuantile(window) for _ in range(len(edges) + 1)]
        self._all = SlidingQuantile(4 * window)

    def bucket(self, prompt_tokens: int) -> int:
        """Index of the ISL bucket of a prompt length."""
        return bisect_right(self.bucket_edges, prompt_tokens)

    def estimate(self, prompt_tokens: int) -> int | None:
        """The quantile estimate without margin or cap, tokens; None before any observation."""
        b = self._buckets[self.bucket(prompt_tokens)]
        if len(b) >= self.min_samples:
            return b.quantile(self.quantile)
        if len(self._all) > 0:
            return self._all.quantile(self.quantile)
        return None

    def predict(self, prompt_tokens: int, max_tokens: int) -> int:
        """Estimate + margin, capped at ``max_tokens``; ``prior_tokens`` or ``max_tokens`` on a cold start."""
        cap = max(int(max_tokens), 1)
        est = self.estimate(prompt_tokens)
        if est is None:
            return cap if self.prior_tokens is None else min(max(self.prior_tokens + self.margin_tokens, 1), cap)
        return min(max(est + self.margin_tokens, 1), cap)

    def observe(self, prompt_tokens: int, output_tokens: int) -> None:
        """Record one finished request (negative lengths are ignored)."""
        if prompt_tokens < 0 or output_tokens < 0:
            return
        self._buckets[self.bucket(prompt_tokens)].add(int(output_tokens))
        self._all.add(int(output_tokens))


class PerModelLengthPredictors:
    """One output-length predictor per served model, made by ``factory`` when the model's first finished request is
    observed (or :meth:`for_model` asks for it).

    A prediction for a model without one is answered by a single spare predictor that never observes anything (what
    a new predictor answers) and keeps nothing: the router predicts before the engine refuses an unknown model, so
    a predictor per name asked would let clients grow the router's memory without bound (about 11 KB per name).
    """

    def __init__(self, factory: Callable[[], OutputLengthPredictor] = BucketedQuantilePredictor) -> None:
        self._factory = factory
        self._by_model: dict[str, OutputLengthPredictor] = {}
        self._unseen: OutputLengthPredictor | None = None

    def __len__(self) -> int:
        """Models with a predictor of their own."""
        return len(self._by_model)

    def for_model(self, model: str) -> OutputLengthPredictor:
        """The predictor of ``model`` (made now if it has none)."""
        p = self._by_model.get(model)
        if p is None:
            p = self._by_model[model] = self._factory()
        return p

    def predict(self, model: str, prompt_tokens: int, max_tokens: int) -> int:
        """``model``'s predictor's ``predict(prompt_tokens, max_tokens)``, tokens; a model without one is answered as
        a new predictor would answer, and none is kept for it (class doc)."""
        p = self._by_model.get(model)
        if p is None:
            p = self._unseen
            if p is None:
                p = self._unseen = self._factory()
        return p.predict(prompt_tokens, max_tokens)

    def observe(self, model: str, prompt_tokens: int, output_tokens: int) -> None:
        """``for_model(model).observe(prompt_tokens, output_tokens)``."""
        self.for_model(model).observe(prompt_tokens, output_tokens)
