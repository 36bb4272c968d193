"""Does each algorithm raise its objective? Short runs of PPO with a critic, GRPO, Dr. GRPO, GSPO,
REINFORCE++, ReMax and DPO on a toy verifiable task, with a tiny model on CPU.

Task: after a prompt of 4 symbols from ``0-9+-*/=``, the reward of a completion is the fraction
of its ``MAX_NEW`` token budget spent on lowercase letters (checked on the token ids; an early end
scores what it has). A random model spends about 10% on letters. Each RL algorithm samples groups
of completions from the embedded `LocalInferenceEngine`, trains with `FSDPEngine` through its
actor, and pushes the new weights in-process every step. DPO is online: every step it pairs the
best and the worst of four samples of each prompt from the current policy. (Offline DPO on pairs
from the initial policy only, tried first, reached preference accuracy 1.0 on its pairs without
raising the task reward: 128 pairs of random strings do not teach "letters".) The objective
reported for every algorithm is the mean reward of fresh samples on held-out prompts before and
after; for DPO the training column is its preference accuracy.

    .venv/bin/python benchmarks/algorithms.py [--steps 60] [--only grpo,gspo]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from areal_lite.actors import DPOActor, PPOActor, PPOCritic, ReinforceActor
from areal_lite.api.config import DPOConfig, LocalEngineConfig, OptimizerConfig, PPOActorConfig, PPOCriticConfig
from areal_lite.api.io import (
    FinetuneSpec,
    GenerationConfig,
    MicroBatchSpec,
    ModelRequest,
    ModelResponse,
    WeightUpdateMeta,
)
from areal_lite.engines.local.engine import LocalInferenceEngine
from areal_lite.engines.train.fsdp import FSDPEngine
from areal_lite.utils.data import concat_padded
from areal_lite.utils.tiny import build_tiny_model
from areal_lite.workflows.trajectory import from_response

MAX_NEW = 8
PROMPTS_PER_STEP = 8
GROUP = 4
EVAL_PROMPTS = 32
LR = 3e-3


@dataclass
class Task:
    tokenizer: object
    letters: frozenset[int]

    def prompt(self, rng: random.Random) -> list[int]:
        text = "".join(rng.choice("0123456789+-*/=") for _ in range(4))
        return self.tokenizer.encode(text)  # type: ignore[attr-defined]

    def reward(self, resp: ModelResponse) -> float:
        return sum(t in self.letters for t in resp.output_tokens) / MAX_NEW


def sample(engine: LocalInferenceEngine, prompts: list[list[int]], n: int, greedy: bool = False) -> list[ModelResponse]:
    """``n`` completions of every prompt, in prompt order (a prompt's samples are consecutive)."""
    g = GenerationConfig(max_new_tokens=MAX_NEW, greedy=greedy)

    async def run() -> list[ModelResponse]:
        return await asyncio.gather(
            *[engine.agenerate(ModelRequest(input_ids=p, gconfig=g)) for p in prompts for _ in range(n)]
        )

    return asyncio.run(run())


def evaluate(engine: LocalInferenceEngine, task: Task) -> float:
    rng = random.Random(12345)
    resps = sample(engine, [task.prompt(rng) for _ in range(EVAL_PROMPTS)], 4)
    return sum(task.reward(r) for r in resps) / len(resps)


def rollout(engine: LocalInferenceEngine, task: Task, rng: random.Random, baseline: bool = False) -> TensorDict:
    prompts = [task.prompt(rng) for _ in range(PROMPTS_PER_STEP)]
    resps = sample(engine, prompts, GROUP)
    extra: list[dict[str, float]] = [{} for _ in resps]
    if baseline:
        greedy = sample(engine, prompts, 1, greedy=True)
        extra = [{"baseline_rewards": task.reward(greedy[i // GROUP])} for i in range(len(resps))]
    return concat_padded([from_response(r, task.reward(r), **e) for r, e in zip(resps, extra)])


class Run:
    """A policy engine, an inference engine that receives its weights, and the push between them."""

    def __init__(self, model_dir: str, cfg: PPOActorConfig | DPOConfig, steps: int, seed: int) -> None:
        self.engine = FSDPEngine(cfg)
        self.engine.initialize(FinetuneSpec(total_train_epochs=1, dataset_size=steps, train_batch_size=1))
        self.rollout = LocalInferenceEngine(LocalEngineConfig(path=model_dir, seed=seed))
        self.rollout.initialize()
        self.meta = WeightUpdateMeta(type="in_process")
        self.engine.connect_engine(self.rollout, self.meta)
        self.version = 0

    def push(self) -> None:
        self.version += 1
        self.engine.set_version(self.version)
        self.engine.update_weights(self.meta)

    def close(self) -> None:
        self.rollout.destroy()
        self.engine.destroy()


def ppo_config(model_dir: str, **kw: object) -> PPOActorConfig:
    base = {
        "path": model_dir,
        "optimizer": OptimizerConfig(lr=LR),
        "group_size": GROUP,
        "ppo_n_minibatches": 2,
        "behav_imp_weight_cap": 5.0,
    }
    base.update(kw)
    return PPOActorConfig(**base)  # type: ignore[arg-type]


def run_rl(
    model_dir: str, task: Task, steps: int, cfg: PPOActorConfig, reinforce: bool = False, critic: bool = False
) -> tuple[float, float, list[float]]:
    run = Run(model_dir, cfg, steps, seed=1)
    value_model = None
    ref_engines: list[FSDPEngine] = []
    try:
        actor = ReinforceActor(cfg, run.engine) if reinforce else PPOActor(cfg, run.engine)
        if critic:
            ccfg = PPOCriticConfig(
                path=model_dir, optimizer=OptimizerConfig(lr=LR), group_size=GROUP, ppo_n_minibatches=2
            )
            critic_engine = FSDPEngine(ccfg)
            critic_engine.initialize(FinetuneSpec(total_train_epochs=1, dataset_size=steps, train_batch_size=1))
            ref_engines.append(critic_engine)
            value_model = PPOCritic(ccfg, critic_engine)
        before = evaluate(run.rollout, task)
        rng = random.Random(0)
        curve = []
        for _ in range(steps):
            batch = rollout(run.rollout, task, rng, baseline=cfg.adv_estimator == "remax")
            curve.append(float(batch["rewards"].mean()))
            if not reinforce:
                batch["prox_logp"] = actor.compute_logp(batch)
            if value_model is not None:
                batch["values"] = value_model.compute_values(batch)
            actor.compute_advantages(batch)
            actor.ppo_update(batch)
            if value_model is not None:
                value_model.ppo_update(batch)
            actor.step_lr_scheduler()
            run.push()
        return before, evaluate(run.rollout, task), curve
    finally:
        for e in ref_engines:
            e.destroy()
        run.close()


def preference_pairs(engine: LocalInferenceEngine, task: Task, rng: random.Random) -> TensorDict:
    """Rows 2i, 2i+1: the best and the worst of ``GROUP`` samples of a prompt (prompts whose
    samples all score the same give no pair)."""
    pairs: list[TensorDict] = []
    while len(pairs) < 2 * PROMPTS_PER_STEP:
        group = sorted(sample(engine, [task.prompt(rng)], GROUP), key=task.reward)
        worst, best = group[0], group[-1]
        if task.reward(best) > task.reward(worst):
            pairs += [from_response(best, task.reward(best)), from_response(worst, task.reward(worst))]
    return concat_padded(pairs)


def run_dpo(model_dir: str, task: Task, steps: int) -> tuple[float, float, list[float]]:
    """Online DPO (Guo et al. 2024): fresh pairs from the current policy every step, against the
    frozen initial policy as the reference."""
    cfg = DPOConfig(path=model_dir, optimizer=OptimizerConfig(lr=LR), beta=0.1, mb_spec=MicroBatchSpec(granularity=2))
    run = Run(model_dir, cfg, steps, seed=1)
    ref = FSDPEngine(cfg)
    ref.initialize(None)
    try:
        actor = DPOActor(cfg, run.engine, ref)
        before = evaluate(run.rollout, task)
        rng = random.Random(0)
        curve = []
        for _ in range(steps):
            stats = actor.train_dpo(preference_pairs(run.rollout, task, rng))
            curve.append(stats["reward_accuracy"])
            actor.step_lr_scheduler()
            run.push()
        return before, evaluate(run.rollout, task), curve
    finally:
        ref.destroy()
        run.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--only", default="", help="comma-separated algorithm names")
    args = parser.parse_args()
    torch.manual_seed(0)
    model_dir = os.path.join(tempfile.mkdtemp(prefix="areal-alg-"), "model")
    build_tiny_model(model_dir, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=259)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    task = Task(tok, frozenset(tok.convert_tokens_to_ids(list("abcdefghijklmnopqrstuvwxyz"))))

    algos: dict[str, Callable[[], tuple[float, float, list[float]]]] = {
        "ppo_critic": lambda: run_rl(
            model_dir, task, args.steps, ppo_config(model_dir, adv_estimator="gae", gae_lambda=0.95), critic=True
        ),
        "grpo": lambda: run_rl(model_dir, task, args.steps, ppo_config(model_dir, adv_estimator="grpo")),
        "dr_grpo": lambda: run_rl(
            model_dir, task, args.steps, ppo_config(model_dir, adv_estimator="dr_grpo", loss_agg="seq-mean-token-sum")
        ),
        "gspo": lambda: run_rl(
            model_dir,
            task,
            args.steps,
            ppo_config(
                model_dir, policy_loss="gspo", eps_clip=3e-4, eps_clip_higher=4e-4, loss_agg="seq-mean-token-mean"
            ),
        ),
        "reinforce_pp": lambda: run_rl(
            model_dir, task, args.steps, ppo_config(model_dir, adv_estimator="reinforce_pp"), reinforce=True
        ),
        "remax": lambda: run_rl(
            model_dir, task, args.steps, ppo_config(model_dir, adv_estimator="remax"), reinforce=True
        ),
        "dpo": lambda: run_dpo(model_dir, task, args.steps),
    }
    chosen = [a for a in args.only.split(",") if a] or list(algos)
    rows = []
    for name in chosen:
        t0 = time.perf_counter()
        before, after, curve = algos[name]()
        k = max(1, len(curve) // 5)
        rows.append((name, before, after, sum(curve[:k]) / k, sum(curve[-k:]) / k, time.perf_counter() - t0))
    print(f"{'algorithm':<14}{'eval before':>12}{'eval after':>12}{'train first':>13}{'train last':>12}{'seconds':>9}")
    for name, before, after, first, last, secs in rows:
        print(f"{name:<14}{before:>12.3f}{after:>12.3f}{first:>13.3f}{last:>12.3f}{secs:>9.1f}")
    print(
        "(eval: mean reward of 4 samples on each of 32 held-out prompts; train: batch reward over the first and last"
        " fifth of the steps, for dpo the preference accuracy on its pairs)"
    )
    raised = sum(after > before for _, before, after, *_ in rows)
    print(
        "RESULT "
        + " ".join(f"{n}_before={b:.3f} {n}_after={a:.3f}" for n, b, a, *_ in rows)
        + f" raised={raised}/{len(rows)} steps={args.steps}"
    )


if __name__ == "__main__":
    main()
