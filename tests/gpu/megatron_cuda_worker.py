"""Run under torchrun (one process) by test_cuda_paths.py: `MegatronEngine` on one GPU in bf16
against `FSDPEngine` on the same model and batch, then a few `train_batch` steps of Megatron.

Prints ``MEGATRON CUDA OK <largest log-prob difference> <first loss> <last loss>``."""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
from fsdp_nccl_worker import batch, n_tokens, nll
from transformers import AutoModelForCausalLM

from areal_lite.api.config import OptimizerConfig, TrainEngineConfig
from areal_lite.api.io import FinetuneSpec, MicroBatchSpec, SaveLoadMeta
from areal_lite.kit import make_train_engine

FT = FinetuneSpec(total_train_epochs=1, dataset_size=64, train_batch_size=8)


def engine(path: str, backend: str) -> object:
    cfg = TrainEngineConfig(
        path=path,
        backend=backend,
        dtype="bfloat16",
        optimizer=OptimizerConfig(lr=1e-3),
        mb_spec=MicroBatchSpec(n_mbs=2),
    )
    e = make_train_engine(cfg)
    e.initialize(FT)
    return e


def main(path: str) -> None:
    fsdp = engine(path, "fsdp")
    data = batch(AutoModelForCausalLM.from_pretrained(path).config.vocab_size)
    expected = fsdp.forward(data)
    fsdp.destroy()

    mcore = engine(path, "megatron")
    assert mcore.device.type == "cuda", mcore.device
    got = mcore.forward(data)
    mask = data["attention_mask"].clone()
    mask[:, 0] = False
    diff = float((got[mask] - expected[mask]).abs().max())
    # Two bf16 implementations of one model (fused or not, another summation order): close, not equal.
    torch.testing.assert_close(got[mask], expected[mask], atol=0.1, rtol=0.05)
    losses = [mcore.train_batch(data, nll, n_tokens)["loss"] for _ in range(6)]
    assert losses[-1] < losses[0], losses
    out = tempfile.mkdtemp()
    mcore.save(SaveLoadMeta(path=os.path.join(out, "hf")))
    before = AutoModelForCausalLM.from_pretrained(path).state_dict()
    after = AutoModelForCausalLM.from_pretrained(os.path.join(out, "hf")).state_dict()
    unchanged = [n for n in before if torch.equal(before[n], after[n])]
    assert not unchanged, f"not trained: {unchanged}"
    rank = dist.get_rank()
    mcore.destroy()
    if rank == 0:
        print("MEGATRON CUDA OK", diff, losses[0], losses[-1])


if __name__ == "__main__":
    main(sys.argv[1])
