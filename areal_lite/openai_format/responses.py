"""OpenAI's Responses API (``POST /v1/responses``) over a chat-completions generator, read and
written once for everything that answers it: our server (`areal_lite.engines.server.responses_routes`)
and the agent workflows' recording proxy (`areal_lite.workflows.openai_proxy`).

`chat_body` turns a Responses request into the chat-completions request it stands for: the
``instructions`` as a system message, the ``input`` items as messages (a ``function_call`` item is
a tool call of the assistant message before it, a ``function_call_output`` a ``tool`` message),
function ``tools`` in chat's shape, ``max_output_tokens`` as ``max_completion_tokens``, top
log-probabilities when ``include`` asks for ``message.output_text.logprobs``. `response_object`
and `ResponseEvents` write the answer: a ``message`` item with one ``output_text`` part, then one
``function_call`` item per call (`finished_response`), and, streamed, the events the SDKs read (``response.created``,
``response.output_text.delta``, ``response.function_call_arguments.done``,
``response.completed``, ...), each with its ``sequence_number``.

Deliberate limits: nothing is stored, so ``previous_response_id``, ``conversation`` and stored
``prompt`` templates are a 400 (send the whole conversation in ``input``), as are tools other than
functions, forced ``tool_choice``, structured ``text.format`` where the caller cannot constrain
output (the recording proxy), and non-text inputs (images, files).
``reasoning`` settings, ``truncation``, ``store`` and ``parallel_tool_calls`` are accepted and
have no effect (the models have no separate reasoning channel; a prompt past the context is a 400).
"""

from __future__ import annotations

import time
import uuid

from areal_lite.openai_format.chat import BadRequest, int_field
from areal_lite.openai_format.tool_calls import ToolCall

LOGPROBS_INCLUDE = "message.output_text.logprobs"
PASSED_THROUGH = ("temperature", "top_p", "top_k", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "seed",
                  "chat_template_kwargs", "skip_special_tokens", "request_id")  # fmt: skip
"""Request keys handed to the chat request as they are (vLLM's extensions included)."""


