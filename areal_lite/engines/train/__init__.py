"""The train engines: `FSDPEngine` (``fsdp.py``) and `MegatronEngine` (``megatron.py``) over
`TrainEngineBase` (``base.py``: packing, micro-batches, global loss normalisation, checkpoints,
weight push), with what only they use: packed attention (``varlen_attention.py``), the LM head's
chunked log-probabilities (``logprob.py``), the shared-prefix trees (``shared_prefix.py``), the LR
schedule, the sending side of weight updates (``weight_sync.py``), HF <-> megatron-core weights
(``mcore_convert.py``, ``mcore_cpu.py``) and `MultiLoRAEngine` (``multi_lora.py``).
"""
