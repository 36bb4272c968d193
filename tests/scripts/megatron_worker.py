"""MegatronEngine against FSDPEngine on one tiny model and batch, under torchrun with 2 gloo ranks.

Usage: ``torchrun --nproc-per-node 2 megatron_worker.py MODEL_DIR OUT_DIR``.

The same process runs, one after the other: FSDPEngine (2 data-parallel ranks, 1 micro-batch),
MegatronEngine with TP=2 (2 micro-batches), MegatronEngine with TP=1 x DP=2 (a token budget
and activation recomputation) and MegatronEngine with PP=2 (3 micro-batches through the 1F1B
schedule). Each forwards the whole batch, takes one `train_batch` on its
data-parallel share and saves HF weights; rank 0 writes ``OUT_DIR/<run>.pt`` (log-probs,
entropies, stats) and ``OUT_DIR/<run>_hf`` for tests/test_megatron.py to compare. The TP=2 run
also sends weights of all three kinds to a receiver, skips a non-finite step, and resumes from a
``train_state`` checkpoint; a tied Llama at TP=2 and PP=2 saves what it trained (results in
``OUT_DIR/checks.json``). Critics (value heads) run through FSDP, TP=2 and PP=2
(``OUT_DIR/critic_<run>.pt`` and ``_hf``). At DP=2, TP=2 and PP=2 (plain SGD), forward_backward
on three batches then one optim_step equals one train_batch on their union, and optim_step's
explicit lr, weight_decay and max_grad_norm are the ones used, and forward_backward_logprobs
returns forward's log-probabilities (``OUT_DIR/checks.json``).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

import torch
import torch.distributed as dist
from engine_checks import WeightReceiver, make_batch, n_tokens, nll, scaled
from tensordict import TensorDict
from transformers import AutoConfig, AutoModelForCausalLM

from areal_lite.api.config import OptimizerConfig, TrainEngineConfig
from areal_lite.api.engine import PackedBatch, TrainEngine
from areal_lite.api.io import FinetuneSpec, MicroBatchSpec, SaveLoadMeta, WeightUpdateMeta
from areal_lite.kit import make_train_engine
from areal_lite.utils.distributed import destroy_default_group

MODEL, OUT = sys.argv[1], sys.argv[2]
FT = FinetuneSpec(total_train_epochs=1, dataset_size=80, train_batch_size=8)


def nan_loss(out: torch.Tensor, ent: torch.Tensor, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return out.sum() * float("nan"), {}


def config(backend: str, **kw: object) -> TrainEngineConfig:
    # eps=1 makes Adam's first step lr * g / (|g| + 1), continuous in the gradient: float noise
    # from a different reduction order cannot flip the sign of an update; lr=1
    # makes the updates large enough (~1e-2) for a 1e-5 comparison to mean something.
    opt = OptimizerConfig(lr=1.0, eps=1.0, weight_decay=0.01, lr_scheduler_type="cosine", warmup_steps_proportion=0.2)
    return TrainEngineConfig(path=MODEL, backend=backend, optimizer=opt, logits_chunk_size=7, **kw)  # type: ignore[arg-type]


def my_share(batch: TensorDict, e: TrainEngine) -> TensorDict:
    return batch[e.data_parallel_rank :: e.data_parallel_world_size]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def hf_params(path: str) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def weight_updates(e: TrainEngine, checks: dict[str, object]) -> None:
    """All three kinds of update to a fresh receiver each; it must end up with the saved weights."""
    rank = dist.get_rank()
    saved = hf_params(os.path.join(OUT, "mcore_tp2_hf")) if rank == 0 else {}
    metas = [
        WeightUpdateMeta(type="in_process"),
        WeightUpdateMeta(type="disk", path=os.path.join(OUT, "update_disk")),
        WeightUpdateMeta(type="distributed", chunk_bytes=20_000),
    ]
    for meta in metas:
        receiver = WeightReceiver(MODEL) if rank == 0 else None
        e.connect_engine(receiver, meta)  # type: ignore[arg-type]
        e.update_weights(meta)
        if receiver is not None:
            checks[f"update_{meta.type}_err"] = max_diff(receiver.params(), saved)
            if meta.type == "in_process":
                checks["update_names_match"] = receiver.names == {n for n, _ in receiver.model.named_parameters()}
            receiver.pool.shutdown()


def resume(e: TrainEngine, cfg: TrainEngineConfig, checks: dict[str, object]) -> None:
    """train_state save after step 1; step 2 here and in a fresh engine loaded from it must agree."""
    ckpt = os.path.join(OUT, "tp2_train_state")
    e.save(SaveLoadMeta(path=ckpt, weight_format="train_state"))
    batch = make_batch(2)
    e.step_lr_scheduler()
    stats = e.train_batch(my_share(batch, e), nll, n_tokens)
    e.save(SaveLoadMeta(path=os.path.join(OUT, "tp2_step2_hf")))
    fresh = make_train_engine(cfg)
    fresh.initialize(FT)
    fresh.load(SaveLoadMeta(path=ckpt, weight_format="train_state"))
    fresh.step_lr_scheduler()
    stats_resumed = fresh.train_batch(my_share(batch, fresh), nll, n_tokens)
    fresh.save(SaveLoadMeta(path=os.path.join(OUT, "tp2_resumed_hf")))
    checks["resume_stats"] = [stats, stats_resumed]
    fresh.destroy()  # `e` created megatron's model-parallel state and tears it down


def padded_logprobs(model: torch.nn.Module, batch: TensorDict) -> torch.Tensor:
    """Token-aligned log-probabilities from HF's own padded-batch forward."""
    ids, am = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=am.long()).logits.float()
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(ids.shape[0], 1), lp], 1) * am


