"""How much work on the other core slows the embedded engine's generation, and the other way round.

In the asynchronous GRPO loop on two cores the engine generates on one thread while the trainer
trains on the other. If the two slowed each other (shared caches, memory bandwidth, the
interpreter lock in one process), overlapping them would gain less than the sum of their
one-thread times promises. This measures it directly: the engine (20M Qwen2 of
`grpo_vs_trl.py`, one thread, pinned to the first core) generates batches of ``--rows`` requests x
``--tokens`` tokens for ``--seconds`` while the other core runs, in turn:

- ``alone``: nothing;
- ``small matmul``: a 64 x 256 x 256 product in a loop (another process, its data in cache);
- ``large matmul``: a 2112 x 384 x 1152 product in a loop (another process; a linear of the
  trainer's update);
- ``memory copy``: copies of 256 MiB in a loop (another process; DRAM bandwidth);
- ``training thread``: the HF model's forward and backward over 4 x 528 tokens in a loop, in a
  thread of the engine's own process (the interpreter lock shared), as the trainer runs beside an
  in-process engine,

with a row ``alone`` before and after each (this machine's speed drifts by tens of percent over
minutes). Each loaded row gives the median seconds per batch, its ratio to the mean of the two
``alone`` rows around it and the other side's rate (loops per second; for the training thread,
against the same loop alone in its own process). The last line is ``RESULT worst_slowdown=...
...`` with ``alone_spread``, the slowest ``alone`` row over the fastest.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/generation_beside.py [--seconds 15] [--rows 32] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import torch
from grpo_vs_trl import MODEL  # the 20M model of the GRPO benchmark

TRAIN_SHAPE = (4, 528)
"""Sequences x tokens of the training loop: the 20M benchmark's update (2112 tokens)."""
LOADS = ("small matmul", "large matmul", "memory copy")


def load_loop(kind: str, seconds: float) -> float:
    """Loops per second of ``kind`` on one thread for ``seconds``."""
    torch.set_num_threads(1)
    if kind == "small matmul":
        a, b = torch.randn(64, 256), torch.randn(256, 256)

        def body() -> None:
            for _ in range(200):
                a @ b
    elif kind == "large matmul":
        a, b = torch.randn(2112, 384), torch.randn(384, 1152)

        def body() -> None:
            a @ b
    elif kind == "memory copy":
        src = torch.randn(64 * 2**20)
        dst = torch.empty_like(src)

        def body() -> None:
            dst.copy_(src)
    else:
        raise ValueError(f"unknown load {kind!r}")
    return _rate(body, seconds)


def _rate(body: Callable[[], None], seconds: float, stop: threading.Event | None = None) -> float:
    """Calls of ``body`` per second, for ``seconds`` or until ``stop`` is set."""
    n, t0 = 0, time.perf_counter()
    end = t0 + seconds
    while time.perf_counter() < end and not (stop and stop.is_set()):
        body()
        n += 1
    return n / (time.perf_counter() - t0)


