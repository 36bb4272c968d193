"""Agents through the OpenAI protocol: the recording proxy answers the real ``openai`` SDK and the
``openai-agents`` SDK, its trajectories are exactly what the model saw and produced (one sequence
while the conversation extends, separate ones when a template rewrites history), and
`AgentWorkflow` grades episodes and groups them. A scripted engine gives chosen replies; the
acceptance test runs the ``openai-agents`` SDK on the embedded engine with a tiny model taught one
tool-using conversation."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from transformers import AutoTokenizer

from areal_lite.api.config import InferenceEngineConfig, LocalEngineConfig
from areal_lite.api.io import GenerationConfig, ModelRequest, ModelResponse
from areal_lite.core import RolloutController
from areal_lite.engines.local.engine import LocalInferenceEngine
from areal_lite.openai_format.chat import render_chat
from areal_lite.rewards import RewardRunner
from areal_lite.utils.tiny import build_tiny_model, build_tokenizer, teach
from areal_lite.workflows import AgentWorkflow, RecordingProxy, check_trajectory
from areal_lite.workflows.agent import episode_means

agents = pytest.importorskip("agents")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
EOS = "<|im_end|>"
GEN = GenerationConfig(max_new_tokens=200)
THINK_DROPPING = (  # Qwen3-like: earlier assistant turns lose their reasoning
    "{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip() %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ScriptedEngine:
    """Replies with the given texts in order (version 7, log-probability -0.25 per token); a reply
    ending in eos stops. Records every prompt it is sent, and its sampling options."""

    def __init__(self, tokenizer, replies: list[str]) -> None:
        self.tok, self.replies, self.prompts, self.gconfigs = tokenizer, list(replies), [], []

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        self.prompts.append(list(req.input_ids))
        self.gconfigs.append(req.gconfig)
        text = self.replies.pop(0)
        out = self.tok(text, add_special_tokens=False)["input_ids"]
        stop = "stop" if text.endswith(EOS) and len(out) <= req.gconfig.max_new_tokens else "length"
        out = out[: req.gconfig.max_new_tokens]
        return ModelResponse(list(req.input_ids), out, [-0.25] * len(out), [7] * len(out), stop)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def segments(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    return runs


async def tool_conversation(client: openai.AsyncOpenAI) -> list[dict]:
    """Ask, run the requested tool call, ask again with its result; the messages of the chat."""
    messages: list[dict] = [{"role": "user", "content": "What is 2+3?"}]
    first = (await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)).choices[0]
    assert first.finish_reason == "tool_calls"
    [call] = first.message.tool_calls
    result = str(eval(json.loads(call.function.arguments)["expression"]))
    messages += [
        first.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    second = (await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)).choices[0]
    return [*messages, second.message.model_dump(exclude_none=True)]


async def with_client(proxy: RecordingProxy, agent):
    async with proxy.client() as client:
        return await agent(client)


def test_a_conversation_that_extends_is_one_trajectory_trained_on_generated_tokens_only(tok) -> None:
    engine = ScriptedEngine(tok, [CALL + EOS, "The answer is 5." + EOS])
    proxy = RecordingProxy(engine, tok, GEN)
    conversation = asyncio.run(with_client(proxy, tool_conversation))

    [trace] = proxy.traces
    assert [c.extended for c in proxy.calls] == [False, True]
    ids = trace.input_ids
    # Each call sent the trajectory so far: the first prompt and reply, token for token, then more.
    first = engine.prompts[0] + proxy.calls[0].response.output_tokens
    assert engine.prompts[1][: len(first)] == first and ids[: len(engine.prompts[1])] == engine.prompts[1]
    # It decodes to exactly the conversation as the template renders it (less the closing newline).
    rendered = render_chat(tok, {"messages": conversation, "add_generation_prompt": False, "tools": TOOLS})
    assert tok.decode(ids) + "\n" == rendered
    # Only the model's replies are trained on, with their log-probabilities and versions.
    runs = segments(trace.loss_mask)
    assert [v for v, _, _ in runs] == [0, 1, 0, 1]
    assert [tok.decode(ids[s:e]) for v, s, e in runs if v] == [CALL + EOS, "The answer is 5." + EOS]
    for v, s, e in runs:
        assert trace.logprobs[s:e] == ([-0.25] * (e - s) if v else [0.0] * (e - s))
        assert trace.versions[s:e] == ([7] * (e - s) if v else [-1] * (e - s))
    check_trajectory(trace.to_tensordict(1.0))


def test_a_template_that_drops_reasoning_gives_separate_aligned_trajectories(tok) -> None:
    tok = build_tokenizer()
    tok.chat_template = THINK_DROPPING
    replies = ["<think>add them</think>Five." + EOS, "<think>again</think>Still five." + EOS]

    async def chat(client: openai.AsyncOpenAI) -> None:
        messages = [{"role": "user", "content": "2+3?"}]
        for follow_up in ("Sure?", None):
            reply = (await client.chat.completions.create(model="m", messages=messages)).choices[0].message
            messages += [{"role": "assistant", "content": reply.content}]
            if follow_up:
                messages += [{"role": "user", "content": follow_up}]

    engine = ScriptedEngine(tok, replies)
    proxy = RecordingProxy(engine, tok, GEN)
    asyncio.run(with_client(proxy, chat))
    assert [c.extended for c in proxy.calls] == [False, False] and len(proxy.traces) == 2
    for trace, prompt, reply in zip(proxy.traces, engine.prompts, replies):
        # Each trajectory is its call's prompt, exactly as sent, then the reply: nothing misaligned.
        assert trace.input_ids[: len(prompt)] == prompt and set(trace.loss_mask[: len(prompt)]) == {0}
        assert tok.decode(trace.input_ids[len(prompt) :]) == reply and set(trace.loss_mask[len(prompt) :]) == {1}
    assert "add them" not in tok.decode(engine.prompts[1])  # the template did drop it

    # The same chat under a template that keeps history is one trajectory.
    keep = build_tokenizer()
    proxy = RecordingProxy(ScriptedEngine(keep, replies), keep, GEN)
    asyncio.run(with_client(proxy, chat))
    assert [c.extended for c in proxy.calls] == [False, True] and len(proxy.traces) == 1


def test_streaming_models_and_bad_requests_through_the_sdk(tok) -> None:
    engine = ScriptedEngine(tok, [CALL + EOS, "plain" + EOS])
    proxy = RecordingProxy(engine, tok, GEN, max_calls=2)

    async def agent(client: openai.AsyncOpenAI) -> None:
        assert [m.id for m in (await client.models.list()).data] == ["areal-lite-policy"]
        messages = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.BadRequestError, match="logit_bias") as refused:
            await client.chat.completions.create(model="m", messages=messages, logit_bias={"3": 1.0})
        assert refused.value.param == "logit_bias"
        with pytest.raises(openai.BadRequestError, match="frequency_penalty") as refused:
            await client.chat.completions.create(model="m", messages=messages, frequency_penalty=2.5)
        assert refused.value.param == "frequency_penalty"
        with pytest.raises(openai.BadRequestError, match="n must be 1"):
            await client.chat.completions.create(model="m", messages=messages, n=2)
        stream = await client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
        [call] = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
        assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "2+3"}
        assert chunks[-2].choices[0].finish_reason == "tool_calls" and chunks[-1].usage.completion_tokens > 0
        done = await client.chat.completions.create(
            model="m", messages=messages, max_tokens=3, logprobs=True, presence_penalty=0.5, extra_body={"min_p": 0.1}
        )
        assert engine.gconfigs[-1].shaping() == {"presence_penalty": 0.5, "min_p": 0.1}
        assert (
            done.choices[0].finish_reason == "length"
            and [e.logprob for e in done.choices[0].logprobs.content] == [-0.25] * 3
        )
        # Each entry's bytes are its token's own: joined, they are the answer's text.
        assert bytes(b for e in done.choices[0].logprobs.content for b in e.bytes).decode() == (
            done.choices[0].message.content
        )
        with pytest.raises(openai.BadRequestError, match="2 model calls are used up"):
            await client.chat.completions.create(model="m", messages=messages)

    asyncio.run(with_client(proxy, agent))
    assert len(proxy.calls) == 2 and proxy.exhausted is not None


def test_text_completions_through_the_sdk_extend_one_trajectory(tok) -> None:
    """``client.completions.create`` (a completion-mode harness): the prompt is continued as it
    is, no template; a second prompt that starts with the first and its answer extends the same
    trajectory; plain and streamed, with the sampled tokens' log-probabilities."""
    engine = ScriptedEngine(tok, ["4 + 1 =", " 5" + EOS, "x" + EOS])
    proxy = RecordingProxy(engine, tok, GEN)

    async def harness(client: openai.AsyncOpenAI) -> tuple[str, str]:
        first = await client.completions.create(model="m", prompt="Q: 2 + 3?\nA:", logprobs=0, max_tokens=50)
        [choice] = first.choices
        assert choice.finish_reason == "length" and first.object == "text_completion"  # no eos: the budget
        assert choice.logprobs.token_logprobs == [-0.25] * len(choice.logprobs.tokens)
        assert "".join(choice.logprobs.tokens) == "4 + 1 ="
        assert choice.logprobs.text_offset[0] == len("Q: 2 + 3?\nA:")
        stream = await client.completions.create(
            model="m", prompt="Q: 2 + 3?\nA:" + choice.text + " then", stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = [c async for c in stream]
        second = "".join(c.choices[0].text for c in chunks if c.choices)
        assert chunks[-2].choices[0].finish_reason == "stop" and chunks[-1].usage.completion_tokens > 0
        with pytest.raises(openai.BadRequestError, match="logprobs must be 0"):
            await client.completions.create(model="m", prompt="hi", logprobs=2)
        with pytest.raises(openai.BadRequestError, match="prompt must be one string"):
            await client.completions.create(model="m", prompt=["a", "b"])
        with pytest.raises(openai.BadRequestError, match="echo"):
            await client.completions.create(model="m", prompt="hi", echo=True)
        return choice.text, second

    first, second = asyncio.run(with_client(proxy, harness))
    assert (first, second) == ("4 + 1 =", " 5")  # the eos is a special token, not in the text
    [trace] = proxy.traces
    assert [c.extended for c in proxy.calls] == [False, True]
    assert tok.decode(trace.input_ids) == "Q: 2 + 3?\nA:4 + 1 = then 5" + EOS
    assert [v for v, _, _ in segments(trace.loss_mask)] == [0, 1, 0, 1]
    check_trajectory(trace.to_tensordict(1.0))


def test_responses_api_through_the_proxy_is_recorded_like_chat(tok, monkeypatch) -> None:
    """openai-agents' default model (the Responses API) through the proxy, plain and streamed: the
    tool runs, and the episode is one trajectory trained on the model's replies only."""
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    ran: list[str] = []

    async def calc(ctx: object, arguments: str) -> str:
        ran.append(json.loads(arguments)["expression"])
        return "5"

    function = TOOLS[0]["function"]
    tool = agents.FunctionTool(name=function["name"], description=function["description"],
                               params_json_schema=function["parameters"], on_invoke_tool=calc,
                               strict_json_schema=False)  # fmt: skip

    async def agent(client: openai.AsyncOpenAI, stream: bool) -> object:
        model = agents.OpenAIProvider(openai_client=client).get_model(None)
        assert isinstance(model, agents.OpenAIResponsesModel)
        solver = agents.Agent(name="solver", tools=[tool], model=model)
        config = agents.RunConfig(tracing_disabled=True)
        if not stream:
            return await agents.Runner.run(solver, "What is 2+3?", max_turns=3, run_config=config)
        result = agents.Runner.run_streamed(solver, "What is 2+3?", max_turns=3, run_config=config)
        async for _ in result.stream_events():
            pass
        return result

    for stream in (False, True):
        proxy = RecordingProxy(ScriptedEngine(tok, [CALL + EOS, "It is 5." + EOS]), tok, GEN)
        result = asyncio.run(with_client(proxy, lambda c, s=stream: agent(c, s)))
        assert result.final_output == "It is 5."  # type: ignore[attr-defined]
        [trace] = proxy.traces
        assert [c.extended for c in proxy.calls] == [False, True]
        runs = segments(trace.loss_mask)
        assert [tok.decode(trace.input_ids[s:e]) for v, s, e in runs if v] == [CALL + EOS, "It is 5." + EOS]
    assert ran == ["2+3", "2+3"]

    async def refused(client: openai.AsyncOpenAI) -> None:
        with pytest.raises(openai.BadRequestError, match="not stored") as e:
            await client.responses.create(model="m", input="hi", previous_response_id="resp_1")
        assert e.value.body["param"] == "previous_response_id"
        with pytest.raises(openai.NotFoundError, match="not a route"):
            await client.embeddings.create(model="m", input="hi")

    asyncio.run(with_client(RecordingProxy(ScriptedEngine(tok, []), tok, GEN), refused))


def test_proxy_server_serves_episodes_over_http(tok) -> None:
    """`ProxyServer`: each registered proxy answers under its own base URL over a real socket, and an
    unregistered one is a 404 in OpenAI's error shape."""
    from areal_lite.workflows.proxy_server import ProxyServer

    async def run() -> None:
        server = ProxyServer()
        await server.start()
        try:
            proxies = [RecordingProxy(ScriptedEngine(tok, [f"reply {i}" + EOS]), tok, GEN) for i in range(2)]
            urls = [server.register(p) for p in proxies]
            for i, (_, url) in enumerate(urls):
                async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as client:
                    out = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
                    assert out.choices[0].message.content == f"reply {i}"
            server.unregister(urls[0][0])
            async with openai.AsyncOpenAI(base_url=urls[0][1], api_key="x", max_retries=0) as client:
                with pytest.raises(openai.NotFoundError, match="no running episode"):
                    await client.models.list()
        finally:
            await server.stop()
        assert [len(p.calls) for p in proxies] == [1, 1]

    asyncio.run(run())


# ---------------------------------------------------------------------------------------------
# The acceptance test: the openai-agents SDK on the embedded engine.

TOOL_CALLS: list[str] = []


@agents.function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    TOOL_CALLS.append(expression)
    a, b = expression.split("+")
    return str(int(a) + int(b))


async def sdk_agent(client: openai.AsyncOpenAI, item: dict) -> str:
    """An openai-agents agent with one function tool, its model calls going through ``client``."""
    model = agents.OpenAIChatCompletionsModel(model="policy", openai_client=client)
    agent = agents.Agent(name="calc", instructions="Use the calculator.", tools=[calculator], model=model)
    result = await agents.Runner.run(
        agent, str(item["prompt"]), max_turns=4, run_config=agents.RunConfig(tracing_disabled=True)
    )
    return str(result.final_output)


def answer_is_right(prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **item) -> float:
    return float(completion.strip() == item["answer"])


@pytest.fixture(scope="module")
def taught_rollout(tmp_path_factory):
    """The embedded engine on a tiny model taught the scripted run of `sdk_agent` on 2+3."""
    path = build_tiny_model(
        str(tmp_path_factory.mktemp("agent") / "m"), hidden_size=64, num_layers=2, max_position_embeddings=1024
    )
    tok = AutoTokenizer.from_pretrained(path)
    scripted = RecordingProxy(ScriptedEngine(tok, [CALL + EOS, "5" + EOS]), tok, GEN)
    assert asyncio.run(with_client(scripted, lambda c: sdk_agent(c, {"prompt": "What is 2+3?"}))) == "5"
    [trace] = scripted.traces
    teach(path, [(trace.input_ids, trace.loss_mask)], lr=3e-3, max_steps=300)
    engine = LocalInferenceEngine(LocalEngineConfig(path=path, max_running_requests=8, seed=1))
    rollout = RolloutController(engine, InferenceEngineConfig(consumer_batch_size=2, max_concurrent_rollouts=2))
    rollout.initialize()
    try:
        yield rollout, trace
    finally:
        rollout.destroy()


def test_openai_agents_sdk_runs_a_tool_agent_on_the_embedded_engine(taught_rollout) -> None:
    rollout, taught = taught_rollout
    engine, tok = rollout.engine, rollout.engine.tokenizer
    proxy = RecordingProxy(engine, tok, GEN.new(greedy=True))
    bodies: list[dict] = []
    answer = proxy.chat_completion

    async def recording(body: dict) -> dict:
        bodies.append(body)
        return await answer(body)

    proxy.chat_completion = recording
    TOOL_CALLS.clear()
    final = asyncio.run(with_client(proxy, lambda c: sdk_agent(c, {"prompt": "What is 2+3?"})))
    assert final == "5" and TOOL_CALLS == ["2+3"]  # the model called the tool; the SDK ran it

    [trace] = proxy.traces  # two calls, one trajectory
    assert [c.extended for c in proxy.calls] == [False, True]
    assert trace.input_ids == taught.input_ids and trace.loss_mask == taught.loss_mask
    # The trajectory decodes to exactly the conversation the SDK held, as the template renders it.
    conversation = [*bodies[-1]["messages"], {"role": "assistant", "content": final}]
    rendered = render_chat(
        tok, {"messages": conversation, "add_generation_prompt": False, "tools": bodies[-1]["tools"]}
    )
    assert tok.decode(trace.input_ids) + "\n" == rendered
    runs = segments(trace.loss_mask)
    assert [v for v, _, _ in runs] == [0, 1, 0, 1]
    assert [tok.decode(trace.input_ids[s:e]) for v, s, e in runs if v] == [CALL + EOS, "5" + EOS]
    generated = [trace.logprobs[i] for i, m in enumerate(trace.loss_mask) if m]
    assert all(lp < 0 for lp in generated) and {trace.versions[i] for i, m in enumerate(trace.loss_mask) if m} == {0}
    check_trajectory(trace.to_tensordict(1.0))


def test_agent_workflow_grades_groups_of_episodes_through_the_controller(taught_rollout) -> None:
    rollout, _ = taught_rollout
    grader = RewardRunner(answer_is_right, mode="inline")
    workflow = AgentWorkflow(sdk_agent, grader, GEN.new(n_samples=2, greedy=True), rollout.engine.tokenizer)
    items = [{"prompt": "What is 2+3?", "answer": "5"}, {"prompt": "What is 2+3?", "answer": "6"}]
    batch = rollout.rollout_batch(items, workflow)
    check_trajectory(batch)
    assert batch["rewards"].tolist() == [1.0, 1.0, 0.0, 0.0] and batch["baseline_rewards"].tolist() == [
        1.0,
        1.0,
        0.0,
        0.0,
    ]
    assert batch["num_calls"].tolist() == [2.0] * 4 and batch["episode_start"].tolist() == [1.0] * 4
    assert episode_means(batch) == {"episode_reward": 0.5, "episode_calls": 2.0, "trajectories_per_episode": 1.0}
