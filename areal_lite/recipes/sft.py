"""`SFT`, the recipe class: supervised fine-tuning on demonstration threads (the token-mean
negative log-likelihood of their assistant turns), with checkpoints, recovery, evaluation and
logging."""

from __future__ import annotations

import math
from collections.abc import Sequence

from areal_lite.recipes.concurrency import async_map
from areal_lite.recipes.data import CosineScheduler, DataSet
from areal_lite.recipes.model import TrainingModel
from areal_lite.recipes.run import Evaluate, RecipeRun, RecipeRunConfig, per_rank
from areal_lite.recipes.thread import StringThread


class SFT:
    """Fine-tune ``model`` on ``dataset`` (threads whose assistant turns are the targets).

    Args:
        dataset: the demonstrations; each rank trains on its own share.
        model: the model to train.
        lr: peak learning rate of the cosine schedule (``lr_scheduler`` replaces it).
        samples_per_batch: threads per optimizer step, over all ranks.
        max_grad_norm: gradient clipping.
        num_epochs: passes over the data (``max_num_steps`` may stop earlier).
        weight_decay: AdamW weight decay.
        data_seed: order of the data.
        run_config: checkpoints, recovery, evaluation and logging.
        evaluate: held-out scores, logged when due and after the last step.
    """

    def __init__(
        self,
        dataset: Sequence[StringThread],
        model: TrainingModel,
        lr: float = 1e-5,
        samples_per_batch: int = 64,
        max_grad_norm: float = 1.0,
        *,
        num_epochs: int = 1,
        max_num_steps: int | None = None,
        weight_decay: float = 0.0,
        lr_scheduler: CosineScheduler | None = None,
        data_seed: int = 42,
        run_config: RecipeRunConfig | None = None,
        evaluate: Evaluate | None = None,
    ) -> None:
        self.dataset = DataSet(dataset, allow_looping=True, seed=data_seed)
        self.model = model
        self.samples_per_batch = per_rank(samples_per_batch, "samples_per_batch")
        self.lr_schedule = lr_scheduler or CosineScheduler(lr)
        self.max_grad_norm = max_grad_norm
        self.weight_decay = weight_decay
        steps = num_epochs * math.ceil(len(self.dataset) / self.samples_per_batch)
        self.total_steps = min(steps, max_num_steps) if max_num_steps else steps
        self.run_config = run_config or RecipeRunConfig()
        self.evaluate = evaluate
        self.history: list[dict[str, float]] = []
        """What each step logged (statistics, rewards, scores)."""

    async def run(self) -> dict[str, float]:
        """Train for ``total_steps`` steps (resuming after a crash when recovery is on); returns
        the last step's statistics."""
        run = RecipeRun(self.run_config, "sft", self.total_steps, {"model": self.model}, self.dataset, self.evaluate)
        stats: dict[str, float] = {}
        try:
            for step in range(await run.resume(), self.total_steps):
                batch = [next(self.dataset) for _ in range(self.samples_per_batch)]
                with run.timer("train"):
                    await async_map(self.model.train_sft, batch)
                    lr = self.lr_schedule(step / self.total_steps)
                    stats = await self.model.optim_step(lr, wd=self.weight_decay, max_grad_norm=self.max_grad_norm)
                stats = await run.end_step(step, stats)
                self.history.append(stats)
        finally:
            run.close()
        return stats
