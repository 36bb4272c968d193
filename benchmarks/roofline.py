"""Generation and training against this machine's limits, measured in the same run.

The limits: matmul GFLOP/s (a 1024^3 product) in the dtype of the rows (``--dtype``: float32, or
bfloat16, which only CPUs with AVX-512 BF16 or AMX compute natively; the run prints both dtypes'
GFLOP/s and which this CPU has; fp32 through torch's ``mm``, which is MKL, and through oneDNN, the
faster being the limit: MKL runs AVX2 kernels on AMD CPUs with AVX-512) and memory GB/s (a 256 MiB copy, read + write), at the thread
count of the run. A step of work cannot take less than
``max(FLOPs / GFLOP/s, bytes / GB/s)``; each row reports that bound over the measured time, its
fraction of the limit (1.0 = at the limit). Every sample of a row is taken right after a sample of
the limits, and a row's fraction is the median over its samples, so a load change on the shared
machine moves both alike.

Counted FLOPs are the useful ones: ``2 x`` the parameters of every matmul (decoder projections and
LM head, not the embedding lookup) per token, plus causal attention (``4 x layers x heads x
head_dim`` per attended position). Bytes are the weights read once per step (and, for decode, the
KV cache read). Rows:

- ``decode``: the embedded engine's model runner, one batched decode step over ``B`` running
  requests of mixed lengths (prompts 16-128 tokens, 0-64 generated), ``B`` = 16 and 64.
- ``linears``: the matmuls of the same decode steps alone (projections, MLPs, LM head; the
  model's weights, ``B`` rows of input, through the engine's own linear path): the fraction the BLAS itself reaches at the decode
  shapes, a ceiling for the ``decode`` row.
- ``prefill``: one batched prefill of ``B`` distinct prompts of 16-128 tokens.
- ``serve``: end to end through the scheduler: ``2 B`` requests (prompts 16-128, outputs 16-64
  tokens, eos ignored) with at most ``B`` running at a time, prefill and decode FLOPs over the
  wall time (the tail, where fewer than ``B`` run, included).
- ``train fwd+bwd`` (fp32 whatever ``--dtype`` says): `FSDPEngine.forward_backward` on one rank over 16 sequences of 128 tokens,
  against ``6 x`` the matmul parameters per token plus 3x the forward attention FLOPs; and a plain
  HF forward + backward of the same tokens (``model(ids).logits``, log-softmax, gather), whose
  time over the engine's is the last column.

Models: Qwen2 with 441 tokens of vocabulary: ``20M`` (hidden 384, 10 layers, 6 heads, 2 KV heads)
and ``100M`` (hidden 768, 12 layers, 12 heads, 4 KV heads).

    OMP_NUM_THREADS=1 python benchmarks/roofline.py [--threads 1] [--repeats 5] [--skip-100m]
        [--dtype float32|bfloat16] [--limits-only]

Last line: ``RESULT gflops=... gflops_float32=... gflops_bfloat16=... bf16_native=0|1
gflops_float32_mm=... gflops_float32_onednn=... decode64_20m=<fraction> ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from areal_lite.api.config import LocalEngineConfig, OptimizerConfig, TrainEngineConfig
from areal_lite.api.engine import PackedBatch
from areal_lite.api.io import FinetuneSpec, MicroBatchSpec
from areal_lite.cpu.linear import onednn_linear
from areal_lite.cpu.precision import cpu_kind, native_bf16
from areal_lite.engines.local.model_loading import load_model
from areal_lite.engines.local.model_runner import ModelRunner
from areal_lite.engines.local.request import SamplingParams, Sequence
from areal_lite.engines.local.scheduler import Scheduler
from areal_lite.engines.train.fsdp import FSDPEngine
from areal_lite.utils.tiny import build_tiny_model

MODELS = {
    "20M": {"hidden_size": 384, "num_layers": 10, "num_heads": 6, "num_kv_heads": 2},
    "100M": {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "num_kv_heads": 4},
}


@dataclass
class Limits:
    gflops: float
    gbps: float

    def seconds(self, flops: float, nbytes: float) -> float:
        """The least time ``flops`` and ``nbytes`` of memory traffic can take."""
        return max(flops / (self.gflops * 1e9), nbytes / (self.gbps * 1e9))


_A, _B = torch.randn(1024, 1024), torch.randn(1024, 1024)
_HALF = {torch.bfloat16: (_A.bfloat16(), _B.bfloat16())}
_SRC, _DST = torch.randn(64 * 1024 * 1024), torch.empty(64 * 1024 * 1024)


def matmul_libraries(dtype: torch.dtype) -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """The libraries a ``dtype`` product can run through here: torch's own ``mm`` (MKL for fp32,
    oneDNN for bf16) and, for fp32, oneDNN directly. MKL runs its AVX2 kernels on AMD CPUs with
    AVX-512, where oneDNN runs AVX-512 ones (2.2x on Zen 5; `cpu_linear`): the limit is the faster."""
    libs: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"mm": torch.mm}
    if dtype == torch.float32 and torch.backends.mkldnn.is_available():
        libs["onednn"] = lambda a, b: onednn_linear(a, b.t())
    return libs


def measure_limits(dtype: torch.dtype = torch.float32, per_library: dict[str, float] | None = None) -> Limits:
    """The best of three 1024^3 matmuls in ``dtype`` (float32 or bfloat16) through each of
    `matmul_libraries`, the fastest library's, and of three 256 MiB copies. ``per_library``, if
    given, receives each library's GFLOP/s."""
    a, b = (_A, _B) if dtype == torch.float32 else _HALF[dtype]
    best: dict[str, float] = {}
    cp = []
    for _ in range(3):
        for name, mm in matmul_libraries(dtype).items():
            t0 = time.perf_counter()
            mm(a, b)
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
        t0 = time.perf_counter()
        _DST.copy_(_SRC)
        cp.append(time.perf_counter() - t0)
    rates = {name: 2 * 1024**3 / t / 1e9 for name, t in best.items()}
    if per_library is not None:
        per_library.update(rates)
    return Limits(max(rates.values()), 2 * _SRC.numel() * 4 / min(cp) / 1e9)


