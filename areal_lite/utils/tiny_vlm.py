"""A tiny vision-language model built locally, for tests and the vision demo: nothing is downloaded.

The model is a randomly initialised Qwen2.5-VL (a ViT whose patches of 14 pixels are merged 2 x 2
into one image token, and a Qwen2 decoder with multimodal 3-D rotary positions); the tokenizer is
`areal_lite.utils.tiny`'s byte-level BPE with the model's vision tokens added; the image processor
is transformers' Qwen2-VL one with small pixel bounds, so a 112 x 112 image becomes 64 patches and
16 image tokens. The directory loads with ``AutoModelForImageTextToText.from_pretrained`` and
`areal_lite.utils.vision.load_processor` (``AutoProcessor.from_pretrained`` where torchvision is
installed) like a real checkpoint. Its text head size is 32,
one that vLLM's CPU attention supports.

The chat template is the text models' ChatML whose message content may also be a list of parts
(``{"type": "text", "text": ...}``, ``{"type": "image"}``, ``{"type": "image_url", ...}``): an image
part becomes ``<|vision_start|><|image_pad|><|vision_end|>``, which the processor expands to the
image's token count.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from areal_lite.utils.tiny import CHAT_TEMPLATE, build_tokenizer
from areal_lite.utils.vision import image_only

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
"""The special tokens Qwen2.5-VL's processor and model look for."""

_CONTENT_MACRO = (
    "{% macro render(content) %}{% if content is string %}{{ content }}{% else %}"
    "{% for part in content or [] %}"
    "{% if part['type'] in ('image', 'image_url') %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{% endmacro %}"
)
VLM_CHAT_TEMPLATE = _CONTENT_MACRO + CHAT_TEMPLATE.replace("+ message['content'] }}", "+ render(message['content']) }}")
"""`areal_lite.utils.tiny.CHAT_TEMPLATE` with content given as a string or as a list of parts."""

PIXELS_PER_TOKEN = 28 * 28
"""Pixels of one image token: a 2 x 2 merge of 14-pixel patches."""


def build_tiny_vlm(
    save_dir: str,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    vision_hidden_size: int = 32,
    vision_depth: int = 2,
    vision_heads: int = 2,
    min_pixels: int = 56 * 56,
    max_pixels: int = 112 * 112,
    vocab_size: int = 512,
    corpus: Iterable[str] | None = None,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> str:
    """Build a random-init Qwen2.5-VL, its tokenizer and its processor into ``save_dir``.

    The decoder has ``num_layers`` layers of width ``hidden_size`` with ``num_heads`` query and
    ``num_kv_heads`` key/value heads; the vision tower ``vision_depth`` blocks of width
    ``vision_hidden_size`` (its last block attends over the whole image, the others within
    windows), projecting into the decoder's width. Images are resized to between ``min_pixels``
    and ``max_pixels`` pixels (multiples of 28 on each side). ``vocab_size`` and ``corpus`` shape
    the text tokenizer (`areal_lite.utils.tiny.build_tokenizer`); the vision tokens come on top.
    Returns ``save_dir``.
    """
    from transformers import (
        AutoModelForImageTextToText,
        Qwen2_5_VLConfig,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessorPil,
    )

    head_dim = hidden_size // num_heads
    if head_dim % 8 or hidden_size % num_heads:
        raise ValueError(f"hidden_size / num_heads must be a multiple of 8, got {hidden_size} / {num_heads}")
    if min_pixels > max_pixels or min_pixels < PIXELS_PER_TOKEN:
        raise ValueError(f"need {PIXELS_PER_TOKEN} <= min_pixels <= max_pixels, got {min_pixels} and {max_pixels}")
    os.makedirs(save_dir, exist_ok=True)
    tokenizer = build_tokenizer(corpus=corpus, vocab_size=vocab_size)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *VISION_TOKENS]})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    image_processor = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)
    # Saved without a video processor (it needs torchvision); `areal_lite.utils.vision.load_processor` loads it.
    processor = image_only(Qwen2_5_VLProcessor)(image_processor, tokenizer, chat_template=VLM_CHAT_TEMPLATE)
    ids = dict(zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(VISION_TOKENS)))
    # The three rotary sections (time, height, width) split the head's frequency pairs as Qwen's do (2:3:3).
    half = head_dim // 2
    sections = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": 4 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sections},
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": None,
    }
    vision = {
        "depth": vision_depth,
        "hidden_size": vision_hidden_size,
        "intermediate_size": 2 * vision_hidden_size,
        "num_heads": vision_heads,
        "out_hidden_size": hidden_size,
        "fullatt_block_indexes": [vision_depth - 1],
        "window_size": 112,
    }
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(save_dir)
    processor.save_pretrained(save_dir)
    return save_dir


__all__ = ["PIXELS_PER_TOKEN", "VISION_TOKENS", "VLM_CHAT_TEMPLATE", "build_tiny_vlm"]
