"""What an OpenAI chat-completions request says, read once for everything that answers one: our
server's ``/v1/chat/completions`` (`areal_lite.engines.server.openai_routes`) and the agent workflows'
recording proxy (`areal_lite.workflows.openai_proxy`).

Pure functions over the request's JSON body and a HF tokenizer: the typed fields, the options no
areal-lite generator can honour, the messages as a chat template wants them, the tools, the prompt
text the template renders, the assistant message of an answer, and the bytes of each token of
its log-probabilities.

Images, for a vision-language model, come as vLLM's OpenAI server takes them: ``image_url``
content parts whose URL is a data URL (``data:image/png;base64,...``, the image file inline).
Such a message's content reaches the template as its parts in order, text and
``{"type": "image"}`` (where the template writes the model's image placeholder); the images'
URLs are read in the same order (`image_urls`) and a data URL gives the file's bytes
(`data_url_bytes`). ``http(s)`` URLs are refused with a 400: a server that fetched them would
reach wherever a request points it. Bad input raises `BadRequest` naming the field at fault, which servers
answer with a 400 (404 for an unknown model) and OpenAI's error object (`error_body`).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re

from areal_lite.openai_format.tool_calls import ToolCall

REFUSED: dict[str, object] = {
    "use_beam_search": False,
    "best_of": 1,
    "echo": False,
    "suffix": None,
    "prompt_logprobs": None,
    "allowed_token_ids": None,
}
"""Request keys taken only at their default (no-op) value: the engines cannot honour any other."""

ROLES = ("system", "developer", "user", "assistant", "tool")


class BadRequest(ValueError):
    """Invalid client input: answered with HTTP ``status`` (400; 404 for an unknown model) and
    OpenAI's error object (`error_body`), naming the request field at fault (``param``) and a
    machine-readable ``code`` where there is one."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict[str, object]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``, the type
    ``invalid_request_error`` for a client's mistake (4xx) and ``server_error`` otherwise."""
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def int_field(d: dict[str, object], key: str, default: int) -> int:
    v = d.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{key} must be an integer, got {v!r}", param=key)
    return v


def float_field(d: dict[str, object], key: str, default: float) -> float:
    v = d.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest(f"{key} must be a number, got {v!r}", param=key)
    return float(v)


def bool_field(d: dict[str, object], key: str, default: bool) -> bool:
    v = d.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"{key} must be a boolean, got {v!r}", param=key)
    return v


def refuse_unsupported(body: dict[str, object], structured: bool = False) -> None:
    """Raise `BadRequest` for an option of `REFUSED` set to anything but its default, or, unless
    the caller constrains output (``structured``), a ``response_format`` other than text or vLLM's
    ``structured_outputs``."""
    for key, default in REFUSED.items():
        value = body.get(key)
        if value is not None and value != default and value not in ({}, []):
            raise BadRequest(f"{key} is not supported by areal-lite", param=key)
    if structured:
        return
    if body.get("structured_outputs") not in (None, {}):
        raise BadRequest("structured_outputs is not supported here", param="structured_outputs")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise BadRequest("response_format other than text is not supported by areal-lite", param="response_format")


def shaping_fields(body: dict[str, object]) -> dict[str, object]:
    """A request's ``min_p``, ``frequency_penalty``, ``presence_penalty``, ``repetition_penalty``
    and ``logit_bias`` (token ids, as strings or integers, to numbers), under the names vLLM's
    requests, SGLang's ``sampling_params`` and `SamplingParams` share; BadRequest naming the field
    for a value of the wrong type or outside vLLM's ranges."""
    out: dict[str, object] = {
        "min_p": float_field(body, "min_p", 0.0),
        "frequency_penalty": float_field(body, "frequency_penalty", 0.0),
        "presence_penalty": float_field(body, "presence_penalty", 0.0),
        "repetition_penalty": float_field(body, "repetition_penalty", 1.0),
    }
    if not 0.0 <= out["min_p"] <= 1.0:
        raise BadRequest(f"min_p must be in [0, 1], got {out['min_p']}.", param="min_p")
    for key in ("frequency_penalty", "presence_penalty"):
        if not -2.0 <= out[key] <= 2.0:
            raise BadRequest(f"{key} must be in [-2, 2], got {out[key]}.", param=key)
    if not 0.0 < out["repetition_penalty"] < float("inf"):
        raise BadRequest(
            f"repetition_penalty must be a finite number greater than zero, got {out['repetition_penalty']}.",
            param="repetition_penalty",
        )
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise BadRequest("logit_bias must be an object mapping token ids to numbers", param="logit_bias")
    out["logit_bias"] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise BadRequest(
                f"logit_bias contains key(s) that cannot be converted to integer token IDs: {[key]!r}",
                param="logit_bias",
            ) from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise BadRequest(f"logit_bias values must be finite numbers, got {value!r}", param="logit_bias")
        out["logit_bias"][token] = float(value)
    return out


