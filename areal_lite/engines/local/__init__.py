"""The embedded inference engine: `LocalInferenceEngine` (``engine.py``), the `InferenceEngine` of a
`Scheduler` in this process (``scheduler.py``: one thread, continuous batching, pause and weight
updates), which drives a `ModelRunner` (``model_runner.py``: the model over a slot-based KV cache,
sampling). Beside them: a request's state (``request.py``), what sampling options do to the logits
(``shaping.py``), structured output (``grammar.py``), the served LoRA adapter
(``adapter_slot.py``) and the decode step as CUDA graphs (``decode_graphs.py``). CPU kernels come
from `areal_lite.cpu`.

``from areal_lite.engines.local import LocalInferenceEngine`` loads only the module it names.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LocalInferenceEngine": "areal_lite.engines.local.engine",
    "Scheduler": "areal_lite.engines.local.scheduler",
    "SamplingParams": "areal_lite.engines.local.request",
}

__all__ = ["LocalInferenceEngine", "SamplingParams", "Scheduler"]


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
