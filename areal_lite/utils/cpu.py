"""Pinning threads to CPU cores.

On a machine with few cores (the CPU demo: 2), the rollout client's threads (the executor's event
loop, the HTTP client loop, the reward threads they start) compete with the training thread for
its core and for the GIL. Pinning them to the rollout server's core keeps the training thread's
core to itself. Linux pins per thread; a thread started later inherits its creator's cores.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


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


def set_thread_intra_op_threads(n: int) -> None:
    """Run the torch ops the calling thread starts on ``n`` threads, leaving other threads' counts
    as they are (``torch.set_num_threads`` sets the count of every thread that has not run a
    parallel op yet, and MKL's for the whole process).

    The embedded engine's scheduler thread uses it where generation and training share a
    process's cores at once (asynchronous RL): each with all of them oversubscribes the cores.
    Sets the thread's OpenMP count (oneDNN, torch's own kernels, the decode attention kernel);
    MKL's count stays the process's (the matmuls MKL runs for attention over prompts).
    """
    import ctypes

    import torch

    # torch sets a thread's OpenMP count from the process-wide one at the thread's first
    # parallel op: run one first so that it does not undo the count set here.
    torch.ones(1 << 16).sum()
    try:
        # The OpenMP runtime torch loaded (the same soname resolves to it): the count is per thread.
        ctypes.CDLL("libgomp.so.1").omp_set_num_threads(ctypes.c_int(n))
    except (OSError, AttributeError):
        logger.warning("no libgomp: the engine's ops run on the process's thread count")
