"""Loading the embedded engine's model: the HF causal LM (or vision-language model) and tokenizer of
a model directory, and what the engine reads off it (its end-of-sequence ids, the context length it allows); dtypes by
name, as configs and weight broadcasts give them."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_DTYPES = {
    n: getattr(torch, n)
    for n in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool")
}


def dtype_of(name: str) -> torch.dtype:
    """A torch dtype from its name (``float32`` or ``torch.float32``); ValueError when unknown."""
    dtype = _DTYPES.get(name.removeprefix("torch."))
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(_DTYPES)}")
    return dtype


def load_model(path: str, dtype: torch.dtype, device: str) -> tuple[torch.nn.Module, PreTrainedTokenizerBase | None]:
    """The HF causal LM (or vision-language model) of a model directory, frozen for inference,
    and its tokenizer (None when the directory has none)."""
    from transformers import AutoConfig

    from areal_lite.utils.tokenizer import TokenizerMissing, load_tokenizer
    from areal_lite.utils.vision import auto_model_class

    auto = auto_model_class(AutoConfig.from_pretrained(path))
    model = auto.from_pretrained(path, dtype=dtype).to(device).eval()
    model.requires_grad_(False)
    tokenizer: PreTrainedTokenizerBase | None = None
    try:
        tokenizer = load_tokenizer(path)
    except TokenizerMissing:
        logger.warning("no tokenizer in %s: stop strings and text prompts are unavailable", path)
    return model, tokenizer


def eos_ids(model: torch.nn.Module) -> frozenset[int]:
    """The model's end-of-sequence ids: its generation config's, else its config's."""
    eos = (
        model.generation_config.eos_token_id
        if model.generation_config.eos_token_id is not None
        else model.config.get_text_config().eos_token_id
    )
    return frozenset([eos] if isinstance(eos, int) else (eos or []))


def context_length(model: torch.nn.Module, max_total_tokens: int) -> int:
    """Prompt + output tokens a request may reach: ``max_total_tokens`` (0 = no limit of its own),
    the model's position range, and its sliding window."""
    config = model.config.get_text_config()
    max_pos = config.max_position_embeddings
    context_len = min(max_total_tokens, max_pos) if max_total_tokens > 0 else max_pos
    window = getattr(config, "sliding_window", None)
    if window and (config.model_type == "mistral" or getattr(config, "use_sliding_window", False)):
        # The runner attends over the whole cache; within one window that is exact.
        context_len = min(context_len, window)
    return context_len
