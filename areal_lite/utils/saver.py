"""Periodic HF checkpoints (`Saver`) and the atomic directory write that they and recover
checkpoints share.

A checkpoint directory is written under a temporary name and renamed into place only once every
rank has finished, so a crash mid-write leaves the previous checkpoint intact and never a half one.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

import torch.distributed as dist

from areal_lite.api.config import SaverConfig
from areal_lite.api.engine import TrainEngine
from areal_lite.api.io import SaveLoadMeta
from areal_lite.utils.step import StepInfo, is_due


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def write_atomically(path: str, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_dir)`` on every rank, then replace ``path`` with ``tmp_dir`` on rank 0.

    Collective when torch.distributed is initialised. The old ``path`` is moved aside to
    ``path + ".old"`` before the new one is renamed in and deleted after, so at every instant one
    complete copy exists under ``path`` or ``path + ".old"`` (see `resolve_atomic`).
    """
    tmp, old = path + ".tmp", path + ".old"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    write(tmp)
    _barrier()
    if _rank() == 0:
        if os.path.exists(path):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()


def resolve_atomic(path: str) -> str | None:
    """The complete copy that `write_atomically` left at ``path``: ``path`` itself, or
    ``path + ".old"`` when a crash came between the two renames; None when there is none."""
    if os.path.isdir(path):
        return path
    if os.path.isdir(path + ".old"):
        return path + ".old"
    return None


class Saver:
    """Writes HF model directories every ``freq_steps`` steps / ``freq_epochs`` epochs and after the
    last step, to ``output_dir/checkpoints/globalstep<N>`` (N counts finished steps)."""

    def __init__(self, config: SaverConfig, output_dir: str) -> None:
        self.config = config
        self.root = os.path.join(output_dir, "checkpoints")

    def path_of(self, step: StepInfo) -> str:
        return os.path.join(self.root, f"globalstep{step.global_step + 1}")

    def save(
        self, engine: TrainEngine, step: StepInfo, *, tokenizer: object | None = None, last: bool = False
    ) -> str | None:
        """Save after ``step`` if it is due (collective); returns the directory written, or None."""
        if not is_due(step, self.config.freq_steps, self.config.freq_epochs, last=last):
            return None
        path = self.path_of(step)
        write_atomically(path, lambda tmp: engine.save(SaveLoadMeta(path=tmp, weight_format="hf", tokenizer=tokenizer)))
        return path
