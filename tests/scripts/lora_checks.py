"""The ``lora`` check of fsdp_worker.py: FSDPEngine training peft LoRA adapters, on 1 or 2 ranks.

- Only the adapters are trainable and only they have optimizer state; training leaves the base
  weights exactly as they were.
- One SGD step (2 ranks, 2 micro-batches) moves the adapters as a plain peft model's step on the
  whole batch does, to 1e-6: FSDP (adapters sharded with their layers) and the loss normalisation
  change nothing.
- An HF save holds the merged model under the base model's HF names (the same file keys) and the
  PEFT adapter in ``adapter/``: ``PeftModel.from_pretrained`` over the base and the merged model give
  the same logits (1e-5), and the engine's own log-probabilities equal them.
- Weight updates in process, through disk (a PEFT directory) and by broadcast reach an embedded
  engine as the adapter alone; after each, the engine's log-probabilities of freshly generated
  tokens equal the trainer's `forward` to 1e-5.
- A train_state checkpoint resumes the adapters and their optimizer state.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import Future

import torch
import torch.distributed as dist
from engine_checks import make_batch, n_tokens, nll
from peft import PeftModel, get_peft_model, set_peft_model_state_dict
from safetensors import safe_open
from tensordict import TensorDict
from transformers import AutoModelForCausalLM

from areal_lite.api.config import LocalEngineConfig, LoRAConfig, OptimizerConfig, TrainEngineConfig
from areal_lite.api.io import FinetuneSpec, GenerationConfig, ModelRequest, SaveLoadMeta, WeightUpdateMeta
from areal_lite.engines.local.engine import LocalInferenceEngine
from areal_lite.engines.train.fsdp import FSDPEngine
from areal_lite.utils.lora import peft_config

LORA = LoRAConfig(rank=4, alpha=8.0)


def lora_engine(model: str, ft: FinetuneSpec | None, n_mbs: int = 1) -> FSDPEngine:
    from areal_lite.api.io import MicroBatchSpec

    cfg = TrainEngineConfig(
        path=model,
        optimizer=OptimizerConfig(lr=1e-2),
        mb_spec=MicroBatchSpec(n_mbs=n_mbs),
        logits_chunk_size=7,
        lora=LORA,
    )
    e = FSDPEngine(cfg)
    e.initialize(ft)
    return e


class RecordingEngine(LocalInferenceEngine):
    """The embedded engine, recording what each weight update carried: (kind, the names of the
    tensors or, for disk, of the files, their bytes)."""

    def __init__(self, config: LocalEngineConfig) -> None:
        super().__init__(config)
        self.received: list[tuple[str, list[str], int]] = []

    def update_weights(self, meta: WeightUpdateMeta) -> Future[None]:
        if meta.type == "in_process":
            tensors = list((meta.named_tensors or {}).items())
            self.received.append(("in_process", [n for n, _ in tensors], sum(t.nbytes for _, t in tensors)))
        elif meta.type == "disk":
            path = meta.path or ""
            files = sorted(os.listdir(path))
            self.received.append(("disk", files, sum(os.path.getsize(os.path.join(path, f)) for f in files)))
        else:
            nbytes = sum(
                torch.Size(s.shape).numel() * torch.finfo(getattr(torch, s.dtype)).bits // 8 for s in meta.param_specs
            )
            self.received.append(("distributed", [s.name for s in meta.param_specs], nbytes))
        return super().update_weights(meta)


def padded_nll(model: torch.nn.Module, batch: TensorDict) -> torch.Tensor:
    """The token-mean NLL over ``loss_mask`` of HF's padded forward (with gradient)."""
    am = batch["attention_mask"]
    logits = model(input_ids=batch["input_ids"], attention_mask=am.long()).logits.float()
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    m = batch["loss_mask"][:, 1:].float()
    return -(lp * m).sum() / m.sum()


