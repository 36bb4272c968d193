"""Train and inference engines. `make_train_engine` picks the train backend from the config's
``backend`` field (``fsdp`` or ``megatron``), so swapping backends is one config line."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from areal_lite.api.config import TrainEngineConfig
    from areal_lite.api.engine import TrainEngine


def make_train_engine(config: TrainEngineConfig) -> TrainEngine:
    """An uninitialised `FSDPEngine` or `MegatronEngine` for ``config.backend``. The backends are
    imported lazily: megatron-core is an optional dependency."""
    if config.backend == "fsdp":
        from areal_lite.engines.fsdp import FSDPEngine

        return FSDPEngine(config)
    if config.backend == "megatron":
        from areal_lite.engines.megatron import MegatronEngine

        return MegatronEngine(config)
    raise ValueError(f"backend must be fsdp or megatron, got {config.backend!r}")


__all__ = ["make_train_engine"]
