"""The SFT warm-up that an RL example runs before RL, written once: `warm_up_with_sft` trains a model
on demonstrations until its greedy score on dev items reaches a target, and saves it. The example
passes what differs: how its model is built, its batches (`resampled_batches` for a fixed pool of
demonstrations), the workflow that scores it, and its stopping rule.

Stopping on a measured score, not a step count, gives RL the same starting point on any machine.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from tensordict import TensorDict

from areal_lite.actors.sft import SFTActor
from areal_lite.api.config import TrainEngineConfig
from areal_lite.api.experiment_config import RLExperimentConfig
from areal_lite.api.io import FinetuneSpec, SaveLoadMeta, WeightUpdateMeta
from areal_lite.api.workflow import RolloutWorkflow
from areal_lite.core.controller import RolloutController
from areal_lite.kit.factory import make_train_engine
from areal_lite.kit.ranks import on_rank0_first, print_rank0
from areal_lite.kit.run import mean_reward
from areal_lite.utils.datasets import padded_batch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def warm_up_with_sft(
    cfg: RLExperimentConfig,
    engine_config: TrainEngineConfig,
    sft_dir: str,
    *,
    batches: Callable[[PreTrainedTokenizerBase, int, int], Iterator[TensorDict]],
    judge: Callable[[PreTrainedTokenizerBase], RolloutWorkflow],
    dev: list[dict[str, object]],
    lr: float,
    max_steps: int,
    eval_every: int,
    target: float,
    build: Callable[[], object] | None = None,
    score_name: str = "dev greedy accuracy",
    score_at_start: bool = False,
) -> None:
    """Fine-tune the model at ``engine_config.path`` until its greedy score on ``dev`` reaches
    ``target`` or ``max_steps`` steps pass, then save it with its tokenizer to ``sft_dir`` (HF).

    The optimizer is ``cfg.actor.optimizer`` at the constant learning rate ``lr``. ``build`` makes
    the model directory when it has no ``config.json`` yet (on trainer rank 0, the others waiting).
    ``batches(tokenizer, rank, world)`` yields this data-parallel rank's batch of each step (an
    `SFTActor` batch: ``input_ids``, ``attention_mask``, ``loss_mask``). The score is the mean
    reward of ``judge(tokenizer)`` over ``dev``, measured every ``eval_every`` steps and after the
    last (with ``score_at_start`` also before the first) through an embedded engine into which the
    trained weights are copied; the console shows it as ``score_name``.
    """
    from transformers import AutoTokenizer

    from areal_lite.engines.local.engine import LocalInferenceEngine

    optimizer = replace(cfg.actor.optimizer, lr=lr, lr_scheduler_type="constant", warmup_steps_proportion=0.0)
    engine_config = replace(engine_config, optimizer=optimizer)
    path = engine_config.path
    engine = make_train_engine(engine_config)
    if build is not None:
        on_rank0_first(engine, lambda: os.path.exists(os.path.join(path, "config.json")) or build())
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine.initialize(FinetuneSpec(total_train_epochs=1, dataset_size=max_steps, train_batch_size=1))
    sft = SFTActor(engine_config, engine)
    scorer = RolloutController(
        LocalInferenceEngine(replace(cfg.local_engine, path=path)), replace(cfg.rollout, episode_process=False)
    )
    scorer.initialize()
    copy_in_place = WeightUpdateMeta(type="in_process")
    engine.connect_engine(scorer.engine, copy_in_place)
    workflow = judge(tokenizer)
    if score_at_start:
        print_rank0(f"[sft] step 0 {score_name} {mean_reward(scorer, workflow, dev):.3f}")
    data = batches(tokenizer, engine.data_parallel_rank, engine.data_parallel_world_size)
    t0 = time.time()
    for step in range(max_steps):
        stats = sft.train_lm(next(data))
        if (step + 1) % eval_every == 0 or step + 1 == max_steps:
            engine.update_weights(copy_in_place)
            score = mean_reward(scorer, workflow, dev)
            print_rank0(
                f"[sft] step {step + 1} loss {stats['loss']:.3f} {score_name} {score:.3f} ({time.time() - t0:.0f}s)"
            )
            if score >= target:
                break
    scorer.destroy()
    engine.save(SaveLoadMeta(path=sft_dir, weight_format="hf", tokenizer=tokenizer))
    engine.destroy()


def resampled_batches(pool: Sequence[tuple[list[int], list[int]]], batch_size: int, seed: int) -> Iterator[TensorDict]:
    """Endless padded batches of ``batch_size`` (token ids, loss mask) rows drawn from ``pool`` with
    replacement, by ``random.Random(seed)``."""
    rng = random.Random(seed)
    while True:
        yield padded_batch(rng.choices(pool, k=batch_size))
