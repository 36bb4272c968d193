"""Training runs of the service (a Tinker "training client" each) over the train engines, and the
base models they share.

A LoRA run is a named adapter in its base model's `MultiLoRAEngine`: every LoRA run of one base
model trains over the same base weights, each with its own gradients and AdamW. A full
fine-tuning run (``lora_config`` absent) owns an `FSDPEngine`, a copy of the model of its own.
Either way a ``forward_backward`` is one forward and one backward pass
(`TrainEngine.forward_backward_logprobs`), its loss one of `areal_lite.service.losses`.

Checkpoints are directories under the service's workdir, addressed as Tinker paths:
``tinker://<run>/weights/<name>`` (the training state: a LoRA run's PEFT adapter, AdamW state and
step count; a full run's `train_state`) and ``tinker://<run>/sampler_weights/<name>`` (what a
sampler loads: the PEFT adapter, or a HF model directory). Each run's ``run.json`` says what it is,
so a checkpoint can seed a new run, also in a later process.

Every method here runs on the service's engine thread.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Literal

import torch

from areal_lite.api.config import LoRAConfig, OptimizerConfig, TrainEngineConfig
from areal_lite.api.io import FinetuneSpec, MicroBatchSpec, SaveLoadMeta
from areal_lite.cpu import compute_dtype
from areal_lite.engines.train.fsdp import FSDPEngine
from areal_lite.engines.train.multi_lora import MultiLoRAEngine
from areal_lite.service import losses
from areal_lite.service.config import ServiceConfig
from areal_lite.service.sampler import Generator
from areal_lite.service.wire import BadRequest, Datum, ForwardBackwardCall, ForwardBackwardResult, Span

SCHEME = "tinker://"
KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
TARGETS = {
    "train_attn": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "train_mlp": ["gate_proj", "up_proj", "down_proj"],
    "train_unembed": ["lm_head"],
}


def dtype_of(cfg: ServiceConfig) -> torch.dtype:
    return compute_dtype(cfg.dtype, torch.device("cuda" if torch.cuda.is_available() else "cpu"))


class BaseModel:
    """A served base model: its directory, and (built when first needed) the `MultiLoRAEngine`
    its LoRA runs share and the `Generator` its samplers share."""

    def __init__(self, name: str, path: str, cfg: ServiceConfig) -> None:
        from transformers import AutoConfig

        self.name, self.path, self.cfg = name, path, cfg
        hf = AutoConfig.from_pretrained(path)
        self.vocab_size = int(hf.vocab_size)
        self.max_len = int(hf.max_position_embeddings)
        self.arch = str((hf.architectures or [hf.model_type])[0])

    @cached_property
    def train_engine(self) -> MultiLoRAEngine:
        engine = MultiLoRAEngine(engine_config(self.path, self.cfg))
        engine.initialize()
        return engine

    @cached_property
    def tokenizer(self) -> object:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)

    @cached_property
    def generator(self) -> Generator:
        return Generator(self.path, dtype_of(self.cfg), self.cfg.max_sampler_adapters, self.cfg.seed)


def engine_config(path: str, cfg: ServiceConfig) -> TrainEngineConfig:
    # Tinker sends every Adam hyperparameter with each optim_step; these only fill the optimizer.
    return TrainEngineConfig(
        path=path,
        dtype=cfg.dtype,
        seed=cfg.seed,
        mb_spec=MicroBatchSpec(max_tokens_per_mb=cfg.max_tokens_per_mb),
        optimizer=OptimizerConfig(lr=1e-4, beta2=0.95, eps=1e-12, gradient_clipping=0.0),
    )


@dataclass
class RunInfo:
    """What a run is (``run.json``)."""

    model_id: str
    base_model: str
    lora: dict[str, object] | None
    """``rank``, ``seed``, ``train_mlp``, ``train_attn``, ``train_unembed``, ``alpha``; None for
    full fine-tuning."""
    user_metadata: dict[str, object] = field(default_factory=dict)
    created: float = field(default_factory=time.time)

    def lora_config(self) -> LoRAConfig | None:
        if self.lora is None:
            return None
        targets = [m for flag, mods in TARGETS.items() if self.lora.get(flag, True) for m in mods]
        if not targets:
            raise BadRequest("lora_config: at least one of train_mlp, train_attn, train_unembed must be true")
        return LoRAConfig(rank=int(self.lora["rank"]), alpha=float(self.lora["alpha"]), target_modules=targets)  # type: ignore[call-overload, arg-type]


def parse_path(path: str) -> tuple[str, str, str]:
    """``(run id, kind, name)`` of ``tinker://<run>/<kind>/<name>``; BadRequest otherwise."""
    parts = path.removeprefix(SCHEME).split("/") if path.startswith(SCHEME) else []
    if len(parts) != 3 or parts[1] not in KINDS or not parts[0] or not parts[2]:
        raise BadRequest(f"not a checkpoint path: {path!r} (expected tinker://<run>/weights|sampler_weights/<name>)")
    return parts[0], parts[1], parts[2]


