"""A verifiers harness that runs here, with nothing to download: the chat loop of verifiers' ``null``
harness (the task's prompt, then model calls, MCP tools when the task has some), run by this
Python interpreter.

verifiers' built-in harnesses provision their program with ``uv`` at rollout time (a download per
machine), and its default runtime is a remote sandbox; neither works offline. `LocalChatHarness`
runs verifiers' own chat program (its bundled script) with ``sys.executable``, which has every
package the script declares (verifiers depends on them), in the runtime of the agent (use
``vf.SubprocessConfig()``). With ``in_process: true`` it instead makes the calls of a plain chat
(no tools) from a coroutine in this process: no Python start per episode (about 2 CPU-seconds
each), which is what an RL run on a small CPU machine can afford.

Name it in an env's agent config as ``{"id": "areal_lite_harness"}``
(`areal_lite.workflows.verifiers_env.local_agent` does). It is a top-level package of its own
because verifiers loads a harness by its id as a top-level module name (a dotted id is not found).
"""

from __future__ import annotations

import functools
import json
import ssl
import sys

from verifiers.v1.clients import ModelContext
from verifiers.v1.configs.harness import HarnessConfig
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.errors import MODEL_TRANSPORT_ERROR_EXIT_CODE
from verifiers.v1.harness import Harness
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
from verifiers.v1.runtimes import ProgramResult, Runtime
from verifiers.v1.task import TaskData
from verifiers.v1.trace import Trace


class LocalChatHarnessConfig(HarnessConfig):
    """`LocalChatHarness`'s config."""

    in_process: bool = False
    """Make the calls of a plain chat from this process instead of running verifiers' program (no
    process start per episode; no MCP tools)."""


class LocalChatHarness(Harness[LocalChatHarnessConfig]):
    """verifiers' chat loop run by this interpreter (see the module docstring)."""

    # As verifiers' null harness, whose program this runs: a chat loop that executes no code.
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    SUPPORTS_TOOL_INTERCEPTION = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def setup(self, runtime: Runtime) -> None:
        """Nothing to provision: the program's packages are installed here."""

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
        if self.config.in_process:
            if mcp_urls:
                return ProgramResult(2, "", "in_process: true runs a plain chat; this task has MCP tools")
            return await _chat(ctx.model, endpoint, secret, system_prompt, prompt)
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
        # hands to uv).
        program = f".vf-chat-program-{trace.id}.py"
        await runtime.write(program, CHAT_PROGRAM_SOURCE.encode())
        return await runtime.run_program([sys.executable, program, *args], {**self.config.resolved_env})


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for every episode's client: building one loads the CA bundle (about 0.1 s)."""
    return ssl.create_default_context()


async def _chat(model: str, endpoint: str, secret: str, system: str | None, prompt: object) -> ProgramResult:
    """One chat call to the rollout's endpoint: the program of ``in_process: true``."""
    import httpx
    import openai

    messages: list[dict[str, object]] = [{"role": "system", "content": system}] if system else []
    if isinstance(prompt, str):
        messages.append({"role": "user", "content": prompt})
    elif prompt is not None:
        messages += [message_to_wire(m) for m in prompt]  # type: ignore[attr-defined]
    http = httpx.AsyncClient(verify=_tls(), timeout=None)  # the rollout's own timeouts bound the call
    async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, http_client=http) as client:
        try:
            reply = await client.chat.completions.create(model=model, messages=messages)  # type: ignore[arg-type]
        except openai.APIConnectionError as e:
            return ProgramResult(MODEL_TRANSPORT_ERROR_EXIT_CODE, "", str(e))
        except openai.APIStatusError as e:
            return ProgramResult(1, "", f"the model call failed: {e}")
    return ProgramResult(0, reply.choices[0].message.content or "", "")


__all__ = ["LocalChatHarness"]
