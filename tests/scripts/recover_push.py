"""One process: train two steps and dump a recover checkpoint; then a fresh FSDPEngine and an
embedded inference engine at the initial weights resume from it through `RunKit.resume`. Checks that
the recovered weights reach the inference engine and that both engines and the rollout controller
take the recovered policy version. Exits 0 when
all checks pass (argv[1]: a working directory with a tiny model in ``model``)."""

from __future__ import annotations

import os
import sys

import torch
from tensordict import TensorDict

from areal_lite.api.config import InferenceEngineConfig, LocalEngineConfig, RecoverConfig, TrainEngineConfig
from areal_lite.api.experiment_config import BaseExperimentConfig, ClusterConfig
from areal_lite.api.io import FinetuneSpec, WeightUpdateMeta
from areal_lite.core import RolloutController
from areal_lite.engines.local.engine import LocalInferenceEngine
from areal_lite.engines.train.fsdp import FSDPEngine
from areal_lite.kit import RunKit
from areal_lite.utils.recover import RecoverHandler
from areal_lite.utils.step import StepInfo

work = sys.argv[1]
model_dir = os.path.join(work, "model")
ids = torch.randint(10, 200, (4, 12), generator=torch.Generator().manual_seed(0))
batch = TensorDict(
    {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids, dtype=torch.bool),
        "loss_mask": torch.ones_like(ids, dtype=torch.int32),
    },
    batch_size=[4],
)


def loss_fn(logp, entropy, mb):
    return -logp.mean(), {}


def trained_weights(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine._full_state_dict().items()}


ft = FinetuneSpec(total_train_epochs=1, dataset_size=16, train_batch_size=4)
cfg = TrainEngineConfig(path=model_dir)
cfg.optimizer.lr = 1e-2
first = FSDPEngine(cfg)
first.initialize(ft)
for _ in range(2):
    first.train_batch(batch, loss_fn, lambda mb: 1.0)
    first.step_lr_scheduler()
first.set_version(2)
handler = RecoverHandler(RecoverConfig(mode="auto"), os.path.join(work, "out"))
assert handler.dump(first, StepInfo.at(1, 4))
expected = trained_weights(first)
first.destroy()

rollout = RolloutController(LocalInferenceEngine(LocalEngineConfig(path=model_dir)), InferenceEngineConfig())
rollout.initialize()
initial = {k: v.clone() for k, v in rollout.engine.model.state_dict().items()}
resumed = FSDPEngine(cfg)
meta = WeightUpdateMeta(type="in_process")
run_cfg = BaseExperimentConfig(cluster=ClusterConfig(fileroot=work), experiment_name="", trial_name="out")
run_cfg.recover.mode = "auto"
run_cfg.stats_logger.console = False
run_cfg.stats_logger.tensorboard = False
run_cfg.stats_logger.wandb_mode = "disabled"
run = RunKit(run_cfg, resumed, [[{}]] * 4, rollout=rollout, weight_meta=meta)  # type: ignore[arg-type]
resumed.initialize(ft)
resumed.connect_engine(rollout.engine, meta)
extra = run.resume()
assert extra is not None and run.start_step == 2, (extra, run.start_step)
assert resumed.get_version() == 2 and rollout.get_version() == 2 and rollout.executor._version == 2
served = rollout.engine.model.state_dict()
changed = [k for k in expected if not torch.equal(initial[k], expected[k])]
assert changed, "training changed no weight"
for k, v in expected.items():
    assert torch.equal(served[k], v), f"{k}: the inference engine does not serve the recovered weights"
rollout.destroy()
resumed.destroy()
print("OK", len(changed), "tensors recovered into the inference engine")
