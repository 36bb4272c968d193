"""Typed messages passed between workflows, inference engines and train engines.

Everything here is plain data: no engine, no HTTP, no torch.distributed. `api/` imports nothing
else from the package, so these types can be shared by every layer without import cycles.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from areal_lite.api.bounds import at_least, between, check_bounds, more_than

if TYPE_CHECKING:
    import torch

StopReason = Literal["length", "stop", "interrupt", "abort"]
"""Why a generation ended.

- ``length``: ``max_new_tokens`` reached.
- ``stop``: an end-of-sequence token, a stop token id or a stop string was produced.
- ``interrupt``: generation was paused for a weight update; the client resumes it as
  prompt + generated tokens, so a finished `ModelResponse` never carries this reason.
- ``abort``: the request was cancelled (``/abort_request``, shutdown) and will not be resumed.
"""

WeightUpdateType = Literal["in_process", "disk", "distributed", "ipc"]

WeightFormat = Literal["hf", "peft", "train_state"]
"""What `TrainEngine.save` writes and `TrainEngine.load` reads.

- ``hf``: a HF model directory (safetensors, config, tokenizer when given) that
  ``from_pretrained`` loads; the same from every backend. An engine that trains LoRA adapters
  writes the model with its adapter merged into the weights, and the adapter itself (``peft``
  below) in the subdirectory ``adapter``.
- ``peft``: a PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``) that
  ``peft.PeftModel.from_pretrained`` loads over the base model; engines that train LoRA only.
- ``train_state``: everything a resumed run needs to continue exactly (model, optimizer, LR
  schedule, step, policy version, RNG). The files are the backend's own and only the backend
  that wrote them reads them back: FSDP writes model and optimizer with
  torch.distributed.checkpoint plus a `torch.save` file per rank for the rest; Megatron writes
  one `torch.save` file per rank and needs the same parallel layout to resume.
"""
WEIGHT_FORMATS: tuple[WeightFormat, ...] = ("hf", "peft", "train_state")


def unknown_weight_format(name: str) -> ValueError:
    """The error for a ``weight_format`` that is not one of `WEIGHT_FORMATS`."""
    hint = " ('dcp' is called 'train_state': not every backend writes torch.distributed.checkpoint)"
    return ValueError(
        f"weight_format must be one of {', '.join(WEIGHT_FORMATS)}, got {name!r}" + (hint if name == "dcp" else "")
    )


@dataclass
class GenerationConfig:
    """Sampling parameters for one request (a subset of SGLang's ``sampling_params``)."""

    n_samples: int = field(default=1, metadata=at_least(1))
    """Samples per prompt. Workflows send ``n_samples`` separate requests, each with its own rid."""
    max_new_tokens: int = field(default=64, metadata=at_least(1))
    """Upper bound on generated tokens."""
    min_new_tokens: int = field(default=0, metadata=at_least(0))
    """End-of-sequence and stop tokens are suppressed until this many tokens were generated."""
    temperature: float = field(default=1.0, metadata=at_least(0.0))
    """Softmax temperature; ignored when ``greedy``."""
    top_p: float = field(default=1.0, metadata={**more_than(0.0), **between(0.0, 1.0)})
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = field(default=-1, metadata=at_least(-1))
    """Keep the k most likely tokens (-1 = all)."""
    greedy: bool = False
    """Argmax decoding; log-probabilities are still those of the untempered distribution."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation (in addition to the tokenizer's eos)."""
    stop: list[str] = field(default_factory=list)
    """Strings that end generation once the decoded output contains them."""
    ignore_eos: bool = False
    """Keep generating after eos (benchmarks)."""
    min_p: float = field(default=0.0, metadata=between(0.0, 1.0))
    """Drop the tokens less likely than this fraction of the most likely one (0 = off)."""
    frequency_penalty: float = field(default=0.0, metadata=between(-2.0, 2.0))
    """Subtracted from a token's logit for each time it is already in the output (0 = off)."""
    presence_penalty: float = field(default=0.0, metadata=between(-2.0, 2.0))
    """Subtracted from a token's logit once it is in the output (0 = off)."""
    repetition_penalty: float = field(default=1.0, metadata=more_than(0.0))
    """Divides a positive logit (multiplies a negative one) of a token already in the prompt or
    the output (1 = off). Penalties and ``min_p`` shape what is sampled, not the reported
    log-probabilities, which stay the policy's: a penalized rollout is slightly off-policy."""
    return_routed_experts: bool = False
    """Mixture-of-experts models: return the experts each token was routed to
    (`ModelResponse.routed_experts`; SGLang's ``return_routed_experts``), which the trajectory
    carries as ``routed_experts`` for routing replay in the train engine."""

    def new(self, **changes: object) -> GenerationConfig:
        """A copy with some fields changed."""
        return replace(self, **changes)

    def to_sglang(self) -> dict[str, object]:
        """The ``sampling_params`` dict of the SGLang protocol (docs/protocol.md) for this config."""
        params: dict[str, object] = {
            "max_new_tokens": self.max_new_tokens,
            "min_new_tokens": self.min_new_tokens,
            "temperature": 0.0 if self.greedy else self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "ignore_eos": self.ignore_eos,
        }
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        if self.stop:
            params["stop"] = list(self.stop)
        return {**params, **self.shaping()}

    def shaping(self) -> dict[str, float]:
        """The ``min_p`` and penalty options not at their off value, under the names SGLang's
        and vLLM's requests both use."""
        off = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}
        return {key: getattr(self, key) for key, value in off.items() if getattr(self, key) != value}


