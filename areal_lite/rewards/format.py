"""Format graders: does a completion follow the answer format the prompt asked for? And the
exact-match grader of synthetic tasks, whose answers have one spelling.

They are pure regular expressions over short strings: fast and unable to hang, so the
`RewardRunner` may run them in a thread instead of a worker process (``safe_in_thread``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable[..., float])

_BOXED = re.compile(r"\\boxed\{[^{}]*(\{[^{}]*\}[^{}]*)*\}")
_THINK = re.compile(r"^\s*<think>(?P<think>.+?)</think>\s*(?P<answer>\S.*)$", re.DOTALL)


def safe_in_thread(fn: F) -> F:
    """Mark a grader as fast and unable to hang or crash the process: `RewardRunner` in ``auto``
    mode then runs it in a thread instead of a worker process."""
    fn.safe_in_thread = True  # type: ignore[attr-defined]
    return fn


@safe_in_thread
def boxed_format_reward(
    prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **data: object
) -> float:
    """1.0 when the completion puts an answer in ``\\boxed{...}``, else 0.0."""
    return 1.0 if _BOXED.search(completion) else 0.0


@safe_in_thread
def think_format_reward(
    prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **data: object
) -> float:
    """1.0 for ``<think>reasoning</think> answer`` (one think block, then a non-empty answer), else 0.0."""
    m = _THINK.match(completion)
    if m is None or "<think>" in m.group("think") or "</think>" in m.group("answer"):
        return 0.0
    return 1.0


@safe_in_thread
def exact_answer_reward(
    prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], *, answer: object, **data: object
) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, is exactly ``answer``, else 0.0."""
    return float(completion.strip() == str(answer))
