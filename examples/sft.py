"""Supervised fine-tuning on demonstrations from a local file.

`SFTActor` minimises the mean negative log-likelihood of the completion tokens (``loss_mask`` 1;
the prompt is context only). Each item of the jsonl/parquet file (``train_dataset.path``) is
either ``{"prompt", "completion"}`` (raw text, or one user turn of the chat template with
``task.use_chat_template``) or ``{"messages": [...]}`` (a chat whose last message is the
completion; the earlier ones are rendered by the chat template), see
`areal_lite.utils.datasets.demonstration_ids`. Without a path, demonstrations of the quickstart's
addition task are generated. Held-out loss and perplexity are reported before and after.

With ``task.tiny_model`` a tiny random model with a byte-level tokenizer is built at
``actor.path`` when nothing is there, so the default config runs on a CPU from nothing:

    python -m areal_lite.launcher.local examples/sft.py --config configs/sft.yaml
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass, field

import torch

from areal_lite import kit
from areal_lite.actors.sft import SFTActor
from areal_lite.api.config import DatasetConfig, TrainEngineConfig
from areal_lite.api.config_loader import load_config
from areal_lite.api.experiment_config import BaseExperimentConfig
from areal_lite.utils.dataloader import endless
from areal_lite.utils.datasets import Rows, addition_problems, demonstration_row, read_rows, sft_batch
from areal_lite.utils.tiny import build_tiny_model


@dataclass
class TaskConfig(kit.TinyModelConfig):
    """The generated demonstrations (when no dataset path is given) and the model to start from."""

    n_digits: int = 2
    """Digits of each operand."""
    n_train: int = 65536
    """Generated training demonstrations."""
    n_eval: int = 256
    """Held-out demonstrations evaluated (generated, or the first of ``valid_dataset``)."""
    seed: int = 0
    """Seed of the generated demonstrations and of the tiny model."""
    use_chat_template: bool = False
    """Render ``prompt`` items as a user turn of the chat template instead of raw text."""
    tiny_model: bool = False
    """Build a tiny random model (byte-level tokenizer) at ``actor.path`` if none is there."""


@dataclass
class SFTConfig(BaseExperimentConfig):
    task: TaskConfig = field(default_factory=TaskConfig)
    actor: TrainEngineConfig = field(default_factory=TrainEngineConfig)


def demonstrations(dataset: DatasetConfig, name: str, n: int, task: TaskConfig, seed: int) -> Rows:
    """The items of ``dataset``'s file (the config section ``name``; rows that are not
    demonstrations stop the run or are left out and counted, ``on_bad_row``), or ``n`` generated
    additions as prompt/completion pairs."""
    if dataset.path:
        return read_rows(
            dataset.path, on_bad_row=dataset.on_bad_row, convert=demonstration_row, setting=f"{name}.on_bad_row"
        )
    items = [{"prompt": p["prompt"], "completion": p["answer"]} for p in addition_problems(n, task.n_digits, seed)]
    return Rows(items=items, where=["generated"] * len(items))


def main(argv: list[str]) -> None:
    cfg = load_config(argv, SFTConfig)
    torch.manual_seed(cfg.seed)
    task = cfg.task
    sft = SFTActor(cfg.actor, kit.make_train_engine(cfg.actor))

    def build() -> None:
        if task.tiny_model and not os.path.exists(os.path.join(cfg.actor.path, "config.json")):
            build_tiny_model(
                cfg.actor.path,
                hidden_size=task.hidden_size,
                num_layers=task.num_layers,
                num_heads=4,
                num_kv_heads=4,
                vocab_size=0,
                max_position_embeddings=64,
                seed=task.seed,
            )

    kit.on_rank0_first(sft.engine, build)
    from areal_lite.utils.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.tokenizer_path or cfg.actor.path)
    train_rows = demonstrations(cfg.train_dataset, "train_dataset", task.n_train, task, task.seed + 2)
    train_items = train_rows.items
    eval_items = demonstrations(cfg.valid_dataset, "valid_dataset", task.n_eval, task, task.seed + 1).items[
        : task.n_eval
    ]
    eval_batch = sft_batch(tokenizer, eval_items, task.use_chat_template)
    collate = functools.partial(sft_batch, tokenizer, use_chat_template=task.use_chat_template)
    dataloader = kit.rank_dataloader(train_items, cfg.train_dataset, sft.engine, seed=cfg.seed, collate_fn=collate)
    run = kit.RunKit(cfg, sft.engine, dataloader, tokenizer=tokenizer, data_stats=train_rows.stats())
    run.start()
    before = run.once("before", lambda: sft.evaluate_lm(eval_batch))

    def evaluate() -> dict[str, float]:
        return {f"eval/{k}": v for k, v in sft.evaluate_lm(eval_batch).items()}

    data = endless(dataloader)
    for global_step in range(run.start_step, run.total_steps):
        stats = sft.train_lm(next(data))
        sft.step_lr_scheduler()
        run.end_step(global_step, stats, evaluate=evaluate)

    after = sft.evaluate_lm(eval_batch)
    run.close()
    sft.engine.destroy()
    kit.print_rank0(
        f"RESULT loss_before={before['loss']:.3f} loss_after={after['loss']:.3f} ppl_after={after['ppl']:.2f}",
    )


if __name__ == "__main__":
    main(sys.argv[1:])