class Storage:
    """Where runs and checkpoints live on disk."""

    def __init__(self, workdir: str) -> None:
        self.root = os.path.abspath(workdir)

    def run_dir(self, model_id: str) -> str:
        return os.path.join(self.root, "runs", model_id)

    def checkpoint(self, model_id: str, kind: str, name: str) -> tuple[str, str]:
        """(tinker path, directory) of checkpoint ``name`` of ``kind``."""
        if not name or "/" in name or name in (".", ".."):
            raise BadRequest(f"a checkpoint name cannot be empty or contain '/', got {name!r}")
        return f"{SCHEME}{model_id}/{kind}/{name}", os.path.join(self.run_dir(model_id), kind, name)

    def resolve(self, path: str) -> tuple[RunInfo, str, str]:
        """(the run, kind, directory) of an existing checkpoint's Tinker path."""
        model_id, kind, name = parse_path(path)
        directory = os.path.join(self.run_dir(model_id), kind, name)
        if not os.path.isdir(directory):
            raise BadRequest(f"no checkpoint at {path}")
        return self.read_info(model_id), kind, directory

    def write_info(self, info: RunInfo) -> None:
        os.makedirs(self.run_dir(info.model_id), exist_ok=True)
        with open(os.path.join(self.run_dir(info.model_id), "run.json"), "w") as f:
            json.dump(asdict(info), f, indent=2)

    def read_info(self, model_id: str) -> RunInfo:
        try:
            with open(os.path.join(self.run_dir(model_id), "run.json")) as f:
                return RunInfo(**json.load(f))
        except FileNotFoundError:
            raise BadRequest(f"no training run {model_id!r} in {self.root}") from None

    def run_ids(self) -> list[str]:
        """Every run with metadata here, newest first."""
        base = os.path.join(self.root, "runs")
        infos = [os.path.join(base, m, "run.json") for m in os.listdir(base)] if os.path.isdir(base) else []
        return [
            os.path.basename(os.path.dirname(f))
            for f in sorted(filter(os.path.isfile, infos), key=os.path.getmtime, reverse=True)
        ]

    def checkpoints(self, model_id: str) -> list[tuple[str, str, float]]:
        """(tinker path, kind, modification time) of every checkpoint of a run."""
        out = []
        for kind in KINDS:
            base = os.path.join(self.run_dir(model_id), kind)
            for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
                out.append((f"{SCHEME}{model_id}/{kind}/{name}", kind, os.path.getmtime(os.path.join(base, name))))
        return out


@dataclass
class Snapshot:
    """Weights a sampler serves: a LoRA adapter over ``base`` (its config and tensors), or a full
    model directory, or the base itself."""

    base: str
    kind: Literal["base", "lora", "full"]
    adapter_config: dict[str, object] | None = None
    tensors: dict[str, torch.Tensor] | None = None
    directory: str | None = None


