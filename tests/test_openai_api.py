"""Our server's OpenAI-compatible routes through the real ``openai`` SDK and the ``openai-agents``
SDK: sync and async clients, token-by-token streaming, tool calls, token ids, log-probabilities and
top log-probabilities (equal to a HF forward), seeds, served model names, the Responses API (plain,
streamed, function tools; openai-agents' default model), ``/inference/v1/generate``, vLLM's rule
for the token a generation stops on, echoed prompts' top log-probabilities, and bad input surfacing
as the SDK's errors with OpenAI's error object while the server keeps serving. The model
is a tiny one taught (in a few seconds of SFT) to answer one question with a Hermes-format tool
call, so that the tool-call path runs on what the model really generates."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_lite.openai_format.tool_calls import parse_tool_calls
from areal_lite.utils.tiny import build_tiny_model, teach

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
ALIASES = ["gpt-5.6-luna", "Qwen/Qwen2.5-0.5B-Instruct"]
"""Served names besides the path: openai-agents' default model, and a hub-style name."""
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


CALLED = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}  # fmt: skip
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "clear"}
FINAL = "It is clear."


def teach_tool_call(model_dir: str) -> None:
    """Fine-tune the model until its greedy answer to QUESTION, with WEATHER_TOOL offered or not,
    is CALL (then end of turn), and its answer once the tool said ``clear`` is FINAL."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    sequences = []
    for messages, tools, reply in (
        (QUESTION, [WEATHER_TOOL], CALL),
        (QUESTION, None, CALL),
        ([*QUESTION, CALLED, RESULT], [WEATHER_TOOL], FINAL),
    ):
        text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        prompt = tok.encode(text, add_special_tokens=False)
        answer = tok.encode(reply + tok.eos_token, add_special_tokens=False)
        sequences.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    teach(model_dir, sequences, lr=1e-2)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = build_tiny_model(str(tmp_path_factory.mktemp("openai") / "m"), hidden_size=64, num_layers=2)
    teach_tool_call(path)
    return path


@pytest.fixture(scope="module")
def base_url(model_path: str):
    names = [model_path, *ALIASES]  # the path first: what answers name when a request names none
    procs, addresses = start_servers(model_path, 1, ["--api-key", KEY, "--served-model-name", *names])
    yield f"http://{addresses[0]}/v1"
    stop_servers(procs)


def hf_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), dim=-1)[0, :-1]
    return logp.gather(1, ids[0, 1:, None])[len(prompt) - 1 :, 0]


def test_sync_client_models_completions_and_chat(base_url: str, model_path: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key=KEY)
    model = client.models.list().data[0]
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
        client.chat.completions.create(model=model_path, messages=messages, frequency_penalty=2.5)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model=model_path, messages=messages, response_format={"type": "xml"})
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1, got 0"):
        client.completions.create(model=model_path, prompt=[1, 2, 3], max_tokens=0)  # vLLM's 400 (0 with echo scores)
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens must be at least 1, got 0"):
        client.chat.completions.create(model=model_path, messages=messages, max_completion_tokens=0)
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


def hf_top(model: torch.nn.Module, prompt: list[int], output: list[int], k: int) -> torch.return_types.topk:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), dim=-1)[0, len(prompt) - 1 : -1]
    return logp.topk(k, dim=-1)


def test_top_logprobs_equal_a_hf_forward(base_url: str, model_path: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key=KEY)
    hf = AutoModelForCausalLM.from_pretrained(model_path).eval()
    tok = AutoTokenizer.from_pretrained(model_path)
    chat = client.chat.completions.create(
        model=model_path, messages=[{"role": "user", "content": "Hello"}], max_tokens=6, logprobs=True,
        top_logprobs=5, extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    choice = chat.choices[0]
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False,
                                                add_generation_prompt=True), add_special_tokens=False)  # fmt: skip
    top = hf_top(hf, prompt, choice.model_extra["token_ids"], 5)
    for k, entry in enumerate(choice.logprobs.content):
        assert [t.token for t in entry.top_logprobs] == [tok.decode([i]) for i in top.indices[k].tolist()]
        torch.testing.assert_close(
            torch.tensor([t.logprob for t in entry.top_logprobs]), top.values[k], atol=1e-4, rtol=0
        )

    done = client.completions.create(model=model_path, prompt=[11, 12, 13], max_tokens=5, logprobs=3,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    c = done.choices[0]
    top = hf_top(hf, [11, 12, 13], c.model_extra["token_ids"], 3)
    for k, (token, entry) in enumerate(zip(c.logprobs.tokens, c.logprobs.top_logprobs)):
        assert token in entry and 3 <= len(entry) <= 4  # vLLM's: the sampled token and the 3 most likely
        assert abs(max(entry.values()) - float(top.values[k, 0])) < 1e-4
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=model_path, messages=QUESTION, logprobs=True, top_logprobs=21)


def test_same_seed_same_tokens_whatever_runs_beside(base_url: str, model_path: str) -> None:
    async def run() -> tuple[list, list, list, list]:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=KEY)
        common = {"model": model_path, "prompt": "The quick", "max_tokens": 24, "temperature": 1.0,
                  "extra_body": {"ignore_eos": True, "return_token_ids": True}}  # fmt: skip

        async def ids(**kw: object) -> list[list[int]]:
            out = await client.completions.create(**{**common, **kw})
            return [c.model_extra["token_ids"] for c in out.choices]

        try:
            alone = await ids(seed=1234, n=2)
            beside, *_ = await asyncio.gather(ids(seed=1234, n=2), *(ids(seed=None) for _ in range(4)))
            other = await ids(seed=99, n=2)
            unseeded = await ids(n=2)
            return alone, beside, other, unseeded
        finally:
            await client.close()

    alone, beside, other, unseeded = asyncio.run(run())
    assert alone == beside  # its own random stream: the other requests in the batch do not matter
    assert alone[0] != alone[1]  # choice i samples with seed + i
    assert other != alone and unseeded != alone


def test_served_model_names_and_model_retrieval(base_url: str, model_path: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [model_path, *ALIASES]
    assert 0 < client.models.list().data[0].created <= time.time()
    hub = client.models.retrieve("Qwen/Qwen2.5-0.5B-Instruct")
    assert hub.id == "Qwen/Qwen2.5-0.5B-Instruct" and hub.model_extra["max_model_len"] > 0
    answer = client.chat.completions.create(model="Qwen/Qwen2.5-0.5B-Instruct", messages=QUESTION, max_tokens=3)
    assert answer.model == "Qwen/Qwen2.5-0.5B-Instruct"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope/nothing")
    assert e.value.body == {"message": "The model `nope/nothing` does not exist.", "type": "invalid_request_error",
                            "param": "model", "code": "model_not_found"}  # fmt: skip


def test_every_error_is_an_openai_error_object(base_url: str, model_path: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="not a route") as e:
        client.get("/v1/no/such/route", cast_to=object)
    assert set(e.value.body) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError, match="not served"):
        client.embeddings.create(model=model_path, input="hello")
    with pytest.raises(openai.NotFoundError, match="not served"):
        client.images.generate(model=model_path, prompt="a cat")
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
    assert e.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_path, messages=QUESTION, seed="7")  # type: ignore[arg-type]
    assert e.value.body["param"] == "seed" and e.value.body["type"] == "invalid_request_error"
    wrong_method = httpx.get(f"{base_url}/chat/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert wrong_method.status_code == 405 and wrong_method.headers["Allow"] == "POST"
    assert set(wrong_method.json()["error"]) == {"message", "type", "param", "code"}


def first_token_share(chunks: object, has_token: object) -> tuple[float, int]:
    """(seconds to the first chunk that carries a token / seconds to the last chunk, chunks with a token)."""
    t0, first, last, n = time.perf_counter(), None, 0.0, 0
    for chunk in chunks:  # type: ignore[attr-defined]
        last = time.perf_counter() - t0
        if has_token(chunk):
            n += 1
            first = last if first is None else first
    return first / last, n  # type: ignore[operator]


def test_streamed_tokens_arrive_as_they_are_produced(base_url: str, model_path: str) -> None:
    """The acceptance bound: the first streamed token arrives before 30% of the answer's time, at
    64 new tokens (the scheduler hands each token out as it is produced)."""
    client = openai.OpenAI(base_url=base_url, api_key=KEY)
    common = {"model": model_path, "max_tokens": 64, "stream": True,
              "extra_body": {"ignore_eos": True, "return_token_ids": True}}  # fmt: skip
    share, n = first_token_share(
        client.chat.completions.create(messages=[{"role": "user", "content": "Tell me a story"}], **common),
        lambda c: bool(c.choices and c.choices[0].model_extra.get("token_ids")),
    )
    assert n == 64 and share < 0.3, share
    share, n = first_token_share(
        client.completions.create(prompt="Once upon a time", **common),
        lambda c: bool(c.choices and c.choices[0].model_extra.get("token_ids")),
    )
    assert n == 64 and share < 0.3, share


RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
                  "parameters": WEATHER_TOOL["function"]["parameters"], "strict": True}  # fmt: skip


def test_responses_api_plain_streamed_and_with_tools(base_url: str, model_path: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key=KEY)
    story = {"model": "gpt-5.6-luna", "input": "Tell me a story", "max_output_tokens": 8, "temperature": 0,
             "extra_body": {"ignore_eos": True}}  # fmt: skip
    plain = client.responses.create(**story)
    assert plain.status == "incomplete" and plain.incomplete_details.reason == "max_output_tokens"
    assert plain.output[0].type == "message" and plain.output_text and plain.usage.output_tokens == 8
    assert plain.temperature == 0 and plain.top_p == 1.0  # the values sampled with, given or not

    events = list(client.responses.create(**story, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == plain.output_text
    assert events[-1].response.output_text == plain.output_text

    called = client.responses.create(model="gpt-5.6-luna", input="Weather in Paris?", tools=[RESPONSES_TOOL],
                                     temperature=0, max_output_tokens=120)  # fmt: skip
    [call] = called.output
    assert (
        call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    )
    streamed = list(client.responses.create(model="gpt-5.6-luna", input="Weather in Paris?", tools=[RESPONSES_TOOL],
                                            temperature=0, max_output_tokens=120, stream=True))  # fmt: skip
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == {"city": "Paris"}
    assert streamed[-1].type == "response.completed" and streamed[-1].response.output[0].name == "get_weather"
    follow = client.responses.create(
        model="gpt-5.6-luna", tools=[RESPONSES_TOOL], max_output_tokens=4,
        input=[{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}],
    )  # fmt: skip
    assert follow.output and follow.usage.input_tokens > called.usage.input_tokens
    with pytest.raises(openai.BadRequestError, match="not stored"):
        client.responses.create(model="gpt-5.6-luna", input="hi", previous_response_id=plain.id)
    with pytest.raises(openai.NotFoundError, match="stores no responses"):
        client.responses.retrieve(plain.id)


def test_openai_agents_default_model_runs_a_tool(base_url: str, model_path: str, monkeypatch) -> None:
    """openai-agents with its default model (the Responses API, named ``gpt-5.6-luna`` here, which the
    server serves as an alias), plain and streamed: the taught tool call runs the tool."""
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    import agents

    seen: list[str] = []

    async def weather(ctx: object, arguments: str) -> str:
        seen.append(json.loads(arguments)["city"])
        return "clear"

    # The tool exactly as taught (the schema a decorated function gets would change the prompt).
    function = WEATHER_TOOL["function"]
    get_weather = agents.FunctionTool(name=function["name"], description=function["description"],
                                      params_json_schema=function["parameters"], on_invoke_tool=weather,
                                      strict_json_schema=False)  # fmt: skip

    async def run() -> tuple[object, object]:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=KEY)
        model = agents.OpenAIProvider(openai_client=client).get_model(None)
        assert isinstance(model, agents.OpenAIResponsesModel) and model.model == agents.models.get_default_model()
        agent = agents.Agent(name="weather", tools=[get_weather], model=model,
                             model_settings=agents.ModelSettings(temperature=0, max_tokens=120))  # fmt: skip
        config = agents.RunConfig(tracing_disabled=True)
        plain = await agents.Runner.run(agent, "Weather in Paris?", max_turns=3, run_config=config)
        streamed = agents.Runner.run_streamed(agent, "Weather in Paris?", max_turns=3, run_config=config)
        async for _ in streamed.stream_events():
            pass
        await client.close()
        return plain, streamed

    plain, streamed = asyncio.run(run())
    assert seen == ["Paris", "Paris"]
    for result in (plain, streamed):
        kinds = [item.type for item in result.new_items]  # type: ignore[attr-defined]
        assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
        assert result.final_output == FINAL  # type: ignore[attr-defined]


def test_inference_generate_token_in_token_out(base_url: str, model_path: str) -> None:
    """vLLM's ``/inference/v1/generate`` as verifiers' TrainClient (through ``renderers``) and vLLM 0.32
    read it: token ids, one log-probability entry per token in both spellings, equal to a HF forward."""
    prompt = [11, 12, 13, 14]
    body = {"model": model_path, "token_ids": prompt, "request_id": "r1",
            "sampling_params": {"max_tokens": 6, "logprobs": 1, "ignore_eos": True, "skip_special_tokens": False,
                                "stop_token_ids": [0], "routed_experts_prompt_start": 0}}  # fmt: skip
    headers = {"Authorization": f"Bearer {KEY}"}
    root = base_url.removesuffix("/v1")
    out = httpx.post(f"{root}/inference/v1/generate", json=body, headers=headers).json()
    [choice] = out["choices"]
    ids = choice["token_ids"]
    assert out["request_id"] == "r1" and len(ids) == 6 and choice["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}
    entries = choice["logprobs"]["content"]
    assert (
        [e["token"] for e in entries]
        == [f"token_id:{t}" for t in ids]
        == [f"token_id:{e['token_id']}" for e in entries]
    )
    assert all(e["top_logprobs"][0]["token_id"] == e["token_id"] for e in entries)
    hf = AutoModelForCausalLM.from_pretrained(model_path).eval()
    torch.testing.assert_close(
        torch.tensor([e["logprob"] for e in entries]), hf_logprobs(hf, prompt, ids), atol=1e-4, rtol=0
    )
    assert choice["weight_versions"] == [{"version": "0", "start": 0, "end": 6}]

    with httpx.stream("POST", f"{root}/inference/v1/generate", json={**body, "stream": True}, headers=headers) as r:
        lines = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert (
        sum(len(c["choices"][0]["token_ids"]) for c in lines) == 6
        and lines[-1]["choices"][0]["finish_reason"] == "length"
    )
    bad = httpx.post(f"{root}/inference/v1/generate", json={"token_ids": prompt}, headers=headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampling_params"


def test_usage_counts_each_prompt_once_whatever_n(base_url: str, model_path: str) -> None:
    """OpenAI's ``usage.prompt_tokens`` is the prompt's length, however many choices share it
    (``n``); completions count each prompt of a batch once."""
    client = openai.OpenAI(base_url=base_url, api_key=KEY)
    common = {"model": model_path, "messages": QUESTION, "max_tokens": 3, "extra_body": {"ignore_eos": True}}
    one = client.chat.completions.create(**common).usage
    three = client.chat.completions.create(n=3, **common).usage
    assert three.prompt_tokens == one.prompt_tokens and three.completion_tokens == 9
    assert three.total_tokens == three.prompt_tokens + 9
    [*_, last] = client.chat.completions.create(n=2, stream=True, stream_options={"include_usage": True}, **common)
    assert last.usage.prompt_tokens == one.prompt_tokens and last.usage.completion_tokens == 6
    done = client.completions.create(model=model_path, prompt=[[11, 12, 13], [14, 15]], n=2, max_tokens=2,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens) == (5, 8, 13)


def test_logprob_bytes_are_the_tokens_own_and_add_up_to_the_content(base_url: str, model_path: str) -> None:
    """``bytes`` is a token's own UTF-8 bytes (OpenAI: "characters represented by multiple tokens ...
    their byte representations must be combined"), so a token that ends inside a character has the
    bytes it holds, not those of a replacement character, and the bytes of all tokens are the text."""
    client = openai.OpenAI(base_url=base_url, api_key=KEY)
    tok = AutoTokenizer.from_pretrained(model_path)
    common = {"model": model_path, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 64,
              "logprobs": True, "top_logprobs": 2, "seed": 3, "temperature": 2.0,
              "extra_body": {"ignore_eos": True, "skip_special_tokens": False, "return_token_ids": True}}  # fmt: skip
    choice = client.chat.completions.create(**common).choices[0]
    entries = choice.logprobs.content
    ids = choice.model_extra["token_ids"]
    joined = b"".join(bytes(e.bytes) for e in entries)  # may end inside a character: the tokens' text does
    assert joined.decode(errors="replace") == tok.decode(ids, skip_special_tokens=False)
    assert any(bytes(e.bytes) != e.token.encode() for e in entries), "no token ended inside a character"
    assert all(bytes(t.bytes).decode(errors="replace") == t.token for e in entries for t in e.top_logprobs)
    streamed = [e for c in client.chat.completions.create(stream=True, **common) if c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]  # fmt: skip
    assert [e.bytes for e in streamed] == [e.bytes for e in entries]


def test_sampling_options_out_of_range_are_a_400_naming_the_field(base_url: str, model_path: str) -> None:
    """OpenAI's ranges: temperature 0 to 2, top_p at most 1, a 64-bit seed, n 1 to 128; each outside
    is a 400 (never a 500 or a hang) whose ``param`` names the field, and the server keeps serving."""
    client = openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0)
    common = {"model": model_path, "messages": QUESTION, "max_tokens": 2}
    for field, value in [
        ("temperature", 2.5),
        ("temperature", -0.5),
        ("top_p", 1.5),
        ("seed", 2**70),
        ("n", "2"),
        ("n", 129),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**common, **{field: value})
        assert e.value.status_code == 400 and e.value.body["param"] == field, (field, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_path, prompt="hi", temperature=3, max_tokens=2)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model_path, input="hi", temperature=3, max_output_tokens=2)
    assert e.value.body["param"] == "temperature"
    for prompt in ([-1], [10**7], [[1], [-1]]):
        with pytest.raises(openai.BadRequestError, match="token ids"):
            client.completions.create(model=model_path, prompt=prompt, max_tokens=2, echo=True)
    assert client.chat.completions.create(**common, temperature=2, seed=2**63 - 1, n=2).choices


def test_a_prompt_past_the_context_is_context_length_exceeded(base_url: str, model_path: str) -> None:
    """OpenAI's error for a prompt past the context: a 400 with code ``context_length_exceeded``,
    streamed or not, on chat, completions and the Responses API. A token budget that only the
    prompt and the completion together take past it is cut to what fits, as vLLM does (its
    `get_max_tokens`): the answer ends with ``length`` at the context."""
    client = openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0)
    long = "hello world " * 400
    calls = [
        (lambda: client.chat.completions.create(model=model_path, messages=[{"role": "user", "content": long}]),
         "messages"),
        (lambda: list(client.chat.completions.create(model=model_path, messages=[{"role": "user", "content": long}],
                                                     stream=True)), "messages"),
        (lambda: client.completions.create(model=model_path, prompt=long, max_tokens=2), "prompt"),
        (lambda: client.responses.create(model=model_path, input=long, max_output_tokens=2), "input"),
    ]  # fmt: skip
    for call, param in calls:
        with pytest.raises(openai.BadRequestError, match="maximum context length") as e:
            call()
        assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == param, e.value.body
    assert client.chat.completions.create(model=model_path, messages=QUESTION, max_tokens=2).choices
    context = client.models.list().data[0].model_extra["max_model_len"]
    cut = client.completions.create(
        model=model_path, prompt=[1, 2, 3], max_tokens=context, extra_body={"ignore_eos": True}
    )
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == context - 3
    with pytest.raises(openai.BadRequestError, match="cannot be greater than the context length") as e:
        client.completions.create(model=model_path, prompt=[1, 2, 3], max_tokens=context + 1)  # vLLM's 400 too
    assert e.value.body["param"] == "max_tokens"


def test_completions_echo_the_prompt(base_url: str, model_path: str) -> None:
    """``echo: true`` puts the prompt before the completion in ``text`` and, with ``logprobs``, its
    tokens before the output's (the first with no log-probability); ``max_tokens: 0`` scores the
    prompt alone. Streamed, the prompt comes first."""
    client = openai.OpenAI(base_url=base_url, api_key=KEY)
    tok = AutoTokenizer.from_pretrained(model_path)
    hf = AutoModelForCausalLM.from_pretrained(model_path).eval()
    common = {"model": model_path, "max_tokens": 5, "temperature": 0, "extra_body": {"ignore_eos": True}}
    plain = client.completions.create(prompt="The quick brown", **common).choices[0]
    echoed = client.completions.create(prompt="The quick brown", echo=True, **common).choices[0]
    assert echoed.text == "The quick brown" + plain.text
    streamed = client.completions.create(prompt="The quick brown", echo=True, stream=True, **common)
    assert "".join(c.choices[0].text for c in streamed) == echoed.text

    prompt = [11, 12, 13, 14]
    done = client.completions.create(prompt=prompt, echo=True, logprobs=2, n=2,
                                     **{**common, "temperature": 1.0})  # fmt: skip
    assert done.usage.prompt_tokens == 4 and done.usage.completion_tokens == 10
    for c in done.choices:
        lp = c.logprobs
        assert c.text.startswith(tok.decode(prompt)) and len(lp.tokens) == len(lp.token_logprobs) == 9
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
        assert lp.tokens[:4] == [tok.decode([t]) for t in prompt] and all(x <= 0 for x in lp.token_logprobs[1:])
    scored = client.completions.create(model=model_path, prompt=prompt, echo=True, logprobs=0, max_tokens=0)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == tok.decode(prompt) and scored.usage.completion_tokens == 0
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:]), hf_logprobs(hf, prompt[:1], prompt[1:]),
                               atol=1e-4, rtol=0)  # fmt: skip


def test_malformed_messages_are_a_400_naming_the_field(base_url: str, model_path: str) -> None:
    """Messages OpenAI refuses are a 400 naming the field at fault: no messages, not objects, an
    unknown role, and a message without the content its role requires (all but an assistant's with
    tool calls)."""
    client = openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0)
    for messages, param in [
        ([], "messages"),
        (["hi"], "messages[0]"),
        ([{"content": "hi"}], "messages[0].role"),
        ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "system", "content": "be brief"}, {"role": "user", "content": None}], "messages[1].content"),
        ([*QUESTION, {"role": "assistant"}], "messages[1].content"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model_path, messages=messages, max_tokens=2)
        assert e.value.body["param"] == param, (messages, e.value.body)
    called = [*QUESTION, {**CALLED, "content": None}, RESULT]
    assert client.chat.completions.create(model=model_path, messages=called, max_tokens=2).choices


def test_the_token_a_generation_stops_on_is_counted_but_not_in_its_text(base_url: str, model_path: str) -> None:
    """vLLM's rule for a generation that ends on a token (end of sequence, or one of
    ``stop_token_ids``): the token counts (usage, token ids) but its text is not part of the
    answer's unless ``include_stop_str_in_output``, streamed or not, on chat, completions and the
    Responses API; ``stop_reason`` names a stop token id and is null at the end of sequence."""
    client = openai.OpenAI(base_url=base_url, api_key=KEY)
    tok = AutoTokenizer.from_pretrained(model_path)
    common = {"model": model_path, "messages": QUESTION, "temperature": 0, "max_tokens": 200}
    shown = {"skip_special_tokens": False, "return_token_ids": True}  # the end of sequence would show
    [ended] = client.chat.completions.create(**common, extra_body=shown).choices
    ids = ended.model_extra["token_ids"]
    assert ids[-1] == tok.eos_token_id and ended.finish_reason == "stop" and ended.model_extra["stop_reason"] is None
    assert ended.message.content == CALL
    streamed = client.chat.completions.create(**common, stream=True, extra_body=shown)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == CALL

    k = next(k for k in range(1, len(ids)) if ids[k] not in ids[:k] and tok.decode(ids[k]).strip())
    stop = {"stop_token_ids": [ids[k]]}
    [cut] = client.chat.completions.create(**common, extra_body=stop).choices
    assert (cut.message.content, cut.finish_reason, cut.model_extra["stop_reason"]) == (
        tok.decode(ids[:k]),
        "stop",
        ids[k],
    )
    kept = client.chat.completions.create(**common, extra_body={**stop, "include_stop_str_in_output": True})
    assert kept.choices[0].message.content == tok.decode(ids[: k + 1]) and kept.usage.completion_tokens == k + 1
    chunks = list(client.chat.completions.create(**common, stream=True, extra_body=stop))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == tok.decode(ids[:k])
    assert chunks[-1].choices[0].model_extra["stop_reason"] == ids[k]

    prompt = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    plain = {"model": model_path, "prompt": prompt, "temperature": 0, "max_tokens": 200, "extra_body": stop}
    assert client.completions.create(**plain).choices[0].text == tok.decode(ids[:k])
    assert "".join(c.choices[0].text for c in client.completions.create(**plain, stream=True)) == tok.decode(ids[:k])
    answer = client.responses.create(model=model_path, input=QUESTION, temperature=0, extra_body=stop)
    assert answer.output_text == tok.decode(ids[:k])


def test_echoed_prompt_tokens_have_their_top_logprobs(base_url: str, model_path: str) -> None:
    """``echo`` with ``logprobs: n``: each prompt token after the first has its ``n`` most likely
    tokens in ``top_logprobs`` (after the token itself), as vLLM and OpenAI answer, streamed or not."""
    client = openai.OpenAI(base_url=base_url, api_key=KEY)
    hf = AutoModelForCausalLM.from_pretrained(model_path).eval()
    prompt = [11, 12, 13, 14]
    with torch.no_grad():
        best = torch.log_softmax(hf(torch.tensor([prompt])).logits.float(), dim=-1)[0, :-1].max(-1).values
    common = {"model": model_path, "prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 1}
    for top in (
        client.completions.create(**common).choices[0].logprobs.top_logprobs,
        next(iter(client.completions.create(**common, stream=True))).choices[0].logprobs.top_logprobs,
    ):
        assert top[0] is None and all(2 <= len(t) <= 3 for t in top[1:4])
        torch.testing.assert_close(torch.tensor([max(t.values()) for t in top[1:4]]), best, atol=1e-4, rtol=0)


def test_stop_and_min_tokens_refused_naming_the_field(base_url: str, model_path: str) -> None:
    """A ``stop`` that is not strings and a ``min_tokens`` above ``max_tokens`` (vLLM's 400) are
    400s whose ``param`` names the field."""
    client = openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0)
    for extra, param in [({"stop": 5}, "stop"), ({"min_tokens": 5}, "min_tokens"), ({"min_tokens": -1}, "min_tokens")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model_path, prompt="hi", max_tokens=2, extra_body=extra)
        assert e.value.body["param"] == param, (extra, e.value.body)


def test_chat_message_has_a_null_refusal(base_url: str, model_path: str) -> None:
    """An answer's message carries ``refusal: null``, a field OpenAI's answers (and vLLM's) always have."""
    body = {"model": model_path, "messages": QUESTION, "max_tokens": 2}
    r = httpx.post(f"{base_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    message = r.json()["choices"][0]["message"]
    assert message["refusal"] is None and message["role"] == "assistant"


def test_tokenize_and_detokenize_as_vllm_serves_them(base_url: str, model_path: str) -> None:
    """``POST /tokenize`` and ``POST /detokenize`` in the shapes vLLM documents, as plain HTTP (as
    lm-evaluation-harness and vLLM's own clients send them): a text, a chat (generation prompt,
    continued final message, tools), token strings, the served names checked (an unknown model is
    vLLM's 404 error object), bad input a 400 naming the field."""
    root = base_url.removesuffix("/v1")
    auth = {"Authorization": f"Bearer {KEY}"}
    tok = AutoTokenizer.from_pretrained(model_path)
    context = httpx.get(f"{base_url}/models", headers=auth).json()["data"][0]["max_model_len"]

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{root}{path}", json=body, headers=auth, timeout=30)

    text = "Hello world, 12+7=19"
    ids = tok.encode(text, add_special_tokens=True)
    answer = post("/tokenize", {"model": model_path, "prompt": text})
    assert answer.status_code == 200
    assert answer.json() == {"count": len(ids), "max_model_len": context, "tokens": ids, "token_strs": None}
    plain = post("/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    bare = tok.encode(text, add_special_tokens=False)
    assert plain["tokens"] == bare and plain["token_strs"] == tok.convert_ids_to_tokens(bare)

    rendered = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    chat = post("/tokenize", {"model": ALIASES[1], "messages": QUESTION}).json()
    assert chat["tokens"] == tok.encode(rendered, add_special_tokens=False)
    completion = openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0).chat.completions.create(
        model=model_path, messages=QUESTION, max_tokens=1
    )
    assert chat["count"] == completion.usage.prompt_tokens, "the chat route's prompt, token for token"
    with_tools = post("/tokenize", {"messages": QUESTION, "tools": [WEATHER_TOOL]}).json()["tokens"]
    assert with_tools == tok.encode(
        tok.apply_chat_template(QUESTION, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    started = [*QUESTION, {"role": "assistant", "content": "It is"}]
    continued = post("/tokenize", {"messages": started, "continue_final_message": True}).json()["tokens"]
    assert tok.decode(continued).endswith("It is"), "the final message left open"
    both = post("/tokenize", {"messages": started, "continue_final_message": True, "add_generation_prompt": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"

    back = post("/detokenize", {"model": ALIASES[0], "tokens": bare})
    assert back.status_code == 200 and back.json() == {"prompt": tok.decode(bare)} == {"prompt": text}

    for path, body in (("/tokenize", {"prompt": text}), ("/detokenize", {"tokens": bare})):
        unknown = post(path, {**body, "model": "nope/nothing"})
        assert unknown.status_code == 404
        assert unknown.json() == {"error": {"message": "The model `nope/nothing` does not exist.",
                                            "type": "invalid_request_error", "param": "model",
                                            "code": "model_not_found"}}  # fmt: skip
        assert httpx.post(f"{root}{path}", json=body).status_code == 401, "the API key is asked for"
    for path, body, param in (
        ("/tokenize", {"prompt": text, "messages": QUESTION}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": [1, 2]}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user"}]}, "messages[0].content"),
        ("/detokenize", {"tokens": [1, len(tok) + 5]}, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ):
        refused = post(path, body)
        assert refused.status_code == 400, (path, body, refused.text)
        assert refused.json()["error"]["param"] == param and refused.json()["error"]["message"], refused.json()
