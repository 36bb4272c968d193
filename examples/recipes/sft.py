"""The `SFT` recipe class on the quickstart's task: fine-tune the tiny model on labelled addition
problems and report held-out greedy accuracy before and after, with checkpoints, recovery and
logging from the run config.

    python examples/recipes/sft.py --config configs/recipes/sft.yaml
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field

from addition_task import TaskConfig, default_model, demonstration, greedy_accuracy, spawn_policy, splits

from areal_lite.api.config import load_config
from areal_lite.kit import print_rank0
from areal_lite.recipes import SFT, ModelConfig, RecipeRunConfig, shutdown


@dataclass
class SFTExampleConfig:
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=default_model)
    run: RecipeRunConfig = field(default_factory=lambda: RecipeRunConfig(output_dir="outputs/recipes/sft"))
    lr: float = 1e-3
    """Peak learning rate (cosine to 0)."""
    samples_per_batch: int = 128
    """Demonstrations per step."""
    steps: int = 400
    """Steps to run (at most one epoch of ``task.n_train_prompts``)."""
    max_grad_norm: float = 1.0
    """Gradient clipping."""


async def main(cfg: SFTExampleConfig) -> None:
    t0 = time.time()
    split = splits(cfg.task)
    model = await spawn_policy(cfg.task, cfg.model, cfg.run.output_dir)
    acc_before = await greedy_accuracy(model, split.held_out)

    async def evaluate() -> dict[str, float]:
        return {"eval/accuracy": await greedy_accuracy(model, split.held_out)}

    sft = SFT(
        [demonstration(p) for p in split.train], model, lr=cfg.lr, samples_per_batch=cfg.samples_per_batch,
        max_grad_norm=cfg.max_grad_norm, max_num_steps=cfg.steps, run_config=cfg.run, evaluate=evaluate,
    )  # fmt: skip
    last = await sft.run()
    await shutdown(model)
    minutes = (time.time() - t0) / 60
    print_rank0(f"RESULT acc_before={acc_before:.3f} acc_after={last['eval/accuracy']:.3f} steps={sft.total_steps} minutes={minutes:.1f}")


if __name__ == "__main__":
    asyncio.run(main(load_config(sys.argv[1:], SFTExampleConfig)))
