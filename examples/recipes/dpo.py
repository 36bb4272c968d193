"""The `DPO` recipe class on the quickstart's task: preference pairs of a right and a wrong answer
(one digit off) to the same problem, after a short SFT warm-up that teaches the format. Reports
held-out preference accuracy (how often the model gives the right answer a higher likelihood than
the wrong one) and greedy accuracy, before and after.

    python examples/recipes/dpo.py --config configs/recipes/dpo.yaml
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import dataclass, field

from addition_task import (
    Problem,
    RLExampleConfig,
    WarmupConfig,
    demonstration,
    finish,
    greedy_accuracy,
    prompt_thread,
    start,
)

from areal_lite.api.config_loader import load_config
from areal_lite.recipes import DPO, StringThread, TrainingModel, async_map


@dataclass
class DPOExampleConfig(RLExampleConfig):
    warmup: WarmupConfig = field(default_factory=lambda: WarmupConfig(target_acc=0.1))
    """A short warm-up: the format, not the skill."""
    steps: int = 200
    """DPO steps."""
    samples_per_batch: int = 64
    """Pairs per step."""
    lr: float = 1e-4
    """Peak learning rate."""
    beta: float = 0.1
    """DPO's beta."""


def preference_pair(problem: Problem, rng: random.Random) -> tuple[StringThread, StringThread]:
    """(right answer, the answer with one digit changed)."""
    right = str(problem["answer"])
    i = rng.randrange(len(right))
    wrong = right[:i] + rng.choice([d for d in "0123456789" if d != right[i]]) + right[i + 1 :]
    return demonstration(problem), prompt_thread(problem).assistant(wrong)


async def preference_accuracy(model: TrainingModel, pairs: list[tuple[StringThread, StringThread]]) -> float:
    """Fraction of pairs whose right answer the model finds more likely than the wrong one."""

    async def prefers_right(pair: tuple[StringThread, StringThread]) -> float:
        right, wrong = await async_map(model.tokenize_thread, pair)
        lp_right, lp_wrong = await async_map(model.logprobs_per_token, [right, wrong])
        return float(sum(lp_right) > sum(lp_wrong))

    return sum(await async_map(prefers_right, pairs)) / len(pairs)


async def main(cfg: DPOExampleConfig) -> None:
    t0 = time.time()
    rng = random.Random(cfg.task.seed)
    split, model, acc_before = await start(cfg.task, cfg.model, cfg.run.output_dir, cfg.warmup)
    train_pairs = [preference_pair(p, rng) for p in split.train]
    held_out_pairs = [preference_pair(p, rng) for p in split.held_out]
    pref_before = await preference_accuracy(model, held_out_pairs)

    async def evaluate() -> dict[str, float]:
        return {"eval/preference_accuracy": await preference_accuracy(model, held_out_pairs)}

    dpo = DPO(
        train_pairs, model, lr=cfg.lr, samples_per_batch=cfg.samples_per_batch, beta=cfg.beta,
        max_num_steps=cfg.steps, run_config=cfg.run, evaluate=evaluate,
    )  # fmt: skip
    last = await dpo.run()
    acc_after = await greedy_accuracy(model, split.held_out)
    await finish(
        t0,
        f"preference_before={pref_before:.3f} preference_after={last['eval/preference_accuracy']:.3f} "
        f"acc_before={acc_before:.3f} acc_after={acc_after:.3f}",
        model,
    )


if __name__ == "__main__":
    asyncio.run(main(load_config(sys.argv[1:], DPOExampleConfig)))
