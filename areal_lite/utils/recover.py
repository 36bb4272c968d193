"""Crash recovery: the full training state, written atomically, and the resume that reads it.

A recover checkpoint (``output_dir/recover/checkpoint``) holds the train engine's full state
(model, optimizer, LR scheduler; `TrainEngine.save` with ``weight_format="train_state"``) and one small
file per rank with the last finished step, the policy version, the data loader's position, the RNG
states and anything else with a ``state_dict`` (the stats logger). It is dumped after a step
finished, so a run resumed from it starts at the next step with the data loader positioned right
after the last trained batch: with a resumable loader (`areal_lite.utils.dataloader`) every sample
is consumed exactly once per epoch and the number of steps equals the uninterrupted run's.

Modes (``recover.mode``): ``disabled`` writes and reads nothing; ``auto`` writes checkpoints and
resumes when one exists; ``resume`` writes and requires one to exist.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from areal_lite.api.config import RecoverConfig
from areal_lite.api.engine import TrainEngine
from areal_lite.api.io import SaveLoadMeta
from areal_lite.utils.saver import resolve_atomic, write_atomically
from areal_lite.utils.step import StepInfo, is_due

MODES = ("disabled", "auto", "resume")
ATTEMPT_ENV = "AREAL_LITE_ATTEMPT"
"""The launchers number each start of the trainer in this environment variable (0 = the first)."""


class Stateful(Protocol):
    def state_dict(self) -> dict[str, object]: ...

    def load_state_dict(self, state: dict[str, object]) -> None: ...


@dataclass
class RecoverInfo:
    """What a resumed run needs to continue: the last finished step and the policy version."""

    last_step: StepInfo
    version: int
    extra: dict[str, object] = field(default_factory=dict)
    """What the script passed as ``extra`` to `RecoverHandler.dump`."""

    @property
    def next_step(self) -> StepInfo:
        return self.last_step.next()


def rng_state() -> dict[str, object]:
    """The states of Python's, NumPy's and torch's (CPU and CUDA) random generators."""
    state: dict[str, object] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, object]) -> None:
    random.setstate(state["python"])  # type: ignore[arg-type]
    np.random.set_state(state["numpy"])  # type: ignore[arg-type]
    torch.set_rng_state(state["torch"])  # type: ignore[arg-type]
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])  # type: ignore[arg-type]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class RecoverHandler:
    """Dumps the full training state every ``recover.freq_steps`` steps and loads it on restart."""

    def __init__(self, config: RecoverConfig, output_dir: str) -> None:
        if config.mode not in MODES:
            raise ValueError(f"recover.mode must be one of {', '.join(MODES)}, got {config.mode!r}")
        self.config = config
        self.path = os.path.join(output_dir, "recover", "checkpoint")

    @property
    def enabled(self) -> bool:
        return self.config.mode != "disabled"

    def exists(self) -> bool:
        return resolve_atomic(self.path) is not None

    def dump(
        self,
        engine: TrainEngine,
        step: StepInfo,
        *,
        dataloader: Stateful | None = None,
        stats_logger: Stateful | None = None,
        extra: dict[str, object] | None = None,
        last: bool = False,
    ) -> bool:
        """Write the state after the finished ``step`` if a dump is due (collective over the
        trainer's ranks). Returns whether it wrote one."""
        if not self.enabled or not is_due(step, self.config.freq_steps, last=last):
            return False
        state = {
            "step": step.to_dict(),
            "version": engine.get_version(),
            "dataloader": dataloader.state_dict() if dataloader is not None else None,
            "stats_logger": stats_logger.state_dict() if stats_logger is not None else None,
            "rng": rng_state(),
            "extra": extra or {},
        }

        def write(tmp: str) -> None:
            engine.save(SaveLoadMeta(path=os.path.join(tmp, "engine"), weight_format="train_state"))
            torch.save(state, os.path.join(tmp, f"state_rank{_rank()}.pt"))

        write_atomically(self.path, write)
        return True

    def load(
        self,
        engine: TrainEngine,
        *,
        dataloader: Stateful | None = None,
        stats_logger: Stateful | None = None,
    ) -> RecoverInfo | None:
        """Restore everything `dump` wrote, or return None when there is nothing to resume. The
        rollout side still has the initial weights: push the restored ones to it
        (`areal_lite.kit.RunKit.resume` does)."""
        if not self.enabled:
            return None
        path = resolve_atomic(self.path)
        if path is None:
            if self.config.mode == "resume":
                raise FileNotFoundError(f"recover.mode=resume but there is no recover checkpoint at {self.path}")
            return None
        state = torch.load(os.path.join(path, f"state_rank{_rank()}.pt"), weights_only=False)
        engine.load(SaveLoadMeta(path=os.path.join(path, "engine"), weight_format="train_state"))
        version = int(state["version"])
        engine.set_version(version)
        if dataloader is not None and state["dataloader"] is not None:
            dataloader.load_state_dict(state["dataloader"])
        if stats_logger is not None and state["stats_logger"] is not None:
            stats_logger.load_state_dict(state["stats_logger"])
        set_rng_state(state["rng"])
        return RecoverInfo(last_step=StepInfo(**state["step"]), version=version, extra=state["extra"])
