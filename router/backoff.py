"""Capped exponential backoff with jitter, shared by the router's reconnecting clients (etcd, Kubernetes)."""

from __future__ import annotations

import random

__all__ = ["Backoff"]


class Backoff:
    """Capped exponential backoff with ±20 % jitter (so many workers do not reconnect in lockstep)."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        if initial_s <= 0 or max_s < initial_s:
            raise ValueError("backoff needs 0 < initial_s <= max_s")
        self.initial_s = initial_s
        self.max_s = max_s
        self._next = initial_s
        self._rng = random.Random()

    def reset(self) -> None:
        self._next = self.initial_s

    def next(self) -> float:
        """The delay to wait now, seconds; doubles the following one up to ``max_s``."""
        delay = self._next * self._rng.uniform(0.8, 1.2)
        self._next = min(self._next * 2.0, self.max_s)
        return min(delay, self.max_s)
