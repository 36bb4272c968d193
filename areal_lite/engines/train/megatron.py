"""`MegatronEngine`: a Qwen2/Llama/Qwen3/Qwen3-MoE causal language model trained with megatron-core.

The same contract as `FSDPEngine` (an actor cannot tell them apart; ``backend: megatron`` in the
actor's config swaps them through `make_train_engine`), built on megatron-core's pieces: a
`GPTModel` with the local (non-Transformer-Engine) layers and tensor parallelism, megatron's
`DistributedDataParallel` with its distributed optimizer (optimizer state sharded over the
data-parallel ranks), and megatron's RNG tracker. Weights come from and go to HF directories and
HF-named tensors through `areal_lite.engines.train.mcore_convert`.

Packed sequences: each micro-batch runs as one packed row of ``T`` tokens in megatron's ``THD``
format (``PackedSeqParams`` with the micro-batch's ``cu_seqlens``), so rotary positions restart per
sequence (megatron's own THD rotary code). megatron-core's packed attention kernels exist only in
Transformer Engine and its local attention refuses packing, so the layers get our core attention,
`_PackedCoreAttention`: causal SDPA within each sequence (`areal_lite.engines.train.varlen_attention`, the
function FSDPEngine uses), ``sum(L_i^2)`` work and never across sequences. The last stage's hidden
states ``[T, h]`` are scored chunk by chunk (`areal_lite.engines.train.logprob`, as in FSDPEngine), and the
loss function sees the same packed micro-batch as with FSDP.

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

import copy
import glob
import json
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from tensordict import TensorDict

from areal_lite.api.config import TrainEngineConfig
from areal_lite.api.engine import LossFn, PackedBatch
from areal_lite.api.io import FinetuneSpec
from areal_lite.cpu import TrainerTuning, compute_dtype
from areal_lite.engines.train.base import TrainEngineBase
from areal_lite.engines.train.logprob import align_to_tokens, logprobs_from_hidden, next_token_labels
from areal_lite.engines.train.mcore_convert import ArchSpec, hf_to_mcore, mcore_split_dim, mcore_to_hf
from areal_lite.engines.train.mcore_cpu import cpu_compat, cpu_mode, install_cpu_rng_tracker, install_moe_fallbacks
from areal_lite.engines.train.varlen_attention import varlen_sdpa_attention
from areal_lite.utils.data import pack_batch, split_microbatches, unpack_sequences
from areal_lite.utils.recover import rng_state, set_rng_state

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer

_DTYPE_NAMES = ("float32", "bfloat16")
_LAYER_PREFIX = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")

MicroBatch = tuple[PackedBatch, float]
"""A micro-batch as the schedule sees it: packed, and its loss weight."""


class _SafetensorsDir(Mapping[str, torch.Tensor]):
    """HF tensors of a model directory, read one at a time from its safetensors files, plus
    ``extra`` tensors that the directory lacks."""

    def __init__(self, path: str, extra: dict[str, torch.Tensor] | None = None) -> None:
        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {path}: MegatronEngine loads safetensors checkpoints")
        self._where: dict[str, str] = {}
        for f in files:
            with safe_open(f, framework="pt") as h:
                for k in h.keys():  # noqa: SIM118 (the handle is not iterable)
                    self._where[k] = f
        self._extra = extra or {}

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name in self._extra:
            return self._extra[name]
        if name not in self._where:
            raise KeyError(f"{name} is not in the checkpoint")
        with safe_open(self._where[name], framework="pt") as h:
            return h.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter({**self._where, **self._extra})

    def __len__(self) -> int:
        return len(set(self._where) | set(self._extra))


def _sub_optimizers(opt: MegatronOptimizer) -> list[MegatronOptimizer]:
    """The optimizers inside megatron's `ChainedOptimizer` (dense / expert parameter groups)."""
    return list(getattr(opt, "chained_optimizers", [opt]))


