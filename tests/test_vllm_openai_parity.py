"""Our OpenAI routes against a real vLLM server's (vLLM's CPU build), on the same model: the same
requests to both, answers compared. Marked ``vllm``: `make test-vllm` runs it.

Sampled text differs, so the comparison is of what a client reads: the HTTP status of every
request (valid ones and the ones vLLM refuses) and, for a refusal, OpenAI's error object naming
the field at fault; each answer parsed by the openai SDK's own types (`Completion`,
`ChatCompletion`, `ChatCompletionChunk`, `Response`, `Model`), with the same OpenAI fields set
(vLLM's own extras such as ``prompt_token_ids`` or ``kv_transfer_params`` left aside) and every
field OpenAI's API reference requires present, null or not; the same usage counts (one tokenizer
and chat template on both sides); the same finish and stop reasons and token counts where eos is
ignored; greedy answers with the same text, tokens, bytes, offsets and top log-probability counts;
streams with the same event layout (the role first, usage last when asked for, then ``[DONE]``;
the Responses API's event types in order) and the same text when greedy.

Where vLLM and OpenAI's service differ, ours follows vLLM, the server users run: a budget that
the prompt takes past the context is cut to what fits (one above the context itself is a 400),
``max_tokens`` 0 is a 400 unless ``echo``, a request without ``model`` is served by the first
served name. vLLM's extensions answer as vLLM's: the token a generation stops on (end of sequence
or ``stop_token_ids``) is left out of its text unless ``include_stop_str_in_output``, and
``stop_reason`` names only a stop string or stop token id. Penalties, ``min_p`` and
``logit_bias`` shape the greedy tokens alike, and the log-probabilities reported beside them are
the unshaped model's on both sides (vLLM's default ``raw_logprobs``).

Deliberate differences, not compared (ours is what OpenAI's API reference documents): the error
object's ``type`` and ``code`` (vLLM: ``"BadRequestError"``, ``400``; ours: ``"invalid_request_error"``
and a string code or null), a wrong type that vLLM's pydantic coerces (``"max_tokens": "3"``,
``"stream": "yes"``, ``"logprobs": true`` on completions: ours a 400), ``n: null`` (vLLM's 400,
OpenAI's default 1), ``n`` above 128 or > 1 at temperature 0 (vLLM serves the one, refuses the
other), a message with a role OpenAI does not know or a user message without content (vLLM
renders them, ours is OpenAI's 400), an incomplete Responses answer (vLLM ends its stream with
``response.completed``, ours with OpenAI's ``response.incomplete``), ``GET /v1/models/{id}`` and
404 bodies (vLLM: FastAPI's ``{"detail": ...}``; ours: OpenAI's). Options the embedded engine cannot
honour are a 400 where vLLM applies them: ``best_of``, structured ``response_format``. Also left aside: the bytes of a token that ends inside a character (vLLM
gives none, ours what OpenAI documents: the bytes it holds) and the completion tokens of
``max_tokens`` 0 with ``echo`` (vLLM counts one it does not return).
"""

from __future__ import annotations

import json
import os
import sys

import openai.types as ot
import openai.types.chat as oc
import openai.types.responses as orr
import pydantic
import pytest
import requests
from openai._models import construct_type
from transformers import AutoTokenizer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
from inference_servers import start_servers, stop_servers, with_bos
from vllm_servers import TINY, start_vllm_servers, stop_vllm_servers, tiny_vllm_model

pytestmark = pytest.mark.vllm

CONTEXT = 512


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tiny_vllm_model(str(tmp_path_factory.mktemp("parity") / "m"), CONTEXT)
    with_bos(path)
    return path


@pytest.fixture(scope="module")
def both(model_path: str, tmp_path_factory: pytest.TempPathFactory):
    """(vLLM's address, ours)."""
    logs, tools = str(tmp_path_factory.mktemp("logs")), ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    vllm_procs, vllm_addresses = start_vllm_servers(model_path, 1, logs, CONTEXT, tools)  # tools as agents run it
    try:
        procs, addresses = start_servers(model_path, 1)
        try:
            yield vllm_addresses[0], addresses[0]
        finally:
            stop_servers(procs)
    finally:
        stop_vllm_servers(vllm_procs)


