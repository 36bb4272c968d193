"""The `SFT` recipe class on the quickstart's task: fine-tune the tiny model on labelled addition
problems and report held-out greedy accuracy before and after, with checkpoints, recovery and
logging from the run config.

    python examples/recipes/sft.py --config configs/recipes/sft.yaml
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass

from addition_task import ExampleConfig, demonstration, finish, held_out_accuracy, start

from areal_lite.api.config_loader import load_config
from areal_lite.recipes import SFT


@dataclass
class SFTExampleConfig(ExampleConfig):
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
    split, model, acc_before = await start(cfg.task, cfg.model, cfg.run.output_dir)
    sft = SFT(
        [demonstration(p) for p in split.train], model, lr=cfg.lr, samples_per_batch=cfg.samples_per_batch,
        max_grad_norm=cfg.max_grad_norm, max_num_steps=cfg.steps, run_config=cfg.run,
        evaluate=held_out_accuracy(model, split),
    )  # fmt: skip
    last = await sft.run()
    await finish(
        t0, f"acc_before={acc_before:.3f} acc_after={last['eval/accuracy']:.3f} steps={sft.total_steps}", model
    )


if __name__ == "__main__":
    asyncio.run(main(load_config(sys.argv[1:], SFTExampleConfig)))
