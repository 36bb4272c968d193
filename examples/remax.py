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

from areal_lite.actors.reinforce import ReinforceActor
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
from areal_lite.workflows.remax import ReMaxWorkflow
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
class ReMaxConfig(BaseExperimentConfig):
    task: TaskConfig = field(default_factory=TaskConfig)
    actor: PPOActorConfig = field(default_factory=PPOActorConfig)
    rollout: InferenceEngineConfig = field(default_factory=InferenceEngineConfig)
    local_engine: LocalEngineConfig = field(default_factory=LocalEngineConfig)
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    weight_update: str = "disk"
    """How weights reach remote servers: disk or distributed (launcher.backend=local copies in process)."""


def main(argv: list[str]) -> None:
    cfg = load_config(argv, ReMaxConfig)
    torch.manual_seed(cfg.seed)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path or cfg.actor.path)
    eval_problems = addition_problems(cfg.task.n_eval, cfg.task.n_digits, seed=cfg.task.seed + 1)
    held_out = {str(p["prompt"]) for p in eval_problems}
    train_problems = addition_problems(cfg.task.n_train_prompts, cfg.task.n_digits, seed=cfg.task.seed + 2, exclude=held_out)
    dataloader = stateful_dataloader(train_problems, batch_size=cfg.train_dataset.batch_size, seed=cfg.seed)

    # n_samples sampled answers per prompt, each scored against the prompt's greedy answer.
    gconfig = replace(cfg.gconfig, stop_token_ids=[tokenizer.eos_token_id])
    reward = RewardRunner(exact_answer_reward, num_workers=1)
    workflow = ReMaxWorkflow(reward, gconfig, tokenizer, use_chat_template=False)
    eval_workflow = RLVRWorkflow(reward, gconfig.new(n_samples=1, greedy=True), tokenizer, use_chat_template=False)

    rollout, weight_meta = make_rollout(
        cfg.launcher.backend, cfg.rollout, cfg.local_engine, cfg.actor.path, cfg.weight_update, cfg.output_dir
    )
    total_steps = cfg.total_train_steps or cfg.total_train_epochs * len(dataloader)
    actor = ReinforceActor(cfg.actor, make_train_engine(cfg.actor))
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
        start_step, acc_before = 0, mean_reward(rollout, eval_workflow, eval_problems)
    else:
        start_step, acc_before = info.next_step.global_step, float(info.extra["acc_before"])  # type: ignore[arg-type]
        rollout.executor.load_state_dict(info.extra["rollout"])

    for global_step in range(start_step, total_steps):
        step = StepInfo.at(global_step, len(dataloader))
        batch = rollout.prepare_batch(dataloader, workflow=workflow)
        actor.compute_advantages(batch)  # adv_estimator=remax: reward - baseline_rewards
        stats = actor.ppo_update(batch)
        actor.step_lr_scheduler()

        rollout.pause()
        actor.engine.set_version(global_step + 1)
        actor.update_weights(weight_meta)
        rollout.set_version(global_step + 1)
        rollout.resume()

        stats["baseline_reward_mean"] = float(batch["baseline_rewards"].mean())
        saver.save(actor.engine, step, tokenizer=tokenizer, last=global_step + 1 == total_steps)
        recover.dump(
            actor.engine,
            step,
            dataloader=dataloader,
            stats_logger=stats_logger,
            extra={"acc_before": acc_before, "rollout": rollout.executor.state_dict()},
        )
        acc = evaluator.evaluate(lambda: mean_reward(rollout, eval_workflow, eval_problems), step)
        stats_logger.commit(global_step, stats, rollout.executor.stats(), {} if acc is None else {"eval/accuracy": acc})

    acc_after = mean_reward(rollout, eval_workflow, eval_problems)
    stats_logger.close()
    rollout.destroy()
    actor.engine.destroy()
    print(f"RESULT acc_before={acc_before:.3f} acc_after={acc_after:.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
