"""The train engines: `FSDPEngine` (``fsdp.py``) and `MegatronEngine` (``megatron.py``) over
`TrainEngineBase` (``base.py``: packing, micro-batches, global loss normalisation, checkpoints,
weight push), with what only they use: packed attention (``varlen_attention.py``), the LM head's
chunked log-probabilities (``logprob.py``), the shared-prefix trees (``shared_prefix.py``), the LR
schedule, the sending side of weight updates (``weight_sync.py``), HF <-> megatron-core weights
(``mcore_convert.py``, ``mcore_cpu.py``) and `MultiLoRAEngine` (``multi_lora.py``).

``from areal_lite.engines.train import FSDPEngine`` loads only the module it names.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "TrainEngineBase": "areal_lite.engines.train.base",
    "FSDPEngine": "areal_lite.engines.train.fsdp",
    "MegatronEngine": "areal_lite.engines.train.megatron",
    "MultiLoRAEngine": "areal_lite.engines.train.multi_lora",
}

__all__ = ["FSDPEngine", "MegatronEngine", "MultiLoRAEngine", "TrainEngineBase"]


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
