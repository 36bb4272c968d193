"""The scaffolding every example script shares, written once; the training loop stays in each script.

- `load_config_and_seed` (`areal_lite.kit.run`): the script's config, torch seeded from it.
- `make_train_engine` and `make_rollout_controller` (`areal_lite.kit.factory`): the train engine
  and the `RolloutController` the config asks for (``actor.backend``; ``launcher.backend`` with
  ``weight_update``).
- `rank_dataloader` (`areal_lite.kit.ranks`): a resumable data loader over this data-parallel
  rank's share of the data; `on_rank0_first` and `print_rank0` for the work and the output that
  one rank does for all.
- `RunKit` (`areal_lite.kit.run`): before the first step, the engines' start and the resume from a
  recover checkpoint; after each, the HF checkpoint, the recover checkpoint, the evaluation and
  the statistics; after the last, `RunKit.finish` ends the loggers and the engines.
  `RunKit.rl_step` is the quickstart's step (batch, advantages, update, weight sync) for the
  scripts whose step is that one. `sync_weights`:
  the weight-sync sequence (pause, push, version, resume), one line in the loop. `mean_reward` and
  `HeldOutScore`: a held-out score, before, during (``evaluate``) and after training.
- `warm_up_with_sft` (`areal_lite.kit.warm_up`): the SFT warm-up before RL, until a dev score is
  reached; the example passes its data and its stopping rule (`warm_up_engine_config`: the engine
  of a model it built). `TinyModelConfig` (`areal_lite.kit.tiny_model`): the config fields of the
  tiny model an example builds; `RewardWarmUpConfig` adds those of the held-out and dev items and
  of a warm-up that stops on a dev reward.

A script reads::

    cfg = load_config_and_seed(argv, MyExperimentConfig)
    ...
    rollout, weight_meta = make_rollout_controller(cfg, model_dir)
    actor = PPOActor(cfg.actor, make_train_engine(cfg.actor))
    dataloader = rank_dataloader(items, cfg.train_dataset, actor.engine, seed=cfg.seed)
    run = RunKit(cfg, actor.engine, dataloader, tokenizer=tokenizer, rollout=rollout, weight_meta=weight_meta)
    run.start()  # initialise the engine, connect it to the rollout engine, resume
    score = HeldOutScore(rollout, eval_workflow, eval_items, "eval/accuracy")
    acc_before = run.once("acc_before", score)
    for global_step in range(run.start_step, run.total_steps):
        batch = rollout.prepare_batch(dataloader, workflow=workflow)
        ...
        sync_weights(rollout, actor.engine, weight_meta, version=global_step + 1)
        run.end_step(global_step, stats, evaluate=score.evaluate)
    acc_after = score()
    run.finish(f"acc_before={acc_before:.3f} acc_after={acc_after:.3f}")  # loggers, engines, RESULT line
"""

from areal_lite.kit.factory import check_dtypes, make_rollout_controller, make_train_engine, rollout_dtype
from areal_lite.kit.ranks import on_rank0_first, print_rank0, rank_dataloader
from areal_lite.kit.run import HeldOutScore, RunKit, job_start_time, load_config_and_seed, mean_reward, sync_weights
from areal_lite.kit.tiny_model import RewardWarmUpConfig, TinyModelConfig
from areal_lite.kit.warm_up import resampled_batches, warm_up_engine_config, warm_up_with_sft

__all__ = [
    "HeldOutScore",
    "RewardWarmUpConfig",
    "RunKit",
    "TinyModelConfig",
    "check_dtypes",
    "job_start_time",
    "load_config_and_seed",
    "make_rollout_controller",
    "make_train_engine",
    "mean_reward",
    "on_rank0_first",
    "print_rank0",
    "rank_dataloader",
    "resampled_batches",
    "rollout_dtype",
    "sync_weights",
    "warm_up_engine_config",
    "warm_up_with_sft",
]
