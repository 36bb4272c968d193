"""`LLMJudgeGrader`: asks a model, through any InferenceEngine, whether a completion is correct.

The judge sees the question, the reference answer (when the item has one) and the response, and
must answer yes or no; the reward is 1.0 for a verdict starting with ``yes``. The judge is a
coroutine grader: `RewardRunner` awaits it on the rollout event loop (``async`` mode), where the
generation request joins the engine's batch like any rollout request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from areal_lite.api.io import GenerationConfig, ModelRequest

if TYPE_CHECKING:
    from areal_lite.api.engine import InferenceEngine

DEFAULT_TEMPLATE = (
    "You are grading an answer.\n"
    "Question: {question}\n"
    "Reference answer: {reference}\n"
    "Response: {response}\n"
    "Is the response correct? Reply with yes or no."
)


def default_judge_gconfig() -> GenerationConfig:
    """The judge's sampling unless told otherwise: greedy, 4 tokens (room for yes or no)."""
    return GenerationConfig(greedy=True, max_new_tokens=4)


def verdict_reward(verdict: str) -> float:
    """1.0 for a verdict that starts with ``yes`` (any case, after white space), else 0.0."""
    return 1.0 if verdict.strip().lower().startswith("yes") else 0.0


class LLMJudgeGrader:
    """Reward 1.0 when the judge model says ``yes``.

    Args:
        engine: where the judge model runs (the policy's own engine, or another one).
        tokenizer: the judge model's tokenizer (its chat template formats the request).
        template: format string with ``{question}``, ``{reference}`` and ``{response}``.
        gconfig: the judge's sampling; greedy and a few tokens by default.
        reference_key: the dataset item's key holding the reference answer.
    """

    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer: object,
        template: str = DEFAULT_TEMPLATE,
        gconfig: GenerationConfig | None = None,
        reference_key: str = "answer",
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.template = template
        self.gconfig = gconfig or default_judge_gconfig()
        self.reference_key = reference_key
        self.last_verdict = ""

    def judge_prompt_ids(self, question: str, response: str, reference: str) -> list[int]:
        text = self.template.format(question=question, reference=reference, response=response)
        chat = self.tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return list(self.tokenizer(chat, add_special_tokens=False)["input_ids"])  # type: ignore[operator]

    async def __call__(
        self, prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **data: object
    ) -> float:
        ids = self.judge_prompt_ids(prompt, completion, str(data.get(self.reference_key, "")))
        resp = await self.engine.agenerate(ModelRequest(input_ids=ids, gconfig=self.gconfig))
        verdict = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)  # type: ignore[attr-defined]
        self.last_verdict = verdict
        return verdict_reward(verdict)
