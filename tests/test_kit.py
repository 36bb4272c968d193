"""`RunKit.rl_step`: the quickstart's step in the order the quickstart writes it, each stage timed."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from areal_lite.api.experiment_config import RLExperimentConfig
from areal_lite.api.io import WeightUpdateMeta
from areal_lite.kit import RunKit


def test_rl_step_batches_trains_and_pushes_the_next_version_in_order(tmp_path) -> None:
    calls: list[tuple[str, object]] = []
    batch = TensorDict({"rewards": torch.ones(2)}, batch_size=[2])

    class Recorder:
        """Records every call as (``name.method``, its argument)."""

        def __init__(self, name: str) -> None:
            self.name = name

        def __getattr__(self, method: str):
            return lambda arg=None: calls.append((f"{self.name}.{method}", getattr(arg, "type", arg)))

    class Rollout(Recorder):
        def prepare_batch(self, dataloader: object, workflow: object, should_accept: object = None) -> TensorDict:
            calls.append(("rollout.prepare_batch", (workflow, should_accept)))
            return batch

    class Actor:
        def compute_advantages(self, data: TensorDict) -> None:
            calls.append(("actor.compute_advantages", data is batch))

        def ppo_update(self, data: TensorDict) -> dict[str, float]:
            calls.append(("actor.ppo_update", data is batch))
            return {"loss": 0.5}

        def step_lr_scheduler(self) -> None:
            calls.append(("actor.step_lr_scheduler", None))

    cfg = RLExperimentConfig()
    cfg.cluster.fileroot = str(tmp_path)
    cfg.stats_logger.wandb_mode = "disabled"
    cfg.total_train_steps = 3
    meta = WeightUpdateMeta(type="disk", path=str(tmp_path / "w"))
    run = RunKit(cfg, Recorder("engine"), [[{}]], rollout=Rollout("rollout"), weight_meta=meta)  # type: ignore[arg-type]
    accept = object()
    got, stats = run.rl_step(Actor(), "workflow", 4, should_accept=accept)  # type: ignore[arg-type]
    assert got is batch and stats == {"loss": 0.5}
    assert calls == [
        ("rollout.prepare_batch", ("workflow", accept)),
        ("actor.compute_advantages", True),
        ("actor.ppo_update", True),
        ("actor.step_lr_scheduler", None),
        ("rollout.pause", None),
        ("engine.set_version", 5),
        ("engine.update_weights", "disk"),
        ("rollout.set_version", 5),
        ("rollout.resume", None),
    ]
    timings = run.tracker.export().scalars
    assert {"timing/rollout", "timing/train", "timing/weight_sync"} <= set(timings), timings

    without = RunKit(cfg, Recorder("engine"), [[{}]])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rollout controller"):
        without.rl_step(Actor(), "workflow", 0)  # type: ignore[arg-type]