def stop_strings(body: dict[str, object]) -> list[str]:
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("stop must be a string or a list of strings", param="stop")
    return stop


def max_completion_tokens(body: dict[str, object]) -> int | None:
    """``max_completion_tokens`` or its older name ``max_tokens``; None when neither is given."""
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise BadRequest(f"{key} must be an integer, got {value!r}", param=key)
    return value


def chat_messages(raw: object, images: bool = False) -> list[dict[str, object]]:
    """The messages as chat templates want them: content a string (text parts joined, null as
    ""), or with ``images`` (the model takes them) and image parts, its parts in order
    (`template_content`); and the arguments of an assistant's tool calls as objects rather than
    JSON strings (what templates that write ``arguments | tojson`` expect, as vLLM passes them)."""
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages must be a non-empty list of objects", param="messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            field = f"messages[{i}].role" if isinstance(m, dict) else f"messages[{i}]"
            raise BadRequest(f"messages[{i}] must be an object with a role in {', '.join(ROLES)}", param=field)
        content = m.get("content")
        if isinstance(content, list):
            content = template_content(content, f"messages[{i}].content", images)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise BadRequest(
                f"messages[{i}].content must be a string, a list of text parts or null", param=f"messages[{i}].content"
            )
        message = {**m, "content": content}
        if m.get("tool_calls"):
            message["tool_calls"] = _template_tool_calls(m["tool_calls"], i)
        out.append(message)
    return out


def _image_url(part: dict[str, object], where: str) -> str:
    """The URL of an ``image_url`` part: ``{"image_url": {"url": ...}}`` (OpenAI's) or a string."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise BadRequest(f'{where}: an image part is {{"type": "image_url", "image_url": {{"url": ...}}}}', param=where)
    return url


def template_content(parts: list[object], where: str, images: bool) -> str | list[dict[str, object]]:
    """A message's content parts as chat templates take them: the text parts' text joined, or, with
    image parts (``images``: the model takes them), the parts in order, ``{"type": "text",
    "text": ...}`` and ``{"type": "image"}``. BadRequest naming ``where`` for any other part."""
    out: list[dict[str, object]] = []
    for j, p in enumerate(parts):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "text" and isinstance(p.get("text"), str):  # type: ignore[union-attr]
            out.append({"type": "text", "text": p["text"]})  # type: ignore[index]
        elif kind == "image_url" and images:
            _image_url(p, f"{where}[{j}]")  # type: ignore[arg-type]
            out.append({"type": "image"})
        elif kind == "image_url":
            raise BadRequest(f"{where}: this model takes no images: only text parts are supported", param=where)
        else:
            raise BadRequest(f"{where}: only text{' and image_url' if images else ''} parts are supported", param=where)
    if all(p["type"] == "text" for p in out):
        return "".join(str(p["text"]) for p in out)
    return out


def image_urls(body: dict[str, object]) -> list[tuple[str, str]]:
    """``(field, url)`` of each ``image_url`` part of a chat request's messages, in order (the
    messages checked by `chat_messages` with images), ``field`` naming the part."""
    found = []
    for i, m in enumerate(body.get("messages") or []):  # type: ignore[arg-type]
        content = m.get("content") if isinstance(m, dict) else None
        for j, p in enumerate(content if isinstance(content, list) else []):
            if isinstance(p, dict) and p.get("type") == "image_url":
                where = f"messages[{i}].content[{j}]"
                found.append((where, _image_url(p, where)))
    return found


_DATA_URL = re.compile(r"data:[\w.+-]+/[\w.+-]+(;[\w.+-]+=[\w.+-]+)*;base64,(?P<data>.*)", re.DOTALL)


def data_url_bytes(url: str, where: str) -> bytes:
    """The image file a data URL (``data:image/png;base64,...``) holds. BadRequest naming
    ``where`` for any other URL (nothing is fetched) or a data URL that is not base64."""
    if not url.startswith("data:"):
        shown = url if len(url) <= 60 else url[:57] + "..."
        raise BadRequest(
            f"{where}: images are not fetched from URLs ({shown!r}): send the image inline as a data URL "
            "(data:image/png;base64,...)",
            param=where,
        )
    match = _DATA_URL.fullmatch(url)
    if match is None:
        raise BadRequest(f"{where}: a data URL of an image is data:<media type>;base64,<data>", param=where)
    try:
        return base64.b64decode(match["data"], validate=True)
    except (binascii.Error, ValueError) as e:
        raise BadRequest(f"{where}: the data URL's base64 does not decode ({e})", param=where) from e


def _template_tool_calls(calls: object, i: int) -> list[dict[str, object]]:
    if not isinstance(calls, list) or not all(
        isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
        for c in calls
    ):  # fmt: skip
        raise BadRequest(
            f'messages[{i}].tool_calls must be a list of {{"function": {{"name": ..., "arguments": ...}}}}',
            param=f"messages[{i}].tool_calls",
        )
    out = []
    for c in calls:
        args = c["function"].get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass  # the template shows the string as it is
        out.append({**c, "function": {**c["function"], "arguments": args}})
    return out


def chat_tools(body: dict[str, object], forced: bool = False) -> list[dict[str, object]] | None:
    """The request's function tools, or None when there are none or ``tool_choice`` is ``none``;
    a ``tool_choice`` that forces a call (``required``, or a named function) is refused unless the
    caller can force one (``forced``)."""
    tools = body.get("tools")
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none", None) and not (forced and (choice == "required" or isinstance(choice, dict))):
        raise BadRequest("tool_choice other than auto or none is not supported here", param="tool_choice")
    if choice not in ("auto", "none", None) and not tools:
        raise BadRequest(f"tool_choice {choice!r} needs tools", param="tool_choice")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(
        isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
        for t in tools
    ):  # fmt: skip
        raise BadRequest('tools must be a list of {"type": "function", "function": {"name": ..., ...}}', param="tools")
    return None if choice == "none" or not tools else tools


def template_tools(body: dict[str, object]) -> list[dict[str, object]] | None:
    """The request's function tools as vLLM hands them to the chat template (its tools'
    ``model_dump()``): each ``{"type": "function", "function": {"name", "description",
    "parameters"}}`` in that order, null where absent, ``strict`` only where given; with
    ``tool_choice: none`` too (the model is told of the tools, no call is read back)."""
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools:
        return None
    out = []
    for t in tools:
        f = t["function"]
        function = {"name": f["name"], "description": f.get("description"), "parameters": f.get("parameters")}
        if f.get("strict") is not None:
            function["strict"] = f["strict"]
        out.append({"type": "function", "function": function})
    return out


def render_chat(tokenizer: object, body: dict[str, object], images: bool = False, **template_kwargs: object) -> str:
    """The prompt text of a chat request: its messages (with image parts where ``images``) and
    tools (`template_tools`, after `chat_tools` checked them) rendered by the chat template of
    ``tokenizer`` (or of a processor), with the generation prompt unless
    ``add_generation_prompt`` is false. The request's ``chat_template_kwargs`` override
    ``template_kwargs``."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise BadRequest("this model directory has no tokenizer with a chat template")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise BadRequest("chat_template_kwargs must be an object", param="chat_template_kwargs")
    try:
        return tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            chat_messages(body.get("messages"), images),
            tools=template_tools(body),
            add_generation_prompt=bool_field(body, "add_generation_prompt", True),
            tokenize=False,
            **{**template_kwargs, **kwargs},
        )
    except BadRequest:
        raise
    except Exception as e:
        raise BadRequest(f"the chat template failed on these messages: {e}", param="messages") from e


