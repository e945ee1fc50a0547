"""Shared test fixtures. Data from ../shared/data is read where present; tests that need it skip with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
from threadpoolctl import threadpool_limits

# One BLAS thread, as the CLI uses: several threads on the 2 shared cores slow ARIMA fits 10-100x.
threadpool_limits(limits=1)

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    """The shared real-data folder (traces, profiles); skips the test when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture
def table_i():
    """DOPD Table I profile (shipped)."""
    from fulcrum.ratio.profiles import builtin_profile

    return builtin_profile("dopd-llama70b-fp8-h100")


@pytest.fixture
def splitwise():
    """Splitwise Llama-2-70B H100 profile (shipped)."""
    from fulcrum.ratio.profiles import builtin_profile

    return builtin_profile("splitwise-llama2-70b-h100")


# ---------------------------------------------------------------------------------------------- router
# A router in front of FAKE engines (tests/fakes/), for the router's tests. Needs aiohttp and pytest-asyncio.
try:
    import pytest_asyncio as _pytest_asyncio
except ImportError:  # pragma: no cover - the router tests skip without it
    _pytest_asyncio = None

if _pytest_asyncio is not None:

    @_pytest_asyncio.fixture
    async def router_harness():
        """``await router_harness(n=2, settings=..., policy=..., config={...})`` → a started RouterHarness;
        every harness made is closed after the test."""
        from fakes.router_harness import RouterHarness

        made = []

        async def make(**kwargs):
            h = RouterHarness()
            made.append(h)
            return await h.start(**kwargs)

        yield make
        for h in made:
            await h.close()


@pytest.fixture
def spare_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh folder set as the temporary folder (``TMPDIR``, read again by :mod:`tempfile`), where a file that
    cannot be written where asked is kept; the test globs it for what was saved."""
    spare = tmp_path / "spare"
    spare.mkdir()
    monkeypatch.setenv("TMPDIR", str(spare))
    monkeypatch.setattr("tempfile.tempdir", None)  # TMPDIR is read again
    return spare
