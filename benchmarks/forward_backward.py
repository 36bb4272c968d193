"""What a Tinker ``forward_backward`` costs: the gradient and the per-token log-probabilities from
one forward and one backward pass (`TrainEngine.forward_backward_logprobs`), against the gradient
alone and against the two-pass path (``forward`` for the log-probabilities, then
``forward_backward`` for the gradient, as a service built on ``logprobs_per_token`` then
``train_tangents`` would run it).

On one engine training a LoRA adapter (rank 16 on every attention, MLP and output layer, what the
service runs for ``create_lora_training_client(rank=16)``) and one batch, the variants alternate ``--repeats`` times after a warm-up; the
table shows the median seconds, the model calls (a forward hook on the engine's root module: one
per micro-batch and forward pass) and each variant's time over the gradient alone. With
``--service`` the same batch also goes through the service (``python -m areal_lite.service``, the
same LoRA run) with the ``tinker`` SDK, timed from the client: a ``forward_backward`` round trip, and
``forward`` then ``forward_backward`` for comparison.

Usage: python benchmarks/forward_backward.py [--rows 16] [--length 128] [--repeats 7] [--service]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from tensordict import TensorDict

from areal_lite.api.config import LoRAConfig, OptimizerConfig, TrainEngineConfig
from areal_lite.api.engine import PackedBatch
from areal_lite.api.io import MicroBatchSpec
from areal_lite.cpu.precision import cpu_kind
from areal_lite.engines.train.multi_lora import MultiLoRAEngine
from areal_lite.utils.tiny import build_tiny_model

TARGETS_ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def make_batch(rows: int, length: int, vocab: int, seed: int = 0) -> TensorDict:
    """``rows`` sequences of 3/4 to all of ``length`` tokens, the first quarter of each a prompt."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3 * length // 4, length + 1, (rows,), generator=g)
    ar = torch.arange(length)[None]
    attn = ar < lens[:, None]
    ids = torch.randint(3, vocab, (rows, length), generator=g) * attn
    loss_mask = (ar >= (lens // 4)[:, None]) & attn
    return TensorDict({"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask.int()}, batch_size=[rows])


def nll(logp: torch.Tensor, entropy: torch.Tensor, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return -(logp * mb["loss_mask"]).sum(), {}  # type: ignore[operator]


def n_tokens(mb: PackedBatch) -> float:
    return float(mb["loss_mask"].sum())  # type: ignore[union-attr]


def engine_rows(args: argparse.Namespace, path: str, batch: TensorDict) -> dict[str, tuple[list[float], int]]:
    cfg = TrainEngineConfig(
        path=path, optimizer=OptimizerConfig(lr=0.0), mb_spec=MicroBatchSpec(max_tokens_per_mb=args.mb_tokens)
    )
    # The service's LoRA run: an adapter of rank 16 on every attention, MLP and output layer.
    engine = MultiLoRAEngine(cfg)
    engine.initialize()
    engine.add_adapter("bench", LoRAConfig(rank=16, alpha=32.0, target_modules=[*TARGETS_ALL]))
    calls: list[int] = []
    engine.model.register_forward_pre_hook(lambda *_: calls.append(1))

    variants = {
        "gradient alone: forward_backward": lambda: engine.forward_backward(batch, nll, n_tokens),
        "one pass: forward_backward_logprobs": lambda: engine.forward_backward_logprobs(batch, nll, n_tokens),
        "two passes: forward, then forward_backward": lambda: (
            engine.forward(batch),
            engine.forward_backward(batch, nll, n_tokens),
        ),
        "forward alone": lambda: engine.forward(batch),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    counts: dict[str, int] = {}
    for r in range(args.repeats + 1):  # the first round warms up
        for name, fn in variants.items():
            calls.clear()
            t0 = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - t0
            engine.optim_step()  # lr 0: drops the gradient, keeps the weights
            counts[name] = len(calls)
            if r:
                times[name].append(elapsed)
    engine.destroy()
    return {k: (times[k], counts[k]) for k in variants}


def service_rows(args: argparse.Namespace, path: str, batch: TensorDict) -> dict[str, list[float]]:
    import tinker
    from tinker import types

    from areal_lite.service.launch import local_service

    data = []
    for ids, attn in zip(batch["input_ids"], batch["attention_mask"]):
        tokens = ids[attn].tolist()
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
            )
        )
    times: dict[str, list[float]] = {"tinker forward_backward": [], "tinker forward, then forward_backward": []}
    with (
        tempfile.TemporaryDirectory() as workdir,
        local_service([path], workdir, "--max-tokens-per-mb", str(args.mb_tokens)) as url,
    ):
        client = tinker.ServiceClient(base_url=url, api_key="tml-bench")
        tc = client.create_lora_training_client(base_model=path, rank=16).result()
        zero = types.AdamParams(learning_rate=0.0)
        for r in range(args.repeats + 1):
            t0 = time.perf_counter()
            tc.forward_backward(data, "cross_entropy").result()
            one = time.perf_counter() - t0
            tc.optim_step(zero).result()
            t0 = time.perf_counter()
            tc.forward(data, "cross_entropy").result()
            tc.forward_backward(data, "cross_entropy").result()
            two = time.perf_counter() - t0
            tc.optim_step(zero).result()
            if r:
                times["tinker forward_backward"].append(one)
                times["tinker forward, then forward_backward"].append(two)
        client.close("success").result()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--mb-tokens", type=int, default=1024, help="micro-batch token budget")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--service", action="store_true", help="also time the same batch through the service")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(
            os.path.join(tmp, "m"), hidden_size=args.hidden, num_layers=args.layers, num_heads=4, num_kv_heads=4
        )
        from transformers import AutoConfig

        batch = make_batch(args.rows, args.length, vocab=AutoConfig.from_pretrained(path).vocab_size)
        rows = engine_rows(args, path, batch)
        served = service_rows(args, path, batch) if args.service else {}

    tokens = int(batch["attention_mask"].sum())
    print(f"cpu: {cpu_kind()}; torch threads {torch.get_num_threads()}")
    print(
        f"{args.rows} rows, {tokens} tokens, model hidden {args.hidden} x {args.layers} layers, {args.repeats} rounds"
    )
    base = statistics.median(rows["gradient alone: forward_backward"][0])
    print(f"{'variant':<46}{'model calls':>12}{'median s':>10}{'min s':>9}{'x gradient alone':>18}")
    for name, (t, count) in rows.items():
        m = statistics.median(t)
        print(f"{name:<46}{count:>12}{m:>10.3f}{min(t):>9.3f}{m / base:>18.2f}")
    for name, t in served.items():
        m = statistics.median(t)
        print(f"{name:<46}{'':>12}{m:>10.3f}{min(t):>9.3f}{m / base:>18.2f}")
    one = rows["one pass: forward_backward_logprobs"]
    two = rows["two passes: forward, then forward_backward"]
    fwd = rows["forward alone"]
    result = (
        f"RESULT one_pass_forward_calls={one[1]} forward_calls={fwd[1]} two_pass_forward_calls={two[1]} "
        f"one_pass_over_gradient={statistics.median(one[0]) / base:.3f} "
        f"two_pass_over_gradient={statistics.median(two[0]) / base:.3f}"
    )
    if served:
        result += (
            f" service_fb_over_engine_fb={statistics.median(served['tinker forward_backward']) / base:.3f}"
            f" service_two_pass_over_one={statistics.median(served['tinker forward, then forward_backward']) / statistics.median(served['tinker forward_backward']):.3f}"
        )
    print(result)


if __name__ == "__main__":
    main()
