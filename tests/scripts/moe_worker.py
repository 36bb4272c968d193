"""FSDPEngine on a mixture-of-experts model, under torchrun (1 or 2 gloo ranks): tests/test_moe.py.

Usage: ``torchrun --nproc-per-node N moe_worker.py MODEL_DIR OUT_DIR``; rank 0 writes
``OUT_DIR/moe_w<N>.json``.

- ``replay_*``: with ``routing_replay`` and recorded routes (random experts, -1 on some tokens),
  the engine's log-probabilities equal a plain HF forward of each sequence whose routers replay the
  same routes (also with shared prefixes), and one SGD step (2 micro-batches) moves every parameter,
  the routers' included, as that plain model's step on the whole batch does.
- ``update_*``: weight updates in process, through disk and by broadcast reach an embedded engine;
  after each, the engine's log-probabilities of fresh samples equal the trainer's forward. Disk
  files and broadcast announcements name the experts one tensor each (the checkpoint layout).
- ``lora_*``: LoRA with ``all-linear`` (attention, the experts' 3-D weights and the routers, as
  peft adapts them) trains the adapters alone; its three kinds of updates reach the engine alike,
  and an HF save's merged model gives the adapted model's logits.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from engine_checks import group_batch, make_batch, n_tokens, nll
from lora_checks import RecordingEngine, samples_and_errors
from peft import PeftModel
from safetensors import safe_open
from tensordict import TensorDict
from transformers import AutoModelForCausalLM

from areal_lite.api.config import LocalEngineConfig, LoRAConfig, OptimizerConfig, TrainEngineConfig
from areal_lite.api.io import FinetuneSpec, MicroBatchSpec, SaveLoadMeta, WeightUpdateMeta
from areal_lite.engines.train.fsdp import FSDPEngine
from areal_lite.utils.moe import NO_EXPERT, RoutingReplay, routing_shape

FT = FinetuneSpec(total_train_epochs=1, dataset_size=80, train_batch_size=8)


def with_routes(batch: TensorDict, shape: tuple[int, int], num_experts: int, seed: int) -> TensorDict:
    """``batch`` with random recorded routes (distinct experts per token and layer; the same for
    the same prefix, as generation records them for a shared prompt), -1 on each sequence's last
    token and on padding."""
    b, length = batch["input_ids"].shape
    routes = torch.full((b, length, *shape), NO_EXPERT, dtype=torch.int32)
    lens = batch["attention_mask"].sum(dim=1).tolist()
    for i in range(b):
        for t in range(lens[i] - 1):
            g = torch.Generator().manual_seed(hash((seed, *batch["input_ids"][i, : t + 1].tolist())) % 2**31)
            routes[i, t] = torch.stack([torch.randperm(num_experts, generator=g)[: shape[1]] for _ in range(shape[0])])
    batch["routed_experts"] = routes
    return batch


def reference_logp(model: torch.nn.Module, replay: RoutingReplay, batch: TensorDict) -> torch.Tensor:
    """[B, L] log-probabilities of a plain HF forward per sequence, its routers replaying the
    batch's routes (0 at position 0 and on padding), with gradient."""
    out = torch.zeros(batch["input_ids"].shape)
    for i, n in enumerate(batch["attention_mask"].sum(dim=1).tolist()):
        replay.begin(batch["routed_experts"][i, :n], replay=True)
        ids = batch["input_ids"][i : i + 1, :n]
        logp = torch.log_softmax(model(ids, use_cache=False).logits.float(), dim=-1)[0, :-1]
        out = out.index_put((torch.tensor([i]), torch.arange(1, n)), logp.gather(1, ids[0, 1:, None])[:, 0])
    return out


def engine(model: str, replay: bool = False, lora: bool = False, **kw: object) -> FSDPEngine:
    cfg = TrainEngineConfig(
        path=model,
        optimizer=OptimizerConfig(lr=1e-2),
        logits_chunk_size=7,
        routing_replay=replay,
        lora=LoRAConfig(rank=4, alpha=8.0) if lora else LoRAConfig(),
        **kw,  # type: ignore[arg-type]
    )
    e = FSDPEngine(cfg)
    e.initialize(FT)
    return e


