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

Nothing is lost on a fault. The checkpoint is checksummed and the previous one kept beside it
(``checkpoint.prev``): a damaged latest one (truncated, corrupted, a few weights overwritten) is
reported and the run resumes from the previous one (`areal_lite.utils.saver.intact_checkpoint`). A
write that fails names its cause (a full disk with the space a copy needs, a read-only directory)
and leaves the previous checkpoint as it was; the first checkpoint says what its copies need. On SIGTERM (the launchers forward it; Slurm sends it before a time limit or
a preemption) the step under way finishes, a checkpoint is written whatever ``freq_steps`` says,
and `stop_requested` tells the loop to exit (`areal_lite.kit.RunKit` does, with exit code 143); a
second SIGTERM ends the process at once.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from areal_lite.api.config import RecoverConfig
from areal_lite.api.engine import TrainEngine
from areal_lite.api.io import SaveLoadMeta
from areal_lite.utils.saver import intact_checkpoint, resolve_atomic, write_atomically
from areal_lite.utils.step import StepInfo, is_due

logger = logging.getLogger(__name__)

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


_stop_signal: int | None = None
"""The stop signal this process received (every `RecoverHandler` of the process sees it)."""
_stop_signal_at = 0.0
_catching = False
REPEAT_SECONDS = 5.0
"""A second SIGTERM this soon after the first is the same request (the launcher signals torchrun's
process group, and torchrun then signals its workers again); a later one ends the process at once."""


def _on_stop_signal(signum: int, frame: FrameType | None) -> None:
    global _stop_signal, _stop_signal_at
    if _stop_signal is not None:
        if time.monotonic() - _stop_signal_at < REPEAT_SECONDS:
            return
        signal.signal(signum, signal.SIG_DFL)  # asked again: stop now
        os.kill(os.getpid(), signum)
        return
    _stop_signal, _stop_signal_at = signum, time.monotonic()
    print(f"[areal-lite] {signal.Signals(signum).name}: a checkpoint follows the step under way", flush=True)


def _catch_stop_signal() -> None:
    """Handle SIGTERM as a request to checkpoint and stop (once per process; from the main thread,
    the only one that may set signal handlers)."""
    global _catching
    if not _catching and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_stop_signal)
        _catching = True


class RecoverHandler:
    """Dumps the full training state every ``recover.freq_steps`` steps and loads it on restart."""

    def __init__(self, config: RecoverConfig, output_dir: str) -> None:
        if config.mode not in MODES:
            raise ValueError(f"recover.mode must be one of {', '.join(MODES)}, got {config.mode!r}")
        self.config = config
        self.path = os.path.join(output_dir, "recover", "checkpoint")
        self.stop_requested = False
        """Set by `dump` once every rank knows of a stop signal and the checkpoint is written."""
        if self.enabled:
            _catch_stop_signal()

    def _stop_agreed(self) -> bool:
        """Whether any rank received a stop signal (collective, each step: all ranks then write the
        checkpoint of the same step)."""
        flag = torch.tensor([_stop_signal or 0], dtype=torch.int64)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

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
        """Write the state after the finished ``step`` if a dump is due, or a stop signal came
        (then `stop_requested` is set after it); collective over the trainer's ranks. Returns
        whether it wrote one."""
        if not self.enabled:
            return False
        stopping = self._stop_agreed()
        if not stopping and not is_due(step, self.config.freq_steps, last=last):
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

        write_atomically(self.path, write, keep_previous=True)
        if stopping:
            self.stop_requested = True
            if _rank() == 0:
                print(
                    f"[areal-lite] stopping: recover checkpoint written after step {step.global_step + 1}", flush=True
                )
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
        path = self._intact()
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

    def _intact(self) -> str | None:
        """The newest intact copy of the checkpoint, chosen on rank 0 (which reads the files to
        check them) for every rank; its errors are raised on every rank."""
        answer: list[object] = [None]
        if _rank() == 0:
            try:
                answer[0] = intact_checkpoint(self.path)
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                answer[0] = e
        if dist.is_available() and dist.is_initialized():
            dist.broadcast_object_list(answer, src=0)
        if isinstance(answer[0], Exception):
            raise answer[0]
        return answer[0]  # type: ignore[return-value]
