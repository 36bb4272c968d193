"""FSDPEngine checks run in their own processes under torchrun (1 or 2 ranks on gloo).

Usage: ``torchrun --nproc-per-node N fsdp_worker.py CHECKS MODEL_DIR OUT_DIR`` with CHECKS a
comma-separated list of the checks below. Rank 0 writes ``OUT_DIR/<CHECKS>_w<world>.json`` and
``.pt`` parameter files that tests/test_fsdp.py compares across runs.

- ``logprobs``: packed vs HF padded log-probabilities and entropies (also with ranks running
  different numbers of micro-batches); bf16 mixed precision.
- ``invariance``: one train_batch with 1 and 4 micro-batches, with gradient checkpointing, and
  with an uneven split over ranks (SGD, and AdamW); the test compares the parameters across runs.
  Also the engine's (fused) AdamW against torch's per-tensor AdamW on the same gradients.
- ``checkpoint``: HF save -> from_pretrained; weight updates of all three kinds to a fake
  receiver; a non-finite gradient skipping the step; train_state save, then eval_batch and one
  more step (the uninterrupted run).
- ``resume``: (a new process) load ``checkpoint``'s train_state and take the same next step.
- ``sft``: SFT loss over 40 steps on a small fixed text dataset.
- ``critic``: a value model's forward and training.
- ``shared_prefix``: log-probabilities, entropies, values and one SGD update with each group's
  prompt computed once equal those of the ordinary packed forward.
- ``accumulation``: forward_backward on three batches, then one optim_step, against one
  train_batch on their union (SGD); optim_step's one-step lr, weight_decay and max_grad_norm.
- ``one_pass``: forward_backward_logprobs against forward then forward_backward; ``target_ids``;
  Adam's betas and eps for one step.
- ``lora``: LoRA adapters (tests/scripts/lora_checks.py).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from engine_checks import WeightReceiver, group_batch, make_batch, n_tokens, nll, scaled, write_results
from lora_checks import check_lora
from tensordict import TensorDict
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_lite.api.config import OptimizerConfig, TrainEngineConfig
from areal_lite.api.engine import PackedBatch
from areal_lite.api.io import FinetuneSpec, MicroBatchSpec, SaveLoadMeta, WeightUpdateMeta
from areal_lite.engines.train.fsdp import FSDPEngine
from areal_lite.utils.distributed import destroy_default_group

CHECKS, MODEL, OUT = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
FT = FinetuneSpec(total_train_epochs=1, dataset_size=80, train_batch_size=8)


def shard(batch: TensorDict) -> TensorDict:
    """This rank's rows of the global batch."""
    return batch[dist.get_rank() :: dist.get_world_size()]


def uneven_shard(batch: TensorDict | torch.Tensor) -> TensorDict | torch.Tensor:
    """With 2 ranks, 6 rows for rank 0 and 2 for rank 1, so that with 4 micro-batches rank 1 runs
    2 real and 2 padding passes; with 1 rank, the whole batch."""
    if dist.get_world_size() == 1:
        return batch
    return batch[:6] if dist.get_rank() == 0 else batch[6:]


def max_over_ranks(x: float) -> float:
    t = torch.tensor([x])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def engine(n_mbs: int = 1, lr: float = 1e-3, ft: FinetuneSpec | None = FT, **kw: object) -> FSDPEngine:
    opt = OptimizerConfig(lr=lr, weight_decay=0.01, lr_scheduler_type="cosine", warmup_steps_proportion=0.2)
    cfg = TrainEngineConfig(path=MODEL, optimizer=opt, mb_spec=MicroBatchSpec(n_mbs=n_mbs), logits_chunk_size=7, **kw)
    e = FSDPEngine(cfg)
    e.initialize(ft)
    return e


def with_sgd(e: FSDPEngine) -> FSDPEngine:
    """``e`` with plain SGD (lr 1) for its optimizer: the update is linear in the gradient, so
    parameter equality to 1e-6 is gradient equality (Adam's first step divides each gradient by
    its own magnitude, so float noise in a near-zero gradient can move a parameter by ~lr)."""
    e.optimizer = torch.optim.SGD(e.model.parameters(), lr=1.0)
    return e