def _new_value_head(path: str, seed: int) -> dict[str, torch.Tensor]:
    """The ``score`` layer HF initialises for a critic loaded from a causal-LM directory, drawn
    exactly as FSDPEngine draws it (same seed, same loading call), so both engines start equal."""
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(seed)
    hf = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    return {f"score.{k}": v.detach().clone() for k, v in hf.score.state_dict().items()}


def _replay_topk(
    replay: object,
    scores: torch.Tensor,
    topk: int,
    num_groups: int | None = None,
    group_topk: int | None = None,
    default_compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron's `RouterReplay.get_replay_topk` with `areal_lite.utils.moe`'s convention for
    tokens without a recorded route (-1: the last token of a sequence, environment tokens): they
    take the router's own top-k instead of an invalid index."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    action = replay.router_replay_action  # type: ignore[attr-defined]
    if action not in (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD):
        return RouterReplay.get_replay_topk(replay, scores, topk, num_groups, group_topk, default_compute_topk)  # type: ignore[arg-type]
    forward = action == RouterReplayAction.REPLAY_FORWARD
    target = replay.target_topk_idx if forward else replay.replay_backward_list.pop(0)  # type: ignore[attr-defined]
    assert default_compute_topk is not None
    _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
    target = target.to(own.device, own.dtype)
    chosen = torch.where(target[:, :1] >= 0, target, own)
    return scores.gather(1, chosen), chosen


class _PackedCoreAttention(torch.nn.Module):
    """megatron core attention over THD-packed sequences: causal SDPA within each sequence.

    Takes the place of the local spec's `DotProductAttention` (which refuses packed sequences);
    receives ``query [T, heads, dim]`` and ``key``/``value [T, kv_heads, dim]`` of this
    tensor-parallel rank and returns ``[T, heads * dim]``. Attention dropout, when configured, draws
    from the default generator rather than megatron's tensor-parallel RNG fork.
    """

    def __init__(self, config: object, softmax_scale: float | None = None, **kwargs: object) -> None:
        super().__init__()
        self.dropout = float(config.attention_dropout)  # type: ignore[attr-defined]
        self.scale = softmax_scale

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: object = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: object = None,
    ) -> torch.Tensor:
        if packed_seq_params is None or attention_bias is not None:
            raise ValueError("MegatronEngine's attention runs THD-packed sequences only, without attention bias")
        out, _ = varlen_sdpa_attention(
            self,
            *(t.transpose(0, 1).unsqueeze(0) for t in (query, key, value)),
            None,
            dropout=self.dropout,
            scaling=self.scale,
            cu_seq_lens_q=packed_seq_params.cu_seqlens_q,  # type: ignore[attr-defined]
        )
        return out.reshape(out.shape[1], -1)


