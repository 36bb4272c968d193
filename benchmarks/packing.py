"""Training throughput, packed vs padded, on a batch with long-tailed sequence lengths.

RL batches have a few long completions among many short ones. Padding every micro-batch to its
longest sequence spends most of the compute on padding; packing the real tokens into one 1-D
sequence per micro-batch (position ids restarting per sequence) spends none.

Rows (same model, same batch, same number of micro-batches, one process, fp32 on CPU):
- ``padded``: the usual dynamic-padding loop, sequences in order, each micro-batch padded to its
  longest sequence; HF forward with an attention mask, LM head on every position.
- ``packed (bare HF)``: the same model and optimizer on packed micro-batches (balanced split),
  transformers' sdpa masking each sequence by the restarting position ids.
- ``packed (FSDPEngine)``: `FSDPEngine.train_batch`, FSDP2 on one rank, the real engine path
  (attention per sequence, `areal_lite.engines.train.varlen_attention`).

Tokens/s counts real tokens only. Throughput is given per CPU-second of this process (stable
when other jobs share the cores) and per wall second (the fastest step). The last line is
``RESULT packed_over_padded=<FSDPEngine / padded, real tokens per CPU-second> ...``.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/packing.py [--steps 3]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable

import torch
from tensordict import TensorDict

from areal_lite.api.config import OptimizerConfig, TrainEngineConfig
from areal_lite.api.engine import PackedBatch
from areal_lite.api.io import FinetuneSpec, MicroBatchSpec
from areal_lite.engines.train.fsdp import FSDPEngine
from areal_lite.engines.train.logprob import align_to_tokens, logprobs_from_hidden, next_token_labels
from areal_lite.utils.data import pack_batch, split_microbatches
from areal_lite.utils.tiny import build_tiny_model


def long_tailed_batch(n: int, max_len: int, vocab: int, seed: int = 0) -> TensorDict:
    """Lengths from a log-normal (median ~40 tokens) capped at ``max_len``."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.exp(torch.randn(n, generator=g) * 0.9 + 3.7).long().clamp(8, max_len)
    ar = torch.arange(int(lens.max())).unsqueeze(0)
    am = ar < lens.unsqueeze(1)
    ids = torch.randint(1, vocab, am.shape, generator=g) * am
    return TensorDict({"input_ids": ids, "attention_mask": am, "loss_mask": am.int()}, batch_size=[n])


def nll(out: torch.Tensor, ent: torch.Tensor, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    m = mb["loss_mask"].float()  # type: ignore[union-attr]
    return -(out * m).sum() / m.sum(), {}


def n_tokens(mb: PackedBatch) -> float:
    return float(mb["loss_mask"].sum())  # type: ignore[union-attr]


def timed(step: Callable[[], object], steps: int) -> tuple[float, float]:
    """(CPU seconds per step, fastest wall seconds per step), after one warm-up step.

    CPU time of this process is the headline because it does not change when other processes
    share the cores; the fastest wall time is the least disturbed one."""
    step()
    cpu = time.process_time()
    walls = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        walls.append(time.perf_counter() - start)
    return (time.process_time() - cpu) / steps, min(walls)


def padded_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: TensorDict, n_mbs: int) -> None:
    total = float(batch["loss_mask"].sum())
    opt.zero_grad()
    for rows in torch.arange(batch.batch_size[0]).chunk(n_mbs):
        mb = batch[rows]
        width = int(mb["attention_mask"].sum(1).max())
        ids, am = mb["input_ids"][:, :width], mb["attention_mask"][:, :width]
        hidden = model.model(input_ids=ids, attention_mask=am.long(), use_cache=False).last_hidden_state
        labels = torch.roll(ids, -1, dims=1).reshape(-1)
        lp, _ = logprobs_from_hidden(hidden.reshape(-1, hidden.shape[-1]), model.lm_head.weight, labels)
        lp = torch.roll(lp.view(ids.shape), 1, dims=1)
        lp[:, 0] = 0
        m = mb["loss_mask"][:, :width].float()
        (-(lp * m).sum() / total).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def packed_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: TensorDict, n_mbs: int) -> None:
    total = float(batch["loss_mask"].sum())
    opt.zero_grad()
    for mb in split_microbatches(batch, MicroBatchSpec(n_mbs=n_mbs)).mbs:
        p = pack_batch(mb)
        ids, pos, cu = p["input_ids"], p["position_ids"], p["cu_seqlens"]
        hidden = model.model(input_ids=ids[None], position_ids=pos[None], use_cache=False).last_hidden_state[0]
        lp, _ = logprobs_from_hidden(hidden, model.lm_head.weight, next_token_labels(ids))
        lp = align_to_tokens(lp, cu)
        (-(lp * p["loss_mask"].float()).sum() / total).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--n-mbs", type=int, default=4)
    args = parser.parse_args()

    from transformers import AutoConfig, AutoModelForCausalLM

    path = build_tiny_model(
        tempfile.mkdtemp(), hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=512
    )
    batch = long_tailed_batch(args.batch, args.max_len, vocab=AutoConfig.from_pretrained(path).vocab_size)
    lens = batch["attention_mask"].sum(1)
    real = int(lens.sum())
    padded_tokens = sum(int(lens[r].max()) * len(r) for r in torch.arange(args.batch).chunk(args.n_mbs))
    print(
        f"batch: {args.batch} sequences, lengths median {int(lens.median())}, max {int(lens.max())}; "
        f"{real} real tokens, {padded_tokens} padded positions in {args.n_mbs} micro-batches"
    )

    rows = []
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    rows.append(("padded", timed(lambda: padded_step(model, opt, batch, args.n_mbs), args.steps)))
    rows.append(("packed (bare HF)", timed(lambda: packed_step(model, opt, batch, args.n_mbs), args.steps)))

    cfg = TrainEngineConfig(path=path, optimizer=OptimizerConfig(lr=1e-5), mb_spec=MicroBatchSpec(n_mbs=args.n_mbs))
    engine = FSDPEngine(cfg)
    engine.initialize(FinetuneSpec(total_train_epochs=1, dataset_size=args.batch, train_batch_size=args.batch))
    rows.append(("packed (FSDPEngine)", timed(lambda: engine.train_batch(batch, nll, n_tokens), args.steps)))
    engine.destroy()

    print(f"{'layout':<22}{'cpu s/step':>12}{'tokens/cpu-s':>14}{'wall s/step':>13}{'tokens/s':>10}")
    for name, (cpu, wall) in rows:
        print(f"{name:<22}{cpu:>12.3f}{real / cpu:>14.0f}{wall:>13.3f}{real / wall:>10.0f}")
    (padded, _), (bare, _), (fsdp, fsdp_wall) = ((real / cpu, real / wall) for _, (cpu, wall) in rows)
    print(
        f"RESULT packed_over_padded={fsdp / padded:.2f} bare_packed_over_padded={bare / padded:.2f} "
        f"padded_tokens_per_cpu_s={padded:.0f} packed_tokens_per_cpu_s={fsdp:.0f} packed_tokens_per_s={fsdp_wall:.0f}"
    )


if __name__ == "__main__":
    main()
