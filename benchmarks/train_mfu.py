"""A training step of `FSDPEngine` against the plain HF step a user writes without a framework:
seconds per step, tokens/s and model FLOPs utilisation (MFU), side by side in one process.

Both sides train the same model (random weights of a Qwen2.5 shape, tied embeddings) on the same
variable-length sequences (``--sequences`` lengths drawn uniformly from ``--min-len`` to
``--max-len``, seeded), one optimizer step per batch, AdamW, gradients clipped at 1.0:

- ``plain HF``: the model in fp32 under bf16 autocast (fp32 on CPU), SDPA attention, the
  sequences in their order cut into micro-batches of at most ``--max-tokens`` padded tokens, each
  padded to its longest row; HF's own loss (``labels``), weighted by each micro-batch's share of
  the tokens; fused AdamW where the device has it.
- ``ours``: `FSDPEngine` (``dtype=bfloat16`` on CUDA, float32 on CPU; packed micro-batches of at
  most ``--max-tokens`` tokens; `train_batch` with a token-mean negative log-likelihood). Each
  ``--variant KEY=VALUE,...`` adds a row of ours with those `TrainEngineConfig` fields changed.

MFU counts ``6 x parameters`` per token plus causal attention, ``6 x layers x hidden x L^2`` per
sequence of ``L`` tokens, over the peak matrix rate measured in the same run: a bf16 8192^3 product
on CUDA, the faster fp32 1024^3 library product on CPU (`benchmarks/roofline.py`). A figure is the
median of ``--steps`` timed steps after ``--warmup``. The last line is ``RESULT mfu_<shape>=...
over_plain_hf_<shape>=... ...`` (ours over plain HF in steps per second).

    python benchmarks/train_mfu.py --device cuda --shapes 0.5b,1.5b        (a GPU)
    OMP_NUM_THREADS=1 python benchmarks/train_mfu.py --device cpu --shapes tiny --sequences 6 \
        --min-len 16 --max-len 96 --max-tokens 256                       (CPU, the test suite's smoke run)
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace

import torch
from tensordict import TensorDict

from areal_lite.api.config import OptimizerConfig, TrainEngineConfig
from areal_lite.api.engine import PackedBatch
from areal_lite.api.io import FinetuneSpec, MicroBatchSpec
from areal_lite.cpu.precision import cpu_kind

SHAPES: dict[str, dict[str, int]] = {
    "0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
    },
    "1.5b": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
}
"""Qwen2.5's 0.5B and 1.5B shapes (vocabulary 151,936), and a tiny one for CPU smoke runs."""
VOCAB = {"0.5b": 151936, "1.5b": 151936, "tiny": 1024}


def build_model(shape: str, out_dir: str, seed: int = 0) -> tuple[str, int]:
    """A Qwen2 model directory of ``shape`` with random weights (saved in bf16 to halve the write);
    returns ``(path, number of parameters)``."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=VOCAB[shape],
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        **SHAPES[shape],
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out_dir)
    return out_dir, n_params


def make_batch(n: int, lo: int, hi: int, vocab: int, seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g)
    mask = torch.arange(int(lens.max()))[None] < lens[:, None]
    ids = torch.randint(1, vocab, mask.shape, generator=g) * mask
    return TensorDict({"input_ids": ids, "attention_mask": mask, "loss_mask": mask.int()}, batch_size=[n])


def model_flops(batch: TensorDict, n_params: int, shape: str) -> float:
    lens = batch["attention_mask"].sum(1).double()
    layers, hidden = SHAPES[shape]["num_hidden_layers"], SHAPES[shape]["hidden_size"]
    return float(6 * n_params * lens.sum() + 6 * layers * hidden * (lens**2).sum())


def peak_flops(device: torch.device) -> tuple[float, str]:
    """The matrix rate this run compares with, in FLOP/s, and what it is."""
    if device.type == "cuda":
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        return 10 * 2 * 8192**3 / (time.perf_counter() - start), "bf16 8192^3 matmul"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from roofline import measure_limits

    return measure_limits(torch.float32).gflops * 1e9, "fp32 1024^3 matmul"


def timed(step: Callable[[], object], device: torch.device, warmup: int, steps: int) -> float:
    """Median seconds per step after ``warmup`` steps."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def padded_microbatches(batch: TensorDict, max_tokens: int) -> list[TensorDict]:
    """The sequences in their order, a micro-batch growing while its rows x longest row fit."""
    lens = batch["attention_mask"].sum(1).tolist()
    groups: list[list[int]] = [[]]
    for i, n in enumerate(lens):
        rows = groups[-1] + [i]
        if groups[-1] and len(rows) * max(lens[j] for j in rows) > max_tokens:
            groups.append([i])
        else:
            groups[-1] = rows
    out = []
    for rows in groups:
        mb = batch[torch.tensor(rows)]
        width = int(mb["attention_mask"].sum(1).max())
        out.append(TensorDict({k: v[:, :width] for k, v in mb.items()}, batch_size=[len(rows)]))
    return out


def report_syncs(step: Callable[[], object]) -> None:
    """Run ``step`` once with CUDA's sync debug mode on and print where the host waited for the
    device (the Python lines that asked for a value, most frequent first)."""
    import collections
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    places = collections.Counter(
        f"{os.path.relpath(w.filename)}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)
    )
    print(f"  host syncs in one step: {sum(places.values())}")
    for place, n in places.most_common(12):
        print(f"    {n:4d}  {place}")