@dataclass
class Shape:
    """What the FLOP and byte counts need of a model."""

    matmul_params: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> Shape:
        cfg = model.config
        # Every linear layer's weight, the LM head's too when it is tied to the embedding.
        matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(matmul, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim)

    def token_flops(self, attended: int) -> float:
        """Forward FLOPs of one token that attends over ``attended`` positions."""
        return 2 * self.matmul_params + 4 * self.layers * self.heads * self.head_dim * attended

    def kv_bytes(self, positions: int, itemsize: int = 4) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * positions * itemsize


@dataclass
class Row:
    name: str
    tokens_per_s: float
    fraction: float
    bound: str
    versus_hf: float | None = None


ROW_DTYPE = torch.float32
"""The dtype of the generation rows (``--dtype``)."""


def sample_row(name: str, run: Callable[[], tuple[int, float, float, float]], repeats: int) -> Row:
    """``run`` times one unit of work (its setup excluded) and returns (tokens, FLOPs, bytes,
    seconds); one warm-up, then ``repeats`` samples, each right after a sample of the limits."""
    run()
    fractions, rates, bounds = [], [], []
    for _ in range(repeats):
        limits = measure_limits(ROW_DTYPE)
        tokens, flops, nbytes, seconds = run()
        fractions.append(limits.seconds(flops, nbytes) / seconds)
        rates.append(tokens / seconds)
        bounds.append("compute" if flops / limits.gflops > nbytes / limits.gbps else "memory")
    return Row(name, statistics.median(rates), statistics.median(fractions), statistics.mode(bounds))