def training_loop(path: str) -> Callable[[], None]:
    """One forward and backward of the HF model over `TRAIN_SHAPE` tokens (the caller's thread)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.randint(3, model.config.vocab_size, TRAIN_SHAPE, generator=torch.Generator().manual_seed(0))

    def body() -> None:
        model(input_ids=ids).logits.logsumexp(-1).mean().backward()

    return body


def pin(core: int) -> None:
    if hasattr(os, "sched_setaffinity") and core < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {core})


class Generator:
    """The embedded engine on one thread, generating batches of random prompts."""

    def __init__(self, path: str, rows: int, tokens: int) -> None:
        from areal_lite.api.config import LocalEngineConfig
        from areal_lite.engines.local.engine import LocalInferenceEngine

        self.engine = LocalInferenceEngine(
            LocalEngineConfig(path=path, dtype="float32", num_threads=1, max_running_requests=rows)
        )
        self.engine.initialize()
        assert self.engine.model is not None
        vocab = self.engine.model.config.vocab_size
        rng = random.Random(0)
        self.requests = [([rng.randrange(3, vocab) for _ in range(rng.randint(12, 20))], tokens) for _ in range(rows)]

    def batch(self) -> float:
        from areal_lite.engines.local.request import SamplingParams

        async def run() -> None:
            await asyncio.gather(
                *[
                    self.engine.scheduler.generate(p, SamplingParams(max_new_tokens=m, ignore_eos=True))
                    for p, m in self.requests
                ]
            )

        t0 = time.perf_counter()
        asyncio.run(run())
        return time.perf_counter() - t0

    def median(self, seconds: float) -> float:
        self.batch()  # warm
        times, end = [], time.perf_counter() + seconds
        while time.perf_counter() < end or len(times) < 3:
            times.append(self.batch())
        return statistics.median(times)


def worker_rate(proc: subprocess.Popen[str], kind: str) -> float:
    """The loops per second a worker process printed."""
    out, _ = proc.communicate(timeout=300)
    if proc.returncode != 0 or "WORKER " not in out:
        raise RuntimeError(f"the {kind} worker failed (exit {proc.returncode}); its output:\n{out[-2000:]}")
    return float(json.loads(out.split("WORKER ", 1)[1])["rate"])


def other_core_process(kind: str, seconds: float, model: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--seconds", str(seconds), "--model-dir", model]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def worker(args: argparse.Namespace) -> None:
    pin(1)
    if args.worker == "training":
        torch.set_num_threads(1)
        rate = _rate(training_loop(args.model_dir), args.seconds)
    else:
        rate = load_loop(args.worker, args.seconds)
    print("WORKER " + json.dumps({"rate": rate}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="generation time per row")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    from areal_lite.cpu.precision import cpu_kind
    from areal_lite.utils.tiny import build_tiny_model

    if (os.cpu_count() or 1) < 2:
        sys.exit("needs two cores")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(f"{tmp}/model", **MODEL)
        pin(0)
        gen = Generator(path, args.rows, args.tokens)
        for _ in range(3):  # the first batches grow the heap
            gen.batch()
        alone = [gen.median(args.seconds)]
        loaded: list[tuple[str, float, str]] = []
        try:
            for kind in LOADS:
                # The load runs past the generation's window, so it is never measured alone.
                proc = other_core_process(kind, args.seconds + 15.0, path)
                time.sleep(3.0)
                t = gen.median(args.seconds)
                loaded.append((kind, t, f"{worker_rate(proc, kind):.1f} loops/s"))
                alone.append(gen.median(args.seconds))
            alone_rate = worker_rate(other_core_process("training", args.seconds, path), "training")
            stop, rates = threading.Event(), []

            def train() -> None:
                pin(1)
                torch.set_num_threads(1)
                rates.append(_rate(training_loop(path), 1e9, stop))

            thread = threading.Thread(target=train, name="training", daemon=True)
            thread.start()
            time.sleep(5.0)
            t = gen.median(args.seconds)
            stop.set()
            thread.join(timeout=120)
            loaded.append(("training thread", t, f"{rates[0]:.3f} it/s (alone {alone_rate:.3f})"))
            alone.append(gen.median(args.seconds))
        finally:
            gen.engine.destroy()
    print(f"CPU: {cpu_kind()}; load {os.getloadavg()[0]:.1f}")
    print(f"20M Qwen2, float32, {args.rows} requests x {args.tokens} tokens per batch, engine on core 0, one thread")
    print("Each loaded row is measured between two rows alone; its ratio is over their mean.")
    print(f"{'beside it on core 1':22s} {'s/batch':>8s} {'x alone':>8s}  the other side")
    slow = {}
    for i, (name, t, other) in enumerate(loaded):
        print(f"{'alone':22s} {alone[i]:8.3f}")
        slow[name] = t / statistics.mean(alone[i : i + 2])
        print(f"{name:22s} {t:8.3f} {slow[name]:8.2f}  {other}")
    print(f"{'alone':22s} {alone[-1]:8.3f}")
    keys = {"small matmul": "small", "large matmul": "large", "memory copy": "copy", "training thread": "training"}
    fields = " ".join(f"{keys[k]}={v:.2f}" for k, v in slow.items())
    print(f"RESULT worst_slowdown={max(slow.values()):.2f} {fields} alone_spread={max(alone) / min(alone):.2f}")


if __name__ == "__main__":
    main()