def tied_embeddings(checks: dict[str, object]) -> None:
    """A tied Llama (with Llama 3.x rope scaling) at TP=2 and at PP=2, where the last stage holds a
    synced copy of the embedding: before and after one step, the engine must reproduce HF's
    log-probabilities of the initial and of the saved model."""
    from areal_lite.utils.tiny import build_tiny_model

    path = os.path.join(OUT, "tied_model")
    if dist.get_rank() == 0:
        build_tiny_model(path, arch="llama", hidden_size=32, num_layers=2, vocab_size=301, tie_word_embeddings=True)
        # Llama 3.x rope scaling; with head_dim 8 the lowest frequencies are the scaled ones
        hf_config = AutoConfig.from_pretrained(path)
        hf_config.rope_parameters = {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        }  # fmt: skip
        hf_config.save_pretrained(path)
    dist.barrier()
    batch = make_batch(3)
    for tag, kw in (("tp2", {"tensor_parallel_size": 2}), ("pp2", {"pipeline_parallel_size": 2})):
        cfg = replace(config("megatron", **kw), path=path)
        e = make_train_engine(cfg)
        e.initialize(FT)
        before = e.forward(batch)
        e.train_batch(my_share(batch, e), nll, n_tokens)
        after = e.forward(batch)
        saved = os.path.join(OUT, f"tied_{tag}_hf")
        e.save(SaveLoadMeta(path=saved))
        e.destroy()
        if dist.get_rank() == 0:
            checks[f"tied_{tag}_initial_err"] = float(
                (before - padded_logprobs(AutoModelForCausalLM.from_pretrained(path), batch)).abs().max()
            )
            checks[f"tied_{tag}_saved_err"] = float(
                (after - padded_logprobs(AutoModelForCausalLM.from_pretrained(saved), batch)).abs().max()
            )
            checks[f"tied_{tag}_moved"] = float((after - before).abs().max())