def hf_padded_logprobs(model: torch.nn.Module, batch: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-aligned log-probabilities and entropies from HF's own padded-batch forward."""
    am = batch["attention_mask"]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=am.long()).logits.float()
    logp = torch.log_softmax(logits, -1)
    lp = logp[:, :-1].gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)[:, :-1]
    zero = torch.zeros(am.shape[0], 1)
    return torch.cat([zero, lp], 1) * am, torch.cat([zero, ent], 1) * am


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def check_logprobs(res: dict[str, object]) -> None:
    """Packed (3 micro-batches, head chunks of 7 tokens) vs HF's padded batch."""
    e = engine(n_mbs=3, ft=None)
    batch = make_batch(0)
    lp, ent = e.forward(batch, with_entropy=True)
    ref_lp, ref_ent = hf_padded_logprobs(AutoModelForCausalLM.from_pretrained(MODEL), batch)
    res["logprob_err"] = float((lp - ref_lp).abs().max())
    res["entropy_err"] = float((ent - ref_ent).abs().max())
    res["logprob_shape"] = list(lp.shape)
    e.config.mb_spec = MicroBatchSpec(n_mbs=4)
    res["logprob_uneven_err"] = max_over_ranks(
        float((e.forward(uneven_shard(batch)) - uneven_shard(ref_lp)).abs().max())
    )
    e.destroy()

    # transformers' own masking of packed rows (position ids restarting, no KV cache).
    e = engine(n_mbs=3, ft=None, attn_impl="eager")
    res["logprob_eager_err"] = float((e.forward(batch) - ref_lp).abs().max())
    e.destroy()

    # bf16 mixed precision: fp32 master weights, bf16 compute, close to the fp32 result.
    e = engine(dtype="bfloat16")
    lp16 = e.forward(batch)
    res["bf16_logprob_err"] = float((lp16 - ref_lp).abs().max())
    res["bf16_stats"] = e.train_batch(shard(batch), nll, n_tokens)
    res["bf16_master_dtypes"] = sorted({str(p.dtype) for p in e.model.parameters()})
    e.destroy()


def check_invariance(res: dict[str, object]) -> None:
    """One train_batch with this rank's share; parameters written for cross-run comparison."""
    batch = make_batch(1)
    runs = [(1, False, shard), (4, False, shard), (1, True, shard), (4, False, uneven_shard)]
    for opt_name in ("sgd", "adamw"):
        for n_mbs, ckpt, share in runs:
            e = engine(n_mbs=n_mbs, lr=1e-3, gradient_checkpointing=ckpt)
            if opt_name == "sgd":
                with_sgd(e)
            before = e._full_state_dict()
            stats = e.train_batch(share(batch), nll, n_tokens)
            after = e._full_state_dict()
            tag = f"{opt_name}_mb{n_mbs}{'_ckpt' if ckpt else ''}{'_uneven' if share is uneven_shard else ''}"
            if dist.get_rank() == 0:
                torch.save(after, os.path.join(OUT, f"params_{tag}_w{dist.get_world_size()}.pt"))
                res[f"changed_{tag}"] = max_diff(before, after)
            res[f"stats_{tag}"] = stats
            e.destroy()
    # The engine's fused AdamW against torch's per-tensor one, on the same gradients.
    e = engine(n_mbs=1, lr=1e-3)
    res["adamw_fused"] = bool(e.optimizer.defaults["fused"])
    groups = [{k: v for k, v in g.items() if k not in ("fused", "foreach")} for g in e.optimizer.param_groups]
    e.optimizer = torch.optim.AdamW(groups, foreach=False)
    e.train_batch(shard(batch), nll, n_tokens)
    after = e._full_state_dict()
    if dist.get_rank() == 0:
        torch.save(after, os.path.join(OUT, f"params_adamw_per_tensor_w{dist.get_world_size()}.pt"))
    e.destroy()


