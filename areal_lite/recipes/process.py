"""What the recipe models of one process share: the default process group (joined or created
here), the engine thread, a work directory the same on every rank, and `gather` for the values
that ranks exchange inside a collective call."""

from __future__ import annotations

import asyncio
import os
import tempfile
from typing import ClassVar, TypeVar

import torch.distributed as dist

from areal_lite.recipes.config import ModelConfig
from areal_lite.recipes.lockstep import EngineThread, engine_thread
from areal_lite.utils.distributed import init_default_group

T = TypeVar("T")


class Process:
    """What the models of this process share (besides the engine thread): whether this package
    created the default process group, the work directory (set by the first model that needs
    one; `shutdown` removes a temporary one) and the names in use."""

    created_group: ClassVar[bool] = False
    work_dir: ClassVar[str | None] = None
    owns_work_dir: ClassVar[bool] = False
    names: ClassVar[set[str]] = set()


async def join_process_group() -> EngineThread:
    """Join (or create) the default process group and start the engine thread (collective)."""

    def join() -> EngineThread:
        if not dist.is_initialized():
            Process.created_group = init_default_group()
        return engine_thread()

    return await asyncio.to_thread(join)


def gather(value: T) -> list[T]:
    """``value`` of every rank (on the engine thread, inside a call every rank makes)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    out: list[T] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(out, value)
    return out


def work_dir(config: ModelConfig) -> str:
    """The work directory, the same on every rank (on the engine thread, inside a call)."""
    if Process.work_dir is None:
        if config.work_dir:
            path = config.work_dir
            os.makedirs(path, exist_ok=True)
        else:
            mine = tempfile.mkdtemp(prefix="areal_lite_recipes_") if dist.get_rank() == 0 else ""
            path = gather(mine)[0]
            Process.owns_work_dir = True
        Process.work_dir = path
    return Process.work_dir
