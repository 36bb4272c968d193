"""GRPO's successors on the quickstart's addition task, one config file each.

The loop is the quickstart's asynchronous GRPO loop; a preset only chooses, in its config's
``actor`` section, which functions of `areal_lite.algorithms.functional` compute the advantages,
the policy loss and its aggregation:

| config             | advantage (``adv_estimator``) | policy loss                      | aggregation (``loss_agg``) | also |
|--------------------|-------------------------------|----------------------------------|----------------------------|------|
| ``dapo.yaml``      | group-normalised (grpo)       | PPO, clip-higher 0.2 / 0.28      | token-mean                 | dynamic sampling, soft overlong penalty |
| ``dr_grpo.yaml``   | group mean only (dr_grpo)     | PPO                              | seq-mean-token-sum         | |
| ``gspo.yaml``      | group-normalised (grpo)       | GSPO, sequence ratio, 3e-4/4e-4  | seq-mean-token-mean        | |
| ``rloo.yaml``      | leave-one-out (rloo)          | REINFORCE                        | seq-mean-token-sum         | |

DAPO (Yu et al. 2025) drops groups whose samples all got the same reward (``dynamic_sampling``,
`rewards_differ`: their advantages are zero) and keeps drawing prompts until a batch is full of
groups with signal. Dr. GRPO (Liu et al. 2025) removes GRPO's std and length normalisations; GSPO
(Zheng et al. 2025) clips a sequence-level ratio; RLOO (Ahmadian et al. 2024) is REINFORCE with
each sample's baseline the mean reward of the others. Every preset keeps decoupled PPO's
behaviour weight for the stale tokens of asynchronous rollouts (``behav_imp_weight_*``).

It starts from a model that can already add a little: by default the quickstart's SFT checkpoint
(run ``make demo`` first), or any HF model directory given as ``actor.path``.

    python -m areal_lite.launcher.local examples/presets.py --config configs/dapo.yaml
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace

from areal_lite import kit
from areal_lite.actors.ppo import PPOActor
from areal_lite.api.experiment_config import RLExperimentConfig
from areal_lite.rewards import RewardRunner, exact_answer_reward
from areal_lite.utils.datasets import AdditionTaskConfig, addition_splits
from areal_lite.workflows.rlvr import RLVRWorkflow, rewards_differ


@dataclass
class PresetConfig(RLExperimentConfig):
    task: AdditionTaskConfig = field(default_factory=AdditionTaskConfig)
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and draw more prompts instead (DAPO)."""


def main(argv: list[str]) -> None:
    cfg = kit.load_config_and_seed(argv, PresetConfig)
    from areal_lite.utils.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.tokenizer_path or cfg.actor.path)
    train_problems, eval_problems = addition_splits(cfg.task)

    gconfig = replace(cfg.gconfig, n_samples=cfg.actor.group_size, stop_token_ids=[tokenizer.eos_token_id])
    reward = RewardRunner(exact_answer_reward, mode="inline")  # a string comparison: no worker needed
    workflow = RLVRWorkflow(reward, gconfig, tokenizer, use_chat_template=False)
    eval_workflow = RLVRWorkflow(reward, gconfig.new(n_samples=1, greedy=True), tokenizer, use_chat_template=False)
    should_accept = rewards_differ if cfg.dynamic_sampling else None

    rollout, weight_meta = kit.make_rollout_controller(cfg)
    actor = PPOActor(cfg.actor, kit.make_train_engine(cfg.actor))
    dataloader = kit.rank_dataloader(train_problems, cfg.train_dataset, actor.engine, seed=cfg.seed)
    run = kit.RunKit(cfg, actor.engine, dataloader, tokenizer=tokenizer, rollout=rollout, weight_meta=weight_meta)
    run.start()
    score = kit.HeldOutScore(rollout, eval_workflow, eval_problems, "eval/accuracy")
    acc_before = run.once("acc_before", score)

    for global_step in range(run.start_step, run.total_steps):
        _, stats = run.rl_step(actor, workflow, global_step, should_accept=should_accept)  # the quickstart's step
        run.end_step(global_step, stats, evaluate=score.evaluate)

    acc_after = score()
    rejected = rollout.stats().get("rollout/rejected", 0.0)
    run.finish(f"acc_before={acc_before:.3f} acc_after={acc_after:.3f} rejected_groups={rejected:.0f}")


if __name__ == "__main__":
    main(sys.argv[1:])
