"""`SFT`, the recipe class: supervised fine-tuning on demonstration threads (the token-mean
negative log-likelihood of their assistant turns), with checkpoints, recovery, evaluation and
logging."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from areal_lite.recipes.data import CosineScheduler
from areal_lite.recipes.model import TrainingModel
from areal_lite.recipes.recipe import BatchRecipe
from areal_lite.recipes.run import Evaluate, RecipeRunConfig
from areal_lite.recipes.thread import StringThread


class SFT(BatchRecipe[StringThread]):
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

    name: ClassVar[str] = "sft"

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
        super().__init__(
            dataset, model, lr=lr, samples_per_batch=samples_per_batch, max_grad_norm=max_grad_norm,
            num_epochs=num_epochs, max_num_steps=max_num_steps, weight_decay=weight_decay, lr_scheduler=lr_scheduler,
            data_seed=data_seed, run_config=run_config, evaluate=evaluate,
        )  # fmt: skip

    async def train_item(self, item: StringThread) -> None:
        await self.model.train_sft(item)
