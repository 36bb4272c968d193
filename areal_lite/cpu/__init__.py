"""Speed measures for CPUs, in one room, and the entry points the runtime calls (``tuning.py``).

The entry points: a train engine holds a `TrainerTuning` and the embedded engine's scheduler an
`EngineTuning`, each told the points of its engine's life; the model runner takes its compiled
kernels from `engine_kernels`; the rollout client's threads call `rollout_client_thread`, and the
trainer's thread `trainer_waits` before it waits for them. Beside them, `check_cores` (cores a
config names), `freeze_startup_objects` (a process that has loaded), `compute_dtype` (a config's
``dtype`` on a device) and `trainer_linear` (the chunked LM head's product).

The measures: thread pinning and the split of cores between generation and training
(``threads.py``), the trainer's fp32 products through oneDNN (``linear.py``), glibc's malloc kept
from returning memory (``malloc.py``), the garbage collector kept off start-up objects
(``gc_freeze.py``), the dtype a CPU computes fastest (``precision.py``), and the embedded engine's
C++ kernels built at run time (``build.py``; ``decode_attention.py``, ``fused_ops.py``). The
switches a user may turn are `CPUConfig`'s fields, each with an environment override
(``switches.py``).
"""

from areal_lite.cpu.gc_freeze import freeze_startup_objects
from areal_lite.cpu.linear import linear as trainer_linear
from areal_lite.cpu.precision import compute_dtype
from areal_lite.cpu.threads import check_cores
from areal_lite.cpu.tuning import (
    EngineKernels,
    EngineTuning,
    TrainerTuning,
    engine_kernels,
    rollout_client_thread,
    trainer_waits,
)

__all__ = [
    "EngineKernels",
    "EngineTuning",
    "TrainerTuning",
    "check_cores",
    "compute_dtype",
    "engine_kernels",
    "freeze_startup_objects",
    "rollout_client_thread",
    "trainer_linear",
    "trainer_waits",
]
