"""Our server's OpenAI-compatible routes through the real ``openai`` SDK: sync and async clients,
streaming, tool calls, token ids and log-probabilities (equal to a HF forward), and bad input
surfacing as the SDK's 400 / 404 errors while the server keeps serving. The model is a tiny one
taught (in a few seconds of SFT) to answer one question with a Hermes-format tool call, so that the
tool-call path runs on what the model really generates."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_lite.utils.tiny import build_tiny_model, teach
from areal_lite.utils.tool_calls import parse_tool_calls

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
from inference_servers import start_servers, stop_servers

KEY = "sk-test"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def teach_tool_call(model_dir: str) -> None:
    """Fine-tune the model until its greedy answer to QUESTION, with WEATHER_TOOL offered or not,
    is CALL (then end of turn)."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    answer = tok.encode(CALL + tok.eos_token, add_special_tokens=False)
    sequences = []
    for tools in ([WEATHER_TOOL], None):
        text = tok.apply_chat_template(QUESTION, tools=tools, add_generation_prompt=True, tokenize=False)
        prompt = tok.encode(text, add_special_tokens=False)
        sequences.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    teach(model_dir, sequences, lr=1e-2)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = build_tiny_model(str(tmp_path_factory.mktemp("openai") / "m"), hidden_size=64, num_layers=2)
    teach_tool_call(path)
    return path


@pytest.fixture(scope="module")
def base_url(model_path: str):
    procs, addresses = start_servers(model_path, 1, ["--api-key", KEY])
    yield f"http://{addresses[0]}/v1"
    stop_servers(procs)


def hf_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), dim=-1)[0, :-1]
    return logp.gather(1, ids[0, 1:, None])[len(prompt) - 1 :, 0]


def test_sync_client_models_completions_and_chat(base_url: str, model_path: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key=KEY)
    [model] = client.models.list().data
    assert model.id == model_path
    prompt = [11, 12, 13, 14]
    done = client.completions.create(
        model=model.id,
        prompt=prompt,
        max_tokens=8,
        logprobs=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    [choice] = done.choices
    out = choice.model_extra["token_ids"]
    assert choice.model_extra["prompt_token_ids"] == prompt and len(out) == 8 and choice.finish_reason == "length"
    hf = AutoModelForCausalLM.from_pretrained(model_path).eval()
    torch.testing.assert_close(
        torch.tensor(choice.logprobs.token_logprobs), hf_logprobs(hf, prompt, out), atol=1e-4, rtol=0
    )
    tok = AutoTokenizer.from_pretrained(model_path)
    assert choice.text == tok.decode(out) and done.usage.prompt_tokens == 4 and done.usage.completion_tokens == 8

    chat = client.chat.completions.create(
        model=model.id, messages=[{"role": "user", "content": "Hello"}], max_tokens=6, n=3, logprobs=True
    )
    assert len(chat.choices) == 3 and [c.index for c in chat.choices] == [0, 1, 2]
    for c in chat.choices:
        assert c.message.role == "assistant" and isinstance(c.message.content, str)
        assert 1 <= len(c.logprobs.content) <= 6 and all(e.logprob <= 0 for e in c.logprobs.content)
    assert chat.usage.completion_tokens == sum(len(c.logprobs.content) for c in chat.choices)


def test_async_client_concurrent_requests(base_url: str) -> None:
    async def ask() -> list:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=KEY)
        try:
            calls = [
                client.chat.completions.create(
                    model=(await client.models.list()).data[0].id,
                    messages=[{"role": "user", "content": f"Count to {i}"}],
                    max_tokens=5 + i,
                    extra_body={"ignore_eos": True},
                )
                for i in range(8)
            ]
            return await asyncio.gather(*calls)
        finally:
            await client.close()

    for i, resp in enumerate(asyncio.run(ask())):
        assert resp.usage.completion_tokens == 5 + i and resp.choices[0].finish_reason == "length"


def test_streaming_adds_up_to_the_whole_answer(base_url: str, model_path: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key=KEY)
    common = {"model": model_path, "max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(prompt="The quick", **common).choices[0]
    chunks = list(client.completions.create(prompt="The quick", stream=True, **common))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert chunks[-1].choices[0].finish_reason == "length" and all(
        c.choices[0].finish_reason is None for c in chunks[:-1]
    )

    messages = [{"role": "user", "content": "Tell me a story"}]
    answer = client.chat.completions.create(messages=messages, **common).choices[0].message.content
    stream = list(
        client.chat.completions.create(messages=messages, stream=True, stream_options={"include_usage": True}, **common)
    )
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == answer
    assert stream[-1].choices == [] and stream[-1].usage.completion_tokens == 12


def test_tool_calls_sync_and_streamed(base_url: str, model_path: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key=KEY)
    common = {"model": model_path, "messages": QUESTION, "tools": [WEATHER_TOOL], "temperature": 0, "max_tokens": 120}
    choice = client.chat.completions.create(**common).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"} and call.id.startswith("call_")

    deltas = [c.choices[0] for c in client.chat.completions.create(stream=True, **common)]
    [streamed] = [t for d in deltas for t in d.delta.tool_calls or []]
    assert streamed.function.name == "get_weather" and json.loads(streamed.function.arguments) == {"city": "Paris"}
    assert deltas[-1].finish_reason == "tool_calls"

    # Without tools the same text is plain content; tool_choice="none" does not parse it either.
    plain = client.chat.completions.create(**{**common, "tools": None}).choices[0]
    assert plain.message.content == CALL and plain.message.tool_calls is None and plain.finish_reason == "stop"
    assert client.chat.completions.create(**common, tool_choice="none").choices[0].message.tool_calls is None

    # The conversation goes on with the call and its result in the history.
    follow = client.chat.completions.create(
        model=model_path,
        messages=[
            *QUESTION,
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'},
        ],
        tools=[WEATHER_TOOL],
        max_tokens=4,
    )
    assert follow.choices[0].message.role == "assistant"


def test_sdk_raises_bad_request_and_not_found_and_server_keeps_serving(base_url: str, model_path: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        client.chat.completions.create(model=model_path, messages=messages, frequency_penalty=0.5)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=model_path, prompt=[1, 2, 3], max_tokens=10_000)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-nope", messages=messages)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
    assert client.chat.completions.create(model=model_path, messages=messages, max_tokens=2).choices


def test_parse_tool_calls_keeps_what_is_not_a_call() -> None:
    text = (
        'Let me check. <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'
        "<tool_call>{not json}</tool_call>"
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call> done'
    )
    content, calls = parse_tool_calls(text)
    assert [c.name for c in calls] == ["a", "b"]
    assert json.loads(calls[0].arguments) == {"x": 1} and json.loads(calls[1].arguments) == {"y": 2}
    assert content == "Let me check. <tool_call>{not json}</tool_call> done"
    assert parse_tool_calls("no calls here") == ("no calls here", [])
