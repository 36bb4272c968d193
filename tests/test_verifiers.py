"""verifiers (0.4, its v1 API) against areal-lite: its real clients on our server (``EvalClient``
relaying chat completions, ``TrainClient`` rendering token ids for ``/inference/v1/generate``), an
env's episodes run by verifiers' own chat program through our server, and `VerifiersWorkflow`
turning an env's episodes into training trajectories through the recording proxy.

verifiers needs ``openai<3`` and our ``dev`` extra's openai-agents needs ``openai>=3``, so these
tests run in an environment of their own: ``make test-verifiers`` builds ``.venv-verifiers`` and
runs them (marker ``verifiers``, which ``make test`` deselects). Imports of verifiers stay inside
the tests so that the module is collected anywhere.
"""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_lite.utils.tiny import build_tiny_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
from inference_servers import start_servers, stop_servers

pytestmark = pytest.mark.verifiers
EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("vf") / "m"), hidden_size=64, num_layers=2)


@pytest.fixture(scope="module")
def base_url(model_path: str):
    procs, addresses = start_servers(model_path, 1)
    yield f"http://{addresses[0]}/v1"
    stop_servers(procs)


def reverse_env(n_tasks: int, in_process: bool):
    """The example's verifiers env (examples/reverse_digits.py), its agent a local harness."""
    import verifiers.v1 as vf

    from areal_lite.workflows.verifiers_env import local_agent

    sys.path.insert(0, EXAMPLES)
    from reverse_digits import ReverseConfig

    taskset = ReverseConfig(id="reverse_digits", n_tasks=n_tasks)
    return vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset=taskset, agent=local_agent(in_process=in_process)))


def test_eval_and_train_clients_on_our_server(base_url: str, model_path: str) -> None:
    import verifiers.v1 as vf
    from verifiers.v1.clients.eval import EvalClient
    from verifiers.v1.clients.train import TrainClient
    from verifiers.v1.dialects import ChatDialect

    body = {"model": model_path, "messages": [{"role": "user", "content": "Hello"}]}

    async def run() -> tuple[object, object]:
        evals = EvalClient(vf.EvalClientConfig(base_url=base_url, api_key_var="AREAL_LITE_TEST_KEY"))
        train = TrainClient(vf.TrainClientConfig(base_url=base_url, api_key_var="AREAL_LITE_TEST_KEY",
                                                 renderer_model_name=model_path))  # fmt: skip
        try:
            relayed = await evals.get_response(ChatDialect(), {**body, "max_tokens": 5}, vf.SamplingConfig())
            rendered = await train.get_response(ChatDialect(), body, vf.SamplingConfig(max_tokens=6, temperature=1.0))
        finally:
            await evals.close()
            await train.close()
        return relayed, rendered

    relayed, rendered = asyncio.run(run())
    assert relayed.message.role == "assistant" and relayed.usage.completion_tokens <= 5  # type: ignore[attr-defined]
    tokens = rendered.tokens  # type: ignore[attr-defined]
    tok = AutoTokenizer.from_pretrained(model_path)
    chat = tok.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
    assert tokens.prompt_ids == tok.encode(chat, add_special_tokens=False)
    assert 1 <= len(tokens.completion_ids) <= 6 and len(tokens.completion_logprobs) == len(tokens.completion_ids)
    ids = torch.tensor([tokens.prompt_ids + tokens.completion_ids])
    with torch.no_grad():
        logp = torch.log_softmax(AutoModelForCausalLM.from_pretrained(model_path)(ids).logits.float(), dim=-1)[0, :-1]
    want = logp.gather(1, ids[0, 1:, None])[len(tokens.prompt_ids) - 1 :, 0]
    torch.testing.assert_close(torch.tensor(tokens.completion_logprobs), want, atol=1e-4, rtol=0)


def test_env_episodes_run_by_verifiers_program_against_our_server(base_url: str, model_path: str) -> None:
    """verifiers' own chat program (a subprocess, `LocalChatHarness`) -> verifiers' interception
    server -> EvalClient -> our /v1/chat/completions, and the rubric scores the reply."""
    import verifiers.v1 as vf

    env = reverse_env(2, in_process=False)

    async def run() -> list:
        client = vf.EvalClientConfig(base_url=base_url, api_key_var="AREAL_LITE_TEST_KEY")
        ctx = vf.ModelContext(model=model_path, client=client, sampling=vf.SamplingConfig(max_tokens=6))
        async with env.serving():
            return [await env.run_episode(task, ctx) for task in env.taskset]

    for episode in asyncio.run(run()):
        assert episode.ok and not episode.errors
        [trace] = episode.traces
        assert len(trace.calls) == 1 and 0.0 <= trace.reward <= 1.0
        assert set(trace.rewards) == {"digits_in_place"}


@pytest.mark.parametrize("in_process", [True, False])
def test_verifiers_workflow_groups_episodes_through_the_controller(model_path: str, in_process: bool) -> None:
    from areal_lite.api.config import InferenceEngineConfig, LocalEngineConfig
    from areal_lite.api.io import GenerationConfig
    from areal_lite.core import RolloutController
    from areal_lite.engines.local.engine import LocalInferenceEngine
    from areal_lite.workflows import check_trajectory
    from areal_lite.workflows.verifiers_env import VerifiersWorkflow, task_items

    env = reverse_env(2, in_process=in_process)
    tok = AutoTokenizer.from_pretrained(model_path)
    workflow = VerifiersWorkflow(env, GenerationConfig(n_samples=3, max_new_tokens=6), tok)
    items = task_items(env.taskset)
    rollout = RolloutController(LocalInferenceEngine(LocalEngineConfig(path=model_path)), InferenceEngineConfig())
    rollout.initialize()
    try:
        batch = rollout.rollout_batch(items, workflow)
    finally:
        rollout.destroy()
    check_trajectory(batch)
    assert batch.batch_size[0] == 6  # 2 tasks x 3 episodes, one trajectory each
    first = batch["episode_start"].bool()
    assert int(first.sum()) == 6 and batch["num_calls"].tolist() == [1.0] * 6
    for g in range(2):
        group = slice(3 * g, 3 * g + 3)
        assert torch.allclose(batch["baseline_rewards"][group], batch["rewards"][group].mean().expand(3))
    for row in range(6):
        # The trajectory is the prompt the proxy rendered, then the reply the rubric scored.
        ids = batch["input_ids"][row][batch["attention_mask"][row]].tolist()
        mask = batch["loss_mask"][row][batch["attention_mask"][row]].tolist()
        prompt, reply = ids[: mask.index(1)], tok.decode(ids[mask.index(1) :], skip_special_tokens=True)
        task = items[row // 3]["task"]
        chat = tok.apply_chat_template([{"role": "user", "content": task.data.prompt}], tokenize=False,
                                       add_generation_prompt=True)  # fmt: skip
        assert prompt == tok.encode(chat, add_special_tokens=False)
        got, want = (reply.strip().split() or [""])[0], task.data.answer
        score = sum(a == b for a, b in zip(got, want)) / max(len(want), len(got))
        assert float(batch["rewards"][row]) == pytest.approx(score)
