"""Runs an evaluation function every ``evaluator.freq_steps`` steps (and when asked)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from areal_lite.api.config import EvaluatorConfig
from areal_lite.utils.step import StepInfo, is_due

R = TypeVar("R")


class Evaluator:
    """Calls ``eval_fn`` after the steps where evaluation is due; the schedule depends only on the
    step numbers, so a resumed run evaluates at the same steps as an uninterrupted one."""

    def __init__(self, config: EvaluatorConfig) -> None:
        self.config = config

    def evaluate(self, eval_fn: Callable[[], R], step: StepInfo, *, last: bool = False) -> R | None:
        """``eval_fn()`` if evaluation is due after ``step`` (or ``last`` with a frequency set)."""
        if not is_due(step, self.config.freq_steps, last=last):
            return None
        return eval_fn()