def _build_gpt(arch: ArchSpec, cfg: TrainEngineConfig, dtype: torch.dtype) -> torch.nn.Module:
    """megatron-core GPTModel (local layers) for ``arch``: this pipeline stage's layers, whose
    forward returns hidden states ``[s, b, h]`` instead of logits (the engine applies the head
    chunk by chunk)."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    class HiddenStatesGPT(GPTModel):
        def _postprocess(self, hidden_states: torch.Tensor, **kwargs: object) -> torch.Tensor:
            return hidden_states

    spec = get_gpt_layer_local_spec(
        num_experts=arch.num_experts or None, moe_grouped_gemm=False, qk_layernorm=arch.qk_norm, normalization="RMSNorm"
    )
    spec.submodules.self_attention.submodules.core_attention = _PackedCoreAttention
    moe = (
        {
            "num_moe_experts": arch.num_experts,
            "moe_router_topk": arch.experts_per_token,
            "moe_ffn_hidden_size": arch.moe_intermediate_size,
            # softmax over the top-k logits = HF's softmax, top-k, renormalise
            "moe_router_pre_softmax": not arch.norm_topk_prob,
            "moe_router_load_balancing_type": "none",
            "moe_aux_loss_coeff": 0.0,
            "expert_model_parallel_size": cfg.expert_parallel_size,
            "moe_enable_routing_replay": cfg.routing_replay,
        }
        if arch.num_experts
        else {}
    )
    recompute = (
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
        if cfg.gradient_checkpointing
        else {}
    )
    tcfg = TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=arch.attention_dropout,
        tensor_model_parallel_size=cfg.tensor_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_parallel_size,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        # Each micro-batch loss carries its share of the global batch: sum gradients over
        # data-parallel ranks instead of averaging them.
        calculate_per_token_loss=True,
        use_cpu_initialization=True,
        # fused kernels are CUDA-only, or change numerics against the HF reference
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # micro-batches differ in length: pipeline stages exchange shapes first
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # takes different token counts on different ranks
        qk_layernorm=arch.qk_norm,
        **moe,
        **recompute,
    )
    gpt = HiddenStatesGPT(
        config=tcfg,
        transformer_layer_spec=spec,
        vocab_size=arch.padded_vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
        rope_scaling=arch.llama3_rope_factor is not None,
        rope_scaling_factor=arch.llama3_rope_factor or 8.0,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )
    if arch.is_critic and gpt.post_process:
        # a value model: the vocabulary head gives way to a scalar head, replicated over TP ranks
        gpt.output_layer = None
        gpt.value_head = torch.nn.Linear(arch.hidden_size, 1, dtype=dtype)
    return gpt


class MegatronEngine(TrainEngineBase):
    """megatron-core train engine. See the module docstring; the methods follow `TrainEngine`, the
    backend-independent ones are `TrainEngineBase`'s."""

    def __init__(self, config: TrainEngineConfig) -> None:
        if config.lora.enabled:
            raise ValueError(
                "LoRA (lora.rank > 0) is not supported by the megatron backend: use backend=fsdp, which trains "
                "peft adapters, or set lora.rank=0"
            )
        super().__init__(config)
        self.arch: ArchSpec | None = None
        self._hf_config: object | None = None
        self.optimizer: MegatronOptimizer | None = None
        self.lr_factor: Callable[[int], float] | None = None
        self._lr_step = 0
        self._owns_model_parallel = False
        self._layer_ids: list[int] = []
        self._stage_specs: list[list[tuple[str, list[tuple[str, tuple[int, ...]]]]]] | None = None
        self._replays: list[object] = []
        """With routing replay: megatron's `RouterReplay` of each local layer."""

    # ---------------------------------------------------------------- setup

    def initialize(self, ft_spec: FinetuneSpec | None = None) -> None:
        from megatron.core import tensor_parallel
        from transformers import AutoConfig

        cfg = self.config
        if cfg.shared_prefix:
            raise ValueError("shared_prefix is implemented by the FSDP engine only (backend=fsdp)")
        if not cpu_mode():
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.compute_dtype = compute_dtype(cfg.dtype, self.device, allowed=_DTYPE_NAMES)
        self.create_process_group()
        torch.manual_seed(cfg.seed)
        if cpu_mode():
            install_cpu_rng_tracker(cfg.seed)
        else:
            tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)

        self._hf_config = AutoConfig.from_pretrained(cfg.path, **({"num_labels": 1} if cfg.is_critic else {}))
        self.arch = ArchSpec.from_hf_config(self._hf_config, cfg.tensor_parallel_size, is_critic=cfg.is_critic)
        self._check_experts(self.arch)
        dtype = self.compute_dtype
        weights = _SafetensorsDir(cfg.path)
        if cfg.is_critic and "score.weight" not in weights:
            weights = _SafetensorsDir(cfg.path, extra=_new_value_head(cfg.path, cfg.seed))
        with cpu_compat():
            model = _build_gpt(self.arch, cfg, dtype).to(self.device)
        # local layer index -> global layer index (megatron numbers layers from 1)
        self._layer_ids = [layer.layer_number - 1 for layer in model.decoder.layers]
        if cfg.routing_replay:
            self._replays = [layer.mlp.router.router_replay for layer in model.decoder.layers]
            for replay in self._replays:
                replay.get_replay_topk = partial(_replay_topk, replay)
        self._copy_hf_into(model, weights)
        if ft_spec is None:
            model.requires_grad_(False)
            self.model = model
        else:
            self.model = self._wrap_ddp(model)
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

    def _wrap_ddp(self, model: torch.nn.Module) -> torch.nn.Module:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp_cfg = DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False
        )
        with cpu_compat():
            return DistributedDataParallel(model.config, ddp_cfg, model)

    def _build_optimizer(self, ft_spec: FinetuneSpec) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides

        opt = self.config.optimizer
        dtype = self.compute_dtype
        ocfg = OptimizerConfig(
            optimizer="adam",
            lr=opt.lr,
            weight_decay=opt.weight_decay,
            adam_beta1=opt.beta1,
            adam_beta2=opt.beta2,
            adam_eps=opt.eps,
            # clipping happens in `_clip_gradients`, after the finiteness check
            clip_grad=0.0,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
            use_distributed_optimizer=True,
        )
        assert self.model is not None
        # megatron's standard overrides give biases and other 1-D parameters (norm weights)
        # wd_mult=0, as FSDPEngine exempts them; `_set_lr` applies wd_mult, which megatron leaves
        # to its own scheduler.
        with cpu_compat():
            self.optimizer = get_megatron_optimizer(
                ocfg, [self.model], config_overrides=get_standard_config_overrides(ocfg)
            )
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

    def _microbatches(self, batch: TensorDict) -> tuple[list[PackedBatch], torch.Tensor, int]:
        """Packed micro-batches of this rank's data, the order-restoring permutation, and how many
        are real. With experts, every forward pass has collectives over the expert-parallel ranks
        (whose data differ): a rank with fewer micro-batches repeats its first with weight 0."""
        from dataclasses import replace

        spec = self.config.mb_spec
        batch = self._same_batch_in_model_parallel_group(batch)
        split = split_microbatches(batch, spec)
        n = len(split.mbs)
        if self.arch is not None and self.arch.num_experts and self.config.expert_parallel_size > 1:
            most = torch.tensor([n], device=self.device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            if n < int(most):
                split = split_microbatches(batch, replace(spec, n_mbs=int(most)))
            n = len(split.mbs)
            most = torch.tensor([n], device=self.device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
        packed = [pack_batch(mb) for mb in split.mbs]
        n_real = len(packed)
        if self.arch is not None and self.arch.num_experts and self.config.expert_parallel_size > 1:
            packed += [packed[0]] * (int(most) - n_real)
        return packed, split.restore_order, n_real

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
            # the hidden state at t has read tokens[: t + 1]: it values the state in which token
            # t + 1 is generated, so values are aligned to the token like log-probabilities
            values = align_to_tokens(self._gpt().value_head(hidden).squeeze(-1).float(), cu)
            return values, torch.zeros_like(values)
        targets = packed.get("target_ids", ids)
        assert isinstance(targets, torch.Tensor)
        logp, entropy = logprobs_from_hidden(
            hidden,
            self._output_weight(),
            next_token_labels(targets.to(self.device)),
            chunk_size=self.config.logits_chunk_size,
            with_entropy=with_entropy,
        )
        logp = align_to_tokens(logp, cu)
        entropy = align_to_tokens(entropy, cu) if entropy is not None else torch.zeros_like(logp)
        return logp, entropy

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

    @torch.no_grad()
    def forward(
        self, batch: TensorDict, *, with_entropy: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        model = self._module()
        model.eval()
        seqlen = batch["attention_mask"].shape[1]
        mbs, order, n_real = self._microbatches(batch)

        def head(packed: PackedBatch, w: float, hidden: torch.Tensor) -> tuple:
            logp, ent = self._token_outputs(hidden, packed, with_entropy)
            return logp.sum() * 0.0, {"logp": logp, "ent": ent}

        with cpu_compat():
            store = self._schedule([(p, 0.0) for p in mbs], head, forward_only=True)
        result = None
        if store:
            outs, ents = [], []
            for packed, out in zip(mbs[:n_real], store[:n_real]):
                cu = packed["cu_seqlens"]
                assert isinstance(cu, torch.Tensor)
                outs.append(unpack_sequences(out["logp"].float().cpu(), cu, seqlen))
                ents.append(unpack_sequences(out["ent"].float().cpu(), cu, seqlen))
            result = (torch.cat(outs)[order], torch.cat(ents)[order])
        lp, ent = self._from_last_stage(result)  # type: ignore[misc]
        return (lp, ent) if with_entropy else lp

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

    def _loss_microbatches(self, batch: TensorDict) -> tuple[list[PackedBatch], int]:
        mbs, _, n_real = self._microbatches(batch)
        return mbs, n_real

    def _loss_passes(
        self, mbs: list[PackedBatch], n_real: int, weights: list[float], total: float, loss_fn: LossFn, train: bool
    ) -> list[dict[str, float]]:
        model = self._module()
        model.train(train)
        with cpu_compat():
            store = self._schedule(
                list(zip(mbs, weights)), self._loss_head(loss_fn, total, train), forward_only=not train
            )
        per_mb = [{k: float(v) for k, v in out.items()} for out in store[:n_real]]
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
                for sub in _sub_optimizers(opt):
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

    def _global_name(self, local: str, ep_rank: int | None = None) -> str:
        """A parameter's name with this stage's local layer index replaced by the global one, and
        a local expert's index by the global index it has on expert-parallel rank ``ep_rank``
        (default: this rank's)."""
        from megatron.core import parallel_state as ps

        name = _LAYER_PREFIX.sub(lambda m: f"decoder.layers.{self._layer_ids[int(m.group(1))]}.", local)
        if self.arch is None or not self.arch.num_experts:
            return name
        rank = ps.get_expert_model_parallel_rank() if ep_rank is None else ep_rank
        per_rank = self.arch.num_experts // self.config.expert_parallel_size
        return _LOCAL_EXPERT.sub(lambda m: f".local_experts.{rank * per_rank + int(m.group(1))}.", name)

    def _global_names(self, local: str) -> list[str]:
        """The global names of parameter ``local`` on every expert-parallel rank (one name but for
        experts, of which each rank holds its own)."""
        if self.arch is None or not self.arch.num_experts or not _LOCAL_EXPERT.search(local):
            return [self._global_name(local)]
        return [self._global_name(local, r) for r in range(self.config.expert_parallel_size)]

    def _is_tied_copy(self, name: str) -> bool:
        """The last stage's copy of a tied embedding (PP > 1): not a weight of its own."""
        assert self.arch is not None
        return name == "output_layer.weight" and self.arch.tie_word_embeddings

    @torch.no_grad()
    def _copy_hf_into(self, gpt: torch.nn.Module, hf: Mapping[str, torch.Tensor]) -> None:
        from megatron.core import parallel_state as ps

        assert self.arch is not None
        params = dict(getattr(gpt, "module", gpt).named_parameters())
        sources = {
            name: "embedding.word_embeddings.weight" if self._is_tied_copy(name) else self._global_name(name)
            for name in params
        }
        tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        converted = hf_to_mcore(hf, self.arch, tp_rank, tp, names=set(sources.values()))
        for name, p in params.items():
            p.copy_(converted[sources[name]].to(p.dtype))

    def _stage_param_specs(self) -> list[list[tuple[str, list[tuple[str, tuple[int, ...]]]]]]:
        """For every pipeline stage: its local parameter names and the HF tensors (names, shapes)
        each one converts to. Known on every rank, so that all take part in the same collectives."""
        from megatron.core import parallel_state as ps

        if self._stage_specs is None:
            assert self.arch is not None
            tp = ps.get_tensor_model_parallel_world_size()
            mine = []
            for name, p in self._gpt().named_parameters():
                if self._is_tied_copy(name):
                    continue
                specs = []
                for gname in self._global_names(name):
                    n_shards = 1 if mcore_split_dim(gname) is None else tp
                    meta = [torch.empty(p.shape, device="meta") for _ in range(n_shards)]
                    specs += [(hf, tuple(t.shape)) for hf, t in mcore_to_hf(gname, meta, self.arch)]
                mine.append((name, specs))
            stages: list[object] = [None] * ps.get_pipeline_model_parallel_world_size()
            dist.all_gather_object(stages, mine, group=ps.get_pipeline_model_parallel_group())
            self._stage_specs = stages  # type: ignore[assignment]
        return self._stage_specs  # type: ignore[return-value]

    def _hf_model_config(self) -> object:
        assert self._hf_config is not None
        return self._hf_config

    @torch.no_grad()
    def _hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors, one at a time, on every rank, cast to the configured dtype.
        Collective over the model-parallel group: every rank iterates to the end. Each stage
        gathers its parameters over tensor-parallel ranks, then broadcasts them to the others;
        data-parallel replicas hold identical weights, so nothing runs across them."""
        from megatron.core import parallel_state as ps

        assert self.arch is not None
        tp = ps.get_tensor_model_parallel_world_size()
        pp_group = ps.get_pipeline_model_parallel_group()
        pp_ranks = dist.get_process_group_ranks(pp_group)
        my_stage = ps.get_pipeline_model_parallel_rank()
        local = dict(self._gpt().named_parameters())
        dtype = self.compute_dtype
        for stage, specs in enumerate(self._stage_param_specs()):
            for name, hf_specs in specs:
                tensors: list[torch.Tensor]
                if stage == my_stage:
                    gnames = self._global_names(name)
                    part = local[name].detach().to(self.device)
                    if len(gnames) > 1:  # an expert: each expert-parallel rank holds its own
                        parts = [torch.empty_like(part) for _ in gnames]
                        dist.all_gather(parts, part.contiguous(), group=ps.get_expert_model_parallel_group())
                        held = [(g, [p]) for g, p in zip(gnames, parts)]
                    elif tp > 1 and mcore_split_dim(gnames[0]) is not None:
                        shards = [torch.empty_like(part) for _ in range(tp)]
                        dist.all_gather(shards, part.contiguous(), group=ps.get_tensor_model_parallel_group())
                        held = [(gnames[0], shards)]
                    else:
                        held = [(gnames[0], [part])]
                    # copies: replicated parameters are views into megatron's live buffers
                    tensors = [
                        t.to(dtype=dtype, copy=True) for g, shards in held for _, t in mcore_to_hf(g, shards, self.arch)
                    ]
                else:
                    tensors = [torch.empty(shape, dtype=dtype, device=self.device) for _, shape in hf_specs]
                for (hf_name, _), t in zip(hf_specs, tensors):
                    if len(pp_ranks) > 1:
                        dist.broadcast(t, src=pp_ranks[stage], group=pp_group)
                    yield hf_name, t

    def _save_hf(self, path: str, tokenizer: object | None) -> None:
        from huggingface_hub import save_torch_state_dict
        from transformers import GenerationConfig

        tensors = {name: t.cpu().contiguous() for name, t in self._hf_tensors()}
        if dist.get_rank() != 0:
            return
        os.makedirs(path, exist_ok=True)
        for stale in glob.glob(os.path.join(path, "*.safetensors")) + glob.glob(
            os.path.join(path, "*.safetensors.index.json")
        ):
            os.remove(stale)
        hf_config = copy.deepcopy(self._hf_config)
        hf_config.dtype = str(self.compute_dtype).removeprefix("torch.")
        if self.config.is_critic:
            hf_config.architectures = [
                a.replace("ForCausalLM", "ForTokenClassification") for a in hf_config.architectures or []
            ]
        hf_config.save_pretrained(path)
        try:
            GenerationConfig.from_pretrained(self.config.path).save_pretrained(path)
        except OSError:
            pass  # the source directory had no generation config
        save_torch_state_dict(tensors, path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)  # type: ignore[attr-defined]

    # ---------------------------------------------------------------- checkpoints

    def _load_hf_weights(self, path: str) -> None:
        with cpu_compat():
            self._copy_hf_into(self._gpt(), _SafetensorsDir(path))
            if self.optimizer is not None:
                self.optimizer.reload_model_params()

    def _inner_optimizers(self) -> list[torch.optim.Optimizer]:
        assert self.optimizer is not None
        return [sub.optimizer for sub in _sub_optimizers(self.optimizer)]

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
