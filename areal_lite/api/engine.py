"""The two engine contracts: `TrainEngine` (owns a model being trained) and `InferenceEngine`
(generates rollouts). Algorithms talk to these and nothing else.

The data contract (docs/design.md), written once here and assumed everywhere:

Trajectory batch (what workflows return and the rollout controller concatenates), a
`tensordict.TensorDict` with batch size ``[B]``, right-padded to a common length ``L``:

=================  ===========  ============================================================
key                dtype/shape  meaning
=================  ===========  ============================================================
``input_ids``      int64 [B,L]  prompt + completion tokens (all turns, for multi-turn)
``attention_mask`` bool  [B,L]  true on real tokens (a prefix of each row)
``loss_mask``      int32 [B,L]  1 on tokens the policy produced and is trained on
``logprobs``       f32   [B,L]  behaviour log-prob of each token; 0 where loss_mask is 0
``versions``       int32 [B,L]  policy version that produced each token; -1 elsewhere
``rewards``        f32   [B]    sequence reward
=================  ===========  ============================================================

Optional keys with a meaning of their own:

==================  ====================  ===================================================
``routed_experts``  int32 [B,L,layers,k]  mixture-of-experts models: the experts each decoder
                                          layer's router chose for token ``i`` when the
                                          inference engine ran it (``top_k`` ids per layer;
                                          -1 on layers without experts, on positions never
                                          run, e.g. the last token, and on padding). Present
                                          when generation asked for them
                                          (``GenerationConfig.return_routed_experts``); with
                                          ``routing_replay`` the train engine's forward
                                          routes each token to them
                                          (`areal_lite.utils.moe`).
``pixel_values``    f32 [B,P,D]           vision-language models: each sequence's image
                                          patches as its processor made them (``D`` values
                                          per patch, 1176 for Qwen-VL's 14-pixel patches),
                                          its images' patches one after another in the order
                                          of their image tokens, right-padded with 0 to the
                                          batch's largest patch count ``P``.
``image_grid_thw``  int64 [B,I,3]         each of the sequence's images' patch grid (time,
                                          height, width), in the same order; rows of 0 pad
                                          to the batch's largest image count ``I``. Row
                                          ``b``'s patches are the first ``sum(prod(grid))``
                                          of ``pixel_values[b]``; a sequence without images
                                          has only zero rows. Both keys or neither.
==================  ====================  ===================================================

The two image keys are per-sequence whatever their second dimension (`IMAGE_KEYS`): padding
batches together pads them to the largest ``P`` and ``I``, and every micro-batch split and
reordering moves a sequence's images with it.

Alignment is to the token: ``logprobs[i]`` scores ``input_ids[i]`` given ``input_ids[:i]``; the
train engine does the shift when it computes logits; nothing else shifts. Position 0 of every
sequence has log-probability 0. An optional int64 ``[B, L]`` key ``target_ids`` changes what is
scored: ``logprobs[i]`` is then the log-probability of ``target_ids[i]`` given ``input_ids[:i]``
(targets that are not the next input token, e.g. a Tinker datum's ``target_tokens``).

Packed micro-batch (what a ``loss_fn`` receives): every per-token key above (and any per-token
key the caller added, e.g. ``advantages`` or ``prox_logp``) concatenated over real tokens into 1-D
``[T]`` tensors; per-sequence keys (e.g. ``rewards``) stay ``[B]``; plus ``cu_seqlens`` int32
``[B+1]`` (sequence boundaries), ``position_ids`` int64 ``[T]`` restarting at 0 per sequence, and
``max_seqlen`` (int). A key is per-token when its shape starts with ``[B, L]``; its trailing
dimensions stay (``routed_experts`` packs to ``[T, layers, k]``). The image keys pack to what the
model takes: ``pixel_values`` ``[P_total, D]``, the real patches of every sequence in sequence
order, and ``image_grid_thw`` ``[N, 3]``, the real images' rows in the same order. A train engine
of a vision-language model adds ``mm_token_type_ids`` int32 ``[T]`` (1 on the tokens the images
fill, 0 elsewhere) and ``mrope_position_ids`` int64 ``[T, 3]``: each token's multimodal rotary
position (time, height, width; the three are equal on text tokens), restarting per sequence,
computed by the model's own rule. The images fill a sequence's first image placeholder tokens, as
many as they have tokens, in order; a placeholder after those (one the model generated) is a text
token (`areal_lite.utils.vision.image_token_mask`, the same rule for generation).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from areal_lite.api.io import FinetuneSpec, ModelRequest, ModelResponse, SaveLoadMeta, WeightUpdateMeta

if TYPE_CHECKING:
    from tensordict import TensorDict

IMAGE_KEYS = ("pixel_values", "image_grid_thw")
"""The per-sequence keys of a trajectory that hold its images (vision-language models)."""

PackedBatch = dict[str, torch.Tensor | int]
"""A packed micro-batch: 1-D per-token tensors, [B] per-sequence tensors, cu_seqlens, max_seqlen."""

LossFn = Callable[[torch.Tensor, torch.Tensor, PackedBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``loss_fn(output, entropy, mb) -> (loss, stats)``.

``output`` is the per-token log-probabilities ``[T]`` aligned to the token (values ``[T]`` for a
critic engine), with gradient; ``entropy`` ``[T]`` the per-token entropy of the policy (with
gradient; zeros for a critic); ``mb`` the packed micro-batch. ``loss`` is a scalar normalised
within the micro-batch (e.g. a token mean); ``stats`` maps names to scalar tensors, averaged over
micro-batches with the same weights as the loss.
"""

