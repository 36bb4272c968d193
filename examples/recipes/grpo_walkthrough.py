"""The simplified GRPO walkthrough, written against the recipe API, on the quickstart's task.

GRPO (Shao et al. 2024) in a few dozen lines: for each prompt, sample a group of completions,
grade them, normalise the scores within the group into advantages, score the tokens under the
policy and under a frozen reference (for the KL term), then train on shuffled mini-batches, one
`optim_step` each. Single-turn; no checkpoints or logging (the `GRPO` recipe class has them).

The task is the quickstart's: two-digit addition with an exact-answer grader, a tiny model built
here and warmed up with SFT until its greedy dev accuracy reaches ``sft_target_acc``, then GRPO
against the grader alone. Held-out greedy accuracy is measured before and after RL.

    python examples/recipes/grpo_walkthrough.py --config configs/recipes/grpo_walkthrough.yaml

Deliberate simplifications: the policy that samples is the policy that is trained (one on-policy
update per batch with the default mini-batching), so the log-probabilities it is trained against
are recomputed by the train engine (`logprobs_per_token`) rather than taken from sampling.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field

import torch
from addition_task import (
    GRPOSettings,
    TaskConfig,
    WarmupConfig,
    default_model,
    exact_grader,
    greedy_accuracy,
    prompt_thread,
    start,
)

from areal_lite.algorithms.functional import grpo_advantages
from areal_lite.api.config_loader import load_config
from areal_lite.api.io import GenerationConfig
from areal_lite.kit import print_rank0
from areal_lite.recipes import (
    CosineScheduler,
    DataSet,
    Grader,
    ModelConfig,
    StringThread,
    TokenizedThread,
    TrainingModel,
    async_map,
    async_map_batch,
    get_minibatches,
    repeat_thread,
    shutdown,
)


@dataclass
class Sample:
    sample: TokenizedThread
    logprobs: list[float]
    ref_logprobs: list[float]
    advantage: float
    score: float
    kl_div: list[float]


class GRPO:
    def __init__(
        self, dataset: list[StringThread], model: TrainingModel, grader: Grader, cfg: WalkthroughConfig
    ) -> None:
        self.dataset = DataSet(dataset, allow_looping=True, seed=cfg.seed)  # an iterator over StringThreads
        self.model = model
        self.grader = grader
        self.completions_per_sample = cfg.completions_per_sample  # the group size
        self.lr_schedule = CosineScheduler(cfg.lr, warmup_fraction=cfg.warmup_fraction)
        self.max_grad_norm = cfg.max_grad_norm
        self.prompts_per_batch = cfg.samples_per_batch // cfg.completions_per_sample
        self.samples_per_mini_batch = cfg.samples_per_mini_batch
        self.mini_epochs_per_batch = cfg.mini_epochs_per_batch
        self.clip_range = cfg.clip_range
        self.kl_beta = cfg.kl_beta
        self.weight_decay = cfg.weight_decay
        self.gconfig = GenerationConfig(max_new_tokens=cfg.max_new_tokens, temperature=1.0)
        self.total_steps = cfg.grpo_steps
        self.step = 0

    @property
    def training_completion_percentage(self) -> float:
        return self.step / self.total_steps

    async def gen_data(self, prompt: StringThread) -> list[Sample]:
        """A group of graded completions of one prompt."""
        tokens = await self.model.tokenize_thread(prompt)
        group = await async_map_batch(
            lambda t: self.model.generate_tokens(t, self.gconfig),
            repeat_thread(tokens),
            batch_size=self.completions_per_sample,
        )
        texts = await async_map(self.model.detokenize_thread, group)
        scores = await async_map(self.grader.score_float_value, texts)
        advantages = grpo_advantages(torch.tensor(scores), self.completions_per_sample)  # (r - mean) / (std + eps)

        logprobs = await async_map(self.model.logprobs_per_token, group)
        ref_logprobs = await async_map(self.model_ref.logprobs_per_token, group)
        kl = [[a - b for a, b in zip(lp, ref)] for lp, ref in zip(logprobs, ref_logprobs)]
        return [
            Sample(group[i], logprobs[i], ref_logprobs[i], float(advantages[i]), scores[i], kl[i])
            for i in range(len(group))
        ]

    async def train_sample(self, s: Sample) -> None:
        await self.model.train_grpo(
            s.sample, s.logprobs, s.ref_logprobs, [s.advantage] * len(s.logprobs), self.clip_range, self.kl_beta
        )

    async def run(self, log_every: int = 25) -> None:
        self.model_ref = await self.model.clone_inf()  # the reference: the policy before RL
        t0 = time.time()
        for step in range(self.total_steps):
            self.step = step
            data = await async_map_batch(self.gen_data, self.dataset, self.prompts_per_batch)
            current_lr = self.lr_schedule(self.training_completion_percentage)
            flattened = [s for group in data for s in group]
            for mini_batch in get_minibatches(flattened, self.samples_per_mini_batch, self.mini_epochs_per_batch):
                await async_map(self.train_sample, mini_batch)
                stats = await self.model.optim_step(current_lr, wd=self.weight_decay, max_grad_norm=self.max_grad_norm)
            if (step + 1) % log_every == 0:
                reward = sum(s.score for s in flattened) / len(flattened)
                kl = sum(sum(s.kl_div) for s in flattened) / sum(len(s.kl_div) for s in flattened)
                print_rank0(
                    f"[grpo] step {step + 1}/{self.total_steps} reward {reward:.3f} kl {kl:.4f} "
                    f"loss {stats['loss']:.4f} grad_norm {stats['grad_norm']:.3f} ({time.time() - t0:.0f}s)"
                )
        await self.model_ref.close()


# ---------------------------------------------------------------------------------- the run


@dataclass
class WalkthroughConfig(GRPOSettings):
    """The task, the SFT warm-up and GRPO's settings (configs/recipes/grpo_walkthrough.yaml; those
    this script shares with examples/recipes/grpo.py in `GRPOSettings`)."""

    output_dir: str = "outputs/recipes/grpo_walkthrough"
    """The tiny model is built here."""
    task: TaskConfig = field(default_factory=TaskConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    model: ModelConfig = field(default_factory=default_model)
    """The policy's engines."""
    grpo_steps: int = 150
    """GRPO steps (batches)."""
    mini_epochs_per_batch: int = 1
    """Passes over each batch."""
    clip_range: float = 0.2
    """PPO clip of the ratio."""
    max_grad_norm: float = 1.0
    """Gradient clipping."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    seed: int = 0
    """Order of the prompts."""


async def main(cfg: WalkthroughConfig) -> None:
    t_start = time.time()
    torch.manual_seed(cfg.seed)
    split, policy, acc_before = await start(cfg.task, cfg.model, cfg.output_dir, cfg.warmup)  # SFT warm-up included
    print_rank0(
        f"[walkthrough] held-out greedy accuracy after SFT: {acc_before:.3f} ({(time.time() - t_start) / 60:.1f} min)"
    )

    t_rl = time.time()
    await GRPO([prompt_thread(p) for p in split.train], policy, exact_grader(), cfg).run()
    acc_after = await greedy_accuracy(policy, split.held_out)
    minutes = (time.time() - t_start) / 60
    print_rank0(f"[walkthrough] GRPO: {cfg.grpo_steps} steps in {time.time() - t_rl:.0f}s")
    await shutdown(policy)
    print_rank0(f"\n{'held-out greedy accuracy':<28}{'value':>8}")
    print_rank0(f"{'after SFT (before RL)':<28}{acc_before:>8.3f}")
    print_rank0(f"{'after GRPO':<28}{acc_after:>8.3f}")
    print_rank0(f"RESULT acc_before={acc_before:.3f} acc_after={acc_after:.3f} minutes={minutes:.1f}")


if __name__ == "__main__":
    asyncio.run(main(load_config(sys.argv[1:], WalkthroughConfig)))