def assistant_message(content: str, calls: list[ToolCall]) -> dict[str, object]:
    """The ``message`` of a chat completion choice: content null when the answer is only calls;
    ``refusal`` null, as OpenAI's (where it is a required field) and vLLM's answers have it."""
    message: dict[str, object] = {"role": "assistant", "content": content or (None if calls else ""), "refusal": None}
    if calls:
        message["tool_calls"] = [c.to_openai() for c in calls]
    return message


def chat_finish_reason(reason: str, calls: list[ToolCall]) -> str:
    """``tool_calls`` for an answer that stopped on its own with calls in it, else ``reason``."""
    return "tool_calls" if calls and reason == "stop" else reason


def token_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """A completion's ``usage``: the tokens of its prompt, of its output, and both."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character that stands for each byte in a vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(shifted)}}


class TokenBytes:
    """The UTF-8 bytes a token stands for (OpenAI's ``logprobs.content[].bytes``): a token that
    ends inside a character holds part of it, and the bytes of the tokens of a text, joined, are
    the text, where each token's decoded text has a replacement character instead. Read from the
    vocabulary for byte-level BPE tokenizers (GPT-2's alphabet: Qwen, Llama 3) and SentencePiece
    byte-fallback tokens (``<0xE6>``); any other token (special and added ones included) is its
    decoded text's bytes."""

    def __init__(self, tokenizer: object | None) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = decoder is not None and b'"ByteLevel"' in decoder.__getstate__()
        self.alphabet = _byte_alphabet()
        self.added = set(tokenizer.added_tokens_decoder) if tokenizer is not None else set()  # type: ignore[attr-defined]

    def __call__(self, token: int, text: str) -> list[int]:
        """The bytes of ``token``, whose decoded text is ``text``."""
        if self.tokenizer is None or token in self.added:
            return list(text.encode())
        piece = self.tokenizer.convert_ids_to_tokens(token)  # type: ignore[attr-defined]
        if self.byte_level and all(c in self.alphabet for c in piece):
            return [self.alphabet[c] for c in piece]
        if m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece):
            return [int(m[1], 16)]
        return list(text.encode())
