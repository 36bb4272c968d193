"""ReMax on the quickstart's addition task: REINFORCE with the greedy answer's reward as baseline.

ReMax (Li et al. 2023, Algorithm 1) samples one answer per prompt and also decodes the greedy
answer; the advantage of the sample is ``reward - reward(greedy)``, so no critic and no group of
samples is needed (`ReMaxWorkflow` returns the sample with ``baseline_rewards``;
``actor.adv_estimator=remax``). The update is plain REINFORCE (`ReinforceActor`: one policy-
gradient step per batch, no ratio clipping), as in the paper.

It starts from a model that can already add a little: by default the quickstart's SFT checkpoint
(run ``make demo`` first), or any HF model directory given as ``actor.path``.

    python -m areal_lite.launcher.local examples/remax.py --config configs/remax.yaml
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace

import torch

from areal_lite import kit
from areal_lite.actors.reinforce import ReinforceActor
from areal_lite.api.config_loader import load_config
from areal_lite.api.experiment_config import RLExperimentConfig
from areal_lite.rewards import RewardRunner, exact_answer_reward
from areal_lite.utils.datasets import AdditionTaskConfig, addition_splits
from areal_lite.workflows.remax import ReMaxWorkflow
from areal_lite.workflows.rlvr import RLVRWorkflow


@dataclass
class ReMaxConfig(RLExperimentConfig):
    task: AdditionTaskConfig = field(default_factory=AdditionTaskConfig)


def main(argv: list[str]) -> None:
    cfg = load_config(argv, ReMaxConfig)
    torch.manual_seed(cfg.seed)
    from areal_lite.utils.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.tokenizer_path or cfg.actor.path)
    train_problems, eval_problems = addition_splits(cfg.task)

    # n_samples sampled answers per prompt, each scored against the prompt's greedy answer.
    gconfig = replace(cfg.gconfig, stop_token_ids=[tokenizer.eos_token_id])
    reward = RewardRunner(exact_answer_reward, num_workers=1)
    workflow = ReMaxWorkflow(reward, gconfig, tokenizer, use_chat_template=False)
    eval_workflow = RLVRWorkflow(reward, gconfig.new(n_samples=1, greedy=True), tokenizer, use_chat_template=False)

    rollout, weight_meta = kit.make_rollout_controller(cfg)
    actor = ReinforceActor(cfg.actor, kit.make_train_engine(cfg.actor))
    dataloader = kit.rank_dataloader(train_problems, cfg.train_dataset, actor.engine, seed=cfg.seed)
    run = kit.RunKit(cfg, actor.engine, dataloader, tokenizer=tokenizer, rollout=rollout, weight_meta=weight_meta)
    run.start()
    acc_before = run.once("acc_before", lambda: kit.mean_reward(rollout, eval_workflow, eval_problems))

    def evaluate() -> dict[str, float]:
        return {"eval/accuracy": kit.mean_reward(rollout, eval_workflow, eval_problems)}

    for global_step in range(run.start_step, run.total_steps):
        batch = rollout.prepare_batch(dataloader, workflow=workflow)
        actor.compute_advantages(batch)  # adv_estimator=remax: reward - baseline_rewards
        stats = actor.ppo_update(batch)
        actor.step_lr_scheduler()
        kit.sync_weights(rollout, actor.engine, weight_meta, version=global_step + 1)
        stats["baseline_reward_mean"] = float(batch["baseline_rewards"].mean())
        run.end_step(global_step, stats, evaluate=evaluate)

    acc_after = kit.mean_reward(rollout, eval_workflow, eval_problems)
    run.close()
    rollout.destroy()
    actor.engine.destroy()
    kit.print_rank0(f"RESULT acc_before={acc_before:.3f} acc_after={acc_after:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
