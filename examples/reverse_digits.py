"""A small verifiers environment, written with verifiers' v1 API as its users write one: a
``Taskset`` of tasks ("Reverse the digits of 482." -> ``284``) and a ``Task`` whose rubric is one
``@vf.reward`` (the fraction of digits in the right place; 1.0 for the exact reversal).

verifiers loads a taskset by module name (``vf.TasksetConfig(id="reverse_digits")``), so this file
must be importable: `examples/verifiers_rl.py`, which trains on it, runs from this directory.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import verifiers.v1 as vf
from pydantic import Field


class ReverseConfig(vf.TasksetConfig):
    """Which numbers the taskset holds."""

    n_digits: int = 3
    """Digits of each number (no leading zero)."""
    n_tasks: int = 512
    """Tasks, distinct numbers drawn with ``seed``."""
    seed: int = 0
    """Seed of the draw; two tasksets with different seeds may share numbers (``exclude`` them)."""
    exclude: list[str] = Field(default_factory=list)
    """Numbers left out (another taskset's, e.g. the held-out ones)."""


class ReverseData(vf.TaskData):
    answer: str = ""
    """The digits reversed."""


class ReverseTask(vf.Task[ReverseData]):
    @vf.reward
    async def digits_in_place(self, trace: vf.Trace) -> float:
        """The fraction of the answer's positions holding the right digit (the reply's first word)."""
        reply = str(trace.messages[-1].content or "").strip() if trace.messages else ""
        got = reply.split()[0] if reply else ""
        want = self.data.answer
        hits = sum(a == b for a, b in zip(got, want))
        return hits / max(len(want), len(got))


def prompt_of(number: str) -> str:
    return f"Reverse the digits of {number}."


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self) -> Iterator[ReverseTask]:
        cfg = self.config
        low, high = 10 ** (cfg.n_digits - 1), 10**cfg.n_digits
        if cfg.n_tasks + len(cfg.exclude) > high - low:
            raise ValueError(f"{cfg.n_digits}-digit numbers are too few for {cfg.n_tasks} tasks")
        rng, seen = random.Random(cfg.seed), set(cfg.exclude)
        made = 0
        while made < cfg.n_tasks:
            number = str(rng.randrange(low, high))
            if number in seen:
                continue
            seen.add(number)
            made += 1
            yield ReverseTask(ReverseData(prompt=prompt_of(number), answer=number[::-1]), cfg.task)


__all__ = ["ReverseTaskset"]
