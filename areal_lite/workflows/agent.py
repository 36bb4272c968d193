"""Agent rollouts through the OpenAI protocol: a user's agent, written with the ``openai`` SDK or
any framework on it (the ``openai-agents`` SDK, ...), trained on what the model saw and produced.

One episode: `AgentWorkflow` puts a `RecordingProxy` (``openai_proxy.py``) in front of the rollout
engine, awaits ``agent_fn(client, item)`` with the proxy's ``openai.AsyncOpenAI`` client, and
scores the final answer the agent returns with a grader over the episode:
``reward_fn(prompt, answer, prompt_ids, answer_ids, **item)``, the prompt being the episode's first
call's. Every trajectory the episode's calls formed (one when the chat template keeps the history
and the model's replies read back as it wrote them; more when a template rewrites history) carries
that reward; only generated tokens are trained on.

Groups. ``gconfig.n_samples`` episodes run per item. As an episode may yield several trajectories,
GRPO's fixed-size groups do not fit the batch; instead each trajectory carries ``baseline_rewards``,
the mean reward of its group's episodes (each episode counted once), so the actor's ``remax``
estimator, ``rewards - baseline_rewards``, gives every trajectory of an episode the group-relative
advantage of Dr. GRPO (GRPO without the division by the group's std; Liu et al. 2025, sec. 3.1).

An episode that ran out of its budget (``max_calls``, ``max_context_tokens``) ends there and is
graded on the empty answer; one whose generation failed fails; an error in the agent's own code
propagates (the executor's ``on_workflow_error`` decides).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tensordict import TensorDict

from areal_lite.api.engine import InferenceEngine
from areal_lite.api.io import GenerationConfig, ModelRequest, ModelResponse
from areal_lite.rewards.combined import RewardFn
from areal_lite.rewards.runner import RewardRunner
from areal_lite.utils.data import concat_padded
from areal_lite.workflows.episodes import EpisodeWorkflow
from areal_lite.workflows.openai_proxy import RecordingProxy
from areal_lite.workflows.rlvr import as_runner, grader_fields
from areal_lite.workflows.trajectory import TokenTrace

if TYPE_CHECKING:
    import openai

AgentFn = Callable[["openai.AsyncOpenAI", dict[str, object]], Awaitable[str | None]]
"""``async agent_fn(client, item) -> final answer`` (None: no answer). Every model call goes
through ``client``; the model name it passes is ignored (the policy answers)."""


@dataclass
class Episode:
    """One agent run: its trajectories, its reward and how many model calls it made."""

    traces: list[TokenTrace]
    reward: float
    num_calls: int


class ProxiedWorkflow(EpisodeWorkflow):
    """What the workflows whose episodes run behind a `RecordingProxy` share (`AgentWorkflow`,
    ``VerifiersWorkflow``): each episode has a proxy of its own, set up alike (`new_proxy`). The
    arguments are `AgentWorkflow`'s."""

    def __init__(
        self,
        gconfig: GenerationConfig,
        tokenizer: object,
        max_calls: int,
        max_context_tokens: int | None,
        template_kwargs: dict[str, object],
    ) -> None:
        if max_calls < 1:
            raise ValueError(f"max_calls must be >= 1, got {max_calls}")
        super().__init__(gconfig, tokenizer, max_context_tokens, template_kwargs)
        self.max_calls = max_calls

    def new_proxy(self, engine: InferenceEngine) -> RecordingProxy:
        """A proxy in front of ``engine`` for one episode."""
        return RecordingProxy(
            engine,
            self.tokenizer,
            self.gconfig,
            max_calls=self.max_calls,
            max_context_tokens=self.max_context_tokens,
            template_kwargs=self.template_kwargs,
        )


