"""RL on a verifiers environment, on CPU: a tiny model learns to reverse the digits of a number.

The environment is plain verifiers v1 code (`examples/reverse_digits.py`: a ``Taskset``, a ``Task``
with one ``@vf.reward``), run by ``vf.SingleAgentEnv`` with a harness that works offline
(``areal_lite_harness`` in the ``subprocess`` runtime). `VerifiersWorkflow` runs its episodes: the
harness's model calls reach the rollout engine through the recording proxy, so they come back as
trajectory tokens with their log-probabilities and versions, and the rubric's score is the reward.

A short SFT warm-up on the tasks' answers teaches the format partly, stopping once the dev reward
reaches ``task.sft_target_reward``; RL then raises the held-out reward. The advantage is
``rewards - baseline_rewards`` (``adv_estimator: remax``), the baseline being the mean reward of
the task's episodes (Dr. GRPO over episodes, as in examples/agent.py).

    make verifiers-example   # builds .venv-verifiers (verifiers needs openai<3), then runs:
    python -m areal_lite.launcher.local examples/verifiers_rl.py --config configs/verifiers.yaml
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import verifiers.v1 as vf

# verifiers imports the taskset by module name: this script's directory is on the path (as the
# directory of the script Python runs), so examples/reverse_digits.py is found.
from reverse_digits import ReverseConfig
from tensordict import TensorDict

from areal_lite import kit
from areal_lite.actors.ppo import PPOActor
from areal_lite.api.experiment_config import RLExperimentConfig
from areal_lite.utils.tiny import build_tiny_model, build_tokenizer
from areal_lite.workflows.agent import episode_means
from areal_lite.workflows.trajectory import encode_chat
from areal_lite.workflows.verifiers_env import VerifiersWorkflow, local_agent, task_items

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class TaskConfig(kit.RewardWarmUpConfig):
    """The verifiers taskset (its items are tasks; the dev tasks' numbers are neither held out nor
    trained on) and the SFT warm-up."""

    n_digits: int = 3
    """Digits of each number."""
    n_train: int = 600
    """Training tasks."""
    in_process: bool = True
    """Run the harness's chat from this process (no program start per episode): see areal_lite_harness."""


def default_task() -> TaskConfig:
    """This task's warm-up: more dev tasks, steps and demonstrations, up to a higher dev reward."""
    return TaskConfig(n_dev=32, sft_steps=400, sft_target_reward=0.5, sft_eval_every=10, sft_batch_size=32)


@dataclass
class VerifiersExperimentConfig(RLExperimentConfig):
    """``gconfig`` is the sampling of each model call; ``actor.group_size`` is the number of episodes
    per task."""

    task: TaskConfig = field(default_factory=default_task)


def make_env(task: TaskConfig, n_tasks: int, seed: int, exclude: list[str] | None = None) -> vf.Env:
    """The verifiers env over ``n_tasks`` reversal tasks, its agent a local harness."""
    taskset = ReverseConfig(id="reverse_digits", n_digits=task.n_digits, n_tasks=n_tasks, seed=seed,
                            exclude=exclude or [])  # fmt: skip
    return vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset=taskset, agent=local_agent(in_process=task.in_process)))


def numbers(env: vf.Env) -> list[str]:
    return [t.data.answer[::-1] for t in env.taskset]


