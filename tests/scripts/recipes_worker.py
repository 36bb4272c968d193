"""``train_grpo`` on a fixed set of 8 samples then ``optim_step``, on 1 rank or under torchrun on 2.

Usage: ``[torchrun --nproc-per-node N] recipes_worker.py MODEL_DIR OUT_DIR``. On 2 ranks rank 0
holds 3 of the samples and rank 1 the other 5, so the ranks ask for different numbers of
log-probabilities and train calls; rank 0 writes the parameter change and the number of exchange
rounds to ``OUT_DIR/grpo_delta_w<world>.pt``, which tests/test_recipes.py compares with one rank
on all 8. Then only the last rank generates (the weight sync, which every rank must join) and both
step again: the ranks must stay in step to finish.
"""

from __future__ import annotations

import asyncio
import sys

import torch
import torch.distributed as dist

from areal_lite.api.config import OptimizerConfig
from areal_lite.api.io import GenerationConfig
from areal_lite.recipes import ModelBuilder, ModelConfig, TokenizedThread, TokenizedTurn, async_map, shutdown
from areal_lite.recipes.lockstep import engine_thread

SGD_LIKE = OptimizerConfig(lr=1e3, eps=1e3, gradient_clipping=0.0)


def sample(prompt: list[int], completion: list[int]) -> TokenizedThread:
    """A user turn of ``prompt`` tokens and an assistant turn of ``completion`` tokens."""
    return TokenizedThread(
        [
            TokenizedTurn("user", prompt, [0.0] * len(prompt), ""),
            TokenizedTurn("assistant", completion, [1.0] * len(completion), ""),
        ]
    )


def random_samples(n: int, seed: int, vocab: int = 290) -> list[TokenizedThread]:
    """``n`` samples of 3 prompt tokens and 1 to 6 completion tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        gen = int(torch.randint(1, 7, (1,), generator=g))
        ids = torch.randint(0, vocab, (3 + gen,), generator=g).tolist()
        out.append(sample(ids[:3], ids[3:]))
    return out


def full_params(engine: object) -> dict[str, torch.Tensor]:
    """Every parameter in full (collective under FSDP)."""
    state = engine.model.state_dict()  # type: ignore[attr-defined]
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


async def grpo_delta(model_dir: str) -> tuple[dict[str, torch.Tensor], int, int, int]:
    """The parameter change of one step of ``train_grpo`` over the 8 samples (this rank's share),
    this rank, the world size and the exchange rounds of the engine thread."""
    cfg = ModelConfig(optimizer=SGD_LIKE, max_seq_len=64, gconfig=GenerationConfig(max_new_tokens=4))
    model = await ModelBuilder(model_dir, cfg).spawn_train("policy")
    rank, world = dist.get_rank(), dist.get_world_size()
    samples = random_samples(8, seed=11)
    share = list(range(8)) if world == 1 else (list(range(3)) if rank == 0 else list(range(3, 8)))
    mine = [samples[i] for i in share]
    logprobs = await async_map(model.logprobs_per_token, mine)
    g = torch.Generator().manual_seed(12)
    noise = [torch.randn(s.n_trained, generator=g) for s in samples]
    adv = torch.randn(8, generator=g).tolist()
    old = [[x + 0.3 * float(e) for x, e in zip(lp, noise[i])] for lp, i in zip(logprobs, share)]
    ref = [[x - 0.1 for x in lp] for lp in logprobs]
    before = await model.with_engine("params", full_params)
    await async_map(lambda j: model.train_grpo(mine[j], old[j], ref[j], adv[share[j]], 0.1, 0.05), range(len(mine)))
    await model.optim_step()
    after = await model.with_engine("params", full_params)
    if rank == world - 1:  # the sync this needs is a collective the other ranks join
        await model.generate_tokens(mine[0])
    await model.train_sft(mine[-1])
    await model.optim_step()
    rounds = engine_thread().rounds
    await shutdown(model)
    return {k: after[k] - before[k] for k in before}, rank, world, rounds


def main() -> None:
    model_dir, out_dir = sys.argv[1:3]
    delta, rank, world, rounds = asyncio.run(grpo_delta(model_dir))
    if rank == 0:
        torch.save({"delta": delta, "rounds": rounds}, f"{out_dir}/grpo_delta_w{world}.pt")


if __name__ == "__main__":
    main()
