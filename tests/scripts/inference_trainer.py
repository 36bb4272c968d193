"""An FSDPEngine trainer (torchrun, gloo) that pushes its weights to rollout servers.

Usage: ``torchrun --nproc-per-node N inference_trainer.py MODEL_DIR ADDR[,ADDR...] WORKDIR sglang|vllm``

It trains one step, sends the weights by disk, and checks that the servers' log-probabilities of
freshly generated tokens equal its own `forward`; then trains again, sends the weights by gloo
broadcast, and checks again. With sglang it then does the same with a LoRA engine, whose updates
carry the adapter alone (a PEFT directory through ``/load_lora_adapter``, then a broadcast of its
tensors) and whose requests name it, and unloads the adapter at the end. Rank 0 writes
``WORKDIR/trainer.json``: per update, the largest log-probability difference and the versions the
tokens carried.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import aiohttp
import torch
import torch.distributed as dist
from tensordict import TensorDict

from areal_lite.api.config import InferenceEngineConfig, LoRAConfig, OptimizerConfig, TrainEngineConfig
from areal_lite.api.engine import PackedBatch
from areal_lite.api.io import FinetuneSpec, GenerationConfig, ModelRequest, WeightUpdateMeta
from areal_lite.engines.remote.client import RemoteEngine
from areal_lite.engines.remote.sglang import RemoteSGLangEngine
from areal_lite.engines.remote.vllm import RemoteVLLMEngine
from areal_lite.engines.train.fsdp import FSDPEngine
from areal_lite.utils.distributed import destroy_default_group

CLIENTS = {"sglang": RemoteSGLangEngine, "vllm": RemoteVLLMEngine}


def nll(out: torch.Tensor, ent: torch.Tensor, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    m = mb["loss_mask"].float()  # type: ignore[union-attr]
    return -(out * m).sum() / m.sum(), {}


def train_step(engine: FSDPEngine, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 200, (4, 16), generator=g)
    batch = TensorDict(
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids, dtype=torch.bool),
            "loss_mask": torch.ones_like(ids, dtype=torch.int32),
        },
        batch_size=[4],
    )
    share = batch[dist.get_rank() :: dist.get_world_size()]
    engine.train_batch(share, nll, lambda mb: float(mb["loss_mask"].sum()))  # type: ignore[union-attr]


def generate(rollout: RemoteEngine | None) -> list[tuple[list[int], list[int], list[float], list[int]]]:
    """Rank 0 generates 8 samples through the servers; every rank gets them."""
    out: list[object] = [None]
    if rollout is not None:
        gconfig = GenerationConfig(max_new_tokens=12, ignore_eos=True)

        async def run():
            reqs = [ModelRequest(input_ids=[5 + i, 17, 30 + 2 * i], gconfig=gconfig) for i in range(8)]
            return await asyncio.gather(*[rollout.agenerate(r) for r in reqs])

        out[0] = [(r.input_tokens, r.output_tokens, r.output_logprobs, r.output_versions) for r in asyncio.run(run())]
    dist.broadcast_object_list(out, src=0)
    return out[0]  # type: ignore[return-value]


def check(engine: FSDPEngine, rollout: RemoteEngine | None) -> dict[str, object]:
    samples = generate(rollout)
    width = max(len(p) + len(o) for p, o, _, _ in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.bool)
    for i, (p, o, _, _) in enumerate(samples):
        ids[i, : len(p) + len(o)] = torch.tensor(p + o)
        mask[i, : len(p) + len(o)] = True
    logp = engine.forward(TensorDict({"input_ids": ids, "attention_mask": mask}, batch_size=[len(samples)]))
    err = 0.0
    for i, (p, o, lps, _) in enumerate(samples):
        err = max(err, float((logp[i, len(p) : len(p) + len(o)] - torch.tensor(lps)).abs().max()))
    return {"max_err": err, "versions": sorted({v for *_, vs in samples for v in vs})}


def main() -> None:
    model, addresses, workdir, client = sys.argv[1], sys.argv[2].split(","), sys.argv[3], CLIENTS[sys.argv[4]]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rollout = None
    if rank == 0:
        rollout = client(InferenceEngineConfig(addresses=addresses, request_timeout=120, setup_timeout=120))
        rollout.initialize()
    engine = FSDPEngine(TrainEngineConfig(path=model, optimizer=OptimizerConfig(lr=1e-2)))
    engine.initialize(FinetuneSpec(total_train_epochs=1, dataset_size=16, train_batch_size=4))
    dist_meta = WeightUpdateMeta(type="distributed", backend="gloo", chunk_bytes=64 * 1024)
    engine.connect_engine(rollout, dist_meta)  # type: ignore[arg-type]
    report: dict[str, object] = {"before": check(engine, rollout)}

    train_step(engine, seed=1)
    engine.set_version(1)
    engine.update_weights(WeightUpdateMeta(type="disk", path=os.path.join(workdir, "v1")))
    report["disk"] = check(engine, rollout)

    train_step(engine, seed=2)
    engine.set_version(2)
    engine.update_weights(dist_meta)
    report["broadcast"] = check(engine, rollout)

    engine.destroy()
    if client is RemoteSGLangEngine:
        report.update(check_lora(rollout, model, addresses, workdir))
    if rollout is not None:
        with open(os.path.join(workdir, "trainer.json"), "w") as f:
            json.dump(report, f)
        rollout.destroy()
    destroy_default_group()


def check_lora(full_rollout: RemoteEngine | None, model: str, addresses: list[str], workdir: str) -> dict[str, object]:
    """The servers back on the base weights, then a LoRA engine: its adapter sent at connect, after
    a step through disk, after another by broadcast; then the servers unload it."""
    rollout = None
    if full_rollout is not None:
        full_rollout.update_weights(WeightUpdateMeta(type="disk", path=model, version=0)).result()
        rollout = RemoteSGLangEngine(
            InferenceEngineConfig(addresses=addresses, request_timeout=120), adapter_name="policy"
        )
        rollout.initialize()
    lora = LoRAConfig(rank=4, alpha=16.0)
    engine = FSDPEngine(TrainEngineConfig(path=model, optimizer=OptimizerConfig(lr=1e-2), lora=lora))
    engine.initialize(FinetuneSpec(total_train_epochs=1, dataset_size=16, train_batch_size=4))
    disk_meta = WeightUpdateMeta(type="disk", path=os.path.join(workdir, "adapter"))
    engine.connect_engine(rollout, disk_meta)  # type: ignore[arg-type]
    report: dict[str, object] = {"lora_connect": check(engine, rollout)}
    train_step(engine, seed=3)
    engine.set_version(3)
    engine.update_weights(disk_meta)
    report["lora_disk"] = check(engine, rollout)
    dist_meta = WeightUpdateMeta(type="distributed", backend="gloo", group_name="lora_group", chunk_bytes=16 * 1024)
    engine.connect_engine(rollout, dist_meta)  # type: ignore[arg-type]
    train_step(engine, seed=4)
    engine.set_version(4)
    engine.update_weights(dist_meta)
    report["lora_broadcast"] = check(engine, rollout)
    if rollout is not None:
        asyncio.run(unload_adapter(addresses))
        rollout.destroy()
    engine.destroy()
    return report


async def unload_adapter(addresses: list[str]) -> None:
    async with aiohttp.ClientSession() as session:
        for address in addresses:
            async with session.post(f"http://{address}/unload_lora_adapter", json={"lora_name": "policy"}) as r:
                assert r.status == 200, await r.text()


if __name__ == "__main__":
    main()
