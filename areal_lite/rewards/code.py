"""`CodeGrader`: reward 1.0 when a completion's program passes its tests, run in a `Sandbox`.

The tests come with the dataset item, in either form (or both):

- ``tests``: Python source run after the program in the same interpreter (``assert f(2) == 4``);
  the run passes when the tests end and print this run's pass token, which the harness reads from
  stdin before the program starts: a program that exits early with status 0 does not pass.
- ``test_cases``: ``[{"input": ..., "output": ...}]``: the program runs once per case with the input
  on stdin and passes when its stdout equals the output (trailing whitespace aside).

Everything that goes wrong (a syntax error, a failed assert, a timeout, a fork bomb, a memory bomb,
a flood of output) scores 0; the sandbox counts how each run ended (`stats`). The grader is a
coroutine (``RewardRunner`` awaits it in ``async`` mode): waiting on a sandboxed process needs no
worker process of its own. The pass token stops accidental passes, not a program written to find
the token in its own interpreter's memory.
"""

from __future__ import annotations

import re
import secrets

from areal_lite.rewards.sandbox import Sandbox

_FENCED = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str:
    """The last fenced code block of ``completion`` (```python, ```py or ```), else all of it."""
    blocks = _FENCED.findall(completion)
    return blocks[-1] if blocks else completion


def _harness(program: str, tests: str) -> str:
    """``main.py`` that runs the program, then the tests, then prints the token read from stdin."""
    return (
        "import sys\n"
        "def _run(token, program, tests):\n"
        "    scope = {'__name__': '__main__'}\n"
        "    exec(compile(program, 'solution.py', 'exec'), scope)\n"
        "    exec(compile(tests, 'tests.py', 'exec'), scope)\n"
        "    sys.stdout.write('\\n' + token + '\\n')\n"
        f"_run(sys.stdin.readline().strip(), {program!r}, {tests!r})\n"
    )


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
            token = secrets.token_hex(16)
            result = await self.sandbox.run(_harness(program, tests), stdin=token + "\n")
            if not (result.ok and result.stdout.rstrip().endswith("\n" + token)):
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
