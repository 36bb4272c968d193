"""`FSDPEngine`: a HF causal language model (or value model) trained with PyTorch FSDP2.

Every decoder layer and the root are sharded with ``fully_shard`` over all ranks (gloo on CPU,
NCCL on CUDA). Batches are packed into one 1-D sequence per micro-batch; attention never crosses
sequence boundaries: with ``attn_impl=sdpa`` (the default) attention runs per sequence
(`areal_lite.engines.train.varlen_attention`), with ``flash_attention_2`` on CUDA the sequence boundaries
go to its varlen kernel, and with ``eager`` position ids restart per sequence with the KV cache
off so that transformers masks each sequence. The LM head is applied chunk by chunk
(`areal_lite.engines.train.logprob`), so full-vocabulary logits of the whole micro-batch never exist at
once.

Loss normalisation is global: each micro-batch loss is scaled by ``loss_weight_fn(mb) / total``
with ``total`` summed over all micro-batches and all ranks, and FSDP's gradient averaging over
ranks is undone, so the gradient equals that of the whole batch on one rank. Ranks whose share
cuts into fewer micro-batches run extra zero-weight passes so that FSDP's collectives match.

Mixed precision (``dtype=bfloat16``, or ``auto`` where the device computes bf16 natively) keeps
fp32 master weights and optimizer state, computes in bf16 and reduces gradients in fp32.

On CPU the HF model's RMS norms and SiLU products run fused, and its fp32 linears and head go
through oneDNN where MKL would run below the CPU's vector width (by default on AMD CPUs from Zen 5
on): `areal_lite.cpu.TrainerTuning`, switched by ``cpu`` (`CPUConfig`).

LoRA (``lora.rank > 0``): peft wraps the model before it is sharded, so each layer's adapters are
sharded with it; only the adapters require gradients, and so only they get optimizer state. Weight
updates send the adapter alone (fp32, under its PEFT tensor names); HF saves write the model with
the adapter merged in (`areal_lite.utils.lora.MergedLoRA`) and the PEFT adapter beside it.

Mixture-of-experts models run their HF MoE blocks; their routers are driven by
`areal_lite.utils.moe.RoutingReplay`: with ``routing_replay`` each token goes to the experts the
batch's ``routed_experts`` recorded at generation, and every training pass reports routing
agreement with generation, expert load and the load-balancing loss (``moe/*``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from tensordict import TensorDict
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from areal_lite.api.config import TrainEngineConfig
from areal_lite.api.engine import InferenceEngine, LossFn, PackedBatch
from areal_lite.api.io import FinetuneSpec, WeightUpdateMeta
from areal_lite.cpu import TrainerTuning, compute_dtype
from areal_lite.engines.train.base import TrainEngineBase, marks_computing
from areal_lite.engines.train.logprob import align_to_tokens, logprobs_from_hidden, next_token_labels
from areal_lite.engines.train.shared_prefix import SharedPrefixLayout, shared_prefix_layout
from areal_lite.engines.train.varlen_attention import register_varlen_sdpa
from areal_lite.utils.data import MicroBatchSplit, pack_batch, split_microbatches, unpack_sequences
from areal_lite.utils.lora import PEFT_PREFIX, MergedLoRA, base_name, config_dict, peft_config
from areal_lite.utils.moe import RoutingReplay, routing_shape
from areal_lite.utils.recover import rng_state, set_rng_state

if TYPE_CHECKING:
    from peft import PeftModel

logger = logging.getLogger(__name__)
_HF_PREFIX = "hf."


class _PackedModel(nn.Module):
    """A HF model under one root module whose forward also applies the head, chunk by chunk.

    Calling the HF ``*ForCausalLM.forward`` would build the logits of every token at once; calling
    its decoder and head separately would bypass FSDP's root hooks. Wrapping both in this module
    (the FSDP root) keeps the head inside the root forward. Parameter names get an ``hf.`` prefix.
    """

    def __init__(self, hf: nn.Module, is_critic: bool, chunk_size: int) -> None:
        super().__init__()
        self.hf = hf
        self.is_critic = is_critic
        self.chunk_size = chunk_size

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        with_entropy: bool,
        tree: SharedPrefixLayout | None = None,
        target_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if tree is not None:
            return self._tree_forward(tree, with_entropy)
        hidden = self._hidden(input_ids, position_ids, cu_seqlens)
        if self.is_critic:
            # The hidden state at t has read tokens[: t + 1]: it values the state in which token
            # t + 1 is generated, so values are aligned to the token like log-probabilities.
            values = align_to_tokens(self.hf.score(hidden).squeeze(-1).float(), cu_seqlens)
            return values, torch.zeros_like(values)
        hidden, weight = self._head(hidden)
        labels = next_token_labels(input_ids if target_ids is None else target_ids)
        logp, entropy = logprobs_from_hidden(
            hidden, weight, labels, chunk_size=self.chunk_size, with_entropy=with_entropy
        )
        logp = align_to_tokens(logp, cu_seqlens)
        entropy = align_to_tokens(entropy, cu_seqlens) if entropy is not None else torch.zeros_like(logp)
        return logp, entropy

    def _head(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden states and output weight whose product is the logits. A LoRA adapter on the
        output layer (peft's, unmerged) joins them as extra columns, ``[h, s * A h]`` times
        ``[W, B]``, which is ``W h + s * B A h``: the logits keep being computed chunk by chunk by
        `logprobs_from_hidden` instead of through the adapted layer's own forward."""
        head = self.hf.get_output_embeddings()
        weight = head.weight
        if not hasattr(head, "lora_A") or head.merged or head.disable_adapters:
            return hidden, weight
        parts, columns = [hidden], [weight]
        for name in head.active_adapters:
            if name in head.lora_A:
                down = head.lora_A[name](head.lora_dropout[name](hidden))
                parts.append(down * head.scaling[name])
                columns.append(head.lora_B[name].weight)
        return torch.cat(parts, dim=-1), torch.cat(columns, dim=-1)

    def _hidden(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor, **extra: object
    ) -> torch.Tensor:
        # Sequence boundaries for varlen attention (ours on CPU, flash-attention's on CUDA);
        # built-in sdpa/eager ignore them and mask by the restarting position ids instead.
        max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        varlen = {
            "cu_seq_lens_q": cu_seqlens,
            "cu_seq_lens_k": cu_seqlens,
            "max_length_q": max_len,
            "max_length_k": max_len,
        }
        return self.hf.base_model(
            input_ids=input_ids.unsqueeze(0), position_ids=position_ids.unsqueeze(0), use_cache=False, **varlen, **extra
        ).last_hidden_state[0]

    def _tree_forward(self, tree: SharedPrefixLayout, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` over a shared-prefix layout: each tree token is predicted from its source, and
        the packed tokens take their tree token's results."""
        hidden = self._hidden(tree.input_ids, tree.position_ids, tree.cu_seqlens, tree_branches=tree.branches)
        predicted = (tree.source >= 0).nonzero().squeeze(1)  # every tree token but each tree's first
        sources = tree.source[predicted]

        def on_tree(values: torch.Tensor) -> torch.Tensor:  # [n predicted] -> [T packed], 0 at starts
            full = values.new_zeros(tree.input_ids.shape[0]).index_put((predicted,), values)
            return full[tree.token_index]

        if self.is_critic:
            values = on_tree(self.hf.score(hidden[sources]).squeeze(-1).float())
            return values, torch.zeros_like(values)
        head_in, weight = self._head(hidden[sources])
        logp, entropy = logprobs_from_hidden(
            head_in, weight, tree.input_ids[predicted], chunk_size=self.chunk_size, with_entropy=with_entropy
        )
        logp = on_tree(logp)
        return logp, on_tree(entropy) if entropy is not None else torch.zeros_like(logp)


def _fused_adam_supported(params: list[torch.Tensor]) -> bool:
    return all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


class FSDPEngine(TrainEngineBase):
    """FSDP2 train engine. See the module docstring; the methods follow `TrainEngine`, the
    backend-independent ones are `TrainEngineBase`'s."""

    def __init__(self, config: TrainEngineConfig) -> None:
        super().__init__(config)
        self.model: _PackedModel | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self._persistent_buffers: set[str] | None = None  # HF names of the buffers a state dict holds
        self._peft: PeftModel | None = None
        """With LoRA: peft's wrapper of the HF model (which `model` shards and runs)."""
        self._adapter_names: dict[str, str] = {}
        """With LoRA: each adapter parameter's name in the HF model -> its name in a PEFT file."""
        self._routing: RoutingReplay | None = None
        """A mixture-of-experts model's routers (None for a dense model)."""
        self._cpu = TrainerTuning(config.cpu)
        """The CPU speed measures: fused kernels, oneDNN products, kept memory, the cores' share."""

    # ---------------------------------------------------------------- setup

    def initialize(self, ft_spec: FinetuneSpec | None = None) -> None:
        cfg = self.config
        if cfg.tensor_parallel_size != 1 or cfg.pipeline_parallel_size != 1:
            raise ValueError(
                f"FSDP shards data-parallel only: tensor_parallel_size={cfg.tensor_parallel_size} and "
                f"pipeline_parallel_size={cfg.pipeline_parallel_size} need backend=megatron"
            )
        if cfg.shared_prefix and cfg.attn_impl != "sdpa":
            raise ValueError(
                f"shared_prefix needs attn_impl=sdpa (the engine's varlen attention), not {cfg.attn_impl!r}"
            )
        if torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.compute_dtype = compute_dtype(cfg.dtype, self.device)
        self.create_process_group()
        torch.manual_seed(cfg.seed)
        hf = self._from_pretrained(cfg.path)
        if cfg.lora.enabled:
            hf = self._add_adapters(hf)
        self._cpu.tune_model(hf, self.device)
        if routing_shape(hf.config) is not None:
            self._routing = RoutingReplay(hf)
        elif cfg.routing_replay:
            raise ValueError(f"routing_replay needs a mixture-of-experts model; {cfg.path} is {hf.config.model_type!r}")
        if cfg.gradient_checkpointing:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if ft_spec is None:
            hf.requires_grad_(False)
        mp = (
            MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
            if self.compute_dtype != torch.float32
            else MixedPrecisionPolicy()
        )
        mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        for layer in hf.base_model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        model = _PackedModel(hf, cfg.is_critic, cfg.logits_chunk_size)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        self.model = model
        if ft_spec is not None:
            self._build_optimizer(ft_spec)
            self._cpu.keep_step_memory(self.device)
        self._cpu.startup_done(self.device)

    def _from_pretrained(self, path: str) -> nn.Module:
        from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

        attn = self.config.attn_impl
        if attn == "sdpa":
            # The engine only ever runs packed rows: SDPA per sequence costs sum(L_i^2) where
            # transformers' sdpa would mask a T x T product (3x slower at T=2k on CPU).
            attn = register_varlen_sdpa()
        kwargs = {"dtype": torch.float32, "attn_implementation": attn}
        if self.config.is_critic:
            # The value head (`score`) is new when loading a causal-LM directory; its init is
            # seeded identically on every rank by `initialize`.
            hf = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, **kwargs)
        else:
            hf = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        hf.config.use_cache = False
        return hf

    def _add_adapters(self, hf: nn.Module) -> nn.Module:
        """Wrap ``hf`` with peft's LoRA (before sharding: FSDP then shards the adapters with their
        layers) and return the HF model, now with adapters, of which only they require gradients."""
        from peft import get_peft_model
        from peft.utils import get_peft_model_state_dict

        if self.config.is_critic:
            raise ValueError("lora is for policies: a critic's new value head needs full training (set lora.rank=0)")
        self._peft = get_peft_model(hf, peft_config(self.config.lora))
        # Names as a PEFT file gives them, by peft's own renaming of the wrapper's state dict.
        tagged = {PEFT_PREFIX + n: torch.empty(0) for n, p in hf.named_parameters() if p.requires_grad}
        renamed = {id(t): name for name, t in get_peft_model_state_dict(self._peft, state_dict=tagged).items()}
        self._adapter_names = {n.removeprefix(PEFT_PREFIX): renamed[id(t)] for n, t in tagged.items()}
        return self._peft.get_base_model()

    def _build_optimizer(self, ft_spec: FinetuneSpec) -> None:
        assert self.model is not None
        opt = self.config.optimizer
        decay, no_decay = [], []
        for p in self.model.parameters():
            if p.requires_grad:
                # Norm weights and biases are 1-D; decaying them towards 0 only hurts.
                (decay if p.ndim >= 2 else no_decay).append(p)
        self.optimizer = torch.optim.AdamW(
            # wd_mult (megatron's name) tells `optim_step` which group a weight_decay override skips
            [
                {"params": decay, "weight_decay": opt.weight_decay, "wd_mult": 1.0},
                {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0},
            ],
            lr=opt.lr,
            betas=(opt.beta1, opt.beta2),
            eps=opt.eps,
            # One fused kernel per parameter group instead of a dozen small ops per parameter: on
            # the CPU the default (per-tensor) AdamW step of the quickstart's model takes 8.6 ms,
            # the fused one 1.7 ms, each op paying DTensor's dispatch.
            fused=_fused_adam_supported(decay + no_decay),
        )
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor(ft_spec))

    def destroy(self) -> None:
        self._cpu.stop_sharing_cores()
        self.lr_scheduler = None
        super().destroy()
        self._cpu.release()

    def _data_parallel_group(self) -> dist.ProcessGroup | None:
        return None  # every rank holds a shard of the whole model: all are data-parallel

    def _advance_lr_schedule(self) -> None:
        assert self.lr_scheduler is not None
        self.lr_scheduler.step()

    # ---------------------------------------------------------------- compute

    def _max_over_ranks(self, n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _microbatches(self, batch: TensorDict) -> tuple[list[PackedBatch], MicroBatchSplit, int]:
        """This rank's packed micro-batches, padded with repeats of the first to the largest count
        over ranks (every rank must run as many forward/backward passes for FSDP's collectives).
        Returns the micro-batches, the split (for restoring order) and how many are real."""
        spec = self.config.mb_spec
        split = split_microbatches(batch, spec)
        n = self._max_over_ranks(len(split.mbs))
        if len(split.mbs) < n:
            split = split_microbatches(batch, replace(spec, n_mbs=n))
        n = self._max_over_ranks(len(split.mbs))
        packed = [self._to_device(pack_batch(mb)) for mb in split.mbs]
        n_real = len(packed)
        packed += [packed[0]] * (n - n_real)
        return packed, split, n_real

    def _to_device(self, mb: PackedBatch) -> PackedBatch:
        return {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in mb.items()}

    def _run(self, mb: PackedBatch, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        ids, pos, cu = mb["input_ids"], mb["position_ids"], mb["cu_seqlens"]
        assert isinstance(ids, torch.Tensor) and isinstance(pos, torch.Tensor) and isinstance(cu, torch.Tensor)
        targets = mb.get("target_ids")
        assert targets is None or isinstance(targets, torch.Tensor)
        if targets is not None and self.config.shared_prefix:
            raise ValueError("target_ids with shared_prefix is not supported: the tree scores the input tokens")
        tree = shared_prefix_layout(ids, pos, cu) if self.config.shared_prefix else None
        if self._routing is not None:
            routes = mb.get("routed_experts")
            if routes is not None and tree is not None:
                routes = routes[tree.origin]  # type: ignore[index]
            self._routing.begin(routes, self.config.routing_replay)  # type: ignore[arg-type]
        return self._module()(ids, pos, cu, with_entropy, tree, targets)

    @torch.no_grad()
    @marks_computing
    def forward(
        self, batch: TensorDict, *, with_entropy: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        model = self._module()
        model.eval()
        seqlen = batch["attention_mask"].shape[1]
        mbs, split, n_real = self._microbatches(batch)
        outs, ents = [], []
        for i, mb in enumerate(mbs):
            out, ent = self._run(mb, with_entropy)
            if i < n_real:
                cu = mb["cu_seqlens"]
                assert isinstance(cu, torch.Tensor)
                outs.append(unpack_sequences(out.float().cpu(), cu.cpu(), seqlen))
                ents.append(unpack_sequences(ent.float().cpu(), cu.cpu(), seqlen))
        order = split.restore_order
        result = torch.cat(outs)[order]
        if with_entropy:
            return result, torch.cat(ents)[order]
        return result

    def _loss_microbatches(self, batch: TensorDict) -> tuple[list[PackedBatch], int]:
        mbs, _, n_real = self._microbatches(batch)
        return mbs, n_real

    def _loss_passes(
        self, mbs: list[PackedBatch], n_real: int, weights: list[float], total: float, loss_fn: LossFn, train: bool
    ) -> list[dict[str, float]]:
        model = self._module()
        model.train(train)
        world = dist.get_world_size()
        results = []
        for i, (mb, w) in enumerate(zip(mbs, weights)):
            if train:
                # Reduce-scatter gradients once, after the last micro-batch.
                model.set_requires_gradient_sync(i == len(mbs) - 1)
            out, ent = self._run(mb, with_entropy=not self.config.is_critic)
            if i < n_real:
                loss, stats = loss_fn(out, ent, mb)
                results.append({"loss": float(loss.detach()), **{k: float(v.detach()) for k, v in stats.items()}})
                if self._routing is not None:
                    results[-1].update(self._routing.stats())
            if not train:
                continue
            if w > 0:
                # FSDP averages gradients over ranks; `world` turns that average into the sum.
                (loss * (w / total * world)).backward()
            else:
                # A zero-weight pass still runs backward so that FSDP's collectives match, without
                # touching the loss, which may be NaN here (e.g. a mean over no tokens).
                ((out.sum() + ent.sum()) * 0.0).backward()
        return results

    def _clip_gradients(self, max_norm: float) -> float:
        params = [p for p in self._module().parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)

    def _apply_update(self) -> None:
        assert self.optimizer is not None
        self.optimizer.step()

    def _zero_grad(self) -> None:
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)

    # ---------------------------------------------------------------- checkpoints

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full HF-named fp32 tensors on CPU on rank 0 (empty elsewhere), never aliasing the live
        parameters. Collective. Gathers parameter by parameter: torch's ``get_model_state_dict``
        spends 7 ms per call verifying and renaming on the quickstart's 1M-parameter model, every
        weight update."""
        keep = dist.get_rank() == 0
        full = {}
        for name, t in self._hf_tensors(cast=False):
            if keep:
                full[name] = t.cpu()
        if self._peft is not None:
            adapter = self._adapter_tensors()
            if keep:
                full.update(MergedLoRA(self._module().hf.config, self._adapter_config(), full).merged(adapter))
        return full

    def _save_hf(self, path: str, tokenizer: object | None) -> None:
        sd = self._full_state_dict()
        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
            # save_pretrained empties the dict it is given (transformers 5): hand it a copy.
            self._module().hf.save_pretrained(path, state_dict=dict(sd))
            if tokenizer is not None:
                tokenizer.save_pretrained(path)  # type: ignore[attr-defined]
        if self._peft is not None:
            self._save_adapter(os.path.join(path, "adapter"))

    # ---------------------------------------------------------------- LoRA adapters

    def _lora(self) -> PeftModel:
        if self._peft is None:
            raise ValueError("this engine trains no LoRA adapter (lora.rank is 0)")
        return self._peft

    def _adapter_config(self) -> dict[str, object]:
        """The adapter's PEFT config, as ``adapter_config.json`` holds it."""
        return config_dict(self._lora().peft_config["default"])

    def _adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The adapter's full fp32 tensors on CPU under their PEFT names, on every rank (collective)."""
        model = self._module()
        model.reshard()
        out = {}
        for name, p in model.hf.named_parameters():
            if name in self._adapter_names:
                full = p.full_tensor() if isinstance(p, DTensor) else p
                out[self._adapter_names[name]] = full.detach().to("cpu", copy=True)
        return out

    def _save_adapter(self, path: str) -> None:
        """A PEFT adapter directory from rank 0, written by peft itself (collective)."""
        tensors = self._adapter_tensors()
        if dist.get_rank() == 0:
            # peft's save takes the wrapper's state dict (and renames it as it does its own).
            state = {PEFT_PREFIX + name: tensors[file_name] for name, file_name in self._adapter_names.items()}
            self._lora().save_pretrained(path, state_dict=state)

    def connect_engine(self, engine: InferenceEngine, meta: WeightUpdateMeta) -> None:
        """With LoRA the adapter is sent at once (collective): generation requests name it, so the
        inference side must hold it before any rollout."""
        super().connect_engine(engine, meta)
        self._share_cores(engine)
        if self._peft is not None:
            self.update_weights(meta)

    def _share_cores(self, engine: InferenceEngine) -> None:
        """With ``share_cores_with_engine``, on CPU, when ``engine`` generates in this process:
        yield its share of the threads while it is generating. An engine with a share of its own
        (``local_engine.num_threads``) keeps that share; one without gets half of the threads
        while this engine computes and all of them otherwise, so that whichever of the two
        computes alone has every thread and both at once split them."""
        share = getattr(engine, "thread_share", 0)
        threads = torch.get_num_threads()
        if not self.config.share_cores_with_engine or self.device.type != "cpu" or threads < 2:
            return
        if share == 0 and hasattr(engine, "yield_threads_to"):
            share = threads // 2
            engine.yield_threads_to(lambda: self.computing, share)
        if not 0 < share < threads:
            return
        assert self.model is not None
        layers = self.model.hf.base_model.layers
        self._cpu.share_cores(lambda: engine.busy, threads, threads - share, layers)  # type: ignore[attr-defined]
        logger.info(
            "training on %d threads while the engine generates on %d, on %d otherwise", threads - share, share, threads
        )

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        """Send the weights, or with LoRA the adapter alone (see `WeightUpdateMeta.lora_config`)."""
        if self._peft is None:
            return super().update_weights(meta)
        meta = replace(meta, lora_config=self._adapter_config())
        self._sender.send(meta, self._version, lambda: iter(self._adapter_tensors().items()), self._save_adapter)
        return None

    def _write_weights(self, path: str) -> None:
        """A disk weight update: ``model.safetensors`` (and ``config.json``, once) in ``path`` from
        rank 0, in the checkpoint layout. Half the time of ``save_pretrained`` for a small model,
        and no progress bar per update; servers read only the weight files. Collective."""
        sd = self._full_state_dict()
        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
            sd = dict(self._checkpoint_layout().to_checkpoint(sd.items()))
            save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
            config = os.path.join(path, "config.json")
            if not os.path.exists(config):
                self._module().hf.config.to_json_file(config)

    def _training_state(self) -> dict[str, object]:
        model = self._module()
        model.reshard()
        if self.optimizer is None:
            return {"model": get_model_state_dict(model)}
        model_sd, optim_sd = get_state_dict(model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def _save_train_state(self, path: str) -> None:
        """Model and optimizer (when the engine has one) with torch.distributed.checkpoint, and per
        rank a `torch.save` file of the LR scheduler, step, version and RNG state."""
        os.makedirs(path, exist_ok=True)
        dcp.save(self._training_state(), checkpoint_id=path)
        extra = {
            "version": self._version,
            "global_step": self._global_step,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "rng": rng_state(),
        }
        torch.save(extra, os.path.join(path, f"extra_state_rank{dist.get_rank()}.pt"))

    def _load_hf_weights(self, path: str) -> None:
        if self._peft is not None:
            raise ValueError("a LoRA engine keeps its base weights: resume it from a train_state checkpoint")
        model = self._module()
        # Loading through HF resolves tied weights, sharded index files and dtype conversion.
        full = self._from_pretrained(path).state_dict()
        model.reshard()
        set_model_state_dict(
            model, {_HF_PREFIX + k: v for k, v in full.items()}, options=StateDictOptions(full_state_dict=True)
        )

    def _load_train_state(self, path: str) -> None:
        extra_file = self._train_state_file(path, f"extra_state_rank{dist.get_rank()}.pt")
        model = self._module()
        state = self._training_state()
        dcp.load(state, checkpoint_id=path)
        if self.optimizer is None:
            set_model_state_dict(model, state["model"])  # type: ignore[arg-type]
        else:
            set_state_dict(model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])  # type: ignore[arg-type]
        extra = torch.load(extra_file, weights_only=False)
        self._version = extra["version"]
        self._global_step = extra["global_step"]
        if self.lr_scheduler is not None and extra["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        set_rng_state(extra["rng"])

    # ---------------------------------------------------------------- weight updates

    def _hf_model_config(self) -> object:
        return self._module().hf.config

    def _hf_tensors(self, cast: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors with HF names, one at a time, cast to the compute dtype (``cast=False``:
        the parameters' own, fp32), as copies that later optimizer steps cannot change. With
        LoRA: the base model's (the adapter not merged in).
        Collective: every rank iterates to the end (non-zero ranks only take part in the gathers)."""
        model = self._module()
        model.reshard()
        hf = model.hf
        if self._persistent_buffers is None:
            self._persistent_buffers = set(hf.state_dict().keys())
        persistent = self._persistent_buffers
        named = list(hf.named_parameters()) + [(n, b) for n, b in hf.named_buffers() if n in persistent]
        for name, t in named:
            if name in self._adapter_names:
                continue
            full = t.full_tensor() if isinstance(t, DTensor) else t
            yield (
                base_name(name),
                full.detach().to(self.compute_dtype if cast else full.dtype, copy=True),
            )


__all__ = ["FSDPEngine"]
