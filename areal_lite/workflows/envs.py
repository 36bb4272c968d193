"""Environments for `MultiTurnWorkflow`: math with feedback and retries, and a calculator tool.

Both grade the final answer with a reward function awaited through a `RewardRunner` (off the event
loop, with a timeout), so one runner, created once, serves every episode.
"""

from __future__ import annotations

import ast
import operator
import re

from areal_lite.rewards.runner import RewardRunner
from areal_lite.workflows.multi_turn import Environment


def question_of(data: dict[str, object]) -> str:
    """The question of a dataset item: ``question``, ``prompt``, or the last user message."""
    for key in ("question", "prompt"):
        if key in data:
            return str(data[key])
    if "messages" in data:
        users = [m["content"] for m in data["messages"] if m["role"] == "user"]  # type: ignore[index, union-attr]
        if users:
            return str(users[-1])
    raise KeyError(f"a dataset item needs 'question', 'prompt' or 'messages'; this one has {sorted(data)}")


class MathFeedbackEnv(Environment):
    """Ask a math question; a wrong answer gets ``retry_message`` and another attempt.

    Reward 1.0-scale from ``grader`` on the turn that answers correctly (the workflow's turn
    discount makes later attempts worth less), 0 otherwise.
    """

    def __init__(self, grader: RewardRunner, retry_message: str = "That is not right. Try again.") -> None:
        self.grader = grader
        self.retry_message = retry_message
        self.data: dict[str, object] = {}
        self.question = ""

    async def reset(self, data: dict[str, object]) -> str:
        self.data = {k: v for k, v in data.items() if k not in ("prompt", "messages", "question")}
        self.question = question_of(data)
        return self.question

    async def step(self, action: str) -> tuple[str, float, bool]:
        reward = await self.grader(self.question, action, [], [], **self.data)
        if reward > 0:
            return "", reward, True
        return self.retry_message, 0.0, False


_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_MAX_EXPONENT = 64
_MAX_EXPRESSION_CHARS = 200


def calculate(expression: str) -> str:
    """Evaluate arithmetic (numbers, + - * / // % **, parentheses) without ``eval``; errors are
    returned as text for the model to read, never raised."""
    if len(expression) > _MAX_EXPRESSION_CHARS:
        return "error: expression too long"

    def ev(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        raise ValueError(f"unsupported syntax: {type(node).__name__}")

    try:
        value = ev(ast.parse(expression.strip(), mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError) as e:
        return f"error: {e}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


class CalculatorEnv(Environment):
    """A tool-use task: the model may call a calculator by writing ``<calc>expression</calc>``;
    the result comes back as a ``tool`` message. A reply without a call is the final answer,
    graded by ``grader``."""

    observation_role = "tool"
    CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)

    def __init__(self, grader: RewardRunner) -> None:
        self.grader = grader
        self.data: dict[str, object] = {}
        self.question = ""
        self.calls = 0

    async def reset(self, data: dict[str, object]) -> str:
        self.data = {k: v for k, v in data.items() if k not in ("prompt", "messages", "question")}
        self.question = question_of(data)
        return f"{self.question}\nYou may use a calculator: write <calc>expression</calc>."

    async def step(self, action: str) -> tuple[str, float, bool]:
        call = self.CALL.search(action)
        if call is not None:
            self.calls += 1
            return calculate(call.group(1)), 0.0, False
        reward = await self.grader(self.question, action, [], [], **self.data)
        return "", reward, True
