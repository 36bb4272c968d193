"""An FSDPEngine trainer (torchrun, gloo) whose rank 0 hands its weights over to our server on this
machine by ipc updates: buckets of shared memory, no file, no process group.

Usage: ``torchrun --nproc-per-node N ipc_trainer.py MODEL_DIR ADDR WORKDIR API_KEY``

It trains a step and sends the weights in buckets of at most 16 KiB (so several), twice. After each
update it reads every tensor back from the server (``/get_weights_by_name``, whole) and compares it
with what the bucket carried, checks that freshly generated tokens score the same on the server and
in the trainer, and lists the buckets' segments left in /dev/shm. Every rank counts the buckets it
made and, as each is made, how many of its own segments are alive (the previous bucket's, while the
server loads it). Rank 0 writes ``WORKDIR/trainer.json``.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import sys
from typing import ClassVar

import aiohttp
import torch
import torch.distributed as dist
from inference_trainer import check, train_step

from areal_lite.api.config import InferenceEngineConfig, OptimizerConfig, TrainEngineConfig
from areal_lite.api.io import FinetuneSpec, WeightUpdateMeta
from areal_lite.engines.remote.sglang import RemoteSGLangEngine
from areal_lite.engines.train import weight_sync
from areal_lite.engines.train.fsdp import FSDPEngine
from areal_lite.utils.distributed import destroy_default_group
from areal_lite.utils.tensor_handles import SEGMENT_PREFIX, SHM_DIR, TensorBucket


class WatchedBucket(TensorBucket):
    """A bucket that records what it carried and how many of this process's buckets were alive
    when it was made."""

    alive_at_make: ClassVar[list[int]] = []
    carried: ClassVar[dict[str, torch.Tensor]] = {}

    def __init__(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        WatchedBucket.alive_at_make.append(len(own_segments()))
        super().__init__(tensors)
        WatchedBucket.carried.update({name: t.detach().clone() for name, t in tensors})


def own_segments() -> list[str]:
    return glob.glob(os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}{os.getpid()}_*"))


async def server_weights(address: str, key: str, names: list[str], sizes: list[int]) -> dict[str, list[float]]:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as session:
        out = {}
        for name, size in zip(names, sizes):
            params = {"name": name, "truncate_size": str(size)}
            async with session.get(f"http://{address}/get_weights_by_name", params=params) as r:
                assert r.status == 200, await r.text()
                out[name] = await r.json()
        return out


def update_and_check(engine: FSDPEngine, rollout: RemoteSGLangEngine | None, version: int) -> dict:
    meta = WeightUpdateMeta(type="ipc", chunk_bytes=16 * 1024)
    WatchedBucket.carried.clear()
    before = len(WatchedBucket.alive_at_make)
    engine.set_version(version)
    engine.update_weights(meta)
    made = len(WatchedBucket.alive_at_make) - before
    report = check(engine, rollout)
    per_rank: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, made)
    report["buckets_per_rank"] = per_rank
    if rollout is not None:
        carried = WatchedBucket.carried
        address, key = rollout.config.addresses[0], rollout.config.api_key or ""
        served = asyncio.run(server_weights(address, key, list(carried), [t.numel() for t in carried.values()]))
        report["tensors"] = len(carried)
        report["max_weight_err"] = max(
            float((torch.tensor(served[n]) - t.float().flatten()).abs().max()) for n, t in carried.items()
        )
        report["max_alive_at_make"] = max(WatchedBucket.alive_at_make[before:])
        report["leaked"] = own_segments()
    return report


def main() -> None:
    model, address, workdir, key = sys.argv[1:5]
    weight_sync.TensorBucket = WatchedBucket  # type: ignore[misc]
    dist.init_process_group("gloo")
    rollout = None
    if dist.get_rank() == 0:
        config = InferenceEngineConfig(addresses=[address], api_key=key, request_timeout=120, setup_timeout=120)
        rollout = RemoteSGLangEngine(config)
        rollout.initialize()
    engine = FSDPEngine(TrainEngineConfig(path=model, optimizer=OptimizerConfig(lr=1e-2)))
    engine.initialize(FinetuneSpec(total_train_epochs=1, dataset_size=16, train_batch_size=4))
    engine.connect_engine(rollout, WeightUpdateMeta(type="ipc"))  # type: ignore[arg-type]
    report: dict[str, object] = {}
    for version in (1, 2):
        train_step(engine, seed=version)
        report[f"v{version}"] = update_and_check(engine, rollout, version)
    engine.destroy()
    if rollout is not None:
        with open(os.path.join(workdir, "trainer.json"), "w") as f:
            json.dump(report, f)
        rollout.destroy()
    destroy_default_group()


if __name__ == "__main__":
    main()
