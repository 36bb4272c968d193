"""The models of the recipe API, spawned by `ModelBuilder` from a HF model directory:

- `InferenceModel`: frozen weights; ``generate`` / ``generate_tokens`` and ``logprobs_per_token``
  (a reference policy, a judge);
- `TrainingModel`: a policy being trained; everything an `InferenceModel` does, plus ``train_*``
  (gradient contributions) and ``optim_step``, ``clone_inf`` and ``save``;
- `ValueModel`: a value head being trained (``values_per_token``, ``train_value``), for PPO.

Each owns a train engine (FSDP or Megatron by ``ModelConfig.backend``; frozen for an
`InferenceModel`), which scores tokens (``logprobs_per_token`` runs the engine's forward pass, so
training and scoring agree exactly), and, from its first ``generate``, an inference engine: the
embedded engine in this process, or a client of SGLang-protocol servers (``ModelConfig.servers``).

Generation always uses the current weights: ``optim_step`` only marks them changed, and the next
generation first pushes them to the inference engine through the train engine's
``update_weights`` (in process for the embedded engine; disk or broadcast for servers). A model
that steps several times between generations syncs once.

Engine work runs on this process's engine thread (`areal_lite.recipes.lockstep`), never on the
event loop: concurrent ``logprobs_per_token`` calls become one batched forward pass, and under
torchrun every rank runs the same collectives in the same order. ``train_*`` calls only check their
arguments and queue the sample; ``optim_step`` trains on everything queued since the last step
(`areal_lite.recipes.losses`). Under several ranks every rank runs the recipe on its own share of
the data; ``optim_step``, ``save``, ``clone_inf`` and ``close`` are collective (every rank calls
them, in the same order), the other methods are not.
"""

from __future__ import annotations

import asyncio
import numbers
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar, TypeVar

import torch.distributed as dist

from areal_lite.api.config import (
    InferenceEngineConfig,
    LocalEngineConfig,
    OptimizerConfig,
    TrainEngineConfig,
    one_of,
)
from areal_lite.api.engine import InferenceEngine, TrainEngine
from areal_lite.api.io import (
    FinetuneSpec,
    GenerationConfig,
    MicroBatchSpec,
    ModelRequest,
    SaveLoadMeta,
    WeightUpdateMeta,
)
from areal_lite.kit import make_train_engine
from areal_lite.recipes.lockstep import EngineThread, PackHandler, close_engine_thread, engine_thread
from areal_lite.recipes.losses import (
    DPOLoss,
    Loss,
    PolicyLoss,
    SFTLoss,
    TangentLoss,
    TrainRow,
    ValueLoss,
    placeholder_row,
    rows_to_batch,
)
from areal_lite.recipes.thread import StringThread, ThreadTokenizer, TokenizedThread
from areal_lite.utils.datasets import padded_batch
from areal_lite.utils.distributed import destroy_default_group, init_default_group

T = TypeVar("T")


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
    weight_update: str = field(default="disk", metadata=one_of("disk", "distributed"))
    """How weights reach servers (the embedded engine takes them in process)."""
    max_running_requests: int = 128
    """Embedded engine: requests decoded together."""
    inference_device: str = "cpu"
    """Embedded engine: cpu or cuda."""
    work_dir: str = ""
    """Where clones (``clone_inf``) and disk weight updates are written (a directory every rank
    can read); empty = a temporary directory, removed by `shutdown`."""
    logits_chunk_size: int = 1024
    """Tokens whose full-vocabulary logits are materialised at once when scoring."""
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
            seed=self.seed,
        )


class _Process:
    """What the models of this process share: the engine thread and the work directory."""

    created_group: ClassVar[bool] = False
    work_dir: ClassVar[str | None] = None
    owns_work_dir: ClassVar[bool] = False
    names: ClassVar[set[str]] = set()


async def _join_process_group() -> EngineThread:
    """Join (or create) the default process group and start the engine thread (collective)."""

    def join() -> EngineThread:
        if not dist.is_initialized():
            _Process.created_group = init_default_group()
        return engine_thread()

    return await asyncio.to_thread(join)


