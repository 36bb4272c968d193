"""`CombinedGrader`: a weighted sum of named graders, each reported by name in the reward stats."""

from __future__ import annotations

from collections.abc import Callable, Mapping

RewardFn = Callable[..., float]
"""``reward_fn(prompt, completion, prompt_ids, completion_ids, **data) -> float``."""


class CombinedGrader:
    """``sum(weight * grader(...))`` over named graders.

    ``named_scores`` returns every component and the ``total``; `RewardRunner` uses it to report
    each component's mean under its name. Picklable when its graders are (module-level functions),
    so it runs in the runner's worker processes like any grader.
    """

    def __init__(self, graders: Mapping[str, tuple[RewardFn, float]]) -> None:
        if not graders:
            raise ValueError("CombinedGrader needs at least one grader")
        if "total" in graders:
            raise ValueError("'total' is reserved for the weighted sum")
        self.graders = dict(graders)
        self.safe_in_thread = all(getattr(fn, "safe_in_thread", False) for fn, _ in self.graders.values())

    def named_scores(
        self, prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **data: object
    ) -> dict[str, float]:
        """Each grader's score by name, and ``total``, the weighted sum."""
        scores = {
            name: float(fn(prompt, completion, prompt_ids, completion_ids, **data))
            for name, (fn, _) in self.graders.items()
        }
        scores["total"] = sum(w * scores[name] for name, (_, w) in self.graders.items())
        return scores

    def __call__(
        self, prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **data: object
    ) -> float:
        return self.named_scores(prompt, completion, prompt_ids, completion_ids, **data)["total"]
