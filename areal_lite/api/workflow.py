"""The workflow contract: how one rollout episode turns data into trajectories."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tensordict import TensorDict

    from areal_lite.api.engine import InferenceEngine


class RolloutWorkflow(abc.ABC):
    """One episode of interaction between a policy and a task.

    Subclasses implement `arun_episode`; they may only call ``engine.agenerate`` (never HTTP, never
    the train engine) and should send slow work (reward code, tokenization of long texts) to an
    executor so the shared event loop never blocks.
    """

    @abc.abstractmethod
    async def arun_episode(self, engine: InferenceEngine, data: dict[str, object]) -> TensorDict | None:
        """Run one episode on ``data`` (one dataset item).

        Returns a TensorDict of batch size ``[n]`` following the trajectory data contract of
        `areal_lite.api.engine` (``input_ids``, ``attention_mask``, ``loss_mask``, ``logprobs``,
        ``versions``, ``rewards``; a GRPO group has ``n`` = group size), or None to reject the
        episode (it is then neither trained on nor counted towards the batch).
        """
