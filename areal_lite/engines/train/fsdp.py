"""`FSDPEngine`: a HF causal language model (or value model) trained with PyTorch FSDP2.

Every decoder layer and the root are sharded with ``fully_shard`` over all ranks (gloo on CPU,
NCCL on CUDA). Batches are packed into one 1-D sequence per micro-batch, which the model
(`areal_lite.engines.train.fsdp_model`: loading, LoRA, sharding and the `PackedModel` root) runs
without attention crossing sequence boundaries, applying the LM head chunk by chunk.

Loss normalisation is global: each micro-batch loss is scaled by ``loss_weight_fn(mb) / total``
with ``total`` summed over all micro-batches and all ranks, and FSDP's gradient averaging over
ranks is undone, so the gradient equals that of the whole batch on one rank. Ranks whose share
cuts into fewer micro-batches run extra zero-weight passes so that FSDP's collectives match.

Mixed precision (``dtype=bfloat16``, or ``auto`` where the device computes bf16 natively) keeps
fp32 master weights and optimizer state, computes in bf16 and reduces gradients in fp32.

On CPU the HF model's RMS norms and SiLU products run fused, and its fp32 linears and head go
through oneDNN where MKL would run below the CPU's vector width (by default on AMD CPUs from Zen 5
on): `areal_lite.cpu.TrainerTuning`, switched by ``cpu`` (`CPUConfig`).

LoRA (``lora.rank > 0``): peft wraps the model before it is sharded, so each layer's adapters are
sharded with it; only the adapters require gradients, and so only they get optimizer state. Weight
updates send the adapter alone (fp32, under its PEFT tensor names); HF saves write the model with
the adapter merged in (`areal_lite.utils.lora.MergedLoRA`) and the PEFT adapter beside it.

Vision-language models (Qwen-VL) train on packed batches with images
(`areal_lite.engines.train.multimodal`): the vision tower's blocks are sharded like the decoder's
layers, and trained with the rest unless ``freeze_vision_tower``.

Mixture-of-experts models run their HF MoE blocks; their routers are driven by
`areal_lite.utils.moe.RoutingReplay`: with ``routing_replay`` each token goes to the experts the
batch's ``routed_experts`` recorded at generation, and every training pass reports routing
agreement with generation, expert load and the load-balancing loss (``moe/*``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from tensordict import TensorDict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from areal_lite.api.config import TrainEngineConfig
from areal_lite.api.engine import InferenceEngine, LossFn, PackedBatch
from areal_lite.api.io import FinetuneSpec, WeightUpdateMeta
from areal_lite.cpu import TrainerTuning, compute_dtype
from areal_lite.engines.train.base import TrainEngineBase, read_back
from areal_lite.engines.train.fsdp_model import HF_PREFIX, PackedModel, add_lora_adapters, load_hf_model, shard
from areal_lite.engines.train.multimodal import PackedImages, decoder_layers
from areal_lite.engines.train.shared_prefix import shared_prefix_layout
from areal_lite.utils.data import MicroBatchSplit
from areal_lite.utils.lora import PEFT_PREFIX, MergedLoRA, base_name, config_dict
from areal_lite.utils.moe import RoutingReplay, routing_shape
from areal_lite.utils.recover import rng_state, set_rng_state
from areal_lite.utils.vision import is_vision_config

if TYPE_CHECKING:
    from peft import PeftModel

logger = logging.getLogger(__name__)


def _fused_adam_supported(params: list[torch.Tensor]) -> bool:
    return all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


@contextlib.contextmanager
def _rank_failure(doing: str, path: str) -> Iterator[None]:
    """torch.distributed.checkpoint reports a rank's failure as a `CheckpointException`, a
    BaseException (``except Exception`` misses it: a full disk then escaped the checkpoint's own
    error handling) whose text is every rank's traceback: raise the first rank's error instead, so
    that its cause (an errno, a message) reaches the caller."""
    try:
        yield
    except CheckpointException as e:
        rank, (error, _) = min(e.failures.items())
        raise RuntimeError(f"{doing} {path} failed on rank {rank}: {type(error).__name__}: {error}") from error


class FSDPEngine(TrainEngineBase):
    """FSDP2 train engine. See the module docstring; the methods follow `TrainEngine`, the
    backend-independent ones are `TrainEngineBase`'s."""

    def __init__(self, config: TrainEngineConfig) -> None:
        super().__init__(config)
        self.model: PackedModel | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self._persistent_buffers: set[str] | None = None  # HF names of the buffers a state dict holds
        self._peft: PeftModel | None = None
        """With LoRA: peft's wrapper of the HF model (which `model` shards and runs)."""
        self._adapter_names: dict[str, str] = {}
        """With LoRA: each adapter parameter's name in the HF model -> its name in a PEFT file."""
        self._routing: RoutingReplay | None = None
        """A mixture-of-experts model's routers (None for a dense model)."""
        self._cpu = TrainerTuning(config.cpu)
        """The CPU speed measures: fused kernels, oneDNN products, kept memory, the cores' share."""

    # ---------------------------------------------------------------- setup

    def initialize(self, ft_spec: FinetuneSpec | None = None) -> None:
        cfg = self.config
        if cfg.tensor_parallel_size != 1 or cfg.pipeline_parallel_size != 1:
            raise ValueError(
                f"FSDP shards data-parallel only: tensor_parallel_size={cfg.tensor_parallel_size} and "
                f"pipeline_parallel_size={cfg.pipeline_parallel_size} need backend=megatron"
            )
        if cfg.shared_prefix and cfg.attn_impl != "sdpa":
            raise ValueError(
                f"shared_prefix needs attn_impl=sdpa (the engine's varlen attention), not {cfg.attn_impl!r}"
            )
        if torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.compute_dtype = compute_dtype(cfg.dtype, self.device)
        self.create_process_group()
        torch.manual_seed(cfg.seed)
        hf = load_hf_model(cfg.path, cfg, self.device)
        if is_vision_config(hf.config) and (cfg.lora.enabled or cfg.shared_prefix):
            what = "lora" if cfg.lora.enabled else "shared_prefix"
            raise ValueError(f"{what} with a vision-language model ({cfg.path}) is not supported yet")
        if cfg.lora.enabled:
            if cfg.is_critic:
                raise ValueError(
                    "lora is for policies: a critic's new value head needs full training (set lora.rank=0)"
                )
            self._peft, self._adapter_names = add_lora_adapters(hf, cfg.lora)
            hf = self._peft.get_base_model()
        self._cpu.tune_model(hf, self.device)
        if routing_shape(hf.config) is not None:
            self._routing = RoutingReplay(hf)
        elif cfg.routing_replay:
            raise ValueError(f"routing_replay needs a mixture-of-experts model; {cfg.path} is {hf.config.model_type!r}")
        if cfg.gradient_checkpointing:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if ft_spec is None:
            hf.requires_grad_(False)
        self.model = shard(hf, cfg, self.device, self.compute_dtype)
        if ft_spec is not None:
            self._build_optimizer(ft_spec)
            self._cpu.keep_step_memory(self.device)
        self._cpu.startup_done(self.device)

    def _build_optimizer(self, ft_spec: FinetuneSpec) -> None:
        assert self.model is not None
        opt = self.config.optimizer
        decay, no_decay = [], []
        for p in self.model.parameters():
            if p.requires_grad:
                # Norm weights and biases are 1-D; decaying them towards 0 only hurts.
                (decay if p.ndim >= 2 else no_decay).append(p)
        self.optimizer = torch.optim.AdamW(
            # wd_mult (megatron's name) tells `optim_step` which group a weight_decay override skips
            [
                {"params": decay, "weight_decay": opt.weight_decay, "wd_mult": 1.0},
                {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0},
            ],
            lr=opt.lr,
            betas=(opt.beta1, opt.beta2),
            eps=opt.eps,
            # One fused kernel per parameter group instead of a dozen small ops per parameter,
            # each op paying DTensor's dispatch.
            fused=_fused_adam_supported(decay + no_decay),
        )
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor(ft_spec))

    def destroy(self) -> None:
        self._cpu.stop_sharing_cores()
        self.lr_scheduler = None
        super().destroy()
        self._cpu.release()

    def _data_parallel_group(self) -> dist.ProcessGroup | None:
        return None  # every rank holds a shard of the whole model: all are data-parallel

    def _advance_lr_schedule(self) -> None:
        assert self.lr_scheduler is not None
        self.lr_scheduler.step()

    # ---------------------------------------------------------------- compute

    def _microbatches(self, batch: TensorDict) -> tuple[list[PackedBatch], MicroBatchSplit, int]:
        vision = self._module().vision
        if vision is not None:
            batch = vision.with_positions(batch)
        # Every rank must run as many forward/backward passes, for FSDP's collectives.
        return self._split_and_pack(batch, same_count_on_all_ranks=True, to_device=True)

    def _run(self, mb: PackedBatch, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        ids, pos, cu = mb["input_ids"], mb["position_ids"], mb["cu_seqlens"]
        assert isinstance(ids, torch.Tensor) and isinstance(pos, torch.Tensor) and isinstance(cu, torch.Tensor)
        targets = mb.get("target_ids")
        assert targets is None or isinstance(targets, torch.Tensor)
        if targets is not None and self.config.shared_prefix:
            raise ValueError("target_ids with shared_prefix is not supported: the tree scores the input tokens")
        tree = shared_prefix_layout(ids, pos, cu) if self.config.shared_prefix else None
        if self._routing is not None:
            routes = mb.get("routed_experts")
            if routes is not None and tree is not None:
                routes = routes[tree.origin]  # type: ignore[index]
            self._routing.begin(routes, self.config.routing_replay)  # type: ignore[arg-type]
        images = PackedImages.of(mb) if self._module().vision is not None else None
        return self._module()(
            ids, pos, cu, with_entropy, tree, targets, max_seqlen=int(mb["max_seqlen"]), images=images
        )

    def _forward_passes(
        self, mbs: list[PackedBatch], n_real: int, with_entropy: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        outputs = []
        for i, mb in enumerate(mbs):
            out, ent = self._run(mb, with_entropy)
            if i < n_real:
                outputs.append((out.float().cpu(), ent.float().cpu()))
        return outputs

    def _loss_passes(
        self, mbs: list[PackedBatch], n_real: int, weights: list[float], total: float, loss_fn: LossFn, train: bool
    ) -> list[dict[str, float]]:
        model = self._module()
        world = dist.get_world_size()
        results = []
        for i, (mb, w) in enumerate(zip(mbs, weights)):
            if train:
                # Reduce-scatter gradients once, after the last micro-batch, and keep the gathered
                # (cast) parameters until then instead of gathering them again for each one.
                model.set_requires_gradient_sync(i == len(mbs) - 1)
                model.set_reshard_after_backward(i == len(mbs) - 1)
            out, ent = self._run(mb, with_entropy=not self.config.is_critic)
            if i < n_real:
                loss, stats = loss_fn(out, ent, mb)
                # Kept on the device and read back once after the last pass: a read per
                # micro-batch would wait for its backward before the next one is launched.
                results.append({"loss": loss.detach(), **{k: v.detach() for k, v in stats.items()}})
                if self._routing is not None:
                    results[-1].update(self._routing.stats())
            if not train:
                continue
            if w > 0:
                # FSDP averages gradients over ranks; `world` turns that average into the sum.
                (loss * (w / total * world)).backward()
            else:
                # A zero-weight pass still runs backward so that FSDP's collectives match, without
                # touching the loss, which may be NaN here (e.g. a mean over no tokens).
                ((out.sum() + ent.sum()) * 0.0).backward()
        return read_back(results)

    def _clip_gradients(self, max_norm: float) -> float:
        params = [p for p in self._module().parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)

    def _apply_update(self) -> None:
        assert self.optimizer is not None
        self.optimizer.step()

    def _zero_grad(self) -> None:
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)

    # ---------------------------------------------------------------- checkpoints

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full HF-named fp32 tensors on CPU on rank 0 (empty elsewhere), never aliasing the live
        parameters. Collective. Gathers parameter by parameter, sparing every weight update the
        verifying and renaming that torch's ``get_model_state_dict`` does on each call."""
        keep = dist.get_rank() == 0
        full = {}
        for name, t in self._hf_tensors(cast=False):
            if keep:
                full[name] = t.cpu()
        if self._peft is not None:
            adapter = self._adapter_tensors()
            if keep:
                full.update(MergedLoRA(self._module().hf.config, self._adapter_config(), full).merged(adapter))
        return full

    def _save_hf(self, path: str, tokenizer: object | None) -> None:
        sd = self._full_state_dict()
        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
            # save_pretrained empties the dict it is given (transformers 5): hand it a copy.
            self._module().hf.save_pretrained(path, state_dict=dict(sd))
            if tokenizer is not None:
                tokenizer.save_pretrained(path)  # type: ignore[attr-defined]
        if self._peft is not None:
            self._save_adapter(os.path.join(path, "adapter"))

    # ---------------------------------------------------------------- LoRA adapters

    def _lora(self) -> PeftModel:
        if self._peft is None:
            raise ValueError("this engine trains no LoRA adapter (lora.rank is 0)")
        return self._peft

    def _adapter_config(self) -> dict[str, object]:
        """The adapter's PEFT config, as ``adapter_config.json`` holds it."""
        return config_dict(self._lora().peft_config["default"])

    def _adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The adapter's full fp32 tensors on CPU under their PEFT names, on every rank (collective)."""
        model = self._module()
        model.reshard()
        out = {}
        for name, p in model.hf.named_parameters():
            if name in self._adapter_names:
                full = p.full_tensor() if isinstance(p, DTensor) else p
                out[self._adapter_names[name]] = full.detach().to("cpu", copy=True)
        return out

    def _save_adapter(self, path: str) -> None:
        """A PEFT adapter directory from rank 0, written by peft itself (collective)."""
        tensors = self._adapter_tensors()
        if dist.get_rank() == 0:
            # peft's save takes the wrapper's state dict (and renames it as it does its own).
            state = {PEFT_PREFIX + name: tensors[file_name] for name, file_name in self._adapter_names.items()}
            self._lora().save_pretrained(path, state_dict=state)

    def connect_engine(self, engine: InferenceEngine, meta: WeightUpdateMeta) -> None:
        """With LoRA the adapter is sent at once (collective): generation requests name it, so the
        inference side must hold it before any rollout."""
        super().connect_engine(engine, meta)
        self._share_cores(engine)
        if self._peft is not None:
            self.update_weights(meta)

    def _share_cores(self, engine: InferenceEngine) -> None:
        """With ``share_cores_with_engine``, on CPU, when ``engine`` generates in this process:
        yield its share of the threads while it is generating. An engine with a share of its own
        (``local_engine.num_threads``) keeps that share; one without gets half of the threads
        while this engine computes and all of them otherwise, so that whichever of the two
        computes alone has every thread and both at once split them."""
        share = getattr(engine, "thread_share", 0)
        threads = torch.get_num_threads()
        if not self.config.share_cores_with_engine or self.device.type != "cpu" or threads < 2:
            return
        if share == 0 and hasattr(engine, "yield_threads_to"):
            share = threads // 2
            engine.yield_threads_to(lambda: self.computing, share)
        if not 0 < share < threads:
            return
        assert self.model is not None
        layers = decoder_layers(self.model.hf)
        self._cpu.share_cores(lambda: engine.busy, threads, threads - share, layers)  # type: ignore[attr-defined]
        logger.info(
            "training on %d threads while the engine generates on %d, on %d otherwise", threads - share, share, threads
        )

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        """Send the weights, or with LoRA the adapter alone (see `WeightUpdateMeta.lora_config`)."""
        if self._peft is None:
            return super().update_weights(meta)
        meta = replace(meta, lora_config=self._adapter_config())
        self._sender.send(meta, self._version, lambda: iter(self._adapter_tensors().items()), self._save_adapter)
        return None

    def _write_weights(self, path: str) -> None:
        """A disk weight update: ``model.safetensors`` (and ``config.json``, once) in ``path`` from
        rank 0, in the checkpoint layout: less work than ``save_pretrained``, and no progress bar
        per update; servers read only the weight files. Collective."""
        sd = self._full_state_dict()
        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
            sd = dict(self._checkpoint_layout().to_checkpoint(sd.items()))
            save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
            config = os.path.join(path, "config.json")
            if not os.path.exists(config):
                self._module().hf.config.to_json_file(config)

    def _training_state(self) -> dict[str, object]:
        model = self._module()
        model.reshard()
        if self.optimizer is None:
            return {"model": get_model_state_dict(model)}
        model_sd, optim_sd = get_state_dict(model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def _save_train_state(self, path: str) -> None:
        """Model and optimizer (when the engine has one) with torch.distributed.checkpoint, and per
        rank a `torch.save` file of the LR scheduler, step, version and RNG state."""
        os.makedirs(path, exist_ok=True)
        with _rank_failure("writing", path):
            dcp.save(self._training_state(), checkpoint_id=path)
        extra = {
            "version": self._version,
            "global_step": self._global_step,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "rng": rng_state(),
        }
        torch.save(extra, os.path.join(path, f"extra_state_rank{dist.get_rank()}.pt"))

    def _load_hf_weights(self, path: str) -> None:
        if self._peft is not None:
            raise ValueError("a LoRA engine keeps its base weights: resume it from a train_state checkpoint")
        model = self._module()
        # Loading through HF resolves tied weights, sharded index files and dtype conversion.
        full = load_hf_model(path, self.config, self.device).state_dict()
        model.reshard()
        set_model_state_dict(
            model, {HF_PREFIX + k: v for k, v in full.items()}, options=StateDictOptions(full_state_dict=True)
        )

    def _load_train_state(self, path: str) -> None:
        extra_file = self._train_state_file(path, f"extra_state_rank{dist.get_rank()}.pt")
        model = self._module()
        state = self._training_state()
        with _rank_failure("reading", path):
            dcp.load(state, checkpoint_id=path)
        if self.optimizer is None:
            set_model_state_dict(model, state["model"])  # type: ignore[arg-type]
        else:
            set_state_dict(model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])  # type: ignore[arg-type]
        extra = torch.load(extra_file, weights_only=False)
        self._version = extra["version"]
        self._global_step = extra["global_step"]
        if self.lr_scheduler is not None and extra["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        set_rng_state(extra["rng"])

    # ---------------------------------------------------------------- weight updates

    def _hf_model_config(self) -> object:
        return self._module().hf.config

    def _hf_tensors(self, cast: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors with HF names, one at a time, cast to the compute dtype (``cast=False``:
        the parameters' own, fp32), as copies that later optimizer steps cannot change. With
        LoRA: the base model's (the adapter not merged in).
        Collective: every rank iterates to the end (non-zero ranks only take part in the gathers)."""
        model = self._module()
        model.reshard()
        hf = model.hf
        if self._persistent_buffers is None:
            self._persistent_buffers = set(hf.state_dict().keys())
        persistent = self._persistent_buffers
        named = list(hf.named_parameters()) + [(n, b) for n, b in hf.named_buffers() if n in persistent]
        for name, t in named:
            if name in self._adapter_names:
                continue
            full = t.full_tensor() if isinstance(t, DTensor) else t
            yield (
                base_name(name),
                full.detach().to(self.compute_dtype if cast else full.dtype, copy=True),
            )


__all__ = ["FSDPEngine"]
