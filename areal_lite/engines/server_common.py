"""What our server's route modules (SGLang, OpenAI and vLLM routes) share: reading a JSON body,
typed fields, the error that bad input gets (``{"error": {"message": ...}}``, 400 unless said
otherwise), and the decoded text of a generation."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from aiohttp import web

from areal_lite.engines.request import GenerationResult

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class BadRequest(ValueError):
    """Invalid client input: answered with HTTP ``status`` (400; 404 for an unknown model)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def error_response(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


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


def int_field(d: dict[str, object], key: str, default: int) -> int:
    v = d.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{key} must be an integer, got {v!r}")
    return v


def float_field(d: dict[str, object], key: str, default: float) -> float:
    v = d.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest(f"{key} must be a number, got {v!r}")
    return float(v)


def bool_field(d: dict[str, object], key: str, default: bool) -> bool:
    v = d.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"{key} must be a boolean, got {v!r}")
    return v


def token_ids(value: object, name: str) -> list[int]:
    """A non-empty list of non-negative integers. Raises BadRequest."""
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        raise BadRequest(f"{name} must be a non-empty list of integers")
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
