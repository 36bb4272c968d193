"""Tool calls in generated text, in the Hermes format that Qwen2.5/Qwen3 and many open models are
trained on: each call is a JSON object ``{"name": ..., "arguments": {...}}`` between
``<tool_call>`` and ``</tool_call>`` (docs/protocol.md, "Tool calls").

`parse_tool_calls` splits a completion into its free text and its calls, as our server's
``/v1/chat/completions`` returns them (``message.content`` and ``message.tool_calls``). A block
whose JSON does not parse, or lacks a string ``name``, stays in the text: the model did not make a
call the caller could run, and the text shows what it wrote.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    """One function call: the tool's name and its arguments as a JSON string (OpenAI's shape)."""

    name: str
    arguments: str
    id: str

    def to_openai(self) -> dict[str, object]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(the text outside well-formed ``<tool_call>`` blocks, stripped; the calls in order)."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    for m in TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append(ToolCall(obj["name"], arguments, f"call_{uuid.uuid4().hex[:24]}"))
        kept.append(text[pos : m.start()])
        pos = m.end()
    kept.append(text[pos:])
    return "".join(kept).strip(), calls