def check_replay(res: dict[str, object], model: str) -> None:
    rank0, share = dist.get_rank() == 0, slice(dist.get_rank(), None, dist.get_world_size())
    hf = AutoModelForCausalLM.from_pretrained(model)
    shape, n_exp = routing_shape(hf.config), hf.config.num_experts
    assert shape is not None
    ref_replay = RoutingReplay(hf)
    for name, batch, tree in (("packed", make_batch(3), False), ("tree", group_batch(4), True)):
        batch = with_routes(batch, shape, n_exp, seed=5)
        e = engine(model, replay=True, shared_prefix=tree)
        logp = e.forward(batch)
        e.destroy()
        if rank0:
            with torch.no_grad():
                ref = reference_logp(hf, ref_replay, batch)
            res[f"replay_logp_{name}"] = float((logp - ref).abs().max())

    batch = with_routes(make_batch(6), shape, n_exp, seed=7)
    e = engine(model, replay=True, mb_spec=MicroBatchSpec(n_mbs=2))
    e.optimizer = torch.optim.SGD(e.model.parameters(), lr=0.5)
    stats = e.forward_backward(batch[share], nll, n_tokens)
    e.optim_step(max_grad_norm=0.0)
    res["replay_stats"] = {k: v for k, v in stats.items() if k.startswith("moe/")}
    trained = dict(e._hf_tensors(cast=False))
    e.destroy()
    if rank0:
        mask = batch["loss_mask"].float()
        loss = -(reference_logp(hf, ref_replay, batch) * mask).sum() / mask.sum()
        loss.backward()
        with torch.no_grad():
            stepped = {n: p - 0.5 * p.grad if p.grad is not None else p for n, p in hf.named_parameters()}
        res["replay_sgd_vs_reference"] = max(float((trained[n] - stepped[n]).abs().max()) for n in stepped)
        router = "model.layers.0.mlp.gate.weight"
        res["replay_router_moved"] = float((trained[router] - hf.state_dict()[router]).abs().max())


def check_updates(res: dict[str, object], model: str, out: str, lora: bool) -> None:
    rank0, share = dist.get_rank() == 0, slice(dist.get_rank(), None, dist.get_world_size())
    tag = "lora" if lora else "update"
    e = engine(model, lora=lora)
    if lora:
        named = dict(e.model.named_parameters())
        res["lora_trainable"] = sorted({n.split(".")[-4] for n, p in named.items() if p.requires_grad})
    receiver = RecordingEngine(LocalEngineConfig(path=model)) if rank0 else None
    if receiver is not None:
        receiver.initialize()
    dist_meta = WeightUpdateMeta(type="distributed", chunk_bytes=20000)  # experts split across chunks
    e.connect_engine(receiver, dist_meta)  # type: ignore[arg-type]
    kinds = [WeightUpdateMeta(type="in_process"), WeightUpdateMeta(type="disk", path=f"{out}/{tag}_push"), dist_meta]
    for i, meta in enumerate(kinds):
        e.train_batch(make_batch(50 + i)[share], nll, n_tokens)
        e.set_version(i + 1)
        e.update_weights(meta)
        err, versions = samples_and_errors(e, receiver)
        res[f"{tag}_{meta.type}"] = {"err": err, "versions": versions}
    if receiver is not None:
        res[f"{tag}_received"] = receiver.received
        receiver.destroy()
        if not lora:
            with safe_open(f"{out}/{tag}_push/model.safetensors", "pt") as f:
                res["update_disk_keys"] = sorted(f.keys())
    if lora:
        hf_dir = f"{out}/lora_hf"
        e.save(SaveLoadMeta(path=hf_dir, weight_format="hf"))
        if rank0:
            batch = make_batch(60)
            am = batch["attention_mask"].long()
            merged = AutoModelForCausalLM.from_pretrained(hf_dir)
            adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), f"{hf_dir}/adapter")
            with torch.no_grad():
                a = merged(input_ids=batch["input_ids"], attention_mask=am).logits
                b = adapted(input_ids=batch["input_ids"], attention_mask=am).logits
            res["lora_merged_vs_peft_logits"] = float((a - b)[am.bool()].abs().max())
    e.destroy()


def main() -> None:
    model, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    res: dict[str, object] = {}
    check_replay(res, model)
    check_updates(res, model, out, lora=False)
    check_updates(res, model, out, lora=True)
    if dist.get_rank() == 0:
        with open(os.path.join(out, f"moe_w{dist.get_world_size()}.json"), "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
