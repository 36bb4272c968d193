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

The embedded engine on CPU holds them too while it runs: each decode step frees and reallocates
its ``[rows, vocab]`` logits and probabilities. (Its thread's blocks come from a glibc arena of
its own, where a block above 64 MiB is mapped afresh whatever these settings, so its sampler makes
no ``[rows, vocab]`` float64 copy: see ``inverse_cdf`` in the engine's model runner.)

The settings are process-wide, so they last only while a holder needs them: each
`keep_freed_memory` is matched by a `release_freed_memory` (the CPU train engine's ``destroy``, the
embedded engine's ``stop``),
and when the last holder releases them glibc's default thresholds come back and the kept memory is
given back to the kernel (``malloc_trim``). A process that builds engines now and then (a test
suite, a notebook) keeps glibc's usual behaviour between them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
# mallopt takes an int: give the heap's top back only once 2 GiB of it are free.
_TRIM_ABOVE = 2**31 - 1
# glibc's defaults (malloc.c: DEFAULT_MMAP_MAX, DEFAULT_TRIM_THRESHOLD), restored on release.
_DEFAULT_MMAP_MAX = 65536
_DEFAULT_TRIM_THRESHOLD = 128 * 1024
# The variables a user sets to choose glibc's behaviour themselves; we leave theirs alone.
_USER_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")

_lock = threading.Lock()
_holders = 0
"""How many `keep_freed_memory` calls in force are not yet released."""


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError):  # not glibc
        return None
    return libc


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory in the process for reuse (no ``mmap`` per large block, no
    trimming) until the matching `release_freed_memory`. Returns whether the settings are in force
    for this call (then release it once): False off Linux, with another C library, or where the
    user set glibc's malloc variables (theirs win)."""
    global _holders
    user = [name for name in _USER_SETTINGS if name in os.environ]
    if user:
        logger.debug("glibc malloc settings left as the environment sets them (%s)", ", ".join(user))
        return False
    with _lock:
        if _holders == 0:
            libc = _libc()
            if libc is None or not (libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_ABOVE)):
                return False
        _holders += 1
        return True


def release_freed_memory() -> None:
    """End one `keep_freed_memory` that returned True; the last one puts glibc's default thresholds
    back and returns the kept free memory to the kernel."""
    global _holders
    with _lock:
        if _holders == 0:
            raise RuntimeError("release_freed_memory without a keep_freed_memory in force")
        _holders -= 1
        if _holders:
            return
        libc = _libc()
        if libc is not None:
            libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
            libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)
            libc.malloc_trim(0)


def kept_holders() -> int:
    """How many holders keep freed memory now (0: glibc's defaults are in force)."""
    return _holders


__all__ = ["keep_freed_memory", "kept_holders", "release_freed_memory"]