@dataclass
class ModelRequest:
    """One generation request: a prompt given as token ids (never text, so nothing is re-tokenized),
    and its images for a vision-language model."""

    input_ids: list[int]
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    """Request id. Requests with the same rid stay on one server (prefix-cache locality)."""
    images: list[bytes] = field(default_factory=list, repr=False)
    """Vision-language models: the prompt's images as image files' bytes (PNG, JPEG; see
    `areal_lite.utils.vision.encode_image`), one per image in the order of their placeholders in
    ``input_ids``, which hold each image's tokens as the model's processor expanded them (Qwen-VL:
    ``<|vision_start|>``, one ``<|image_pad|>`` per image token, ``<|vision_end|>``). The engine
    processes them with the model's processor, as the workflow did for the trajectory, so both
    sides see the same pixels. A request resumed after an interruption keeps them. An engine that
    cannot take images refuses a request that has some."""


@dataclass
class ModelResponse:
    """The result of one request, possibly stitched together across weight updates."""

    input_tokens: list[int]
    output_tokens: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    """Log-probability of each output token under the policy that produced it (temperature 1,
    before top-p/top-k truncation), so it matches what the train engine recomputes."""
    output_versions: list[int] = field(default_factory=list)
    """Policy version that produced each output token."""
    stop_reason: StopReason = "length"
    latency: float = 0.0
    """Seconds from submission to the last token."""
    ttft: float = 0.0
    """Seconds to the first output token."""
    rid: str = ""
    routed_experts: torch.Tensor | None = None
    """With ``GenerationConfig.return_routed_experts``: int32 ``[input_len + output_len - 1,
    layers, top_k]``, row ``i`` the experts of each decoder layer (-1 on layers without experts)
    that token ``i`` went through (the last token never goes through the model). For a response
    stitched together across weight updates, the routes of its last part, which covers the whole
    prefix."""

    @property
    def input_len(self) -> int:
        return len(self.input_tokens)

    @property
    def output_len(self) -> int:
        return len(self.output_tokens)


