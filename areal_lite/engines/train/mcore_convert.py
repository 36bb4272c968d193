"""HF <-> megatron-core weight conversion for the Qwen2, Llama, Qwen3 and Qwen3-MoE architectures.

mbridge does this for many architectures but only with Transformer Engine's layer names; our
`MegatronEngine` builds megatron-core's local (non-TE) GPT layers, whose parameters map to HF's as
follows (per layer ``i``, ``L = decoder.layers.i``, ``H = model.layers.i``):

==========================================  =================================================
megatron-core                               HF
==========================================  =================================================
``embedding.word_embeddings.weight``        ``model.embed_tokens.weight`` (vocab rows split)
``L.input_layernorm.weight``                ``H.input_layernorm.weight``
``L.self_attention.linear_qkv.{weight,bias}``  ``H.self_attn.{q,k,v}_proj.{weight,bias}``
``L.self_attention.linear_proj.weight``     ``H.self_attn.o_proj.weight`` (columns split)
``L.pre_mlp_layernorm.weight``              ``H.post_attention_layernorm.weight``
``L.mlp.linear_fc1.weight``                 ``H.mlp.{gate,up}_proj.weight``
``L.mlp.linear_fc2.weight``                 ``H.mlp.down_proj.weight`` (columns split)
``decoder.final_layernorm.weight``          ``model.norm.weight``
``output_layer.weight``                     ``lm_head.weight`` (absent when tied)
``value_head.{weight,bias}`` (critics)      ``score.{weight,bias}`` (token classification)
==========================================  =================================================

Qwen3 adds per-head norms on queries and keys (``L.self_attention.{q,k}_layernorm.weight`` ``<->``
``H.self_attn.{q,k}_norm.weight``). In a Qwen3-MoE layer the MLP is a router and experts, in the
layout of HF checkpoints (one tensor per expert and projection, what ``save_pretrained`` writes;
the runtime's stacked experts are `areal_lite.utils.hf_layout`'s business):

==================================================  =========================================
megatron-core                                       HF
==================================================  =========================================
``L.mlp.router.weight``                             ``H.mlp.gate.weight``
``L.mlp.experts.local_experts.e.linear_fc1.weight``  ``H.mlp.experts.e.{gate,up}_proj.weight``
``L.mlp.experts.local_experts.e.linear_fc2.weight``  ``H.mlp.experts.e.down_proj.weight``
==================================================  =========================================

Expert names here carry the global expert index ``e``; an expert-parallel rank holds a contiguous
run of experts, which the engine numbers from 0 locally. Experts are never split over
tensor-parallel ranks (expert tensor parallelism is not supported).

A critic (``is_critic``) has no output layer; its value head maps to the ``score`` layer of HF's
``*ForTokenClassification`` with one label.

Two layouts need care. ``linear_qkv`` stacks rows per query group: for each of the
``num_kv_heads`` groups, its ``heads/kv_heads`` query heads, then its key head, then its value
head; a tensor-parallel rank holds a contiguous run of whole groups. ``linear_fc1`` holds, on each
rank, that rank's slice of the gate projection followed by its slice of the up projection. The
vocabulary is padded to a multiple of the tensor-parallel size with zero rows, which are dropped
again on the way back (and whose logits the engine never uses).

Everything here is pure tensor manipulation, so round trips are exact and testable without
processes: `hf_to_mcore` gives one rank's shard, `mcore_to_hf` takes every rank's shard of one
parameter (as gathered by the engine) and returns the HF tensors it holds.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "qwen3", "qwen3_moe")


@dataclass(frozen=True)
class ArchSpec:
    """The shape facts of a Qwen2/Llama/Qwen3(-MoE) model that the conversion and megatron-core need."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    """The HF vocabulary size (rows of the embedding)."""
    padded_vocab_size: int
    """``vocab_size`` rounded up to a multiple of the tensor-parallel size."""
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    llama3_rope_factor: float | None
    """Llama 3.x rope scaling factor (None: no scaling)."""
    attention_dropout: float
    tie_word_embeddings: bool
    qkv_bias: bool
    is_critic: bool = False
    """A value model: a scalar value head instead of the language-model head."""
    qk_norm: bool = False
    """RMSNorm on each query and key head (Qwen3)."""
    num_experts: int = 0
    """Experts per layer (0: a dense model)."""
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    """Whether the top-k gate weights are renormalised to sum to 1."""

    @classmethod
    def from_hf_config(cls, config: object, tp_size: int = 1, is_critic: bool = False) -> ArchSpec:
        """Read a transformers ``Qwen2Config`` / ``LlamaConfig`` / ``Qwen3Config`` /
        ``Qwen3MoeConfig`` (anything else is refused)."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"MegatronEngine converts {SUPPORTED_MODEL_TYPES} models, not {model_type!r}")

        def g(name: str, default: object = None) -> object:
            return getattr(config, name, default)

        rope = g("rope_parameters") or g("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        llama3_factor = None
        if rope_type == "llama3":
            # megatron-core implements Llama 3.x scaling with these constants only
            fixed = (
                rope.get("low_freq_factor"),
                rope.get("high_freq_factor"),
                rope.get("original_max_position_embeddings"),
            )
            if fixed != (1.0, 4.0, 8192):
                raise ValueError(f"llama3 rope scaling {rope} differs from megatron-core's (1, 4, 8192)")
            llama3_factor = float(rope["factor"])
        elif rope_type != "default":
            raise ValueError(f"rope scaling {rope} is not supported by the megatron conversion")
        if g("use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported by the megatron conversion")
        num_heads = g("num_attention_heads")
        num_kv_heads = g("num_key_value_heads") or num_heads
        hidden = g("hidden_size")
        head_dim = g("head_dim") or hidden // num_heads
        if num_kv_heads % tp_size != 0:
            raise ValueError(f"tensor_parallel_size={tp_size} must divide num_key_value_heads={num_kv_heads}")
        vocab = g("vocab_size")
        rope_theta = g("rope_theta")
        if rope_theta is None:  # transformers 5 keeps it in rope_parameters
            rope_theta = rope.get("rope_theta", 10000.0)
        qkv_bias = model_type == "qwen2" or bool(g("attention_bias", False))
        if model_type == "llama" and g("mlp_bias", False):
            raise ValueError("Llama with mlp_bias is not supported by the megatron conversion")
        moe = model_type == "qwen3_moe"
        if moe and (list(g("mlp_only_layers", None) or []) or g("decoder_sparse_step", 1) != 1):
            raise ValueError("the megatron conversion needs every Qwen3-MoE layer to be a mixture of experts")
        return cls(
            model_type=model_type,
            num_layers=g("num_hidden_layers"),
            hidden_size=hidden,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=g("intermediate_size"),
            vocab_size=vocab,
            padded_vocab_size=-(-vocab // tp_size) * tp_size,
            max_position_embeddings=g("max_position_embeddings"),
            rms_norm_eps=g("rms_norm_eps"),
            rope_theta=float(rope_theta),
            llama3_rope_factor=llama3_factor,
            attention_dropout=float(g("attention_dropout", 0.0) or 0.0),
            tie_word_embeddings=bool(g("tie_word_embeddings", False)) and not is_critic,
            qkv_bias=qkv_bias,
            is_critic=is_critic,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            num_experts=int(g("num_experts", 0) or 0) if moe else 0,
            experts_per_token=int(g("num_experts_per_tok", 0) or 0) if moe else 0,
            moe_intermediate_size=int(g("moe_intermediate_size", 0) or 0) if moe else 0,
            norm_topk_prob=bool(g("norm_topk_prob", True)),
        )


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight")
_SIMPLE_LAYER = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.router.weight": "mlp.gate.weight",
}
# megatron-core's dimension along which tensor-parallel ranks split each parameter (None: replicated)
_SPLIT_DIM = {
    "input_layernorm.weight": None,
    "pre_mlp_layernorm.weight": None,
    "self_attention.linear_proj.weight": 1,
    "mlp.linear_fc2.weight": 1,
    "self_attention.linear_qkv.weight": 0,
    "self_attention.linear_qkv.bias": 0,
    "mlp.linear_fc1.weight": 0,
    "self_attention.q_layernorm.weight": None,
    "self_attention.k_layernorm.weight": None,
    "mlp.router.weight": None,
    "mlp.experts.linear_fc1": None,
    "mlp.experts.linear_fc2": None,
}
_DENSE_MLP = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
_QK_NORM = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")


def _layer_suffix(suffix: str) -> str:
    """The `_SPLIT_DIM` key of a layer parameter (every expert's under one key)."""
    match = _EXPERT.fullmatch(suffix)
    return f"mlp.experts.{match.group(2)}" if match else suffix


def mcore_param_names(arch: ArchSpec) -> list[str]:
    """Every megatron-core parameter name of the model, in a fixed order."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(arch.num_layers):
        for suffix in _SPLIT_DIM:
            if suffix == "self_attention.linear_qkv.bias" and not arch.qkv_bias:
                continue
            if suffix in _QK_NORM and not arch.qk_norm:
                continue
            if suffix in _DENSE_MLP and arch.num_experts:
                continue
            if suffix.startswith("mlp.experts.") or (suffix == "mlp.router.weight" and not arch.num_experts):
                continue
            names.append(f"decoder.layers.{i}.{suffix}")
            if suffix == "mlp.router.weight":
                for e in range(arch.num_experts):
                    names += [f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc{k}.weight" for k in (1, 2)]
    names.append("decoder.final_layernorm.weight")
    if arch.is_critic:
        names += ["value_head.weight", "value_head.bias"]
    elif not arch.tie_word_embeddings:
        names.append("output_layer.weight")
    return names


def _split(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    return torch.chunk(t, size, dim=dim)[rank].clone()


def _pad_vocab(t: torch.Tensor, arch: ArchSpec) -> torch.Tensor:
    if arch.padded_vocab_size == t.shape[0]:
        return t
    pad = t.new_zeros(arch.padded_vocab_size - t.shape[0], *t.shape[1:])
    return torch.cat([t, pad])


def _qkv_to_mcore(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ArchSpec) -> torch.Tensor:
    """Stack HF q/k/v rows (weights [rows, H] or biases [rows]) in megatron's per-group order."""
    per_group = arch.num_heads // arch.num_kv_heads
    rest = q.shape[1:]
    q = q.reshape(arch.num_kv_heads, per_group * arch.head_dim, *rest)
    k = k.reshape(arch.num_kv_heads, arch.head_dim, *rest)
    v = v.reshape(arch.num_kv_heads, arch.head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _qkv_to_hf(qkv: torch.Tensor, arch: ArchSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    per_group = arch.num_heads // arch.num_kv_heads
    rest = qkv.shape[1:]
    grouped = qkv.reshape(arch.num_kv_heads, (per_group + 2) * arch.head_dim, *rest)
    q, k, v = torch.split(grouped, [per_group * arch.head_dim, arch.head_dim, arch.head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_to_mcore(
    hf: Mapping[str, torch.Tensor],
    arch: ArchSpec,
    tp_rank: int = 0,
    tp_size: int = 1,
    names: Iterable[str] | None = None,
) -> dict[str, torch.Tensor]:
    """This tensor-parallel rank's megatron-core parameters from full HF tensors.

    ``hf`` maps HF names to tensors (a state dict, or a lazy mapping over safetensors files);
    only the HF tensors that the requested megatron ``names`` (default: all of
    `mcore_param_names`) need are read, so a pipeline stage reads only its own layers.
    ``lm_head.weight`` is not needed when tied, nor by a critic, which needs ``score.weight`` and
    ``score.bias`` instead.
    """
    return {name: _one_to_mcore(name, hf, arch, tp_rank, tp_size) for name in (names or mcore_param_names(arch))}


def _one_to_mcore(
    name: str, hf: Mapping[str, torch.Tensor], arch: ArchSpec, tp_rank: int, tp_size: int
) -> torch.Tensor:
    if name == "embedding.word_embeddings.weight":
        return _split(_pad_vocab(hf["model.embed_tokens.weight"], arch), 0, tp_rank, tp_size)
    if name == "output_layer.weight":
        return _split(_pad_vocab(hf["lm_head.weight"], arch), 0, tp_rank, tp_size)
    if name == "decoder.final_layernorm.weight":
        return hf["model.norm.weight"].clone()
    if name.startswith("value_head."):
        return hf["score." + name.removeprefix("value_head.")].clone()
    match = _LAYER.fullmatch(name)
    if match is None or _layer_suffix(match.group(2)) not in _SPLIT_DIM:
        raise KeyError(f"not a megatron parameter of a supported model: {name}")
    h, suffix = f"model.layers.{match.group(1)}.", match.group(2)
    expert = _EXPERT.fullmatch(suffix)
    if expert is not None:
        e = f"{h}mlp.experts.{expert.group(1)}."
        if expert.group(2) == "linear_fc2":
            return hf[e + "down_proj.weight"].clone()
        return torch.cat([hf[e + "gate_proj.weight"], hf[e + "up_proj.weight"]])
    if suffix in _SIMPLE_LAYER:
        t = hf[h + _SIMPLE_LAYER[suffix]]
        dim = _SPLIT_DIM[suffix]
        return t.clone() if dim is None else _split(t, dim, tp_rank, tp_size)
    if suffix == "mlp.linear_fc1.weight":
        gate = _split(hf[h + "mlp.gate_proj.weight"], 0, tp_rank, tp_size)
        up = _split(hf[h + "mlp.up_proj.weight"], 0, tp_rank, tp_size)
        return torch.cat([gate, up])
    kind = suffix.rsplit(".", 1)[1]
    qkv = _qkv_to_mcore(*(hf[f"{h}self_attn.{p}_proj.{kind}"] for p in "qkv"), arch)
    return _split(qkv, 0, tp_rank, tp_size)


def mcore_split_dim(name: str) -> int | None:
    """The dimension along which tensor-parallel ranks split megatron parameter ``name``."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0
    if name in ("decoder.final_layernorm.weight", "value_head.weight", "value_head.bias"):
        return None
    match = _LAYER.fullmatch(name)
    if match is None or _layer_suffix(match.group(2)) not in _SPLIT_DIM:
        raise KeyError(f"not a megatron parameter of a supported model: {name}")
    return _SPLIT_DIM[_layer_suffix(match.group(2))]


def mcore_to_hf(name: str, shards: list[torch.Tensor], arch: ArchSpec) -> list[tuple[str, torch.Tensor]]:
    """The full HF tensors held by megatron parameter ``name``, from every tensor-parallel rank's
    shard of it (``shards[r]`` from rank ``r``; a one-element list for replicated parameters)."""
    dim = mcore_split_dim(name)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        full = torch.cat(shards)[: arch.vocab_size]
        return [("model.embed_tokens.weight" if name.startswith("embedding") else "lm_head.weight", full)]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", shards[0])]
    if name.startswith("value_head."):
        return [("score." + name.removeprefix("value_head."), shards[0])]
    match = _LAYER.fullmatch(name)
    assert match is not None
    i, suffix = match.group(1), match.group(2)
    h = f"model.layers.{i}."
    expert = _EXPERT.fullmatch(suffix)
    if expert is not None:
        e = f"{h}mlp.experts.{expert.group(1)}."
        if expert.group(2) == "linear_fc2":
            return [(e + "down_proj.weight", shards[0])]
        gate, up = torch.chunk(shards[0], 2, dim=0)
        return [(e + "gate_proj.weight", gate), (e + "up_proj.weight", up)]
    if dim is None:
        return [(h + _SIMPLE_LAYER[suffix], shards[0])]
    if suffix in _SIMPLE_LAYER:
        return [(h + _SIMPLE_LAYER[suffix], torch.cat(shards, dim=dim))]
    if suffix == "mlp.linear_fc1.weight":
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        gate = torch.cat([g for g, _ in halves])
        up = torch.cat([u for _, u in halves])
        return [(h + "mlp.gate_proj.weight", gate), (h + "mlp.up_proj.weight", up)]
    kind = suffix.rsplit(".", 1)[1]
    q, k, v = _qkv_to_hf(torch.cat(shards), arch)
    return [(f"{h}self_attn.{p}_proj.{kind}", t) for p, t in zip("qkv", (q, k, v))]


def mcore_state_to_hf(shards: Mapping[str, list[torch.Tensor]], arch: ArchSpec) -> dict[str, torch.Tensor]:
    """A whole HF state dict from every rank's shards of every megatron parameter."""
    out: dict[str, torch.Tensor] = {}
    for name in mcore_param_names(arch):
        out.update(mcore_to_hf(name, list(shards[name]), arch))
    return out


__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ArchSpec",
    "hf_to_mcore",
    "mcore_param_names",
    "mcore_split_dim",
    "mcore_state_to_hf",
    "mcore_to_hf",
]
