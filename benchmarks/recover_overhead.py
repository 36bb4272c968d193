"""What fault tolerance costs: recover checkpoint write/read, HF checkpoint write, and the
launcher's start-up of a rollout server until it answers /health.

The recover dump (model + AdamW state via DCP, data loader, RNG) runs after every
``recover.freq_steps`` steps; compare its seconds with a training step's to pick the frequency.
One process (FSDPEngine makes its own one-rank group). Usage:
python benchmarks/recover_overhead.py [--hidden 128 --layers 4 --repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from tensordict import TensorDict

from areal_lite.api.config import RecoverConfig, SaverConfig, TrainEngineConfig
from areal_lite.api.io import FinetuneSpec
from areal_lite.engines.train.fsdp import FSDPEngine
from areal_lite.launcher.processes import is_healthy
from areal_lite.utils.dataloader import stateful_dataloader
from areal_lite.utils.distributed import find_free_port
from areal_lite.utils.recover import RecoverHandler
from areal_lite.utils.saver import Saver
from areal_lite.utils.step import StepInfo
from areal_lite.utils.tiny import build_tiny_model


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def server_startup_seconds(model: str) -> float:
    port = find_free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_lite.engines.server", "--model-path", model, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while not is_healthy(f"127.0.0.1:{port}", timeout=1.0):
            if proc.poll() is not None:
                raise RuntimeError("the server exited during start-up")
            time.sleep(0.05)
        return time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        model = build_tiny_model(
            os.path.join(work, "model"), hidden_size=args.hidden, num_layers=args.layers, num_heads=4, num_kv_heads=2
        )
        engine = FSDPEngine(TrainEngineConfig(path=model))
        engine.initialize(FinetuneSpec(1, 64, 8))
        ids = torch.randint(10, 200, (8, 32))
        batch = TensorDict(
            {
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids, dtype=torch.bool),
                "loss_mask": torch.ones_like(ids, dtype=torch.int32),
            },
            batch_size=[8],
        )
        train = lambda: engine.train_batch(batch, lambda lp, ent, mb: (-lp.mean(), {}), lambda mb: 1.0)
        train()  # optimizer state exists from here on, as in a real dump
        n_params = sum(p.numel() for p in engine.model.parameters())
        dataloader = stateful_dataloader(list(range(64)), 8)
        handler = RecoverHandler(RecoverConfig(mode="auto"), os.path.join(work, "out"))
        saver = Saver(SaverConfig(freq_steps=1), os.path.join(work, "out"))
        step = StepInfo.first(8)
        rows = [
            ("train step (8 x 32 tokens)", timed(train, args.repeats)),
            ("recover dump", timed(lambda: handler.dump(engine, step, dataloader=dataloader), args.repeats)),
            ("recover load", timed(lambda: handler.load(engine, dataloader=dataloader), args.repeats)),
            ("HF checkpoint", timed(lambda: saver.save(engine, step), args.repeats)),
            ("server start -> /health 200", timed(lambda: server_startup_seconds(model), max(1, args.repeats // 2))),
        ]
        engine.destroy()
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, {n_params / 1e6:.2f} M parameters; medians of {args.repeats}"
    )
    print(f"{'operation':32s} {'seconds':>8s}")
    for name, s in rows:
        print(f"{name:32s} {s:8.3f}")
    r = dict(rows)
    print(
        f"RESULT dump_s={r['recover dump']:.3f} load_s={r['recover load']:.3f} hf_save_s={r['HF checkpoint']:.3f} "
        f"server_start_s={r['server start -> /health 200']:.2f} dump_over_step={r['recover dump'] / r['train step (8 x 32 tokens)']:.2f}"
    )


if __name__ == "__main__":
    main()
