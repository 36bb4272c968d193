"""Keeping the memory a CPU training step frees for the next step (glibc's malloc).

Torch's CPU tensors come from the C library's ``malloc``. glibc serves every block above its mmap
threshold (at most 32 MiB) with a fresh ``mmap`` and unmaps it on free, and returns the top of its
heap to the kernel once more than the trim threshold is free there. A training step allocates and
frees the same large blocks every time (FSDP's gathered layer parameters, gradients, activations,
logits chunks), so each step touches gigabytes of pages afresh: SmolLM2-135M with all parameters
took about 500 thousand minor page faults (2 GB) in every forward-backward pass. Each fault zeroes
a page in the kernel, which costs more when the machine is short of free pages (reclaim running),
so the step's time moved with the state of the machine. With mmap off and the trim threshold at 2 GiB, freed
blocks stay in the heap and the next step reuses them: no faults after the second step. The cost
is that the process keeps its peak heap (it would reach that peak every step anyway).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
# mallopt takes an int: give the heap's top back only once 2 GiB of it are free.
_TRIM_ABOVE = 2**31 - 1
# The variables a user sets to choose glibc's behaviour themselves; we leave theirs alone.
_USER_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")

_done = False


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory in the process for reuse (no ``mmap`` per large block, no
    trimming), once per process. Returns whether the settings are in force: False off Linux, with
    another C library, or where the user set glibc's malloc variables (theirs win)."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    user = [name for name in _USER_SETTINGS if name in os.environ]
    if user:
        logger.debug("glibc malloc settings left as the environment sets them (%s)", ", ".join(user))
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _done = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_ABOVE))
    return _done


__all__ = ["keep_freed_memory"]