def _gather(thread: EngineThread, value: T) -> list[T]:
    """``value`` of every rank (on the engine thread, inside a call every rank makes)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    out: list[T] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(out, value)
    return out


def _work_dir(config: ModelConfig, thread: EngineThread) -> str:
    """The work directory, the same on every rank (on the engine thread, inside a call)."""
    if _Process.work_dir is None:
        if config.work_dir:
            path = config.work_dir
            os.makedirs(path, exist_ok=True)
        else:
            mine = tempfile.mkdtemp(prefix="areal_lite_recipes_") if dist.get_rank() == 0 else ""
            path = _gather(thread, mine)[0]
            _Process.owns_work_dir = True
        _Process.work_dir = path
    return _Process.work_dir


def per_token(name: str, values: float | Sequence[float], thread: TokenizedThread) -> list[float]:
    """``values`` as one float per trained token of ``thread`` (a single float is repeated)."""
    if isinstance(values, numbers.Real):
        return [float(values)] * thread.n_trained
    out = [float(v) for v in values]
    if len(out) != thread.n_trained:
        raise ValueError(
            f"{name} has {len(out)} values but the thread has {thread.n_trained} trained tokens "
            "(one value per token of weight > 0)"
        )
    return out


def train_row(thread: TokenizedThread, **values: list[float]) -> TrainRow:
    """The row of a thread: its tokens, its trained tokens, and per-trained-token ``values``
    placed at those tokens (0 elsewhere)."""
    trained = [i for i, w in enumerate(thread.weights) if w > 0]
    row = TrainRow(thread.tokens, [0] * len(thread), {})
    for i in trained:
        row.loss_mask[i] = 1
    for key, vals in values.items():
        full = [0.0] * len(thread)
        for i, v in zip(trained, vals):
            full[i] = v
        row.values[key] = full
    return row


class InferenceModel:
    """A model with frozen weights: tokenization, generation and per-token log-probabilities.
    Build one with `ModelBuilder.spawn_inference` or `TrainingModel.clone_inf`."""

    is_critic = False

    def __init__(self, name: str, path: str, config: ModelConfig, engine: TrainEngine, tokenizer: object) -> None:
        self.name = name
        self.path = path
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.threads = ThreadTokenizer(tokenizer, config.use_chat_template, config.max_seq_len)
        self._thread = engine_thread()
        self._packed_keys: list[str] = []
        self._register("forward", self._forward_handler)
        self._generator: InferenceEngine | None = None
        self._generator_lock = threading.Lock()
        self._closed = False

    @classmethod
    async def _spawn(cls, name: str, path: str, config: ModelConfig, trainable: bool) -> InferenceModel:
        from transformers import AutoTokenizer

        if name in _Process.names:
            raise ValueError(f"a model named {name!r} exists already in this process")
        await _join_process_group()
        engine = make_train_engine(config.engine_config(path, is_critic=cls.is_critic))
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, path)
        model = cls(name, path, config, engine, tokenizer)
        ft_spec = FinetuneSpec(total_train_epochs=1, dataset_size=1, train_batch_size=1) if trainable else None
        try:
            await model._call("spawn", lambda: engine.initialize(ft_spec))
        except BaseException:
            for key in model._packed_keys:
                model._thread.unregister(key)
            raise
        _Process.names.add(name)
        return model

    def _register(self, what: str, handler: PackHandler) -> None:
        key = f"{self.name}/{what}"
        self._thread.register(key, handler)
        self._packed_keys.append(key)

    async def _call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` on the engine thread, once every rank has asked for ``what`` of this model."""
        if self._closed:
            raise RuntimeError(f"model {self.name!r} is closed")
        return await asyncio.wrap_future(self._thread.call(f"{self.name}/{what}", fn))

    async def _packed(self, what: str, item: object) -> object:
        if self._closed:
            raise RuntimeError(f"model {self.name!r} is closed")
        return await asyncio.wrap_future(self._thread.pack(f"{self.name}/{what}", item))

    # ---------------------------------------------------------------- threads and tokens

    async def tokenize_thread(self, thread: StringThread) -> TokenizedThread:
        """``thread`` as token ids with per-token weights (`areal_lite.recipes.thread`)."""
        return await asyncio.to_thread(self.threads.tokenize, thread)

    async def detokenize_thread(self, thread: TokenizedThread) -> StringThread:
        return self.threads.detokenize(thread)

    async def logprobs_per_token(self, thread: TokenizedThread) -> list[float]:
        """Log-probability of each trained token of ``thread`` under this model's weights (one per
        token of weight > 0, in order), from the train engine's forward pass."""
        return await self._score(thread)

    async def _score(self, thread: TokenizedThread) -> list[float]:
        if thread.n_trained == 0:
            raise ValueError("the thread has no trained token (no assistant turn): there is nothing to score")
        self.threads.check(thread)
        return await self._packed("forward", thread)  # type: ignore[return-value]

    def _forward_handler(self, items: list[object]) -> list[object]:
        threads: list[TokenizedThread] = items  # type: ignore[assignment]
        # Sorted by tokens: the batch does not depend on the order the requests arrived in, and
        # samples of one prompt sit together (a shared prefix).
        order = sorted(range(len(threads)), key=lambda i: threads[i].tokens)
        rows = [(threads[i].tokens, [1 if w > 0 else 0 for w in threads[i].weights]) for i in order]
        batch = padded_batch(rows or [([0, 0], [0, 0])])
        out = self.engine.forward(batch)
        mask = batch["loss_mask"].bool()
        results: list[object] = [None] * len(threads)
        for j, i in enumerate(order):
            results[i] = out[j][mask[j]].tolist()  # type: ignore[index]
        return results

    # ---------------------------------------------------------------- generation

    async def generate(self, thread: StringThread, gconfig: GenerationConfig | None = None) -> StringThread:
        """``thread`` with a sampled assistant turn appended."""
        tokens = await self.generate_tokens(await self.tokenize_thread(thread), gconfig)
        return await self.detokenize_thread(tokens)

    async def generate_tokens(self, thread: TokenizedThread, gconfig: GenerationConfig | None = None) -> TokenizedThread:
        """``thread`` with a sampled assistant turn appended (weight 1 on every sampled token);
        the result's ``logprobs`` are the sampling log-probabilities of those tokens."""
        g = gconfig or self.config.gconfig
        prompt = self.threads.prompt_ids(thread)
        room = self.config.max_seq_len - len(prompt)
        if room <= 0:
            raise ValueError(f"a prompt of {len(prompt)} tokens leaves no room under max_seq_len={self.config.max_seq_len}")
        g = g.new(
            max_new_tokens=min(g.max_new_tokens, room),
            stop_token_ids=sorted({*g.stop_token_ids, self.threads.eos_id}),
        )
        engine = await self._generation_engine()
        await self._before_generation()
        response = await engine.agenerate(ModelRequest(input_ids=prompt, gconfig=g))
        return thread.with_turn(self.threads.completion_turn(response.output_tokens), response.output_logprobs)

    async def _before_generation(self) -> None:
        """A frozen model's inference engine always holds its weights."""

    async def _generation_engine(self) -> InferenceEngine:
        """The inference engine, started on first use."""
        if self._generator is not None:
            return self._generator
        return await asyncio.to_thread(self._ensure_generator)

    def _ensure_generator(self) -> InferenceEngine:
        """Start the inference engine unless it runs already (from any thread, once)."""
        with self._generator_lock:
            if self._generator is None:
                self._generator = self._start_generator()
                self._generator_started()
            return self._generator

    def _generator_started(self) -> None:
        """Hook: the inference engine has just started (from the model directory)."""

    def _start_generator(self) -> InferenceEngine:
        cfg = self.config
        if cfg.servers:
            from areal_lite.engines.remote import RemoteSGLangEngine

            rollout = InferenceEngineConfig(addresses=list(cfg.servers))
            engine: InferenceEngine = RemoteSGLangEngine(rollout, control_servers=dist.get_rank() == 0)
        else:
            from areal_lite.engines.local import LocalInferenceEngine

            local = LocalEngineConfig(
                path=self.path,
                device=cfg.inference_device,
                max_running_requests=cfg.max_running_requests,
                max_total_tokens=cfg.max_seq_len,
                seed=cfg.seed + dist.get_rank(),
            )
            engine = LocalInferenceEngine(local)
        engine.initialize()
        return engine

    # ---------------------------------------------------------------- lifetime

    async def close(self) -> None:
        """Release the engines (collective)."""
        if self._closed:
            return
        await self._call("close", self.engine.destroy)
        if self._generator is not None:
            await asyncio.to_thread(self._generator.destroy)
        self._closed = True
        for key in self._packed_keys:
            self._thread.unregister(key)
        _Process.names.discard(self.name)


