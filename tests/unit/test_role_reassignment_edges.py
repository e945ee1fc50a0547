"""Role reassignment (BanaServe Alg. 1 with a role flip) at its edges: the last instance of a duty, and a
utilisation that is not a number."""

from __future__ import annotations

import math

from fulcrum.rebalancing.role_reassignment import InstanceUtilisation, RoleBounds, plan_role_change


def test_the_last_instance_of_a_duty_is_not_flipped_even_when_the_bounds_allow_zero() -> None:
    """Router config accepts ``min_decode: 0`` / ``min_prefill: 0``; with one instance left on the cool duty the
    N/(N−1) check divided by zero (ZeroDivisionError every period, logged by the router's loop). The duty's load
    would have no instance left, so the flip cannot shrink the gap: no change."""
    hot_prefill = [InstanceUtilisation("p", "prefill", 1.8), InstanceUtilisation("d", "decode", 0.1)]
    assert plan_role_change(hot_prefill, RoleBounds(min_decode=0)) is None
    hot_decode = [InstanceUtilisation("p", "prefill", 0.1), InstanceUtilisation("d", "decode", 1.8)]
    assert plan_role_change(hot_decode, RoleBounds(min_prefill=0)) is None
    # with two on the cool duty the flip still happens
    two = [*hot_prefill, InstanceUtilisation("d2", "decode", 0.2)]
    change = plan_role_change(two, RoleBounds(min_decode=0))
    assert change is not None and change.instance == "d" and change.to_duty == "prefill"


def test_a_utilisation_that_is_not_a_number_flips_nothing() -> None:
    """A NaN utilisation made the gap NaN, which passed both the δ test and the overshoot test (every comparison
    with NaN is false): an instance was flipped on no information."""
    nan = [
        InstanceUtilisation("p", "prefill", math.nan), InstanceUtilisation("p2", "prefill", 1.0),
        InstanceUtilisation("d", "decode", 0.1), InstanceUtilisation("d2", "decode", 0.1),
    ]
    assert plan_role_change(nan) is None


def test_a_cooldown_or_dwell_time_that_is_not_a_number_is_refused() -> None:
    """``cooldown_s < 0 or dwell_s < 0`` let NaN through: a NaN cooldown never held a flip back, a NaN dwell time
    held every instance back for ever (``now − flipped >= NaN`` is false)."""
    import pytest

    from fulcrum.rebalancing.role_reassignment import RoleBalanceConfig

    for field in ("cooldown_s", "dwell_s"):
        with pytest.raises(ValueError, match="cooldown_s and dwell_s"):
            RoleBalanceConfig(**{field: math.nan})