def _text_of(content: object, where: str) -> str:
    """The text of a message's ``content``: a string, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or a list of content parts", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise BadRequest(f"{where}.content[{j}]: only text parts are supported, got {kind!r}", param="input")
    return "".join(texts)


def input_messages(body: dict[str, object]) -> list[dict[str, object]]:
    """The chat messages of a Responses request's ``instructions`` and ``input``."""
    messages: list[dict[str, object]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest("instructions must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadRequest("input must be a string or a non-empty list of items", param="input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise BadRequest(f"{where}.role must be user, system, developer or assistant", param="input")
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments", "{}"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(args, str) or not isinstance(call_id, str):
                raise BadRequest(f"{where}: a function_call needs string name, arguments and call_id", param="input")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # type: ignore[union-attr]
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise BadRequest(f"{where}: a function_call_output needs a string call_id", param="input")
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, where)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            continue  # no model here writes a separate reasoning channel to replay
        elif kind == "item_reference":
            raise BadRequest(f"{where}: items are not stored on this server; send them in full", param="input")
        else:
            raise BadRequest(f"{where}: input items of type {kind!r} are not supported", param="input")
    return messages


def _chat_tools(body: dict[str, object]) -> list[dict[str, object]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list", param="tools")
    out = []
    for j, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            kind = t.get("type") if isinstance(t, dict) else None
            raise BadRequest(f"tools[{j}]: only function tools are supported, got {kind!r}", param="tools")
        # ``strict`` (schema-constrained arguments) is left out: no engine here constrains decoding,
        # and the chat template then shows the tool as a chat request would.
        function = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_body(body: dict[str, object], structured: bool = False) -> dict[str, object]:
    """The chat-completions request a Responses request stands for; with ``structured`` (a caller
    that constrains output) a ``text.format`` of ``json_object`` or ``json_schema`` becomes its
    ``response_format`` and a ``tool_choice`` may force a call, otherwise both are refused. Raises
    `BadRequest`."""
    for key, what in (
        ("previous_response_id", "responses are not stored on this server: send the whole conversation in input"),
        ("conversation", "conversations are not stored on this server: send the whole conversation in input"),
        ("prompt", "stored prompts are not supported: send instructions and input"),
    ):
        if body.get(key) is not None:
            raise BadRequest(f"{key}: {what}", param=key)
    if body.get("background"):
        raise BadRequest("background responses are not supported", param="background")
    text = body.get("text") or {}
    fmt = text.get("format") if isinstance(text, dict) else None
    response_format = _response_format(fmt, structured)
    choice = _tool_choice(body.get("tool_choice", "auto"), structured)
    include = body.get("include") or []
    if not isinstance(include, list):
        raise BadRequest("include must be a list", param="include")
    chat: dict[str, object] = {"messages": input_messages(body), "tool_choice": choice or "auto"}
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    if response_format is not None:
        chat["response_format"] = response_format
    tools = _chat_tools(body)
    if tools:
        chat["tools"] = tools
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = int_field(body, "max_output_tokens", 0)
    top = int_field(body, "top_logprobs", 0)
    if LOGPROBS_INCLUDE in include or top:
        chat.update(logprobs=True, top_logprobs=top)
    for key in PASSED_THROUGH:
        if key in body:
            chat[key] = body[key]
    return chat


def _tool_choice(choice: object, structured: bool) -> object:
    """Chat's ``tool_choice`` for a Responses one: ``auto``, ``none``, and where the caller can
    force a call (``structured``), ``required`` or a named function (``{"type": "function",
    "name": ...}``, chat's ``{"type": "function", "function": {"name": ...}}``)."""
    if choice in ("auto", "none", None):
        return choice
    if structured and choice == "required":
        return choice
    if (
        structured
        and isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("name"), str)
    ):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise BadRequest(f"tool_choice {choice!r} is not supported here", param="tool_choice")


def _response_format(fmt: object, structured: bool) -> dict[str, object] | None:
    """Chat's ``response_format`` for a Responses ``text.format`` (None: plain text)."""
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if not structured or kind not in ("json_object", "json_schema"):
        raise BadRequest(f"text.format {kind!r} (structured output) is not supported here", param="text")
    if kind == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}  # type: ignore[union-attr]


def wants_logprobs(body: dict[str, object]) -> bool:
    return LOGPROBS_INCLUDE in (body.get("include") or [])


def usage(prompt_tokens: int, output_tokens: int) -> dict[str, object]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens,
    }


def status_of(finish: str) -> tuple[str, dict[str, object] | None]:
    """(``status``, ``incomplete_details``) of a generation that ended for ``finish``."""
    if finish == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish == "abort":
        return "incomplete", None
    return "completed", None


def message_item(item_id: str, text: str, logprobs: list[dict[str, object]] | None, status: str) -> dict[str, object]:
    part: dict[str, object] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def call_item(call: ToolCall) -> dict[str, object]:
    return {
        "id": f"fc_{call.id.removeprefix('call_')}",
        "type": "function_call",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": "completed",
    }


def output_items(
    content: str, calls: list[ToolCall], logprobs: list[dict[str, object]] | None, status: str, item_id: str
) -> list[dict[str, object]]:
    """A message item (left out when the answer is only calls), then one function_call item per call."""
    items = [message_item(item_id, content, logprobs, status)] if content or not calls else []
    return items + [call_item(c) for c in calls]


def response_object(
    body: dict[str, object],
    response_id: str,
    model: str,
    output: list[dict[str, object]],
    status: str,
    incomplete: dict[str, object] | None = None,
    usage_: dict[str, object] | None = None,
) -> dict[str, object]:
    """The ``response`` object, echoing the request's settings as OpenAI does."""
    text = body.get("text") if isinstance(body.get("text"), dict) else {}
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),  # an integer, as OpenAI and vLLM send it
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "model": model,
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "store": False,
        "temperature": 1.0 if body.get("temperature") is None else body["temperature"],  # what sampled
        "text": {"format": {"type": "text"}, **text},  # type: ignore[dict-item]
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "top_p": 1.0 if body.get("top_p") is None else body["top_p"],
        "truncation": body.get("truncation") or "disabled",
        "usage": usage_,
        "user": body.get("user"),
    }