class _Trainable(InferenceModel):
    """The training half shared by `TrainingModel` and `ValueModel`: the calls queued since the
    last step, ``optim_step``, ``save`` and the training state for recovery."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._queued: list[tuple[Loss, list[TrainRow]]] = []
        self.version = 0
        """Optimizer steps taken: the policy version its generations are tagged with."""

    def _trainable(self, sample: TokenizedThread, what: str) -> TokenizedThread:
        if not isinstance(sample, TokenizedThread):
            raise TypeError(f"{what} takes a TokenizedThread (tokenize_thread gives one), got {type(sample).__name__}")
        if sample.n_trained == 0:
            raise ValueError(f"{what}: the thread has no assistant turn (no token of weight > 0): nothing to train on")
        self.threads.check(sample)
        return sample

    def _queue(self, loss: Loss, *rows: TrainRow) -> None:
        if self._closed:
            raise RuntimeError(f"model {self.name!r} is closed")
        self._queued.append((loss, list(rows)))

    async def optim_step(
        self, lr: float | None = None, wd: float | None = None, max_grad_norm: float | None = None
    ) -> dict[str, float]:
        """Train on every ``train_*`` call made since the last step, then clip, step AdamW and
        zero the gradients. None takes the configured value (`ModelConfig.optimizer`). Returns
        the losses' statistics (prefixed by the loss's name when several kinds were trained),
        ``grad_norm``, ``lr``, ``update_successful``, ``n_samples`` and ``n_tokens`` (all ranks).
        Collective."""
        queued, self._queued = self._queued, []
        stats = await self._call("optim_step", lambda: self._step(queued, lr, wd, max_grad_norm))
        self.version += 1
        self._weights_changed()
        return stats

    def _step(
        self, queued: list[tuple[Loss, list[TrainRow]]], lr: float | None, wd: float | None, clip: float | None
    ) -> dict[str, float]:
        losses = sorted({loss for loss, _ in queued}, key=repr)
        everyone = sorted({loss for mine in _gather(self._thread, losses) for loss in mine}, key=repr)
        if not everyone:
            raise RuntimeError(
                f"optim_step on {self.name!r} with no gradient accumulated: call a train_* method first"
            )
        stats: dict[str, float] = {}
        n_samples = n_tokens = 0
        for loss in everyone:
            # Sorted by tokens, as in scoring: the same batch whatever order the calls came in.
            calls = sorted((rs for q, rs in queued if q == loss), key=lambda rs: [r.input_ids for r in rs])
            rows = [row for rs in calls for row in rs]
            n_samples += len(rows) // loss.rows_per_call
            n_tokens += sum(sum(r.loss_mask) for r in rows)
            batch = rows_to_batch(rows or [placeholder_row(loss.keys)] * loss.rows_per_call)
            part = loss.accumulate(self.engine, batch)
            prefix = f"{loss.name}/" if len(everyone) > 1 else ""
            stats.update({prefix + k: v for k, v in part.items()})
        stats.update(self.engine.optim_step(lr, wd, clip))
        totals = _gather(self._thread, (n_samples, n_tokens))
        stats["n_samples"] = float(sum(s for s, _ in totals))
        stats["n_tokens"] = float(sum(t for _, t in totals))
        self.engine.set_version(self.version + 1)
        return stats

    def _weights_changed(self) -> None:
        """Hook: the weights changed (a step or a load)."""

    async def save(self, path: str) -> str:
        """Write the current weights as a HF model directory (with the tokenizer). Collective."""
        meta = SaveLoadMeta(path=path, weight_format="hf", tokenizer=self.tokenizer)
        await self._call("save", lambda: self.engine.save(meta))
        return path

    async def with_engine(self, what: str, fn: Callable[[TrainEngine], T], changes_weights: bool = False) -> T:
        """``fn(engine)`` on the engine thread, in step with the other ranks (every rank calls it
        with the same ``what``): checkpoints and other collective work on the train engine. Say
        ``changes_weights`` when ``fn`` loads weights (the next generation then syncs)."""
        out = await self._call(what, lambda: fn(self.engine))
        if changes_weights:
            self.version = self.engine.get_version()
            self._weights_changed()
        return out


class TrainingModel(_Trainable):
    """A policy being trained. Build one with `ModelBuilder.spawn_train`.

    The ``train_*`` methods add one sample's share of a gradient; ``optim_step`` applies it. Their
    per-token arguments (``logprobs``, ``advantages``, ``tangents``...) have one value per trained
    token of the sample (``sample.n_trained``: its tokens of weight > 0); ``advantages`` may also be
    one float for the whole sample.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._register("sync", self._sync_handler)
        self._weights = 0
        """Counts the changes of the train engine's weights (steps, loads)."""
        self._generator_weights: int | None = None
        """Which of them the inference engine holds (None: it has not started)."""
        self._sync: tuple[int, asyncio.Future] | None = None
        self._connected = False
        self._clones = 0

    # ---------------------------------------------------------------- generation sees the current weights

    def _weights_changed(self) -> None:
        self._weights += 1

    async def _before_generation(self) -> None:
        if self._generator_weights == self._weights:
            return
        if self._sync is None or self._sync[0] != self._weights:
            self._sync = (self._weights, asyncio.ensure_future(self._packed("sync", None)))
        weights, pending = self._sync
        await pending
        self._generator_weights = weights

    def _generator_started(self) -> None:
        self._generator_weights = 0  # the directory's weights (servers are started on them too)

    def _sync_handler(self, items: list[object]) -> list[object]:
        """Push the train engine's weights to the inference engine. Every rank takes part, and a
        rank whose inference engine has not started starts it here (another rank's generation
        needs the sync, and trainer rank 0 is the one that sends)."""
        generator = self._ensure_generator()
        meta = self._weight_meta()
        if not self._connected:
            self.engine.connect_engine(generator, meta)
            self._connected = True
        self.engine.update_weights(meta)
        self._generator_weights = self._weights
        return [None] * len(items)

    def _weight_meta(self) -> WeightUpdateMeta:
        if not self.config.servers:
            return WeightUpdateMeta(type="in_process")
        if self.config.weight_update == "distributed":
            return WeightUpdateMeta(type="distributed", world_size=1 + len(self.config.servers))
        path = os.path.join(_work_dir(self.config, self._thread), f"{self.name}-weights")
        return WeightUpdateMeta(type="disk", path=path)

    # ---------------------------------------------------------------- gradient contributions

    async def train_sft(self, sample: TokenizedThread | StringThread) -> None:
        """Supervised fine-tuning: the token-mean negative log-likelihood of the trained tokens."""
        if isinstance(sample, StringThread):
            sample = await self.tokenize_thread(sample)
        self._queue(SFTLoss(), train_row(self._trainable(sample, "train_sft")))

    async def train_ppo(
        self,
        sample: TokenizedThread,
        logprobs: Sequence[float],
        advantages: float | Sequence[float],
        clip_range: float = 0.2,
    ) -> None:
        """PPO's clipped surrogate (Schulman et al. 2017, eq. 7) with the ratio against
        ``logprobs`` (the policy that sampled the tokens) and per-token ``advantages`` (e.g. GAE)."""
        sample = self._trainable(sample, "train_ppo")
        lp = per_token("logprobs", logprobs, sample)
        adv = per_token("advantages", advantages, sample)
        zeros = [0.0] * len(lp)
        row = train_row(sample, advantages=adv, prox_logp=lp, behav_logp=lp, ref_logp=zeros)
        self._queue(PolicyLoss(eps_clip=clip_range), row)

    async def train_grpo(
        self,
        sample: TokenizedThread,
        logprobs: Sequence[float],
        ref_logprobs: Sequence[float],
        advantages: float | Sequence[float],
        clip_range: float = 0.2,
        kl_beta: float = 0.0,
        *,
        kl_estimator: str = "k3",
        loss_agg: str = "token-mean",
    ) -> None:
        """GRPO (Shao et al. 2024, eq. 3): the clipped surrogate against ``logprobs`` plus
        ``kl_beta`` times a KL estimate to the reference (``kl_estimator`` k1, k2 or k3; eq. 4 is
        k3), token-averaged over every sample of the step (``loss_agg``)."""
        sample = self._trainable(sample, "train_grpo")
        lp = per_token("logprobs", logprobs, sample)
        ref = per_token("ref_logprobs", ref_logprobs, sample)
        adv = per_token("advantages", advantages, sample)
        row = train_row(sample, advantages=adv, prox_logp=lp, behav_logp=lp, ref_logp=ref)
        loss = PolicyLoss(eps_clip=clip_range, kl_beta=kl_beta, kl_estimator=kl_estimator, loss_agg=loss_agg)
        self._queue(loss, row)

    async def train_gspo(
        self,
        sample: TokenizedThread,
        logprobs: Sequence[float],
        ref_logprobs: Sequence[float],
        advantage: float | Sequence[float],
        left_clip: float = 3e-4,
        right_clip: float = 4e-4,
        kl_beta: float = 0.0,
    ) -> None:
        """GSPO (Zheng et al. 2025, eq. 5-7): a sequence-level ratio clipped to
        ``[1 - left_clip, 1 + right_clip]``, the sequence's ``advantage``, sequence-averaged."""
        sample = self._trainable(sample, "train_gspo")
        lp = per_token("logprobs", logprobs, sample)
        ref = per_token("ref_logprobs", ref_logprobs, sample)
        adv = per_token("advantage", advantage, sample)
        row = train_row(sample, advantages=adv, prox_logp=lp, behav_logp=lp, ref_logp=ref)
        loss = PolicyLoss(
            policy_loss="gspo", eps_clip=left_clip, eps_clip_higher=right_clip, kl_beta=kl_beta,
            loss_agg="seq-mean-token-mean",
        )  # fmt: skip
        self._queue(loss, row)

    async def train_dpo(
        self,
        sample_pos: TokenizedThread,
        sample_neg: TokenizedThread,
        ref_logprobs_pos: float | Sequence[float],
        ref_logprobs_neg: float | Sequence[float],
        beta: float = 0.1,
    ) -> None:
        """DPO (Rafailov et al. 2023, eq. 7) on one preference pair. The reference
        log-probabilities are per trained token (`logprobs_per_token` of the reference) or their
        sum over the sample."""
        pos = self._trainable(sample_pos, "train_dpo")
        neg = self._trainable(sample_neg, "train_dpo")
        rows = [
            train_row(s, ref_logp=_sequence_or_tokens(name, ref, s))
            for s, ref, name in ((pos, ref_logprobs_pos, "ref_logprobs_pos"), (neg, ref_logprobs_neg, "ref_logprobs_neg"))
        ]
        self._queue(DPOLoss(beta=beta), *rows)

    async def train_tangents(self, sample: TokenizedThread, tangents: Sequence[float]) -> None:
        """Bring your own loss: add ``sum_t tangents[t] * dlog p_t/dtheta`` over the trained tokens,
        ``tangents`` being ``dL/dlog p`` of any loss ``L`` of the log-probabilities (closed form or
        autodiff of the values ``logprobs_per_token`` gave). With one rank the gradients of
        several calls add up exactly; see `areal_lite.actors.train_on_tangents` for several."""
        sample = self._trainable(sample, "train_tangents")
        if isinstance(tangents, numbers.Real):
            raise TypeError("tangents must hold one value per trained token, not a single number")
        self._queue(TangentLoss(), train_row(sample, tangents=per_token("tangents", tangents, sample)))

    # ---------------------------------------------------------------- copies

    async def clone_inf(self, name: str | None = None) -> InferenceModel:
        """A frozen copy of the current weights (a reference policy). Collective."""
        self._clones += 1
        clone = name or f"{self.name}-ref{self._clones}"

        def save_copy() -> str:
            path = os.path.join(_work_dir(self.config, self._thread), clone)
            self.engine.save(SaveLoadMeta(path=path, weight_format="hf", tokenizer=self.tokenizer))
            return path

        path = await self._call(f"clone:{clone}", save_copy)
        return await InferenceModel._spawn(clone, path, self.config, trainable=False)


