"""Train-engine throughput on CPU: MegatronEngine against FSDPEngine, one process, same model and data.

Times `forward` (log-probabilities without gradient) and `train_batch` (one optimizer step) on a
quickstart-sized tiny Qwen2 and a GRPO-like batch of short sequences: both engines live in one
process and are called in turn, and each figure is the best of ``--repeats`` after a warm-up.
MegatronEngine runs padded micro-batches (FSDPEngine packs them into one row with per-sequence
attention) and, on CPU, pays for the torch-function mode of `mcore_cpu`.
Usage: python benchmarks/megatron_vs_fsdp.py [--hidden 128 --layers 4 --batch 256 --repeats 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from functools import partial

import torch
from tensordict import TensorDict

from areal_lite.api.config import OptimizerConfig, TrainEngineConfig
from areal_lite.api.engine import PackedBatch
from areal_lite.api.io import FinetuneSpec, MicroBatchSpec
from areal_lite.kit import make_train_engine
from areal_lite.utils.tiny import build_tiny_model


def make_batch(n: int, prompt: int, completion: int) -> TensorDict:
    g = torch.Generator().manual_seed(0)
    lens = prompt + torch.randint(1, completion + 1, (n,), generator=g)
    length = prompt + completion
    ar = torch.arange(length).unsqueeze(0)
    am = ar < lens.unsqueeze(1)
    ids = torch.randint(1, 250, (n, length), generator=g) * am
    loss_mask = (ar >= prompt) & am
    return TensorDict({"input_ids": ids, "attention_mask": am, "loss_mask": loss_mask.int()}, batch_size=[n])


def nll(out: torch.Tensor, ent: torch.Tensor, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    m = mb["loss_mask"].float()  # type: ignore[union-attr]
    return -(out * m).sum() / m.sum(), {}


def n_tokens(mb: PackedBatch) -> float:
    return float(mb["loss_mask"].sum())  # type: ignore[union-attr]


def best_time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=256, help="sequences per batch")
    parser.add_argument("--prompt", type=int, default=7, help="prompt tokens per sequence")
    parser.add_argument("--completion", type=int, default=6, help="max completion tokens per sequence")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_tiny_model(
        tempfile.mkdtemp(), hidden_size=args.hidden, num_layers=args.layers, num_heads=4, num_kv_heads=2
    )
    batch = make_batch(args.batch, args.prompt, args.completion)
    tokens = int(batch["attention_mask"].sum())
    engines = {}
    for backend in ("fsdp", "megatron"):  # FSDP first: it creates the process group both use
        cfg = TrainEngineConfig(
            path=model, backend=backend, optimizer=OptimizerConfig(lr=1e-4), mb_spec=MicroBatchSpec(n_mbs=2)
        )
        engines[backend] = make_train_engine(cfg)
        engines[backend].initialize(FinetuneSpec(1, 10 * args.batch, args.batch))
    # Interleaved, best of `repeats` after a warm-up call: the machine is shared, the minimum is
    # the least disturbed measurement of each.
    times: dict[str, list[list[float]]] = {b: [[], []] for b in engines}
    for _ in range(args.repeats + 1):
        for backend, engine in engines.items():
            times[backend][0].append(best_time(partial(engine.forward, batch)))
            times[backend][1].append(best_time(partial(engine.train_batch, batch, nll, n_tokens)))
    rows = [(b, min(t[0][1:]), min(t[1][1:])) for b, t in times.items()]
    engines["megatron"].destroy()
    engines["fsdp"].destroy()
    print(f"{args.batch} sequences, {tokens} tokens, hidden {args.hidden}, {args.layers} layers, 1 thread")
    print(f"{'backend':10s} {'forward s':>10s} {'train s':>10s} {'train tok/s':>12s}")
    for backend, fwd, train in rows:
        print(f"{backend:10s} {fwd:10.3f} {train:10.3f} {tokens / train:12.0f}")
    (_, ff, ft), (_, mf, mt) = rows
    print(
        f"RESULT fsdp_train_s={ft:.3f} megatron_train_s={mt:.3f} megatron_over_fsdp_train={mt / ft:.2f} megatron_over_fsdp_forward={mf / ff:.2f}"
    )


if __name__ == "__main__":
    main()
