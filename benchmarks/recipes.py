"""The recipe API's training step against the actor's: ``async_map(train_grpo, 64 samples)`` then
``optim_step`` vs `PPOActor.ppo_update` on the same batch with the same settings, on one model.

The recipe path is timed end to end from the event loop (argument checks, queueing, building the
batch, the engine thread, gathering the statistics); ``ppo_update`` is timed inside the engine
thread, so it pays none of that. A third variant shows what packing saves: the same 64 samples
trained one at a time (64 forward-backward passes, then the step). The variants alternate, each
``--repeats`` times after a warm-up, and the medians are compared.

Usage: python benchmarks/recipes.py [--samples 64] [--repeats 7]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import torch
from tensordict import TensorDict

from areal_lite.actors import PPOActor
from areal_lite.api.config import OptimizerConfig, PPOActorConfig
from areal_lite.recipes import ModelBuilder, ModelConfig, TokenizedThread, TokenizedTurn, async_map, shutdown
from areal_lite.utils.tiny import build_tiny_model

CLIP, BETA = 0.2, 0.01


def make_samples(n: int, seed: int) -> list[TokenizedThread]:
    """GRPO-like samples: a 12-token prompt and 8 to 40 completion tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        prompt = torch.randint(3, 250, (12,), generator=g).tolist()
        completion = torch.randint(3, 250, (int(torch.randint(8, 41, (1,), generator=g)),), generator=g).tolist()
        out.append(
            TokenizedThread(
                [
                    TokenizedTurn("user", prompt, [0.0] * len(prompt), ""),
                    TokenizedTurn("assistant", completion, [1.0] * len(completion), ""),
                ]
            )
        )
    return out


def as_batch(
    samples: list[TokenizedThread], old: list[list[float]], ref: list[list[float]], adv: list[float]
) -> TensorDict:
    """The samples as the padded trajectory batch `PPOActor.ppo_update` takes."""
    width = max(len(s) for s in samples)
    n = len(samples)
    out = {k: torch.zeros(n, width) for k in ("logprobs", "prox_logp", "ref_logp", "advantages")}
    ids = torch.zeros(n, width, dtype=torch.int64)
    attn = torch.zeros(n, width, dtype=torch.bool)
    mask = torch.zeros(n, width, dtype=torch.int32)
    for i, s in enumerate(samples):
        ids[i, : len(s)] = torch.tensor(s.tokens)
        attn[i, : len(s)] = True
        trained = torch.tensor([j for j, w in enumerate(s.weights) if w > 0])
        mask[i, trained] = 1
        for key, values in (("logprobs", old[i]), ("prox_logp", old[i]), ("ref_logp", ref[i])):
            out[key][i, trained] = torch.tensor(values)
        out["advantages"][i, trained] = adv[i]
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": mask, "rewards": torch.zeros(n), **out}
    return TensorDict(batch, batch_size=[n])


async def bench(args: argparse.Namespace) -> dict[str, list[float]]:
    path = build_tiny_model(
        tempfile.mkdtemp(), hidden_size=args.hidden, num_layers=args.layers, num_heads=4, num_kv_heads=4
    )
    optimizer = OptimizerConfig(lr=1e-6, gradient_clipping=1.0)
    model = await ModelBuilder(path, ModelConfig(optimizer=optimizer, max_seq_len=64)).spawn_train("bench")
    samples = make_samples(args.samples, seed=0)
    logprobs = await async_map(model.logprobs_per_token, samples)
    ref = [[x - 0.01 for x in lp] for lp in logprobs]
    adv = torch.randn(args.samples, generator=torch.Generator().manual_seed(1)).tolist()
    batch = as_batch(samples, logprobs, ref, adv)
    cfg = PPOActorConfig(
        path=path, optimizer=optimizer, eps_clip=CLIP, kl_ctl=BETA, kl_estimator="k3", behav_imp_weight_cap=None,
        use_decoupled_loss=False,
    )  # fmt: skip
    actor = PPOActor(cfg, model.engine, ref_engine=model.engine)

    async def recipe() -> float:
        t0 = time.perf_counter()
        await async_map(
            lambda i: model.train_grpo(samples[i], logprobs[i], ref[i], adv[i], CLIP, BETA), range(args.samples)
        )
        await model.optim_step()
        return time.perf_counter() - t0

    def timed_update(_engine: object) -> float:
        t0 = time.perf_counter()
        actor.ppo_update(batch)
        return time.perf_counter() - t0

    def one_at_a_time(engine: object) -> float:
        t0 = time.perf_counter()
        for i in range(args.samples):
            model.engine.forward_backward(batch[i : i + 1], actor.loss_fn, actor.loss_weight)
        model.engine.optim_step()
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {"recipe": [], "ppo_update": [], "unpacked": []}
    for r in range(args.repeats + 1):  # the first round warms up
        rec = await recipe()
        upd = await model.with_engine("ppo_update", timed_update)
        unp = await model.with_engine("one_at_a_time", one_at_a_time)
        if r:
            times["recipe"].append(rec)
            times["ppo_update"].append(upd)
            times["unpacked"].append(unp)
    await shutdown(model)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=64, help="samples per step")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (after one warm-up round)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size of the tiny model")
    parser.add_argument("--layers", type=int, default=4, help="layers of the tiny model")
    args = parser.parse_args()
    times = asyncio.run(bench(args))
    median = {k: statistics.median(v) for k, v in times.items()}
    base = median["ppo_update"]
    print(
        f"{args.samples} GRPO samples per step, model hidden {args.hidden} x {args.layers} layers, {args.repeats} rounds"
    )
    print(f"{'variant':<46}{'median s':>10}{'min s':>9}{'max s':>9}{'x ppo_update':>14}")
    names = {
        "ppo_update": "PPOActor.ppo_update (inside the engine thread)",
        "recipe": "async_map(train_grpo) + optim_step (end to end)",
        "unpacked": "one sample at a time, then the step",
    }
    for key in ("ppo_update", "recipe", "unpacked"):
        v = times[key]
        print(f"{names[key]:<46}{median[key]:>10.3f}{min(v):>9.3f}{max(v):>9.3f}{median[key] / base:>14.2f}")
    ratio = median["recipe"] / base
    print(
        f"RESULT recipe_over_ppo_update={ratio:.3f} unpacked_over_ppo_update={median['unpacked'] / base:.3f} "
        f"within_1_2x={ratio <= 1.2}"
    )


if __name__ == "__main__":
    main()
