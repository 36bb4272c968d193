"""The CPU room's entry points: what the runtime tells the room, and the speed measures it applies.

The engines and the rollout client say what they are doing (a model is loaded, a thread starts,
a thread goes idle, the engine stops); the room decides what that means on this CPU. Each place
calls one entry point:

- a train engine holds a `TrainerTuning`: its HF model's fused kernels and oneDNN products,
  freed memory kept between steps, its share of the cores beside an in-process engine;
- the embedded engine's scheduler holds an `EngineTuning`: its cores, its thread count, its
  OpenMP workers freed while it idles, freed memory kept while it runs; its model runner takes its
  compiled kernels from `engine_kernels`;
- the rollout client's threads in the trainer process (the executor's loop, the HTTP client's
  loop, an episode worker) start with `rollout_client_thread`, and the trainer's thread calls
  `trainer_waits` before it waits for them.

The switches a user may turn are `CPUConfig`'s fields (`areal_lite.cpu.switches`). The
measures themselves are the room's other modules; nothing outside the room calls them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from areal_lite.api.config import CPUConfig, LocalEngineConfig
from areal_lite.cpu import decode_attention, fused_ops, linear, malloc, threads
from areal_lite.cpu.gc_freeze import freeze_startup_objects


class _KeepsStepMemory:
    """Freed memory kept for the next step while an engine runs on CPU (`malloc`): a step frees
    and reallocates the same large blocks (a trainer's gathered parameters, gradients and
    activations; the embedded engine's [rows, vocab] logits and probabilities: docs/performance.md,
    "Sampling without a float64 copy"), and kept, they are reused instead of faulted in afresh.
    Process-wide, so only from `keep_step_memory` to `release`."""

    def __init__(self) -> None:
        self._keeps_freed_memory = False
        """Whether `keep_step_memory` made glibc keep freed memory (given back by `release`)."""

    def keep_step_memory(self, device: torch.device) -> None:
        """The engine will run steps on ``device``: on CPU, keep what they free."""
        if device.type == "cpu" and not self._keeps_freed_memory:
            self._keeps_freed_memory = malloc.keep_freed_memory()

    def release(self) -> None:
        """The engine stopped: glibc's default thresholds come back once no one keeps freed memory."""
        if self._keeps_freed_memory:
            self._keeps_freed_memory = False
            malloc.release_freed_memory()


class TrainerTuning(_KeepsStepMemory):
    """The CPU measures of one train engine, applied at the points of its life it reports. Off the
    CPU only `startup_done` does anything."""

    def __init__(self, config: CPUConfig) -> None:
        super().__init__()
        self.config = config
        self._core_sharing: threads.CoreSharing | None = None
        """Beside an in-process engine with a thread share of its own: the trainer's count."""

    def tune_model(self, model: torch.nn.Module, device: torch.device) -> None:
        """``model`` (an HF model, adapters added) is loaded on ``device``: on CPU, its RMS norms and
        SiLU products run fused where they run in fp32 (`fused_ops`), and its fp32 linears and the
        chunked head go through oneDNN where MKL would run below the CPU's width (`linear`)."""
        if device.type != "cpu":
            return
        linear.follow(self.config)
        fused_ops.patch_for_training(model, self.config)
        linear.patch_for_training(model)

    def startup_done(self, device: torch.device) -> None:
        """The engine has loaded: on CPU its chunked head follows this config (`linear.follow`);
        what loading left alive is kept from the garbage collector (`freeze_startup_objects`)."""
        if device.type == "cpu":
            linear.follow(self.config)
        freeze_startup_objects()

    def share_cores(
        self, engine_busy: Callable[[], bool], idle_threads: int, busy_threads: int, layers: Iterable[torch.nn.Module]
    ) -> None:
        """Train ``layers`` on ``busy_threads`` while ``engine_busy()``, on ``idle_threads``
        otherwise (`threads.CoreSharing`), in place of any earlier share."""
        self.stop_sharing_cores()
        self._core_sharing = threads.CoreSharing(engine_busy, idle_threads, busy_threads)
        self._core_sharing.attach(layers)

    def stop_sharing_cores(self) -> None:
        """Remove the share's hooks and give the training thread its whole count back."""
        if self._core_sharing is not None:
            self._core_sharing.detach()
            self._core_sharing = None


