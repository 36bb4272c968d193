"""`TinyModelConfig`: the width and depth of the tiny model an example builds with
`areal_lite.utils.tiny.build_tiny_model`, one config section's fields for every example that does;
`RewardWarmUpConfig` adds the held-out and dev items and the SFT warm-up of an RL example that
stops its warm-up on a dev reward."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TinyModelConfig:
    """The tiny model's shape (a task section extends it; its other settings are the example's)."""

    hidden_size: int = 128
    """Width of the tiny model."""
    num_layers: int = 4
    """Depth of the tiny model."""


@dataclass
class RewardWarmUpConfig(TinyModelConfig):
    """The task section of an RL example on a tiny model built here, warmed up with SFT
    (`areal_lite.kit.warm_up_with_sft`) until its greedy reward on dev items reaches
    ``sft_target_reward``, then scored on held-out items before and after RL. The example adds its
    task's fields; its experiment config may give the section other defaults."""

    n_eval: int = 100
    """Held-out items for the mean greedy reward before and after RL."""
    n_dev: int = 20
    """Dev items for the SFT stopping rule (none of them held out)."""
    sft_steps: int = 300
    """At most this many SFT steps."""
    sft_target_reward: float = 0.2
    """Stop SFT once the dev greedy reward reaches this: RL needs groups whose rewards differ (that
    sometimes succeed)."""
    sft_eval_every: int = 5
    """Measure the dev reward every this many SFT steps."""
    sft_batch_size: int = 16
    """Demonstrations per SFT step and rank."""
    sft_lr: float = 1e-3
    """SFT learning rate."""
    seed: int = 0
    """Seed of the model and the task's items."""
