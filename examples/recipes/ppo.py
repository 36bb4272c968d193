"""The `PPO` recipe class on the quickstart's task: the SFT warm-up, then PPO with a value model
(a new scalar head on the tiny network) against the exact-answer grader. Reports held-out greedy
accuracy before and after, and the value model's explained variance at the first and last step.

    python examples/recipes/ppo.py --config configs/recipes/ppo.yaml
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field

from addition_task import (
    TaskConfig,
    WarmupConfig,
    default_model,
    exact_grader,
    greedy_accuracy,
    prompt_thread,
    spawn_policy,
    splits,
    warm_up_with_sft,
)

from areal_lite.api.config import load_config
from areal_lite.api.io import GenerationConfig
from areal_lite.kit import print_rank0
from areal_lite.recipes import PPO, ModelBuilder, ModelConfig, RecipeRunConfig, shutdown


@dataclass
class PPOExampleConfig:
    task: TaskConfig = field(default_factory=TaskConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    model: ModelConfig = field(default_factory=default_model)
    run: RecipeRunConfig = field(default_factory=lambda: RecipeRunConfig(output_dir="outputs/recipes/ppo"))
    steps: int = 200
    """PPO steps."""
    samples_per_batch: int = 256
    """Completions (one per prompt) per step."""
    samples_per_mini_batch: int = 128
    """Completions per optimizer step of each model."""
    lr_policy: float = 5e-5
    """Peak policy learning rate."""
    lr_value: float = 1e-3
    """Peak value learning rate."""
    kl_beta: float = 0.001
    """Per-token KL penalty in the reward."""
    gamma: float = 1.0
    """Discount."""
    lam: float = 0.95
    """GAE lambda."""
    max_new_tokens: int = 5
    """Completion length limit."""


async def main(cfg: PPOExampleConfig) -> None:
    t0 = time.time()
    split = splits(cfg.task)
    policy = await spawn_policy(cfg.task, cfg.model, cfg.run.output_dir)
    value = await ModelBuilder(policy.path, cfg.model).spawn_value("value")
    await warm_up_with_sft(policy, cfg.task, cfg.warmup, split)
    acc_before = await greedy_accuracy(policy, split.held_out)

    async def evaluate() -> dict[str, float]:
        return {"eval/accuracy": await greedy_accuracy(policy, split.held_out)}

    ppo = PPO(
        [prompt_thread(p) for p in split.train], policy, value, exact_grader(), lr_policy=cfg.lr_policy,
        lr_value=cfg.lr_value, kl_beta=cfg.kl_beta, samples_per_batch=cfg.samples_per_batch, max_num_ppo_steps=cfg.steps,
        samples_per_mini_batch=cfg.samples_per_mini_batch, gamma=cfg.gamma, lam=cfg.lam,
        gconfig=GenerationConfig(max_new_tokens=cfg.max_new_tokens), run_config=cfg.run, evaluate=evaluate,
    )  # fmt: skip
    last = await ppo.run()
    await shutdown(policy, value)
    ev = [h["value/explained_variance"] for h in ppo.history]
    minutes = (time.time() - t0) / 60
    print_rank0(
        f"RESULT acc_before={acc_before:.3f} acc_after={last['eval/accuracy']:.3f} "
        f"explained_variance_first={ev[0]:.3f} explained_variance_last={ev[-1]:.3f} minutes={minutes:.1f}"
    )


if __name__ == "__main__":
    asyncio.run(main(load_config(sys.argv[1:], PPOExampleConfig)))
