"""Workflows for the episode-process tests: module-level classes, so that the worker process
unpickles them by reference."""

from __future__ import annotations

import threading

from tensordict import TensorDict

from areal_lite.api.engine import InferenceEngine
from areal_lite.api.io import GenerationConfig, ModelRequest
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