def finished_response(
    body: dict[str, object],
    response_id: str,
    model: str,
    content: str,
    calls: list[ToolCall],
    logprobs: list[dict[str, object]] | None,
    finish: str,
    prompt_tokens: int,
    output_tokens: int,
    item_id: str,
) -> dict[str, object]:
    """The ``response`` object of a generation that ended for ``finish`` (stop, length or abort):
    its message item ``item_id`` and function calls (`output_items`), status and usage."""
    status, incomplete = status_of(finish)
    output = output_items(content, calls, logprobs, status, item_id)
    return response_object(body, response_id, model, output, status, incomplete, usage(prompt_tokens, output_tokens))


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


class ResponseEvents:
    """The server-sent events of one streamed response, in order, numbered.

    `start` opens it; `text` adds a piece of the message's text (opening the message item and its
    text part the first time); `finish` closes the message, adds the function calls and ends with
    ``response.completed`` (``response.incomplete`` when the generation was cut short)."""

    def __init__(self, body: dict[str, object], response_id: str, model: str) -> None:
        self.body, self.response_id, self.model = body, response_id, model
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.seq = 0
        self.text_so_far = ""
        self.opened = False

    def _event(self, kind: str, **fields: object) -> dict[str, object]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def start(self) -> list[dict[str, object]]:
        skeleton = response_object(self.body, self.response_id, self.model, [], "in_progress")
        return [
            self._event("response.created", response=skeleton),
            self._event("response.in_progress", response=skeleton),
        ]

    def _open(self) -> list[dict[str, object]]:
        if self.opened:
            return []
        self.opened = True
        item = {**message_item(self.item_id, "", None, "in_progress"), "content": []}
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            self._event("response.output_item.added", output_index=0, item=item),
            self._event(
                "response.content_part.added", item_id=self.item_id, output_index=0, content_index=0, part=part
            ),
        ]

    def text(self, delta: str, logprobs: list[dict[str, object]] | None = None) -> list[dict[str, object]]:
        if not delta:
            return []
        self.text_so_far += delta
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return [*self._open(), self._event("response.output_text.delta", **where, delta=delta, logprobs=logprobs or [])]

    def finish(
        self,
        content: str,
        calls: list[ToolCall],
        logprobs: list[dict[str, object]] | None,
        finish: str,
        usage_: dict[str, object],
    ) -> list[dict[str, object]]:
        status, incomplete = status_of(finish)
        events: list[dict[str, object]] = []
        output: list[dict[str, object]] = []
        if self.opened or content or not calls:
            rest = content[len(self.text_so_far) :] if content.startswith(self.text_so_far) else ""
            events += self.text(rest)
            events += self._open()
            text = self.text_so_far
            where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
            item = message_item(self.item_id, text, logprobs, status)
            events += [
                self._event("response.output_text.done", **where, text=text, logprobs=logprobs or []),
                self._event("response.content_part.done", **where, part=item["content"][0]),  # type: ignore[index]
                self._event("response.output_item.done", output_index=0, item=item),
            ]
            output.append(item)
        for call in calls:
            index, item = len(output), call_item(call)
            where = {"item_id": item["id"], "output_index": index}
            events += [
                self._event("response.output_item.added", output_index=index, item={**item, "arguments": "", "status": "in_progress"}),
                self._event("response.function_call_arguments.delta", **where, delta=call.arguments),
                self._event("response.function_call_arguments.done", **where, arguments=call.arguments, name=call.name),
                self._event("response.output_item.done", output_index=index, item=item),
            ]  # fmt: skip
            output.append(item)
        final = response_object(self.body, self.response_id, self.model, output, status, incomplete, usage_)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=final)]
