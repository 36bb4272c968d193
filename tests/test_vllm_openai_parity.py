"""Our OpenAI routes against a real vLLM server's (vLLM's CPU build), on the same model: the same
requests to both, answers compared. Marked ``vllm``: `make test-vllm` runs it.

Sampled text differs, so the comparison is of what a client reads: the HTTP status of every
request (valid ones and the ones vLLM refuses); each answer parsed by the openai SDK's own types
(`Completion`, `ChatCompletion`, `ChatCompletionChunk`), with the same OpenAI fields set (vLLM's
own extras such as ``prompt_token_ids`` or ``kv_transfer_params`` left aside); the same usage
counts (one tokenizer and chat template on both sides); the same finish reasons and token counts
where eos is ignored; greedy answers with the same text, tokens, bytes and offsets; and streams
with the same event layout (the role first, usage last when asked for, then ``[DONE]``).

Where vLLM and OpenAI's service differ, ours follows vLLM, the server users run: a budget that
the prompt takes past the context is cut to what fits (one above the context itself is a 400),
``max_tokens`` 0 is a 400 unless ``echo``. Deliberate differences, not compared: ``n`` > 1 at
temperature 0 (vLLM refuses it, OpenAI and ours serve it), a message with a role OpenAI does not
know (vLLM renders it, ours is OpenAI's 400), ``logit_bias`` (vLLM applies it, ours refuses it
with a 400), the bytes of a token that ends inside a character (vLLM gives none, ours what
OpenAI documents: the bytes it holds) and the completion tokens of ``max_tokens`` 0 with ``echo``
(vLLM counts one it does not return).
"""

from __future__ import annotations

import json
import os
import sys

import openai.types as ot
import openai.types.chat as oc
import pydantic
import pytest
import requests
from openai._models import construct_type

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
from inference_servers import start_servers, stop_servers
from vllm_servers import start_vllm_servers, stop_vllm_servers, tiny_vllm_model

pytestmark = pytest.mark.vllm

CONTEXT = 512


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("parity") / "m")
    return tiny_vllm_model(path, CONTEXT)


@pytest.fixture(scope="module")
def both(model_path: str, tmp_path_factory: pytest.TempPathFactory):
    """(vLLM's address, ours)."""
    vllm_procs, vllm_addresses = start_vllm_servers(model_path, 1, str(tmp_path_factory.mktemp("logs")), CONTEXT)
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


C, CH = "/v1/completions", "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
GREEDY = {"temperature": 0, "ignore_eos": True}

ANSWERS = [
    (C, {"prompt": "ab", "max_tokens": 4, **GREEDY}),
    (C, {"prompt": "ab", "max_tokens": 3, "logprobs": 2, "echo": True, **GREEDY}),
    (C, {"prompt": "ab", "max_tokens": 3, "n": 2, "logprobs": 2, "echo": True, "ignore_eos": True}),
    (C, {"prompt": ["ab", "cde"], "max_tokens": 2, **GREEDY}),
    (C, {"prompt": [5, 6, 7], "max_tokens": 2, "seed": 3, "stop": ["x", "y"], "ignore_eos": True}),
    (C, {"prompt": "ab", "max_tokens": 0, "echo": True, "logprobs": 1}),
    (C, {"prompt": [5] * 500, "max_tokens": 20, **GREEDY}),  # cut to the 12 tokens that fit
    (C, {"prompt": "ab", "max_tokens": 2, "user": "u", "unknown_field": 1, **GREEDY}),
    (CH, {"messages": MESSAGES, "max_tokens": 4, **GREEDY}),
    (CH, {"messages": MESSAGES, "max_tokens": 3, "logprobs": True, "top_logprobs": 2, **GREEDY}),
    (CH, {"messages": MESSAGES, "max_tokens": 3, "logprobs": True, "top_logprobs": 2, "n": 2, "ignore_eos": True}),
    (CH, {"messages": MESSAGES, "max_completion_tokens": 3, "response_format": {"type": "text"}, **GREEDY}),
    (CH, {"messages": MESSAGES, "max_tokens": 500, **GREEDY}),  # cut to what fits after the prompt
]
REFUSED = [
    (C, {"model": "no-such-model", "prompt": "ab"}, 404),
    (C, {"prompt": "ab", "max_tokens": 0}, 400),
    (C, {"prompt": "ab", "max_tokens": -1}, 400),
    (C, {"prompt": "ab", "temperature": 3}, 400),
    (C, {"prompt": "ab", "top_p": 0}, 400),
    (C, {"prompt": "ab", "n": 0}, 400),
    (C, {"prompt": "", "max_tokens": 2}, 400),
    (C, {"prompt": "ab", "logprobs": 30}, 400),
    (C, {"prompt": [5] * 600, "max_tokens": 2}, 400),
    (C, {"prompt": "ab", "max_tokens": 600}, 400),  # a budget above the context itself
    (CH, {"messages": MESSAGES, "max_tokens": 0}, 400),
    (CH, {"messages": []}, 400),
    (CH, {}, 400),
    (CH, {"messages": MESSAGES, "top_logprobs": 2}, 400),
    (CH, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 25}, 400),
    (CH, {"messages": [{"role": "user", "content": "a b " * 400}]}, 400),
]
STREAMS = [
    (C, {"prompt": "ab", "max_tokens": 3, "stream_options": {"include_usage": True}, **GREEDY}),
    (C, {"prompt": "ab", "max_tokens": 2, "n": 2, "logprobs": 1, "ignore_eos": True}),
    (CH, {"messages": MESSAGES, "max_tokens": 3, "stream_options": {"include_usage": True}, **GREEDY}),
    (CH, {"messages": MESSAGES, "max_tokens": 2, "logprobs": True, "top_logprobs": 1, **GREEDY}),
]


