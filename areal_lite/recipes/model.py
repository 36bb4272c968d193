"""The models of the recipe API, spawned by `ModelBuilder` from a HF model directory, and
`shutdown`:

- `InferenceModel`: frozen weights; ``generate`` / ``generate_tokens`` and ``logprobs_per_token``
  (a reference policy, a judge);
- `TrainingModel`: a policy being trained; everything an `InferenceModel` does, plus ``train_*``
  (gradient contributions) and ``optim_step``, ``clone_inf`` and ``save``;
- `ValueModel`: a value head being trained (``values_per_token``, ``train_value``), for PPO.

Each owns a train engine (FSDP or Megatron by ``ModelConfig.backend``; frozen for an
`InferenceModel`), which scores tokens (``logprobs_per_token`` runs the engine's forward pass, so
training and scoring agree exactly), and, from its first ``generate``, an inference engine: the
embedded engine in this process, or a client of SGLang-protocol servers (``ModelConfig.servers``).

Generation always uses the current weights: ``optim_step`` only marks them changed, and the next
generation first pushes them to the inference engine through the train engine's
``update_weights`` (in process for the embedded engine; disk or broadcast for servers). A model
that steps several times between generations syncs once.

Engine work runs on this process's engine thread (`areal_lite.recipes.lockstep`), never on the
event loop: concurrent ``logprobs_per_token`` calls become one batched forward pass, and under
torchrun every rank runs the same collectives in the same order. ``train_*`` calls only check their
arguments and queue the sample; ``optim_step`` trains on everything queued since the last step
(`areal_lite.recipes.losses`). Under several ranks every rank runs the recipe on its own share of
the data; ``optim_step``, ``save``, ``clone_inf`` and ``close`` are collective (every rank calls
them, in the same order), the other methods are not.
"""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import dataclass, field, replace

import torch.distributed as dist

from areal_lite.recipes.config import ModelConfig
from areal_lite.recipes.inference import InferenceModel
from areal_lite.recipes.lockstep import close_engine_thread
from areal_lite.recipes.process import Process
from areal_lite.recipes.training import TrainingModel, ValueModel
from areal_lite.utils.distributed import destroy_default_group

__all__ = ["InferenceModel", "ModelBuilder", "ModelConfig", "TrainingModel", "ValueModel", "shutdown"]


@dataclass
class ModelBuilder:
    """Spawns recipe models from a HF model directory ``path``::

        policy = await ModelBuilder(path, config).spawn_train("policy", max_seq_len=512)
        reference = await policy.clone_inf()

    Under torchrun every rank spawns the same models in the same order (spawning is collective).
    """

    path: str
    config: ModelConfig = field(default_factory=ModelConfig)

    def tp(self, size: int) -> ModelBuilder:
        """The same builder with tensor parallelism ``size``. Megatron splits each layer over
        ``size`` ranks; FSDP has no tensor parallelism, so ``size > 1`` raises ValueError there
        (set ``ModelConfig.backend="megatron"`` first) instead of being ignored."""
        if size < 1:
            raise ValueError(f"tensor parallelism must be >= 1, got {size}")
        changed = replace(self, config=replace(self.config, tensor_parallel_size=size))
        changed._check_parallelism()
        return changed

    def _check_parallelism(self) -> None:
        size = self.config.tensor_parallel_size
        if size > 1 and self.config.backend != "megatron":
            raise ValueError(
                f"tp({size}): the {self.config.backend} backend has no tensor parallelism; use "
                "ModelConfig(backend='megatron') (ModelBuilder(path, config).tp(n)), or tp(1)"
            )
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() % size != 0:
            raise ValueError(f"tp({size}) does not divide the {dist.get_world_size()} ranks of this run")

    def with_config(self, **changes: object) -> ModelBuilder:
        """The same builder with some `ModelConfig` fields changed."""
        return replace(self, config=replace(self.config, **changes))  # type: ignore[arg-type]

    def _config(self, max_seq_len: int | None) -> ModelConfig:
        self._check_parallelism()
        return self.config if max_seq_len is None else replace(self.config, max_seq_len=max_seq_len)

    async def spawn_train(self, name: str, max_seq_len: int | None = None) -> TrainingModel:
        """A policy to train, from the directory's weights."""
        return await TrainingModel._spawn(name, self.path, self._config(max_seq_len), trainable=True)  # type: ignore[return-value]

    async def spawn_value(self, name: str, max_seq_len: int | None = None) -> ValueModel:
        """A value model to train: the directory's network with a new scalar head."""
        return await ValueModel._spawn(name, self.path, self._config(max_seq_len), trainable=True)  # type: ignore[return-value]

    async def spawn_inference(self, name: str, max_seq_len: int | None = None) -> InferenceModel:
        """A frozen model (a reference, a judge)."""
        return await InferenceModel._spawn(name, self.path, self._config(max_seq_len), trainable=False)


async def shutdown(*models: InferenceModel) -> None:
    """Close ``models``, stop the engine thread, remove the temporary work directory and leave the
    process group this package created. Collective; the last call of a recipe script."""
    for model in models:
        await model.close()
    await asyncio.to_thread(close_engine_thread)
    if Process.owns_work_dir and Process.work_dir and (not dist.is_initialized() or dist.get_rank() == 0):
        shutil.rmtree(Process.work_dir, ignore_errors=True)
    Process.work_dir, Process.owns_work_dir = None, False
    if Process.created_group:
        destroy_default_group()
        Process.created_group = False
