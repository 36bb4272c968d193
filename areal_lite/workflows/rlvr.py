"""RLVR rollouts for GRPO: a group of samples per prompt, each scored by a verifiable reward.

One episode renders the item's chat through the tokenizer's template, sends ``n_samples``
requests for it (each its own rid, together through `InferenceEngine.agenerate_batch`), scores
every completion with the reward function (`RewardRunner`: worker processes, threads or async,
with a timeout, or inline for microsecond graders), and returns the group as one
``[n_samples, L]`` trajectory batch. Group-relative advantages are the trainer's business.
"""

from __future__ import annotations

import asyncio

from tensordict import TensorDict

from areal_lite.api.engine import InferenceEngine
from areal_lite.api.io import GenerationConfig, ModelRequest, ModelResponse
from areal_lite.api.workflow import RolloutWorkflow
from areal_lite.rewards.combined import RewardFn
from areal_lite.rewards.runner import RewardRunner
from areal_lite.workflows.trajectory import encode_chat, from_responses, prompt_messages

_RESERVED = ("prompt", "completion", "prompt_ids", "completion_ids")


def as_runner(reward_fn: RewardFn | RewardRunner, timeout: float) -> RewardRunner:
    return reward_fn if isinstance(reward_fn, RewardRunner) else RewardRunner(reward_fn, timeout=timeout)


async def score(
    reward: RewardRunner, tokenizer: object, prompt: str, resp: ModelResponse, data: dict[str, object]
) -> float:
    """The reward of one response; the item's other fields (e.g. ``answer``) go to the grader."""
    completion = tokenizer.decode(resp.output_tokens, skip_special_tokens=True)  # type: ignore[attr-defined]
    return await reward(prompt, completion, resp.input_tokens, resp.output_tokens, **grader_fields(data))


def grader_fields(data: dict[str, object]) -> dict[str, object]:
    """The item's fields a grader gets as keyword arguments: all but the four it takes first."""
    return {k: v for k, v in data.items() if k not in _RESERVED}


def rewards_differ(traj: TensorDict) -> bool:
    """``should_accept`` for dynamic sampling (DAPO): keep a group only if its rewards are not all
    equal, since a group-normalised advantage is zero everywhere otherwise."""
    rewards = traj["rewards"]
    return bool((rewards != rewards[0]).any())


class RLVRWorkflow(RolloutWorkflow):
    """GRPO groups: ``gconfig.n_samples`` completions of one prompt with their rewards.

    Args:
        reward_fn: ``reward_fn(prompt, completion, prompt_ids, completion_ids, **item) -> float``,
            or a `RewardRunner` (shared across workflows, with its own mode and timeout).
        gconfig: sampling; ``n_samples`` is the group size.
        tokenizer: a HF tokenizer with a chat template.
        enable_thinking: passed to the chat template (Qwen3-style thinking switch).
        use_chat_template: render the item through the chat template; False sends the item's
            ``prompt`` text as it is (base models, synthetic tasks).
        reward_timeout: seconds per sample when ``reward_fn`` is wrapped here.
    """

    def __init__(
        self,
        reward_fn: RewardFn | RewardRunner,
        gconfig: GenerationConfig,
        tokenizer: object,
        enable_thinking: bool = False,
        reward_timeout: float = 15.0,
        use_chat_template: bool = True,
    ) -> None:
        self.reward = as_runner(reward_fn, reward_timeout)
        self.gconfig = gconfig
        self.tokenizer = tokenizer
        self.enable_thinking = enable_thinking
        self.use_chat_template = use_chat_template

    def prompt_ids(self, data: dict[str, object]) -> list[int]:
        """The item's prompt tokens: its chat rendered by the template, or its raw ``prompt`` text."""
        if self.use_chat_template:
            return encode_chat(self.tokenizer, prompt_messages(data), enable_thinking=self.enable_thinking)
        return list(self.tokenizer(str(data["prompt"]), add_special_tokens=False)["input_ids"])  # type: ignore[operator]

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, object]) -> TensorDict:
        prompt_ids = self.prompt_ids(data)
        one = self.gconfig.new(n_samples=1)
        resps = await engine.agenerate_batch(
            [ModelRequest(input_ids=prompt_ids, gconfig=one) for _ in range(self.gconfig.n_samples)]
        )
        prompt = self.tokenizer.decode(prompt_ids)  # type: ignore[attr-defined]
        rewards = await asyncio.gather(*(score(self.reward, self.tokenizer, prompt, r, data) for r in resps))
        return from_responses(resps, list(rewards))
