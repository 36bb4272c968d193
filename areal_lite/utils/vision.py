"""Vision-language models: telling one from a text model, loading its processor, images as bytes.

A Qwen-VL processor holds an image processor, a tokenizer and a video processor; transformers'
video processors need torchvision, and ``AutoProcessor.from_pretrained`` fails without it even
when no video is ever processed. Where torchvision is missing, `load_processor` loads the same
processor class without its video slot (`image_only`): images and text are processed exactly as
the full processor does. Images travel between workflows and engines as encoded files (PNG by
default), the form servers take them in (`encode_image`, `decode_image`), and over HTTP as data
URLs (`data_url`). Which placeholder tokens of a sequence its images fill is `image_token_mask`'s
rule, the same for training and generation.
"""

from __future__ import annotations

import base64
import io
import json
import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from PIL import Image
    from transformers import PretrainedConfig, ProcessorMixin


def is_vision_config(config: PretrainedConfig) -> bool:
    """Whether a HF model config is a vision-language model's (a vision tower and image tokens)."""
    return getattr(config, "vision_config", None) is not None and getattr(config, "image_token_id", None) is not None


def auto_model_class(config: PretrainedConfig) -> type:
    """The transformers auto class that builds the generating model of ``config``:
    ``AutoModelForImageTextToText`` for a vision-language model, else ``AutoModelForCausalLM``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM


def image_token_mask(input_ids: torch.Tensor, image_token_id: int, n_image_tokens: torch.Tensor) -> torch.Tensor:
    """Which tokens of each row of ``input_ids`` (``[B, L]``) hold its images: the first
    ``n_image_tokens[b]`` image placeholder tokens (``image_token_id``) of row ``b``, in order. A
    placeholder after those is text: one the model generated, which no image fills (the train
    engine and the inference engine both read a sequence so). ValueError naming a row that has
    fewer placeholders than its images' tokens."""
    placeholders = input_ids == image_token_id
    have = placeholders.sum(dim=-1)
    short = (have < n_image_tokens).nonzero()
    if short.numel():
        b = int(short[0, 0])
        raise ValueError(
            f"row {b} has {int(have[b])} image placeholder tokens; its images need {int(n_image_tokens[b])}"
        )
    return placeholders & (placeholders.cumsum(dim=-1) <= n_image_tokens.unsqueeze(-1))


def image_only(cls: type[ProcessorMixin]) -> type[ProcessorMixin]:
    """A subclass of the processor class ``cls`` (a Qwen-VL processor's: image processor, tokenizer,
    video processor) without the video processor, under the same name, so that what it saves
    names ``cls`` and loads as one where torchvision is installed."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs) -> None:
        cls.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__})


def _processor_class_name(path: str) -> str:
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        file = os.path.join(path, name)
        if os.path.exists(file):
            with open(file) as f:
                found = json.load(f).get("processor_class")
            if found:
                return found
    raise FileNotFoundError(f"{path} names no processor class (no processor_config.json or preprocessor_config.json)")


def load_processor(path: str) -> ProcessorMixin:
    """The processor of the vision-language model directory ``path``: ``AutoProcessor``'s where
    torchvision is installed, else the same class without its video processor (`image_only`)."""
    import transformers
    from transformers.utils import is_torchvision_available

    if is_torchvision_available() or not os.path.isdir(path):
        return transformers.AutoProcessor.from_pretrained(path)
    name = _processor_class_name(path)
    cls = getattr(transformers, name, None)
    if cls is None:
        raise ValueError(f"{path} names processor class {name!r}, which transformers {transformers.__version__} lacks")
    return image_only(cls).from_pretrained(path)


def encode_image(image: Image.Image, format: str = "PNG") -> bytes:
    """``image`` as the bytes of an image file (PNG: lossless, so the pixels come back exact)."""
    buf = io.BytesIO()
    image.save(buf, format=format)
    return buf.getvalue()


def decode_image(data: bytes) -> Image.Image:
    """The RGB image an image file's bytes hold (what `encode_image` wrote, or a JPEG, ...)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return img.convert("RGB")


_MEDIA_TYPES = {b"\x89PNG": "image/png", b"\xff\xd8\xff": "image/jpeg", b"GIF8": "image/gif", b"RIFF": "image/webp"}


def data_url(data: bytes) -> str:
    """An image file's bytes as a data URL (``data:image/png;base64,...``), as vLLM's and SGLang's
    servers take images inline; the media type from the file's first bytes (PNG when unknown)."""
    media = next((t for magic, t in _MEDIA_TYPES.items() if data.startswith(magic)), "image/png")
    return f"data:{media};base64,{base64.b64encode(data).decode('ascii')}"


__all__ = [
    "auto_model_class",
    "data_url",
    "decode_image",
    "encode_image",
    "image_only",
    "image_token_mask",
    "is_vision_config",
    "load_processor",
]
