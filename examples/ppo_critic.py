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

import sys
from dataclasses import dataclass, field, replace

import torch

from areal_lite import kit
from areal_lite.actors.ppo import PPOActor, PPOCritic
from areal_lite.api.config import PPOCriticConfig
from areal_lite.api.config_loader import load_config
from areal_lite.api.experiment_config import RLExperimentConfig
from areal_lite.rewards import RewardRunner, exact_answer_reward
from areal_lite.utils.datasets import AdditionTaskConfig, addition_splits
from areal_lite.workflows.rlvr import RLVRWorkflow


@dataclass
class PPOCriticExperimentConfig(RLExperimentConfig):
    task: AdditionTaskConfig = field(default_factory=AdditionTaskConfig)
    critic: PPOCriticConfig = field(default_factory=PPOCriticConfig)


def main(argv: list[str]) -> None:
    cfg = load_config(argv, PPOCriticExperimentConfig)
    torch.manual_seed(cfg.seed)
    from areal_lite.utils.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.tokenizer_path or cfg.actor.path)
    train_problems, eval_problems = addition_splits(cfg.task)

    gconfig = replace(cfg.gconfig, n_samples=cfg.actor.group_size, stop_token_ids=[tokenizer.eos_token_id])
    reward = RewardRunner(exact_answer_reward, num_workers=1)
    workflow = RLVRWorkflow(reward, gconfig, tokenizer, use_chat_template=False)
    eval_workflow = RLVRWorkflow(reward, gconfig.new(n_samples=1, greedy=True), tokenizer, use_chat_template=False)

    rollout, weight_meta = kit.make_rollout_controller(cfg)
    actor = PPOActor(cfg.actor, kit.make_train_engine(cfg.actor))
    critic = PPOCritic(cfg.critic, kit.make_train_engine(cfg.critic))
    dataloader = kit.rank_dataloader(train_problems, cfg.train_dataset, actor.engine, seed=cfg.seed)
    run = kit.RunKit(
        cfg,
        actor.engine,
        dataloader,
        tokenizer=tokenizer,
        rollout=rollout,
        weight_meta=weight_meta,
        others={"critic": critic.engine},
    )
    run.start()  # the critic too
    acc_before = run.once("acc_before", lambda: kit.mean_reward(rollout, eval_workflow, eval_problems))

    def evaluate() -> dict[str, float]:
        return {"eval/accuracy": kit.mean_reward(rollout, eval_workflow, eval_problems)}

    for global_step in range(run.start_step, run.total_steps):
        batch = rollout.prepare_batch(dataloader, workflow=workflow)
        batch["values"] = critic.compute_values(batch)
        actor.compute_advantages(batch)  # GAE: adds "advantages" and "returns"
        stats = actor.ppo_update(batch)
        stats.update(critic.ppo_update(batch))
        actor.step_lr_scheduler()
        critic.step_lr_scheduler()
        kit.sync_weights(rollout, actor.engine, weight_meta, version=global_step + 1)
        run.end_step(global_step, stats, evaluate=evaluate)

    acc_after = kit.mean_reward(rollout, eval_workflow, eval_problems)
    run.close()
    rollout.destroy()
    actor.engine.destroy()
    critic.engine.destroy()
    kit.print_rank0(f"RESULT acc_before={acc_before:.3f} acc_after={acc_after:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