def post(address: str, route: str, body: dict) -> tuple[int, object]:
    """Status and JSON answer; a stream's answer is its list of events (``[DONE]`` as a string)."""
    r = requests.post(f"http://{address}{route}", json=body, stream=bool(body.get("stream")), timeout=120)
    if body.get("stream") and r.status_code == 200:
        data = [line[6:] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
        return 200, [d if d == "[DONE]" else json.loads(d) for d in data]
    return r.status_code, r.json()


def openai_fields(obj: object) -> object:
    """The fields an SDK type declares that are set (not None), recursively; extras left aside."""
    if isinstance(obj, list):  # the first object stands for the rest; a list of numbers is a list
        return [openai_fields(x) for x in obj[:1]] if obj and isinstance(obj[0], pydantic.BaseModel) else "list"
    if isinstance(obj, pydantic.BaseModel):
        declared = type(obj).model_fields
        return {k: openai_fields(getattr(obj, k)) for k in declared if getattr(obj, k) is not None}
    if isinstance(obj, dict):  # a completion's top_logprobs: token -> logprob
        return "dict"
    return type(obj).__name__ if not isinstance(obj, int | float) or isinstance(obj, bool) else "number"


HEAD = {"id", "object", "created", "model", "choices"}
REQUIRED = {
    "text_completion": {"index", "text", "logprobs", "finish_reason"},
    "chat.completion": {"index", "message", "logprobs", "finish_reason"},
    "chat.completion.chunk": {"index", "delta", "finish_reason"},
}
"""What OpenAI's API reference requires of an answer (``HEAD``) and of its choices, by ``object``:
present even when null, which the SDK's types (every nullable field optional) cannot say."""


def missing_required(answer: dict) -> list[str]:
    """The required keys (``REQUIRED``; a message's ``role``, ``content`` and ``refusal``; usage's
    three counts) that ``answer`` lacks."""
    missing = sorted(HEAD - set(answer))
    for c in answer.get("choices", []):
        missing += sorted(REQUIRED[answer["object"]] - set(c))
        if "message" in c:
            missing += sorted({"role", "content", "refusal"} - set(c["message"]))
    if answer.get("usage") is not None:
        missing += sorted({"prompt_tokens", "completion_tokens", "total_tokens"} - set(answer["usage"]))
    return missing


C, CH, R = "/v1/completions", "/v1/chat/completions", "/v1/responses"
MESSAGES = [{"role": "user", "content": "hi"}]
GREEDY = {"temperature": 0, "ignore_eos": True}
STOP_AT_ONCE = {"stop_token_ids": list(range(TINY["vocab_size"])), "temperature": 0}
"""Every token a stop token: the generation stops on its first one, whichever it is."""
PARTS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
IMAGE = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
USAGE = {"include_usage": True}
OPENAI_ONLY = {"user": "u", "metadata": {"k": "v"}, "store": False, "parallel_tool_calls": True, "stream": False,
               "stream_options": None}  # fmt: skip
"""OpenAI request fields that change nothing here, at values that change nothing there."""

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}}}  # fmt: skip
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}

