"""Workflows for the episode-process tests: module-level classes, so that the worker process
unpickles them by reference."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from tensordict import TensorDict

from areal_lite.api.engine import InferenceEngine
from areal_lite.api.io import GenerationConfig, ModelRequest, ModelResponse
from areal_lite.api.workflow import RolloutWorkflow
from areal_lite.workflows.trajectory import from_responses


class Continue(RolloutWorkflow):
    """Continue ``data["prompt"]`` (token ids) greedily; the reward is the first token generated."""

    def __init__(self, max_new_tokens: int) -> None:
        self.gconfig = GenerationConfig(max_new_tokens=max_new_tokens, greedy=True, ignore_eos=True)

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, object]) -> TensorDict | None:
        if data.get("fail"):
            raise ValueError(f"bad item {data['prompt']}")
        resp = await engine.agenerate(ModelRequest(input_ids=list(data["prompt"]), gconfig=self.gconfig))  # type: ignore[call-overload]
        return from_responses([resp], [float(resp.output_tokens[0])])


class HoldsALock(Continue):
    """Does not pickle."""

    def __init__(self, max_new_tokens: int) -> None:
        super().__init__(max_new_tokens)
        self.lock = threading.Lock()


class SignalsProgress(RolloutWorkflow):
    """Continue ``data["prompt"]`` greedily in two calls: ``first`` tokens, then (after creating
    the file ``data["marker"]``) ``rest`` more from prompt + those; one response of both. A test
    that waits for the markers knows every episode has tokens of the version then current."""

    def __init__(self, first: int, rest: int) -> None:
        self.first, self.rest = first, rest

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, object]) -> TensorDict | None:
        prompt = list(data["prompt"])  # type: ignore[call-overload]
        head = await engine.agenerate(ModelRequest(input_ids=prompt, gconfig=_greedy(self.first)))
        Path(str(data["marker"])).touch()
        tail = await engine.agenerate(ModelRequest(input_ids=prompt + head.output_tokens, gconfig=_greedy(self.rest)))
        both = ModelResponse(
            input_tokens=prompt,
            output_tokens=head.output_tokens + tail.output_tokens,
            output_logprobs=head.output_logprobs + tail.output_logprobs,
            output_versions=head.output_versions + tail.output_versions,
            stop_reason=tail.stop_reason,
        )
        return from_responses([both], [0.0])


def _greedy(n: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=n, greedy=True, ignore_eos=True)


def all_exist(paths: list[str]) -> bool:
    return all(os.path.exists(p) for p in paths)
