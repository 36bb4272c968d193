"""The embedded inference engine: `LocalInferenceEngine` (``engine.py``), the `InferenceEngine` of a
`Scheduler` in this process (``scheduler.py``: one thread, continuous batching, pause), which
loads weight updates through a `WeightLoader` (``weights.py``: from tensors, disk, a broadcast, LoRA
adapters) and drives a `ModelRunner` (``model_runner.py``: batched prefill and decode, the model
over a slot-based KV cache). Beside them: loading the model (``model_loading.py``), picking and
recording each next token (``sampling.py``), a request's state (``request.py``), what sampling
options do to the logits (``shaping.py``), structured output (``grammar.py``), the served LoRA
adapter (``adapter_slot.py``), the decode step as CUDA graphs (``decode_graphs.py``), linear layers
with weights laid out once for oneDNN (``packed_linears.py``) and results handed across threads
(``futures.py``). CPU kernels come from `areal_lite.cpu`.
"""