def mixed_prompts(n: int, seed: int, vocab: int, lengths: tuple[int, int] = (16, 128)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def _sequences(prompts: list[list[int]]) -> list[Sequence]:
    params = SamplingParams(max_new_tokens=1 << 20, ignore_eos=True)
    return [Sequence(str(i), p, params, lambda r: None, frozenset(), False) for i, p in enumerate(prompts)]


def decode_row(path: str, label: str, batch: int, repeats: int) -> Row:
    model, _ = load_model(path, ROW_DTYPE, "cpu")
    shape = Shape.of(model)
    vocab = model.config.vocab_size
    runner = ModelRunner(model, max_rows=batch, context_len=512, seed=0)
    rng = random.Random(1)
    steps = 8

    def run() -> tuple[int, float, float, float]:
        # Fresh rows each sample: mixed prompt lengths and 0-64 tokens already generated.
        runner.clear()
        seqs = _sequences(mixed_prompts(batch, rng.randrange(1 << 30), vocab))
        runner.prefill(seqs)
        for _ in range(rng.randint(0, 64) // steps):
            runner.decode()
        pos = runner.lens[: len(runner.rows)].tolist()
        flops = sum(shape.token_flops(p + 1 + s) for p in pos for s in range(steps))
        size = ROW_DTYPE.itemsize
        nbytes = steps * size * shape.matmul_params + sum(
            shape.kv_bytes(p + 1 + s, size) for p in pos for s in range(steps)
        )
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.decode()
        return batch * steps, flops, nbytes, time.perf_counter() - t0

    return sample_row(f"decode {label} B={batch}", run, repeats)


def linears_row(path: str, label: str, batch: int, repeats: int) -> Row:
    """The matmuls of ``steps`` decode steps alone (every projection, MLP and the LM head, the
    model's own weights, ``batch`` rows): what the BLAS makes of the decode shapes, a ceiling for
    the decode row that no attention or scheduling work can lift."""
    model, _ = load_model(path, ROW_DTYPE, "cpu")
    shape = Shape.of(model)
    runner = ModelRunner(model, max_rows=batch, context_len=512, seed=0)  # fuses q/k/v and gate/up as it decodes
    weights = [
        w
        for (qkv, _, gate_up, _), layer in zip(runner.fused, runner.layers)
        for w in (qkv, layer.self_attn.o_proj.weight, gate_up, layer.mlp.down_proj.weight)
    ]
    weights.append(model.lm_head.weight)
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=ROW_DTYPE) for w in weights}
    steps = 8

    def run() -> tuple[int, float, float, float]:
        t0 = time.perf_counter()
        for _ in range(steps):
            for w in weights:
                runner.linear(inputs[w.shape[1]], w)
        seconds = time.perf_counter() - t0
        nbytes = steps * ROW_DTYPE.itemsize * shape.matmul_params
        return batch * steps, steps * 2 * shape.matmul_params * batch, nbytes, seconds

    return sample_row(f"linears {label} B={batch}", run, repeats)


def prefill_row(path: str, label: str, batch: int, repeats: int) -> Row:
    model, _ = load_model(path, ROW_DTYPE, "cpu")
    shape = Shape.of(model)
    runner = ModelRunner(model, max_rows=batch, context_len=512, seed=0)
    rng = random.Random(2)

    def run() -> tuple[int, float, float, float]:
        runner.clear()
        prompts = mixed_prompts(batch, rng.randrange(1 << 30), model.config.vocab_size)
        seqs = _sequences(prompts)
        # Causal attention: token t attends over t + 1 positions.
        flops = sum(shape.token_flops(t + 1) for p in prompts for t in range(len(p)))
        t0 = time.perf_counter()
        runner.prefill(seqs)
        nbytes = ROW_DTYPE.itemsize * shape.matmul_params
        return sum(len(p) for p in prompts), flops, nbytes, time.perf_counter() - t0

    return sample_row(f"prefill {label} B={batch}", run, repeats)


