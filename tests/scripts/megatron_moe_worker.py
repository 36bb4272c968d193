"""MegatronEngine's mixture-of-experts layers against FSDPEngine, under torchrun with 2 gloo ranks.

Usage: ``torchrun --nproc-per-node 2 megatron_moe_worker.py MODEL_DIR OUT_DIR``; rank 0 writes
``OUT_DIR/megatron_moe.json`` for tests/test_moe.py.

On one Qwen3-MoE model and batch: FSDPEngine (2 data-parallel ranks), MegatronEngine with the
experts split over 2 expert-parallel ranks (EP=2; the ranks' micro-batch counts differ under the
token budget, so one runs zero-weight passes), and MegatronEngine with every expert on each rank
(EP=1). Each forwards the batch and takes one AdamW step on its data-parallel share, without and
with routing replay of random recorded routes; log-probabilities and parameters are compared with
FSDP's. The EP=2 engine also saves a HF checkpoint (``from_pretrained`` loads it: the experts one
tensor each) and sends weights of the three kinds to an embedded engine on rank 0.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from engine_checks import make_batch, n_tokens, nll
from lora_checks import RecordingEngine, samples_and_errors
from moe_worker import with_routes
from transformers import AutoConfig, AutoModelForCausalLM

from areal_lite.api.config import LocalEngineConfig, OptimizerConfig, TrainEngineConfig
from areal_lite.api.io import FinetuneSpec, MicroBatchSpec, SaveLoadMeta, WeightUpdateMeta
from areal_lite.kit import make_train_engine
from areal_lite.utils.data import split_microbatches
from areal_lite.utils.hf_layout import CheckpointLayout
from areal_lite.utils.moe import routing_shape

MODEL, OUT = sys.argv[1], sys.argv[2]
FT = FinetuneSpec(total_train_epochs=1, dataset_size=80, train_batch_size=8)


def run(backend: str, ep: int, replay: bool, res: dict[str, object], extra: bool = False) -> dict[str, torch.Tensor]:
    """Forward and one AdamW step; returns the log-probabilities and the HF tensors after the step."""
    share = slice(dist.get_rank(), None, dist.get_world_size())
    # eps=1: Adam's first step is continuous in the gradient, so float noise cannot flip it
    opt = OptimizerConfig(lr=1.0, eps=1.0, gradient_clipping=0.0)
    cfg = TrainEngineConfig(
        path=MODEL, backend=backend, optimizer=opt, routing_replay=replay, expert_parallel_size=ep,
        mb_spec=MicroBatchSpec(max_tokens_per_mb=26), logits_chunk_size=7,
    )  # fmt: skip
    e = make_train_engine(cfg)
    e.initialize(FT)
    config = AutoConfig.from_pretrained(MODEL)
    shape = routing_shape(config)
    assert shape is not None
    batch = make_batch(11, n=12)
    if replay:
        batch = with_routes(batch, shape, config.num_experts, seed=3)
    logp = e.forward(batch)
    e.train_batch(batch[share], nll, n_tokens)
    # the checkpoint layout (FSDP's stacked experts one tensor each), as Megatron gives them
    after = {n: t.cpu() for n, t in CheckpointLayout(config).to_checkpoint(e._hf_tensors())}  # type: ignore[attr-defined]
    if extra:
        hf_dir = f"{OUT}/megatron_moe_hf"
        e.save(SaveLoadMeta(path=hf_dir, weight_format="hf"))
        if dist.get_rank() == 0:
            loaded = AutoModelForCausalLM.from_pretrained(hf_dir).state_dict()
            res["hf_save_loaded_all"] = set(loaded) == set(AutoModelForCausalLM.from_pretrained(MODEL).state_dict())
            runtime = dict(CheckpointLayout(config).to_checkpoint(loaded.items()))
            res["hf_save_vs_tensors"] = max(float((runtime[n] - t).abs().max()) for n, t in after.items())
        receiver = RecordingEngine(LocalEngineConfig(path=MODEL)) if dist.get_rank() == 0 else None
        if receiver is not None:
            receiver.initialize()
        dist_meta = WeightUpdateMeta(type="distributed", chunk_bytes=20000)
        e.connect_engine(receiver, dist_meta)  # type: ignore[arg-type]
        kinds = [WeightUpdateMeta(type="in_process"), WeightUpdateMeta(type="disk", path=f"{OUT}/push"), dist_meta]
        for i, meta in enumerate(kinds):
            e.set_version(i + 1)
            e.update_weights(meta)
            err, versions = samples_and_errors(e, receiver)  # type: ignore[arg-type]
            res[f"update_{meta.type}"] = {"err": err, "versions": versions}
        if receiver is not None:
            receiver.destroy()
    e.destroy()
    return {"logp": logp, **{f"w:{n}": t for n, t in after.items()}}


def gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    return {
        "logp": float((a["logp"] - b["logp"]).abs().max()),
        "params": max(float((a[k] - b[k]).abs().max()) for k in a if k.startswith("w:")),
        "moved": max(float((b[k] - c).abs().max()) for k, c in REF.items()),
    }


def main() -> None:
    global REF
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    start = AutoModelForCausalLM.from_pretrained(MODEL).state_dict().items()
    REF = {f"w:{n}": t for n, t in CheckpointLayout(AutoConfig.from_pretrained(MODEL)).to_checkpoint(start)}
    res: dict[str, object] = {}
    share = make_batch(11, n=12)[dist.get_rank() :: dist.get_world_size()]
    counts: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(counts, len(split_microbatches(share, MicroBatchSpec(max_tokens_per_mb=26)).mbs))
    res["micro_batches_per_rank"] = counts
    for replay in (False, True):
        fsdp = run("fsdp", 1, replay, res)
        for ep in (2, 1):
            mega = run("megatron", ep, replay, res, extra=ep == 2 and not replay)
            res[f"ep{ep}_replay{int(replay)}"] = gap(fsdp, mega)
    if dist.get_rank() == 0:
        with open(os.path.join(OUT, "megatron_moe.json"), "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


REF: dict[str, torch.Tensor] = {}

if __name__ == "__main__":
    main()
