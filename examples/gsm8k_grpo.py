"""GRPO on GSM8K: the GPU recipe, the quickstart's loop pointed at a real model and real servers.

A HF model (``actor.path``) answers grade-school math questions rendered through its chat
template; the reward is math-verify's equivalence of the last ``\\boxed{}`` answer with the
number after ``####`` in the GSM8K solution (`areal_lite.rewards.math_answer_reward`, run in
worker processes with a timeout). Rollouts come from SGLang servers that the launcher starts
(``launcher.backend=sglang``; ``areal`` starts our own SGLang-protocol server, for CPU), at most
``rollout.max_head_offpolicyness`` versions ahead of training; weights reach them through the disk
or a NCCL broadcast (``weight_update``). Decoupled PPO loss with group-normalised advantages.

The data are local files (``train_dataset.path``, ``valid_dataset.path``: parquet or jsonl with
GSM8K's ``question`` and ``answer`` fields); nothing is downloaded here.

    python -m areal_lite.launcher.local examples/gsm8k_grpo.py --config configs/gsm8k_grpo.yaml \\
        actor.path=Qwen/Qwen2.5-1.5B-Instruct train_dataset.path=data/gsm8k/train.parquet \\
        valid_dataset.path=data/gsm8k/test.parquet
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
from areal_lite.rewards import RewardRunner, math_answer_reward
from areal_lite.utils.dataloader import stateful_dataloader
from areal_lite.utils.datasets import gsm8k_item, load_rows
from areal_lite.utils.evaluator import Evaluator
from areal_lite.utils.recover import RecoverHandler
from areal_lite.utils.rollout import make_rollout, mean_reward
from areal_lite.utils.saver import Saver
from areal_lite.utils.stats import StatsTracker
from areal_lite.utils.stats_logger import StatsLogger
from areal_lite.utils.step import StepInfo
from areal_lite.workflows.rlvr import RLVRWorkflow
from areal_lite.workflows.trajectory import encode_chat


@dataclass
class GSM8KConfig(BaseExperimentConfig):
    actor: PPOActorConfig = field(default_factory=PPOActorConfig)
    rollout: InferenceEngineConfig = field(default_factory=InferenceEngineConfig)
    local_engine: LocalEngineConfig = field(default_factory=LocalEngineConfig)
    """The embedded engine (launcher.backend=local only)."""
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    weight_update: str = "disk"
    """How weights reach remote servers: disk or distributed (NCCL on GPU, gloo on CPU)."""
    reward_workers: int = 4
    """Worker processes grading answers with math-verify."""
    enable_thinking: bool = False
    """Passed to the chat template (Qwen3-style thinking switch)."""
    n_eval: int = 0
    """Held-out questions evaluated (greedy accuracy); 0 = all of ``valid_dataset``."""


def load_gsm8k(path: str, tokenizer: object, max_length: int | None, enable_thinking: bool) -> list[dict[str, object]]:
    """GSM8K items from a local file, without those whose prompt exceeds ``max_length`` tokens."""
    items = [gsm8k_item(row) for row in load_rows(path)]
    if max_length is None:
        return items
    return [
        it for it in items if len(encode_chat(tokenizer, it["messages"], enable_thinking=enable_thinking)) <= max_length
    ]  # type: ignore[arg-type]


def main(argv: list[str]) -> None:
    cfg = load_config(argv, GSM8KConfig)
    torch.manual_seed(cfg.seed)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path or cfg.actor.path)
    train_items = load_gsm8k(cfg.train_dataset.path, tokenizer, cfg.train_dataset.max_length, cfg.enable_thinking)
    eval_items = (
        load_gsm8k(cfg.valid_dataset.path, tokenizer, None, cfg.enable_thinking) if cfg.valid_dataset.path else []
    )
    eval_items = eval_items[: cfg.n_eval] if cfg.n_eval else eval_items
    dataloader = stateful_dataloader(
        train_items, batch_size=cfg.train_dataset.batch_size, shuffle=cfg.train_dataset.shuffle, seed=cfg.seed
    )

    gconfig = replace(cfg.gconfig, n_samples=cfg.actor.group_size, stop_token_ids=[tokenizer.eos_token_id])
    reward = RewardRunner(math_answer_reward, num_workers=cfg.reward_workers)
    workflow = RLVRWorkflow(reward, gconfig, tokenizer, enable_thinking=cfg.enable_thinking)
    eval_workflow = RLVRWorkflow(
        reward, gconfig.new(n_samples=1, greedy=True), tokenizer, enable_thinking=cfg.enable_thinking
    )

    rollout, weight_meta = make_rollout(
        cfg.launcher.backend, cfg.rollout, cfg.local_engine, cfg.actor.path, cfg.weight_update, cfg.output_dir
    )
    total_steps = cfg.total_train_steps or cfg.total_train_epochs * len(dataloader)
    ref = None
    if cfg.actor.kl_ctl > 0:  # a frozen copy of the initial policy for the KL penalty
        ref = make_train_engine(cfg.actor)
        ref.initialize()
    actor = PPOActor(cfg.actor, make_train_engine(cfg.actor), ref_engine=ref)
    # The LR schedule spans this run's steps (total_train_steps may end it before or after the epochs).
    actor.engine.initialize(FinetuneSpec(1, total_steps * cfg.train_dataset.batch_size, cfg.train_dataset.batch_size))
    actor.engine.connect_engine(rollout, weight_meta)

    saver = Saver(cfg.saver, cfg.output_dir)
    evaluator = Evaluator(cfg.evaluator)
    recover = RecoverHandler(cfg.recover, cfg.output_dir)
    stats_logger = StatsLogger(
        cfg.stats_logger, cfg.output_dir, total_steps=total_steps, run_name=cfg.experiment_name, run_config=cfg
    )
    tracker = StatsTracker()

    info = recover.load(
        actor.engine,
        dataloader=dataloader,
        stats_logger=stats_logger,
        inference_engine=rollout,
        weight_update_meta=weight_meta,
    )
    start_step = 0 if info is None else info.next_step.global_step
    if info is not None:
        rollout.executor.load_state_dict(info.extra["rollout"])  # replay prompts that were in flight

    for global_step in range(start_step, total_steps):
        step = StepInfo.at(global_step, len(dataloader))
        with tracker.timer("rollout"):
            batch = rollout.prepare_batch(dataloader, workflow=workflow)
        with tracker.timer("train"):
            actor.compute_advantages(batch)
            stats = actor.ppo_update(batch)
            actor.step_lr_scheduler()
        with tracker.timer("weight_sync"):
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
            extra={"rollout": rollout.executor.state_dict()},
        )
        acc = evaluator.evaluate(lambda: mean_reward(rollout, eval_workflow, eval_items), step) if eval_items else None
        tracker.dist("rollout/staleness", rollout.executor.last_batch_staleness)
        stats_logger.commit(
            global_step,
            stats,
            rollout.executor.stats(),
            tracker.export(),
            {} if acc is None else {"eval/accuracy": acc},
        )

    final_acc = mean_reward(rollout, eval_workflow, eval_items) if eval_items else float("nan")
    stats_logger.close()
    rollout.destroy()
    actor.engine.destroy()
    if ref is not None:
        ref.destroy()
    print(f"RESULT steps={total_steps} eval_accuracy={final_acc:.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
