"""GRPO updates with each group's prompt computed once (``actor.shared_prefix``) vs as packed.

A GRPO batch holds G samples per prompt; packed as they are, the prompt goes through the model G
times. With ``shared_prefix`` every group becomes one tree sequence (prompt once, one branch per
completion; `areal_lite.engines.train.shared_prefix`), with the same results. Rows: one `PPOActor.ppo_update`
(forward, backward, AdamW step) of the same batch with the ordinary packed layout and with the
shared prefix, alternating, on the quickstart's model size (hidden 128, 4 layers) and batch
(32 prompts x 8 samples) in three workloads: the quickstart's 6-token prompts with 1-5 completion
tokens, chat-like 200-token prompts with 20-200 completion tokens, and the same with the first 40
tokens of every prompt alike (``system``: a chat template's system turn, which every group shares
but only the group's samples share the rest; each group is still one tree of its whole prompt).
Times are medians per update, in CPU-seconds of this process (stable when other jobs share the
cores). The last line is
``RESULT short_speedup=<plain / shared> long_speedup=<...> short_tokens=<shared / plain> ...``.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/shared_prefix.py [--steps 8]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from tensordict import TensorDict

from areal_lite.actors.ppo import PPOActor
from areal_lite.api.config import OptimizerConfig, PPOActorConfig
from areal_lite.api.io import FinetuneSpec, MicroBatchSpec
from areal_lite.utils.tiny import build_tiny_model


def grpo_batch(
    n_prompts: int, group: int, prompt_len: int, completion: tuple[int, int], vocab: int, common: int = 0
) -> TensorDict:
    """Rows of ``group`` samples per prompt, completions of random lengths in ``completion``; the
    first ``common`` tokens of every prompt are the same (a chat template's system turn)."""
    g = torch.Generator().manual_seed(0)
    start = torch.randint(3, vocab, (common,), generator=g)
    rows = []
    for _ in range(n_prompts):
        prompt = torch.cat([start, torch.randint(3, vocab, (prompt_len - common,), generator=g)])
        for _ in range(group):
            n = int(torch.randint(completion[0], completion[1] + 1, (1,), generator=g))
            rows.append((prompt, torch.randint(3, vocab, (n,), generator=g)))
    width = max(len(p) + len(c) for p, c in rows)
    b = len(rows)
    ids = torch.zeros(b, width, dtype=torch.int64)
    loss_mask = torch.zeros(b, width, dtype=torch.int32)
    for i, (p, c) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.cat([p, c])
        loss_mask[i, len(p) : len(p) + len(c)] = 1
    lens = torch.tensor([len(p) + len(c) for p, c in rows])
    return TensorDict(
        {
            "input_ids": ids,
            "attention_mask": torch.arange(width)[None] < lens[:, None],
            "loss_mask": loss_mask,
            "logprobs": -torch.rand(b, width, generator=g) * loss_mask,
            "versions": torch.where(loss_mask.bool(), 0, -1).int(),
            "rewards": (torch.rand(b, generator=g) > 0.5).float(),
        },
        batch_size=[b],
    )


def make_actor(path: str, shared: bool, n_mbs: int) -> PPOActor:
    from areal_lite.engines.train.fsdp import FSDPEngine

    cfg = PPOActorConfig(
        path=path,
        group_size=8,
        shared_prefix=shared,
        mb_spec=MicroBatchSpec(n_mbs=n_mbs, granularity=8),
        optimizer=OptimizerConfig(lr=1e-6),
    )
    engine = FSDPEngine(cfg)
    engine.initialize(FinetuneSpec(1, 10_000, 32))
    return PPOActor(cfg, engine)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="timed updates per layout and workload")
    args = parser.parse_args()
    torch.manual_seed(0)
    from transformers import AutoConfig

    path = build_tiny_model(
        tempfile.mkdtemp(), hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=512
    )
    vocab = AutoConfig.from_pretrained(path).vocab_size
    # prompt length, completion lengths, micro-batches, tokens every prompt starts with
    workloads = {"short": (6, (1, 5), 1, 0), "long": (200, (20, 200), 8, 0), "system": (200, (20, 200), 8, 40)}
    results: dict[str, dict[bool, float]] = {}
    tokens: dict[str, dict[bool, int]] = {}
    print(f"{'workload':<8}{'layout':<16}{'tokens/update':>14}{'s/update':>10}")
    for name, (prompt_len, completion, n_mbs, common) in workloads.items():
        batch = grpo_batch(32, 8, prompt_len, completion, vocab, common)
        actors = {shared: make_actor(path, shared, n_mbs) for shared in (False, True)}
        times: dict[bool, list[float]] = {False: [], True: []}
        for actor in actors.values():
            actor.compute_advantages(batch)
            actor.ppo_update(batch.clone())  # warm-up
        for _ in range(args.steps):
            for shared, actor in actors.items():
                t0 = time.process_time()
                actor.ppo_update(batch.clone())
                times[shared].append(time.process_time() - t0)
        results[name] = {k: statistics.median(v) for k, v in times.items()}
        engine = actors[True].engine
        from areal_lite.engines.train.shared_prefix import shared_prefix_layout

        mbs, _, _ = engine._microbatches(batch)
        tree_tokens = sum(
            int(shared_prefix_layout(mb["input_ids"], mb["position_ids"], mb["cu_seqlens"]).input_ids.numel())
            for mb in mbs
        )
        tokens[name] = {False: int(batch["attention_mask"].sum()), True: tree_tokens}
        for shared in (False, True):
            label = "shared prefix" if shared else "packed"
            print(f"{name:<8}{label:<16}{tokens[name][shared]:>14}{results[name][shared]:>10.3f}")
        for actor in actors.values():
            actor.engine.destroy()
    print(
        "RESULT "
        + " ".join(f"{n}_speedup={r[False] / r[True]:.2f}" for n, r in results.items())
        + " "
        + " ".join(f"{n}_tokens={t[True] / t[False]:.2f}" for n, t in tokens.items())
    )


if __name__ == "__main__":
    main()
