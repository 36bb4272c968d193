"""The megatron-core objects `MegatronEngine` trains, built for packed sequences.

`build_gpt` makes megatron-core's `GPTModel` with the local (non-Transformer-Engine) layers and
tensor/pipeline/expert parallelism, its forward returning the last stage's hidden states (the
engine applies the head chunk by chunk; a critic's last stage gets a scalar value head instead of
the vocabulary head). megatron-core's packed attention kernels exist only in Transformer Engine and
its local attention refuses packing, so the layers get our core attention, `PackedCoreAttention`:
causal SDPA within each sequence (`areal_lite.engines.train.varlen_attention`, the function
FSDPEngine uses), ``sum(L_i^2)`` work and never across sequences. `replay_topk` is the router
replay hook for mixture-of-experts layers; `wrap_ddp` and `distributed_optimizer` give megatron's
`DistributedDataParallel` and its distributed optimizer (optimizer state sharded over the
data-parallel ranks).

On CPU megatron-core runs under `mcore_cpu.cpu_compat`: the engine calls `build_gpt` within it,
`wrap_ddp` and `distributed_optimizer` enter it themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from areal_lite.api.config import OptimizerConfig, TrainEngineConfig
from areal_lite.engines.train.mcore_convert import ArchSpec
from areal_lite.engines.train.mcore_cpu import cpu_compat
from areal_lite.engines.train.varlen_attention import varlen_sdpa_attention

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer


def replay_topk(
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


class PackedCoreAttention(torch.nn.Module):
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


def build_gpt(arch: ArchSpec, cfg: TrainEngineConfig, dtype: torch.dtype) -> torch.nn.Module:
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
    spec.submodules.self_attention.submodules.core_attention = PackedCoreAttention
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


def wrap_ddp(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in megatron's `DistributedDataParallel`, for its distributed optimizer (fp32
    gradient reduction, not overlapped with the backward pass)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_cfg = DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False
    )
    with cpu_compat():
        return DistributedDataParallel(model.config, ddp_cfg, model)


def distributed_optimizer(model: torch.nn.Module, opt: OptimizerConfig, dtype: torch.dtype) -> MegatronOptimizer:
    """megatron's distributed Adam over the `wrap_ddp` ``model``, without clipping of its own (the
    engine clips after its finiteness check) and without an LR schedule (the engine sets the LR
    and applies ``wd_mult`` to each group)."""
    from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer, get_standard_config_overrides

    ocfg = McoreOptimizerConfig(
        optimizer="adam",
        lr=opt.lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.beta1,
        adam_beta2=opt.beta2,
        adam_eps=opt.eps,
        # clipping happens in `MegatronEngine._clip_gradients`, after the finiteness check
        clip_grad=0.0,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=True,
    )
    # megatron's standard overrides give biases and other 1-D parameters (norm weights)
    # wd_mult=0, as FSDPEngine exempts them; `MegatronEngine._set_lr` applies wd_mult, which
    # megatron leaves to its own scheduler.
    with cpu_compat():
        return get_megatron_optimizer(ocfg, [model], config_overrides=get_standard_config_overrides(ocfg))


def sub_optimizers(opt: MegatronOptimizer) -> list[MegatronOptimizer]:
    """The optimizers inside megatron's `ChainedOptimizer` (dense / expert parameter groups)."""
    return list(getattr(opt, "chained_optimizers", [opt]))


__all__ = ["PackedCoreAttention", "build_gpt", "distributed_optimizer", "replay_topk", "sub_optimizers", "wrap_ddp"]
