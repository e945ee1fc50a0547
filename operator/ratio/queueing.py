"""Queueing headroom for the TTFT SLO: DOPD eqs. (10), (17), (18).

DOPD models the prefill queue with Kingman's heavy-traffic approximation (eq. 10)

    W_q ≈ ρ/(1−ρ) · (c_a² + c_s²)/2 · E[S],      ρ = λ·E[S]  (eq. 17)

for one server. Fulcrum's prefill instances pull from one shared queue (DOPD §V-C), i.e. a G/G/c queue, for
which we use the Allen–Cunneen form (Kingman's for c = 1):

    W_q ≈ C(c, a) / (c·μ − λ) · (c_a² + c_s²)/2,   a = λ/μ, μ = 1/E[S], C = Erlang's C formula.

For an SLO at percentile q we need the waiting-time *quantile*, not its mean. Under the same heavy-traffic
approximation the wait is zero with probability 1 − C and exponential otherwise, with the rate above, so

    W_q(q) = E[S]·(c_a² + c_s²)/2 / (c·(1 − ρ)) · ln(C / (1 − q))   when C > 1 − q, else 0.

The batching timeout of DOPD Alg. 1 follows eq. (18): T_timeout ≥ α·W_q, and it may never use up the TTFT
slack the queue leaves.
"""

from __future__ import annotations

import math

__all__ = ["erlang_c", "mean_wait", "wait_quantile", "min_servers_for_ttft", "batching_timeout"]


def erlang_c(servers: int, offered_load: float) -> float:
    """Probability an arrival waits in an M/M/c queue (Erlang C), c = ``servers``, a = λ·E[S] (erlangs).

    Returns 1.0 when the load reaches or exceeds the servers (unstable), 0.0 for no load.
    Computed with the numerically stable Erlang-B recursion.
    """
    if offered_load <= 0:
        return 0.0
    if servers <= 0 or offered_load >= servers:
        return 1.0
    b = 1.0
    for k in range(1, servers + 1):
        b = offered_load * b / (k + offered_load * b)
    rho = offered_load / servers
    return b / (1.0 - rho + rho * b)


def mean_wait(rate: float, mean_service_s: float, ca2: float, cs2: float, servers: int = 1) -> float:
    """Mean queueing delay W_q in seconds (eq. 10 for c = 1; Allen–Cunneen for c > 1). ``inf`` if ρ ≥ 1."""
    if rate <= 0 or mean_service_s <= 0:
        return 0.0
    a = rate * mean_service_s
    if servers <= 0 or a >= servers:
        return math.inf
    c_wait = erlang_c(servers, a)
    return c_wait / (servers / mean_service_s - rate) * (ca2 + cs2) / 2.0


def wait_quantile(rate: float, mean_service_s: float, ca2: float, cs2: float, servers: int, q: float) -> float:
    """Queueing delay at quantile ``q`` (0 < q < 1), seconds; ``inf`` if the queue is unstable (see module doc)."""
    if rate <= 0 or mean_service_s <= 0:
        return 0.0
    a = rate * mean_service_s
    if servers <= 0 or a >= servers:
        return math.inf
    c_wait = erlang_c(servers, a)
    tail = 1.0 - q
    if c_wait <= tail:
        return 0.0
    rho = a / servers
    scale = mean_service_s * max(ca2 + cs2, 1e-9) / 2.0 / (servers * (1.0 - rho))
    return scale * math.log(c_wait / tail)


def min_servers_for_ttft(
    rate: float,
    mean_service_s: float,
    service_q_s: float,
    ca2: float,
    cs2: float,
    ttft_slo_s: float,
    q: float,
    *,
    max_servers: int = 4096,
    target_utilisation: float = 0.95,
) -> int:
    """Fewest prefill instances c so that W_q(q) + S(q) ≤ TTFT SLO and ρ ≤ ``target_utilisation``.

    Args:
        rate: arrival rate λ, requests/s.
        mean_service_s: E[S], mean prefill time per request (or per request within a batch), seconds.
        service_q_s: prefill time at the same quantile, S(q), seconds (a long prompt's own prefill).
        ca2, cs2: squared coefficients of variation of inter-arrival and service times.
        ttft_slo_s: TTFT target, seconds.
        q: SLO percentile as a fraction, e.g. 0.9.
        max_servers: search bound; returned when even that many miss the SLO.

    Returns the count (≥ 1 when rate > 0, 0 when rate is 0).
    """
    if rate <= 0 or mean_service_s <= 0:
        return 0
    a = rate * mean_service_s
    c = max(1, math.ceil(a / target_utilisation))
    budget = ttft_slo_s - service_q_s
    while c < max_servers:
        if budget > 0 and wait_quantile(rate, mean_service_s, ca2, cs2, c, q) <= budget:
            return c
        if budget <= 0:
            # The prompt itself outlasts the SLO: no count of instances helps; keep the stable minimum.
            return c
        c += 1
    return max_servers


def batching_timeout(expected_wait_s: float, slack_s: float, alpha: float = 0.5) -> float:
    """DOPD Alg. 1 batching timeout by eq. (18): α·W_q, capped by the TTFT slack left (seconds, ≥ 0)."""
    if not math.isfinite(expected_wait_s):
        return 0.0
    return max(0.0, min(alpha * expected_wait_s, slack_s))