class Run:
    """A training run (a Tinker training client's model)."""

    def __init__(self, info: RunInfo, base: BaseModel, storage: Storage) -> None:
        self.info, self.base, self.storage = info, base, storage
        self.lora = info.lora_config()
        self.adapter = "run" + "".join(c if c.isalnum() else "_" for c in info.model_id)
        self.engine: FSDPEngine
        if self.lora is None:
            self.engine = FSDPEngine(engine_config(base.path, base.cfg))
            self.engine.initialize(FinetuneSpec(total_train_epochs=1, dataset_size=1, train_batch_size=1))
        else:
            self.engine = base.train_engine
            seed = info.lora.get("seed") if info.lora else None
            self.engine.add_adapter(self.adapter, self.lora, None if seed is None else int(seed))  # type: ignore[call-overload]
        storage.write_info(info)

    @property
    def is_lora(self) -> bool:
        return self.lora is not None

    def _select(self) -> FSDPEngine:
        if isinstance(self.engine, MultiLoRAEngine):
            self.engine.use(self.adapter)
        return self.engine

    def close(self) -> None:
        """Release what this run holds (its adapter, or its engine)."""
        if isinstance(self.engine, MultiLoRAEngine):
            self.engine.remove_adapter(self.adapter)
        else:
            self.engine.destroy()

    # ---------------------------------------------------------------- training

    def forward_backward(self, call: ForwardBackwardCall, recorded: dict[str, Recorded]) -> ForwardBackwardResult:
        loss, config = losses.resolve(call.loss_fn, call.loss_fn_config)
        data = call.data()
        if loss.name == "stable_reinforce":
            for datum in data:
                sampler_logprobs(datum, recorded)
        losses.check_data(data, loss, self.base.vocab_size, self.base.max_len)
        losses.fill_defaults(data, loss, config)
        batch = losses.tinker_batch(data)
        engine = self._select()
        if call.forward_only:
            logprobs = engine.forward(batch)
            assert isinstance(logprobs, torch.Tensor)
            total = losses.loss_sum(loss, config, batch, logprobs)
        else:
            loss_fn, weight_fn = losses.engine_loss(loss, config, batch)
            stats, logprobs = engine.forward_backward_logprobs(batch, loss_fn, weight_fn)
            total = stats["loss"]
        outputs = [{"logprobs": lp} for lp in losses.datum_logprobs(data, logprobs)]
        return ForwardBackwardResult(outputs, {"loss:sum": total})

    def optim_step(self, params: dict[str, object]) -> dict[str, float]:
        """One AdamW step with Tinker's ``AdamParams`` (every field applies to this step)."""
        kind = params.get("type", "adam")
        if kind not in ("adam", "adamw", None):
            raise BadRequest(f"optimizer {kind!r} is not supported: this service steps AdamW (AdamParams)")
        try:
            lr = float(params.get("learning_rate", 1e-4))  # type: ignore[arg-type]
            betas = (float(params.get("beta1", 0.9)), float(params.get("beta2", 0.95)))  # type: ignore[arg-type]
            eps = float(params.get("eps", 1e-12))  # type: ignore[arg-type]
            wd = float(params.get("weight_decay", 0.0))  # type: ignore[arg-type]
            clip = float(params.get("grad_clip_norm", 0.0))  # type: ignore[arg-type]
        except (TypeError, ValueError) as e:
            raise BadRequest(f"AdamParams: {e}") from e
        if lr < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1) or eps <= 0 or wd < 0:
            raise BadRequest("AdamParams: learning_rate, weight_decay >= 0, betas in [0, 1), eps > 0")
        stats = self._select().optim_step(lr, wd, clip, betas=betas, eps=eps)
        return {"grad_norm": stats["grad_norm"], "learning_rate": lr, "update_successful": stats["update_successful"]}

    # ---------------------------------------------------------------- checkpoints

    def save_state(self, directory: str) -> None:
        engine = self._select()
        if isinstance(engine, MultiLoRAEngine):
            engine.save_adapter(self.adapter, directory, with_optimizer=True)
        else:
            engine.save(SaveLoadMeta(path=directory, weight_format="train_state"))

    def load_state(self, source: RunInfo, directory: str, with_optimizer: bool) -> None:
        if (source.lora is None) != (self.info.lora is None) or source.base_model != self.info.base_model:
            raise BadRequest(
                f"checkpoint of run {source.model_id} ({source.base_model}, lora={source.lora is not None}) "
                f"does not fit run {self.info.model_id} ({self.info.base_model}, lora={self.info.lora is not None})"
            )
        engine = self._select()
        if isinstance(engine, MultiLoRAEngine):
            engine.load_adapter(self.adapter, directory, with_optimizer)
            return
        engine.load(SaveLoadMeta(path=directory, weight_format="train_state"))
        if not with_optimizer:
            assert engine.optimizer is not None
            engine.optimizer.state.clear()  # type: ignore[attr-defined]

    def snapshot(self, directory: str | None) -> Snapshot:
        """The current weights as a sampler snapshot: written to ``directory`` when given (a named
        ``sampler_weights`` checkpoint), else kept in memory (LoRA) or in a scratch directory."""
        engine = self._select()
        if isinstance(engine, MultiLoRAEngine):
            if directory is not None:
                engine.save_adapter(self.adapter, directory, with_optimizer=False)
            return Snapshot(
                self.base.name,
                "lora",
                engine.adapter_config(self.adapter),
                engine.adapter_tensors(self.adapter),
                directory,
            )
        if directory is None:
            directory = os.path.join(self.storage.root, "scratch", f"{self.adapter}-{time.monotonic_ns()}")
        engine.save(SaveLoadMeta(path=directory, weight_format="hf", tokenizer=self.base.tokenizer))
        return Snapshot(self.base.name, "full", directory=directory)

    def save_external(self, directory: str) -> None:
        """Weights other tools load: the PEFT adapter directory (LoRA) or a HF model directory."""
        engine = self._select()
        if isinstance(engine, MultiLoRAEngine):
            engine.save_adapter(self.adapter, directory, with_optimizer=False)
        else:
            engine.save(SaveLoadMeta(path=directory, weight_format="hf", tokenizer=self.base.tokenizer))


