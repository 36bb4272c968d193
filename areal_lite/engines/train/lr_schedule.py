"""Learning-rate schedules: linear warm-up, then constant, linear or cosine decay.

The schedule is a multiplier of the peak LR as a function of the optimizer step, for
``torch.optim.lr_scheduler.LambdaLR``. Warm-up is linear and reaches the peak at the end of the
warm-up (step ``w - 1`` has factor 1), so the first step is not wasted at LR 0 (unlike HF's
``get_*_schedule_with_warmup``). Decay goes from the peak to ``min_lr_ratio`` at the last step.
"""

from __future__ import annotations

import math
from collections.abc import Callable


def lr_multiplier(
    kind: str, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0
) -> Callable[[int], float]:
    """The LR factor at each step for ``kind`` in constant, linear, cosine."""
    if kind not in ("constant", "linear", "cosine"):
        raise ValueError(f"lr schedule must be constant, linear or cosine, got {kind!r}")
    total_steps = max(1, total_steps)
    warmup_steps = max(0, min(warmup_steps, total_steps))

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        decay_steps = max(1, total_steps - warmup_steps - 1)
        progress = min(1.0, (step - warmup_steps) / decay_steps)
        if kind == "linear":
            shape = 1.0 - progress
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return min_lr_ratio + (1.0 - min_lr_ratio) * shape

    return factor
