"""The `PPO` recipe class on the quickstart's task: the SFT warm-up, then PPO with a value model
(a new scalar head on the tiny network) against the exact-answer grader. Reports held-out greedy
accuracy before and after, and the value model's explained variance at the first and last step.

    python examples/recipes/ppo.py --config configs/recipes/ppo.yaml
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass

from addition_task import RLExampleConfig, exact_grader, finish, held_out_accuracy, prompt_thread, start

from areal_lite.api.config_loader import load_config
from areal_lite.api.io import GenerationConfig
from areal_lite.recipes import PPO, ModelBuilder


@dataclass
class PPOExampleConfig(RLExampleConfig):
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
    split, policy, acc_before = await start(cfg.task, cfg.model, cfg.run.output_dir, cfg.warmup)
    value = await ModelBuilder(policy.path, cfg.model).spawn_value("value")  # the base network, a new head

    ppo = PPO(
        [prompt_thread(p) for p in split.train], policy, value, exact_grader(), lr_policy=cfg.lr_policy,
        lr_value=cfg.lr_value, kl_beta=cfg.kl_beta, samples_per_batch=cfg.samples_per_batch, max_num_ppo_steps=cfg.steps,
        samples_per_mini_batch=cfg.samples_per_mini_batch, gamma=cfg.gamma, lam=cfg.lam,
        gconfig=GenerationConfig(max_new_tokens=cfg.max_new_tokens), run_config=cfg.run,
        evaluate=held_out_accuracy(policy, split),
    )  # fmt: skip
    last = await ppo.run()
    ev = [h["value/explained_variance"] for h in ppo.history]
    await finish(
        t0,
        f"acc_before={acc_before:.3f} acc_after={last['eval/accuracy']:.3f} "
        f"explained_variance_first={ev[0]:.3f} explained_variance_last={ev[-1]:.3f}",
        policy,
        value,
    )


if __name__ == "__main__":
    asyncio.run(main(load_config(sys.argv[1:], PPOExampleConfig)))
