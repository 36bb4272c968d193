"""What the recipe classes share, written once: `Recipe` (the loop of steps with the run's
bookkeeping around each), `BatchRecipe` (a step is one optimizer step on the next batch of items:
SFT, DPO), `run_data` (the looping data and each rank's share of a step) and `train_minibatches`
(shuffled mini-batches, one step each: GRPO, PPO). A recipe class
says what one step is; the loop, checkpoints, recovery, evaluation and logging are here and in
`areal_lite.recipes.run`."""

from __future__ import annotations

import abc
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import ClassVar, Generic, TypeVar

from areal_lite.recipes.concurrency import async_map
from areal_lite.recipes.data import CosineScheduler, DataSet, get_minibatches
from areal_lite.recipes.run import Evaluate, RecipeRun, RecipeRunConfig, mean_of, per_rank
from areal_lite.recipes.training import TrainingModel, _Trainable

T = TypeVar("T")


class Recipe(abc.ABC):
    """A training run of ``total_steps`` steps: `setup`, then (after a resume when recovery is on)
    one `train_step` after another, each followed by `RecipeRun.end_step`, then `teardown`.

    ``models`` are what the run checkpoints (the first is saved as HF checkpoints); ``dataset``
    resumes at its position. ``history`` holds what each step logged."""

    name: ClassVar[str]

    def __init__(
        self,
        models: dict[str, _Trainable],
        dataset: DataSet,
        total_steps: int,
        run_config: RecipeRunConfig | None,
        evaluate: Evaluate | None,
    ) -> None:
        self.models = models
        self.dataset = dataset
        self.total_steps = total_steps
        self.run_config = run_config or RecipeRunConfig()
        self.evaluate = evaluate
        self.step = 0
        self.history: list[dict[str, float]] = []
        """What each step logged (the models' statistics, per-rank records, scores)."""

    @property
    def training_completion_percentage(self) -> float:
        return self.step / self.total_steps

    async def setup(self) -> None:
        """Before the run, and before a resume loads weights (set graders up, clone a reference)."""

    async def teardown(self) -> None:
        """After the run, also after a failed one."""

    @abc.abstractmethod
    async def train_step(self, run: RecipeRun) -> dict[str, float]:
        """Step ``self.step``; returns the models' statistics (per-rank values go to `RecipeRun.record`)."""

    async def run(self) -> dict[str, float]:
        """Train for ``total_steps`` steps (resuming after a crash when recovery is on); returns
        what the last step logged."""
        await self.setup()
        run = RecipeRun(self.run_config, self.name, self.total_steps, self.models, self.dataset, self.evaluate)
        stats: dict[str, float] = {}
        try:
            for step in range(await run.resume(), self.total_steps):
                self.step = step
                stats = await run.end_step(step, await self.train_step(run))
                self.history.append(stats)
        finally:
            run.close()
            await self.teardown()
        return stats


class BatchRecipe(Recipe, Generic[T]):
    """A recipe whose step is one optimizer step on the next ``samples_per_batch`` items (over
    all ranks), each trained on by `train_item`, with a cosine learning rate.

    Args:
        dataset: the items; each rank trains on its own share.
        model: the model to train.
        lr: peak learning rate of the cosine schedule (``lr_scheduler`` replaces it).
        samples_per_batch: items per optimizer step, over all ranks.
        max_grad_norm: gradient clipping.
        num_epochs: passes over the data (``max_num_steps`` may stop earlier).
        weight_decay: AdamW weight decay.
        data_seed: order of the data.
        run_config: checkpoints, recovery, evaluation and logging.
        evaluate: held-out scores, logged when due and after the last step.
    """

    def __init__(
        self,
        dataset: Sequence[T],
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
        data, self.samples_per_batch = run_data(dataset, data_seed, samples_per_batch, "samples_per_batch")
        steps = num_epochs * math.ceil(len(data) / self.samples_per_batch)
        super().__init__({"model": model}, data, min(steps, max_num_steps or steps), run_config, evaluate)
        self.model = model
        self.lr_schedule = lr_scheduler or CosineScheduler(lr)
        self.max_grad_norm = max_grad_norm
        self.weight_decay = weight_decay

    @abc.abstractmethod
    async def train_item(self, item: T) -> None:
        """Add one item's gradient contribution."""

    async def train_step(self, run: RecipeRun) -> dict[str, float]:
        batch = [next(self.dataset) for _ in range(self.samples_per_batch)]
        with run.timer("train"):
            await async_map(self.train_item, batch)
            lr = self.lr_schedule(self.training_completion_percentage)
            return await self.model.optim_step(lr, wd=self.weight_decay, max_grad_norm=self.max_grad_norm)


def run_data(dataset: Sequence[T], seed: int, per_step: int, what: str) -> tuple[DataSet[T], int]:
    """A run's data (looping: a new shuffle each epoch, of which each rank draws its own share) and
    this rank's share of the ``per_step`` items a step takes over all ranks (``what`` names it in
    the error when the ranks cannot share it evenly)."""
    return DataSet(dataset, allow_looping=True, seed=seed), per_rank(per_step, what)


async def train_minibatches(
    data: list[T],
    size: int,
    n_epochs: int,
    seed: int,
    train_one: Callable[[T], Awaitable[None]],
    optim_step: Callable[[], Awaitable[dict[str, float]]],
) -> dict[str, float]:
    """For each shuffled mini-batch of ``size`` items over ``n_epochs`` passes: ``train_one`` on
    every item, then ``optim_step()``. Returns the mean of the steps' statistics."""
    steps = []
    for mini_batch in get_minibatches(data, size, n_epochs, seed=seed):
        await async_map(train_one, mini_batch)
        steps.append(await optim_step())
    return {k: mean_of([s[k] for s in steps]) for k in steps[0]}
