"""GRPO on GSM8K: the GPU recipe, the quickstart's loop pointed at a real model and real servers.

A HF model (``actor.path``) answers grade-school math questions rendered through its chat
template; the reward is math-verify's equivalence of the last ``\\boxed{}`` answer with the
number after ``####`` in the GSM8K solution (`areal_lite.rewards.math_answer_reward`, run in
worker processes with a timeout). Rollouts come from SGLang servers that the launcher starts
(``launcher.backend=sglang``; ``areal`` starts our own SGLang-protocol server, for CPU), at most
``rollout.max_head_offpolicyness`` versions ahead of training; weights reach them through the disk
or a NCCL broadcast (``weight_update``). Decoupled PPO loss with group-normalised advantages.

The data are local files (``train_dataset.path``, ``valid_dataset.path``: parquet or jsonl with
GSM8K's ``question`` and ``answer`` fields); nothing is downloaded here. A row without them stops the
run naming its file and line, or is left out and counted (``train_dataset.on_bad_row=skip``).

    python -m areal_lite.launcher.local examples/gsm8k_grpo.py --config configs/gsm8k_grpo.yaml \\
        actor.path=Qwen/Qwen2.5-1.5B-Instruct train_dataset.path=data/gsm8k/train.parquet \\
        valid_dataset.path=data/gsm8k/test.parquet
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

from areal_lite import kit
from areal_lite.actors.ppo import PPOActor
from areal_lite.api.config import DatasetConfig
from areal_lite.api.experiment_config import RLExperimentConfig
from areal_lite.rewards import RewardRunner, math_answer_reward
from areal_lite.utils.datasets import GSM8K_FIELDS, Rows, gsm8k_item, read_rows
from areal_lite.workflows.rlvr import RLVRWorkflow
from areal_lite.workflows.trajectory import encode_chat


@dataclass
class GSM8KConfig(RLExperimentConfig):
    reward_workers: int = 4
    """Worker processes grading answers with math-verify."""
    enable_thinking: bool = False
    """Passed to the chat template (Qwen3-style thinking switch)."""
    n_eval: int = 0
    """Held-out questions evaluated (greedy accuracy); 0 = all of ``valid_dataset``."""


def load_gsm8k(tokenizer: object, dataset: DatasetConfig, name: str, enable_thinking: bool) -> Rows:
    """GSM8K items from the local file of ``dataset`` (the config section ``name``): rows without a
    question or an answer ending in ``#### N`` stop the run or are left out (``on_bad_row``), and
    prompts over ``max_length`` tokens are left out; both are counted (`Rows.stats`)."""
    rows = read_rows(
        dataset.path, GSM8K_FIELDS, on_bad_row=dataset.on_bad_row, convert=gsm8k_item, setting=f"{name}.on_bad_row"
    )
    if dataset.max_length is not None:
        limit = dataset.max_length

        def too_long(item: dict[str, object]) -> bool:
            return len(encode_chat(tokenizer, item["messages"], enable_thinking=enable_thinking)) > limit  # type: ignore[arg-type]

        rows.drop_if(too_long, f"prompt_over_{limit}_tokens")
    return rows


def main(argv: list[str]) -> None:
    cfg = kit.load_config_and_seed(argv, GSM8KConfig)
    from areal_lite.utils.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.tokenizer_path or cfg.actor.path)
    train_rows = load_gsm8k(tokenizer, cfg.train_dataset, "train_dataset", cfg.enable_thinking)
    train_items = train_rows.items
    eval_items = (
        load_gsm8k(tokenizer, cfg.valid_dataset, "valid_dataset", cfg.enable_thinking).items
        if cfg.valid_dataset.path
        else []
    )
    eval_items = eval_items[: cfg.n_eval] if cfg.n_eval else eval_items

    gconfig = replace(cfg.gconfig, n_samples=cfg.actor.group_size, stop_token_ids=[tokenizer.eos_token_id])
    reward = RewardRunner(math_answer_reward, num_workers=cfg.reward_workers)
    workflow = RLVRWorkflow(reward, gconfig, tokenizer, enable_thinking=cfg.enable_thinking)
    eval_workflow = RLVRWorkflow(
        reward, gconfig.new(n_samples=1, greedy=True), tokenizer, enable_thinking=cfg.enable_thinking
    )

    rollout, weight_meta = kit.make_rollout_controller(cfg)
    actor_engine = kit.make_train_engine(cfg.actor)
    dataloader = kit.rank_dataloader(train_items, cfg.train_dataset, actor_engine, seed=cfg.seed)
    ref = None
    if cfg.actor.kl_ctl > 0:  # a frozen copy of the initial policy for the KL penalty
        ref = kit.make_train_engine(cfg.actor)
        ref.initialize()
    actor = PPOActor(cfg.actor, actor_engine, ref_engine=ref)
    run = kit.RunKit(
        cfg,
        actor.engine,
        dataloader,
        tokenizer=tokenizer,
        rollout=rollout,
        weight_meta=weight_meta,
        data_stats=train_rows.stats(),
    )
    run.start()
    score = kit.HeldOutScore(rollout, eval_workflow, eval_items, "eval/accuracy")

    for global_step in range(run.start_step, run.total_steps):
        _, stats = run.rl_step(actor, workflow, global_step)  # the quickstart's step
        run.end_step(global_step, stats, evaluate=score.evaluate if eval_items else None)

    final_acc = score() if eval_items else float("nan")
    if ref is not None:
        ref.destroy()
    run.finish(f"steps={run.total_steps} eval_accuracy={final_acc:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
