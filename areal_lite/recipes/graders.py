"""Graders of the recipe API: objects that score a finished `StringThread`.

A `Grader` has an async ``setup()`` (start what it needs, e.g. a judge model; call it once before
grading) and an async ``score_float_value(thread)``. Shipped:

- `FunctionGrader`: any ``fn(thread) -> float`` (or a coroutine function);
- `RewardFnGrader`: a reward function of `areal_lite.rewards` (``fn(prompt, completion,
  prompt_ids, completion_ids, **item)``), run by a `RewardRunner` (off the event loop, with a
  timeout; a grader that fails scores 0 and is counted); the thread's ``metadata`` are the item;
- `JudgeGrader`: asks a model (an `InferenceModel`, or one it spawns in ``setup``) whether the
  completion is right, with the yes/no prompt of `areal_lite.rewards.judge`;
- `CombinedGrader`: a weighted sum of named graders; its ``setup`` sets every child up.

A grader written inside a recipe may subclass `Grader` or be any object with an async
``score_float_value`` (`CombinedGrader` calls ``setup`` and ``close`` where they exist).
"""

from __future__ import annotations

import abc
import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable, Mapping

from areal_lite.api.io import GenerationConfig
from areal_lite.recipes.model import InferenceModel, ModelBuilder
from areal_lite.recipes.thread import StringThread
from areal_lite.rewards.combined import RewardFn
from areal_lite.rewards.judge import DEFAULT_TEMPLATE, default_judge_gconfig, verdict_reward
from areal_lite.rewards.runner import RewardRunner, RunnerMode


class Grader(abc.ABC):
    """Scores threads. Subclasses implement `score_float_value` (and `setup` when they need to
    start something)."""

    async def setup(self) -> None:
        """Start what grading needs (a judge model, worker processes). Idempotent."""

    @abc.abstractmethod
    async def score_float_value(self, thread: StringThread) -> float:
        """The score of ``thread`` (usually of its last assistant turn)."""

    async def close(self) -> None:
        """Release what `setup` started."""


class FunctionGrader(Grader):
    """A grader from ``fn(thread) -> float`` or ``async fn(thread) -> float``. A plain function
    is called on the event loop: keep it fast (a string comparison), or use `RewardFnGrader`."""

    def __init__(self, fn: Callable[[StringThread], float | Awaitable[float]], name: str | None = None) -> None:
        self.fn = fn
        self.name = name or getattr(fn, "__name__", type(fn).__name__)

    async def score_float_value(self, thread: StringThread) -> float:
        out = self.fn(thread)
        if inspect.isawaitable(out):
            out = await out
        return float(out)  # type: ignore[arg-type]


class RewardFnGrader(Grader):
    """A reward function of `areal_lite.rewards` on the last assistant turn: ``prompt`` is the
    content of the turns before it (joined by newlines), ``completion`` its content, and the
    thread's metadata its keyword arguments (e.g. ``answer``). Token ids are not known here and are
    passed empty. ``mode`` and ``timeout`` are `RewardRunner`'s. A sample the runner could not
    score (its grader raised, timed out or returned a non-number: NaN) scores 0 here, as the
    recipes' group-normalised advantages need a number for every sample; `stats` counts them."""

    def __init__(self, fn: RewardFn, mode: RunnerMode = "auto", timeout: float = 30.0, name: str | None = None) -> None:
        self.runner = RewardRunner(fn, mode=mode, timeout=timeout)
        self.name = name or getattr(fn, "__name__", type(fn).__name__)

    async def score_float_value(self, thread: StringThread) -> float:
        prompt = thread.prompt()
        text = "\n".join(content for _, content in prompt.turns)
        score = await self.runner(text, thread.completion(), [], [], **thread.metadata)
        return score if math.isfinite(score) else 0.0

    def stats(self) -> dict[str, float]:
        """The runner's counts and means (``reward/...``)."""
        return self.runner.stats()

    async def close(self) -> None:
        await asyncio.to_thread(self.runner.close)


