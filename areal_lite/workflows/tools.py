"""Tools for agents, in the OpenAI function-tool shape: `PythonTool`, a Python interpreter whose
code runs in a `Sandbox` (areal_lite/rewards/sandbox.py).

A tool is an async callable with ``name``, ``description`` and `openai_tool` (the entry for a
chat request's ``tools``). With the ``openai-agents`` SDK, wrap it as
``agents.function_tool(tool.__call__, name_override=tool.name)``.
"""

from __future__ import annotations

from areal_lite.rewards.sandbox import Sandbox


class PythonTool:
    """Runs the model's Python code in a fresh sandbox and returns what it printed.

    Args:
        sandbox: where the code runs (a default `Sandbox` when None).
        max_chars: the reply keeps its last this many characters (the error, and how the run
            ended, come last).
    """

    name = "python"
    description = "Run Python code and return what it prints."

    def __init__(self, sandbox: Sandbox | None = None, max_chars: int = 2000) -> None:
        self.sandbox = sandbox or Sandbox()
        self.max_chars = max_chars

    async def __call__(self, code: str) -> str:
        """Run ``code``; its stdout, then its stderr and how it ended when it did not succeed."""
        result = await self.sandbox.run(code)
        reply = result.stdout if result.ok else f"{result.stdout}{result.stderr}[{result.outcome}]"
        return reply[-self.max_chars :]

    def openai_tool(self) -> dict[str, object]:
        """The tool as an entry of a chat request's ``tools``."""
        code = {"type": "string", "description": "Python source; print what you want to see."}
        params = {"type": "object", "properties": {"code": code}, "required": ["code"]}
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": params},
        }
