"""Tiny local models and tokenizers load through the standard HF entry points."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_lite.utils.tiny import build_tiny_model


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
