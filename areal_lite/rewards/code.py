"""`CodeGrader`: reward 1.0 when a completion's program passes its tests, run in a `Sandbox`.

The tests come with the dataset item, in either form (or both):

- ``tests``: Python source (``assert f(2) == 4``) run against the program's top-level names by a
  checker, a second process of the same sandbox that the program cannot inspect (another uid,
  not dumpable: `areal_lite.rewards.code_harness`); what the program gives the tests is compared
  by value, as plain data (numbers, strings, bytes, lists, tuples, dicts, sets), never by the
  ``__eq__`` of the program's own objects. The run passes when the checker's tests end without an
  exception: a program that exits early, or tampers with its interpreter, does not pass.
- ``test_cases``: ``[{"input": ..., "output": ...}]``: the program runs once per case with the input
  on stdin and passes when its stdout equals the output (trailing whitespace aside).

Everything that goes wrong (a syntax error, a failed assert, a timeout, a fork bomb, a memory bomb,
a flood of output) scores 0; the sandbox counts how each run ended (`stats`). The grader is a
coroutine (``RewardRunner`` awaits it in ``async`` mode): waiting on a sandboxed process needs no
worker process of its own.
"""

from __future__ import annotations

import os
import re

from areal_lite.rewards.sandbox import Sandbox

with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "code_harness.py")) as _f:
    _common, _program_side, _checker_side = re.split(r"\n# ---- .*\n", _f.read())
PROGRAM_SOURCE = _common + _program_side
"""The program's side of a test run, as source (the sandbox's python may not see this package)."""
CHECKER_SOURCE = _common + _checker_side
"""The checker's side of a test run, as source: each side compiles only its own part."""

_FENCED = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str:
    """The last fenced code block of ``completion`` (```python, ```py or ```), else all of it."""
    blocks = _FENCED.findall(completion)
    return blocks[-1] if blocks else completion


def _program(solution: str) -> tuple[str, dict[str, str]]:
    """``main.py`` that runs the solution (``solution.py``) and serves its names to the checker."""
    return PROGRAM_SOURCE + '\nserve("solution.py")\n', {"solution.py": solution}


def _checker(tests: str) -> str:
    """The checker's source: the tests, run against the program's names."""
    return CHECKER_SOURCE + f"\ncheck({tests!r})\n"


class CodeGrader:
    """1.0 when the completion's code passes the item's ``tests`` and ``test_cases``, else 0.0.

    Args:
        sandbox: where programs run (a default `Sandbox` when None: this raises
            `SandboxUnavailable` where no isolation is available).
    """

    def __init__(self, sandbox: Sandbox | None = None) -> None:
        self.sandbox = sandbox or Sandbox()

    async def __call__(
        self,
        prompt: str,
        completion: str,
        prompt_ids: list[int],
        completion_ids: list[int],
        *,
        tests: str | None = None,
        test_cases: list[dict[str, str]] | None = None,
        **data: object,
    ) -> float:
        if not tests and not test_cases:
            raise ValueError("a code item needs 'tests' (Python asserts) or 'test_cases' (stdin/stdout pairs)")
        program = extract_code(completion)
        if tests:
            main, files = _program(program)
            result = await self.sandbox.run(main, files=files, checker=_checker(tests))
            if not result.ok:
                return 0.0
        for case in test_cases or []:
            result = await self.sandbox.run(program, stdin=str(case["input"]))
            if not (result.ok and _lines(result.stdout) == _lines(str(case["output"]))):
                return 0.0
        return 1.0

    def stats(self, reset: bool = False) -> dict[str, float]:
        """How the sandbox runs ended (`Sandbox.stats`)."""
        return self.sandbox.stats(reset)


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]
