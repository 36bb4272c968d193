"""`DPO`, the recipe class: direct preference optimisation (Rafailov et al. 2023) on
(preferred, dispreferred) thread pairs against a frozen copy of the starting model, with
checkpoints, recovery, evaluation and logging. The logged ``reward_accuracy`` is the fraction of
a step's pairs whose implicit reward ranks the preferred answer first, before the step."""

from __future__ import annotations

import math
from collections.abc import Sequence

from areal_lite.recipes.concurrency import async_map
from areal_lite.recipes.data import CosineScheduler, DataSet
from areal_lite.recipes.model import InferenceModel, TrainingModel
from areal_lite.recipes.run import Evaluate, RecipeRun, RecipeRunConfig, per_rank
from areal_lite.recipes.thread import StringThread

Pair = tuple[StringThread, StringThread]
"""(preferred, dispreferred): the same prompt with two answers."""


class DPO:
    """Train ``model`` on preference pairs.

    Args:
        dataset: (preferred, dispreferred) thread pairs; each rank trains on its own share.
        model: the policy; a frozen clone taken when `run` starts is the reference.
        lr: peak learning rate of the cosine schedule (``lr_scheduler`` replaces it).
        samples_per_batch: pairs per optimizer step, over all ranks.
        beta: DPO's beta (strength of the implicit KL to the reference).
        num_epochs: passes over the data (``max_num_steps`` may stop earlier).
        max_grad_norm: gradient clipping.
        weight_decay: AdamW weight decay.
        data_seed: order of the data.
        run_config: checkpoints, recovery, evaluation and logging.
        evaluate: held-out scores, logged when due and after the last step.
    """

    def __init__(
        self,
        dataset: Sequence[Pair],
        model: TrainingModel,
        lr: float = 1e-6,
        samples_per_batch: int = 32,
        beta: float = 0.1,
        *,
        num_epochs: int = 1,
        max_num_steps: int | None = None,
        max_grad_norm: float = 1.0,
        weight_decay: float = 0.0,
        lr_scheduler: CosineScheduler | None = None,
        data_seed: int = 42,
        run_config: RecipeRunConfig | None = None,
        evaluate: Evaluate | None = None,
    ) -> None:
        for i, pair in enumerate(dataset):
            if len(pair) != 2:
                raise ValueError(f"DPO item {i} is not a (preferred, dispreferred) pair")
        self.dataset = DataSet(dataset, allow_looping=True, seed=data_seed)
        self.model = model
        self.samples_per_batch = per_rank(samples_per_batch, "samples_per_batch")
        self.beta = beta
        self.lr_schedule = lr_scheduler or CosineScheduler(lr)
        self.max_grad_norm = max_grad_norm
        self.weight_decay = weight_decay
        steps = num_epochs * math.ceil(len(self.dataset) / self.samples_per_batch)
        self.total_steps = min(steps, max_num_steps) if max_num_steps else steps
        self.run_config = run_config or RecipeRunConfig()
        self.evaluate = evaluate
        self.history: list[dict[str, float]] = []
        """What each step logged (statistics, rewards, scores)."""
        self.model_ref: InferenceModel | None = None

    async def train_pair(self, pair: Pair) -> None:
        assert self.model_ref is not None
        preferred, dispreferred = await async_map(self.model.tokenize_thread, pair)
        ref_pos, ref_neg = await async_map(self.model_ref.logprobs_per_token, [preferred, dispreferred])
        await self.model.train_dpo(preferred, dispreferred, sum(ref_pos), sum(ref_neg), self.beta)

    async def run(self) -> dict[str, float]:
        """Train for ``total_steps`` steps (resuming after a crash when recovery is on); returns
        the last step's statistics."""
        self.model_ref = await self.model.clone_inf()
        run = RecipeRun(self.run_config, "dpo", self.total_steps, {"policy": self.model}, self.dataset, self.evaluate)
        stats: dict[str, float] = {}
        try:
            for step in range(await run.resume(), self.total_steps):
                batch = [next(self.dataset) for _ in range(self.samples_per_batch)]
                with run.timer("train"):
                    await async_map(self.train_pair, batch)
                    lr = self.lr_schedule(step / self.total_steps)
                    stats = await self.model.optim_step(lr, wd=self.weight_decay, max_grad_norm=self.max_grad_norm)
                stats = await run.end_step(step, stats)
                self.history.append(stats)
        finally:
            run.close()
            await self.model_ref.close()
        return stats
