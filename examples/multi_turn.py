"""Multi-turn GRPO: the model answers, hears whether it was right, and may try again.

`MultiTurnWorkflow` runs ``actor.group_size`` episodes per question against `MathFeedbackEnv`
(areal_lite/workflows/envs.py): a wrong answer gets ``task.retry_message`` and another turn, up to
``max_turns`` (fewer when the conversation would outgrow the model's context); a right answer on
turn t earns ``turn_discount**t``. The trajectory is the whole conversation as the model saw it,
token for token; only the model's own tokens are trained on (the feedback and the chat-template
glue have ``loss_mask`` 0). Group-normalised advantages over the episodes of a question and the
decoupled PPO loss, as in the quickstart.

The questions are the quickstart's additions asked in a chat (``57+68=`` as a user turn). By
default it starts from the quickstart's SFT checkpoint (``make demo`` first), which was trained
without a chat template, so expect low rewards at first; any chat model can be ``actor.path``.

    python -m areal_lite.launcher.local examples/multi_turn.py --config configs/multi_turn.yaml
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace

import torch

from areal_lite.actors.ppo import PPOActor
from areal_lite.api.config import (
    BaseExperimentConfig,
    InferenceEngineConfig,
    LocalEngineConfig,
    PPOActorConfig,
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
from areal_lite.workflows.envs import MathFeedbackEnv
from areal_lite.workflows.multi_turn import MultiTurnWorkflow


@dataclass
class TaskConfig:
    """The addition task of the quickstart, as a conversation."""

    n_digits: int = 2
    """Digits of each operand."""
    n_train_prompts: int = 16384
    """Training questions."""
    n_eval: int = 200
    """Held-out questions for the mean greedy episode reward before and after."""
    seed: int = 0
    """Seed of the problems."""
    max_turns: int = 3
    """Attempts per episode."""
    turn_discount: float = 0.5
    """A right answer on attempt t (from 0) earns this to the power t."""
    retry_message: str = "Wrong."
    """The environment's reply to a wrong answer (short: the quickstart's model has 64 positions)."""


@dataclass
class MultiTurnConfig(BaseExperimentConfig):
    task: TaskConfig = field(default_factory=TaskConfig)
    actor: PPOActorConfig = field(default_factory=PPOActorConfig)
    rollout: InferenceEngineConfig = field(default_factory=InferenceEngineConfig)
    local_engine: LocalEngineConfig = field(default_factory=LocalEngineConfig)
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    """Sampling of each turn (``max_new_tokens`` per turn)."""
    weight_update: str = "disk"
    """How weights reach remote servers: disk or distributed (launcher.backend=local copies in process)."""


def main(argv: list[str]) -> None:
    cfg = load_config(argv, MultiTurnConfig)
    torch.manual_seed(cfg.seed)
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path or cfg.actor.path)
    eval_problems = addition_problems(cfg.task.n_eval, cfg.task.n_digits, seed=cfg.task.seed + 1)
    held_out = {str(p["prompt"]) for p in eval_problems}
    train_problems = addition_problems(cfg.task.n_train_prompts, cfg.task.n_digits, seed=cfg.task.seed + 2, exclude=held_out)
    dataloader = stateful_dataloader(train_problems, batch_size=cfg.train_dataset.batch_size, seed=cfg.seed)

    # One grader serves every episode.
    grader = RewardRunner(exact_answer_reward, num_workers=1)
    gconfig = replace(cfg.gconfig, n_samples=cfg.actor.group_size, stop_token_ids=[tokenizer.eos_token_id])
    # An episode ends early rather than overflow the model's context.
    context = AutoConfig.from_pretrained(cfg.actor.path).max_position_embeddings
    turns = {"max_turns": cfg.task.max_turns, "turn_discount": cfg.task.turn_discount, "max_context_tokens": context}

    def env() -> MathFeedbackEnv:  # a new environment per episode
        return MathFeedbackEnv(grader, retry_message=cfg.task.retry_message)

    workflow = MultiTurnWorkflow(env, gconfig, tokenizer, **turns)
    eval_workflow = MultiTurnWorkflow(env, gconfig.new(n_samples=1, greedy=True), tokenizer, **turns)

    rollout, weight_meta = make_rollout(
        cfg.launcher.backend, cfg.rollout, cfg.local_engine, cfg.actor.path, cfg.weight_update, cfg.output_dir
    )
    total_steps = cfg.total_train_steps or cfg.total_train_epochs * len(dataloader)
    actor = PPOActor(cfg.actor, make_train_engine(cfg.actor))
    # The LR schedule spans this run's steps (total_train_steps may end it before or after the epochs).
    actor.engine.initialize(FinetuneSpec(1, total_steps * cfg.train_dataset.batch_size, cfg.train_dataset.batch_size))
    actor.engine.connect_engine(rollout, weight_meta)

    saver = Saver(cfg.saver, cfg.output_dir)
    evaluator = Evaluator(cfg.evaluator)
    recover = RecoverHandler(cfg.recover, cfg.output_dir)
    stats_logger = StatsLogger(cfg.stats_logger, cfg.output_dir, total_steps=total_steps, run_name=cfg.experiment_name)

    info = recover.load(
        actor.engine,
        dataloader=dataloader,
        stats_logger=stats_logger,
        inference_engine=rollout,
        weight_update_meta=weight_meta,
    )
    if info is None:
        start_step, reward_before = 0, mean_reward(rollout, eval_workflow, eval_problems)
    else:
        start_step, reward_before = info.next_step.global_step, float(info.extra["reward_before"])  # type: ignore[arg-type]
        rollout.executor.load_state_dict(info.extra["rollout"])

    for global_step in range(start_step, total_steps):
        step = StepInfo.at(global_step, len(dataloader))
        batch = rollout.prepare_batch(dataloader, workflow=workflow)
        actor.compute_advantages(batch)
        stats = actor.ppo_update(batch)
        actor.step_lr_scheduler()

        rollout.pause()
        actor.engine.set_version(global_step + 1)
        actor.update_weights(weight_meta)
        rollout.set_version(global_step + 1)
        rollout.resume()

        stats["num_turns_mean"] = float(batch["num_turns"].mean())
        saver.save(actor.engine, step, tokenizer=tokenizer, last=global_step + 1 == total_steps)
        recover.dump(
            actor.engine,
            step,
            dataloader=dataloader,
            stats_logger=stats_logger,
            extra={"reward_before": reward_before, "rollout": rollout.executor.state_dict()},
        )
        score = evaluator.evaluate(lambda: mean_reward(rollout, eval_workflow, eval_problems), step)
        stats_logger.commit(
            global_step, stats, rollout.executor.stats(), {} if score is None else {"eval/reward": score}
        )

    reward_after = mean_reward(rollout, eval_workflow, eval_problems)
    stats_logger.close()
    rollout.destroy()
    actor.engine.destroy()
    print(f"RESULT reward_before={reward_before:.3f} reward_after={reward_after:.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
