"""Loading a model's tokenizer, refusing a directory that has none.

``AutoTokenizer.from_pretrained`` on a model directory without tokenizer files does not fail: it
builds a tokenizer of the model's class with an empty vocabulary (only the special tokens of its
config), and the run fails later with an error about chat templates, or trains on empty prompts.
`load_tokenizer` names the directory and what to do instead.
"""

from __future__ import annotations

import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from areal_lite.api.errors import RecurringError


class TokenizerMissing(RecurringError, FileNotFoundError):
    """A model directory (or hub id) holds no usable tokenizer."""


def has_vocabulary(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether ``tokenizer`` has tokens beyond its added special ones (an empty one built from a
    directory without tokenizer files has none)."""
    return len(tokenizer.get_vocab()) > len(tokenizer.added_tokens_decoder)


def load_tokenizer(path: str, what: str = "the model") -> PreTrainedTokenizerBase:
    """The tokenizer of ``path`` (a local directory or a hub id); `TokenizerMissing` naming
    ``path`` when it has none. ``what`` says which setting ``path`` came from, for the message
    (e.g. ``"actor.path"``)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise TokenizerMissing(f"cannot load a tokenizer from {what} {path!r}: {e}") from e
    if not has_vocabulary(tokenizer):
        where = "the directory" if os.path.isdir(path) else "the hub id"
        raise TokenizerMissing(
            f"{where} {path!r} ({what}) holds no tokenizer (no tokenizer.json, tokenizer.model or vocabulary "
            "files): copy the base model's tokenizer files into it, or set tokenizer_path"
        )
    return tokenizer
