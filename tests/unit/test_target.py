"""The pool vocabulary (fulcrum.target.Pool) and the ClusterTarget / ReadyCounts helpers that replace string lookups."""

from __future__ import annotations

import json

import pytest

from fulcrum.observation import ReadyCounts
from fulcrum.target import ClusterTarget, Pool, PoolSize, RoutingParams

T = ClusterTarget(prefill=PoolSize(3, 1), decode=PoolSize(2, 4), routing=RoutingParams(ultra_short_tokens=64))


def test_pools_iterate_in_object_order_and_read_as_their_names() -> None:
    assert list(Pool) == [Pool.PREFILL, Pool.DECODE, Pool.UNIFIED]
    assert [str(p) for p in Pool] == ["prefill", "decode", "unified"] and f"{Pool.DECODE}-x" == "decode-x"
    assert Pool.DECODE == "decode" and {"decode": 1}[Pool.DECODE] == 1  # status keys and labels stay strings
    assert json.dumps({Pool.PREFILL: Pool.UNIFIED}) == '{"prefill": "unified"}'
    assert Pool("unified") is Pool.UNIFIED and Pool.disaggregated() == (Pool.PREFILL, Pool.DECODE)
    with pytest.raises(ValueError):
        Pool("both")


def test_a_target_is_read_and_changed_by_pool_with_the_rest_kept() -> None:
    assert T.pool(Pool.DECODE) == PoolSize(2, 4) and T.pool(Pool.UNIFIED) == PoolSize()
    bigger = T.with_replicas(Pool.DECODE, 5)
    assert bigger.decode == PoolSize(5, 4) and bigger.prefill == T.prefill and bigger.routing == T.routing
    assert T.with_pool(Pool.UNIFIED, PoolSize(1, 8)).unified == PoolSize(1, 8)
    assert dict(T.pools()) == {Pool.PREFILL: T.prefill, Pool.DECODE: T.decode, Pool.UNIFIED: T.unified}
    assert ClusterTarget.of({Pool.PREFILL: PoolSize(3, 1), Pool.DECODE: PoolSize(2, 4)}, T.routing) == T
    assert T.same_pools(ClusterTarget(prefill=T.prefill, decode=T.decode)) and not T.same_pools(bigger)
    with pytest.raises(ValueError):
        T.with_replicas(Pool.PREFILL, -1)


def test_ready_counts_are_read_by_pool() -> None:
    r = ReadyCounts(prefill=3, decode=1, unified=0)
    assert [r.of(p) for p in Pool] == [3, 1, 0] and r.total == 4
