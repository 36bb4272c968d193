"""A small SFT run with the real pieces, for the recovery test: FSDPEngine on a tiny model, the
resumable data loader, the recover handler, the saver and the stats logger.

Every rank appends one JSON line per trained step to ``output_dir/consumed_rank<R>.jsonl``: the
attempt (``AREAL_LITE_ATTEMPT``), the global step, the sample ids it trained on and the loss. With
``pause_at_step=K`` the first attempt stops after training step K, before its recover checkpoint,
writes its pid to ``paused_rank<R>`` and waits there to be killed. After a SIGTERM it exits with
143 once the recover checkpoint of the step under way is written.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import torch
from tensordict import TensorDict

from areal_lite.api.config import TrainEngineConfig
from areal_lite.api.config_loader import load_config
from areal_lite.api.experiment_config import BaseExperimentConfig
from areal_lite.api.io import FinetuneSpec
from areal_lite.engines.train.fsdp import FSDPEngine
from areal_lite.utils.dataloader import stateful_dataloader
from areal_lite.utils.recover import RecoverHandler
from areal_lite.utils.saver import Saver
from areal_lite.utils.stats import StatsTracker
from areal_lite.utils.stats_logger import StatsLogger
from areal_lite.utils.step import StepInfo


@dataclass
class Config(BaseExperimentConfig):
    actor: TrainEngineConfig = field(default_factory=TrainEngineConfig)
    dataset_size: int = 24
    vocab_size: int = 256
    pause_at_step: int = -1
    step_seconds: float = 0.0
    """Sleep this long after each step (to send a signal while the run goes on)."""


def make_item(i: int, vocab: int) -> dict[str, object]:
    n = 6 + i % 5
    return {"id": i, "input_ids": [(7 * i + 3 * j + 1) % vocab for j in range(n)]}


def to_batch(items: list[dict[str, object]]) -> TensorDict:
    seqs = [torch.tensor(it["input_ids"]) for it in items]
    L = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), L, dtype=torch.int64)
    mask = torch.zeros(len(seqs), L, dtype=torch.bool)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = s
        mask[b, : len(s)] = True
    loss_mask = mask.to(torch.int32)
    loss_mask[:, 0] = 0
    return TensorDict({"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}, batch_size=[len(seqs)])


def sft_loss(logp: torch.Tensor, entropy: torch.Tensor, mb: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    m = mb["loss_mask"].float()
    return -(logp * m).sum() / m.sum(), {}


def n_trained_tokens(mb: dict) -> float:
    return float(mb["loss_mask"].sum())


def main() -> None:
    cfg = load_config(sys.argv[1:], Config)
    attempt = int(os.environ.get("AREAL_LITE_ATTEMPT", "0"))
    dataset = [make_item(i, cfg.vocab_size) for i in range(cfg.dataset_size)]
    engine = FSDPEngine(cfg.actor)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ft_spec = FinetuneSpec(cfg.total_train_epochs, len(dataset), cfg.train_dataset.batch_size * world)
    engine.initialize(ft_spec)
    rank = engine.data_parallel_rank
    dataloader = stateful_dataloader(
        dataset, cfg.train_dataset.batch_size, seed=cfg.seed, rank=rank, world_size=engine.data_parallel_world_size
    )
    steps_per_epoch = len(dataloader)
    total_steps = cfg.total_train_epochs * steps_per_epoch
    stats_logger = StatsLogger(cfg.stats_logger, cfg.output_dir, total_steps=total_steps)
    saver = Saver(cfg.saver, cfg.output_dir)
    recover = RecoverHandler(cfg.recover, cfg.output_dir)
    info = recover.load(engine, dataloader=dataloader, stats_logger=stats_logger)
    step = info.next_step if info is not None else StepInfo.first(steps_per_epoch)
    tracker = StatsTracker()
    with open(os.path.join(cfg.output_dir, f"consumed_rank{rank}.jsonl"), "a") as record:
        data = iter(dataloader)
        while step.global_step < total_steps:
            try:
                items = next(data)
            except StopIteration:  # the epoch ended: the next iteration is the next epoch
                data = iter(dataloader)
                items = next(data)
            stats = engine.train_batch(to_batch(items), sft_loss, n_trained_tokens)
            engine.step_lr_scheduler()
            tracker.total(n_samples=len(items))
            record.write(
                json.dumps(
                    {
                        "attempt": attempt,
                        "step": step.global_step,
                        "ids": [it["id"] for it in items],
                        "loss": stats["loss"],
                    }
                )
                + "\n"
            )
            record.flush()
            if attempt == 0 and step.global_step == cfg.pause_at_step:
                with open(os.path.join(cfg.output_dir, f"paused_rank{rank}"), "w") as f:
                    f.write(str(os.getpid()))
                # Paused only to be killed: torchrun's SIGTERM after a peer's death ends it at once
                # (the checkpoint a SIGTERM asks for needs that peer; torchrun would wait 30 s).
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                while True:
                    time.sleep(0.1)
            last = step.global_step == total_steps - 1
            saver.save(engine, step, last=last)
            stats_logger.commit(step.global_step, stats, tracker.export())
            recover.dump(engine, step, dataloader=dataloader, stats_logger=stats_logger, last=last)
            if recover.stop_requested:  # a SIGTERM: the checkpoint of this step is written
                sys.exit(143)
            time.sleep(cfg.step_seconds)
            step = step.next()
    stats_logger.close()
    engine.destroy()


if __name__ == "__main__":
    main()