def check_checkpoint_and_updates(res: dict[str, object]) -> None:
    e = engine(lr=1e-2)
    e.train_batch(shard(make_batch(2)), nll, n_tokens)
    e.step_lr_scheduler()
    rank0 = dist.get_rank() == 0
    # HF save -> from_pretrained -> identical logits to a HF model holding the engine's weights.
    hf_dir = os.path.join(OUT, "hf")
    e.save(SaveLoadMeta(path=hf_dir, weight_format="hf", tokenizer=AutoTokenizer.from_pretrained(MODEL)))
    full = e._full_state_dict()
    if rank0:
        loaded = AutoModelForCausalLM.from_pretrained(hf_dir)
        direct = AutoModelForCausalLM.from_pretrained(MODEL)
        direct.load_state_dict(full)
        batch = make_batch(3)
        with torch.no_grad():
            a = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long()).logits
            b = direct(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long()).logits
        res["hf_logits_equal"] = bool(torch.equal(a, b))
        res["hf_tokenizer_saved"] = os.path.exists(os.path.join(hf_dir, "tokenizer.json"))

    # Weight updates: after each kind, the receiver holds exactly the engine's weights.
    receiver = WeightReceiver(MODEL) if rank0 else None
    dist_meta = WeightUpdateMeta(type="distributed", chunk_bytes=20_000)
    e.connect_engine(receiver, dist_meta)  # type: ignore[arg-type]
    for i, meta in enumerate(
        [WeightUpdateMeta(type="in_process"), WeightUpdateMeta(type="disk", path=os.path.join(OUT, "push")), dist_meta]
    ):
        e.train_batch(shard(make_batch(10 + i)), nll, n_tokens)
        e.set_version(i + 1)
        full = e._full_state_dict()
        stale = max_diff(receiver.params(), full) if rank0 else 0.0
        e.update_weights(meta)
        full = e._full_state_dict()
        if rank0:
            res[f"update_{meta.type}_stale_diff"] = stale
            res[f"update_{meta.type}_diff"] = max_diff(receiver.params(), full)
            res[f"update_{meta.type}_version"] = receiver.version
    if rank0:
        res["distributed_chunks"] = receiver.chunks
        receiver.destroy()

    # A non-finite gradient skips the step and leaves the parameters untouched.
    before = e._full_state_dict()

    def nan_loss(out: torch.Tensor, ent: torch.Tensor, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, stats = nll(out, ent, mb)
        return loss * float("nan"), stats

    res["nan_stats"] = e.train_batch(shard(make_batch(4)), nan_loss, n_tokens)
    after = e._full_state_dict()
    if rank0:
        res["nan_param_change"] = max_diff(before, after)

    # Full training state, then the step an uninterrupted run takes next.
    e.set_version(7)
    e.save(SaveLoadMeta(path=os.path.join(OUT, "train_state"), weight_format="train_state"))
    res["eval_stats"] = e.eval_batch(shard(make_batch(5)), nll, n_tokens)
    res["next_stats"] = e.train_batch(shard(make_batch(5)), nll, n_tokens)
    after = e._full_state_dict()
    if rank0:
        torch.save(after, os.path.join(OUT, f"params_uninterrupted_w{dist.get_world_size()}.pt"))
    e.destroy()


def check_sft(res: dict[str, object]) -> None:
    """SFT on a small fixed text dataset: the token-mean loss over a few dozen steps."""
    tok = AutoTokenizer.from_pretrained(MODEL)
    texts = [
        "The quick brown fox jumps over the lazy dog.",
        "What is 12 + 30? The answer is 42.",
        "Solve step by step: 7 * 6 = 42, then 42 - 2 = 40. #### 40",
        "Reinforcement learning from verifiable rewards trains language models with a grader.",
    ]
    rows = [tok(t)["input_ids"] for t in texts]
    length = max(map(len, rows))
    ids = torch.zeros(len(rows), length, dtype=torch.int64)
    am = torch.zeros(len(rows), length, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        am[i, : len(r)] = True
    batch = TensorDict({"input_ids": ids, "attention_mask": am, "loss_mask": am.int()}, batch_size=[len(rows)])
    e = engine(lr=1e-2, ft=FinetuneSpec(total_train_epochs=40, dataset_size=4, train_batch_size=4))
    losses = []
    for _ in range(40):
        losses.append(e.train_batch(shard(batch), nll, n_tokens)["loss"])
        e.step_lr_scheduler()
    res["sft_losses"] = losses
    e.destroy()


def check_critic(res: dict[str, object]) -> None:
    e = engine(lr=1e-2, is_critic=True)
    batch = shard(make_batch(6))
    values = e.forward(batch)
    res["critic_shape"] = list(values.shape)
    res["critic_pad_zero"] = bool((values[~batch["attention_mask"]] == 0).all())

    def mse(out: torch.Tensor, ent: torch.Tensor, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        m = mb["loss_mask"].float()  # type: ignore[union-attr]
        return ((out - 1.0) ** 2 * m).sum() / m.sum(), {"entropy_abs": ent.abs().sum()}

    losses = [e.train_batch(batch, mse, n_tokens) for _ in range(5)]
    res["critic_losses"] = [s["loss"] for s in losses]
    res["critic_entropy_abs"] = losses[0]["entropy_abs"]
    e.destroy()


def check_shared_prefix(res: dict[str, object]) -> None:
    batch = group_batch(0)
    out: dict[bool, dict[str, object]] = {}
    for shared in (False, True):
        e = engine(n_mbs=2, ft=None, shared_prefix=shared)
        lp, ent = e.forward(batch, with_entropy=True)
        e.destroy()
        e = engine(lr=1e-2, is_critic=True, shared_prefix=shared)
        values = e.forward(batch)
        e.destroy()
        e = with_sgd(engine(shared_prefix=shared))
        stats = e.train_batch(shard(batch), nll, n_tokens)
        out[shared] = {"lp": lp, "ent": ent, "values": values, "stats": stats, "params": e._full_state_dict()}
        e.destroy()
    plain, tree = out[False], out[True]
    res["shared_lp_err"] = float((plain["lp"] - tree["lp"]).abs().max())
    res["shared_ent_err"] = float((plain["ent"] - tree["ent"]).abs().max())
    res["shared_value_err"] = float((plain["values"] - tree["values"]).abs().max())
    res["shared_param_err"] = max_diff(plain["params"], tree["params"])
    res["shared_loss"] = [plain["stats"]["loss"], tree["stats"]["loss"]]
    res["shared_lp_nonzero"] = int((tree["lp"] != 0).sum())
    e = engine(n_mbs=2, ft=None, shared_prefix=True)
    layout = e._microbatches(batch)[0]
    from areal_lite.engines.train.shared_prefix import shared_prefix_layout

    res["shared_tokens"] = [
        [
            int(mb["input_ids"].numel()),
            int(shared_prefix_layout(mb["input_ids"], mb["position_ids"], mb["cu_seqlens"]).input_ids.numel()),
        ]
        for mb in layout
    ]
    e.destroy()


def check_accumulation(res: dict[str, object]) -> None:
    """Three forward_backward calls, each loss scaled by its batch's share of the union's loss
    weight, then one optim_step: the update of one train_batch on the union. Then optim_step's
    explicit arguments: SGD moves the parameters by lr x the clipped gradient; with zero gradients
    AdamW's step is the decoupled weight decay alone, which leaves 1-D parameters untouched."""
    rank0 = dist.get_rank() == 0
    parts = [make_batch(20, n=4), make_batch(21, n=6), make_batch(22, n=4)]
    totals = [float(p["loss_mask"].sum()) for p in parts]
    e = with_sgd(engine(n_mbs=2))
    before = e._full_state_dict()
    union_stats = e.train_batch(shard(torch.cat(parts)), nll, n_tokens)
    union = e._full_state_dict()
    e.destroy()
    e = with_sgd(engine(n_mbs=2))
    calls = [e.forward_backward(shard(p), scaled(nll, t / sum(totals)), n_tokens) for p, t in zip(parts, totals)]
    step = e.optim_step()
    accumulated = e._full_state_dict()
    res["accum_loss"] = [sum(c["loss"] for c in calls), union_stats["loss"]]
    res["accum_grad_norm"] = [step["grad_norm"], union_stats["grad_norm"]]
    if rank0:
        torch.save(accumulated, os.path.join(OUT, f"params_accum_w{dist.get_world_size()}.pt"))
        res["accum_changed"] = max_diff(before, accumulated)
        res["accum_param_err"] = max_diff(union, accumulated)

    e.forward_backward(shard(parts[0]), nll, n_tokens)
    before = e._full_state_dict()
    res["override_stats"] = e.optim_step(lr=0.25, weight_decay=0.0, max_grad_norm=0.01)
    after = e._full_state_dict()
    res["override_lr_after"] = e.optimizer.param_groups[0]["lr"]
    if rank0:
        res["override_step_norm"] = float(torch.cat([(after[k] - before[k]).flatten() for k in after]).norm())
    e.destroy()

    e = engine(lr=1e-3)
    before = e._full_state_dict()
    e.forward_backward(shard(parts[0]), scaled(nll, 0.0), n_tokens)
    e.optim_step(lr=0.1, weight_decay=0.5)
    after = e._full_state_dict()
    res["override_wd_of_group"] = [g["weight_decay"] for g in e.optimizer.param_groups]
    if rank0:
        decayed = {k: v * (1 - 0.1 * 0.5) if v.ndim >= 2 else v for k, v in before.items()}
        res["override_wd_err"] = max_diff(decayed, after)
    e.destroy()


def check_one_pass(res: dict[str, object]) -> None:
    """forward_backward_logprobs: the log-probabilities of forward (each rank its uneven share, cut
    into 3 micro-batches), from as many model calls as forward alone makes, and the gradient of
    forward_backward (SGD: equal parameters). Scoring given target ids instead of the next input
    token (``target_ids``) against HF's logits. Adam's betas and eps for one step."""
    rank0 = dist.get_rank() == 0
    batch = uneven_shard(make_batch(30, n=8))
    e = with_sgd(engine(n_mbs=3))
    calls: list[int] = []
    hook = e.model.register_forward_pre_hook(lambda *_: calls.append(1))
    lp_ref = e.forward(batch)
    res["forward_calls"] = len(calls)
    calls.clear()
    stats, lp = e.forward_backward_logprobs(batch, nll, n_tokens)
    res["one_pass_calls"] = len(calls)
    hook.remove()
    res["one_pass_logprob_err"] = max_over_ranks(float((lp - lp_ref).abs().max()))
    e.optim_step()
    one_pass = e._full_state_dict()
    e.destroy()
    e = with_sgd(engine(n_mbs=3))
    res["one_pass_loss"] = [stats["loss"], e.forward_backward(batch, nll, n_tokens)["loss"]]
    e.optim_step()
    two_pass = e._full_state_dict()  # collective: every rank gathers
    if rank0:
        res["one_pass_param_err"] = max_diff(one_pass, two_pass)

    targeted = make_batch(31, n=4)
    g = torch.Generator().manual_seed(3)
    targeted["target_ids"] = (
        torch.randint(1, 250, targeted["input_ids"].shape, generator=g) * targeted["attention_mask"]
    )
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(MODEL)(
            input_ids=targeted["input_ids"], attention_mask=targeted["attention_mask"].long()
        ).logits.float()
    ref = torch.log_softmax(logits, -1)[:, :-1].gather(-1, targeted["target_ids"][:, 1:, None]).squeeze(-1)
    ref = torch.cat([torch.zeros(4, 1), ref], 1) * targeted["attention_mask"]
    e.destroy()
    e = engine(ft=None)  # the directory's weights, as HF loads them
    res["target_ids_err"] = float((e.forward(targeted) - ref).abs().max())
    e.destroy()

    # betas and eps for one step: the step of an engine configured with them; then back.
    configured = OptimizerConfig(lr=1e-2, beta1=0.5, beta2=0.6, eps=1e-3, gradient_clipping=0.0)
    stepped = []
    for opt, override in ((OptimizerConfig(lr=1e-2, gradient_clipping=0.0), True), (configured, False)):
        e = FSDPEngine(TrainEngineConfig(path=MODEL, optimizer=opt))
        e.initialize(FT)
        for _ in range(2):
            e.forward_backward(shard(make_batch(32)), nll, n_tokens)
            e.optim_step(betas=(0.5, 0.6), eps=1e-3) if override else e.optim_step()
        stepped.append(e._full_state_dict())
        if override:
            res["adam_after"] = [list(e.optimizer.param_groups[0]["betas"]), e.optimizer.param_groups[0]["eps"]]
        e.destroy()
    if rank0:
        res["adam_override_err"] = max_diff(*stepped)


def resume(res: dict[str, object]) -> None:
    e = engine(lr=1e-2)
    e.load(SaveLoadMeta(path=os.path.join(OUT, "train_state"), weight_format="train_state"))
    res["resumed_version"] = e.get_version()
    res["next_stats"] = e.train_batch(shard(make_batch(5)), nll, n_tokens)
    after = e._full_state_dict()
    if dist.get_rank() == 0:
        torch.save(after, os.path.join(OUT, f"params_resumed_w{dist.get_world_size()}.pt"))
    e.destroy()


def main() -> None:
    torch.manual_seed(0)
    # The group is created here, not by the engines, so that several engines can come and go.
    dist.init_process_group("gloo")
    checks = {
        "logprobs": check_logprobs,
        "invariance": check_invariance,
        "checkpoint": check_checkpoint_and_updates,
        "resume": resume,
        "sft": check_sft,
        "critic": check_critic,
        "shared_prefix": check_shared_prefix,
        "accumulation": check_accumulation,
        "one_pass": check_one_pass,
        "lora": lambda res: check_lora(res, MODEL, OUT),
    }
    res: dict[str, object] = {}
    for name in CHECKS:
        checks[name](res)
    write_results(res, os.path.join(OUT, f"{'-'.join(CHECKS)}_w{dist.get_world_size()}.json"))
    destroy_default_group()


if __name__ == "__main__":
    main()
