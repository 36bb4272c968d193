"""`TrainEngineBase`: the half of a train engine that does not depend on the backend, written once
for `FSDPEngine` and `MegatronEngine` (two copies of it would drift apart).

What lives here: the policy version; the split of a batch into packed micro-batches (as many on
every rank where collectives need it) and the per-sequence outputs put back in the batch's order;
the weight-update sender (`areal_lite.engines.train.weight_sync`), fed in the checkpoint layout
for broadcasts and ipc updates (`areal_lite.utils.hf_layout`: a mixture-of-experts model's experts one tensor
each, as any server reads them); the global loss normalisation (each micro-batch loss weighted by
``loss_weight_fn(mb) / total``, ``total`` summed over the micro-batches and the data-parallel
ranks) with the weighted means of the loss and the stats reduced over those ranks; `train_batch`
as `forward_backward` then `optim_step`; `forward_backward_logprobs`, which keeps the
log-probabilities its own forward pass computed (each sequence's row travels with it through the
micro-batch split); the optimizer step itself (one-step hyperparameters, Adam's betas and eps
among them, the skip on a non-finite gradient norm); `save` / `load` dispatch by
`SaveLoadMeta.weight_format`; teardown. LoRA is the FSDP engine's alone (it overrides the adapter
methods).

What a backend implements (the abstract methods at the end of the class): which micro-batches a
rank runs and how they run through the model with their losses, how gradients are clipped and
applied, and how its weights and training state are read and written.
"""

from __future__ import annotations

import abc
import functools
import logging
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist
from tensordict import TensorDict

from areal_lite.api.config import TrainEngineConfig
from areal_lite.api.engine import InferenceEngine, LossFn, LossWeightFn, PackedBatch, TrainEngine
from areal_lite.api.io import FinetuneSpec, SaveLoadMeta, WeightUpdateMeta, unknown_weight_format
from areal_lite.engines.train.lr_schedule import lr_multiplier
from areal_lite.engines.train.weight_sync import WeightSender
from areal_lite.utils.data import MicroBatchSplit, pack_batch, split_microbatches, unpack_sequences
from areal_lite.utils.distributed import destroy_default_group, init_default_group
from areal_lite.utils.hf_layout import CheckpointLayout

logger = logging.getLogger(__name__)

_ROW = "batch_row"
"""The per-sequence key `forward_backward_logprobs` adds: each sequence's row in the batch."""


class Optimizer(Protocol):
    """What the shared code uses of a backend's optimizer (torch's, or megatron's wrapper)."""

    param_groups: list[dict[str, object]]


_Method = TypeVar("_Method", bound=Callable[..., object])


def marks_computing(method: _Method) -> _Method:
    """Count the engine as computing while ``method`` runs (`TrainEngineBase.computing`)."""

    @functools.wraps(method)
    def wrapper(self: TrainEngineBase, *args: object, **kwargs: object) -> object:
        self._computing += 1
        try:
            return method(self, *args, **kwargs)
        finally:
            self._computing -= 1

    return wrapper  # type: ignore[return-value]


def read_back(passes: list[dict[str, torch.Tensor | float]]) -> list[dict[str, float]]:
    """Each micro-batch's loss and stats as floats, the device's values read in one transfer
    (waiting for the device once per step, not once per micro-batch)."""
    on_device = [v for stats in passes for v in stats.values() if isinstance(v, torch.Tensor)]
    values = iter(torch.stack([v.float().reshape(()) for v in on_device]).tolist() if on_device else [])
    return [
        {k: next(values) if isinstance(v, torch.Tensor) else float(v) for k, v in stats.items()} for stats in passes
    ]