def demonstrations(tokenizer: object, env: vf.Env) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) per task: its prompt as the harness sends it, rendered by the chat
    template as the recording proxy renders it, then the answer and the end of the turn."""
    out = []
    for task in env.taskset:
        prompt = encode_chat(tokenizer, [{"role": "user", "content": task.data.prompt}])
        answer = list(tokenizer(task.data.answer + tokenizer.eos_token, add_special_tokens=False)["input_ids"])  # type: ignore[operator]
        out.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    return out


def warm_up(cfg: VerifiersExperimentConfig, base_dir: str, sft_dir: str, train: vf.Env, dev: vf.Env) -> None:
    """Build the tiny model (its tokenizer's merges learnt on a prompt with the digits left out, so
    every digit is a token), then SFT on the training tasks' answers until the dev greedy reward
    reaches ``task.sft_target_reward``."""
    task = cfg.task

    def build() -> None:
        example = build_tokenizer(vocab_size=0)
        text = example.apply_chat_template([{"role": "user", "content": "Reverse the digits of ."}], tokenize=False,
                                           add_generation_prompt=True)  # fmt: skip
        build_tiny_model(base_dir, hidden_size=task.hidden_size, num_layers=task.num_layers, corpus=[text],
                         vocab_size=512, max_position_embeddings=256, seed=task.seed)  # fmt: skip

    def batches(tokenizer: PreTrainedTokenizerBase, rank: int, world: int) -> Iterator[TensorDict]:
        return kit.resampled_batches(
            demonstrations(tokenizer, train)[rank::world], task.sft_batch_size, task.seed + rank
        )

    def greedy(tokenizer: PreTrainedTokenizerBase) -> VerifiersWorkflow:
        return VerifiersWorkflow(dev, cfg.gconfig.new(n_samples=1, greedy=True), tokenizer)

    engine_cfg = kit.warm_up_engine_config(cfg, base_dir, seed=task.seed)
    kit.warm_up_with_sft(
        cfg, engine_cfg, sft_dir, build=build, batches=batches, judge=greedy, dev=task_items(dev.taskset),
        lr=task.sft_lr, max_steps=task.sft_steps, eval_every=task.sft_eval_every, target=task.sft_target_reward,
        score_name="dev reward",
    )  # fmt: skip


def main(argv: list[str]) -> None:
    cfg = kit.load_config_and_seed(argv, VerifiersExperimentConfig)
    t0 = time.time()
    task = cfg.task
    base_dir, sft_dir = os.path.join(cfg.output_dir, "base_model"), os.path.join(cfg.output_dir, "sft_model")
    held_out = make_env(task, task.n_eval, seed=task.seed + 1)
    train = make_env(task, task.n_train, seed=task.seed + 2, exclude=numbers(held_out))
    dev = make_env(task, task.n_dev, seed=task.seed + 3, exclude=numbers(held_out) + numbers(train))
    actor_cfg = replace(cfg.actor, path=sft_dir, group_size=1)  # an episode may split: no fixed-size groups
    actor = PPOActor(actor_cfg, kit.make_train_engine(actor_cfg))
    actor.engine.create_process_group()  # before SFT's: torchrun's group cannot be re-made
    if not os.path.exists(os.path.join(sft_dir, "config.json")):
        warm_up(cfg, base_dir, sft_dir, train, dev)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(sft_dir)
    workflow = VerifiersWorkflow(train, cfg.gconfig.new(n_samples=cfg.actor.group_size), tokenizer)
    eval_workflow = VerifiersWorkflow(held_out, cfg.gconfig.new(n_samples=1, greedy=True), tokenizer)
    eval_items = task_items(held_out.taskset)

    rollout, weight_meta = kit.make_rollout_controller(cfg, sft_dir)
    dataloader = kit.rank_dataloader(task_items(train.taskset), cfg.train_dataset, actor.engine, seed=cfg.seed)
    run = kit.RunKit(cfg, actor.engine, dataloader, tokenizer=tokenizer, rollout=rollout, weight_meta=weight_meta)
    run.start()
    score = kit.HeldOutScore(rollout, eval_workflow, eval_items, "eval/reward")
    before = run.once("reward_before", score)
    kit.print_rank0(f"[verifiers] held-out greedy reward after SFT: {before:.3f}")

    for global_step in range(run.start_step, run.total_steps):
        batch, stats = run.rl_step(actor, workflow, global_step)  # the quickstart's step
        stats.update(episode_means(batch))
        run.end_step(global_step, stats, evaluate=score.evaluate)

    after = score()
    run.finish(f"reward_before={before:.3f} reward_after={after:.3f} minutes={(time.time() - t0) / 60:.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
