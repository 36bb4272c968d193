"""Structured output (`areal_lite.engines.local.grammar`): every finished generation follows its grammar
(a JSON schema, any JSON object, a regex, a choice, EBNF), sampled or greedy, beside free requests
in one batch; the reported log-probabilities stay the model's own; the openai SDK's ``parse``
helpers get their Pydantic objects back through ``response_format`` (chat) and ``text.format``
(Responses); SGLang's ``json_schema`` / ``regex`` / ``ebnf`` and vLLM's ``structured_outputs`` are
taken on their routes, and a grammar that does not compile is a 400 naming the field.
test_vllm_openai_parity compares the routes with a real vLLM."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys

import jsonschema
import openai
import pydantic
import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_lite.api.config import LocalEngineConfig
from areal_lite.engines.local import grammar
from areal_lite.engines.local.engine import LocalInferenceEngine
from areal_lite.engines.local.request import SamplingParams
from areal_lite.utils.tiny import build_tiny_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
from inference_servers import start_servers, stop_servers

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer"}},
    "required": ["answer", "n"],
    "additionalProperties": False,
}
PROMPT = [5, 9, 11, 20]


class Verdict(pydantic.BaseModel):
    answer: bool
    reason: str = pydantic.Field(max_length=6)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("grammar") / "m"), hidden_size=64, num_layers=2)


@pytest.fixture(scope="module")
def engine(model_path: str):
    eng = LocalInferenceEngine(LocalEngineConfig(path=model_path, max_running_requests=64, seed=5))
    eng.initialize()
    yield eng
    eng.destroy()


def generate_all(engine: LocalInferenceEngine, jobs: list[SamplingParams]):
    async def run():
        return await asyncio.gather(*[engine.scheduler.generate(PROMPT, sp) for sp in jobs])

    return asyncio.run(run())


def follows(kind: str, text: str) -> bool:
    if kind == "schema":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(r"[a-c]{2,4}-[0-9]{2}", text) is not None
    if kind == "choice":
        return text in ("yes", "no way", "maybe")
    return re.fullmatch(r"(ab)+c", text) is not None  # the EBNF


GRAMMARS = {
    "schema": lambda: grammar.json_schema_grammar(SCHEMA),
    "object": grammar.json_object_grammar,
    "regex": lambda: grammar.regex_grammar(r"[a-c]{2,4}-[0-9]{2}"),
    "choice": lambda: grammar.choice_grammar(["yes", "no way", "maybe"]),
    "ebnf": lambda: grammar.ebnf_grammar('root ::= ("a" "b")+ "c"'),
}


def test_every_finished_generation_follows_its_grammar(engine: LocalInferenceEngine) -> None:
    """Eight samples of each grammar at temperature 1 and a greedy one, beside free requests."""
    tok = engine.scheduler.tokenizer
    kinds = [k for k in GRAMMARS for _ in range(9)]
    jobs = [SamplingParams(max_new_tokens=200, temperature=0.0 if i % 9 == 0 else 1.0, grammar=GRAMMARS[k]())
            for i, k in enumerate(kinds)]  # fmt: skip
    free = [SamplingParams(max_new_tokens=20, ignore_eos=True)] * 4
    results = generate_all(engine, jobs + free)
    finished = {k: 0 for k in GRAMMARS}
    for kind, r in zip(kinds, results):
        if r.finish_reason["type"] == "stop":
            assert r.output_ids[-1] == tok.eos_token_id  # the grammar, once complete, allows only eos
            assert follows(kind, tok.decode(r.output_ids[:-1])), (kind, tok.decode(r.output_ids))
            finished[kind] += 1
    # A tiny random model wanders in JSON's free whitespace; the fixed grammars always finish.
    assert finished["regex"] == finished["choice"] == finished["ebnf"] == 9
    assert finished["schema"] >= 5 and finished["object"] >= 5, finished
    assert all(len(r.output_ids) == 20 for r in results[len(jobs) :])


def test_reported_logprobs_stay_the_models_own(engine: LocalInferenceEngine, model_path: str) -> None:
    hf = AutoModelForCausalLM.from_pretrained(model_path).eval()
    [r] = generate_all(engine, [SamplingParams(max_new_tokens=20, temperature=0.0, grammar=GRAMMARS["regex"]())])
    ids = torch.tensor([PROMPT + r.output_ids])
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits.float(), dim=-1)[0, len(PROMPT) - 1 : -1]
    policy = logp.gather(1, ids[0, len(PROMPT) :, None])[:, 0]
    torch.testing.assert_close(torch.tensor(r.output_logprobs), policy, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "bad",
    [
        lambda: grammar.json_schema_grammar("{not json"),
        lambda: grammar.json_schema_grammar([1]),
        lambda: grammar.choice_grammar([]),
        lambda: grammar.ebnf_grammar("root ::= ("),
        lambda: grammar.requested({"type": "json_schema", "json_schema": {"name": "x"}}, None),
        lambda: grammar.requested({"type": "xml"}, None),
        lambda: grammar.requested(None, {"regex": "a", "choice": ["b"]}),
        lambda: grammar.requested(None, {"structural_tag": "{}"}),
    ],
)
def test_bad_grammars_raise(bad) -> None:
    with pytest.raises(ValueError):
        bad()


@pytest.fixture(scope="module")
def server(model_path: str):
    procs, addresses = start_servers(model_path, 1)
    yield f"http://{addresses[0]}"
    stop_servers(procs)


def test_the_sdks_parse_helpers_get_their_objects(server: str, model_path: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Is it?"}]
    parsed = []
    for seed in range(4):  # sampled: a tiny random model may wander in JSON's free whitespace
        try:
            chat = client.chat.completions.parse(
                model=model_path, messages=messages, response_format=Verdict, max_tokens=200, seed=seed
            )
        except openai.LengthFinishReasonError:
            continue
        parsed.append(chat.choices[0].message.parsed)
    assert parsed and all(isinstance(v, Verdict) and len(v.reason) <= 6 for v in parsed)
    for seed in range(4):
        r = client.responses.parse(
            model=model_path, input="Is it?", text_format=Verdict, max_output_tokens=200, extra_body={"seed": seed}
        )
        if r.status == "completed":
            assert isinstance(r.output_parsed, Verdict) and r.text.format.type == "json_schema"
            break
    else:
        pytest.fail("no Responses answer completed in 4 seeds")
    choice = client.completions.create(
        model=model_path,
        prompt="Pick:",
        max_tokens=20,
        extra_body={"structured_outputs": {"choice": ["left", "right"]}},
    )
    assert choice.choices[0].text in ("left", "right")


def test_sglang_and_vllm_token_routes_take_their_grammars(server: str, model_path: str) -> None:
    r = requests.post(f"{server}/generate", json={"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 30, "regex": r"[0-9]{3}"}}, timeout=60)  # fmt: skip
    assert r.status_code == 200 and re.fullmatch(r"[0-9]{3}", r.json()["text"]), r.text
    r = requests.post(f"{server}/generate", json={"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 30, "ebnf": 'root ::= "x" | "yz"', "temperature": 0}}, timeout=60)  # fmt: skip
    assert r.status_code == 200 and r.json()["text"] in ("x", "yz"), r.text
    r = requests.post(f"{server}/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": {
        "max_tokens": 30, "structured_outputs": {"regex": "ab?"}, "skip_special_tokens": True}}, timeout=60)  # fmt: skip
    tokens = r.json()["choices"][0]["token_ids"]
    assert r.status_code == 200 and re.fullmatch("ab?", AutoTokenizer.from_pretrained(model_path).decode(
        tokens, skip_special_tokens=True)), tokens  # fmt: skip


@pytest.mark.parametrize(
    "route,body,param",
    [
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format",
        ),
        ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
        ("/v1/completions", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ("/generate", {"sampling_params": {"regex": "a", "json_schema": "{}"}}, "regex"),
        ("/generate", {"sampling_params": {"json_schema": "{nope"}}, "json_schema"),
        ("/inference/v1/generate", {"sampling_params": {"structured_outputs": {"json": 3}}}, "structured_outputs"),
    ],
)
def test_a_grammar_that_does_not_compile_is_a_400_naming_its_field(
    server: str, route: str, body: dict, param: str
) -> None:
    base = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]}, "/v1/completions": {
        "prompt": "hi"}, "/generate": {"input_ids": PROMPT}, "/inference/v1/generate": {"token_ids": PROMPT}}[route]  # fmt: skip
    r = requests.post(f"{server}{route}", json={**base, **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"], "additionalProperties": False}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_a_forced_tool_choice_answers_with_a_call(server: str, model_path: str) -> None:
    """A named tool: the answer is a call to it, arguments valid against its parameters, finish
    ``stop`` (OpenAI's, vLLM's); ``required``: one or more calls of the given tools, finish
    ``tool_calls``, one at most without parallel calls; streamed, the same call comes whole."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    done = 0
    for seed in range(4):  # sampled: a tiny random model may wander in JSON's free whitespace
        r = client.chat.completions.create(
            model=model_path, messages=messages, tools=[WEATHER, TIME], tool_choice=named, max_tokens=200, seed=seed
        )
        c = r.choices[0]
        if c.finish_reason == "length":
            continue
        [call] = c.message.tool_calls
        assert (c.finish_reason, c.message.content, call.function.name) == ("stop", "", "get_weather")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        done += 1
    assert done
    for seed in range(4):
        r = client.chat.completions.create(model=model_path, messages=messages, tools=[WEATHER, TIME],
            tool_choice="required", parallel_tool_calls=False, max_tokens=200, seed=seed)  # fmt: skip
        c = r.choices[0]
        if c.finish_reason == "tool_calls":
            assert len(c.message.tool_calls) == 1 and c.message.tool_calls[0].function.name in (
                "get_weather",
                "get_time",
            )
            break
    else:
        pytest.fail("no required tool call finished in 4 seeds")
    stream = client.chat.completions.create(model=model_path, messages=messages, tools=[WEATHER], tool_choice=named,
        max_tokens=200, seed=0, stream=True)  # fmt: skip
    chunks = list(stream)
    calls = [t for ch in chunks if ch.choices for t in ch.choices[0].delta.tool_calls or []]
    plain = client.chat.completions.create(model=model_path, messages=messages, tools=[WEATHER], tool_choice=named,
        max_tokens=200, seed=0)  # fmt: skip
    if plain.choices[0].message.tool_calls:
        assert [(t.function.name, t.function.arguments) for t in calls] == [
            (t.function.name, t.function.arguments) for t in plain.choices[0].message.tool_calls
        ]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ""
    with pytest.raises(openai.BadRequestError, match="get_nothing") as refused:
        client.chat.completions.create(model=model_path, messages=messages, tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_nothing"}})  # fmt: skip
    assert refused.value.param == "tool_choice"


def test_the_responses_api_forces_calls_too(server: str, model_path: str) -> None:
    """``client.responses.create`` with ``tool_choice`` naming a function (what openai-agents
    sends for ``ModelSettings(tool_choice=...)``): a ``function_call`` item of that tool."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"], "strict": True}
    for seed in range(4):
        r = client.responses.create(model=model_path, input="Weather in Paris?", tools=[tool], max_output_tokens=200,
            tool_choice={"type": "function", "name": "get_weather"}, extra_body={"seed": seed})  # fmt: skip
        if r.status == "completed":
            [call] = [item for item in r.output if item.type == "function_call"]
            assert call.name == "get_weather"
            jsonschema.validate(json.loads(call.arguments), tool["parameters"])
            break
    else:
        pytest.fail("no forced call completed in 4 seeds")
    r = client.responses.create(model=model_path, input="hi", tools=[tool], tool_choice="required", max_output_tokens=8)
    assert r.status == "incomplete" or any(item.type == "function_call" for item in r.output)