def _sequence_or_tokens(name: str, ref: float | Sequence[float], sample: TokenizedThread) -> list[float]:
    """Per-token reference log-probabilities, or a sequence total placed on the first trained
    token (DPO only uses their sum)."""
    if isinstance(ref, numbers.Real):
        return [float(ref)] + [0.0] * (sample.n_trained - 1)
    return per_token(name, ref, sample)


class ValueModel(_Trainable):
    """A value model (a scalar head per token) being trained, for PPO. Build one with
    `ModelBuilder.spawn_value`; it starts from a language model's weights with a new head."""

    is_critic = True

    async def values_per_token(self, thread: TokenizedThread) -> list[float]:
        """The value of the state before each trained token (one per token of weight > 0)."""
        return await self._score(thread)

    async def logprobs_per_token(self, thread: TokenizedThread) -> list[float]:
        raise TypeError("a ValueModel has values (values_per_token), not log-probabilities")

    async def train_value(
        self,
        sample: TokenizedThread,
        values: Sequence[float],
        returns: Sequence[float],
        clip_range: float | None = 0.2,
    ) -> None:
        """PPO's clipped value loss toward ``returns``, the new values clipped to within
        ``clip_range`` of ``values`` (the ones the returns were computed with)."""
        sample = self._trainable(sample, "train_value")
        row = train_row(sample, values=per_token("values", values, sample), returns=per_token("returns", returns, sample))
        self._queue(ValueLoss(eps_clip=clip_range), row)

    async def generate_tokens(self, thread: TokenizedThread, gconfig: GenerationConfig | None = None) -> TokenizedThread:
        raise TypeError("a ValueModel scores tokens; it does not generate")


