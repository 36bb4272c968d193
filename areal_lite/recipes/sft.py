"""`SFT`, the recipe class: supervised fine-tuning on demonstration threads (the token-mean
negative log-likelihood of their assistant turns), with checkpoints, recovery, evaluation and
logging."""

from __future__ import annotations

from typing import ClassVar

from areal_lite.recipes.recipe import BatchRecipe
from areal_lite.recipes.thread import StringThread


class SFT(BatchRecipe[StringThread]):
    """Fine-tune ``model`` on ``dataset``, threads whose assistant turns are the targets:
    ``SFT(dataset, model, lr, samples_per_batch, max_grad_norm, *, num_epochs, max_num_steps,
    weight_decay, lr_scheduler, data_seed, run_config, evaluate)`` (`BatchRecipe` documents them)."""

    name: ClassVar[str] = "sft"

    async def train_item(self, item: StringThread) -> None:
        await self.model.train_sft(item)
