"""`ModelConfig`: how a model of the recipe API is built and run (train engine, micro-batching,
sequence length, tokenization, sampling, where generation runs)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from areal_lite.api.config import LoRAConfig, OptimizerConfig, TrainEngineConfig, one_of
from areal_lite.api.io import GenerationConfig, MicroBatchSpec


@dataclass
class ModelConfig:
    """How a recipe model is built and run."""

    backend: str = field(default="fsdp", metadata=one_of("fsdp", "megatron"))
    """Train engine: fsdp or megatron."""
    dtype: str = field(default="float32", metadata=one_of("float32", "bfloat16", "float16", "auto"))
    """Compute dtype of the train engine (see `TrainEngineConfig.dtype`)."""
    tensor_parallel_size: int = 1
    """Megatron only: tensor-parallel degree."""
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-5, gradient_clipping=1.0))
    """AdamW; its ``lr``, ``weight_decay`` and ``gradient_clipping`` are what ``optim_step`` uses
    for an argument left at None. The LR schedule is the recipe's (it passes ``lr``), so the
    engine's schedule is constant."""
    mb_spec: MicroBatchSpec = field(default_factory=MicroBatchSpec)
    """How the train engine cuts a step's batch into micro-batches (e.g. a token budget)."""
    max_seq_len: int = 2048
    """Longest thread, prompt plus completion, in tokens; longer ones are refused."""
    use_chat_template: bool = True
    """Render threads with the tokenizer's chat template; False: plain concatenation of the turns,
    each assistant turn followed by eos (raw-text tasks)."""
    gconfig: GenerationConfig = field(default_factory=lambda: GenerationConfig(max_new_tokens=256))
    """Default sampling of ``generate`` (eos always stops it)."""
    servers: list[str] = field(default_factory=list)
    """host:port of SGLang-protocol servers that generate for this model; empty = the embedded
    engine in this process."""
    weight_update: str = field(default="disk", metadata=one_of("disk", "distributed", "ipc"))
    """How weights reach servers: disk, distributed (a broadcast), or ipc (servers on this machine
    map the trainer's memory); the embedded engine takes them in process."""
    max_running_requests: int = 128
    """Embedded engine: requests decoded together."""
    inference_device: str = "cpu"
    """Embedded engine: cpu or cuda."""
    work_dir: str = ""
    """Where clones (``clone_inf``) and disk weight updates are written (a directory every rank
    can read); empty = a temporary directory, removed by `shutdown`."""
    logits_chunk_size: int = 1024
    """Tokens whose full-vocabulary logits are materialised at once when scoring."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """FSDP: train low-rank adapters instead of every weight (off while ``rank`` is 0). Only the
    adapters train and carry optimizer state, weight syncs ship the adapter alone, and ``save`` and
    ``clone_inf`` write the merged model (plus the PEFT adapter under ``adapter/``). Value models
    (`ValueModel`) train every weight."""
    shared_prefix: bool = False
    """FSDP: run the prompt that the samples of a group share through the model once, in scoring
    and training (`TrainEngineConfig.shared_prefix`; same results, less compute for groups)."""
    seed: int = 1
    """Seed of new heads (a value head) and of sampling."""

    def engine_config(self, path: str, is_critic: bool = False) -> TrainEngineConfig:
        return TrainEngineConfig(
            path=path,
            backend=self.backend,
            dtype=self.dtype,
            is_critic=is_critic,
            optimizer=replace(self.optimizer, lr_scheduler_type="constant", warmup_steps_proportion=0.0),
            mb_spec=self.mb_spec,
            logits_chunk_size=self.logits_chunk_size,
            tensor_parallel_size=self.tensor_parallel_size,
            shared_prefix=self.shared_prefix,
            lora=LoRAConfig() if is_critic else self.lora,
            seed=self.seed,
        )
