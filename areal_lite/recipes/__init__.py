"""The recipe API: algorithms written as short async programs over models.

Where the example scripts drive actors and a rollout controller in a loop, a recipe awaits model
methods directly: ``generate`` completions, score them, ask for ``logprobs_per_token``, add
gradient contributions with ``train_grpo`` (or ``train_sft``, ``train_ppo``, ``train_gspo``,
``train_dpo``, ``train_tangents``) and apply them with ``optim_step``. The names and meanings
follow the training-primitive interface that users of commercial fine-tuning platforms know, so a
recipe written in that style ports by changing its imports. docs/recipes.md is the guide.

Modules, bottom up: `thread` (conversations), `concurrency` and `data` (fan-out, data sets,
schedules), `lockstep` (the engine thread), `config` and `process` (what models are built from and
share), `losses` (train calls -> actor losses), `inference` and `training` (the models), `model`
(`ModelBuilder`, `shutdown`), `graders`, `run` and `recipe` (the recipe classes' loop, checkpoints,
logging and progress) and the recipe classes `SFT`, `PPO`, `GRPO` and `DPO`.
"""

from areal_lite.recipes.concurrency import async_map, async_map_batch
from areal_lite.recipes.data import CosineScheduler, DataSet, get_minibatches
from areal_lite.recipes.dpo import DPO
from areal_lite.recipes.graders import CombinedGrader, FunctionGrader, Grader, JudgeGrader, RewardFnGrader
from areal_lite.recipes.grpo import GRPO
from areal_lite.recipes.model import (
    InferenceModel,
    ModelBuilder,
    ModelConfig,
    TrainingModel,
    ValueModel,
    shutdown,
)
from areal_lite.recipes.ppo import PPO
from areal_lite.recipes.recipe import BatchRecipe, Recipe
from areal_lite.recipes.run import RecipeRunConfig
from areal_lite.recipes.sft import SFT
from areal_lite.recipes.thread import StringThread, TokenizedThread, TokenizedTurn, repeat_thread

__all__ = [
    "DPO",
    "GRPO",
    "PPO",
    "SFT",
    "BatchRecipe",
    "CombinedGrader",
    "CosineScheduler",
    "DataSet",
    "FunctionGrader",
    "Grader",
    "InferenceModel",
    "JudgeGrader",
    "ModelBuilder",
    "ModelConfig",
    "Recipe",
    "RecipeRunConfig",
    "RewardFnGrader",
    "StringThread",
    "TokenizedThread",
    "TokenizedTurn",
    "TrainingModel",
    "ValueModel",
    "async_map",
    "async_map_batch",
    "get_minibatches",
    "repeat_thread",
    "shutdown",
]
