"""What the recipe classes do around each step, written once: HF checkpoints (`Saver`), recover
checkpoints and the resume from them (`RecoverHandler`), evaluation when due, and the statistics
(`StatsLogger`: one console line per step under a progress bar, wandb, tensorboard).

The same utilities as the example scripts' `areal_lite.kit.RunKit`, driven from async code: every
collective piece of work runs on the engine thread through `_Trainable.with_engine`.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from areal_lite.api.config import EvaluatorConfig, RecoverConfig, SaverConfig, StatsLoggerConfig
from areal_lite.api.engine import TrainEngine
from areal_lite.recipes.data import DataSet, data_parallel_rank
from areal_lite.recipes.training import _Trainable
from areal_lite.utils.recover import RecoverHandler
from areal_lite.utils.saver import Saver
from areal_lite.utils.stats import StatsTracker, StepStats
from areal_lite.utils.stats_logger import StatsLogger
from areal_lite.utils.step import StepInfo, is_due


def per_rank(n: int, what: str) -> int:
    """A global count (samples per batch...) as each rank's share; it must divide evenly."""
    world = data_parallel_rank()[1]
    if n < world or n % world:
        raise ValueError(f"{what}={n} cannot be shared evenly by {world} ranks")
    return n // world


def mean_of(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if len(values) else 0.0


Evaluate = Callable[[], Awaitable[dict[str, float]]]
"""``await evaluate() -> {name: score}``: held-out scores, logged with the step's statistics."""


@dataclass
class RecipeRunConfig:
    """Where a recipe writes, and how often it saves, recovers, evaluates and logs."""

    output_dir: str = "outputs/recipes/run"
    """Checkpoints (``checkpoints/globalstep<N>``), recover checkpoints and logs go here."""
    saver: SaverConfig = field(default_factory=SaverConfig)
    """HF checkpoints of the trained model (every N steps, and after the last with a frequency set)."""
    recover: RecoverConfig = field(default_factory=RecoverConfig)
    """Recover checkpoints: ``auto`` resumes a crashed run at the step after the last dump."""
    evaluator: EvaluatorConfig = field(default_factory=EvaluatorConfig)
    """When the recipe's ``evaluate`` runs (and always after the last step when it is given)."""
    stats_logger: StatsLoggerConfig = field(default_factory=StatsLoggerConfig)
    """Console line and table, wandb, tensorboard."""


class RecipeRun:
    """Saving, recovery, evaluation and logging of one recipe run of ``total_steps`` steps.

    ``models`` are the models the recipe trains, the first being the one saved as HF checkpoints
    (each recovers from its own directory); ``dataset`` resumes at its position.
    """

    def __init__(
        self,
        config: RecipeRunConfig,
        name: str,
        total_steps: int,
        models: dict[str, _Trainable],
        dataset: DataSet | None = None,
        evaluate: Evaluate | None = None,
    ) -> None:
        if total_steps < 1:
            raise ValueError(f"a recipe run needs at least one step, got {total_steps}")
        self.config = config
        self.total_steps = total_steps
        self.models = models
        self.dataset = dataset
        self.evaluate = evaluate
        self.saver = Saver(config.saver, config.output_dir)
        self.recover = {name: RecoverHandler(config.recover, os.path.join(config.output_dir, name)) for name in models}
        self.stats_logger = StatsLogger(config.stats_logger, config.output_dir, total_steps=total_steps, run_name=name)
        self.tracker = StatsTracker()
        self.start_step = 0
        self._t0 = time.perf_counter()

    def timer(self, stage: str) -> AbstractContextManager[None]:
        """Time a stage of the step (``timing/<stage>``)."""
        return self.tracker.timer(stage)

    def record(self, **values: float) -> None:
        """Per-rank values of this step (rewards, accuracies), averaged over the ranks when logged."""
        self.tracker.scalar(**values)

    async def resume(self) -> int:
        """Load the last recover checkpoint of every model (with the data position and the logger
        state) when recovery is on and one exists; returns the step to start at (0 when fresh)."""
        start = 0
        for i, (name, model) in enumerate(self.models.items()):
            states = self._states() if i == 0 else {}

            def load(engine: TrainEngine, handler: RecoverHandler = self.recover[name], states: dict = states) -> int:
                info = handler.load(engine, **states)
                return 0 if info is None else info.next_step.global_step

            start = max(start, await model.with_engine("recover-load", load, changes_weights=True))
        self.start_step = start
        return start

    def _states(self) -> dict[str, object]:
        return {"dataloader": self.dataset, "stats_logger": self.stats_logger}

    async def end_step(self, step: int, stats: dict[str, float]) -> dict[str, float]:
        """After step ``step`` (from 0): the HF checkpoint and the recover dump when due, the
        evaluation when due (and after the last step), then the log line. ``stats`` are global (the
        models' statistics); per-rank values go through `record`. Collective. Returns everything
        logged for the step."""
        info = StepInfo.at(step, self.total_steps)
        last = step + 1 == self.total_steps
        models = list(self.models.items())
        main = models[0][1]

        def checkpoint(engine: TrainEngine) -> StepStats:
            self.saver.save(engine, info, tokenizer=main.tokenizer, last=last)
            self.recover[models[0][0]].dump(engine, info, **self._states())  # type: ignore[arg-type]
            return self.tracker.export()

        step_stats = await main.with_engine("end-step", checkpoint)
        for name, model in models[1:]:
            await model.with_engine("recover-dump", lambda e, h=self.recover[name]: h.dump(e, info))
        stopping = self.recover[models[0][0]].stop_requested  # a SIGTERM: checkpointed, now exit
        scores: dict[str, float] = {}
        if self.evaluate is not None and not stopping and (last or is_due(info, self.config.evaluator.freq_steps)):
            scores = await self.evaluate()
        logged = {**stats, **step_stats.scalars, **scores, "elapsed_min": (time.perf_counter() - self._t0) / 60}
        self.stats_logger.commit(step, logged, StepStats(histograms=step_stats.histograms))
        if stopping:
            self.close()
            raise SystemExit(128 + signal.SIGTERM)
        return logged

    def close(self) -> None:
        """Finish the loggers (curves, wandb)."""
        self.stats_logger.close()
