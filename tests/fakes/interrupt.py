"""Ctrl-C for real: run ``python -m fulcrum ...`` as a child process, send it SIGINT once it reached a point, and
collect what it printed (the tests of ``fulcrum profile``'s interrupt handling)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence


async def interrupt_when(argv: Sequence[str], reached: Callable[[], bool], what: str) -> tuple[int, str]:
    """Start ``python -m fulcrum *argv``, wait (up to 60 s) until ``reached()``, send SIGINT, wait (up to 30 s) for
    the exit. The waits sleep on the running loop, so a FAKE engine served by this loop keeps answering.

    Returns: (exit code, standard error as text). The child is killed if it outlives the waits.

    Raises:
        AssertionError: the child exited, or 60 s passed, before ``reached()`` (``what`` names the point).
    """
    proc = subprocess.Popen([sys.executable, "-m", "fulcrum", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 60
        while not reached() and time.monotonic() < deadline and proc.poll() is None:
            await asyncio.sleep(0.05)
        assert reached(), f"the run never reached {what}"
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        _, err = proc.communicate(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err.decode()
