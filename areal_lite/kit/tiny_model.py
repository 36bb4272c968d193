"""`TinyModelConfig`: the width and depth of the tiny model an example builds with
`areal_lite.utils.tiny.build_tiny_model`, one config section's fields for every example that does."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TinyModelConfig:
    """The tiny model's shape (a task section extends it; its other settings are the example's)."""

    hidden_size: int = 128
    """Width of the tiny model."""
    num_layers: int = 4
    """Depth of the tiny model."""
