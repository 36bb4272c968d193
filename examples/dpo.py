"""DPO: learn from preference pairs against a frozen reference model.

Direct preference optimisation (Rafailov et al. 2023; ``actor.dpo_loss=ipo`` for IPO) raises the
policy's log-probability of each chosen answer relative to the rejected one, measured against a
frozen reference policy (``ref``, by default the starting weights): no reward model, no sampling.
Row ``2i`` of a batch is pair i's chosen answer and row ``2i + 1`` its rejected one
(`areal_lite.utils.datasets.preference_batch`), so micro-batches keep pairs whole
(``actor.mb_spec.granularity: 2``).

The pairs come from a local jsonl/parquet file with ``prompt``, ``chosen`` and ``rejected`` fields
(``train_dataset.path``, ``valid_dataset.path``), or, when no path is given, are generated for the
quickstart's addition task: the right sum is chosen over a nearly right one. The held-out DPO loss
and reward accuracy (chosen's implicit reward above rejected's) are reported before and after.

    python -m areal_lite.launcher.local examples/dpo.py --config configs/dpo.yaml
"""

from __future__ import annotations

import random
import sys
from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from areal_lite.actors.dpo import DPOActor
from areal_lite.api.config import BaseExperimentConfig, DPOConfig, TrainEngineConfig, load_config
from areal_lite.api.io import FinetuneSpec
from areal_lite.engines import make_train_engine
from areal_lite.utils.dataloader import endless, stateful_dataloader
from areal_lite.utils.datasets import addition_problems, load_rows, preference_batch
from areal_lite.utils.evaluator import Evaluator
from areal_lite.utils.recover import RecoverHandler
from areal_lite.utils.saver import Saver
from areal_lite.utils.stats_logger import StatsLogger
from areal_lite.utils.step import StepInfo


@dataclass
class TaskConfig:
    """The generated pairs (when no dataset path is given) and how prompts are rendered."""

    n_digits: int = 2
    """Digits of each operand."""
    n_train_pairs: int = 8192
    """Generated training pairs."""
    n_eval: int = 256
    """Held-out pairs evaluated (generated, or the first of ``valid_dataset``)."""
    seed: int = 0
    """Seed of the generated pairs."""
    use_chat_template: bool = False
    """Render each prompt as a user turn of the chat template (chat models) instead of raw text."""


@dataclass
class DPOExperimentConfig(BaseExperimentConfig):
    task: TaskConfig = field(default_factory=TaskConfig)
    actor: DPOConfig = field(default_factory=DPOConfig)
    ref: TrainEngineConfig = field(default_factory=TrainEngineConfig)
    """The frozen reference policy."""


def addition_pairs(n: int, n_digits: int, seed: int, exclude: Collection[str] = ()) -> list[dict[str, object]]:
    """The right sum (chosen) against one off by 1 or 10 (rejected); no prompt in ``exclude``."""
    rng = random.Random(seed)
    pairs = []
    for p in addition_problems(n, n_digits, seed, exclude=exclude):
        wrong = int(p["answer"]) + rng.choice([-10, -1, 1, 10])  # type: ignore[call-overload]
        pairs.append({"prompt": p["prompt"], "chosen": p["answer"], "rejected": str(abs(wrong))})
    return pairs


def main(argv: list[str]) -> None:
    cfg = load_config(argv, DPOExperimentConfig)
    torch.manual_seed(cfg.seed)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path or cfg.actor.path)
    task = cfg.task
    eval_pairs = (
        load_rows(cfg.valid_dataset.path)
        if cfg.valid_dataset.path
        else addition_pairs(task.n_eval, task.n_digits, task.seed + 1)
    )
    # Generated training pairs never repeat a held-out prompt (2-digit sums have only 10^4).
    train_pairs = (
        load_rows(cfg.train_dataset.path)
        if cfg.train_dataset.path
        else addition_pairs(task.n_train_pairs, task.n_digits, task.seed + 2, exclude={str(p["prompt"]) for p in eval_pairs})
    )
    eval_batch = preference_batch(tokenizer, eval_pairs[: task.n_eval], task.use_chat_template)
    dataloader = stateful_dataloader(
        train_pairs,
        batch_size=cfg.train_dataset.batch_size,
        shuffle=cfg.train_dataset.shuffle,
        seed=cfg.seed,
        collate_fn=lambda items: preference_batch(tokenizer, items, task.use_chat_template),
    )

    total_steps = cfg.total_train_steps or cfg.total_train_epochs * len(dataloader)
    ref = make_train_engine(cfg.ref)
    ref.initialize()  # no FinetuneSpec: frozen, forward only
    dpo = DPOActor(cfg.actor, make_train_engine(cfg.actor), ref)
    # The LR schedule spans this run's steps (total_train_steps may end it before or after the epochs).
    dpo.engine.initialize(FinetuneSpec(1, total_steps * cfg.train_dataset.batch_size, cfg.train_dataset.batch_size))

    saver = Saver(cfg.saver, cfg.output_dir)
    evaluator = Evaluator(cfg.evaluator)
    recover = RecoverHandler(cfg.recover, cfg.output_dir)
    stats_logger = StatsLogger(cfg.stats_logger, cfg.output_dir, total_steps=total_steps, run_name=cfg.experiment_name)

    info = recover.load(dpo.engine, dataloader=dataloader, stats_logger=stats_logger)
    if info is None:
        start_step, before = 0, dpo.evaluate_dpo(eval_batch)  # the policy equals the reference: loss log 2
    else:
        start_step, before = info.next_step.global_step, info.extra["before"]

    data = endless(dataloader)
    for global_step in range(start_step, total_steps):
        step = StepInfo.at(global_step, len(dataloader))
        stats = dpo.train_dpo(next(data))
        dpo.step_lr_scheduler()

        saver.save(dpo.engine, step, tokenizer=tokenizer, last=global_step + 1 == total_steps)
        recover.dump(dpo.engine, step, dataloader=dataloader, stats_logger=stats_logger, extra={"before": before})
        held_out = evaluator.evaluate(lambda: dpo.evaluate_dpo(eval_batch), step)
        stats_logger.commit(
            global_step, stats, {} if held_out is None else {f"eval/{k}": v for k, v in held_out.items()}
        )

    after = dpo.evaluate_dpo(eval_batch)
    stats_logger.close()
    dpo.engine.destroy()
    ref.destroy()
    print(
        f"RESULT loss_before={before['loss']:.3f} loss_after={after['loss']:.3f} "
        f"reward_accuracy_after={after['reward_accuracy']:.3f}",
        flush=True,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
