"""`PPO`, the recipe class: proximal policy optimisation (Schulman et al. 2017) with a value
model, as in RLHF (Ouyang et al. 2022): one completion per prompt, a per-token reward that is the
KL penalty to the starting policy plus the grader's score on the last token, GAE advantages
(`functional.gae_advantages`, whitened over the batch), and clipped policy and value losses, with
checkpoints, recovery, evaluation and logging.

The logged ``value/explained_variance`` (1 - Var(returns - values) / Var(returns), over the
batch's tokens, with the values before the step) measures how well the value model predicts the
returns: it rises as the value model trains.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from areal_lite.algorithms import functional as F
from areal_lite.api.io import GenerationConfig
from areal_lite.recipes.concurrency import async_map_batch
from areal_lite.recipes.data import CosineScheduler
from areal_lite.recipes.graders import Grader
from areal_lite.recipes.inference import InferenceModel
from areal_lite.recipes.recipe import Recipe, run_data, train_minibatches
from areal_lite.recipes.run import Evaluate, RecipeRun, RecipeRunConfig, mean_of, per_rank
from areal_lite.recipes.thread import StringThread, TokenizedThread
from areal_lite.recipes.training import TrainingModel, ValueModel


@dataclass
class Rollout:
    """One graded completion with what PPO trains on (per trained token)."""

    sample: TokenizedThread
    score: float
    logprobs: list[float]
    ref_logprobs: list[float]
    values: list[float]
    advantages: list[float] | None = None
    returns: list[float] | None = None


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """``1 - Var(returns - values) / Var(returns)``: 1 for a perfect value model, 0 for one that
    predicts the mean, negative for a worse one (0 when the returns do not vary)."""
    var = returns.var(unbiased=False)
    return float(1.0 - (returns - values).var(unbiased=False) / var) if var > 0 else 0.0


class PPO(Recipe):
    """PPO on ``dataset`` (prompts as `StringThread`s) with ``grader`` as the reward.

    Args:
        dataset: the prompts; each rank trains on its own share, looping over it.
        policy_model: the policy.
        value_model: the value model (`ModelBuilder.spawn_value`).
        grader: scores each completed thread (set up by `run`).
        lr_policy: peak learning rate of the policy's cosine schedule.
        lr_value: peak learning rate of the value model's cosine schedule.
        kl_beta: per-token KL penalty to the starting policy, in the reward (0: no reference).
        samples_per_batch: completions per step, over all ranks.
        max_num_ppo_steps: steps to run (default: one pass over the prompts).
        samples_per_mini_batch: completions per optimizer step, over all ranks (default: all).
        mini_epochs_per_batch: passes over each batch.
        gamma: discount; lam: GAE lambda.
        clip_range: policy ratio clip; value_clip_range: value clip (None = unclipped).
        max_grad_norm: gradient clipping of both models.
        gconfig: sampling (default: the policy's).
        data_seed: order of the prompts.
        run_config: checkpoints, recovery, evaluation and logging.
        evaluate: held-out scores, logged when due and after the last step.
    """

    name: ClassVar[str] = "ppo"

    def __init__(
        self,
        dataset: Sequence[StringThread],
        policy_model: TrainingModel,
        value_model: ValueModel,
        grader: Grader,
        lr_policy: float = 1e-6,
        lr_value: float = 1e-5,
        kl_beta: float = 0.01,
        samples_per_batch: int = 128,
        max_num_ppo_steps: int | None = None,
        *,
        samples_per_mini_batch: int | None = None,
        mini_epochs_per_batch: int = 1,
        gamma: float = 1.0,
        lam: float = 0.95,
        clip_range: float = 0.2,
        value_clip_range: float | None = 0.2,
        max_grad_norm: float = 1.0,
        gconfig: GenerationConfig | None = None,
        data_seed: int = 42,
        run_config: RecipeRunConfig | None = None,
        evaluate: Evaluate | None = None,
    ) -> None:
        data, self.samples_per_batch = run_data(dataset, data_seed, samples_per_batch, "samples_per_batch")
        steps = max_num_ppo_steps or max(1, len(data) // self.samples_per_batch)
        super().__init__({"policy": policy_model, "value": value_model}, data, steps, run_config, evaluate)
        self.policy = policy_model
        self.value = value_model
        self.grader = grader
        self.policy_schedule = CosineScheduler(lr_policy)
        self.value_schedule = CosineScheduler(lr_value)
        self.kl_beta = kl_beta
        self.samples_per_mini_batch = per_rank(samples_per_mini_batch or samples_per_batch, "samples_per_mini_batch")
        self.mini_epochs_per_batch = mini_epochs_per_batch
        self.gamma = gamma
        self.lam = lam
        self.clip_range = clip_range
        self.value_clip_range = value_clip_range
        self.max_grad_norm = max_grad_norm
        self.gconfig = gconfig
        self.policy_ref: InferenceModel | None = None

    async def gen_data(self, prompt: StringThread) -> Rollout:
        """One completion of ``prompt``, graded and scored by the three models."""
        sample = await self.policy.generate_tokens(await self.policy.tokenize_thread(prompt), self.gconfig)
        score = await self.grader.score_float_value(await self.policy.detokenize_thread(sample))
        logprobs = await self.policy.logprobs_per_token(sample)
        ref = await self.policy_ref.logprobs_per_token(sample) if self.policy_ref is not None else logprobs
        return Rollout(sample, score, logprobs, ref, await self.value.values_per_token(sample))

    def compute_advantages(self, rollouts: list[Rollout]) -> dict[str, float]:
        """Per-token rewards (KL penalty, score on the last token), GAE advantages whitened over
        the batch, and returns; sets them on each rollout. Returns batch statistics."""
        lens = torch.tensor([len(r.logprobs) for r in rollouts])
        cu = torch.zeros(len(rollouts) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lens, 0)
        logp = torch.tensor([x for r in rollouts for x in r.logprobs])
        ref = torch.tensor([x for r in rollouts for x in r.ref_logprobs])
        values = torch.tensor([x for r in rollouts for x in r.values])
        mask = torch.ones_like(logp, dtype=torch.bool)
        kl = F.kl_k1(logp, ref)
        token_rewards = -self.kl_beta * kl + F.last_token_rewards(torch.tensor([r.score for r in rollouts]), mask, cu)
        advantages, returns = F.gae_advantages(token_rewards, values, mask, cu, self.gamma, self.lam)
        advantages = F.whiten(advantages, mask)
        for r, adv, ret in zip(rollouts, advantages.split(lens.tolist()), returns.split(lens.tolist())):
            r.advantages, r.returns = adv.tolist(), ret.tolist()
        return {
            "value/explained_variance": explained_variance(values, returns),
            "value/mean": float(values.mean()),
            "kl_k1": float(kl.mean()),
        }

    async def train_rollout(self, r: Rollout) -> None:
        assert r.advantages is not None and r.returns is not None
        await self.policy.train_ppo(r.sample, r.logprobs, r.advantages, self.clip_range)
        await self.value.train_value(r.sample, r.values, r.returns, self.value_clip_range)

    async def setup(self) -> None:
        await self.grader.setup()
        self.policy_ref = await self.policy.clone_inf() if self.kl_beta > 0 else None

    async def teardown(self) -> None:
        if self.policy_ref is not None:
            await self.policy_ref.close()

    async def train_step(self, run: RecipeRun) -> dict[str, float]:
        with run.timer("generate"):
            rollouts = await async_map_batch(self.gen_data, self.dataset, self.samples_per_batch)
        run.record(reward_mean=mean_of([r.score for r in rollouts]), **self.compute_advantages(rollouts))
        p = self.training_completion_percentage

        async def optim_step() -> dict[str, float]:
            policy = await self.policy.optim_step(self.policy_schedule(p), max_grad_norm=self.max_grad_norm)
            value = await self.value.optim_step(self.value_schedule(p), max_grad_norm=self.max_grad_norm)
            return {**policy, **{f"value/{k}": v for k, v in value.items()}}

        with run.timer("train"):
            return await train_minibatches(
                rollouts,
                self.samples_per_mini_batch,
                self.mini_epochs_per_batch,
                self.step,
                self.train_rollout,
                optim_step,
            )