def snapshot_from_checkpoint(info: RunInfo, kind: str, directory: str) -> Snapshot:
    """The snapshot a saved checkpoint holds, for a sampler."""
    if info.lora is not None:
        with open(os.path.join(directory, "adapter_config.json")) as f:
            config = json.load(f)
        return Snapshot(info.base_model, "lora", config, None, directory)
    if kind != "sampler_weights":
        raise BadRequest("sample a full fine-tuning run from its sampler_weights (save_weights_for_sampler)")
    return Snapshot(info.base_model, "full", directory=directory)


def remove_scratch(snapshot: Snapshot, storage: Storage) -> None:
    """Delete a snapshot's scratch directory, if it has one."""
    scratch = os.path.join(storage.root, "scratch")
    if snapshot.directory and os.path.dirname(snapshot.directory) == scratch:
        shutil.rmtree(snapshot.directory, ignore_errors=True)


# -------------------------------------------------------------------------------------- stable_reinforce


@dataclass
class Recorded:
    """What sampling recorded of one sampled sequence (``record_stability_info``)."""

    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    time: float = field(default_factory=time.time)


def sampler_logprobs(datum: Datum, recorded: dict[str, Recorded]) -> None:
    """Put the recorded sampling log-probabilities of ``datum``'s sampled tokens in its
    ``logprobs`` input, by its provenance; BadRequest when it has none, or names a sequence that
    was not recorded, or tokens that are not the recorded ones."""
    if not datum.target_spans:
        raise BadRequest(
            "stable_reinforce needs provenance on every datum: sample with record_stability_info=True and "
            "attach the sequence ids with Datum.with_provenance"
        )
    targets = datum.inputs.get(losses.TARGETS)
    if targets is None:
        return  # check_data reports it
    logprobs = datum.inputs.get("logprobs")
    logprobs = logprobs.copy() if logprobs is not None else targets.astype("float32") * 0
    position = 0
    for span in datum.target_spans:
        if span.kind == "sampled":
            _fill(span, recorded, targets, logprobs, position)
        position += span.length
    if position != len(targets):
        raise BadRequest(f"provenance covers {position} target positions, target_tokens has {len(targets)}")
    datum.inputs["logprobs"] = logprobs


def _fill(span: Span, recorded: dict[str, Recorded], targets: object, logprobs: object, position: int) -> None:
    rec = recorded.get(span.sequence_id)
    if rec is None:
        raise BadRequest(
            f"sequence {span.sequence_id!r} has no recorded stability information (sample with record_stability_info=True, in this session)"
        )
    end = span.offset + span.length
    if end > len(rec.tokens):
        raise BadRequest(
            f"provenance asks for sampled tokens [{span.offset}, {end}) of a {len(rec.tokens)}-token sequence"
        )
    window = slice(position, position + span.length)
    if list(targets[window]) != rec.tokens[span.offset : end]:  # type: ignore[index]
        raise BadRequest(
            f"target_tokens at {position}..{position + span.length} are not sequence {span.sequence_id!r}'s"
        )
    logprobs[window] = rec.logprobs[span.offset : end]  # type: ignore[index]
    rec.time = time.time()
