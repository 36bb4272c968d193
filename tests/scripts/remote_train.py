"""A small asynchronous RL run against remote rollout servers, for the server-kill test:
a rollout controller over the launcher's servers, prepare_batch with staleness 1,
FSDPEngine training on the sampled completions, weights pushed to the servers after every step
through disk, or with ``weight_update=distributed`` by a gloo broadcast.

Each step appends ``{"step", "n", "versions"}`` to ``output_dir/steps.jsonl``. With
``pause_after_step=K`` the trainer stops after step K (rollouts still in flight on the servers),
writes ``paused`` and waits for a ``continue`` file before going on.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field

import torch
from tensordict import TensorDict

from areal_lite.api.config import InferenceEngineConfig, TrainEngineConfig
from areal_lite.api.config_loader import load_config
from areal_lite.api.engine import InferenceEngine
from areal_lite.api.experiment_config import BaseExperimentConfig
from areal_lite.api.io import FinetuneSpec, GenerationConfig, ModelRequest, WeightUpdateMeta
from areal_lite.api.workflow import RolloutWorkflow
from areal_lite.core import RolloutController
from areal_lite.engines.remote.sglang import RemoteSGLangEngine
from areal_lite.engines.train.fsdp import FSDPEngine
from areal_lite.kit import sync_weights
from areal_lite.utils.dataloader import stateful_dataloader
from areal_lite.workflows.trajectory import from_response


@dataclass
class Config(BaseExperimentConfig):
    actor: TrainEngineConfig = field(default_factory=TrainEngineConfig)
    rollout: InferenceEngineConfig = field(default_factory=InferenceEngineConfig)
    total_steps: int = 6
    max_new_tokens: int = 6
    pause_after_step: int = -1
    weight_update: str = "disk"


class SampleWorkflow(RolloutWorkflow):
    """One completion per prompt, rewarded by nothing in particular: this run tests plumbing."""

    def __init__(self, gconfig: GenerationConfig) -> None:
        self.gconfig = gconfig

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, object]) -> TensorDict | None:
        resp = await engine.agenerate(ModelRequest(input_ids=list(data["input_ids"]), gconfig=self.gconfig))
        return from_response(resp, reward=0.0)


def likelihood_loss(
    logp: torch.Tensor, entropy: torch.Tensor, mb: dict
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    m = mb["loss_mask"].float()
    return -(logp * m).sum() / m.sum().clamp(min=1), {}


def main() -> None:
    cfg = load_config(sys.argv[1:], Config)
    prompts = [{"input_ids": [(5 * i + j) % 200 + 10 for j in range(4 + i % 3)]} for i in range(32)]
    rollout = RolloutController(RemoteSGLangEngine(cfg.rollout), cfg.rollout)
    rollout.initialize()
    actor = FSDPEngine(cfg.actor)
    actor.initialize(
        FinetuneSpec(1, cfg.total_steps * cfg.rollout.consumer_batch_size, cfg.rollout.consumer_batch_size)
    )
    if cfg.weight_update == "distributed":
        meta = WeightUpdateMeta(type="distributed", backend="gloo", master_address="127.0.0.1")
    else:
        meta = WeightUpdateMeta(type="disk", path=os.path.join(cfg.output_dir, "weights"))
    actor.connect_engine(rollout.engine, meta)
    dataloader = stateful_dataloader(prompts, cfg.rollout.consumer_batch_size, seed=cfg.seed)
    workflow = SampleWorkflow(GenerationConfig(max_new_tokens=cfg.max_new_tokens, min_new_tokens=cfg.max_new_tokens))
    with open(os.path.join(cfg.output_dir, "steps.jsonl"), "a") as log:
        for step in range(cfg.total_steps):
            batch = rollout.prepare_batch(dataloader, workflow)
            actor.train_batch(batch, likelihood_loss, lambda mb: float(mb["loss_mask"].sum()))
            actor.step_lr_scheduler()
            sync_weights(rollout, actor, meta, version=step + 1)
            versions = sorted({int(v) for v in batch["versions"].flatten().tolist() if v >= 0})
            log.write(json.dumps({"step": step, "n": batch.batch_size[0], "versions": versions}) + "\n")
            log.flush()
            if step == cfg.pause_after_step:
                open(os.path.join(cfg.output_dir, "paused"), "w").close()
                while not os.path.exists(os.path.join(cfg.output_dir, "continue")):
                    time.sleep(0.05)
    rollout.destroy()
    actor.destroy()


if __name__ == "__main__":
    main()
