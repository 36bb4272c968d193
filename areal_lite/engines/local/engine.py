"""The embedded inference engine: `InferenceEngine` over a `Scheduler` in this process.

The scheduler (`areal_lite.engines.local.scheduler`) owns the model and does the work: continuous
batching over the model runner's slot-based KV cache, aborts and pauses, weight loads between two
decode steps. This adapter gives it the contract the rollout controller drives: `agenerate` on
`ModelRequest`s, `update_weights` from a `WeightUpdateMeta` (in-process tensors, a directory on
disk, or a broadcast in a weight-update group that the engine joins as rank 1 of 2), the version
new tokens are tagged with, and pause (in place: running requests keep their KV cache, which is
recomputed if the weights change) / resume. Weight updates go to the scheduler's `WeightLoader`
(`areal_lite.engines.local.weights`); an update from a LoRA train engine carries its adapter
alone, which it merges into the weights (as adapter `ADAPTER`). A vision-language model's requests
carry their images (``ModelRequest.images``: docs/vision.md).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from areal_lite.api.config import LocalEngineConfig
from areal_lite.api.engine import InferenceEngine
from areal_lite.api.io import ModelRequest, ModelResponse, WeightUpdateMeta
from areal_lite.engines.local.adapter_slot import SEPARATOR
from areal_lite.engines.local.request import SamplingParams
from areal_lite.engines.local.scheduler import Scheduler

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ADAPTER = "policy"
"""The name the trained LoRA adapter is held under."""


class LocalInferenceEngine(InferenceEngine):
    """Generation in this process on a HF causal LM or vision-language model (CPU or CUDA), with
    continuous batching.

    `agenerate` may be awaited from any event loop and any thread.
    """

    def __init__(self, config: LocalEngineConfig) -> None:
        self.config = config
        self.scheduler = Scheduler(config)
        self._registered: dict[str, object] | None = None
        """The config of the adapter registered for broadcasts (None: none yet)."""

    def initialize(self) -> None:
        """Load the model and tokenizer and start the scheduler thread."""
        self.scheduler.start()

    def destroy(self) -> None:
        self.scheduler.stop()

    @property
    def model(self) -> torch.nn.Module | None:
        """The HF model generating (None before `initialize`)."""
        return self.scheduler.model

    @property
    def busy(self) -> bool:
        """Whether the engine is generating (requests running or queued, not paused)."""
        return self.scheduler.busy

    @property
    def thread_share(self) -> int:
        """The threads the engine's ops run on when it has a share of its own
        (`LocalEngineConfig.num_threads`); 0 when it runs on the process's count."""
        return self.config.num_threads

    def yield_threads_to(self, computing: Callable[[], bool], share: int) -> None:
        """See `Scheduler.yield_threads_to` (a trainer in this process connects it)."""
        self.scheduler.yield_threads_to(computing, share)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The tokenizer of the model directory (None when it has none)."""
        return self.scheduler.tokenizer

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        if req.gconfig.return_routed_experts and self.scheduler.routing_shape is None:
            raise ValueError("return_routed_experts is set but the model has no mixture-of-experts layers")
        _, images = await self.scheduler.prepare_images(req.input_ids, req.images)
        params = SamplingParams.from_gconfig(req.gconfig)
        res = await self.scheduler.generate(req.input_ids, params, rid=req.rid, images=images)
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=res.output_ids,
            output_logprobs=res.output_logprobs,
            output_versions=res.output_versions,
            stop_reason=res.finish_reason["type"],  # type: ignore[arg-type]
            latency=res.latency,
            ttft=res.ttft,
            rid=req.rid,
            routed_experts=res.routed_experts if req.gconfig.return_routed_experts else None,
        )

    def init_weights_update_group(self, meta: WeightUpdateMeta) -> Future[None]:
        """Join the weight-update group as rank 1 of 2 (the trainer is rank 0)."""
        meta.world_size = 2
        return self.scheduler.weights.join_weights_update_group(meta, rank=1)

    def update_weights(self, meta: WeightUpdateMeta) -> Future[None]:
        lora = meta.lora_config
        if meta.type == "in_process":
            if meta.named_tensors is None:
                raise ValueError("an in_process weight update needs named_tensors")
            if lora is not None:
                return self.scheduler.weights.load_adapter(ADAPTER, lora, dict(meta.named_tensors), meta.version)
            return self.scheduler.weights.load_tensors(dict(meta.named_tensors), meta.version)
        if meta.type == "ipc":
            raise ValueError("the embedded engine shares the trainer's process: give it in_process updates, not ipc")
        if meta.type == "disk":
            if lora is not None:
                return self.scheduler.weights.load_adapter_from_disk(ADAPTER, meta.path or "", meta.version)
            return self.scheduler.weights.load_weights_from_disk(meta.path or "", meta.version)
        specs = list(meta.param_specs)
        names = [s.name for s in specs]
        if lora is not None:
            # As a server is told: the adapter is registered once, then its tensors are announced by name.
            if self._registered != lora:
                self.scheduler.weights.register_adapter(ADAPTER, lora).result()
                self._registered = lora
            names = [f"{ADAPTER}{SEPARATOR}{n}" for n in names]
        return self.scheduler.weights.receive_broadcast(
            names, [s.dtype for s in specs], [list(s.shape) for s in specs], meta.version
        )

    def set_version(self, version: int) -> None:
        self.scheduler.version = version

    def get_version(self) -> int:
        return self.scheduler.version

    def pause(self) -> None:
        """Freeze running requests in place (their caches are recomputed if weights change)."""
        self.scheduler.pause_generation("in_place")

    def resume(self) -> None:
        self.scheduler.continue_generation()


__all__ = ["LocalInferenceEngine"]
