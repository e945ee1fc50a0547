"""Optional: run the local cluster in a network namespace of its own, so that pod IPs need not be loopback
addresses and the API accepts them in Endpoints and EndpointSlices (docs/e2e.md, "EndpointSlices").

``enter_private_netns()`` moves the *calling thread* (call it from the main thread before the cluster starts any
thread or process: they inherit it) into a new network namespace with ``lo`` up and ``10.244.0.1/16`` on it. The
kernel then treats every address of 10.244.0.0/16 as local (a ``local 10.244.0.0/16 dev lo`` route), as it does
127.0.0.0/8: the node agent can hand out ``10.244.<a>.<b>`` pod IPs (``LocalCluster(pod_prefix="10.244")``).
The namespace has no other interface: nothing sent to those addresses leaves it. Root only.
"""

from __future__ import annotations

import ctypes
import os
import subprocess

__all__ = ["CLONE_NEWNET", "POD_PREFIX", "enter_private_netns"]

CLONE_NEWNET = 0x40000000
POD_PREFIX = "10.244"


def enter_private_netns(address: str = "10.244.0.1/16") -> None:
    """Unshare the calling thread's network namespace; ``lo`` up with ``address`` (OSError when not allowed)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNET): {os.strerror(err)}")
    for argv in (["ip", "link", "set", "lo", "up"], ["ip", "addr", "add", address, "dev", "lo"]):
        subprocess.run(argv, check=True, capture_output=True, timeout=30)
