"""One decoupled-PPO update of `PPOActor` on a fixed batch, on 1 rank or under torchrun on 2.

Usage: ``[torchrun --nproc-per-node N] actor_worker.py MODEL_DIR OUT_DIR``. Each rank trains on
its share of whole GRPO groups; rank 0 writes the parameter change to
``OUT_DIR/ppo_delta_w<world>.pt``, which tests/test_actors.py compares across world sizes. Three
of the four groups have uniform rewards (zero advantages): on 2 ranks, which leave them out of the
update, rank 0 trains one group and rank 1 none. A second update with two minibatches checks that
ranks stay in step (no hang).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from areal_lite.actors import PPOActor
from areal_lite.api.config import OptimizerConfig, PPOActorConfig
from areal_lite.api.io import FinetuneSpec
from areal_lite.engines.train.fsdp import FSDPEngine
from areal_lite.utils.distributed import destroy_default_group

GROUP = 4
N = 16


def make_batch() -> TensorDict:
    g = torch.Generator().manual_seed(0)
    width = 12
    gen = torch.randint(1, 9, (N,), generator=g)
    pos = torch.arange(width).unsqueeze(0)
    attn = pos < (3 + gen).unsqueeze(1)
    loss_mask = attn & (pos >= 3)
    return TensorDict(
        {
            "input_ids": torch.randint(0, 250, (N, width), generator=g) * attn,
            "attention_mask": attn,
            "loss_mask": loss_mask.int(),
            "logprobs": torch.zeros(N, width),
            "versions": torch.where(loss_mask, 0, -1).int(),
            "rewards": torch.randn(N, generator=g).index_fill(
                0, torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15]), 1.0
            ),
            "noise": torch.randn(N, width, 2, generator=g) * loss_mask.unsqueeze(-1),
        },
        batch_size=[N],
    )


def full_params(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    """Full parameters (collective; complete on rank 0)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {n: t.clone() for n, t in get_model_state_dict(engine.model, options=opts).items()}


def ppo_delta(
    model_dir: str, n_minibatches: int = 1, skip_zero_advantage: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The parameter change of one `ppo_update` (seq-mean-token-mean, clipping and the behaviour
    cap active) on this rank's share of the batch."""
    # Adam's first step with eps = lr much larger than |g| is the gradient itself.
    cfg = PPOActorConfig(
        path=model_dir, optimizer=OptimizerConfig(lr=1e3, eps=1e3, gradient_clipping=0.0), group_size=GROUP,
        ppo_n_minibatches=n_minibatches, loss_agg="seq-mean-token-mean", eps_clip=0.1, behav_imp_weight_cap=1.3,
        skip_zero_advantage=skip_zero_advantage,
    )  # fmt: skip
    engine = FSDPEngine(cfg)
    engine.initialize(FinetuneSpec(total_train_epochs=1, dataset_size=10, train_batch_size=1))
    try:
        rank, world = engine.data_parallel_rank, engine.data_parallel_world_size
        groups = [g for g in range(N // GROUP) if g % world == rank]
        batch = make_batch()[torch.tensor([g * GROUP + i for g in groups for i in range(GROUP)])]
        actor = PPOActor(cfg, engine)
        logp = actor.compute_logp(batch)
        batch["prox_logp"] = logp + 0.2 * batch["noise"][..., 0]
        batch["logprobs"] = batch["prox_logp"] + 0.2 * batch["noise"][..., 1]
        actor.compute_advantages(batch)
        before = full_params(engine)
        stats = actor.ppo_update(batch)
        after = full_params(engine)
        return {n: after[n] - before[n] for n in before}, stats
    finally:
        engine.destroy()


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    delta, stats = ppo_delta(model_dir)
    if dist.get_rank() == 0:
        torch.save({"delta": delta, "stats": stats}, os.path.join(out, f"ppo_delta_w{dist.get_world_size()}.pt"))
    ppo_delta(model_dir, n_minibatches=2)
    destroy_default_group()


if __name__ == "__main__":
    main()
