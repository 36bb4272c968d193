"""Multi-turn agent rollouts: a policy talks to an environment for up to ``max_turns`` turns.

The trajectory is built from tokens, never re-tokenized: each turn's request is exactly the tokens
so far, the model's output tokens are appended as they came (loss_mask 1, their logprobs and
versions), and the environment's reply is appended as the token ids of the chat-template text
that closes the assistant turn and opens the next one (loss_mask 0, version -1). So what is
trained on is exactly what the model saw and produced; re-rendering the conversation with the
chat template could tokenize differently at turn boundaries (or, for Qwen3 templates, drop earlier
thinking) and train on tokens the model never saw.

The episode's reward is ``sum_t turn_discount**t * r_t`` over the turns' rewards, so a task solved
on a later attempt earns less.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable

from tensordict import TensorDict

from areal_lite.api.engine import InferenceEngine
from areal_lite.api.io import GenerationConfig, ModelRequest, ModelResponse
from areal_lite.utils.data import concat_padded
from areal_lite.workflows.episodes import EpisodeWorkflow
from areal_lite.workflows.trajectory import TokenTrace, encode_chat

_SENTINEL = "\u2063ASSISTANT-REPLY\u2063"


class Environment(abc.ABC):
    """One episode's environment. A new instance per episode (episodes run concurrently)."""

    observation_role: str = "user"
    """Chat role of the environment's replies (``user``, or ``tool`` for tool results)."""

    @abc.abstractmethod
    async def reset(self, data: dict[str, object]) -> str:
        """Start an episode on a dataset item; returns the first user message."""

    @abc.abstractmethod
    async def step(self, action: str) -> tuple[str, float, bool]:
        """Act on the model's reply: returns (observation for the next turn, reward, done)."""


class ChatTurnGlue:
    """Token ids between a model's reply and the next generation: the end of the assistant turn,
    the environment's message, and the next assistant header, as the chat template renders them."""

    def __init__(self, tokenizer: object, **template_kwargs: object) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = template_kwargs
        self.special_ids = frozenset(tokenizer.all_special_ids)  # type: ignore[attr-defined]

    def text_after_reply(self, role: str, content: str) -> str:
        """The template's text after an assistant reply: its closing, the ``role`` message, the
        next assistant header. Rendered around a sentinel reply so that any template works
        (system prompts added by default and rewriting of earlier turns fall before it)."""
        messages = [
            {"role": "user", "content": "."},
            {"role": "assistant", "content": _SENTINEL},
            {"role": role, "content": content},
        ]
        text = self.tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            messages, tokenize=False, add_generation_prompt=True, **self.template_kwargs
        )
        return text[text.index(_SENTINEL) + len(_SENTINEL) :]

    def ids_after_reply(self, resp: ModelResponse, role: str, content: str) -> list[int]:
        text = self.text_after_reply(role, content)
        last = resp.output_tokens[-1] if resp.output_tokens else None
        if resp.stop_reason == "stop" and last in self.special_ids:
            # The model already closed its turn with a special token (eos) the template also writes.
            own = self.tokenizer.decode([last])  # type: ignore[attr-defined]
            text = text.removeprefix(own)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]


class MultiTurnWorkflow(EpisodeWorkflow):
    """Agent loop over an `Environment`, ``gconfig.n_samples`` independent episodes per item.

    Args:
        env_factory: builds a fresh environment for each episode.
        gconfig: sampling of each turn (``max_new_tokens`` per turn).
        tokenizer: a HF tokenizer with a chat template.
        max_turns: turn limit; the episode ends after this many model replies.
        turn_discount: weight of turn t's reward is ``turn_discount ** t``.
        max_context_tokens: end the episode before a turn whose prompt plus ``max_new_tokens``
            would exceed this (None = no limit; the engine rejects prompts beyond its context).
        template_kwargs: passed to the chat template (e.g. ``enable_thinking=False``).
    """

    def __init__(
        self,
        env_factory: Callable[[], Environment],
        gconfig: GenerationConfig,
        tokenizer: object,
        max_turns: int = 3,
        turn_discount: float = 0.9,
        max_context_tokens: int | None = None,
        **template_kwargs: object,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        super().__init__(gconfig, tokenizer, max_context_tokens, template_kwargs)
        self.env_factory = env_factory
        self.max_turns = max_turns
        self.turn_discount = turn_discount
        self.glue = ChatTurnGlue(tokenizer, **template_kwargs)

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, object]) -> TensorDict:
        episodes = await asyncio.gather(*(self.run_one(engine, data) for _ in range(self.n_episodes)))
        return concat_padded(episodes)

    async def run_one(self, engine: InferenceEngine, data: dict[str, object]) -> TensorDict:
        env = self.env_factory()
        first = await env.reset(data)
        trace = TokenTrace(encode_chat(self.tokenizer, [{"role": "user", "content": first}], **self.template_kwargs))
        total, weight = 0.0, 1.0
        for turn in range(self.max_turns):
            resp = await engine.agenerate(ModelRequest(input_ids=list(trace.input_ids), gconfig=self.gconfig))
            trace.add_generated(resp)
            reply = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)  # type: ignore[attr-defined]
            observation, reward, done = await env.step(reply)
            total += weight * reward
            if done or turn == self.max_turns - 1:
                break
            context = self.glue.ids_after_reply(resp, env.observation_role, observation)
            if (
                self.max_context_tokens
                and len(trace.input_ids) + len(context) + self.gconfig.max_new_tokens > self.max_context_tokens
            ):
                break
            trace.add_context(context)
            weight *= self.turn_discount
        return trace.to_tensordict(total, num_turns=float(turn + 1))