def samples_and_errors(e: FSDPEngine, engine: LocalInferenceEngine | None) -> tuple[float, list[int]]:
    """Rank 0's engine generates 6 samples; the largest gap between its log-probabilities and the
    trainer's forward of the same tokens, and the versions they carried."""
    out: list[object] = [None]
    if engine is not None:

        async def run():
            g = GenerationConfig(max_new_tokens=10, ignore_eos=True)
            return await asyncio.gather(*[engine.agenerate(ModelRequest([5 + i, 17, 30 + i], g)) for i in range(6)])

        out[0] = [(r.input_tokens, r.output_tokens, r.output_logprobs, r.output_versions) for r in asyncio.run(run())]
    dist.broadcast_object_list(out, src=0)
    samples = out[0]
    width = max(len(p) + len(o) for p, o, _, _ in samples)  # type: ignore[union-attr]
    ids = torch.zeros(len(samples), width, dtype=torch.long)  # type: ignore[arg-type]
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, (p, o, _, _) in enumerate(samples):  # type: ignore[arg-type]
        ids[i, : len(p) + len(o)] = torch.tensor(p + o)
        mask[i, : len(p) + len(o)] = True
    logp = e.forward(TensorDict({"input_ids": ids, "attention_mask": mask}, batch_size=[len(samples)]))  # type: ignore[arg-type]
    err = max(
        float((logp[i, len(p) : len(p) + len(o)] - torch.tensor(lps)).abs().max())
        for i, (p, o, lps, _) in enumerate(samples)  # type: ignore[arg-type]
    )
    return err, sorted({v for *_, vs in samples for v in vs})  # type: ignore[union-attr]


