"""A one-process FSDPEngine trainer whose weights do not fit the servers' model, so that its weight
update fails on every server: how long the trainer takes to learn it, and what it is told.

Usage: ``python failing_update_trainer.py MODEL_DIR ADDR[,ADDR...] WORKDIR disk|distributed``

It connects to vLLM servers (``distributed``: forms the weight-update group, 64 KiB chunks), then
calls ``update_weights`` once; rank 0 writes ``WORKDIR/failed.json`` with the seconds from the
call to the error and the error's text, and lets the error end the process (exit code 1).
"""

from __future__ import annotations

import json
import os
import sys
import time

from areal_lite.api.config import InferenceEngineConfig, TrainEngineConfig
from areal_lite.api.io import FinetuneSpec, WeightUpdateMeta
from areal_lite.engines.remote.vllm import RemoteVLLMEngine
from areal_lite.engines.train.fsdp import FSDPEngine

MODEL, ADDRESSES, WORKDIR, MODE = sys.argv[1], sys.argv[2].split(","), sys.argv[3], sys.argv[4]


def main() -> None:
    rollout = RemoteVLLMEngine(InferenceEngineConfig(addresses=ADDRESSES, request_timeout=120, setup_timeout=120))
    rollout.initialize()
    engine = FSDPEngine(TrainEngineConfig(path=MODEL))
    engine.initialize(FinetuneSpec(total_train_epochs=1, dataset_size=4, train_batch_size=4))
    if MODE == "disk":
        meta = WeightUpdateMeta(type="disk", path=os.path.join(WORKDIR, "weights"))
    else:
        meta = WeightUpdateMeta(type="distributed", backend="gloo", chunk_bytes=64 * 1024)
    engine.connect_engine(rollout, meta)
    engine.set_version(1)
    t0 = time.monotonic()
    try:
        engine.update_weights(meta)
    except Exception as e:
        with open(os.path.join(WORKDIR, "failed.json"), "w") as f:
            json.dump({"seconds": time.monotonic() - t0, "error": str(e)}, f)
        raise


if __name__ == "__main__":
    main()
