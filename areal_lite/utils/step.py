"""Where a run is in its schedule (`StepInfo`) and when periodic work is due (`is_due`).

Saving, evaluation and recover checkpoints all fire on step or epoch boundaries. Deciding that from
the step numbers alone, rather than from counters kept in memory, means a resumed run fires at the
same steps as an uninterrupted one with no extra state to checkpoint.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class StepInfo:
    """A training step: its epoch, its index inside the epoch and its global index (all from 0)."""

    epoch: int
    epoch_step: int
    global_step: int
    steps_per_epoch: int

    @classmethod
    def first(cls, steps_per_epoch: int) -> StepInfo:
        return cls(epoch=0, epoch_step=0, global_step=0, steps_per_epoch=steps_per_epoch)

    @classmethod
    def at(cls, global_step: int, steps_per_epoch: int) -> StepInfo:
        """The step with index ``global_step`` of a run with ``steps_per_epoch`` steps per epoch."""
        return cls(global_step // steps_per_epoch, global_step % steps_per_epoch, global_step, steps_per_epoch)

    @property
    def is_last_of_epoch(self) -> bool:
        return self.epoch_step == self.steps_per_epoch - 1

    def next(self) -> StepInfo:
        return StepInfo.at(self.global_step + 1, self.steps_per_epoch)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def is_due(step: StepInfo, freq_steps: int | None = None, freq_epochs: int | None = None, last: bool = False) -> bool:
    """True after every ``freq_steps``-th step, at the end of every ``freq_epochs``-th epoch, and
    after the ``last`` step of the run (when any frequency is set)."""
    if freq_steps is None and freq_epochs is None:
        return False
    if last:
        return True
    if freq_steps is not None and freq_steps > 0 and (step.global_step + 1) % freq_steps == 0:
        return True
    return freq_epochs is not None and freq_epochs > 0 and step.is_last_of_epoch and (step.epoch + 1) % freq_epochs == 0
