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

from areal_lite import kit
from areal_lite.actors.ppo import PPOActor
from areal_lite.api.config_loader import load_config
from areal_lite.api.experiment_config import RLExperimentConfig
from areal_lite.rewards import RewardRunner, exact_answer_reward
from areal_lite.utils.datasets import AdditionTaskConfig, addition_splits
from areal_lite.workflows.envs import MathFeedbackEnv
from areal_lite.workflows.multi_turn import MultiTurnWorkflow


@dataclass
class TaskConfig(AdditionTaskConfig):
    """The addition task of the quickstart, as a conversation."""

    n_eval: int = 200
    """Held-out questions for the mean greedy episode reward before and after."""
    max_turns: int = 3
    """Attempts per episode."""
    turn_discount: float = 0.5
    """A right answer on attempt t (from 0) earns this to the power t."""
    retry_message: str = "Wrong."
    """The environment's reply to a wrong answer (short: the quickstart's model has 64 positions)."""


@dataclass
class MultiTurnConfig(RLExperimentConfig):
    """``gconfig`` is the sampling of each turn (``max_new_tokens`` per turn)."""

    task: TaskConfig = field(default_factory=TaskConfig)


def main(argv: list[str]) -> None:
    cfg = load_config(argv, MultiTurnConfig)
    torch.manual_seed(cfg.seed)
    from transformers import AutoConfig

    from areal_lite.utils.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.tokenizer_path or cfg.actor.path)
    train_problems, eval_problems = addition_splits(cfg.task)

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

    rollout, weight_meta = kit.make_rollout_controller(cfg)
    actor = PPOActor(cfg.actor, kit.make_train_engine(cfg.actor))
    dataloader = kit.rank_dataloader(train_problems, cfg.train_dataset, actor.engine, seed=cfg.seed)
    run = kit.RunKit(cfg, actor.engine, dataloader, tokenizer=tokenizer, rollout=rollout, weight_meta=weight_meta)
    run.start()
    reward_before = run.once("reward_before", lambda: kit.mean_reward(rollout, eval_workflow, eval_problems))

    def evaluate() -> dict[str, float]:
        return {"eval/reward": kit.mean_reward(rollout, eval_workflow, eval_problems)}

    for global_step in range(run.start_step, run.total_steps):
        batch = rollout.prepare_batch(dataloader, workflow=workflow)
        actor.compute_advantages(batch)
        stats = actor.ppo_update(batch)
        actor.step_lr_scheduler()
        kit.sync_weights(rollout, actor.engine, weight_meta, version=global_step + 1)
        stats["num_turns_mean"] = float(batch["num_turns"].mean())
        run.end_step(global_step, stats, evaluate=evaluate)

    reward_after = kit.mean_reward(rollout, eval_workflow, eval_problems)
    run.close()
    rollout.destroy()
    actor.engine.destroy()
    kit.print_rank0(f"RESULT reward_before={reward_before:.3f} reward_after={reward_after:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
