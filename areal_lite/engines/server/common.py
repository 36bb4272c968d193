"""What our server's route modules (SGLang, OpenAI and vLLM routes) share: reading a JSON body,
typed fields, the error that bad input gets (OpenAI's error object ``{"error": {"message", "type",
"param", "code"}}``, 400 unless said otherwise), the decoded text of a generation, and of each
token in log-probabilities; and what changes while the server serves (`ServerState`)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

from areal_lite.engines.local.request import GenerationResult
from areal_lite.openai_format.chat import BadRequest, TokenBytes, bool_field, error_body, float_field, int_field

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [  # the typed fields, BadRequest and TokenBytes are the shared OpenAI parsing's, re-exported
    "BadRequest",
    "ServerState",
    "TokenBytes",
    "bool_field",
    "error_response",
    "float_field",
    "int_field",
    "output_text",
    "read_json",
    "token_ids",
    "token_text",
]


@dataclass
class ServerState:
    """What changes while the server serves, shared by its SGLang routes
    (`areal_lite.engines.server.generate_routes`, `areal_lite.engines.server.sglang_routes`)."""

    weight_version: str
    """The version of the weights served: an integer, as a string on the wire (SGLang's)."""
    ready: bool = False
    """Startup is done: the health routes answer 200 (503 before)."""


def error_response(message: str, status: int = 400, param: str | None = None, code: str | None = None) -> web.Response:
    return web.json_response(error_body(message, status, param, code), status=status)


async def read_json(request: web.Request) -> dict[str, object]:
    """The request's JSON object ({} for an empty body). Raises BadRequest for anything else."""
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"malformed JSON: {e}") from e
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def token_ids(value: object, name: str) -> list[int]:
    """A non-empty list of non-negative integers. Raises BadRequest."""
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        raise BadRequest(f"{name} must be a non-empty list of integers", param=name)
    return value


def output_text(
    tokenizer: PreTrainedTokenizerBase | None, r: GenerationResult, skip_special: bool, keep_stop: bool
) -> str:
    """The decoded output ("" without a tokenizer), cut before a matched stop string unless ``keep_stop``."""
    if tokenizer is None:
        return ""
    text = tokenizer.decode(r.output_ids, skip_special_tokens=skip_special)
    matched = r.finish_reason.get("matched")
    if isinstance(matched, str) and not keep_stop and matched in text:
        text = text[: text.index(matched)]
    return text


CONTEXT_TOKENS = 4
"""How many tokens before one that ends inside a character `token_text` looks back (vLLM's)."""


def token_text(tokenizer: PreTrainedTokenizerBase, token: int, before: Sequence[int] = ()) -> str:
    """A token's text in log-probabilities, as vLLM gives it: the token decoded alone; where that
    ends inside a character (a byte-level token decodes to U+FFFD), the character it completes
    after up to `CONTEXT_TOKENS` of the tokens ``before`` it (oldest first), with the bytes those
    left unfinished, or "" when it completes none. So the texts of a run of tokens join into the
    text they decode to together, where decoding each alone would give replacement characters."""
    text = tokenizer.decode([token])
    if not text.endswith("\ufffd"):
        return text
    context = list(before)[-CONTEXT_TOKENS:]
    for n in range(1, len(context) + 1):
        window = context[-n:]
        whole = tokenizer.decode([*window, token])
        if whole.endswith("\ufffd"):
            continue
        # The window's tokens that themselves end inside a character left their bytes to this one.
        clean = len(window)
        while clean and tokenizer.decode([window[clean - 1]]).endswith("\ufffd"):
            clean -= 1
        prefix = tokenizer.decode(window[:clean]) if clean else ""
        return whole[len(os.path.commonprefix([prefix, whole])) :]
    return ""
