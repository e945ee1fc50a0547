"""``fulcrum.commands.bind_host``: ``$FULCRUM_BIND_HOST`` narrows a wildcard ``--host`` and nothing else (the
e2e process node agent sets it to a pod's loopback address, docs/e2e.md)."""

from __future__ import annotations

import pytest

from fulcrum.commands import BIND_HOST_ENV, bind_host


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::", ""])
def test_a_wildcard_host_becomes_the_bind_host_from_the_environment(
        monkeypatch: pytest.MonkeyPatch, wildcard: str) -> None:
    monkeypatch.setenv(BIND_HOST_ENV, "127.0.3.4")
    assert bind_host(wildcard) == "127.0.3.4"


def test_an_explicit_host_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BIND_HOST_ENV, "127.0.3.4")
    assert bind_host("127.0.0.1") == "127.0.0.1"


@pytest.mark.parametrize("value", [None, "", "  "])
def test_without_the_variable_the_host_is_kept(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv(BIND_HOST_ENV, raising=False)
    else:
        monkeypatch.setenv(BIND_HOST_ENV, value)
    assert bind_host("0.0.0.0") == "0.0.0.0"