class TrainEngineBase(TrainEngine):
    """The backend-independent state and methods of `FSDPEngine` and `MegatronEngine`."""

    def __init__(self, config: TrainEngineConfig) -> None:
        self.config = config
        self.model: torch.nn.Module | None = None
        self.optimizer: Optimizer | None = None
        self.device = torch.device("cpu")
        self.compute_dtype = torch.float32
        """What ``config.dtype`` resolved to (``auto``: `areal_lite.cpu.precision`)."""
        self._version = 0
        self._global_step = 0
        """Optimizer steps taken (a skipped step does not count)."""
        self._owns_group = False
        """Whether this engine created the default process group (and `destroy` ends it)."""
        self._sender = WeightSender()
        self._computing = 0
        """Calls of forward passes, losses or optimizer steps running now (`computing`)."""
        self._checkpoint: CheckpointLayout | None = None

    def create_process_group(self) -> None:
        if not dist.is_initialized():
            self._owns_group = init_default_group()

    def destroy(self) -> None:
        self.model = None
        self.optimizer = None
        self._sender = WeightSender()
        if self._owns_group:
            destroy_default_group()
        self._owns_group = False

    def _module(self) -> torch.nn.Module:
        if self.model is None:
            raise RuntimeError(f"{type(self).__name__}.initialize() has not been called (or destroy() was)")
        return self.model

    def _lr_factor(self, ft_spec: FinetuneSpec) -> Callable[[int], float]:
        """The configured LR schedule over the run's optimizer steps, as a multiplier of the peak."""
        opt = self.config.optimizer
        total = ft_spec.total_train_steps
        return lr_multiplier(opt.lr_scheduler_type, total, int(opt.warmup_steps_proportion * total), opt.min_lr_ratio)

    def _require_optimizer(self, method: str) -> Optimizer:
        if self.optimizer is None:
            raise RuntimeError(f"{method} needs an optimizer: initialize the engine with a FinetuneSpec")
        return self.optimizer

    @property
    def data_parallel_rank(self) -> int:
        return dist.get_rank(self._data_parallel_group())

    @property
    def data_parallel_world_size(self) -> int:
        return dist.get_world_size(self._data_parallel_group())

    def set_version(self, version: int) -> None:
        self._version = version

    def get_version(self) -> int:
        return self._version

    @property
    def computing(self) -> bool:
        """Whether a forward pass, a loss pass or an optimizer step runs now: what an engine
        generating in this process on CPU reads to yield its share of the cores (read without a
        lock, from another thread)."""
        return self._computing > 0

    def step_lr_scheduler(self) -> None:
        if self.optimizer is None:
            raise RuntimeError("a frozen engine (initialized without FinetuneSpec) has no LR scheduler")
        self._advance_lr_schedule()

    # ---------------------------------------------------------------- micro-batches

    def _max_over_ranks(self, n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _split_and_pack(
        self, batch: TensorDict, *, same_count_on_all_ranks: bool, to_device: bool
    ) -> tuple[list[PackedBatch], MicroBatchSplit, int]:
        """``batch`` split by ``config.mb_spec`` and packed: the micro-batches, the split (for
        restoring order) and how many are real. With ``same_count_on_all_ranks`` (where every
        forward pass has collectives across ranks whose data differ) a rank with fewer
        micro-batches splits finer, up to the largest count over all ranks, and repeats its first
        micro-batch for any it still lacks (those get weight 0). ``to_device``: the real
        micro-batches' tensors go to the compute device."""
        spec = self.config.mb_spec
        split = split_microbatches(batch, spec)
        n = len(split.mbs)
        if same_count_on_all_ranks:
            n = self._max_over_ranks(n)
            if len(split.mbs) < n:
                split = split_microbatches(batch, replace(spec, n_mbs=n))
            n = self._max_over_ranks(len(split.mbs))
        packed = [self._to_device(pack_batch(mb)) if to_device else pack_batch(mb) for mb in split.mbs]
        n_real = len(packed)
        packed += [packed[0]] * (n - n_real)
        return packed, split, n_real

    def _to_device(self, mb: PackedBatch) -> PackedBatch:
        return {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in mb.items()}

    @torch.no_grad()
    @marks_computing
    def forward(
        self, batch: TensorDict, *, with_entropy: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        self._module().eval()
        mbs, split, n_real = self._microbatches(batch)
        outputs = self._forward_passes(mbs, n_real, with_entropy)
        result = None
        if outputs is not None:
            width = batch["attention_mask"].shape[1]
            outs, ents = [], []
            for mb, (out, ent) in zip(mbs, outputs):
                cu = mb["cu_seqlens"]
                assert isinstance(cu, torch.Tensor)
                outs.append(unpack_sequences(out, cu.cpu(), width))
                ents.append(unpack_sequences(ent, cu.cpu(), width))
            order = split.restore_order
            result = (torch.cat(outs)[order], torch.cat(ents)[order])
        logprobs, entropy = self._from_last_stage(result)  # type: ignore[misc]
        return (logprobs, entropy) if with_entropy else logprobs

    # ---------------------------------------------------------------- losses and updates

    def train_batch(self, batch: TensorDict, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> dict[str, float]:
        result = self.forward_backward(batch, loss_fn, loss_weight_fn)
        result.update(self.optim_step())
        return result

    def forward_backward(self, batch: TensorDict, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> dict[str, float]:
        self._require_optimizer("forward_backward")
        return self._weighted_loss(batch, loss_fn, loss_weight_fn, train=True)

    def forward_backward_logprobs(
        self, batch: TensorDict, loss_fn: LossFn, loss_weight_fn: LossWeightFn
    ) -> tuple[dict[str, float], torch.Tensor]:
        # Each sequence carries its row so that the log-probabilities the loss sees, micro-batch
        # by micro-batch in whatever order the split made, go back to their rows.
        data = batch.clone(recurse=False)
        data[_ROW] = torch.arange(batch.batch_size[0], dtype=torch.int64)
        seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

        def recording_loss(
            out: torch.Tensor, entropy: torch.Tensor, mb: PackedBatch
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            rows, cu = mb[_ROW], mb["cu_seqlens"]
            assert isinstance(rows, torch.Tensor) and isinstance(cu, torch.Tensor)
            seen.append((rows.cpu(), cu.cpu(), out.detach().float().cpu()))
            return loss_fn(out, entropy, mb)

        stats = self.forward_backward(data, recording_loss, loss_weight_fn)
        width = batch["attention_mask"].shape[1]
        logprobs = torch.zeros(batch["attention_mask"].shape, dtype=torch.float32)
        for rows, cu, out in self._from_last_stage(seen):  # type: ignore[union-attr]
            logprobs[rows] = unpack_sequences(out, cu, width)
        return stats, logprobs

    def _from_last_stage(self, obj: object) -> object:
        """``obj`` as the stage that runs the losses has it, on every stage (pipeline-parallel
        backends override this; without pipeline stages every rank runs the losses)."""
        return obj

    @marks_computing
    def optim_step(
        self,
        lr: float | None = None,
        weight_decay: float | None = None,
        max_grad_norm: float | None = None,
        *,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
    ) -> dict[str, float]:
        groups = self._require_optimizer("optim_step").param_groups
        adam = {"betas": betas, "eps": eps}
        for key, value in adam.items():
            if value is not None and any(key not in group for group in groups):
                raise ValueError(f"{type(self).__name__}'s optimizer takes no per-step {key}")
        configured = [{k: group[k] for k in ("lr", "weight_decay", *adam) if k in group} for group in groups]
        for group in groups:
            if lr is not None:
                group["lr"] = lr
            if weight_decay is not None:
                # wd_mult: 0 for the parameters never decayed (biases, norm weights), as megatron marks them
                group["weight_decay"] = weight_decay * float(group.get("wd_mult", 1.0))  # type: ignore[arg-type]
            group.update({k: v for k, v in adam.items() if v is not None})
        step_lr = float(groups[0]["lr"])  # type: ignore[arg-type]
        clip = self.config.optimizer.gradient_clipping if max_grad_norm is None else max_grad_norm
        grad_norm = self._clip_gradients(clip)
        ok = math.isfinite(grad_norm)
        if ok:
            self._apply_update()
            self._global_step += 1
        else:
            logger.warning("non-finite gradient norm %s at step %d: skipping the update", grad_norm, self._global_step)
        self._zero_grad()
        for group, saved in zip(groups, configured):
            group.update(saved)
        return {"grad_norm": grad_norm, "lr": step_lr, "update_successful": float(ok)}

    @torch.no_grad()
    def eval_batch(self, batch: TensorDict, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> dict[str, float]:
        return self._weighted_loss(batch, loss_fn, loss_weight_fn, train=False)

    @marks_computing
    def _weighted_loss(
        self, batch: TensorDict, loss_fn: LossFn, loss_weight_fn: LossWeightFn, train: bool
    ) -> dict[str, float]:
        """Run the losses of every micro-batch (backward too when ``train``) and return the loss and
        stats averaged with the loss weights over micro-batches and data-parallel ranks."""
        mbs, _, n_real = self._microbatches(batch)
        read = read_back([{"w": loss_weight_fn(mb)} for mb in mbs[:n_real]])
        weights = [r["w"] for r in read] + [0.0] * (len(mbs) - n_real)
        total = self._sum_over_data_parallel({"total": sum(weights)})["total"]
        if total <= 0:
            raise ValueError("loss_weight_fn gave a total weight of 0 over the whole batch (no trained tokens?)")
        sums: dict[str, float] = {}
        self._module().train(train)
        for stats, w in zip(self._loss_passes(mbs, n_real, weights, total, loss_fn, train), weights):
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v * w / total
        keys = ["loss"] + sorted(k for k in sums if k != "loss")
        return self._sum_over_data_parallel({k: sums[k] for k in keys})

    def _sum_over_data_parallel(self, values: dict[str, float]) -> dict[str, float]:
        """``values`` summed over the data-parallel ranks (float64, on the compute device: megatron's
        groups may be NCCL-only on CUDA). Every rank must pass the same keys in the same order."""
        vec = torch.tensor(list(values.values()), dtype=torch.float64, device=self.device)
        dist.all_reduce(vec, group=self._data_parallel_group())
        return dict(zip(values, vec.tolist()))

    # ---------------------------------------------------------------- checkpoints and weight updates

    def save(self, meta: SaveLoadMeta) -> None:
        """Collective: every rank calls it; all have finished writing when it returns."""
        if meta.weight_format == "hf":
            self._save_hf(meta.path, meta.tokenizer)
        elif meta.weight_format == "peft":
            self._save_adapter(meta.path)
        elif meta.weight_format == "train_state":
            self._save_train_state(meta.path)
        else:
            raise unknown_weight_format(meta.weight_format)
        dist.barrier()

    def load(self, meta: SaveLoadMeta) -> None:
        if meta.weight_format == "hf":
            self._load_hf_weights(meta.path)
        elif meta.weight_format == "peft":
            raise ValueError("loading a PEFT adapter into a train engine is not supported: resume from a train_state")
        elif meta.weight_format == "train_state":
            self._load_train_state(meta.path)
        else:
            raise unknown_weight_format(meta.weight_format)
        dist.barrier()

    def _train_state_file(self, path: str, name: str) -> str:
        """``path/name``, a file this backend's `_save_train_state` writes; a clear error when it
        is missing (nothing there, or another backend's training state)."""
        file = os.path.join(path, name)
        if not os.path.exists(file):
            raise FileNotFoundError(
                f"{path} holds no {type(self).__name__} training state ({name} is missing): a train_state "
                "checkpoint is read back only by the backend that wrote it"
            )
        return file

    def connect_engine(self, engine: InferenceEngine, meta: WeightUpdateMeta) -> None:
        """Remember ``engine``; for distributed updates global rank 0 also builds the weight-update
        group (`WeightSender.connect`: a ``master_port`` of 0 is replaced in ``meta`` by a free port)."""
        self._sender.connect(engine, meta)

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        tensors = self._hf_tensors
        if meta.type in ("distributed", "ipc") and not self._checkpoint_layout().identity:
            layout = self._checkpoint_layout()

            def tensors() -> Iterator[tuple[str, torch.Tensor]]:
                return layout.to_checkpoint(self._hf_tensors())

        self._sender.send(meta, self._version, tensors, self._write_weights)

    def _checkpoint_layout(self) -> CheckpointLayout:
        """The checkpoint layout of the trained model (what disk, broadcast and ipc updates carry)."""
        if self._checkpoint is None:
            self._checkpoint = CheckpointLayout(self._hf_model_config())
        return self._checkpoint

    def _write_weights(self, path: str) -> None:
        """A disk weight update: the HF directory the inference servers load (collective)."""
        self._save_hf(path, None)

    def _save_adapter(self, path: str) -> None:
        """A PEFT adapter directory (``weight_format="peft"``); engines that train LoRA override it."""
        raise ValueError(f"{type(self).__name__} trains no LoRA adapter: there is no PEFT adapter to save")

    # ---------------------------------------------------------------- what a backend implements

    @abc.abstractmethod
    def _data_parallel_group(self) -> dist.ProcessGroup | None:
        """The group over which losses are normalised and gradients summed (None: all ranks)."""

    @abc.abstractmethod
    def _microbatches(self, batch: TensorDict) -> tuple[list[PackedBatch], MicroBatchSplit, int]:
        """This rank's packed micro-batches, the split (for restoring order) and how many of them
        are real data: any after those are padding passes that keep collectives matched (they get
        weight 0). `_split_and_pack` does the work."""

    @abc.abstractmethod
    def _forward_passes(
        self, mbs: list[PackedBatch], n_real: int, with_entropy: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Run each micro-batch through the model without gradients; return the per-token outputs
        (log-probabilities, a critic's values) and entropies ``[T]`` of each real micro-batch, fp32
        on CPU (None on a pipeline stage that does not run the head)."""

    @abc.abstractmethod
    def _loss_passes(
        self, mbs: list[PackedBatch], n_real: int, weights: list[float], total: float, loss_fn: LossFn, train: bool
    ) -> list[dict[str, float]]:
        """Run ``loss_fn`` on each micro-batch; when ``train``, backward of each loss scaled by its
        ``weight / total`` with gradients summed (not averaged) over data-parallel ranks. Returns
        the unweighted loss (key ``loss``) and stats of each real micro-batch, on every rank."""

    @abc.abstractmethod
    def _clip_gradients(self, max_norm: float) -> float:
        """Finish the gradients (reductions the passes left pending), clip their global norm to
        ``max_norm`` (0 = no clipping) and return the norm before clipping."""

    @abc.abstractmethod
    def _apply_update(self) -> None:
        """The optimizer step on the clipped gradients."""

    @abc.abstractmethod
    def _zero_grad(self) -> None:
        """Drop every accumulated gradient (they start at zero, and `optim_step` ends with this)."""

    @abc.abstractmethod
    def _advance_lr_schedule(self) -> None:
        """Move the LR schedule one optimizer step on."""

    @abc.abstractmethod
    def _hf_model_config(self) -> object:
        """The HF config of the trained model (a causal LM's)."""

    @abc.abstractmethod
    def _hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors in the compute dtype, one at a time, as copies later steps cannot
        change. Collective: every rank iterates to the end and gets the real values (with the
        embedded engine, each rank's own engine loads them)."""

    @abc.abstractmethod
    def _save_hf(self, path: str, tokenizer: object | None) -> None:
        """A HF model directory (and ``tokenizer``) from rank 0 that ``from_pretrained`` loads."""

    @abc.abstractmethod
    def _load_hf_weights(self, path: str) -> None:
        """Replace the model's weights by those of a HF directory (optimizer state untouched)."""

    @abc.abstractmethod
    def _save_train_state(self, path: str) -> None:
        """Everything a resumed run needs to continue exactly (``weight_format="train_state"``)."""

    @abc.abstractmethod
    def _load_train_state(self, path: str) -> None:
        """Restore what `_save_train_state` wrote; a directory another backend wrote is refused
        with an error that says so."""


__all__ = ["TrainEngineBase"]
