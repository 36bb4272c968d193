"""verifiers environments as a source of training: `VerifiersWorkflow` runs the episodes of any
verifiers ``Env`` (its v1 API: ``Taskset``, ``Task`` with ``@vf.reward``, ``Harness``, ``Env``)
on the rollout engine and returns them in the data contract of `areal_lite.api.engine`.

One episode: a `RecordingProxy` (``openai_proxy.py``) is put in front of the engine and served
over HTTP (`ProxyServer`: the harness is a program in another process), the env runs the task with
a model context whose endpoint is that proxy (verifiers' ``EvalClient`` relays the harness's own
requests to it, chat completions or Responses), and the task's rubric scores the episode. Every
model call the harness made is in the proxy's trajectories, token in, token out, with the
log-probabilities and versions of the engine; the reward is the episode's (the mean over its
traces of their weighted rubric scores).

Groups. ``gconfig.n_samples`` episodes run per task. As an episode may yield several trajectories
(several agents, or a history its chat template rewrites), each trajectory carries
``baseline_rewards``, the mean reward of its group's episodes, as in `AgentWorkflow`: the actor's
``remax`` estimator then gives every trajectory of an episode the group-relative advantage.

An episode the env could not finish (its harness failed, a timeout) is dropped from its group and
logged; a group left with no episode is rejected (None). A generation that failed in the engine
fails the workflow. verifiers is an optional dependency (``pip install areal-lite[verifiers]``,
in an environment of its own: docs/rollout.md says why).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from areal_lite.api.engine import InferenceEngine
from areal_lite.api.io import GenerationConfig
from areal_lite.workflows.agent import Episode, ProxiedWorkflow, group_batch
from areal_lite.workflows.proxy_server import ProxyServer

if TYPE_CHECKING:
    import verifiers.v1 as vf
    from tensordict import TensorDict

logger = logging.getLogger(__name__)

API_KEY_VAR = "AREAL_LITE_PROXY_KEY"
"""The environment variable verifiers reads the proxy's API key from (the proxy needs none)."""


def local_agent(in_process: bool = False, **agent: object) -> vf.AgentConfig:
    """A verifiers agent that runs here: ``areal_lite_harness.LocalChatHarness`` (verifiers' chat
    loop, nothing to download; ``in_process``: a plain chat from this process, no program start
    per episode) in the ``subprocess`` runtime; ``agent`` sets other `vf.AgentConfig` fields."""
    import verifiers.v1 as vf

    harness = {"id": "areal_lite_harness", "in_process": in_process}
    return vf.AgentConfig(harness=harness, runtime=vf.SubprocessConfig(), **agent)  # type: ignore[arg-type]


class VerifiersWorkflow(ProxiedWorkflow):
    """``gconfig.n_samples`` episodes of a verifiers env per task.

    A dataset item is ``{"task": task}``, a `vf.Task` of the env's taskset (`task_items`).

    Args:
        env: the verifiers environment (e.g. a ``vf.SingleAgentEnv`` whose agent is `local_agent`).
        gconfig: sampling of each model call (``max_new_tokens`` per call); ``n_samples`` is the
            number of episodes per task.
        tokenizer: the policy's HF tokenizer with a chat template.
        max_calls: model calls per episode; later calls are refused and the episode ends.
        max_context_tokens: a call is refused once the conversation leaves no room below this.
        template_kwargs: passed to the chat template (e.g. ``enable_thinking=False``).
    """

    def __init__(
        self,
        env: vf.Env,
        gconfig: GenerationConfig,
        tokenizer: object,
        *,
        max_calls: int = 16,
        max_context_tokens: int | None = None,
        **template_kwargs: object,
    ) -> None:
        super().__init__(gconfig, tokenizer, max_calls, max_context_tokens, template_kwargs)
        self.env = env

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, object]) -> TensorDict | None:
        server = ProxyServer()
        await server.start()
        try:
            async with self.env.serving():
                runs = [self.run_one(engine, server, data["task"]) for _ in range(self.n_episodes)]  # type: ignore[arg-type]
                episodes = [e for e in await asyncio.gather(*runs) if e is not None]
        finally:
            await server.stop()
        return group_batch(episodes) if episodes else None

    async def run_one(self, engine: InferenceEngine, server: ProxyServer, task: vf.Task) -> Episode | None:
        """One episode of ``task``, its model calls recorded; None when the env could not finish it."""
        import verifiers.v1 as vf

        proxy = self.new_proxy(engine)
        key, _ = server.register(proxy)
        try:
            # One endpoint for every episode, the episode named by the model: verifiers keeps one
            # HTTP client per endpoint config (building one costs ~0.06 s of CPU).
            client = vf.EvalClientConfig(base_url=server.base_url, api_key_var=API_KEY_VAR)
            episode = await self.env.run_episode(task, vf.ModelContext(model=key, client=client))
        finally:
            server.unregister(key)
        if proxy.error is not None:
            raise RuntimeError("a model call of the verifiers episode failed") from proxy.error
        if episode.errors or not episode.traces:
            first = episode.errors[0] if episode.errors else None
            logger.warning("verifiers episode of task %s failed: %s", task.data.idx, first and first.message)
            return None
        if proxy.exhausted is None and any(t.errors for t in episode.traces):
            logger.warning("verifiers episode of task %s: %s", task.data.idx, episode.traces[0].errors[0].message)
            return None
        reward = sum(t.reward for t in episode.traces) / len(episode.traces)
        return Episode(proxy.traces, reward, len(proxy.calls))


def task_items(taskset: vf.Taskset) -> list[dict[str, object]]:
    """The dataset items of a taskset (or a view of one, e.g. ``taskset.take(64)``) for
    `VerifiersWorkflow`: ``{"task": task}`` each."""
    return [{"task": task} for task in taskset]
