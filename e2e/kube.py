"""``kubectl`` for the end-to-end tests (shared by ``conftest.py`` and the tests)."""

from __future__ import annotations

import subprocess

__all__ = ["kubectl"]


def kubectl(*args: str, check: bool = True, timeout: float = 60.0, input_text: str | None = None) -> str:
    """Run ``kubectl`` with the caller's KUBECONFIG; its stdout (raises CalledProcessError when ``check``)."""
    proc = subprocess.run(["kubectl", *args], capture_output=True, text=True, timeout=timeout, input=input_text)
    if check and proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, ["kubectl", *args], proc.stdout, proc.stderr)
    return proc.stdout
