"""The quickstart's task for the recipe examples: two-digit addition (``57+68=`` -> ``125``) with
an exact-answer grader, as threads of the recipe API; the tiny model, greedy accuracy and the SFT
warm-up that the RL examples start from. Shared by the scripts of this directory (one copy)."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field

from areal_lite.api.config import READS_MODEL
from areal_lite.api.io import GenerationConfig
from areal_lite.kit import TinyModelConfig, print_rank0
from areal_lite.recipes import (
    CosineScheduler,
    Grader,
    ModelBuilder,
    ModelConfig,
    RecipeRunConfig,
    RewardFnGrader,
    StringThread,
    TrainingModel,
    async_map,
)
from areal_lite.recipes.data import data_parallel_rank
from areal_lite.recipes.run import Evaluate
from areal_lite.rewards.format import exact_answer_reward
from areal_lite.utils.datasets import AdditionTaskConfig, addition_problems
from areal_lite.utils.tiny import build_tiny_model

Problem = dict[str, object]


@dataclass
class TaskConfig(AdditionTaskConfig, TinyModelConfig):
    """The synthetic task (``n_train_prompts``: training prompts for RL, demonstrations for SFT)
    and the tiny model; ``seed`` seeds the model too."""

    n_dev: int = 200
    """Dev problems for the SFT warm-up's stopping rule."""
    model_path: str = field(default="", metadata=READS_MODEL)
    """A HF model directory to start from instead of the tiny model (e.g. SmolLM2-135M-Instruct:
    ``python -m areal_lite.utils.pretrained smollm2`` prints its directory; with a chat model, set
    ``model.use_chat_template=true`` and a longer ``model.max_seq_len``); empty = build the tiny model."""


@dataclass
class WarmupConfig:
    """The SFT warm-up before RL: labelled problems until greedy dev accuracy reaches ``target_acc``."""

    steps: int = 1500
    """At most this many SFT steps (0: no warm-up)."""
    target_acc: float = 0.35
    """Stop once greedy dev accuracy reaches this."""
    eval_every: int = 25
    """Check dev accuracy every this many steps."""
    batch_size: int = 128
    """Demonstrations per step (over all ranks)."""
    lr: float = 1e-3
    """Constant learning rate."""


def default_model() -> ModelConfig:
    """Raw text (no chat template), short threads, each group's prompt through the model once."""
    return ModelConfig(use_chat_template=False, max_seq_len=64, max_running_requests=256, shared_prefix=True)


@dataclass
class ExampleConfig:
    """What every recipe-class example has: the task, the model's engines and the run's outputs.
    A script's config adds its recipe's settings."""

    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=default_model)
    run: RecipeRunConfig = field(default_factory=RecipeRunConfig)
    """Output directory, checkpoints, recovery, evaluation schedule, statistics."""


@dataclass
class RLExampleConfig(ExampleConfig):
    """An example that starts from the SFT warm-up."""

    warmup: WarmupConfig = field(default_factory=WarmupConfig)


@dataclass
class Split:
    train: list[Problem]
    held_out: list[Problem]
    dev: list[Problem]
    excluded: set[str] = field(default_factory=set)
    """Prompts no training problem may have (the held-out ones)."""


def splits(task: TaskConfig) -> Split:
    """Disjoint training, held-out and dev problems."""
    held_out = addition_problems(task.n_eval, task.n_digits, seed=task.seed + 1)
    excluded = {str(p["prompt"]) for p in held_out}
    dev = addition_problems(task.n_dev, task.n_digits, task.seed + 2, exclude=excluded)
    train = addition_problems(task.n_train_prompts, task.n_digits, task.seed + 3, exclude=excluded)
    return Split(train, held_out, dev, excluded)


