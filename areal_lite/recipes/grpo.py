"""`GRPO`, the recipe class: group relative policy optimisation (Shao et al. 2024) written against
the recipe API, with checkpoints, recovery, evaluation and logging.

Each step draws ``samples_per_batch / completions_per_sample`` prompts, samples a group of
completions for each, grades them, normalises the scores within each group into advantages
(`functional.grpo_advantages`), scores the tokens under the policy and the frozen reference, and
trains on the shuffled samples in mini-batches of ``samples_per_mini_batch``, one `optim_step`
each, ``mini_epochs_per_batch`` times. examples/recipes/grpo_walkthrough.py is the same algorithm
without the bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from areal_lite.algorithms import functional as F
from areal_lite.api.io import GenerationConfig
from areal_lite.recipes.concurrency import async_map, async_map_batch
from areal_lite.recipes.data import CosineScheduler
from areal_lite.recipes.graders import Grader
from areal_lite.recipes.inference import InferenceModel
from areal_lite.recipes.recipe import Recipe, run_data, train_minibatches
from areal_lite.recipes.run import Evaluate, RecipeRun, RecipeRunConfig, mean_of, per_rank
from areal_lite.recipes.thread import StringThread, TokenizedThread, repeat_thread
from areal_lite.recipes.training import TrainingModel


@dataclass
class Sample:
    """One graded completion, ready to train on."""

    sample: TokenizedThread
    logprobs: list[float]
    ref_logprobs: list[float]
    advantage: float
    score: float


class GRPO(Recipe):
    """GRPO on ``dataset`` (prompts as `StringThread`s) with ``grader`` as the reward.

    Args:
        dataset: the prompts; each rank trains on its own share, looping over it.
        model: the policy.
        grader: scores each completed thread (set up by `run`).
        completions_per_sample: the group size.
        lr: peak learning rate of the cosine schedule (``lr_scheduler`` replaces it).
        kl_beta: weight of the k3 KL estimate to the reference (0: no reference model).
        samples_per_batch: completions per step, over all ranks.
        samples_per_mini_batch: completions per optimizer step, over all ranks.
        mini_epochs_per_batch: passes over each batch.
        max_num_grpo_steps: steps to run (default: one pass over the prompts).
        clip_range: PPO clip epsilon of the ratio.
        max_grad_norm: gradient clipping.
        weight_decay: AdamW weight decay.
        gconfig: sampling (default: the model's).
        data_seed: order of the prompts.
        run_config: checkpoints, recovery, evaluation and logging.
        evaluate: held-out scores, logged when due and after the last step.
    """

    name: ClassVar[str] = "grpo"

    def __init__(
        self,
        dataset: Sequence[StringThread],
        model: TrainingModel,
        grader: Grader,
        completions_per_sample: int = 8,
        lr: float = 1e-6,
        kl_beta: float = 0.01,
        *,
        samples_per_batch: int = 128,
        samples_per_mini_batch: int = 128,
        mini_epochs_per_batch: int = 1,
        max_num_grpo_steps: int | None = None,
        clip_range: float = 0.2,
        max_grad_norm: float = 1.0,
        weight_decay: float = 0.0,
        lr_scheduler: CosineScheduler | None = None,
        gconfig: GenerationConfig | None = None,
        data_seed: int = 42,
        run_config: RecipeRunConfig | None = None,
        evaluate: Evaluate | None = None,
    ) -> None:
        if samples_per_batch % completions_per_sample:
            raise ValueError(
                f"samples_per_batch={samples_per_batch} is not a multiple of completions_per_sample={completions_per_sample}"
            )
        per_step = samples_per_batch // completions_per_sample
        data, self.prompts_per_batch = run_data(dataset, data_seed, per_step, "prompts per batch")
        steps = max_num_grpo_steps or max(1, len(data) // self.prompts_per_batch)
        super().__init__({"policy": model}, data, steps, run_config, evaluate)
        self.model = model
        self.grader = grader
        self.completions_per_sample = completions_per_sample
        self.samples_per_mini_batch = per_rank(samples_per_mini_batch, "samples_per_mini_batch")
        self.mini_epochs_per_batch = mini_epochs_per_batch
        self.lr_schedule = lr_scheduler or CosineScheduler(lr)
        self.kl_beta = kl_beta
        self.clip_range = clip_range
        self.max_grad_norm = max_grad_norm
        self.weight_decay = weight_decay
        self.gconfig = gconfig
        self.model_ref: InferenceModel | None = None

    async def gen_data(self, prompt: StringThread) -> list[Sample]:
        """A graded group of completions of ``prompt``, with advantages and log-probabilities."""
        tokenized = await self.model.tokenize_thread(prompt)
        group = await async_map_batch(
            lambda t: self.model.generate_tokens(t, self.gconfig), repeat_thread(tokenized), self.completions_per_sample
        )
        texts = await async_map(self.model.detokenize_thread, group)
        scores = await async_map(self.grader.score_float_value, texts)
        advantages = F.grpo_advantages(torch.tensor(scores), self.completions_per_sample).tolist()
        logprobs = await async_map(self.model.logprobs_per_token, group)
        if self.model_ref is not None:
            ref_logprobs = await async_map(self.model_ref.logprobs_per_token, group)
        else:
            ref_logprobs = logprobs
        return [Sample(*fields) for fields in zip(group, logprobs, ref_logprobs, advantages, scores)]

    async def train_sample(self, s: Sample) -> None:
        await self.model.train_grpo(s.sample, s.logprobs, s.ref_logprobs, s.advantage, self.clip_range, self.kl_beta)

    async def setup(self) -> None:
        await self.grader.setup()
        # The reference is the policy as the recipe found it (cloned before a resume loads weights).
        self.model_ref = await self.model.clone_inf() if self.kl_beta > 0 else None

    async def teardown(self) -> None:
        if self.model_ref is not None:
            await self.model_ref.close()

    async def train_step(self, run: RecipeRun) -> dict[str, float]:
        with run.timer("generate"):
            groups = await async_map_batch(self.gen_data, self.dataset, self.prompts_per_batch)
        data = [s for group in groups for s in group]
        run.record(
            reward_mean=mean_of([s.score for s in data]),
            completion_tokens=mean_of([len(s.logprobs) for s in data]),
            kl_k1=mean_of([lp - r for s in data for lp, r in zip(s.logprobs, s.ref_logprobs)]),
        )
        lr = self.lr_schedule(self.training_completion_percentage)
        with run.timer("train"):
            return await train_minibatches(
                data, self.samples_per_mini_batch, self.mini_epochs_per_batch, self.step, self.train_sample,
                lambda: self.model.optim_step(lr, wd=self.weight_decay, max_grad_norm=self.max_grad_norm),
            )  # fmt: skip