ANSWERS = [
    (C, {"prompt": "ab", "max_tokens": 4, **GREEDY}),
    (C, {"prompt": "ab", "max_tokens": 1, **GREEDY}),
    (C, {"prompt": "ab", "max_tokens": 3, "logprobs": 2, "echo": True, **GREEDY}),
    (C, {"prompt": "abcd", "max_tokens": 2, "logprobs": 0, **GREEDY}),
    (C, {"prompt": "ab", "max_tokens": 3, "n": 2, "logprobs": 2, "echo": True, "ignore_eos": True}),
    (C, {"prompt": ["ab", "cde"], "max_tokens": 2, **GREEDY}),
    (C, {"prompt": ["ab", ""], "max_tokens": 2, **GREEDY}),  # "" is the BOS alone
    (C, {"prompt": [[5, 6], [7, 8, 9]], "max_tokens": 2, "n": 2, "logprobs": 1, "ignore_eos": True}),
    (C, {"prompt": [5, 6, 7], "max_tokens": 2, "seed": 3, "stop": ["x", "y"], "ignore_eos": True}),
    (C, {"prompt": "ab", "max_tokens": 0, "echo": True, "logprobs": 1}),
    (C, {"prompt": [5] * 500, "max_tokens": 20, **GREEDY}),  # cut to the 12 tokens that fit
    (C, {"prompt": "ab", "max_tokens": 2, "user": "u", "unknown_field": 1, **GREEDY}),
    (C, {"prompt": "ab", "max_tokens": 2, "add_special_tokens": False, "logprobs": 0, "echo": True, **GREEDY}),
    (CH, {"messages": MESSAGES, "max_tokens": 2, "add_special_tokens": True, **GREEDY}),
    (C, {"prompt": "ab", "max_tokens": 4, "min_tokens": 2, "top_k": 5, "stop": [], **GREEDY}),
    (C, {"prompt": "ab", "max_tokens": 4, "logprobs": 1, **STOP_AT_ONCE}),
    (C, {"prompt": "ab", "max_tokens": 4, "include_stop_str_in_output": True, **STOP_AT_ONCE}),
    (CH, {"messages": MESSAGES, "max_tokens": 4, **GREEDY}),
    (CH, {"messages": MESSAGES, "max_tokens": 3, "logprobs": True, "top_logprobs": 2, **GREEDY}),
    (CH, {"messages": MESSAGES, "max_tokens": 3, "logprobs": True, "top_logprobs": 0, **GREEDY}),
    (CH, {"messages": MESSAGES, "max_tokens": 3, "logprobs": True, "top_logprobs": 2, "n": 2, "ignore_eos": True}),
    (CH, {"messages": MESSAGES, "max_completion_tokens": 3, "response_format": {"type": "text"}, **GREEDY}),
    (CH, {"messages": MESSAGES, "max_tokens": 500, **GREEDY}),  # cut to what fits after the prompt
    (CH, {"messages": PARTS, "max_tokens": 3, **GREEDY}),
    (CH, {"messages": MESSAGES, "max_tokens": 2, "stop": "zz", **OPENAI_ONLY, **GREEDY}),
    (CH, {"messages": MESSAGES, "max_tokens": 4, **STOP_AT_ONCE}),
    # Structured output (llguidance here, xgrammar in vLLM): the same greedy tokens.
    (C, {"prompt": "ab", "max_tokens": 10, "structured_outputs": {"choice": ["left", "right on"]}, "temperature": 0}),
    (C, {"prompt": "ab", "max_tokens": 10, "structured_outputs": {"regex": "[a-c]{3}-[0-9]"}, "temperature": 0}),
    (CH, {"messages": MESSAGES, "max_tokens": 60, "response_format": {"type": "json_object"}, "temperature": 0}),
    (
        CH,
        {
            "messages": MESSAGES,
            "max_tokens": 60,
            "temperature": 0,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "v",
                    "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
                },
            },
        },
    ),
    # Tools rendered into the prompt as vLLM renders them (its model_dump: description null), also with none.
    (CH, {"messages": MESSAGES, "tools": [TOOL, CLOCK], "max_tokens": 6, "temperature": 0}),
    (CH, {"messages": MESSAGES, "tools": [TOOL, CLOCK], "tool_choice": "none", "max_tokens": 6, "temperature": 0}),
    # Penalties and biases change the greedy tokens (test_shaping checks that they do), the same way.
    (C, {"prompt": "ab", "max_tokens": 10, "repetition_penalty": 1.8, "logprobs": 1, **GREEDY}),
    (C, {"prompt": "ab", "max_tokens": 10, "frequency_penalty": 1.5, **GREEDY}),
    (C, {"prompt": [7, 8, 9], "max_tokens": 10, "presence_penalty": 2, "frequency_penalty": -0.5, **GREEDY}),
    (C, {"prompt": "ab", "max_tokens": 4, "logit_bias": {"42": 100, "43": -100}, "logprobs": 2, **GREEDY}),
    (
        CH,
        {
            "messages": MESSAGES,
            "max_tokens": 4,
            "logit_bias": {"77": 30},
            "logprobs": True,
            "top_logprobs": 1,
            **GREEDY,
        },
    ),
    (
        CH,
        {
            "messages": MESSAGES,
            "max_tokens": 6,
            "presence_penalty": 1,
            "repetition_penalty": 1.3,
            "min_p": 0.5,
            **GREEDY,
        },
    ),
]
REFUSED = [  # (route, body, status, the param ours names)
    (C, {"model": "no-such-model", "prompt": "ab"}, 404, "model"),
    (C, {"prompt": "ab", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "ab", "max_tokens": -1}, 400, "max_tokens"),
    (C, {"prompt": "ab", "max_tokens": 600}, 400, "max_tokens"),  # a budget above the context itself
    (C, {"prompt": "ab", "temperature": 3}, 400, "temperature"),
    (C, {"prompt": "ab", "temperature": -0.5}, 400, "temperature"),
    (C, {"prompt": "ab", "temperature": "hot"}, 400, "temperature"),
    (C, {"prompt": "ab", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "ab", "top_p": 1.5}, 400, "top_p"),
    (C, {"prompt": "ab", "n": 0}, 400, "n"),
    (C, {"prompt": "ab", "seed": "x"}, 400, "seed"),
    (C, {"prompt": "ab", "seed": 2**64}, 400, "seed"),
    (C, {"prompt": "ab", "stop": 5}, 400, "stop"),
    (C, {"prompt": "ab", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens"),
    (C, {"prompt": "ab", "logprobs": 30}, 400, "logprobs"),
    (C, {"prompt": "ab", "suffix": "x"}, 400, "suffix"),
    (C, {"prompt": "", "max_tokens": 2}, 400, "prompt"),
    (C, {"prompt": 5}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": [[]]}, 400, "prompt"),
    (C, {"prompt": [5] * 600, "max_tokens": 2}, 400, "prompt"),
    (C, {"prompt": [10**6]}, 400, None),
    (CH, {"messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
    (CH, {"messages": MESSAGES, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CH, {"messages": []}, 400, "messages"),
    (CH, {"messages": "hi"}, 400, "messages"),
    (CH, {}, 400, "messages"),
    (CH, {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    (CH, {"messages": IMAGE}, 400, "messages[0].content"),
    (CH, {"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
    (CH, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 25}, 400, "top_logprobs"),
    (CH, {"messages": MESSAGES, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (CH, {"messages": MESSAGES, "presence_penalty": 3}, 400, "presence_penalty"),
    (C, {"prompt": "ab", "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    (C, {"prompt": "ab", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (C, {"prompt": "ab", "min_p": 1.5}, 400, "min_p"),
    (C, {"prompt": "ab", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    (C, {"prompt": "ab", "structured_outputs": {"regex": "(unclosed"}}, 400, "structured_outputs"),
    (C, {"prompt": "ab", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "structured_outputs"),
    (
        CH,
        {"messages": MESSAGES, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        400,
        "tool_choice",
    ),
    (
        CH,
        {
            "messages": MESSAGES,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
        },
        400,
        "response_format",
    ),
    (CH, {"messages": [{"role": "user", "content": "a b " * 400}]}, 400, "messages"),
    (R, {"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    (R, {"input": []}, 400, "input"),
]
STREAMS = [
    (C, {"prompt": "ab", "max_tokens": 3, "stream_options": USAGE, **GREEDY}),
    (C, {"prompt": "ab", "max_tokens": 2, "n": 2, "logprobs": 1, "ignore_eos": True}),
    (C, {"prompt": "ab", "max_tokens": 2, "echo": True, "logprobs": 1, **GREEDY}),
    (C, {"prompt": "ab", "max_tokens": 4, **STOP_AT_ONCE}),
    (CH, {"messages": MESSAGES, "max_tokens": 3, "stream_options": USAGE, **GREEDY}),
    (CH, {"messages": MESSAGES, "max_tokens": 2, "logprobs": True, "top_logprobs": 1, **GREEDY}),
    (CH, {"messages": MESSAGES, "max_tokens": 2, "n": 2, "stream_options": USAGE, "ignore_eos": True}),
    (CH, {"messages": MESSAGES, "max_tokens": 4, **STOP_AT_ONCE}),
]


def with_model(body: dict, model_path: str) -> dict:
    return {"model": model_path, **body} if body and "model" not in body else body


def ids(cases: list) -> list[str]:
    return [f"{case[0][4:].replace('/', '-')}-{i}" for i, case in enumerate(cases)]


def top_sizes(route: str, logprobs: object) -> object:
    """How many top log-probabilities each position has (a completion's dict: the token, then the
    most likely ones, a token named twice once)."""
    if route == C:
        return [None if t is None else len(t) for t in logprobs.top_logprobs]
    return [len(t.top_logprobs) for t in logprobs.content]


@pytest.mark.parametrize("route,body", ANSWERS, ids=ids(ANSWERS))
def test_answers_read_alike(both, model_path: str, route: str, body: dict) -> None:
    body = with_model(body, model_path)
    (vllm_status, theirs), (status, ours) = post(both[0], route, body), post(both[1], route, body)
    assert (vllm_status, status) == (200, 200), (theirs, ours)
    assert missing_required(ours) == [], ours
    kind = ot.Completion if route == C else oc.ChatCompletion
    a, b = construct_type(type_=kind, value=theirs), construct_type(type_=kind, value=ours)  # as the SDK reads
    assert openai_fields(b) == openai_fields(a)
    if body.get("max_tokens") == 0:  # vLLM counts one completion token it does not return
        assert (b.usage.prompt_tokens, b.usage.completion_tokens) == (a.usage.prompt_tokens, 0)
    else:
        assert b.usage == a.usage, (b.usage, a.usage)
    assert len(b.choices) == len(a.choices)
    for x, y in zip(sorted(a.choices, key=lambda c: c.index), sorted(b.choices, key=lambda c: c.index)):
        assert (y.index, y.finish_reason) == (x.index, x.finish_reason)
        if x.logprobs is not None:
            lengths = (
                (len(x.logprobs.tokens), len(x.logprobs.token_logprobs), len(x.logprobs.top_logprobs))
                if route == C
                else (len(x.logprobs.content), [len(t.top_logprobs) for t in x.logprobs.content])
            )
            assert lengths == (
                (len(y.logprobs.tokens), len(y.logprobs.token_logprobs), len(y.logprobs.top_logprobs))
                if route == C
                else (len(y.logprobs.content), [len(t.top_logprobs) for t in y.logprobs.content])
            )
        if body.get("temperature") != 0:
            continue
        # Greedy on the same weights: the same tokens, so the same text and log-probabilities
        # (vLLM keeps back the bytes of a character the last token leaves unfinished; ours ends
        # the text with a replacement character there, as the tokenizer's decode does).
        texts = [(c.text if route == C else c.message.content).rstrip("\ufffd") for c in (y, x)]
        assert texts[0] == texts[1], (ours, theirs)
        assert y.model_extra["stop_reason"] == x.model_extra["stop_reason"]
        if route == CH:  # forced tool choices: the same calls
            assert [(t.function.name, t.function.arguments) for t in y.message.tool_calls or []] == [
                (t.function.name, t.function.arguments) for t in x.message.tool_calls or []
            ]
        if x.logprobs is not None and route == CH:
            # A token that ends inside a character: vLLM gives it no text and no bytes, ours (as
            # OpenAI documents ``bytes``) the bytes it holds. Every other token alike.
            assert len(y.logprobs.content) == len(x.logprobs.content)
            for t, u in zip(y.logprobs.content, x.logprobs.content):
                assert (t.token, t.bytes) == (u.token, u.bytes) or (u.bytes == [] and t.bytes)
        elif x.logprobs is not None:
            assert (y.logprobs.tokens, y.logprobs.text_offset) == (x.logprobs.tokens, x.logprobs.text_offset)
        if x.logprobs is not None:
            assert top_sizes(route, y.logprobs) == top_sizes(route, x.logprobs)


@pytest.mark.parametrize("route,body,expected,param", REFUSED, ids=ids(REFUSED))
def test_refused_alike(both, model_path: str, route: str, body: dict, expected: int, param: str | None) -> None:
    body = with_model(body, model_path)
    (vllm_status, theirs), (status, ours) = post(both[0], route, body), post(both[1], route, body)
    assert (vllm_status, status) == (expected, expected), (theirs, ours)
    error = ours["error"]  # OpenAI's error object, naming the field at fault
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_end_of_sequence_has_no_stop_reason(both, model_path: str) -> None:
    """A generation that samples its end of sequence finishes with ``stop`` and no ``stop_reason``
    (only a stop string or a stop token id is named); its text ends before it."""
    body = {"model": model_path, "prompt": "ab", "max_tokens": 400, "n": 8, "skip_special_tokens": False}
    eos = AutoTokenizer.from_pretrained(model_path).eos_token
    for address in both:
        _, answer = post(address, C, body)
        stopped = [c for c in answer["choices"] if c["finish_reason"] == "stop"]
        assert stopped, "no choice sampled its end of sequence in 400 tokens"
        assert all(c["stop_reason"] is None and eos not in c["text"] for c in stopped), answer


def test_models_read_alike(both, model_path: str) -> None:
    cards = [requests.get(f"http://{address}/v1/models", timeout=30).json() for address in both]
    a, b = (construct_type(type_=ot.Model, value=c["data"][0]) for c in cards)
    assert openai_fields(b) == openai_fields(a) and (b.id, b.object) == (a.id, a.object) == (model_path, "model")
    assert [c["object"] for c in cards] == ["list", "list"]
    assert b.model_extra["max_model_len"] == a.model_extra["max_model_len"] == CONTEXT


def test_responses_read_alike(both, model_path: str) -> None:
    """The Responses API, plain and streamed: the same status, usage and greedy text, and the same
    event types in the same order, but the last (an incomplete answer: vLLM's stream ends with
    ``response.completed``, ours with OpenAI's ``response.incomplete``)."""
    body = {"model": model_path, "input": "hi", "max_output_tokens": 3, **GREEDY}
    (_, theirs), (_, ours) = post(both[0], R, body), post(both[1], R, body)
    a, b = construct_type(type_=orr.Response, value=theirs), construct_type(type_=orr.Response, value=ours)
    assert (b.status, b.incomplete_details, b.usage.input_tokens, b.usage.output_tokens, b.usage.total_tokens) == (
        a.status, a.incomplete_details, a.usage.input_tokens, a.usage.output_tokens, a.usage.total_tokens)  # fmt: skip
    assert [(o.type, o.role) for o in b.output] == [(o.type, o.role) for o in a.output] == [("message", "assistant")]
    assert b.output_text.rstrip("\ufffd") == a.output_text.rstrip("\ufffd")

    (_, theirs), (_, ours) = post(both[0], R, {**body, "stream": True}), post(both[1], R, {**body, "stream": True})

    def types(events: list[dict]) -> list[str]:  # deltas counted once: the pieces of text differ
        out = [e["type"] for e in events]
        return [t for i, t in enumerate(out) if i == 0 or t != out[i - 1]]

    assert types(ours)[:-1] == types(theirs)[:-1] and types(theirs)[-1] == "response.completed"
    assert types(ours)[-1] == "response.incomplete" and ours[-1]["response"]["status"] == "incomplete"
    assert [e["sequence_number"] for e in ours] == list(range(len(ours)))


@pytest.mark.parametrize("route,body", STREAMS, ids=ids(STREAMS))
def test_streams_read_alike(both, model_path: str, route: str, body: dict) -> None:
    body = with_model({**body, "stream": True}, model_path)
    (_, theirs), (_, ours) = post(both[0], route, body), post(both[1], route, body)
    kind = ot.Completion if route == C else oc.ChatCompletionChunk
    for events in (theirs, ours):
        assert events[-1] == "[DONE]" and all(isinstance(e, dict) for e in events[:-1])
    assert all(missing_required(e) == [] for e in ours[:-1]), ours
    a, b = (
        [construct_type(type_=kind, value=e) for e in theirs[:-1]],
        [construct_type(type_=kind, value=e) for e in ours[:-1]],
    )
    assert {c.object for c in b} == {c.object for c in a} and len({c.id for c in b}) == 1
    if route == CH:  # each choice's first chunk gives the role, with empty content
        roles = [[(c.index, c.delta.role) for k in chunks for c in k.choices if c.delta.role] for chunks in (a, b)]
        assert roles[1] == roles[0] == [(i, "assistant") for i in range(body.get("n", 1))]
        assert [c.index for c in b[0].choices] == [c.index for c in a[0].choices] == [0]
    if body.get("stream_options"):  # usage comes last, alone, and only there
        assert (b[-1].choices, b[-1].usage) == ([], a[-1].usage) and a[-1].choices == []
        assert all(c.usage is None for c in b[:-1])
    else:
        assert all(c.usage is None for c in a + b)

    def per_choice(chunks: list, what) -> dict[int, object]:
        out: dict[int, list] = {}
        for chunk in chunks:
            for c in chunk.choices:
                out.setdefault(c.index, []).append(what(c))
        return out

    def finishes(chunks: list) -> dict[int, list]:
        return {i: [f for f in fs if f] for i, fs in per_choice(chunks, lambda c: c.finish_reason).items()}

    def stop_reasons(chunks: list) -> dict[int, list]:
        named = per_choice(chunks, lambda c: (c.model_extra or {}).get("stop_reason"))
        return {i: [s for s in ss if s is not None] for i, ss in named.items()}

    def tokens(chunks: list) -> dict[int, int]:
        """Per choice, how many tokens the streamed log-probabilities cover."""

        def n(c: object) -> int:
            lp = c.logprobs
            return (len(lp.tokens or []) if route == C else len(lp.content or [])) if lp is not None else 0

        return {i: sum(ns) for i, ns in per_choice(chunks, n).items()}

    def text(chunks: list) -> dict[int, str]:
        pieces = per_choice(chunks, lambda c: c.text if route == C else (c.delta.content or ""))
        return {i: "".join(p).rstrip("\ufffd") for i, p in pieces.items()}

    assert finishes(b) == finishes(a) and all(len(f) == 1 for f in finishes(b).values())
    assert stop_reasons(b) == stop_reasons(a)
    if body.get("logprobs"):
        assert tokens(b) == tokens(a)
    if body.get("temperature") == 0:
        assert text(b) == text(a)


@pytest.mark.parametrize("choice", [NAMED, "required"], ids=["named", "required"])
def test_a_forced_tool_choice_starts_the_same_hermes_call(both, model_path: str, choice: object) -> None:
    """vLLM's hermes tool parser forces a call in the Hermes format (``<tool_call>\\n{"name": ...,
        "arguments": ``), and so do we: the same text up to the arguments (llguidance writes forced text
    in its canonical tokens, xgrammar lets the model pick any that spell it). There the two part:
        ours holds the arguments to the tool's schema, vLLM's CPU build left them free (a tiny random
        model writes a number there, to the end of its budget)."""
    body = {"model": model_path, "messages": MESSAGES, "tools": [TOOL, CLOCK], "tool_choice": choice,
            "max_tokens": 120, "temperature": 0, "return_token_ids": True}  # fmt: skip
    (s1, theirs), (s2, ours) = post(both[0], CH, body), post(both[1], CH, body)
    assert (s1, s2) == (200, 200), (theirs, ours)
    head = '<tool_call>\n{"name": "get_weather", "arguments": '
    tok = AutoTokenizer.from_pretrained(model_path)
    texts = [tok.decode(x["choices"][0]["token_ids"]) for x in (theirs, ours)]
    assert texts[0][: len(head)] == texts[1][: len(head)] == head, texts
    assert theirs["usage"]["prompt_tokens"] == ours["usage"]["prompt_tokens"]
