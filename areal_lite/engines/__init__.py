"""The engines, one room per system:

- `areal_lite.engines.train`: the train engines, `FSDPEngine` and `MegatronEngine` over their shared
  base (packing, micro-batches, checkpoints, weight push), their weight conversions and multi-LoRA.
- `areal_lite.engines.local`: the embedded inference engine, `LocalInferenceEngine` over a
  continuous-batching `Scheduler` and its `ModelRunner` (sampling, grammars, CUDA graphs).
- `areal_lite.engines.server`: our HTTP server over the embedded engine (``python -m
  areal_lite.engines.server``): SGLang's protocol, vLLM's RL routes and the OpenAI routes.
- `areal_lite.engines.remote`: clients of generation servers, `RemoteSGLangEngine` and
  `RemoteVLLMEngine`, over a `ServerFleet`.

The public classes are importable from here too (``from areal_lite.engines import FSDPEngine``),
loaded on first use so that importing one room does not import the others.
`areal_lite.kit.make_train_engine` picks the train backend from the config's ``backend`` field, so
swapping backends is one config line.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "TrainEngineBase": "areal_lite.engines.train.base",
    "FSDPEngine": "areal_lite.engines.train.fsdp",
    "MegatronEngine": "areal_lite.engines.train.megatron",
    "LocalInferenceEngine": "areal_lite.engines.local.engine",
    "RemoteSGLangEngine": "areal_lite.engines.remote.sglang",
    "RemoteEngine": "areal_lite.engines.remote.client",
    "RemoteVLLMEngine": "areal_lite.engines.remote.vllm",
    "MultiLoRAEngine": "areal_lite.engines.train.multi_lora",
    "Scheduler": "areal_lite.engines.local.scheduler",
    "ServerFleet": "areal_lite.engines.remote.fleet",
}

__all__ = [
    "FSDPEngine",
    "LocalInferenceEngine",
    "MegatronEngine",
    "MultiLoRAEngine",
    "RemoteEngine",
    "RemoteSGLangEngine",
    "RemoteVLLMEngine",
    "Scheduler",
    "ServerFleet",
    "TrainEngineBase",
]


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
