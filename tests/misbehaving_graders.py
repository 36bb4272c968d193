"""Graders that fail in each way a reward function can, for the runner tests. A module of its own,
importing nothing heavy, so that the runner's worker processes unpickle them quickly."""

from __future__ import annotations

import math
import os
import threading


def misbehaving_grader(
    prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], *, kind: str
) -> float:
    """1.0 for ``ok``; raises, hangs forever, returns NaN or kills its process for the other kinds."""
    if kind == "raise":
        raise RuntimeError("grader bug")
    if kind == "hang":
        threading.Event().wait()
    if kind == "nan":
        return math.nan
    if kind == "exit":
        os._exit(3)
    return 1.0
