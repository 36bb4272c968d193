"""Pinning threads to CPU cores.

On a machine with few cores (the CPU demo: 2), the rollout client's threads (the executor's event
loop, the HTTP client loop, the reward threads they start) compete with the training thread for
its core and for the GIL. Pinning them to the rollout server's core keeps the training thread's
core to itself. Linux pins per thread; a thread started later inherits its creator's cores.
"""

from __future__ import annotations

import os


def check_cores(cores: list[int], key: str) -> None:
    """Raise ValueError naming ``key`` unless every core in ``cores`` exists on this machine."""
    if not cores:
        return
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError(f"{key}={cores}: this platform cannot pin threads to cores (no sched_setaffinity)")
    n = os.cpu_count() or 1
    bad = [c for c in cores if not 0 <= c < n]
    if bad:
        raise ValueError(f"{key}={cores}: no core {bad} on this machine (cores 0..{n - 1})")


def pin_this_thread(cores: list[int]) -> None:
    """Run the calling thread (and the threads it starts from now on) on ``cores`` only."""
    if cores:
        os.sched_setaffinity(0, cores)  # pid 0 = the calling thread on Linux
