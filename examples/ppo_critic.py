"""PPO with a learned critic and GAE on the quickstart's addition task.

Classic PPO (Schulman et al. 2017) for language models: a value model (`PPOCritic`, the policy's
architecture with a scalar head) predicts each token's return; advantages are GAE over the tokens
(``actor.adv_estimator=gae``, ``discount``, ``gae_lambda``) with the sequence reward on the last
token; the actor takes clipped (decoupled) PPO steps and the critic clipped value-loss steps on the
same batch. One sample per prompt: no group is needed, the critic is the baseline.

It starts from a model that can already add a little: by default the quickstart's SFT checkpoint
(run ``make demo`` first), or any HF model directory given as ``actor.path``. The critic starts
from ``critic.path`` (the same directory by default) with a new value head.

    python -m areal_lite.launcher.local examples/ppo_critic.py --config configs/ppo_critic.yaml
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, replace

import torch

from areal_lite.actors.ppo import PPOActor, PPOCritic
from areal_lite.api.config import (
    BaseExperimentConfig,
    InferenceEngineConfig,
    LocalEngineConfig,
    PPOActorConfig,
    PPOCriticConfig,
    load_config,
)
from areal_lite.api.io import FinetuneSpec, GenerationConfig
from areal_lite.engines import make_train_engine
from areal_lite.rewards import RewardRunner, exact_answer_reward
from areal_lite.utils.dataloader import stateful_dataloader
from areal_lite.utils.datasets import addition_problems
from areal_lite.utils.evaluator import Evaluator
from areal_lite.utils.recover import RecoverHandler
from areal_lite.utils.rollout import make_rollout, mean_reward
from areal_lite.utils.saver import Saver
from areal_lite.utils.stats_logger import StatsLogger
from areal_lite.utils.step import StepInfo
from areal_lite.workflows.rlvr import RLVRWorkflow


@dataclass
class TaskConfig:
    """The addition task of the quickstart."""

    n_digits: int = 2
    """Digits of each operand."""
    n_train_prompts: int = 16384
    """Training prompts."""
    n_eval: int = 500
    """Held-out problems for the greedy accuracy before and after."""
    seed: int = 0
    """Seed of the problems."""


@dataclass
class PPOCriticExperimentConfig(BaseExperimentConfig):
    task: TaskConfig = field(default_factory=TaskConfig)
    actor: PPOActorConfig = field(default_factory=PPOActorConfig)
    critic: PPOCriticConfig = field(default_factory=PPOCriticConfig)
    rollout: InferenceEngineConfig = field(default_factory=InferenceEngineConfig)
    local_engine: LocalEngineConfig = field(default_factory=LocalEngineConfig)
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    weight_update: str = "disk"
    """How weights reach remote servers: disk or distributed (launcher.backend=local copies in process)."""


def main(argv: list[str]) -> None:
    cfg = load_config(argv, PPOCriticExperimentConfig)
    torch.manual_seed(cfg.seed)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path or cfg.actor.path)
    eval_problems = addition_problems(cfg.task.n_eval, cfg.task.n_digits, seed=cfg.task.seed + 1)
    held_out = {str(p["prompt"]) for p in eval_problems}
    train_problems = addition_problems(cfg.task.n_train_prompts, cfg.task.n_digits, seed=cfg.task.seed + 2, exclude=held_out)
    dataloader = stateful_dataloader(train_problems, batch_size=cfg.train_dataset.batch_size, seed=cfg.seed)

    gconfig = replace(cfg.gconfig, n_samples=cfg.actor.group_size, stop_token_ids=[tokenizer.eos_token_id])
    reward = RewardRunner(exact_answer_reward, num_workers=1)
    workflow = RLVRWorkflow(reward, gconfig, tokenizer, use_chat_template=False)
    eval_workflow = RLVRWorkflow(reward, gconfig.new(n_samples=1, greedy=True), tokenizer, use_chat_template=False)

    rollout, weight_meta = make_rollout(
        cfg.launcher.backend, cfg.rollout, cfg.local_engine, cfg.actor.path, cfg.weight_update, cfg.output_dir
    )
    total_steps = cfg.total_train_steps or cfg.total_train_epochs * len(dataloader)
    # The LR schedule spans this run's steps (total_train_steps may end it before or after the epochs).
    ft_spec = FinetuneSpec(1, total_steps * cfg.train_dataset.batch_size, cfg.train_dataset.batch_size)
    actor = PPOActor(cfg.actor, make_train_engine(cfg.actor))
    actor.engine.initialize(ft_spec)
    actor.engine.connect_engine(rollout, weight_meta)
    critic = PPOCritic(cfg.critic, make_train_engine(cfg.critic))
    critic.engine.initialize(ft_spec)

    saver = Saver(cfg.saver, cfg.output_dir)
    evaluator = Evaluator(cfg.evaluator)
    recover = RecoverHandler(cfg.recover, cfg.output_dir)
    critic_recover = RecoverHandler(cfg.recover, os.path.join(cfg.output_dir, "critic"))
    stats_logger = StatsLogger(cfg.stats_logger, cfg.output_dir, total_steps=total_steps, run_name=cfg.experiment_name)

    info = recover.load(
        actor.engine,
        dataloader=dataloader,
        stats_logger=stats_logger,
        inference_engine=rollout,
        weight_update_meta=weight_meta,
    )
    critic_recover.load(critic.engine)
    if info is None:
        start_step, acc_before = 0, mean_reward(rollout, eval_workflow, eval_problems)
    else:
        start_step, acc_before = info.next_step.global_step, float(info.extra["acc_before"])  # type: ignore[arg-type]
        rollout.executor.load_state_dict(info.extra["rollout"])

    for global_step in range(start_step, total_steps):
        step = StepInfo.at(global_step, len(dataloader))
        batch = rollout.prepare_batch(dataloader, workflow=workflow)
        batch["values"] = critic.compute_values(batch)
        actor.compute_advantages(batch)  # GAE: adds "advantages" and "returns"
        stats = actor.ppo_update(batch)
        stats.update(critic.ppo_update(batch))
        actor.step_lr_scheduler()
        critic.step_lr_scheduler()

        rollout.pause()
        actor.engine.set_version(global_step + 1)
        actor.update_weights(weight_meta)
        rollout.set_version(global_step + 1)
        rollout.resume()

        saver.save(actor.engine, step, tokenizer=tokenizer, last=global_step + 1 == total_steps)
        recover.dump(
            actor.engine,
            step,
            dataloader=dataloader,
            stats_logger=stats_logger,
            extra={"acc_before": acc_before, "rollout": rollout.executor.state_dict()},
        )
        critic_recover.dump(critic.engine, step)
        acc = evaluator.evaluate(lambda: mean_reward(rollout, eval_workflow, eval_problems), step)
        stats_logger.commit(global_step, stats, rollout.executor.stats(), {} if acc is None else {"eval/accuracy": acc})

    acc_after = mean_reward(rollout, eval_workflow, eval_problems)
    stats_logger.close()
    rollout.destroy()
    actor.engine.destroy()
    critic.engine.destroy()
    print(f"RESULT acc_before={acc_before:.3f} acc_after={acc_after:.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