AcceptFn = Callable[["TensorDict"], bool]
"""``should_accept(trajectory) -> keep?``: filters finished episodes (e.g. drop GRPO groups whose
rewards are all equal)."""

LossWeightFn = Callable[[PackedBatch], float]
"""``loss_weight_fn(mb) -> weight`` of a micro-batch, e.g. its number of trained tokens. Each
micro-batch loss is scaled by ``weight / total``, total summed over all micro-batches and all
data-parallel ranks of one `TrainEngine.train_batch` (or `TrainEngine.forward_backward`) call, so
the update does not depend on how the batch was cut."""


class TrainEngine(abc.ABC):
    """A model being trained: its parameters, optimizer, LR schedule, packing and micro-batching,
    checkpoints, and the sending side of weight updates. Knows nothing of any RL algorithm."""

    @abc.abstractmethod
    def initialize(self, ft_spec: FinetuneSpec | None = None) -> None:
        """Join (or create) the default process group, load the model from the configured HF
        directory, shard it, build the optimizer and the LR schedule derived from ``ft_spec``
        (no optimizer when ``ft_spec`` is None: a frozen reference model)."""

    @abc.abstractmethod
    def destroy(self) -> None:
        """Release the model, optimizer and any process groups this engine created."""

    @abc.abstractmethod
    def create_process_group(self) -> None:
        """Join (or create) the default process group and set up this backend's parallel layout,
        so that `data_parallel_rank` is known before the model loads (e.g. to shard the data the
        LR schedule's length depends on). `initialize` calls it when the script did not."""

    @property
    @abc.abstractmethod
    def data_parallel_rank(self) -> int:
        """This process's data-parallel rank (which slice of the data it trains on)."""

    @property
    @abc.abstractmethod
    def data_parallel_world_size(self) -> int:
        """Number of data-parallel ranks."""

    @abc.abstractmethod
    def forward(
        self, batch: TensorDict, *, with_entropy: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probabilities (values, for a critic) of a padded trajectory batch, without
        gradient. Returns float32 ``[B, L]`` in the batch's padded layout, aligned to the token
        (``out[b, i]`` scores ``input_ids[b, i]``; 0 at position 0 and on padding); with
        ``with_entropy`` also the per-token entropy ``[B, L]``. Computed on packed 1-D micro-batches
        with attention that never crosses sequence boundaries, logits chunk by chunk."""

    @abc.abstractmethod
    def train_batch(self, batch: TensorDict, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> dict[str, float]:
        """One optimizer step on a padded trajectory batch (this rank's share of the data):
        `forward_backward` then `optim_step` with the configured hyperparameters.

        Micro-batches by the configured `MicroBatchSpec`; each micro-batch loss is weighted by
        ``loss_weight_fn(mb) / total`` (total over all micro-batches and all data-parallel ranks);
        gradients are clipped; a non-finite gradient norm skips the step and logs a warning.
        Returns ``loss``, ``grad_norm``, ``lr``, ``update_successful`` (1.0/0.0) and the weighted
        means of the stats ``loss_fn`` returned."""

    @abc.abstractmethod
    def forward_backward(self, batch: TensorDict, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> dict[str, float]:
        """Add the gradient of a padded trajectory batch (this rank's share) to the gradients
        accumulated since the last `optim_step`, without stepping.

        Micro-batched and normalised as in `train_batch`, with ``total`` the weight of this call
        alone (its micro-batches, all data-parallel ranks): each call contributes the gradient of
        its own normalised loss, and calls add up. To accumulate one update over several calls
        equal to `train_batch` on the union of their batches, scale call ``c``'s loss by its share
        ``total_c / sum(total)`` of the union's weight (``1 / N`` for N calls of equal weight).
        Returns ``loss`` and the stats ``loss_fn`` returned, weighted means over this call."""

    @abc.abstractmethod
    def forward_backward_logprobs(
        self, batch: TensorDict, loss_fn: LossFn, loss_weight_fn: LossWeightFn
    ) -> tuple[dict[str, float], torch.Tensor]:
        """`forward_backward`, also returning the per-token log-probabilities ``[B, L]`` (float32,
        detached, laid out as `forward` returns them) that its own forward pass computed: one
        forward and one backward, where `forward` then `forward_backward` cost two forwards."""

    @abc.abstractmethod
    def optim_step(
        self,
        lr: float | None = None,
        weight_decay: float | None = None,
        max_grad_norm: float | None = None,
        *,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
    ) -> dict[str, float]:
        """Clip the accumulated gradients, step the optimizer and zero the gradients.

        The arguments apply to this step only; None takes the configured value: the LR schedule's
        current LR, ``optimizer.weight_decay`` (never applied to biases and norm weights),
        ``optimizer.gradient_clipping`` (0 = no clipping), Adam's ``betas`` and ``eps``. A
        non-finite gradient norm skips the step (the gradients are still zeroed) and logs a
        warning. Returns ``grad_norm`` (before clipping), ``lr`` (of this step) and
        ``update_successful`` (1.0/0.0)."""

    @abc.abstractmethod
    def eval_batch(self, batch: TensorDict, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> dict[str, float]:
        """Like `train_batch` without gradients or an update; returns the weighted loss and stats."""

    @abc.abstractmethod
    def step_lr_scheduler(self) -> None:
        """Advance the LR schedule by one training step."""

    @abc.abstractmethod
    def save(self, meta: SaveLoadMeta) -> None:
        """Write HF weights (``weight_format="hf"``) or the full training state
        (``"train_state"``; see `WeightFormat`). Collective: every rank calls it."""

    @abc.abstractmethod
    def load(self, meta: SaveLoadMeta) -> None:
        """Read what `save` wrote. Loading ``"train_state"`` restores model, optimizer, scheduler,
        step and RNG so that the next `train_batch` equals the uninterrupted run's."""

    @abc.abstractmethod
    def connect_engine(self, engine: InferenceEngine, meta: WeightUpdateMeta) -> None:
        """Remember the inference engine that receives weight updates; for ``distributed`` also
        create the weight-update process group with it (rank 0 is the trainer's rank 0)."""

    @abc.abstractmethod
    def update_weights(self, meta: WeightUpdateMeta) -> None:
        """Send the current full weights to the connected inference engine and wait until it has
        loaded them. Collective over the trainer's ranks (full tensors are gathered from shards);
        only rank 0 talks to the inference side."""

    @abc.abstractmethod
    def set_version(self, version: int) -> None:
        """Set the policy version (the number of weight updates so far)."""

    @abc.abstractmethod
    def get_version(self) -> int:
        """The current policy version."""


class InferenceEngine(abc.ABC):
    """Generates: an embedded model, or a client of SGLang-protocol servers.

    The contract is generation (`agenerate`), weight updates, the policy version new tokens are
    tagged with, and pausing generation. Running workflows over data under the staleness bound is
    the job of `areal_lite.core.RolloutController`, which the training loop holds and which drives
    an engine through these methods; an engine never calls back up.
    """

    @abc.abstractmethod
    def initialize(self) -> None:
        """Load the model or connect to the servers."""

    @abc.abstractmethod
    def destroy(self) -> None:
        """Release the model or the HTTP sessions."""

    @abc.abstractmethod
    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate one completion for ``req.input_ids``. Survives weight updates: a generation
        interrupted by one continues (or is resumed as prompt + generated tokens) so the response
        is complete and every token carries the version that produced it. ``stop_reason`` is
        ``length``, ``stop`` or ``abort``."""

    async def agenerate_batch(self, reqs: list[ModelRequest]) -> list[ModelResponse]:
        """Generate a completion for each request (e.g. the samples of a GRPO group): the same
        responses as awaiting `agenerate` on each, which is what this default does. A client of
        servers overrides it to send them as one batch request."""
        return list(await asyncio.gather(*(self.agenerate(r) for r in reqs)))

    @abc.abstractmethod
    def init_weights_update_group(self, meta: WeightUpdateMeta) -> Future[None]:
        """Join the weight-update process group described by ``meta`` (distributed updates).
        Returns at once; the future completes once joined (the trainer joins concurrently)."""

    def weight_update_group_intact(self) -> bool:
        """Whether every member of the group formed by `init_weights_update_group` is still
        there. A client of several servers answers False once one has died; the sender then forms
        a new group of the live ones before it broadcasts (a broadcast to a dead member fails).
        An engine in one process is always intact."""
        return True

    @abc.abstractmethod
    def update_weights(self, meta: WeightUpdateMeta) -> Future[None]:
        """Receive new weights: copy ``meta.named_tensors`` (in_process), load ``meta.path``
        (disk), or receive the broadcast of the tensors in ``meta.param_specs`` (distributed; the
        trainer broadcasts after this returns). Returns at once; the future completes once loaded.
        Generation is paused around the load by the caller or by the engine."""

    @abc.abstractmethod
    def set_version(self, version: int) -> None:
        """Tag tokens generated from now on with ``version``."""

    @abc.abstractmethod
    def get_version(self) -> int:
        """The version new tokens are tagged with."""

    @abc.abstractmethod
    def pause(self) -> None:
        """Pause generation: running generations are interrupted and continue (or are resumed as
        prompt + generated tokens) after `resume`, their later tokens tagged with the version
        then current. `agenerate` calls in progress do not return meanwhile."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Undo `pause`."""
