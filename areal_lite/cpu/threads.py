"""Pinning threads to CPU cores, and dividing the cores' threads between generation and training.

On a machine with few cores (the CPU demo: 2), the rollout client's threads (the executor's event
loop, the HTTP client loop, the reward threads they start) compete with the training thread for
its core and for the GIL. Pinning them to the rollout server's core keeps the training thread's
core to itself. Linux pins per thread; a thread started later inherits its creator's cores.

Where the embedded engine generates in the training process (asynchronous RL), each part sets the
torch thread count of its own thread: the engine's scheduler thread a fixed share
(`set_thread_intra_op_threads`), the training thread the rest while the engine is generating and
all of them while it is not (`CoreSharing`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch.utils.hooks import RemovableHandle

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
    import torch

    # torch sets a thread's OpenMP count from the process-wide one at the thread's first
    # parallel op: run one first so that it does not undo the count set here.
    torch.ones(1 << 16).sum()
    gomp = _libgomp()
    if gomp is None or not hasattr(gomp, "omp_set_num_threads"):
        logger.warning("no libgomp: the engine's ops run on the process's thread count")
        return
    gomp.omp_set_num_threads(ctypes.c_int(n))


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (its soname resolves to the copy already loaded), or None."""
    try:
        return ctypes.CDLL("libgomp.so.1")
    except OSError:
        return None


def release_openmp_threads() -> None:
    """Free the calling thread's OpenMP worker threads; its next parallel op starts them again.

    Call it from a thread about to wait while another thread of the process computes (the trainer
    waiting for its batch while the embedded engine generates; the engine's scheduler thread
    going idle while the trainer trains). libgomp gives each thread that runs parallel ops a team
    of its own, and its workers stay (docked) after the op. Once the process holds more such
    threads than it has CPUs, libgomp spins only 100 times at each of its barriers instead of
    about 300000 and waits on a futex instead, so every parallel op pays for waking its workers:
    a small linear ([32, 384] x [384, 1152], oneDNN, 2 threads on 2 CPUs) took 204-240 us in a
    second thread once the main thread had run parallel ops, against 146-150 us with the main
    thread's team freed first. That is the decode step of an in-process engine beside a trainer.
    A no-op without libgomp (or one older than OpenMP 5.0), or when the thread has no team."""
    gomp = _libgomp()
    if gomp is not None and hasattr(gomp, "omp_pause_resource_all"):  # OpenMP 5.0
        gomp.omp_pause_resource_all(ctypes.c_int(1))  # omp_pause_soft: frees this thread's pool


class CoreSharing:
    """The training thread's share of the cores beside an in-process engine that has a share of
    its own (`LocalEngineConfig.num_threads`): ``busy_threads`` while ``engine_busy()`` says the
    engine is generating, ``idle_threads`` otherwise, checked as each decoder layer's forward and
    backward starts.

    With a fixed count the trainer either oversubscribes the cores while the engine decodes or
    leaves the engine's share idle once the batch is out; a step of asynchronous RL overlaps both.
    Sets the count with ``torch.set_num_threads`` from the training thread (its OpenMP count and
    MKL's, which runs the trainer's fp32 matmuls; the engine's thread keeps its own count)."""

    def __init__(self, engine_busy: Callable[[], bool], idle_threads: int, busy_threads: int) -> None:
        if not 1 <= busy_threads <= idle_threads:
            raise ValueError(f"busy_threads must be in 1..{idle_threads}, got {busy_threads}")
        self.engine_busy = engine_busy
        self.idle_threads = idle_threads
        self.busy_threads = busy_threads
        self.switches = 0
        """How many times the count changed (for tests and logs)."""
        self._current = idle_threads
        self._handles: list[RemovableHandle] = []

    def update(self) -> None:
        """Set the calling thread's count for the engine's state now."""
        import torch

        n = self.busy_threads if self.engine_busy() else self.idle_threads
        if n != self._current:
            torch.set_num_threads(n)
            self._current = n
            self.switches += 1

    def attach(self, layers: Iterable[torch.nn.Module]) -> None:
        """Check the engine's state before each of ``layers``' forward and backward."""
        for layer in layers:
            self._handles.append(layer.register_forward_pre_hook(lambda module, args: self.update()))
            self._handles.append(layer.register_forward_hook(self._before_backward))

    def _before_backward(self, module: torch.nn.Module, args: object, output: object) -> None:
        out = output[0] if isinstance(output, tuple) else output
        if getattr(out, "requires_grad", False):
            out.register_hook(lambda grad: self.update())

    def detach(self) -> None:
        """Remove the hooks and give the thread its whole count back."""
        import torch

        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._current != self.idle_threads:
            torch.set_num_threads(self.idle_threads)
            self._current = self.idle_threads
