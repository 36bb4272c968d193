"""The rollout side of a training script, as the launcher set it up.

With ``launcher.backend=local`` the script generates in its own process (`LocalInferenceEngine`,
weights copied in place); with ``areal`` or ``sglang`` the launcher started servers and passed
their addresses in ``rollout.addresses``, and the script talks to them with `RemoteSGLangEngine`,
pushing weights through the disk or over a process group (``weight_update``: disk or distributed).
"""

from __future__ import annotations

import os
from dataclasses import replace

from areal_lite.api.config import InferenceEngineConfig, LocalEngineConfig
from areal_lite.api.engine import InferenceEngine
from areal_lite.api.io import WeightUpdateMeta
from areal_lite.api.workflow import RolloutWorkflow


def make_rollout(
    backend: str,
    rollout: InferenceEngineConfig,
    local_engine: LocalEngineConfig,
    model_dir: str,
    weight_update: str,
    output_dir: str,
) -> tuple[InferenceEngine, WeightUpdateMeta]:
    """An initialised inference engine for ``backend`` and the `WeightUpdateMeta` that reaches it."""
    if backend == "local":
        from areal_lite.engines.local import LocalInferenceEngine

        engine: InferenceEngine = LocalInferenceEngine(replace(local_engine, path=model_dir), rollout)
        meta = WeightUpdateMeta(type="in_process")
    else:
        from areal_lite.engines.remote import RemoteSGLangEngine

        engine = RemoteSGLangEngine(rollout)
        if weight_update == "distributed":
            from areal_lite.utils.distributed import find_free_port

            meta = WeightUpdateMeta(
                type="distributed", master_port=find_free_port(), world_size=1 + len(rollout.addresses)
            )
        elif weight_update == "disk":
            meta = WeightUpdateMeta(type="disk", path=os.path.join(output_dir, "weight_update"))
        else:
            raise ValueError(f"weight_update must be disk or distributed for remote servers, got {weight_update!r}")
    engine.initialize()
    return engine, meta


def mean_reward(rollout: InferenceEngine, workflow: RolloutWorkflow, items: list[dict[str, object]]) -> float:
    """Mean reward of ``workflow`` over ``items``, run now outside the staleness accounting: with a
    greedy workflow and a verifier, the held-out accuracy."""
    return float(rollout.rollout_batch(items, workflow)["rewards"].float().mean())