class EngineTuning(_KeepsStepMemory):
    """The CPU measures of the embedded engine's scheduler (`areal_lite.engines.local.scheduler`),
    applied at the points of its life it reports: ``config.cores``, ``config.num_threads``."""

    def __init__(self, config: LocalEngineConfig) -> None:
        super().__init__()
        self.config = config

    def check_cores(self) -> None:
        """ValueError, naming ``local_engine.cores``, for cores this machine lacks."""
        threads.check_cores(self.config.cores, "local_engine.cores")

    def started(self) -> None:
        """The scheduler thread is running (called from the thread that started it): what loading
        left alive is kept from the garbage collector, and the starting thread's OpenMP workers go.

        Loading ran parallel ops on the starting thread, which gave it an OpenMP team of its own.
        Kept, its docked workers count against the CPUs, and libgomp then wakes the scheduler's
        workers through a futex at every op instead of spinning: at 2 threads on 2 CPUs the decode
        step ran at one thread's speed. The caller gets a team again if it computes."""
        freeze_startup_objects()
        threads.release_openmp_threads()

    def thread_started(self) -> None:
        """In the scheduler thread, before its first step: it runs on the engine's cores (and so do
        the threads it starts), with its own thread count where the engine has one."""
        threads.pin_this_thread(self.config.cores)
        if self.config.num_threads:
            threads.set_thread_intra_op_threads(self.config.num_threads)

    def idle(self) -> None:
        """In the scheduler thread, as it goes idle: whoever computes while the engine waits (the
        trainer beside it in process) gets the cores' OpenMP threads to itself."""
        threads.release_openmp_threads()

    def run_on(self, n: int) -> None:
        """In the scheduler thread: run its torch ops on ``n`` threads from now on (the share it
        yields to a trainer in this process, or all of them back)."""
        threads.set_thread_intra_op_threads(n)


@dataclass(frozen=True)
class EngineKernels:
    """The embedded engine's compiled kernels for one model on one device (None where unavailable)."""

    attention: decode_attention.DecodeAttention | None
    """Decode attention (CPU, fp32 or bf16); None: two batched matmuls."""
    block: int
    """Positions per block of the key cache: `decode_attention.BLOCK` with the kernel, else 1."""
    ops: fused_ops.FusedOps | None
    """The residual add and norm, rotary embedding and SiLU product (CPU, fp32 or bf16); None: torch ops."""


def engine_kernels(
    device: torch.device, dtype: torch.dtype, head_dim: int, group: int, config: CPUConfig | None = None
) -> EngineKernels:
    """The compiled kernels of a model with ``head_dim`` and ``group`` query heads per KV head, in
    ``dtype`` on ``device``, as ``config`` switches them (defaults where None)."""
    attend = decode_attention.load(device, dtype, head_dim, group, config)
    block = decode_attention.BLOCK if attend is not None else 1
    return EngineKernels(attend, block, fused_ops.load(device, dtype, config))


def rollout_client_thread(cores: list[int]) -> None:
    """The calling thread is one of the rollout client's in the trainer process (the executor's
    event loop, the HTTP client's loop, an episode worker's main thread): it runs on ``cores``
    (``rollout.client_cores``; empty: anywhere), and so do the threads it starts from now on. On a
    small CPU machine the rollout server's core keeps them off the training thread's core."""
    threads.pin_this_thread(cores)


def trainer_waits() -> None:
    """The calling thread (the trainer's) waits while the engine generates: its OpenMP workers go,
    so that the engine's alone spin on the cores (a no-op once they are gone)."""
    threads.release_openmp_threads()