def with_model(body: dict, model_path: str) -> dict:
    return {"model": model_path, **body} if body and "model" not in body else body


@pytest.mark.parametrize("route,body", ANSWERS, ids=[f"{r[4:]}-{i}" for i, (r, _) in enumerate(ANSWERS)])
def test_answers_read_alike(both, model_path: str, route: str, body: dict) -> None:
    body = with_model(body, model_path)
    (vllm_status, theirs), (status, ours) = post(both[0], route, body), post(both[1], route, body)
    assert (vllm_status, status) == (200, 200), (theirs, ours)
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
        if x.logprobs is not None and route == CH:
            # A token that ends inside a character: vLLM gives it no text and no bytes, ours (as
            # OpenAI documents ``bytes``) the bytes it holds. Every other token alike.
            assert len(y.logprobs.content) == len(x.logprobs.content)
            for t, u in zip(y.logprobs.content, x.logprobs.content):
                assert (t.token, t.bytes) == (u.token, u.bytes) or (u.bytes == [] and t.bytes)
        elif x.logprobs is not None:
            assert (y.logprobs.tokens, y.logprobs.text_offset) == (x.logprobs.tokens, x.logprobs.text_offset)


@pytest.mark.parametrize("route,body,expected", REFUSED, ids=[f"{r[4:]}-{i}" for i, (r, _, _) in enumerate(REFUSED)])
def test_refused_alike(both, model_path: str, route: str, body: dict, expected: int) -> None:
    body = with_model(body, model_path)
    (vllm_status, theirs), (status, ours) = post(both[0], route, body), post(both[1], route, body)
    assert (vllm_status, status) == (expected, expected), (theirs, ours)
    assert isinstance(ours["error"]["message"], str) and ours["error"]["message"]  # OpenAI's error object
    assert {"message", "type", "param", "code"} <= set(ours["error"])


@pytest.mark.parametrize("route,body", STREAMS, ids=[f"{r[4:]}-{i}" for i, (r, _) in enumerate(STREAMS)])
def test_streams_read_alike(both, model_path: str, route: str, body: dict) -> None:
    body = with_model({**body, "stream": True}, model_path)
    (_, theirs), (_, ours) = post(both[0], route, body), post(both[1], route, body)
    kind = ot.Completion if route == C else oc.ChatCompletionChunk
    for events in (theirs, ours):
        assert events[-1] == "[DONE]" and all(isinstance(e, dict) for e in events[:-1])
    a, b = (
        [construct_type(type_=kind, value=e) for e in theirs[:-1]],
        [construct_type(type_=kind, value=e) for e in ours[:-1]],
    )
    if route == CH:  # the first chunk gives the role, with empty content
        assert [c.delta.role for c in b[0].choices] == [c.delta.role for c in a[0].choices] == ["assistant"]
    if body.get("stream_options"):  # usage comes last, alone, and only there
        assert (b[-1].choices, b[-1].usage) == ([], a[-1].usage) and a[-1].choices == []
        assert all(c.usage is None for c in b[:-1])

    def finishes(chunks: list) -> dict[int, str]:
        return {c.index: c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason}

    def tokens(chunks: list) -> dict[int, int]:
        """Per choice, how many tokens the streamed log-probabilities cover."""
        out: dict[int, int] = {}
        for chunk in chunks:
            for c in chunk.choices:
                lp = c.logprobs
                n = (len(lp.tokens or []) if route == C else len(lp.content or [])) if lp is not None else 0
                out[c.index] = out.get(c.index, 0) + n
        return out

    assert finishes(b) == finishes(a)
    if body.get("logprobs"):
        assert tokens(b) == tokens(a)
