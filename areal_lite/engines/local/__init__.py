"""The embedded inference engine: `LocalInferenceEngine` (``engine.py``), the `InferenceEngine` of a
`Scheduler` in this process (``scheduler.py``: one thread, continuous batching, pause and weight
updates), which drives a `ModelRunner` (``model_runner.py``: the model over a slot-based KV cache,
sampling). Beside them: a request's state (``request.py``), what sampling options do to the logits
(``shaping.py``), structured output (``grammar.py``), the served LoRA adapter
(``adapter_slot.py``) and the decode step as CUDA graphs (``decode_graphs.py``). CPU kernels come
from `areal_lite.cpu`.
"""
