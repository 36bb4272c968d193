"""The workflow contract: how one rollout episode turns data into trajectories."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tensordict import TensorDict

    from areal_lite.api.engine import InferenceEngine


class RolloutWorkflow(abc.ABC):
    """One episode of interaction between a policy and a task.

    Subclasses implement `arun_episode`; they may only call ``engine.agenerate`` (never HTTP, never
    the train engine) and should send slow work (reward code, tokenization of long texts) to an
    executor so the shared event loop never blocks.
    """

    @abc.abstractmethod
    async def arun_episode(self, engine: InferenceEngine, data: dict[str, object]) -> TensorDict | None:
        """Run one episode on ``data`` (one dataset item).

        Returns a TensorDict of batch size ``[n]`` following the trajectory data contract of
        `areal_lite.api.engine` (``input_ids``, ``attention_mask``, ``loss_mask``, ``logprobs``,
        ``versions``, ``rewards``; a GRPO group has ``n`` = group size), or None to reject the
        episode (it is then neither trained on nor counted towards the batch).
        """


TRAJECTORY_KEYS = ("input_ids", "attention_mask", "loss_mask", "logprobs", "versions", "rewards")
"""The keys every trajectory carries (the data contract of `areal_lite.api.engine`)."""


class TrajectoryError(ValueError):
    """A workflow returned something that breaks the trajectory data contract."""


def check_trajectory_layout(traj: object, producer: str = "the workflow") -> None:
    """Raise `TrajectoryError` naming the offending key when ``traj`` is not laid out as the data
    contract says: a TensorDict of batch size ``[n]`` with every key of `TRAJECTORY_KEYS`, integer
    ``input_ids`` ``[n, L]``, the other per-token keys of that shape, floating ``logprobs`` and
    ``rewards`` ``[n]``, and with images both image keys (floating ``pixel_values`` ``[n, P, D]``,
    integer ``image_grid_thw`` ``[n, I, 3]``). Cheap enough for every finished episode (the rollout executor calls it);
    `areal_lite.workflows.check_trajectory` checks the values too."""
    import torch
    from tensordict import TensorDict

    from areal_lite.api.engine import IMAGE_KEYS

    where = f"{producer} returned a trajectory that breaks the data contract"
    if not isinstance(traj, TensorDict):
        raise TrajectoryError(f"{producer} must return a TensorDict or None, got {type(traj).__name__}")
    missing = [k for k in TRAJECTORY_KEYS if k not in traj]
    if missing:
        raise TrajectoryError(f"{where}: it lacks key {missing[0]!r} (needs {', '.join(TRAJECTORY_KEYS)})")
    if len(traj.batch_size) != 1:
        raise TrajectoryError(f"{where}: its batch size must be [n], got {list(traj.batch_size)}")
    ids = traj["input_ids"]
    if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TrajectoryError(
            f"{where}: 'input_ids' must be an integer [n, L] tensor, got {ids.dtype} {list(ids.shape)}"
        )
    for key in ("attention_mask", "loss_mask", "logprobs", "versions"):
        if traj[key].shape != ids.shape:
            raise TrajectoryError(
                f"{where}: {key!r} has shape {list(traj[key].shape)}, expected {list(ids.shape)} like 'input_ids'"
            )
    if traj["rewards"].shape != ids.shape[:1]:
        raise TrajectoryError(f"{where}: 'rewards' has shape {list(traj['rewards'].shape)}, expected [{ids.shape[0]}]")
    for key in ("logprobs", "rewards"):
        if not traj[key].dtype.is_floating_point:
            raise TrajectoryError(f"{where}: {key!r} must be floating point, got {traj[key].dtype}")
    images = [key for key in IMAGE_KEYS if key in traj]
    if len(images) == 1:
        other = "image_grid_thw" if images[0] == "pixel_values" else "pixel_values"
        raise TrajectoryError(f"{where}: it carries {images[0]!r} without {other!r} (images need both)")
    if images:
        pixels, grids = traj["pixel_values"], traj["image_grid_thw"]
        if pixels.dim() != 3 or not pixels.dtype.is_floating_point:
            raise TrajectoryError(
                f"{where}: 'pixel_values' must be a floating [n, patches, D] tensor, got {pixels.dtype} {list(pixels.shape)}"
            )
        if grids.dim() != 3 or grids.shape[2] != 3 or grids.dtype.is_floating_point or grids.dtype == torch.bool:
            raise TrajectoryError(
                f"{where}: 'image_grid_thw' must be an integer [n, images, 3] tensor, got {grids.dtype} {list(grids.shape)}"
            )
    if "routed_experts" in traj:
        routes = traj["routed_experts"]
        if routes.dim() != 4 or routes.shape[:2] != ids.shape or routes.dtype.is_floating_point:
            raise TrajectoryError(
                f"{where}: 'routed_experts' must be an integer [n, L, layers, top_k] tensor, "
                f"got {routes.dtype} {list(routes.shape)}"
            )
