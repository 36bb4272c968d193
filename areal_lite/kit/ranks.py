"""What the trainer's ranks share and what one rank does for all: `rank_dataloader` (each
data-parallel rank's own share of the data), `on_rank0_first` and `print_rank0`."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader

from areal_lite.api.config import DatasetConfig
from areal_lite.api.engine import TrainEngine
from areal_lite.utils.dataloader import stateful_dataloader


def is_rank0() -> bool:
    """Whether this process is trainer rank 0 (the process group's, else torchrun's ``RANK``)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def rank_dataloader(
    items: Sequence[object],
    dataset: DatasetConfig,
    engine: TrainEngine,
    *,
    seed: int,
    collate_fn: Callable[[list[object]], object] | None = None,
) -> StatefulDataLoader:
    """A resumable loader over this data-parallel rank's share of ``items`` (ranks never share an
    item), ``dataset.batch_size`` items per rank and step. Joins ``engine``'s process group first."""
    engine.create_process_group()
    extra = {} if collate_fn is None else {"collate_fn": collate_fn}
    world = engine.data_parallel_world_size
    loader = stateful_dataloader(
        items,
        batch_size=dataset.batch_size,
        shuffle=dataset.shuffle,
        seed=seed,
        rank=engine.data_parallel_rank,
        world_size=world,
        **extra,  # type: ignore[arg-type]
    )
    if len(loader) == 0:
        where = f" ({dataset.path})" if dataset.path else ""
        raise ValueError(
            f"the training data{where} has {len(items)} items, fewer than one batch of "
            f"batch_size={dataset.batch_size} x {world} data-parallel ranks"
        )
    return loader


def on_rank0_first(engine: TrainEngine, prepare: Callable[[], object]) -> None:
    """Run ``prepare`` (e.g. build a model directory that every rank then loads) on trainer rank 0
    while the other ranks wait for it. Joins ``engine``'s process group first."""
    engine.create_process_group()
    if dist.get_rank() == 0:
        prepare()
    dist.barrier()


def print_rank0(*args: object) -> None:
    """``print`` on trainer rank 0 only (every rank runs the script)."""
    if is_rank0():
        print(*args, flush=True)
