"""The train engines: `FSDPEngine` (``fsdp.py``, its model in ``fsdp_model.py``) and
`MegatronEngine` (``megatron.py``, its megatron-core model and optimizer in ``mcore_model.py``, its
weights as HF tensors in ``mcore_weights.py``) over `TrainEngineBase` (``base.py``: micro-batches,
global loss normalisation, the optimizer step, checkpoints, weight push), with what only they use:
packed attention (``varlen_attention.py``), the LM head's chunked log-probabilities
(``logprob.py``), the shared-prefix trees (``shared_prefix.py``), the LR schedule, the sending side
of weight updates (``weight_sync.py``), HF <-> megatron-core tensor conversion
(``mcore_convert.py``), megatron-core on CPU (``mcore_cpu.py``) and `MultiLoRAEngine`
(``multi_lora.py``).
"""
