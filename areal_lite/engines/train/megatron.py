"""`MegatronEngine`: a Qwen2/Llama/Qwen3/Qwen3-MoE causal language model trained with megatron-core.

The same contract as `FSDPEngine` (an actor cannot tell them apart; ``backend: megatron`` in the
actor's config swaps them through `make_train_engine`), built on megatron-core's pieces: a
`GPTModel` with the local (non-Transformer-Engine) layers and tensor parallelism, megatron's
`DistributedDataParallel` with its distributed optimizer (optimizer state sharded over the
data-parallel ranks), and megatron's RNG tracker; `areal_lite.engines.train.mcore_model` builds
them. Weights come from and go to HF directories and HF-named tensors through
`areal_lite.engines.train.mcore_weights` (which converts with `mcore_convert`).

Packed sequences: each micro-batch runs as one packed row of ``T`` tokens in megatron's ``THD``
format (``PackedSeqParams`` with the micro-batch's ``cu_seqlens``), so rotary positions restart per
sequence (megatron's own THD rotary code), and attention runs within each sequence
(`mcore_model.PackedCoreAttention`). The last stage's hidden states ``[T, h]`` are scored chunk by
chunk (`areal_lite.engines.train.logprob`, as in FSDPEngine), and the loss function sees the same
packed micro-batch as with FSDP.

Parallelism: ``tensor_parallel_size`` ranks split every layer, ``pipeline_parallel_size`` stages
split the layers; the remaining factor of the world size is data parallel. The ranks of one
model-parallel group (TP x PP) must train on the same data, so the batch of its first rank is
broadcast to the others. Micro-batches run through megatron's own schedule (1F1B across pipeline
stages; variable sequence lengths, so packed micro-batches of any length pass between stages); the
head, the log-probabilities and the loss run on the last stage, whose results are broadcast to the
other stages. Gradients are summed (not averaged) over data-parallel ranks, because each
micro-batch loss already carries its ``weight / total`` share of the global batch. At TP > 1 the
(vocabulary-split) output weight is all-gathered for the head, so the logits match FSDP's to the
last bit of the matmul. With tied embeddings and PP > 1 the last stage holds a copy of the
embedding that megatron keeps in sync (its gradients are summed with the first stage's).

On CPU (gloo) megatron-core's few hard-coded CUDA calls are redirected by `mcore_cpu`.

Mixture-of-experts models (Qwen3-MoE) run megatron-core's MoE layers (router, local experts,
all-to-all token dispatcher) with ``expert_parallel_size`` ranks sharing the experts of each
layer; every forward pass then has collectives across those ranks, so ranks whose data cuts into
fewer micro-batches run zero-weight passes, as FSDP's do. With ``routing_replay`` megatron's own
router replay forces the batch's ``routed_experts`` (positions without a route take the router's
choice); its probabilities are the router's scores at those experts, as `areal_lite.utils.moe`
defines them for FSDP. The ``moe/*`` statistics are FSDP's only.

Checkpoints: ``hf`` writes a HF directory from rank 0 (sharded safetensors and config);
``train_state`` writes each rank's parameter shards, optimizer state, LR schedule, step and RNG
with `torch.save` into one directory; it resumes under the same parallel layout.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from tensordict import TensorDict

from areal_lite.api.config import TrainEngineConfig
from areal_lite.api.engine import LossFn, PackedBatch
from areal_lite.api.io import FinetuneSpec
from areal_lite.cpu import TrainerTuning, compute_dtype
from areal_lite.engines.train.base import TrainEngineBase, read_back
from areal_lite.engines.train.logprob import token_logprobs, token_values
from areal_lite.engines.train.mcore_convert import ArchSpec
from areal_lite.engines.train.mcore_cpu import cpu_compat, cpu_mode, install_cpu_rng_tracker, install_moe_fallbacks
from areal_lite.engines.train.mcore_model import build_gpt, distributed_optimizer, replay_topk, sub_optimizers, wrap_ddp
from areal_lite.engines.train.mcore_weights import HFWeights, SafetensorsDir, new_value_head, write_hf_dir
from areal_lite.utils.data import MicroBatchSplit
from areal_lite.utils.recover import rng_state, set_rng_state
from areal_lite.utils.vision import is_vision_config

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer

_DTYPE_NAMES = ("float32", "bfloat16")

MicroBatch = tuple[PackedBatch, float]
"""A micro-batch as the schedule sees it: packed, and its loss weight."""


class MegatronEngine(TrainEngineBase):
    """megatron-core train engine. See the module docstring; the methods follow `TrainEngine`, the
    backend-independent ones are `TrainEngineBase`'s."""

    def __init__(self, config: TrainEngineConfig) -> None:
        if config.lora.enabled:
            raise ValueError(
                "LoRA (lora.rank > 0) is not supported by the megatron backend: use backend=fsdp, which trains "
                "peft adapters, or set lora.rank=0"
            )
        fsdp_only = [k for k in ("liger_kernels", "compile_layers") if getattr(config, k)]
        if fsdp_only:
            raise ValueError(
                f"{', '.join(fsdp_only)}: the FSDP engine's (backend=fsdp); megatron-core fuses its own kernels"
            )
        super().__init__(config)
        self.arch: ArchSpec | None = None
        self._hf_config: object | None = None
        self.optimizer: MegatronOptimizer | None = None
        self.lr_factor: Callable[[int], float] | None = None
        self._lr_step = 0
        self._owns_model_parallel = False
        self._layer_ids: list[int] = []
        self._weights: HFWeights | None = None
        """This rank's parameters as HF tensors and back (from `initialize` on)."""
        self._replays: list[object] = []
        """With routing replay: megatron's `RouterReplay` of each local layer."""

    # ---------------------------------------------------------------- setup

    def initialize(self, ft_spec: FinetuneSpec | None = None) -> None:
        from megatron.core import tensor_parallel
        from transformers import AutoConfig

        cfg = self.config
        if cfg.shared_prefix:
            raise ValueError("shared_prefix is implemented by the FSDP engine only (backend=fsdp)")
        self._hf_config = AutoConfig.from_pretrained(cfg.path, **({"num_labels": 1} if cfg.is_critic else {}))
        if is_vision_config(self._hf_config):
            raise NotImplementedError(
                f"MegatronEngine does not support vision-language models yet ({cfg.path} is "
                f"{self._hf_config.model_type!r}): it has no vision tower, image inputs or multimodal rotary "
                "positions; train it with backend=fsdp"
            )
        if not cpu_mode():
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.compute_dtype = compute_dtype(cfg.dtype, self.device, allowed=_DTYPE_NAMES)
        self.create_process_group()
        torch.manual_seed(cfg.seed)
        if cpu_mode():
            install_cpu_rng_tracker(cfg.seed)
        else:
            tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)

        self.arch = ArchSpec.from_hf_config(self._hf_config, cfg.tensor_parallel_size, is_critic=cfg.is_critic)
        self._check_experts(self.arch)
        dtype = self.compute_dtype
        weights = SafetensorsDir(cfg.path)
        if cfg.is_critic and "score.weight" not in weights:
            weights = SafetensorsDir(cfg.path, extra=new_value_head(cfg.path, cfg.seed))
        with cpu_compat():
            model = build_gpt(self.arch, cfg, dtype).to(self.device)
        # local layer index -> global layer index (megatron numbers layers from 1)
        self._layer_ids = [layer.layer_number - 1 for layer in model.decoder.layers]
        if cfg.routing_replay:
            self._replays = [layer.mlp.router.router_replay for layer in model.decoder.layers]
            for replay in self._replays:
                replay.get_replay_topk = partial(replay_topk, replay)
        self._weights = HFWeights(self.arch, self._layer_ids, cfg.expert_parallel_size)
        self._weights.copy_into(model, weights)
        if ft_spec is None:
            model.requires_grad_(False)
            self.model = model
        else:
            self.model = wrap_ddp(model)
            self._build_optimizer(ft_spec)
        TrainerTuning(cfg.cpu).startup_done(self.device)

    def _check_experts(self, arch: ArchSpec) -> None:
        cfg = self.config
        if not arch.num_experts:
            if cfg.expert_parallel_size != 1 or cfg.routing_replay:
                raise ValueError("expert_parallel_size and routing_replay are for mixture-of-experts models")
            return
        if cfg.tensor_parallel_size != 1:
            raise ValueError(
                "mixture-of-experts models train with tensor_parallel_size=1 (no expert tensor parallelism)"
            )
        if arch.num_experts % cfg.expert_parallel_size != 0:
            raise ValueError(f"expert_parallel_size={cfg.expert_parallel_size} must divide {arch.num_experts} experts")
        if cfg.routing_replay and cfg.gradient_checkpointing:
            raise ValueError("routing_replay with gradient_checkpointing is FSDP's only (backend=fsdp)")
        install_moe_fallbacks()

    def create_process_group(self) -> None:
        from megatron.core import parallel_state as ps

        super().create_process_group()
        tp, pp, ep = (
            self.config.tensor_parallel_size,
            self.config.pipeline_parallel_size,
            self.config.expert_parallel_size,
        )
        if dist.get_world_size() % (tp * pp * ep) != 0:
            raise ValueError(
                f"world size {dist.get_world_size()} is not a multiple of tensor x pipeline x expert parallel size "
                f"{tp} x {pp} x {ep}"
            )
        sizes = (tp, pp, ep)
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
            )
            self._owns_model_parallel = True
        elif (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_expert_model_parallel_world_size(),
        ) != sizes:
            raise RuntimeError(
                "megatron model parallelism is already initialised with other tensor/pipeline/expert sizes"
            )

    def _build_optimizer(self, ft_spec: FinetuneSpec) -> None:
        assert self.model is not None
        self.optimizer = distributed_optimizer(self.model, self.config.optimizer, self.compute_dtype)
        self.lr_factor = self._lr_factor(ft_spec)
        self._set_lr()

    def _set_lr(self) -> None:
        assert self.optimizer is not None and self.lr_factor is not None
        opt = self.config.optimizer
        lr = opt.lr * self.lr_factor(self._lr_step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            group["weight_decay"] = opt.weight_decay * group.get("wd_mult", 1.0)

    def destroy(self) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.router_replay import RouterReplay

        if self._replays:
            RouterReplay.clear_global_router_replay_instances()
            self._replays = []
        if self._owns_model_parallel:
            ps.destroy_model_parallel()
            self._owns_model_parallel = False
        super().destroy()

    def _data_parallel_group(self) -> dist.ProcessGroup:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group(with_context_parallel=True)

    def _advance_lr_schedule(self) -> None:
        self._lr_step += 1
        self._set_lr()

    # ---------------------------------------------------------------- compute

    def _gpt(self) -> torch.nn.Module:
        """The GPTModel itself (inside megatron's DDP wrapper when training)."""
        model = self._module()
        return getattr(model, "module", model)

    def _same_batch_in_model_parallel_group(self, batch: TensorDict) -> TensorDict:
        """The batch of the first rank of this model-parallel (TP x PP) group, on all its ranks."""
        from megatron.core import parallel_state as ps

        group = ps.get_model_parallel_group()
        ranks = dist.get_process_group_ranks(group)
        if len(ranks) == 1:
            return batch
        box: list[object] = [batch.to_dict() if dist.get_rank() == ranks[0] else None]
        dist.broadcast_object_list(box, src=ranks[0], group=group)
        data = box[0]
        assert isinstance(data, dict)
        return TensorDict(data, batch_size=[data["attention_mask"].shape[0]])

    def _microbatches(self, batch: TensorDict) -> tuple[list[PackedBatch], MicroBatchSplit, int]:
        # With experts every forward pass has collectives over the expert-parallel ranks, whose
        # data differ.
        experts = self.arch is not None and bool(self.arch.num_experts) and self.config.expert_parallel_size > 1
        batch = self._same_batch_in_model_parallel_group(batch)
        # On the compute device: the loss function reads the micro-batch's masks beside the
        # log-probabilities (on CPU this moves nothing).
        return self._split_and_pack(batch, same_count_on_all_ranks=experts, to_device=True)

    def _output_weight(self) -> torch.Tensor:
        """The full ``[vocab, hidden]`` LM head weight (gathered over tensor-parallel ranks, with
        gradient flowing back to this rank's slice)."""
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        assert self.arch is not None
        gpt = self._gpt()
        w = gpt.shared_embedding_or_output_weight() if self.arch.tie_word_embeddings else gpt.output_layer.weight
        if self.config.tensor_parallel_size > 1:
            w = gather_from_tensor_model_parallel_region(w.t()).t()
        return w[: self.arch.vocab_size]

    def _token_outputs(
        self, hidden: torch.Tensor, packed: PackedBatch, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-aligned log-probabilities (values, for a critic) and entropies (zeros, for a
        critic) ``[T]`` from the last stage's hidden states ``[T, 1, h]``."""
        hidden = hidden.squeeze(1)
        ids, cu = packed["input_ids"], packed["cu_seqlens"]
        assert isinstance(ids, torch.Tensor) and isinstance(cu, torch.Tensor)
        if self.config.is_critic:
            return token_values(self._gpt().value_head(hidden), cu)
        targets = packed.get("target_ids", ids)
        assert isinstance(targets, torch.Tensor)
        return token_logprobs(
            hidden, self._output_weight(), targets.to(self.device), cu, self.config.logits_chunk_size, with_entropy
        )

    def _schedule(
        self, mbs: list[MicroBatch], head: Callable[..., tuple], forward_only: bool
    ) -> list[dict[str, torch.Tensor]]:
        """Run every micro-batch through megatron's schedule; ``head(packed, weight, hidden)`` runs
        on the last stage and returns what megatron's loss function returns. Returns the heads'
        result dicts in micro-batch order (on the last stage; empty elsewhere)."""
        from megatron.core.packed_seq_params import PackedSeqParams
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def step(data: Iterator[MicroBatch], model: torch.nn.Module) -> tuple[torch.Tensor, Callable[..., tuple]]:
            packed, w = next(data)
            ids, pos, cu = packed["input_ids"], packed["position_ids"], packed["cu_seqlens"]
            assert isinstance(ids, torch.Tensor) and isinstance(pos, torch.Tensor) and isinstance(cu, torch.Tensor)
            cu = cu.to(self.device)
            max_len = int(packed["max_seqlen"])
            thd = PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len, max_seqlen_kv=max_len
            )
            if self._replays:
                self._set_replay(packed)
            hidden = model(ids.to(self.device)[None], pos.to(self.device)[None], None, packed_seq_params=thd)
            return hidden, partial(head, packed, w)

        return get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter(mbs),
            model=[self._module()],
            num_microbatches=len(mbs),
            seq_length=max(int(p["cu_seqlens"][-1]) for p, _ in mbs),  # type: ignore[index]
            micro_batch_size=1,
            forward_only=forward_only,
        )

    def _set_replay(self, packed: PackedBatch) -> None:
        """Give each local layer's router the routes of this micro-batch's tokens to replay."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if "routed_experts" not in packed:
            raise ValueError("routing replay is on but the batch has no 'routed_experts'")
        routes = packed["routed_experts"]
        assert isinstance(routes, torch.Tensor)
        for replay, layer in zip(self._replays, self._layer_ids):
            replay.clear_indices()  # type: ignore[attr-defined]
            replay.set_target_indices(routes[:, layer].to(self.device, torch.int64))  # type: ignore[attr-defined]
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)  # type: ignore[attr-defined]

    def _from_last_stage(self, obj: object) -> object:
        """``obj`` of the last pipeline stage, on every stage."""
        from megatron.core import parallel_state as ps

        if ps.get_pipeline_model_parallel_world_size() == 1:
            return obj
        group = ps.get_pipeline_model_parallel_group()
        box = [obj if ps.is_pipeline_last_stage() else None]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(), group=group)
        return box[0]

    def _forward_passes(
        self, mbs: list[PackedBatch], n_real: int, with_entropy: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        def head(packed: PackedBatch, w: float, hidden: torch.Tensor) -> tuple:
            logp, ent = self._token_outputs(hidden, packed, with_entropy)
            return logp.sum() * 0.0, {"logp": logp, "ent": ent}

        with cpu_compat():
            store = self._schedule([(p, 0.0) for p in mbs], head, forward_only=True)
        if not store:
            return None
        return [(out["logp"].float().cpu(), out["ent"].float().cpu()) for out in store[:n_real]]

    def _loss_head(self, loss_fn: LossFn, total: float, train: bool) -> Callable[..., tuple]:
        def head(packed: PackedBatch, w: float, hidden: torch.Tensor) -> tuple:
            out, ent = self._token_outputs(hidden, packed, with_entropy=True)
            loss, stats = loss_fn(out, ent, packed)
            # copies: megatron rescales the returned loss in place
            reported = {"loss": loss.detach().clone(), **{k: v.detach().clone() for k, v in stats.items()}}
            if not train:
                return loss, reported
            # A zero-weight micro-batch still runs backward (the schedule always does) without
            # touching its loss, which may be NaN (e.g. a mean over no tokens).
            scaled = loss * (w / total) if w > 0 else (out.sum() + ent.sum()) * 0.0
            # (loss, num_tokens, stats): with calculate_per_token_loss megatron leaves it unscaled
            return scaled, torch.ones((), dtype=torch.int), reported

        return head

    def _loss_passes(
        self, mbs: list[PackedBatch], n_real: int, weights: list[float], total: float, loss_fn: LossFn, train: bool
    ) -> list[dict[str, float]]:
        with cpu_compat():
            store = self._schedule(
                list(zip(mbs, weights)), self._loss_head(loss_fn, total, train), forward_only=not train
            )
        per_mb = read_back(store[:n_real])
        return self._from_last_stage(per_mb)  # type: ignore[return-value]

    def _clip_gradients(self, max_norm: float) -> float:
        """Sum the gradients over data-parallel ranks (and the tied embedding's over the first and
        last stage), once per `optim_step` however many `forward_backward` calls accumulated them
        (a second reduction would add the others' gradients again), then clip them unless their
        norm is non-finite."""
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        opt = self.optimizer
        assert opt is not None
        with cpu_compat():
            finalize_model_grads([self._module()])
            opt.prepare_grads()
            grad_norm = float(opt.get_grad_norm())
            if max_norm > 0 and math.isfinite(grad_norm):
                for sub in sub_optimizers(opt):
                    params = sub.get_parameters()
                    if params:
                        clip_grad_by_total_norm_fp32(params, max_norm=max_norm, total_norm=grad_norm)
        return grad_norm

    def _apply_update(self) -> None:
        assert self.optimizer is not None
        with cpu_compat():
            self.optimizer.step_with_ready_grads()

    def _zero_grad(self) -> None:
        assert self.optimizer is not None
        with cpu_compat():
            self._module().zero_grad_buffer()
            self.optimizer.zero_grad()

    # ---------------------------------------------------------------- weights in HF form

    def _hf_model_config(self) -> object:
        assert self._hf_config is not None
        return self._hf_config

    def _hf_weights(self) -> HFWeights:
        assert self._weights is not None
        return self._weights

    def _hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors, one at a time, on every rank, cast to the configured dtype.
        Collective over the model-parallel group (`HFWeights.hf_tensors`)."""
        return self._hf_weights().hf_tensors(self._gpt(), self.device, self.compute_dtype)

    def _save_hf(self, path: str, tokenizer: object | None) -> None:
        tensors = {name: t.cpu().contiguous() for name, t in self._hf_tensors()}
        if dist.get_rank() == 0:
            cfg = self.config
            write_hf_dir(path, tensors, self._hf_config, self.compute_dtype, cfg.is_critic, cfg.path, tokenizer)

    # ---------------------------------------------------------------- checkpoints

    def _load_hf_weights(self, path: str) -> None:
        with cpu_compat():
            self._hf_weights().copy_into(self._gpt(), SafetensorsDir(path))
            if self.optimizer is not None:
                self.optimizer.reload_model_params()

    def _inner_optimizers(self) -> list[torch.optim.Optimizer]:
        assert self.optimizer is not None
        return [sub.optimizer for sub in sub_optimizers(self.optimizer)]

    def _layout(self) -> dict[str, int]:
        cfg = self.config
        return {
            "world_size": dist.get_world_size(),
            "tensor_parallel_size": cfg.tensor_parallel_size,
            "pipeline_parallel_size": cfg.pipeline_parallel_size,
            "expert_parallel_size": cfg.expert_parallel_size,
        }

    def _save_train_state(self, path: str) -> None:
        """Per rank, one `torch.save` file of its parameter shards, optimizer state (when the engine
        has one), LR step, step, version and RNG state; and the parallel layout, which a resumed
        run must share."""
        os.makedirs(path, exist_ok=True)
        state: dict[str, object] = {
            "model": {n: p.detach().cpu().clone() for n, p in self._gpt().named_parameters()},
            "version": self._version,
            "global_step": self._global_step,
            "lr_step": self._lr_step,
            "rng": rng_state(),
        }
        if self.optimizer is not None:
            inner = self._inner_optimizers()
            # The optimizer's own parameters are the (fp32 master) shards it updates.
            state["optim"] = [o.state_dict() for o in inner]
            state["main_params"] = [
                [p.detach().cpu().clone() for g in o.param_groups for p in g["params"]] for o in inner
            ]
        torch.save(state, os.path.join(path, f"megatron_rank{dist.get_rank()}.pt"))
        if dist.get_rank() == 0:
            with open(os.path.join(path, "megatron_layout.json"), "w") as f:
                json.dump(self._layout(), f)

    @torch.no_grad()
    def _load_train_state(self, path: str) -> None:
        with open(self._train_state_file(path, "megatron_layout.json")) as f:
            layout = {"expert_parallel_size": 1, **json.load(f)}  # older checkpoints had no experts
        if layout != self._layout():
            raise ValueError(f"checkpoint {path} was written with layout {layout}, this run has {self._layout()}")
        state = torch.load(os.path.join(path, f"megatron_rank{dist.get_rank()}.pt"), weights_only=False)
        for name, p in self._gpt().named_parameters():
            p.copy_(state["model"][name])
        if self.optimizer is not None and "optim" in state:
            for o, sd, mains in zip(self._inner_optimizers(), state["optim"], state["main_params"]):
                for p, saved in zip((p for g in o.param_groups for p in g["params"]), mains):
                    p.copy_(saved)
                o.load_state_dict(sd)
        self._version = state["version"]
        self._global_step = state["global_step"]
        self._lr_step = state["lr_step"]
        if self.optimizer is not None:
            self._set_lr()
        set_rng_state(state["rng"])


__all__ = ["MegatronEngine"]