class AgentWorkflow(ProxiedWorkflow):
    """``gconfig.n_samples`` episodes of an OpenAI-SDK agent per item.

    Args:
        agent_fn: the agent (see `AgentFn`); a module-level function, so that the workflow pickles
            for ``rollout.episode_process``.
        reward_fn: the grader over an episode, or a `RewardRunner`.
        gconfig: sampling of each model call (``max_new_tokens`` per call); ``n_samples`` is the
            number of episodes per item.
        tokenizer: the policy's HF tokenizer with a chat template (tools in it for tool calls).
        max_calls: model calls per episode.
        max_context_tokens: a call is refused once the conversation leaves no room below this.
        reward_timeout: seconds per episode when ``reward_fn`` is wrapped here.
        template_kwargs: passed to the chat template (e.g. ``enable_thinking=False``).
    """

    def __init__(
        self,
        agent_fn: AgentFn,
        reward_fn: RewardFn | RewardRunner,
        gconfig: GenerationConfig,
        tokenizer: object,
        *,
        max_calls: int = 16,
        max_context_tokens: int | None = None,
        reward_timeout: float = 15.0,
        **template_kwargs: object,
    ) -> None:
        super().__init__(gconfig, tokenizer, max_calls, max_context_tokens, template_kwargs)
        self.agent_fn = agent_fn
        self.reward = as_runner(reward_fn, reward_timeout)

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, object]) -> TensorDict | None:
        episodes = await asyncio.gather(*(self.run_one(engine, data) for _ in range(self.n_episodes)))
        return group_batch(episodes)

    async def run_one(self, engine: InferenceEngine, data: dict[str, object]) -> Episode:
        """Run the agent once on ``data`` and grade its answer."""
        proxy = self.new_proxy(engine)
        answer: str | None = None
        async with proxy.client() as client:
            try:
                answer = await self.agent_fn(client, data)
            except Exception:
                if proxy.error is None and proxy.exhausted is None:
                    raise  # the agent's own error
        if proxy.error is not None:
            raise RuntimeError("a model call of the agent failed") from proxy.error
        reward = await self.grade(proxy, answer or "", data)
        return Episode(proxy.traces, reward, len(proxy.calls))

    async def grade(self, proxy: RecordingProxy, answer: str, data: dict[str, object]) -> float:
        prompt_ids = proxy.calls[0].prompt_ids if proxy.calls else []
        prompt = self.tokenizer.decode(prompt_ids)  # type: ignore[attr-defined]
        answer_ids = list(self.tokenizer(answer, add_special_tokens=False)["input_ids"])  # type: ignore[operator]
        return await self.reward(prompt, answer, prompt_ids, answer_ids, **grader_fields(data))


def group_batch(episodes: list[Episode]) -> TensorDict | None:
    """The trajectories of a group of episodes, each with its episode's reward and ``num_calls``,
    the group's mean episode reward as ``baseline_rewards``, and ``episode_start`` 1 on the first
    trajectory of each episode; None when no episode made a call."""
    baseline = sum(e.reward for e in episodes) / len(episodes)
    parts = [
        trace.to_tensordict(
            e.reward, baseline_rewards=baseline, num_calls=float(e.num_calls), episode_start=float(i == 0)
        )
        for e in episodes
        for i, trace in enumerate(e.traces)
    ]
    return concat_padded(parts) if parts else None


def episode_means(batch: TensorDict) -> dict[str, float]:
    """Means over a batch's episodes, each counted once however many trajectories it split into:
    ``episode_reward``, ``episode_calls`` and ``trajectories_per_episode``."""
    first = batch["episode_start"].bool()
    return {
        "episode_reward": float(batch["rewards"][first].mean()),
        "episode_calls": float(batch["num_calls"][first].mean()),
        "trajectories_per_episode": len(first) / int(first.sum()),
    }


class _ScriptedPolicy:
    """Stands in for the engine: replies with the given texts in order, each ended by eos."""

    def __init__(self, tokenizer: object, replies: list[str]) -> None:
        self.tokenizer, self.replies = tokenizer, list(replies)

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        text = self.replies.pop(0) + self.tokenizer.eos_token  # type: ignore[attr-defined]
        out = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]
        return ModelResponse(list(req.input_ids), out, [0.0] * len(out), [0] * len(out), "stop")


async def record_demonstration(
    agent_fn: AgentFn, item: dict[str, object], replies: list[str], tokenizer: object, max_new_tokens: int = 256
) -> list[TokenTrace]:
    """The trajectories of ``agent_fn`` run on ``item`` against a scripted policy whose model calls
    answer ``replies`` in order: SFT data for an agent, tokenized exactly as its RL episodes are
    (loss mask on the replies only)."""
    policy = _ScriptedPolicy(tokenizer, replies)
    proxy = RecordingProxy(policy, tokenizer, GenerationConfig(max_new_tokens=max_new_tokens))  # type: ignore[arg-type]
    async with proxy.client() as client:
        await agent_fn(client, item)
    return proxy.traces