@dataclass
class ModelBuilder:
    """Spawns recipe models from a HF model directory ``path``::

        policy = await ModelBuilder(path, config).spawn_train("policy", max_seq_len=512)
        reference = await policy.clone_inf()

    Under torchrun every rank spawns the same models in the same order (spawning is collective).
    """

    path: str
    config: ModelConfig = field(default_factory=ModelConfig)

    def tp(self, size: int) -> ModelBuilder:
        """The same builder with tensor parallelism ``size`` (Megatron)."""
        return replace(self, config=replace(self.config, tensor_parallel_size=size))

    def with_config(self, **changes: object) -> ModelBuilder:
        """The same builder with some `ModelConfig` fields changed."""
        return replace(self, config=replace(self.config, **changes))  # type: ignore[arg-type]

    def _config(self, max_seq_len: int | None) -> ModelConfig:
        return self.config if max_seq_len is None else replace(self.config, max_seq_len=max_seq_len)

    async def spawn_train(self, name: str, max_seq_len: int | None = None) -> TrainingModel:
        """A policy to train, from the directory's weights."""
        return await TrainingModel._spawn(name, self.path, self._config(max_seq_len), trainable=True)  # type: ignore[return-value]

    async def spawn_value(self, name: str, max_seq_len: int | None = None) -> ValueModel:
        """A value model to train: the directory's network with a new scalar head."""
        return await ValueModel._spawn(name, self.path, self._config(max_seq_len), trainable=True)  # type: ignore[return-value]

    async def spawn_inference(self, name: str, max_seq_len: int | None = None) -> InferenceModel:
        """A frozen model (a reference, a judge)."""
        return await InferenceModel._spawn(name, self.path, self._config(max_seq_len), trainable=False)


async def shutdown(*models: InferenceModel) -> None:
    """Close ``models``, stop the engine thread, remove the temporary work directory and leave the
    process group this package created. Collective; the last call of a recipe script."""
    for model in models:
        await model.close()
    await asyncio.to_thread(close_engine_thread)
    if _Process.owns_work_dir and _Process.work_dir and (not dist.is_initialized() or dist.get_rank() == 0):
        shutil.rmtree(_Process.work_dir, ignore_errors=True)
    _Process.work_dir, _Process.owns_work_dir = None, False
    if _Process.created_group:
        destroy_default_group()
        _Process.created_group = False
