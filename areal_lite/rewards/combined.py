"""`CombinedGrader`: a weighted sum of named graders, each reported by name in the reward stats."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from areal_lite.rewards.runner import RewardRunner, is_coroutine_grader

RewardFn = Callable[..., float]
"""``reward_fn(prompt, completion, prompt_ids, completion_ids, **data) -> float``."""


class CombinedGrader:
    """``sum(weight * grader(...))`` over named graders.

    ``named_scores`` returns every component and the ``total``; `RewardRunner` uses it to report
    each component's mean under its name. Picklable when its graders are (module-level functions),
    so it runs in the runner's worker processes like any grader.

    With a coroutine grader among them (an `LLMJudgeGrader`, whose engine lives in this process)
    the combination is ``is_async``: `RewardRunner` awaits ``anamed_scores`` on its event loop,
    which awaits the coroutine graders there and runs each plain one in its own `RewardRunner`
    (its worker processes or threads, with the outer runner's timeout); a component that fails
    fails the sample, as in the plain case.
    """

    def __init__(self, graders: Mapping[str, tuple[RewardFn, float]]) -> None:
        if not graders:
            raise ValueError("CombinedGrader needs at least one grader")
        if "total" in graders:
            raise ValueError("'total' is reserved for the weighted sum")
        self.graders = dict(graders)
        self.safe_in_thread = all(getattr(fn, "safe_in_thread", False) for fn, _ in self.graders.values())
        self.is_async = any(is_coroutine_grader(fn) for fn, _ in self.graders.values())
        self._runners: dict[str, RewardRunner] = {}

    def named_scores(
        self, prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **data: object
    ) -> dict[str, float]:
        """Each grader's score by name, and ``total``, the weighted sum."""
        if self.is_async:
            raise TypeError("this CombinedGrader holds a coroutine grader: await anamed_scores (RewardRunner does)")
        scores = {
            name: float(fn(prompt, completion, prompt_ids, completion_ids, **data))
            for name, (fn, _) in self.graders.items()
        }
        return self._with_total(scores)

    async def anamed_scores(
        self,
        prompt: str,
        completion: str,
        prompt_ids: list[int],
        completion_ids: list[int],
        timeout: float = 15.0,
        **data: object,
    ) -> dict[str, float]:
        """`named_scores` of an ``is_async`` combination, its graders run concurrently."""

        async def score(name: str, fn: RewardFn) -> float:
            if is_coroutine_grader(fn):
                return float(await fn(prompt, completion, prompt_ids, completion_ids, **data))  # type: ignore[misc]
            runner = self._runners.get(name)
            if runner is None:
                runner = self._runners[name] = RewardRunner(fn, timeout=timeout)
            status, value = await runner.outcome(prompt, completion, prompt_ids, completion_ids, **data)
            if status != "ok":
                raise RuntimeError(f"grader {name!r}: {status}{f' ({value})' if value else ''}")
            return float(value)  # type: ignore[arg-type]

        values = await asyncio.gather(*(score(name, fn) for name, (fn, _) in self.graders.items()))
        return self._with_total(dict(zip(self.graders, values)))

    def close(self) -> None:
        """Stop the worker processes of an ``is_async`` combination's plain graders."""
        for runner in self._runners.values():
            runner.close()
        self._runners.clear()

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_runners": {}}

    def _with_total(self, scores: dict[str, float]) -> dict[str, float]:
        scores["total"] = sum(w * scores[name] for name, (_, w) in self.graders.items())
        return scores

    def __call__(
        self, prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **data: object
    ) -> float:
        return self.named_scores(prompt, completion, prompt_ids, completion_ids, **data)["total"]
