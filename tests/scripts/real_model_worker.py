"""The train engines on SmolLM2-135M-Instruct (a Llama with tied embeddings), under torchrun with 2
gloo ranks, for tests/test_real_model.py.

Usage: ``torchrun --nproc-per-node 2 real_model_worker.py MODEL_DIR BATCH.pt OUT_DIR``.

One after the other, each forwards the batch of ``BATCH.pt`` (the data contract's padded layout)
and rank 0 saves the per-token log-probabilities to ``OUT_DIR/<run>.pt``: FSDP (2 data-parallel
ranks) in float32 and in bfloat16 (what ``actor.dtype=auto`` picks on a CPU with AVX-512 BF16), and
Megatron on 2 data-parallel ranks (its 3 key-value heads rule out tensor parallelism 2), whose
embedding also serves as the output layer after our HF -> Megatron conversion and whose weights
saved back to HF must be the model's own (``OUT_DIR/megatron_roundtrip.json``).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from areal_lite.api.config import TrainEngineConfig
from areal_lite.api.io import SaveLoadMeta
from areal_lite.kit import make_train_engine
from areal_lite.utils.distributed import destroy_default_group

MODEL, BATCH, OUT = sys.argv[1:4]


def forward(name: str, config: TrainEngineConfig) -> None:
    engine = make_train_engine(config)
    engine.initialize(None)
    batch = torch.load(BATCH, weights_only=False)
    logp = engine.forward(batch)
    if name == "megatron":
        engine.save(SaveLoadMeta(path=os.path.join(OUT, "megatron_hf"), weight_format="hf"))
    if dist.get_rank() == 0:
        torch.save(logp.float(), os.path.join(OUT, f"{name}.pt"))
    engine.destroy()


def main() -> None:
    # One process group for the three engines: an engine that created the group would destroy it.
    dist.init_process_group("gloo")
    forward("fsdp_fp32", TrainEngineConfig(path=MODEL, backend="fsdp", dtype="float32"))
    forward("fsdp_bf16", TrainEngineConfig(path=MODEL, backend="fsdp", dtype="bfloat16"))
    forward("megatron", TrainEngineConfig(path=MODEL, backend="megatron"))
    if int(os.environ["RANK"]) == 0:
        original = load_file(os.path.join(MODEL, "model.safetensors"))
        saved = load_file(os.path.join(OUT, "megatron_hf", "model.safetensors"))
        diff = {k: float((original[k] - saved[k]).abs().max()) for k in original if k in saved}
        with open(os.path.join(OUT, "megatron_roundtrip.json"), "w") as f:
            json.dump({"missing": sorted(set(original) - set(saved)), "extra": sorted(set(saved) - set(original)),
                       "max_diff": max(diff.values())}, f)  # fmt: skip
    destroy_default_group()


if __name__ == "__main__":
    main()
