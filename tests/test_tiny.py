"""Tiny local models and tokenizers load through the standard HF entry points."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_lite.utils.tiny import build_tiny_model, with_random_weights


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tiny_model_directory_loads_and_is_seeded(tmp_path, arch: str) -> None:
    a = build_tiny_model(str(tmp_path / "a"), arch=arch, seed=3)
    b = build_tiny_model(str(tmp_path / "b"), arch=arch, seed=3)
    ma = AutoModelForCausalLM.from_pretrained(a)
    mb = AutoModelForCausalLM.from_pretrained(b)
    tok = AutoTokenizer.from_pretrained(a)
    assert ma.config.model_type == arch
    for (na, pa), (_, pb) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert torch.equal(pa, pb), na
    text = tok.apply_chat_template([{"role": "user", "content": "1+1?"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None
    logits = ma(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tok))


def test_byte_level_without_merges_gives_one_token_per_character(tmp_path) -> None:
    d = build_tiny_model(str(tmp_path / "c"), vocab_size=0)
    tok = AutoTokenizer.from_pretrained(d)
    assert len(tok("123+45=")["input_ids"]) == 7


def test_random_weights_for_a_directory_that_has_only_a_config_and_a_tokenizer(tmp_path) -> None:
    full = build_tiny_model(str(tmp_path / "full"), arch="llama", seed=1)
    shape = tmp_path / "shape"
    shape.mkdir()
    for name in os.listdir(full):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(full, name), shape / name)
    assert with_random_weights(full, str(tmp_path / "unused")) == full  # weights there: used as they are
    out = with_random_weights(str(shape), str(tmp_path / "out"), seed=5)
    model, ref = AutoModelForCausalLM.from_pretrained(out), AutoModelForCausalLM.from_pretrained(full)
    assert AutoTokenizer.from_pretrained(out).get_vocab() == AutoTokenizer.from_pretrained(full).get_vocab()
    assert {n: p.shape for n, p in model.state_dict().items()} == {n: p.shape for n, p in ref.state_dict().items()}
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, ref.model.layers[0].mlp.up_proj.weight)
    again = AutoModelForCausalLM.from_pretrained(with_random_weights(str(shape), str(tmp_path / "again"), seed=5))
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n  # seeded