class JudgeGrader(Grader):
    """1.0 when a judge model answers yes to "is the response correct?" (a greedy, short
    generation), else 0.0.

    Args:
        judge: the judge, or a `ModelBuilder` that ``setup`` spawns it from (as ``name``).
        template: format string with ``{question}``, ``{reference}`` and ``{response}``.
        reference_key: the metadata key of the reference answer ("" when there is none).
        gconfig: the judge's sampling; greedy and 4 tokens by default.
    """

    def __init__(
        self,
        judge: InferenceModel | ModelBuilder,
        template: str = DEFAULT_TEMPLATE,
        reference_key: str = "answer",
        gconfig: GenerationConfig | None = None,
        name: str = "judge",
    ) -> None:
        self.judge = judge
        self.template = template
        self.reference_key = reference_key
        self.gconfig = gconfig or default_judge_gconfig()
        self.name = name
        self.last_verdict = ""

    async def setup(self) -> None:
        if isinstance(self.judge, ModelBuilder):
            self.judge = await self.judge.spawn_inference(self.name)

    async def score_float_value(self, thread: StringThread) -> float:
        if not isinstance(self.judge, InferenceModel):
            raise TypeError("JudgeGrader.setup() must be awaited before grading: it spawns the judge")
        question = "\n".join(content for role, content in thread.prompt().turns if role != "system")
        reference = str(thread.metadata.get(self.reference_key, "")) if self.reference_key else ""
        text = self.template.format(question=question, reference=reference, response=thread.completion())
        verdict = (await self.judge.generate(StringThread([("user", text)]), self.gconfig)).completion()
        self.last_verdict = verdict
        return verdict_reward(verdict)

    async def close(self) -> None:
        if isinstance(self.judge, InferenceModel):
            await self.judge.close()


class CombinedGrader(Grader):
    """``sum(weight * score)`` over named graders (weights default to 1). ``setup`` sets every
    child up; `score_components` gives each child's score and the ``total``. A child may be any
    object with an async ``score_float_value`` (a grader written in a recipe); one without is a
    TypeError here."""

    def __init__(
        self, graders: Mapping[str, Grader] | list[Grader], weights: Mapping[str, float] | list[float] | None = None
    ) -> None:
        if isinstance(graders, Mapping):
            named = dict(graders)
        else:
            named = {getattr(g, "name", f"{type(g).__name__}_{i}"): g for i, g in enumerate(graders)}
            if len(named) != len(graders):
                raise ValueError("two graders have the same name: pass a dict of name -> grader")
        if not named:
            raise ValueError("CombinedGrader needs at least one grader")
        if "total" in named:
            raise ValueError("'total' is reserved for the weighted sum")
        for name, g in named.items():
            if not callable(getattr(g, "score_float_value", None)):
                raise TypeError(f"grader {name!r} ({type(g).__name__}) has no score_float_value method")
        if weights is None:
            w = dict.fromkeys(named, 1.0)
        elif isinstance(weights, Mapping):
            w = {name: float(weights.get(name, 1.0)) for name in named}
            unknown = set(weights) - set(named)
            if unknown:
                raise ValueError(f"weights for unknown graders: {sorted(unknown)}")
        else:
            if len(weights) != len(named):
                raise ValueError(f"{len(weights)} weights for {len(named)} graders")
            w = dict(zip(named, map(float, weights)))
        self.graders = named
        self.weights = w

    async def setup(self) -> None:
        await asyncio.gather(*(g.setup() for g in self.graders.values() if hasattr(g, "setup")))

    async def score_components(self, thread: StringThread) -> dict[str, float]:
        """Each grader's score by name, and ``total``, the weighted sum."""
        scores = await asyncio.gather(*(g.score_float_value(thread) for g in self.graders.values()))
        out = dict(zip(self.graders, scores))
        out["total"] = sum(self.weights[name] * s for name, s in zip(self.graders, scores))
        return out

    async def score_float_value(self, thread: StringThread) -> float:
        return (await self.score_components(thread))["total"]

    async def close(self) -> None:
        await asyncio.gather(*(g.close() for g in self.graders.values() if hasattr(g, "close")))