def check_lora(res: dict[str, object], model: str, out: str) -> None:
    rank0 = dist.get_rank() == 0
    share = slice(dist.get_rank(), None, dist.get_world_size())
    ft = FinetuneSpec(total_train_epochs=1, dataset_size=80, train_batch_size=8)

    # Trainable: the adapters alone; the optimizer holds them and nothing else.
    e = lora_engine(model, ft, n_mbs=2)
    named = dict(e.model.named_parameters())
    trainable = {n for n, p in named.items() if p.requires_grad}
    res["lora_trainable"] = sorted(n.split(".")[-3] for n in trainable)
    optimized = {id(p) for g in e.optimizer.param_groups for p in g["params"]}
    res["lora_optimizer_params_trainable"] = optimized == {id(named[n]) for n in trainable}
    base_before = dict(e._hf_tensors(cast=False))
    adapter_before = e._adapter_tensors()

    # One SGD step against a plain peft model on the whole batch (rank 0), from the same adapter.
    batch = make_batch(30)
    e.optimizer = torch.optim.SGD(e.model.parameters(), lr=1.0)
    e.forward_backward(batch[share], nll, n_tokens)
    e.optim_step(max_grad_norm=0.0)
    if rank0:
        ref = get_peft_model(AutoModelForCausalLM.from_pretrained(model), peft_config(LORA))
        set_peft_model_state_dict(ref, adapter_before)
        padded_nll(ref, batch).backward()
        with torch.no_grad():
            for p in ref.parameters():
                if p.grad is not None:
                    p -= p.grad
        from peft.utils import get_peft_model_state_dict

        stepped = get_peft_model_state_dict(ref)
    adapter_sgd = e._adapter_tensors()
    if rank0:
        res["lora_sgd_moved"] = max(float((adapter_sgd[k] - adapter_before[k]).abs().max()) for k in adapter_sgd)
        res["lora_sgd_vs_peft"] = max(float((adapter_sgd[k] - stepped[k]).abs().max()) for k in adapter_sgd)
    e.destroy()

    # AdamW steps: optimizer state for the adapters only, base weights untouched.
    e = lora_engine(model, ft)
    for i in range(3):
        e.train_batch(make_batch(31 + i)[share], nll, n_tokens)
    state_ids = {id(p) for p in e.optimizer.state}
    named = dict(e.model.named_parameters())
    res["lora_optimizer_state"] = [len(state_ids), len(trainable)]
    res["lora_state_only_adapters"] = state_ids <= {id(named[n]) for n in trainable}
    base_after = dict(e._hf_tensors(cast=False))
    res["lora_base_change"] = max(float((base_after[k] - base_before[k]).abs().max()) for k in base_after)

    # HF save: the merged model, and the PEFT adapter beside it.
    hf_dir = os.path.join(out, "lora_hf")
    e.save(SaveLoadMeta(path=hf_dir, weight_format="hf"))
    batch = make_batch(40)
    engine_lp = e.forward(batch)
    if rank0:
        merged = AutoModelForCausalLM.from_pretrained(hf_dir)
        adapted = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(model), os.path.join(hf_dir, "adapter")
        )
        am = batch["attention_mask"]
        with torch.no_grad():
            a = merged(input_ids=batch["input_ids"], attention_mask=am.long()).logits
            b = adapted(input_ids=batch["input_ids"], attention_mask=am.long()).logits
        res["lora_merged_vs_peft_logits"] = float((a - b)[am].abs().max())
        lp = torch.log_softmax(b, -1)[:, :-1].gather(-1, batch["input_ids"][:, 1:, None])[..., 0] * am[:, 1:]
        res["lora_engine_vs_peft_logprobs"] = float((engine_lp[:, 1:] - lp).abs().max())
        with safe_open(os.path.join(hf_dir, "model.safetensors"), "pt") as f:
            merged_keys = set(f.keys())
        base_dir = os.path.join(out, "lora_base_saved")
        AutoModelForCausalLM.from_pretrained(model).save_pretrained(base_dir)
        with safe_open(os.path.join(base_dir, "model.safetensors"), "pt") as f:
            res["lora_merged_keys_equal_base_keys"] = merged_keys == set(f.keys())
        with safe_open(os.path.join(hf_dir, "adapter", "adapter_model.safetensors"), "pt") as f:
            res["lora_adapter_keys_equal_sent"] = set(f.keys()) == set(e._adapter_names.values())

    # Weight updates of the three kinds to an embedded engine on rank 0.
    engine = RecordingEngine(LocalEngineConfig(path=model)) if rank0 else None
    if engine is not None:
        engine.initialize()
    dist_meta = WeightUpdateMeta(type="distributed", chunk_bytes=4000)
    e.connect_engine(engine, dist_meta)  # type: ignore[arg-type]  # with LoRA: sends the adapter at once
    kinds = [
        WeightUpdateMeta(type="in_process"),
        WeightUpdateMeta(type="disk", path=os.path.join(out, "lora_push")),
        dist_meta,
    ]
    for i, meta in enumerate(kinds):
        e.train_batch(make_batch(50 + i)[share], nll, n_tokens)
        e.set_version(i + 1)
        e.update_weights(meta)
        err, versions = samples_and_errors(e, engine)
        res[f"lora_update_{meta.type}"] = {"err": err, "versions": versions}
    if engine is not None:
        res["lora_received"] = engine.received
        res["lora_full_bytes"] = sum(
            v.nbytes for v in AutoModelForCausalLM.from_pretrained(model).state_dict().values()
        )
        engine.destroy()

    # A train_state checkpoint resumes adapters and optimizer state.
    state_dir = os.path.join(out, "lora_train_state")
    e.save(SaveLoadMeta(path=state_dir, weight_format="train_state"))
    saved = e._adapter_tensors()
    e.destroy()
    e = lora_engine(model, ft)
    e.load(SaveLoadMeta(path=state_dir, weight_format="train_state"))
    resumed = e._adapter_tensors()
    res["lora_resumed_equal"] = all(torch.equal(saved[k], resumed[k]) for k in saved)
    res["lora_resumed_optimizer_state"] = len(e.optimizer.state)
    e.destroy()