async def spawn_policy(task: TaskConfig, model: ModelConfig, output_dir: str) -> TrainingModel:
    """The model at ``task.model_path``, or the tiny model (a byte-level tokenizer: one token per
    character), built on the first run."""
    if task.model_path:
        return await ModelBuilder(task.model_path, model).spawn_train("policy")
    path = os.path.join(output_dir, "base_model")
    if not os.path.exists(os.path.join(path, "config.json")):
        # Every rank builds the same (seeded) model and the first rename wins: no rank reads a
        # half-written directory, and no process group is needed yet.
        tmp = f"{path}.tmp{os.getpid()}"
        build_tiny_model(
            tmp, hidden_size=task.hidden_size, num_layers=task.num_layers, num_heads=4, num_kv_heads=4,
            vocab_size=0, max_position_embeddings=64, seed=task.seed,
        )  # fmt: skip
        try:
            os.rename(tmp, path)
        except OSError:
            shutil.rmtree(tmp)
    return await ModelBuilder(path, model).spawn_train("policy")


def prompt_thread(problem: Problem) -> StringThread:
    """``57+68=`` as a user turn; the gold answer in the metadata, where the grader reads it."""
    return StringThread([("user", str(problem["prompt"]))], {"answer": problem["answer"]})


def demonstration(problem: Problem) -> StringThread:
    return prompt_thread(problem).assistant(str(problem["answer"]))


def exact_grader() -> Grader:
    """1.0 for exactly the right answer: a string comparison, run on the event loop."""
    return RewardFnGrader(exact_answer_reward, mode="inline")


async def greedy_accuracy(model: TrainingModel, problems: list[Problem], max_new_tokens: int = 5) -> float:
    """Fraction of ``problems`` whose greedy completion is exactly right (every rank runs all)."""
    greedy = GenerationConfig(greedy=True, max_new_tokens=max_new_tokens)
    grader = exact_grader()
    done = await async_map(lambda p: model.generate(prompt_thread(p), greedy), problems)
    scores = await async_map(grader.score_float_value, done)
    return sum(scores) / len(scores)


async def start(
    task: TaskConfig, model_config: ModelConfig, output_dir: str, warmup: WarmupConfig | None = None
) -> tuple[Split, TrainingModel, float]:
    """The splits, the policy (after the SFT warm-up when ``warmup`` is given) and its held-out
    greedy accuracy."""
    split = splits(task)
    model = await spawn_policy(task, model_config, output_dir)
    if warmup is not None:
        await warm_up_with_sft(model, task, warmup, split)
    return split, model, await greedy_accuracy(model, split.held_out)


def held_out_accuracy(model: TrainingModel, split: Split) -> Evaluate:
    """The recipes' ``evaluate``: ``eval/accuracy``, greedy on the held-out problems."""

    async def evaluate() -> dict[str, float]:
        return {"eval/accuracy": await greedy_accuracy(model, split.held_out)}

    return evaluate


async def warm_up_with_sft(model: TrainingModel, task: TaskConfig, warmup: WarmupConfig, split: Split) -> float:
    """SFT on fresh labelled problems until greedy dev accuracy reaches ``warmup.target_acc``
    (checked every ``warmup.eval_every`` steps) or ``warmup.steps`` pass; returns the last dev
    accuracy. Stopping on a measured accuracy, not a step count, gives RL the same start on any
    machine."""
    t0 = time.time()
    lr = CosineScheduler(warmup.lr, min_lr_ratio=1.0)(0.0)  # constant
    rank, world = data_parallel_rank()
    acc = 0.0
    for step in range(warmup.steps):
        # Each rank trains on its share of the step's problems (all of them on one rank).
        batch = addition_problems(warmup.batch_size, task.n_digits, task.seed + 1000 + step, exclude=split.excluded)
        await async_map(model.train_sft, [demonstration(p) for p in batch[rank::world]])
        stats = await model.optim_step(lr)
        if (step + 1) % warmup.eval_every == 0 or step + 1 == warmup.steps:
            acc = await greedy_accuracy(model, split.dev)
            print_rank0(
                f"[sft] step {step + 1} loss {stats['loss']:.3f} dev greedy accuracy {acc:.3f} ({time.time() - t0:.0f}s)"
            )
            if acc >= warmup.target_acc:
                break
    return acc
