"""The `GRPO` recipe class on the quickstart's task: the SFT warm-up, then GRPO against the
exact-answer grader, with checkpoints, recovery, evaluation and logging from the run config. The
same algorithm as examples/recipes/grpo_walkthrough.py, from the library.

    python examples/recipes/grpo.py --config configs/recipes/grpo.yaml
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass

from addition_task import GRPOSettings, RLExampleConfig, exact_grader, finish, held_out_accuracy, prompt_thread, start

from areal_lite.api.config_loader import load_config
from areal_lite.api.io import GenerationConfig
from areal_lite.recipes import GRPO, CosineScheduler


@dataclass
class GRPOExampleConfig(RLExampleConfig, GRPOSettings):
    steps: int = 100
    """GRPO steps."""


async def main(cfg: GRPOExampleConfig) -> None:
    t0 = time.time()
    split, model, acc_before = await start(cfg.task, cfg.model, cfg.run.output_dir, cfg.warmup)
    grpo = GRPO(
        [prompt_thread(p) for p in split.train], model, exact_grader(), cfg.completions_per_sample,
        kl_beta=cfg.kl_beta, samples_per_batch=cfg.samples_per_batch, samples_per_mini_batch=cfg.samples_per_mini_batch,
        max_num_grpo_steps=cfg.steps, lr_scheduler=CosineScheduler(cfg.lr, warmup_fraction=cfg.warmup_fraction),
        gconfig=GenerationConfig(max_new_tokens=cfg.max_new_tokens), run_config=cfg.run,
        evaluate=held_out_accuracy(model, split),
    )  # fmt: skip
    last = await grpo.run()
    await finish(t0, f"acc_before={acc_before:.3f} acc_after={last['eval/accuracy']:.3f}", model)


if __name__ == "__main__":
    asyncio.run(main(load_config(sys.argv[1:], GRPOExampleConfig)))
