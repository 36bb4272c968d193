"""Run under torchrun by test_cuda_paths.py: ``train MODEL`` (FSDP on NCCL in bf16) or
``nccl_update MODEL`` (one trainer rank broadcasting into an embedded engine on GPU 1)."""

from __future__ import annotations

import asyncio
import sys

import torch
import torch.distributed as dist
from tensordict import TensorDict

from areal_lite.api.config import LocalEngineConfig, OptimizerConfig, TrainEngineConfig
from areal_lite.api.engine import PackedBatch
from areal_lite.api.io import FinetuneSpec, MicroBatchSpec, WeightUpdateMeta
from areal_lite.engines.local.engine import LocalInferenceEngine
from areal_lite.engines.local.request import SamplingParams
from areal_lite.engines.train.fsdp import FSDPEngine


def nll(logp: torch.Tensor, ent: torch.Tensor, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    m = mb["loss_mask"].float()  # type: ignore[union-attr]
    return -(logp * m).sum() / m.sum(), {}


def n_tokens(mb: PackedBatch) -> float:
    return float(mb["loss_mask"].sum())  # type: ignore[union-attr]


def batch(vocab: int) -> TensorDict:
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([5, 17, 9, 30, 12, 24, 8, 16])
    am = torch.arange(int(lens.max()))[None] < lens[:, None]
    ids = torch.randint(3, vocab, am.shape, generator=g) * am
    return TensorDict({"input_ids": ids, "attention_mask": am, "loss_mask": am.int()}, batch_size=[len(lens)])


def engine(path: str, dtype: str = "bfloat16") -> FSDPEngine:
    cfg = TrainEngineConfig(path=path, dtype=dtype, optimizer=OptimizerConfig(lr=1e-3), mb_spec=MicroBatchSpec(n_mbs=2))
    e = FSDPEngine(cfg)
    e.initialize(FinetuneSpec(total_train_epochs=1, dataset_size=64, train_batch_size=8))
    return e


def train(path: str) -> None:
    from transformers import AutoModelForCausalLM

    e = engine(path)
    assert e.device.type == "cuda", e.device
    # One group for both devices: gloo for CPU tensors, NCCL for CUDA ones ("cpu:gloo,cuda:nccl").
    assert "cuda:nccl" in dist.get_backend(), dist.get_backend()
    assert e.compute_dtype == torch.bfloat16, e.compute_dtype
    data = batch(e.model.hf.config.vocab_size)  # type: ignore[union-attr]
    logp = e.forward(data)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    ids, am = data["input_ids"], data["attention_mask"]
    with torch.no_grad():
        out = hf(input_ids=ids.cuda(), attention_mask=am.long().cuda()).logits.float().log_softmax(-1)
    expected = torch.zeros_like(logp)
    expected[:, 1:] = out[:, :-1].gather(-1, ids[:, 1:, None].cuda())[..., 0].cpu()
    mask = am.clone()
    mask[:, 0] = False
    torch.testing.assert_close(logp[mask], expected[mask], atol=0.1, rtol=0.05)  # bf16 on both sides
    # FSDP2 keeps the root module's parameters (embeddings, final norm, head) unsharded after a
    # forward without backward; resharding makes every parameter a DTensor again.
    e.model.reshard()  # type: ignore[union-attr]
    before = {n: p.full_tensor().clone() for n, p in e.model.named_parameters()}  # type: ignore[union-attr]
    losses = [e.train_batch(data, nll, n_tokens)["loss"] for _ in range(8)]
    assert losses[-1] < losses[0], losses
    e.model.reshard()  # type: ignore[union-attr]
    for n, p in e.model.named_parameters():  # type: ignore[union-attr]
        assert not torch.equal(p.full_tensor(), before[n]), f"{n} did not change"
    rank = dist.get_rank()
    e.destroy()  # destroys the default group, which the engine created
    if rank == 0:
        print("TRAIN OK", losses[0], losses[-1])


def nccl_update(path: str) -> None:
    torch.cuda.set_device(0)
    trainer = engine(path, dtype="float32")
    inference = LocalInferenceEngine(LocalEngineConfig(path=path, device="cuda:1"))
    inference.initialize()
    meta = WeightUpdateMeta(type="distributed", backend="nccl", master_port=0)
    trainer.connect_engine(inference, meta)
    data = batch(trainer.model.hf.config.vocab_size)  # type: ignore[union-attr]
    for _ in range(3):
        trainer.train_batch(data, nll, n_tokens)
    trainer.set_version(1)
    trainer.update_weights(meta)
    assert inference.get_version() == 1
    prompt = [5, 6, 7, 8]

    async def one() -> list[float]:
        r = await inference.scheduler.generate(prompt, SamplingParams(max_new_tokens=6, ignore_eos=True))
        return [r.output_ids, r.output_logprobs]  # type: ignore[list-item]

    out_ids, out_lp = asyncio.run(one())
    ids = torch.tensor([prompt + out_ids], device="cuda:0")
    trainer.model.eval()  # type: ignore[union-attr]
    expected = trainer.forward(
        TensorDict({"input_ids": ids.cpu(), "attention_mask": torch.ones_like(ids.cpu()).bool()}, batch_size=[1])
    )[0, len(prompt) :]
    torch.testing.assert_close(torch.tensor(out_lp), expected.float(), atol=2e-3, rtol=0)
    inference.destroy()
    trainer.destroy()
    print("UPDATE OK")


if __name__ == "__main__":
    {"train": train, "nccl_update": nccl_update}[sys.argv[1]](sys.argv[2])
