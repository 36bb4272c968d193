"""Backend-agnostic actors: each holds a `TrainEngine` and calls only its ``forward`` and
``train_batch`` (plus the loop's pass-throughs), so it runs unchanged on FSDP and Megatron."""

from areal_lite.actors.distill import DistillActor
from areal_lite.actors.dpo import DPOActor
from areal_lite.actors.ppo import PPOActor, PPOCritic
from areal_lite.actors.reinforce import ReinforceActor
from areal_lite.actors.sft import SFTActor
from areal_lite.actors.tangent import summed_loss, train_on_tangents

__all__ = [
    "DPOActor",
    "DistillActor",
    "PPOActor",
    "PPOCritic",
    "ReinforceActor",
    "SFTActor",
    "summed_loss",
    "train_on_tangents",
]