def plain_hf_step(path: str, batch: TensorDict, device: torch.device, max_tokens: int) -> Callable[[], None]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    mbs = [mb.to(device) for mb in padded_microbatches(batch, max_tokens)]
    total = float(batch["loss_mask"][:, 1:].sum())
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step() -> None:
        for mb in mbs:
            labels = mb["input_ids"].masked_fill(~mb["attention_mask"].bool(), -100)
            with amp:
                loss = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"].long(), labels=labels).loss
            (loss * float(mb["loss_mask"][:, 1:].sum()) / total).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step.model = model  # type: ignore[attr-defined]
    return step


def _nll(logp: torch.Tensor, ent: torch.Tensor, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    m = mb["loss_mask"]
    return -(logp * m).sum() / m.sum().clamp(min=1), {}


def _n_tokens(mb: PackedBatch) -> torch.Tensor:
    return mb["loss_mask"].sum()  # type: ignore[union-attr,return-value]


def engine_config(path: str, device: torch.device, max_tokens: int, overrides: str) -> TrainEngineConfig:
    cfg = TrainEngineConfig(
        path=path,
        dtype="bfloat16" if device.type == "cuda" else "float32",
        optimizer=OptimizerConfig(lr=1e-5, gradient_clipping=1.0),
        mb_spec=MicroBatchSpec(max_tokens_per_mb=max_tokens),
    )
    for item in filter(None, overrides.split(",")):
        key, value = item.split("=", 1)
        current = getattr(cfg, key)
        cast = (lambda v: v.lower() in ("1", "true", "yes")) if isinstance(current, bool) else type(current)
        cfg = replace(cfg, **{key: cast(value)})
    return cfg


def run_shape(shape: str, args: argparse.Namespace, device: torch.device, peak: float) -> dict[str, float]:
    from areal_lite.engines.train.fsdp import FSDPEngine

    tmp = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    path, n_params = build_model(shape, tmp)
    batch = make_batch(args.sequences, args.min_len, args.max_len, VOCAB[shape], seed=1)
    tokens = int(batch["attention_mask"].sum())
    flops = model_flops(batch, n_params, shape)
    print(
        f"\n{shape}: {n_params / 1e6:.0f}M parameters, {args.sequences} sequences, {tokens} tokens, "
        f"{flops / 1e12:.1f} TFLOP a step"
    )
    rows: list[tuple[str, float, float]] = []

    def record(name: str, step: Callable[[], object]) -> None:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        seconds = timed(step, device, args.warmup, args.steps)
        mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        rows.append((name, seconds, mem))
        print(
            f"  {name:<28} {seconds:8.3f} s/step {tokens / seconds:10.0f} tok/s  MFU {flops / seconds / peak:6.1%}  peak {mem:5.1f} GiB",
            flush=True,
        )

    plain = plain_hf_step(path, batch, device, args.max_tokens)
    record("plain HF", plain)
    del plain
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    for variant in [""] + args.variant:
        engine = FSDPEngine(engine_config(path, device, args.max_tokens, variant))
        engine.initialize(FinetuneSpec(total_train_epochs=1, dataset_size=len(batch), train_batch_size=len(batch)))
        record("ours" + (f" ({variant})" if variant else ""), lambda e=engine: e.train_batch(batch, _nll, _n_tokens))
        if args.sync_report and device.type == "cuda" and not variant:
            report_syncs(lambda e=engine: e.train_batch(batch, _nll, _n_tokens))
        engine.destroy()
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    plain_s, ours_s = rows[0][1], rows[1][1]
    tag = shape.replace(".", "p")
    result = {
        f"mfu_{tag}": flops / ours_s / peak,
        f"plain_hf_mfu_{tag}": flops / plain_s / peak,
        f"over_plain_hf_{tag}": plain_s / ours_s,
        f"s_per_step_{tag}": ours_s,
    }
    for variant, (_, seconds, _) in zip(args.variant, rows[2:], strict=True):
        # mfu_0p5b_compile_layers for --variant compile_layers=true: the fields the row changed
        slug = "_".join(kv.split("=")[0] for kv in variant.split(","))
        result[f"mfu_{tag}_{slug}"] = flops / seconds / peak
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", default="0.5b,1.5b")
    parser.add_argument("--sequences", type=int, default=30)
    parser.add_argument("--min-len", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--variant", action="append", default=[], help="KEY=VALUE,... of TrainEngineConfig")
    parser.add_argument("--sync-report", action="store_true", help="CUDA: where one step of ours waits for the device")
    args = parser.parse_args()
    device = torch.device(args.device)
    peak, what = peak_flops(device)
    hardware = torch.cuda.get_device_name() if device.type == "cuda" else cpu_kind()
    print(f"{hardware}, torch {torch.__version__}; peak {peak / 1e12:.1f} TFLOP/s ({what})")
    result: dict[str, float] = {"peak_tflops": peak / 1e12}
    for shape in args.shapes.split(","):
        result.update(run_shape(shape, args, device, peak))
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in result.items()))


if __name__ == "__main__":
    main()