def serve_row(path: str, label: str, batch: int, repeats: int) -> Row:
    dtype = str(ROW_DTYPE).removeprefix("torch.")
    scheduler = Scheduler(LocalEngineConfig(path=path, dtype=dtype, max_running_requests=batch))
    scheduler.start()
    assert scheduler.model is not None
    shape = Shape.of(scheduler.model)
    vocab = scheduler.model.config.vocab_size
    rng = random.Random(3)

    def run() -> tuple[int, float, float, float]:
        prompts = mixed_prompts(2 * batch, rng.randrange(1 << 30), vocab)
        outputs = [rng.randint(16, 64) for _ in prompts]
        flops = sum(shape.token_flops(t + 1) for p, m in zip(prompts, outputs) for t in range(len(p) + m - 1))
        steps = sum(outputs) / batch  # decode steps if every step ran ``batch`` rows

        async def go() -> int:
            results = await asyncio.gather(
                *[
                    scheduler.generate(p, SamplingParams(max_new_tokens=m, ignore_eos=True))
                    for p, m in zip(prompts, outputs)
                ]
            )
            return sum(len(r.output_ids) for r in results)

        t0 = time.perf_counter()
        tokens = asyncio.run(go())
        return tokens, flops, steps * ROW_DTYPE.itemsize * shape.matmul_params, time.perf_counter() - t0

    try:
        return sample_row(f"serve {label} B={batch}", run, repeats)
    finally:
        scheduler.stop()


