"""`InferenceModel`: a model of the recipe API with frozen weights: tokenization, per-token
log-probabilities (the train engine's forward pass, batched over concurrent requests) and
generation (an inference engine started on the first call). `areal_lite.recipes.model` says how
models are spawned and run; `TrainingModel` extends this one."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from areal_lite.api.config import InferenceEngineConfig, LocalEngineConfig
from areal_lite.api.engine import InferenceEngine, TrainEngine
from areal_lite.api.io import FinetuneSpec, GenerationConfig, ModelRequest
from areal_lite.kit import make_train_engine
from areal_lite.recipes.config import ModelConfig
from areal_lite.recipes.lockstep import PackHandler, engine_thread
from areal_lite.recipes.losses import batch_order
from areal_lite.recipes.process import Process, join_process_group
from areal_lite.recipes.thread import StringThread, ThreadTokenizer, TokenizedThread
from areal_lite.utils.datasets import padded_batch

T = TypeVar("T")


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

        if name in Process.names:
            raise ValueError(f"a model named {name!r} exists already in this process")
        await join_process_group()
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
        Process.names.add(name)
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
        if not isinstance(thread, StringThread):
            raise TypeError(f"tokenize_thread takes a StringThread, got {type(thread).__name__}")
        return await asyncio.to_thread(self.threads.tokenize, thread)

    async def detokenize_thread(self, thread: TokenizedThread) -> StringThread:
        """``thread`` as text turns (the contents it was tokenized or generated from)."""
        if not isinstance(thread, TokenizedThread):
            raise TypeError(f"detokenize_thread takes a TokenizedThread, got {type(thread).__name__}")
        return self.threads.detokenize(thread)

    async def serialize_tokenized_thread(self, thread: TokenizedThread) -> tuple[list[int], list[object], list[float]]:
        """``(tokens, image_patches, weights)`` of ``thread``: its token ids, its image patches
        (none: these models read text only) and one weight per token (> 0 on trained tokens; the
        first token never is). ``tokens[:-1]`` predict ``tokens[1:]``, as `train_tangents` takes them."""
        thread = await self._tokenized(thread, "serialize_tokenized_thread")
        return thread.tokens, [], thread.weights

    async def _tokenized(self, thread: TokenizedThread | StringThread, what: str) -> TokenizedThread:
        """``thread`` as a `TokenizedThread`: tokenized when it is a `StringThread`; any other type
        is a TypeError now rather than an AttributeError deep inside a batched call."""
        if isinstance(thread, TokenizedThread):
            return thread
        if isinstance(thread, StringThread):
            return await self.tokenize_thread(thread)
        raise TypeError(f"{what} takes a TokenizedThread (or a StringThread, tokenized), got {type(thread).__name__}")

    async def logprobs_per_token(self, thread: TokenizedThread | StringThread) -> list[float]:
        """Log-probability of each trained token of ``thread`` under this model's weights (one per
        token of weight > 0, in order), from the train engine's forward pass. A `StringThread` is
        tokenized first."""
        return await self._score(await self._tokenized(thread, "logprobs_per_token"))

    async def _score(self, thread: TokenizedThread) -> list[float]:
        if thread.n_trained == 0:
            raise ValueError("the thread has no trained token (no assistant turn): there is nothing to score")
        self.threads.check(thread)
        return await self._packed("forward", thread)  # type: ignore[return-value]

    def _forward_handler(self, items: list[object]) -> list[object]:
        threads: list[TokenizedThread] = items  # type: ignore[assignment]
        masks = [[1 if w > 0 else 0 for w in t.weights] for t in threads]
        order = sorted(range(len(threads)), key=lambda i: batch_order(threads[i].tokens, masks[i]))
        rows = [(threads[i].tokens, masks[i]) for i in order]
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
        if not isinstance(thread, StringThread):
            raise TypeError(
                f"generate takes a StringThread (generate_tokens a TokenizedThread), got {type(thread).__name__}"
            )
        tokens = await self.generate_tokens(await self.tokenize_thread(thread), gconfig)
        return await self.detokenize_thread(tokens)

    async def generate_tokens(
        self, thread: TokenizedThread | StringThread, gconfig: GenerationConfig | None = None
    ) -> TokenizedThread:
        """``thread`` with a sampled assistant turn appended (weight 1 on every sampled token);
        the result's ``logprobs`` are the sampling log-probabilities of those tokens. A
        `StringThread` is tokenized first (so ``async_map_batch(model.generate_tokens,
        repeat_thread(string_thread), n)`` samples a group)."""
        thread = await self._tokenized(thread, "generate_tokens")
        g = gconfig or self.config.gconfig
        prompt = self.threads.prompt_ids(thread)
        room = self.config.max_seq_len - len(prompt)
        if room <= 0:
            raise ValueError(
                f"a prompt of {len(prompt)} tokens leaves no room under max_seq_len={self.config.max_seq_len}"
            )
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
            from areal_lite.engines.remote.sglang import RemoteSGLangEngine

            rollout = InferenceEngineConfig(addresses=list(cfg.servers))
            engine: InferenceEngine = RemoteSGLangEngine(rollout, control_servers=dist.get_rank() == 0)
        else:
            from areal_lite.engines.local.engine import LocalInferenceEngine

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
        Process.names.discard(self.name)
