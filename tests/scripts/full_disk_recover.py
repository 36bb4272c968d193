"""Recover checkpoints of a real `FSDPEngine` on small file systems, for tests/test_checkpoints.py,
which runs this in a mount namespace of its own with tmpfs mounts at the directories it names.

Usage: ``full_disk_recover.py MODEL SMALL MEDIUM``. One training step (so that Adam's state is in
the checkpoint), then a recover checkpoint into ``SMALL`` (smaller than one copy: the write fails
inside torch.distributed.checkpoint) and two into ``MEDIUM`` (one copy fits, two do not). Each
`CheckpointWriteError` is printed as ``ERROR <message>``; the last one is raised, uncaught, so
that the launchers' stop file (``AREAL_LITE_STOP_FILE``) gets its line.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from recover_train import make_item, n_trained_tokens, sft_loss, to_batch

from areal_lite.api.config import OptimizerConfig, RecoverConfig, TrainEngineConfig
from areal_lite.api.io import FinetuneSpec
from areal_lite.engines.train.fsdp import FSDPEngine
from areal_lite.utils.recover import RecoverHandler
from areal_lite.utils.saver import CheckpointWriteError
from areal_lite.utils.step import StepInfo


def main() -> None:
    model, small, medium = sys.argv[1:4]
    engine = FSDPEngine(TrainEngineConfig(path=model, optimizer=OptimizerConfig(lr=1e-3)))
    engine.initialize(FinetuneSpec(1, 4, 2))
    engine.train_batch(to_batch([make_item(i, 256) for i in range(2)]), sft_loss, n_trained_tokens)
    step = StepInfo.first(2)
    last: CheckpointWriteError | None = None
    for root, dumps in ((small, 1), (medium, 2)):
        handler = RecoverHandler(RecoverConfig(mode="auto", freq_steps=1), root)
        for _ in range(dumps):
            try:
                handler.dump(engine, step)
                print("WROTE", sorted(os.listdir(os.path.join(root, "recover"))), flush=True)
            except CheckpointWriteError as e:
                print("ERROR", e, flush=True)
                last = e
            step = step.next()
    if last is not None:
        raise last


if __name__ == "__main__":
    main()