def value_loss(out: torch.Tensor, ent: torch.Tensor, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    m = mb["loss_mask"].float()  # type: ignore[union-attr]
    return (((out - 0.5) ** 2) * m).sum() / m.sum(), {}


def critics(full: TensorDict) -> None:
    """A critic (new value head on a causal-LM directory) through FSDP, Megatron TP=2 and PP=2:
    rank 0 writes values before and after one step, and the saved HF weights."""
    for tag, kw in (("fsdp", {}), ("tp2", {"tensor_parallel_size": 2}), ("pp2", {"pipeline_parallel_size": 2})):
        e = make_train_engine(config("fsdp" if tag == "fsdp" else "megatron", is_critic=True, **kw))
        e.initialize(FT)
        before = e.forward(full)
        stats = e.train_batch(my_share(full, e), value_loss, n_tokens)
        after = e.forward(full)
        e.save(SaveLoadMeta(path=os.path.join(OUT, f"critic_{tag}_hf")))
        e.destroy()
        if dist.get_rank() == 0:
            torch.save({"before": before, "after": after, "stats": stats}, os.path.join(OUT, f"critic_{tag}.pt"))


def sgd_engine(cfg: TrainEngineConfig) -> TrainEngine:
    """An initialised engine whose distributed optimizer steps with SGD (decoupled weight decay,
    the parameter groups' LR) instead of Adam: the update is linear in the gradient, so parameter
    equality to 1e-6 is gradient equality. The Adam inside megatron's wrapper keeps its parameter
    groups (shards that are views into megatron's buffers, which a new torch optimizer refuses)
    and gets this step."""
    e = make_train_engine(cfg)
    e.initialize(FT)
    for sub in getattr(e.optimizer, "chained_optimizers", [e.optimizer]):
        inner = sub.optimizer

        @torch.no_grad()
        def sgd_step(closure: object = None, groups: list[dict] = inner.param_groups) -> None:
            for group in groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.mul_(1 - group["lr"] * group["weight_decay"]).add_(p.grad, alpha=-group["lr"])

        inner.step = sgd_step
    return e


def full_params(e: TrainEngine) -> dict[str, torch.Tensor]:
    return {name: t.cpu() for name, t in e._hf_tensors()}  # type: ignore[attr-defined]


def accumulation(checks: dict[str, object]) -> None:
    """Three forward_backward calls (each loss scaled by its batch's share of the union's loss
    weight) then one optim_step, against one train_batch on the union, at DP=2 (gradients reduced
    over data-parallel ranks once, in optim_step), TP=2 and PP=2; at DP=2 also optim_step's
    explicit lr, weight_decay and max_grad_norm (SGD moves by lr x the clipped gradient, and with
    zero gradients by the weight decay alone)."""
    parts = [make_batch(20, n=4), make_batch(21, n=6), make_batch(22, n=4)]
    totals = [float(p["loss_mask"].sum()) for p in parts]
    layouts = {
        "dp2": {"mb_spec": MicroBatchSpec(n_mbs=2)},
        "tp2": {"tensor_parallel_size": 2, "mb_spec": MicroBatchSpec(n_mbs=2)},
        "pp2": {"pipeline_parallel_size": 2, "mb_spec": MicroBatchSpec(n_mbs=3)},
    }
    for tag, kw in layouts.items():
        cfg = config("megatron", **kw)
        e = sgd_engine(cfg)
        before = full_params(e)
        union_stats = e.train_batch(my_share(torch.cat(parts), e), nll, n_tokens)
        union = full_params(e)
        e.destroy()
        e = sgd_engine(cfg)
        calls = [
            e.forward_backward(my_share(p, e), scaled(nll, t / sum(totals)), n_tokens) for p, t in zip(parts, totals)
        ]
        step = e.optim_step()
        accumulated = full_params(e)
        checks[f"accum_{tag}"] = {
            "changed": max_diff(before, accumulated),
            "param_err": max_diff(union, accumulated),
            "loss": [sum(c["loss"] for c in calls), union_stats["loss"]],
            "grad_norm": [step["grad_norm"], union_stats["grad_norm"]],
        }
        if tag == "dp2":
            configured_lr = e.optimizer.param_groups[0]["lr"]  # type: ignore[attr-defined]
            e.forward_backward(my_share(parts[0], e), nll, n_tokens)
            before = full_params(e)
            stats = e.optim_step(lr=0.25, weight_decay=0.0, max_grad_norm=0.01)
            after = full_params(e)
            checks["override"] = {
                "stats": stats,
                "step_norm": float(torch.cat([(after[k] - before[k]).flatten() for k in after]).norm()),
                "configured_lr": configured_lr,
                "lr_after": e.optimizer.param_groups[0]["lr"],  # type: ignore[attr-defined]
            }
            # zero gradients: the step is the weight decay alone, which spares 1-D parameters
            e.forward_backward(my_share(parts[0], e), scaled(nll, 0.0), n_tokens)
            e.optim_step(lr=0.1, weight_decay=0.5)
            decayed = {k: v * (1 - 0.1 * 0.5) if v.ndim >= 2 else v for k, v in after.items()}
            checks["override"]["wd_err"] = max_diff(decayed, full_params(e))  # type: ignore[index]
        # forward_backward_logprobs: forward's log-probabilities (at PP=2 from the last stage, on
        # every stage) and forward_backward's loss, from the one pass.
        share = my_share(parts[1], e)
        reference = e.forward(share)
        one_pass, logprobs = e.forward_backward_logprobs(share, nll, n_tokens)
        two_pass = e.forward_backward(share, nll, n_tokens)
        e.optim_step(lr=0.0)
        checks[f"one_pass_{tag}"] = {
            "logprob_err": float((logprobs - reference).abs().max()),
            "loss": [one_pass["loss"], two_pass["loss"]],
        }
        e.destroy()


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    runs = {
        "fsdp": config("fsdp"),
        "mcore_tp2": config("megatron", tensor_parallel_size=2, mb_spec=MicroBatchSpec(n_mbs=2)),
        "mcore_tp1": config("megatron", mb_spec=MicroBatchSpec(max_tokens_per_mb=40), gradient_checkpointing=True),
        "mcore_pp2": config("megatron", pipeline_parallel_size=2, mb_spec=MicroBatchSpec(n_mbs=3)),
    }
    checks: dict[str, object] = {}
    full = make_batch(0)
    for tag, cfg in runs.items():
        e = make_train_engine(cfg)
        e.initialize(FT)
        lp, ent = e.forward(full, with_entropy=True)
        eval_stats = e.eval_batch(my_share(full, e), nll, n_tokens)
        stats = e.train_batch(my_share(full, e), nll, n_tokens)
        lp_after = e.forward(full)
        e.save(SaveLoadMeta(path=os.path.join(OUT, f"{tag}_hf")))
        if rank == 0:
            torch.save(
                {
                    "batch": full.to_dict(),
                    "lp": lp,
                    "ent": ent,
                    "stats": stats,
                    "eval_stats": eval_stats,
                    "lp_after": lp_after,
                    "type": type(e).__name__,
                },
                os.path.join(OUT, f"{tag}.pt"),
            )
        if tag == "mcore_tp2":
            weight_updates(e, checks)
            before = e.forward(full)
            skipped = e.train_batch(my_share(full, e), nan_loss, n_tokens)
            checks["nan_update_successful"] = skipped["update_successful"]
            checks["nan_changed"] = float((e.forward(full) - before).abs().max())
            resume(e, cfg, checks)
        e.destroy()
    tied_embeddings(checks)
    critics(full)
    accumulation(checks)
    frozen = make_train_engine(runs["mcore_tp2"])
    frozen.initialize(None)  # a reference policy: no optimizer, no DDP wrapper
    lp = frozen.forward(full)
    frozen.destroy()
    if rank == 0:
        checks["frozen_lp_err"] = float((lp - torch.load(os.path.join(OUT, "fsdp.pt"))["lp"]).abs().max())
    if rank == 0:
        with open(os.path.join(OUT, "checks.json"), "w") as f:
            json.dump(checks, f)
    destroy_default_group()


if __name__ == "__main__":
    main()
