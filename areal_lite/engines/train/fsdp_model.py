"""The FSDP engine's model: a HF model loaded for training (`load_hf_model`), with LoRA adapters
(`add_lora_adapters`), sharded with FSDP2 (`shard`) under `PackedModel`, the root module whose
forward runs a packed micro-batch through the decoder and applies the head chunk by chunk
(`areal_lite.engines.train.logprob`), so full-vocabulary logits of the whole micro-batch never exist
at once.

Attention never crosses sequence boundaries: with ``attn_impl=sdpa`` (the default) attention runs
per sequence (`areal_lite.engines.train.varlen_attention`), with ``flash_attention_2`` on CUDA the
sequence boundaries go to its varlen kernel, and with ``eager`` position ids restart per sequence
with the KV cache off so that transformers masks each sequence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from areal_lite.api.config import LoRAConfig, TrainEngineConfig
from areal_lite.engines.train.logprob import logprobs_from_hidden, token_logprobs, token_values
from areal_lite.engines.train.multimodal import PackedImages, VisionLanguageModel, decoder_layers
from areal_lite.engines.train.shared_prefix import SharedPrefixLayout
from areal_lite.engines.train.varlen_attention import register_varlen_sdpa
from areal_lite.utils.lora import PEFT_PREFIX, peft_config
from areal_lite.utils.vision import is_vision_config

if TYPE_CHECKING:
    from peft import PeftModel

COMPILE_BACKEND = "inductor"
"""``torch.compile``'s backend for ``compile_layers`` (tests swap in ``aot_eager``, which traces the
same graphs and their backward without generating kernels)."""
HF_PREFIX = "hf."
"""What `PackedModel` puts before the HF model's parameter names."""


class PackedModel(nn.Module):
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
        self.vision = VisionLanguageModel(hf) if is_vision_config(hf.config) else None
        """A vision-language model's images and positions (None for a text model)."""

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        with_entropy: bool,
        tree: SharedPrefixLayout | None = None,
        target_ids: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        images: PackedImages | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-aligned log-probabilities and entropies (values and zeros for a critic) of one
        packed micro-batch; ``max_seqlen``, its longest sequence, spares a read of ``cu_seqlens``
        from the device; ``images``, a vision-language model's images and positions."""
        if tree is not None:
            return self._tree_forward(tree, with_entropy)
        hidden = self._hidden(input_ids, position_ids, cu_seqlens, max_seqlen, images=images)
        if self.is_critic:
            return token_values(self.hf.score(hidden), cu_seqlens)
        hidden, weight = self._head(hidden)
        tokens = input_ids if target_ids is None else target_ids
        return token_logprobs(hidden, weight, tokens, cu_seqlens, self.chunk_size, with_entropy)

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
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int | None = None,
        images: PackedImages | None = None,
        **extra: object,
    ) -> torch.Tensor:
        # Sequence boundaries for varlen attention (ours, or flash-attention's); built-in
        # sdpa/eager ignore them and mask by the restarting position ids instead.
        max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if max_seqlen is None else max_seqlen
        varlen = {
            "cu_seq_lens_q": cu_seqlens,
            "cu_seq_lens_k": cu_seqlens,
            "max_length_q": max_len,
            "max_length_k": max_len,
        }
        if self.vision is not None:
            if images is None:
                raise ValueError("a vision-language model's forward needs the micro-batch's images and positions")
            return self.vision.hidden(input_ids, position_ids, images, **varlen, **extra)
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


