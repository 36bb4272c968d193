"""`DPO`, the recipe class: direct preference optimisation (Rafailov et al. 2023) on
(preferred, dispreferred) thread pairs against a frozen copy of the starting model, with
checkpoints, recovery, evaluation and logging. The logged ``reward_accuracy`` is the fraction of
a step's pairs whose implicit reward ranks the preferred answer first, before the step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from areal_lite.recipes.concurrency import async_map
from areal_lite.recipes.data import CosineScheduler
from areal_lite.recipes.inference import InferenceModel
from areal_lite.recipes.recipe import BatchRecipe
from areal_lite.recipes.run import Evaluate, RecipeRunConfig
from areal_lite.recipes.thread import StringThread
from areal_lite.recipes.training import TrainingModel

Pair = tuple[StringThread, StringThread]
"""(preferred, dispreferred): the same prompt with two answers."""


class DPO(BatchRecipe[Pair]):
    """Train ``model`` on ``dataset``, (preferred, dispreferred) thread pairs, against a frozen
    clone of ``model`` taken when `run` starts. ``beta`` is DPO's beta (the strength of the implicit
    KL to the reference); the other arguments are `BatchRecipe`'s, with ``samples_per_batch``
    counting pairs."""

    name: ClassVar[str] = "dpo"

    def __init__(
        self,
        dataset: Sequence[Pair],
        model: TrainingModel,
        lr: float = 1e-6,
        samples_per_batch: int = 32,
        beta: float = 0.1,
        *,
        max_grad_norm: float = 1.0,
        num_epochs: int = 1,
        max_num_steps: int | None = None,
        weight_decay: float = 0.0,
        lr_scheduler: CosineScheduler | None = None,
        data_seed: int = 42,
        run_config: RecipeRunConfig | None = None,
        evaluate: Evaluate | None = None,
    ) -> None:
        for i, pair in enumerate(dataset):
            if len(pair) != 2:
                raise ValueError(f"DPO item {i} is not a (preferred, dispreferred) pair")
        super().__init__(
            dataset, model, lr, samples_per_batch, max_grad_norm, num_epochs=num_epochs, max_num_steps=max_num_steps,
            weight_decay=weight_decay, lr_scheduler=lr_scheduler, data_seed=data_seed, run_config=run_config,
            evaluate=evaluate,
        )  # fmt: skip
        self.beta = beta
        self.model_ref: InferenceModel | None = None

    async def setup(self) -> None:
        self.model_ref = await self.model.clone_inf()

    async def teardown(self) -> None:
        if self.model_ref is not None:
            await self.model_ref.close()

    async def train_item(self, item: Pair) -> None:
        assert self.model_ref is not None
        preferred, dispreferred = await async_map(self.model.tokenize_thread, item)
        ref_pos, ref_neg = await async_map(self.model_ref.logprobs_per_token, [preferred, dispreferred])
        await self.model.train_dpo(preferred, dispreferred, sum(ref_pos), sum(ref_neg), self.beta)
