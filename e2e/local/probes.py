"""Polling helpers the local-cluster scenarios share: wait for a condition, read objects with kubectl."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest

__all__ = ["wait", "kget"]


def wait(what: str, probe: Callable[[], Any], timeout_s: float = 120.0, every_s: float = 0.5) -> Any:
    """Call ``probe`` every ``every_s`` seconds until it returns something truthy, and return that.

    An exception of a probe that is not ready yet (a failing kubectl, a refused connection, a missing key) counts
    as "not yet". Fails the test after ``timeout_s`` seconds, naming ``what`` and the last answer.
    """
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except (subprocess.CalledProcessError, OSError, KeyError, ValueError, RuntimeError) as err:
            last = err
        else:
            if last:
                return last
        time.sleep(every_s)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what} (last: {str(last)[:800]})")


def kget(cluster: Any, kind: str, ns: str, name: str = "", selector: str = "") -> dict[str, Any]:
    """``kubectl get KIND [NAME] -n NS [-l SELECTOR] -o json`` on ``cluster``, parsed; ``{}`` when nothing is found."""
    args = ["get", kind, *([name] if name else []), "-n", ns, "-o", "json"]
    if selector:
        args += ["-l", selector]
    out = cluster.kubectl(*args, check=False)
    return json.loads(out) if out.strip() else {}
