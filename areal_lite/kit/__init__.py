"""The scaffolding every example script shares, written once; the training loop stays in each script.

- `make_train_engine` and `make_rollout_controller` (`areal_lite.kit.factory`): the train engine
  and the `RolloutController` the config asks for (``actor.backend``; ``launcher.backend`` with
  ``weight_update``).
- `rank_dataloader` (`areal_lite.kit.ranks`): a resumable data loader over this data-parallel
  rank's share of the data; `on_rank0_first` and `print_rank0` for the work and the output that
  one rank does for all.
- `RunKit` (`areal_lite.kit.run`): before the first step, the engines' start and the resume from a
  recover checkpoint; after each, the HF checkpoint, the recover checkpoint, the evaluation and
  the statistics. `sync_weights`: the weight-sync sequence (pause, push, version, resume), one line
  in the loop. `mean_reward`: a held-out score.
- `warm_up_with_sft` (`areal_lite.kit.warm_up`): the SFT warm-up before RL, until a dev score is
  reached; the example passes its data and its stopping rule. `TinyModelConfig`
  (`areal_lite.kit.tiny_model`): the config fields of the tiny model an example builds.

A script reads::

    rollout, weight_meta = make_rollout_controller(cfg, model_dir)
    actor = PPOActor(cfg.actor, make_train_engine(cfg.actor))
    dataloader = rank_dataloader(items, cfg.train_dataset, actor.engine, seed=cfg.seed)
    run = RunKit(cfg, actor.engine, dataloader, tokenizer=tokenizer, rollout=rollout, weight_meta=weight_meta)
    run.start()  # initialise the engine, connect it to the rollout engine, resume
    acc_before = run.once("acc_before", lambda: mean_reward(rollout, eval_workflow, eval_items))
    for global_step in range(run.start_step, run.total_steps):
        batch = rollout.prepare_batch(dataloader, workflow=workflow)
        ...
        sync_weights(rollout, actor.engine, weight_meta, version=global_step + 1)
        run.end_step(global_step, stats, evaluate=...)
    run.close()
"""

from areal_lite.kit.factory import check_dtypes, make_rollout_controller, make_train_engine, rollout_dtype
from areal_lite.kit.ranks import on_rank0_first, print_rank0, rank_dataloader
from areal_lite.kit.run import RunKit, job_start_time, mean_reward, sync_weights
from areal_lite.kit.tiny_model import TinyModelConfig
from areal_lite.kit.warm_up import resampled_batches, warm_up_with_sft

__all__ = [
    "RunKit",
    "TinyModelConfig",
    "check_dtypes",
    "job_start_time",
    "make_rollout_controller",
    "make_train_engine",
    "mean_reward",
    "on_rank0_first",
    "print_rank0",
    "rank_dataloader",
    "resampled_batches",
    "rollout_dtype",
    "sync_weights",
    "warm_up_with_sft",
]