@dataclass
class ParamSpec:
    """Name, shape and dtype of one tensor sent in a distributed weight update."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    """A torch dtype name without the ``torch.`` prefix, e.g. ``"float32"`` or ``"bfloat16"``."""


@dataclass
class WeightUpdateMeta:
    """How new weights travel from the train engine to the inference engine.

    - ``in_process``: the trainer hands full tensors to an engine in its own process.
    - ``disk``: trainer rank 0 writes HF safetensors to ``path``; servers load them.
    - ``distributed``: trainer rank 0 and the servers share a process group
      (``master_address:master_port``, ``group_name``); rank 0 broadcasts each tensor, in chunks
      of at most ``chunk_bytes``, after announcing the chunk's ``param_specs``.
    - ``ipc``: servers on the trainer's machine map the trainer's memory. Rank 0 copies the full
      tensors into buckets of at most ``chunk_bytes`` (POSIX shared memory on CPU, one device
      allocation on a GPU) and sends each bucket's handles (``serialized_tensors``, SGLang's
      ``update_weights_from_tensor``); a bucket is freed once every server has loaded it. No
      file and no process group: the servers must run on this machine.
    """

    type: WeightUpdateType
    path: str | None = None
    master_address: str = "127.0.0.1"
    master_port: int = 0
    group_name: str = "weight_update_group"
    backend: str = "gloo"
    world_size: int = 0
    """Size of the weight-update group: 1 (trainer rank 0) + all server ranks. Set by the engine."""
    chunk_bytes: int = 256 * 1024 * 1024
    """Distributed and ipc: the most bytes of tensors one chunk (one bucket) carries; a larger
    tensor goes alone."""
    version: int | None = None
    """Policy version the new weights carry; the receiving side tags new tokens with it."""
    param_specs: list[ParamSpec] = field(default_factory=list)
    """Distributed only: the tensors of the chunk about to be broadcast, in broadcast order."""
    last_chunk: bool = True
    """Distributed and ipc: whether this chunk ends the update. Servers that apply an update whole
    (vLLM's, through our worker extension) keep earlier chunks until the last one arrives."""
    serialized_tensors: str | None = field(default=None, repr=False)
    """Ipc only: one bucket's tensors as handles to the trainer's memory, one entry of SGLang's
    ``serialized_named_tensors`` (`areal_lite.utils.tensor_handles.TensorBucket.serialize`)."""
    named_tensors: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    """In-process only: full (unsharded) tensors keyed by HF parameter name (adapter tensors keyed
    by their PEFT name when ``lora_config`` is set)."""
    lora_config: dict[str, object] | None = None
    """Set by a train engine that trains LoRA adapters: the update carries the adapter alone (its
    tensors under the names a PEFT adapter file gives them; a directory in PEFT's layout for
    ``disk``), and this is its PEFT config (what ``adapter_config.json`` holds). None: full weights."""

    def __post_init__(self) -> None:
        if self.type not in ("in_process", "disk", "distributed", "ipc"):
            raise ValueError(f"WeightUpdateMeta.type must be in_process, disk, distributed or ipc, got {self.type!r}")
        if self.type == "disk" and not self.path:
            raise ValueError("a disk weight update needs WeightUpdateMeta.path")

    def to_json(self) -> dict[str, object]:
        """A JSON-safe view (no tensors)."""
        d = asdict(replace(self, named_tensors=None))
        d.pop("named_tensors")
        return d


@dataclass
class SaveLoadMeta:
    """What `TrainEngine.save` / `load` write or read: a directory in one of the `WeightFormat`s."""

    path: str
    weight_format: WeightFormat = "hf"
    """``hf`` (portable weights) or ``train_state`` (everything to resume; see `WeightFormat`)."""
    tokenizer: object | None = None
    """A tokenizer (anything with ``save_pretrained``) written beside HF weights."""

    def __post_init__(self) -> None:
        if self.weight_format not in WEIGHT_FORMATS:
            raise unknown_weight_format(self.weight_format)


@dataclass
class FinetuneSpec:
    """The length of a run, from which LR schedules are derived."""

    total_train_epochs: int
    dataset_size: int
    train_batch_size: int

    @property
    def steps_per_epoch(self) -> int:
        return max(1, self.dataset_size // self.train_batch_size)

    @property
    def total_train_steps(self) -> int:
        return self.total_train_epochs * self.steps_per_epoch


@dataclass
class MicroBatchSpec:
    """How a batch is cut into micro-batches.

    At least ``n_mbs`` micro-batches; none longer than ``max_tokens_per_mb`` real tokens (None =
    no budget); groups of ``granularity`` consecutive sequences (a GRPO group) never split.
    """

    n_mbs: int = field(default=1, metadata=at_least(1))
    max_tokens_per_mb: int | None = field(default=None, metadata=at_least(1))
    granularity: int = field(default=1, metadata=at_least(1))

    def __post_init__(self) -> None:
        check_bounds(self)