def load_hf_model(path: str, config: TrainEngineConfig, device: torch.device) -> nn.Module:
    """The HF model (a value model with ``config.is_critic``) of directory ``path`` in fp32, with
    the engine's attention; a vision-language model's vision tower with plain sdpa, its
    parameters frozen with ``config.freeze_vision_tower``."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForTokenClassification,
    )

    attn = config.attn_impl
    if attn == "sdpa":
        # The engine only ever runs packed rows: SDPA per sequence costs sum(L_i^2) where
        # transformers' sdpa would mask a T x T product.
        attn = register_varlen_sdpa()
    kwargs = {"dtype": torch.float32, "attn_implementation": attn}
    if is_vision_config(AutoConfig.from_pretrained(path)):
        if config.is_critic:
            raise ValueError(f"{path} is a vision-language model: a critic (value head) of one is not supported yet")
        # The vision tower attends within each image, never over the packed row: plain sdpa.
        kwargs["attn_implementation"] = {"": attn, "text_config": attn, "vision_config": "sdpa"}
        hf = AutoModelForImageTextToText.from_pretrained(path, **kwargs)
        hf.config.use_cache = hf.config.text_config.use_cache = False
        if config.freeze_vision_tower:
            VisionLanguageModel(hf).tower.requires_grad_(False)
        return hf
    if config.is_critic:
        # The value head (`score`) is new when loading a causal-LM directory; its init is
        # seeded identically on every rank by `FSDPEngine.initialize`.
        hf = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, **kwargs)
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    hf.config.use_cache = False
    if config.liger_kernels:
        apply_liger_kernels(hf, device)
    return hf


def apply_liger_kernels(hf: nn.Module, device: torch.device) -> None:
    """Swap ``hf``'s RMS norms, rotary embedding and SwiGLU MLPs for Liger's Triton kernels (the
    parameters and their names stay; the head is not touched: `fused_head` scores the tokens)."""
    if device.type != "cuda":
        raise ValueError(f"liger_kernels needs CUDA (Liger's kernels are Triton kernels); this engine runs on {device}")
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError as e:
        raise ValueError('liger_kernels needs the liger-kernel package: pip install -e ".[liger]"') from e
    _apply_liger_kernel_to_instance(
        model=hf, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False
    )


def add_lora_adapters(hf: nn.Module, lora: LoRAConfig) -> tuple[PeftModel, dict[str, str]]:
    """Wrap ``hf`` with peft's LoRA (before sharding: FSDP then shards the adapters with their
    layers), after which only the adapters require gradients. Returns peft's wrapper and each
    adapter parameter's name in the HF model -> its name in a PEFT file."""
    from peft import get_peft_model
    from peft.utils import get_peft_model_state_dict

    peft = get_peft_model(hf, peft_config(lora))
    # Names as a PEFT file gives them, by peft's own renaming of the wrapper's state dict.
    tagged = {PEFT_PREFIX + n: torch.empty(0) for n, p in hf.named_parameters() if p.requires_grad}
    renamed = {id(t): name for name, t in get_peft_model_state_dict(peft, state_dict=tagged).items()}
    return peft, {n.removeprefix(PEFT_PREFIX): renamed[id(t)] for n, t in tagged.items()}


def shard(hf: nn.Module, config: TrainEngineConfig, device: torch.device, dtype: torch.dtype) -> PackedModel:
    """Every decoder layer of ``hf`` (and vision block of a vision-language model), then the
    `PackedModel` root around it, sharded with
    ``fully_shard`` over all ranks; with a compute ``dtype`` other than fp32, mixed precision
    (fp32 master weights, ``dtype`` compute, fp32 gradient reduction). With
    ``config.compile_layers`` the decoder layers are compiled first."""
    mp = (
        MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        if dtype != torch.float32
        else MixedPrecisionPolicy()
    )
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    layers = list(decoder_layers(hf))
    if config.compile_layers:
        for layer in layers:  # in place (`nn.Module.compile`): names stay; FSDP's hooks run eagerly
            layer.compile(dynamic=True, backend=COMPILE_BACKEND)
    if is_vision_config(hf.config):
        layers += list(VisionLanguageModel(hf).tower.blocks)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    model = PackedModel(hf, config.is_critic, config.logits_chunk_size)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


__all__ = ["HF_PREFIX", "PackedModel", "add_lora_adapters", "apply_liger_kernels", "load_hf_model", "shard"]
