"""A verifiers harness that runs here, with nothing to download: verifiers' own chat program (the
loop of its ``null`` harness: the task's prompt, model calls, MCP tools when the task has some)
run by this Python interpreter in the ``subprocess`` runtime.

verifiers' built-in harnesses provision their program with ``uv`` at rollout time (a download per
machine), and its default runtime is a remote sandbox; neither works offline. This one needs only
the packages verifiers itself depends on (``openai``, ``mcp``, ``httpx``), which are installed
wherever verifiers is. Name it in an env config as ``{"id": "areal_lite_harness"}``, with
``vf.SubprocessConfig()`` as the runtime (`areal_lite.workflows.verifiers_env.local_agent` does).

It is a top-level package of its own because verifiers loads a harness by its id as a top-level
module name (a dotted id is not found).
"""

from __future__ import annotations

import json
import sys

from verifiers.v1.clients import ModelContext
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.null import NullHarness
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
from verifiers.v1.runtimes import ProgramResult, Runtime
from verifiers.v1.task import TaskData
from verifiers.v1.trace import Trace


class LocalChatHarness(NullHarness):
    """verifiers' chat loop run by ``sys.executable`` (see the module docstring)."""

    async def setup(self, runtime: Runtime) -> None:
        """Nothing to provision: the program is an installed module."""

    async def launch(
        self,
        ctx: ModelContext,
        trace: Trace,
        runtime: Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: TaskData,
        tool_interception_url: str | None = None,
    ) -> ProgramResult:
        system_prompt, prompt = self.resolve_prompt(data)
        # The program's command line, as verifiers' own launcher writes it (secrets in argv so
        # that tools the program runs do not inherit them).
        args = [f"--base-url={endpoint}", f"--api-key={secret}", f"--model={ctx.model}"]
        if tool_interception_url:
            args.append(f"--tool-interception-url={tool_interception_url}")
        if system_prompt:
            args.append(f"--system-prompt={system_prompt}")
        if mcp_urls:
            servers = {name: {"url": url, "timeout": self.config.tool_timeout} for name, url in mcp_urls.items()}
            args.append("--mcp-config=" + json.dumps({"mcpServers": servers}))
        if isinstance(prompt, str):
            args.append(f"--prompt={prompt}")
        elif prompt is not None:
            path = f".vf-initial-messages-{trace.id}.json"
            await runtime.write(path, json.dumps([message_to_wire(m) for m in prompt]).encode())
            args.append(f"--initial-messages-file={path}")
        # verifiers' program is its utils modules bundled into one script (what its null harness
        # hands to uv); this interpreter has every package the script declares.
        program = f".vf-chat-program-{trace.id}.py"
        await runtime.write(program, CHAT_PROGRAM_SOURCE.encode())
        return await runtime.run_program([sys.executable, program, *args], {**self.config.resolved_env})


__all__ = ["LocalChatHarness"]
