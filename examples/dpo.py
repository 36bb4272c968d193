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

import functools
import random
import sys
from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from areal_lite import kit
from areal_lite.actors.dpo import DPOActor
from areal_lite.api.config import DatasetConfig, DPOConfig, TrainEngineConfig
from areal_lite.api.config_loader import load_config
from areal_lite.api.experiment_config import BaseExperimentConfig
from areal_lite.utils.dataloader import endless
from areal_lite.utils.datasets import PREFERENCE_FIELDS, addition_problems, preference_batch, read_rows


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


def file_pairs(dataset: DatasetConfig, name: str) -> list[dict[str, object]]:
    """The pairs in ``dataset``'s file (the config section ``name``): rows without ``prompt``,
    ``chosen`` and ``rejected`` stop the run or are left out (``on_bad_row``)."""
    return read_rows(dataset.path, PREFERENCE_FIELDS, on_bad_row=dataset.on_bad_row, setting=f"{name}.on_bad_row").items


def main(argv: list[str]) -> None:
    cfg = load_config(argv, DPOExperimentConfig)
    torch.manual_seed(cfg.seed)
    from areal_lite.utils.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.tokenizer_path or cfg.actor.path)
    task = cfg.task
    if cfg.valid_dataset.path:
        eval_pairs = file_pairs(cfg.valid_dataset, "valid_dataset")
    else:
        eval_pairs = addition_pairs(task.n_eval, task.n_digits, task.seed + 1)
    if cfg.train_dataset.path:
        train_pairs = file_pairs(cfg.train_dataset, "train_dataset")
    else:  # never a held-out prompt (2-digit sums have only 10^4)
        held_out = {str(p["prompt"]) for p in eval_pairs}
        train_pairs = addition_pairs(task.n_train_pairs, task.n_digits, task.seed + 2, exclude=held_out)
    eval_batch = preference_batch(tokenizer, eval_pairs[: task.n_eval], task.use_chat_template)
    ref = kit.make_train_engine(cfg.ref)
    dpo = DPOActor(cfg.actor, kit.make_train_engine(cfg.actor), ref)
    collate = functools.partial(preference_batch, tokenizer, use_chat_template=task.use_chat_template)
    dataloader = kit.rank_dataloader(train_pairs, cfg.train_dataset, dpo.engine, seed=cfg.seed, collate_fn=collate)
    run = kit.RunKit(cfg, dpo.engine, dataloader, tokenizer=tokenizer)
    ref.initialize()  # no FinetuneSpec: frozen, forward only
    run.start()
    before = run.once("before", lambda: dpo.evaluate_dpo(eval_batch))  # the policy equals the reference: loss log 2

    def evaluate() -> dict[str, float]:
        return {f"eval/{k}": v for k, v in dpo.evaluate_dpo(eval_batch).items()}

    data = endless(dataloader)
    for global_step in range(run.start_step, run.total_steps):
        stats = dpo.train_dpo(next(data))
        dpo.step_lr_scheduler()
        run.end_step(global_step, stats, evaluate=evaluate)

    after = dpo.evaluate_dpo(eval_batch)
    run.close()
    dpo.engine.destroy()
    ref.destroy()
    kit.print_rank0(
        f"RESULT loss_before={before['loss']:.3f} loss_after={after['loss']:.3f} "
        f"reward_accuracy_after={after['reward_accuracy']:.3f}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
