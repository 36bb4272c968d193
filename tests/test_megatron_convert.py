"""HF <-> megatron-core weight conversion (pure tensor code, no processes): round trips are exact
for Qwen2 (untied, q/k/v biases) and Llama (tied), at TP=1, 2 and 4, with a vocabulary that needs
padding, and for a critic's value head; a TP shard is the matching slice of the TP=1 tensor (whole query groups, gate and up
slices); unsupported models are refused. That the layout is megatron's own is shown by
tests/test_megatron.py, where converted weights give FSDP's log-probabilities."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from areal_lite.engines.train.mcore_convert import (
    ArchSpec,
    hf_to_mcore,
    mcore_param_names,
    mcore_split_dim,
    mcore_state_to_hf,
)


def tiny_hf(arch: str, tie: bool) -> torch.nn.Module:
    common = {
        "vocab_size": 301, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 8,
        "num_key_value_heads": 4, "max_position_embeddings": 64, "tie_word_embeddings": tie,
    }  # fmt: skip
    config = Qwen2Config(**common) if arch == "qwen2" else LlamaConfig(**common)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def hf_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # what from_pretrained-loadable checkpoints hold: tied lm_head is not stored
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight")
    return sd


@pytest.mark.parametrize("arch,tie", [("qwen2", False), ("llama", True), ("qwen2", True)])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_round_trip_is_exact(arch: str, tie: bool, tp: int) -> None:
    model = tiny_hf(arch, tie)
    spec = ArchSpec.from_hf_config(model.config, tp)
    assert spec.padded_vocab_size % tp == 0 and spec.padded_vocab_size >= 301
    assert spec.qkv_bias == (arch == "qwen2")
    hf = hf_state(model)
    ranks = [hf_to_mcore(hf, spec, r, tp) for r in range(tp)]
    assert all(set(shard) == set(mcore_param_names(spec)) for shard in ranks)
    shards = {}
    for name in mcore_param_names(spec):
        shards[name] = [ranks[r][name] for r in range(tp)] if mcore_split_dim(name) is not None else [ranks[0][name]]
    back = mcore_state_to_hf(shards, spec)
    assert back.keys() == hf.keys()
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


@pytest.mark.parametrize("tp", [1, 2])
def test_critic_round_trip_is_exact(tp: int) -> None:
    from transformers import AutoModelForTokenClassification

    config = Qwen2Config(vocab_size=301, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=4, max_position_embeddings=64, num_labels=1)  # fmt: skip
    hf = {k: v.detach().clone() for k, v in AutoModelForTokenClassification.from_config(config).state_dict().items()}
    spec = ArchSpec.from_hf_config(config, tp, is_critic=True)
    ranks = [hf_to_mcore(hf, spec, r, tp) for r in range(tp)]
    assert "output_layer.weight" not in ranks[0] and ranks[0]["value_head.weight"].shape == (1, 32)
    shards = {
        n: [ranks[r][n] for r in range(tp)] if mcore_split_dim(n) is not None else [ranks[0][n]]
        for n in mcore_param_names(spec)
    }
    back = mcore_state_to_hf(shards, spec)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_tp_shards_are_slices_of_the_full_layout() -> None:
    model = tiny_hf("qwen2", tie=False)
    hf = hf_state(model)
    full = hf_to_mcore(hf, ArchSpec.from_hf_config(model.config, 1))
    spec2 = ArchSpec.from_hf_config(model.config, 2)
    halves = [hf_to_mcore(hf, spec2, r, 2) for r in range(2)]
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    # (8 heads / 4 groups) -> per group 2 query heads + k + v, 4 rows of head_dim 4 each
    assert full[qkv].shape == ((8 + 2 * 4) * 4, 32)
    assert torch.equal(torch.cat([h[qkv] for h in halves]), full[qkv])
    # group 0: its two query heads, then its key head, then its value head
    q, k, v = (
        hf["model.layers.0.self_attn.q_proj.weight"],
        hf["model.layers.0.self_attn.k_proj.weight"],
        hf["model.layers.0.self_attn.v_proj.weight"],
    )
    assert torch.equal(full[qkv][:16], torch.cat([q[:8], k[:4], v[:4]]))
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(full[fc1], torch.cat([gate, up]))
    assert torch.equal(halves[1][fc1], torch.cat([gate[24:], up[24:]]))
    proj = "decoder.layers.1.self_attention.linear_proj.weight"
    assert torch.equal(halves[1][proj], hf["model.layers.1.self_attn.o_proj.weight"][:, 16:])
    emb = "embedding.word_embeddings.weight"
    assert halves[0][emb].shape[0] == halves[1][emb].shape[0] == 151
    assert torch.equal(halves[1][emb][-1], torch.zeros(32))


def test_unsupported_models_are_refused() -> None:
    with pytest.raises(ValueError, match="qwen2"):
        ArchSpec.from_hf_config(MistralConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ArchSpec.from_hf_config(Qwen2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2), tp_size=4)
    with pytest.raises(ValueError, match="rope scaling"):
        ArchSpec.from_hf_config(
            LlamaConfig(hidden_size=32, num_attention_heads=4, rope_scaling={"rope_type": "linear", "factor": 2.0})
        )


def test_llama3_rope_scaling_maps_to_megatron_frequencies() -> None:
    """Llama 3.x rope scaling: megatron's scaled inverse frequencies equal HF's exactly (the
    end-to-end check in test_megatron.py cannot tell them apart on short sequences)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    }  # fmt: skip
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=16384, rope_parameters=rope)
    spec = ArchSpec.from_hf_config(config)
    assert spec.llama3_rope_factor == 8.0
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    mcore = RotaryEmbedding(
        kv_channels=spec.head_dim, rotary_percent=1.0, rotary_base=int(spec.rope_theta),
        rope_scaling=True, rope_scaling_factor=spec.llama3_rope_factor, use_cpu_initialization=True,
    )  # fmt: skip
    assert torch.equal(mcore.inv_freq, hf_inv_freq)
    unscaled = RotaryEmbedding(
        kv_channels=spec.head_dim, rotary_percent=1.0, rotary_base=int(spec.rope_theta), use_cpu_initialization=True
    )
    assert not torch.equal(unscaled.inv_freq, hf_inv_freq)
    with pytest.raises(ValueError, match="llama3"):
        ArchSpec.from_hf_config(
            LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters={**rope, "high_freq_factor": 2.0})
        )


def test_a_pipeline_stage_reads_only_its_tensors() -> None:
    class Recording(dict):
        def __getitem__(self, key: str) -> torch.Tensor:
            read.add(key)
            return super().__getitem__(key)

    read: set[str] = set()
    model = tiny_hf("qwen2", tie=False)
    spec = ArchSpec.from_hf_config(model.config, 2)
    last_stage = [n for n in mcore_param_names(spec) if n.startswith("decoder.layers.1.")]
    last_stage += ["decoder.final_layernorm.weight", "output_layer.weight"]
    out = hf_to_mcore(Recording(hf_state(model)), spec, 1, 2, names=last_stage)
    assert set(out) == set(last_stage)
    assert read and all(k.startswith("model.layers.1.") or k in ("model.norm.weight", "lm_head.weight") for k in read)
