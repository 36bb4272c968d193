"""Grading a final mathematical answer with the math-verify library.

The gold answer comes from the dataset item (``answer``); the completion's answer is the last
``\\boxed{...}`` (or, failing that, the last expression math-verify can extract). Equivalent forms
(``1/2`` and ``0.5``, ``\\frac{3}{6}``) count as correct.

math-verify's own timeouts use ``SIGALRM``, which only works in a process's main thread: they are
used there (in the `RewardRunner`'s worker processes) and switched off in other threads, where
only the runner's timeout applies.
"""

from __future__ import annotations

import threading

from math_verify import parse, verify

_TIMEOUT_S = 5


def math_answer_reward(
    prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], *, answer: object, **data: object
) -> float:
    """1.0 when the completion's final answer equals ``answer`` mathematically, else 0.0."""
    gold_text = str(answer)
    if "\\boxed" not in gold_text and "$" not in gold_text:
        gold_text = f"${gold_text}$"
    timeout = _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(gold_text, parsing_timeout=timeout)
    pred = parse(completion, parsing_timeout=timeout)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0