def _token_nll(logp: torch.Tensor, ent: torch.Tensor, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    m = mb["loss_mask"].float()  # type: ignore[union-attr]
    return -(logp * m).sum(), {}


def _n_tokens(mb: PackedBatch) -> float:
    return float(mb["loss_mask"].sum())  # type: ignore[union-attr]


def train_row(path: str, label: str, repeats: int, n_seqs: int = 16, seq_len: int = 128) -> Row:
    """The train engine's forward+backward vs the FLOP count and vs plain HF on the same tokens."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    hf.config.use_cache = False
    shape = Shape.of(hf)
    ids = torch.randint(3, hf.config.vocab_size, (n_seqs, seq_len), generator=torch.Generator().manual_seed(0))
    ones = torch.ones_like(ids)
    batch = TensorDict({"input_ids": ids, "attention_mask": ones.bool(), "loss_mask": ones}, batch_size=[n_seqs])
    engine = FSDPEngine(
        TrainEngineConfig(path=path, optimizer=OptimizerConfig(lr=1e-5), mb_spec=MicroBatchSpec(n_mbs=1))
    )
    engine.initialize(FinetuneSpec(total_train_epochs=1, dataset_size=n_seqs, train_batch_size=n_seqs))
    tokens = n_seqs * seq_len
    flops = 3 * n_seqs * sum(shape.token_flops(t + 1) for t in range(seq_len))
    nbytes = 3 * 4 * shape.matmul_params

    def engine_step() -> float:
        t0 = time.perf_counter()
        engine.forward_backward(batch, _token_nll, _n_tokens)
        seconds = time.perf_counter() - t0
        engine._zero_grad()
        return seconds

    def hf_step() -> float:
        t0 = time.perf_counter()
        logits = hf(input_ids=ids).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:, None])
        (-logp.sum() / tokens).backward()
        seconds = time.perf_counter() - t0
        hf.zero_grad(set_to_none=True)
        return seconds

    engine_step(), hf_step()
    fractions, rates, ratios = [], [], []
    for i in range(repeats):
        limits = measure_limits()
        # Alternate which goes first, so neither always runs right after the limits sample.
        e, h = (engine_step(), hf_step()) if i % 2 == 0 else tuple(reversed((hf_step(), engine_step())))
        fractions.append(limits.seconds(flops, nbytes) / e)
        rates.append(tokens / e)
        ratios.append(h / e)
    engine.destroy()
    return Row(
        f"train fwd+bwd {label}",
        statistics.median(rates),
        statistics.median(fractions),
        "compute",
        statistics.median(ratios),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-100m", action="store_true", help="only the 20M model")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="of the generation rows")
    parser.add_argument("--limits-only", action="store_true", help="only the limits, in both dtypes")
    args = parser.parse_args()
    global ROW_DTYPE
    ROW_DTYPE = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    native = native_bf16(torch.device("cpu"))
    fp32_libs: list[dict[str, float]] = [{} for _ in range(3)]
    by_dtype = {
        "float32": statistics.median(measure_limits(torch.float32, libs).gflops for libs in fp32_libs),
        "bfloat16": statistics.median(measure_limits(torch.bfloat16).gflops for _ in range(3)),
    }
    fp32_by_lib = {name: statistics.median(libs[name] for libs in fp32_libs) for name in fp32_libs[0]}
    print(f"CPU: {cpu_kind()}")
    print(
        f"matmul ({args.threads} thread(s), median of 3): float32 {by_dtype['float32']:.1f} GFLOP/s "
        f"({', '.join(f'{k} {v:.1f}' for k, v in fp32_by_lib.items())}), bfloat16 "
        f"{by_dtype['bfloat16']:.1f} GFLOP/s ({by_dtype['bfloat16'] / by_dtype['float32']:.2f}x): bf16 is "
        f"{'native' if native else 'emulated'} on this CPU"
    )
    dtype_result = [f"gflops_{k}={v:.1f}" for k, v in by_dtype.items()] + [f"bf16_native={int(native)}"]
    dtype_result += [f"gflops_float32_{k}={v:.1f}" for k, v in fp32_by_lib.items()]
    if args.limits_only:
        print("RESULT " + " ".join(dtype_result))
        return
    rows: list[Row] = []
    limits = [measure_limits(ROW_DTYPE) for _ in range(3)]
    print(f"{'row':<26}{'tokens/s':>10}{'of limit':>10}{'bound':>9}{'HF / ours':>11}", flush=True)

    def add(row: Row) -> None:
        rows.append(row)
        vs = f"{row.versus_hf:>11.3f}" if row.versus_hf is not None else f"{'':>11}"
        print(f"{row.name:<26}{row.tokens_per_s:>10.0f}{row.fraction:>10.3f}{row.bound:>9}{vs}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        for label, dims in MODELS.items():
            if label == "100M" and args.skip_100m:
                continue
            path = build_tiny_model(f"{tmp}/{label}", vocab_size=512, **dims)
            for b in (16, 64):
                add(decode_row(path, label, b, args.repeats))
                add(linears_row(path, label, b, args.repeats))
            for b in (16, 64):
                add(prefill_row(path, label, b, args.repeats))
            for b in (16, 64):
                add(serve_row(path, label, b, args.repeats))
            add(train_row(path, label, args.repeats))
    limits += [measure_limits(ROW_DTYPE) for _ in range(3)]
    gflops = statistics.median(lim.gflops for lim in limits)
    gbps = statistics.median(lim.gbps for lim in limits)
    print(
        f"limits ({args.threads} thread(s), median of the run's samples): matmul {gflops:.1f} GFLOP/s in {args.dtype}, "
        f"copy {gbps:.1f} GB/s"
    )
    keys = {r.name: r for r in rows}
    result = [f"dtype={args.dtype}", f"gflops={gflops:.1f}", f"gbps={gbps:.1f}", *dtype_result]
    for r in rows:
        key = r.name.replace("train fwd+bwd", "train").replace(" B=", "").replace(" ", "_").lower()
        result.append(f"{key}={r.fraction:.3f}")
    train = keys.get("train fwd+bwd 20M")
    if train is not None and train.versus_hf is not None:
        result.append(f"train_20m_hf_over_ours={train.versus_hf:.3f}")
    print("RESULT " + " ".join(result))


if __name__ == "__main__":
    main()
