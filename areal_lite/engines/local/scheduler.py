"""The embedded engine's scheduler: one thread that owns the model and serves every request.

Requests from any thread or event loop join a queue; between two steps the scheduler admits
waiting requests, and each step is one forward pass that prefills the admitted requests and
decodes one token of every running one, so a short request leaves as soon as it is done and never
waits for the longest one. Aborts, pauses (in place, abort, retract) and weight loads (from
tensors, from disk, received by broadcast in a weight-update group, or a LoRA adapter: the
`WeightLoader` of `areal_lite.engines.local.weights`) are applied between two steps; after a
weight load, running requests get their KV cache recomputed under the new weights and continue,
so every later token is produced by (and tagged with the version of) the new weights.

A streamed request (`stream`) gets each token as it is sampled: the scheduler hands it over right
after the step that produced it, before the request's result.

A vision-language model's request may carry images, made ready off the scheduler thread
(`prepare_images`: `areal_lite.engines.local.images`) and passed with the request.

This is the API of our HTTP server (`areal_lite.engines.server`); `LocalInferenceEngine` adapts
it to the `InferenceEngine` contract.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, InvalidStateError
from typing import TYPE_CHECKING

import torch

from areal_lite.api.config import LocalEngineConfig
from areal_lite.cpu import EngineTuning
from areal_lite.engines.local.futures import call_in_loop, complete, set_result_once
from areal_lite.engines.local.grammar import Grammars
from areal_lite.engines.local.images import ImageInputs, ImagePrompts
from areal_lite.engines.local.model_loading import context_length, dtype_of, eos_ids, load_model
from areal_lite.engines.local.model_runner import ModelRunner
from areal_lite.engines.local.request import GenerationError, GenerationResult, SamplingParams, Sequence, TokenOut
from areal_lite.engines.local.weights import WeightLoader
from areal_lite.utils.vision import is_vision_config

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)
THROUGHPUT_STEPS = 40
"""`Scheduler.gen_throughput` averages over this many generation steps (SGLang logs its decode
throughput every 40 steps)."""


class Scheduler:
    """Continuous-batching generation on a HF causal LM (CPU or CUDA), in a thread of its own.

    `generate` may be awaited from any event loop and any thread; the other methods may be called
    from any thread.
    """

    def __init__(self, config: LocalEngineConfig) -> None:
        self.config = config
        self.model: torch.nn.Module | None = None
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self._runner: ModelRunner | None = None
        self.version = 0
        """The version new tokens are tagged with."""
        self._cond = threading.Condition()
        self._waiting: list[Sequence] = []
        self._commands: list[tuple[Callable[[], object], Future]] = []
        self._paused = False
        self._stopping = False
        self._abort_pending = False
        self._admitting: list[Sequence] = []
        """Taken from the queue, not yet in the batch (an abort must still find them)."""
        self._thread: threading.Thread | None = None
        self._cpu = EngineTuning(config)
        """The CPU speed measures: the engine's cores and threads, memory kept from `start` to `stop`."""
        self._eos_ids: frozenset[int] = frozenset()
        self.weights = WeightLoader(self._run_in_scheduler, self._weights_loaded)
        self.adapter = self.weights.adapter
        """The LoRA adapter merged into the weights, if any (read it from the scheduler thread)."""
        self._yield_to: tuple[Callable[[], bool], int] | None = None
        """(whether a trainer in this process computes, the threads to run on meanwhile)."""
        self._recent_steps: deque[tuple[float, int]] = deque(maxlen=THROUGHPUT_STEPS)
        """(seconds, tokens produced) of the last generation steps, for `gen_throughput`."""
        self.images: ImagePrompts | None = None
        """A vision-language model's image processing (None for a text model)."""

    # ----- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Load the model and tokenizer and start the scheduler thread."""
        cfg = self.config
        self._cpu.check_cores()
        model, self.tokenizer = load_model(cfg.path, dtype_of(cfg.dtype), cfg.device)
        self._eos_ids = eos_ids(model)
        self.model = model
        context_len = context_length(model, cfg.max_total_tokens)
        self._runner = ModelRunner(model, cfg.max_running_requests, context_len, cfg.seed, cfg.cuda_graphs, cfg.cpu)
        self.weights.attach(model, self._runner.device)
        self.grammars = Grammars(self.tokenizer, model.config.get_text_config().vocab_size, self._eos_ids)
        self.images = ImagePrompts(model, cfg.path) if is_vision_config(model.config) else None
        self._cpu.keep_step_memory(self._runner.device)
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="local-engine-scheduler", daemon=True)
        self._thread.start()
        self._cpu.started()

    def stop(self) -> None:
        """Stop the thread; queued and running requests end aborted, pending commands fail."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for seq in self._waiting + (self._runner.clear() if self._runner else []):
            seq.deliver(seq.result({"type": "abort", "message": "engine stopped"}))
        self._waiting.clear()
        for _, fut in self._commands:
            with contextlib.suppress(InvalidStateError):  # its caller gave it up
                fut.set_exception(RuntimeError("the scheduler was stopped before this command ran"))
        self._commands.clear()
        self.weights.detach()
        self.model = None
        self._runner = None
        self._cpu.release()

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """The token ids a generation of ``params`` ends on: its ``stop_token_ids`` and, unless
        ``ignore_eos``, the model's end-of-sequence ids."""
        return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self._eos_ids)

    @property
    def context_len(self) -> int:
        assert self._runner is not None, "call start() first"
        return self._runner.context_len

    @property
    def routing_shape(self) -> tuple[int, int] | None:
        """(layers, top_k) of the routes a mixture-of-experts model records; None for a dense model."""
        assert self._runner is not None, "call start() first"
        return self._runner.route_shape

    @property
    def gen_throughput(self) -> float:
        """Tokens produced per second of generation over the last `THROUGHPUT_STEPS` steps (time
        spent idle not counted; 0 before any step): SGLang's ``last_gen_throughput``."""
        steps = list(self._recent_steps)  # the scheduler thread appends meanwhile
        seconds = sum(t for t, _ in steps)
        return sum(n for _, n in steps) / seconds if seconds > 0 else 0.0

    @property
    def num_running(self) -> int:
        """Requests admitted or waiting."""
        with self._cond:
            return len(self._waiting) + (len(self._runner.rows) if self._runner else 0)

    # ----- generation ----------------------------------------------------------------------

    def validate_request(self, input_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a request the engine cannot serve (empty or too long prompt,
        token ids outside the vocabulary, in the prompt or ``logit_bias``, stop strings or a
        grammar without a tokenizer, a grammar that does not compile)."""
        if self._runner is None:
            raise RuntimeError("the scheduler is not started: call start() first")
        if not input_ids:
            raise ValueError("the prompt is empty")
        if len(input_ids) >= self._runner.context_len:
            raise ValueError(
                f"the prompt has {len(input_ids)} tokens; the context length is {self._runner.context_len}"
            )
        vocab = self._runner.vocab_size
        if min(input_ids) < 0 or max(input_ids) >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab})")
        outside = [t for t in params.logit_bias if not 0 <= t < vocab]
        if outside:
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab - 1}], got {outside[0]}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model directory has none")
        if params.grammar is not None:
            self.grammars.check(params.grammar)

    async def prepare_images(
        self, input_ids: list[int], images: list[bytes], expand: bool = False
    ) -> tuple[list[int], ImageInputs | None]:
        """The prompt and its images' `ImageInputs` (None without images), made in a worker
        thread; with ``expand``, image placeholders (one token an image) are expanded
        (`ImagePrompts.prepare`). ValueError where the model takes no images or the prompt and
        the images disagree."""
        if not images:
            return input_ids, None
        if self.images is None:
            raise ValueError("this model takes no images: it is not a vision-language model")
        return await asyncio.to_thread(self.images.prepare, input_ids, images, expand)

    def submit_request(
        self,
        input_ids: list[int],
        params: SamplingParams,
        deliver: Callable[[GenerationResult], None],
        rid: str | None = None,
        return_input_logprobs: bool = False,
        on_token: Callable[[TokenOut], None] | None = None,
        images: ImageInputs | None = None,
    ) -> str:
        """Queue a request (with its ``images``, `prepare_images`); ``deliver`` is called once,
        from the scheduler thread, with its result, and ``on_token`` (if given) with each token
        as it is produced, before that. Returns the rid. Raises ValueError as `validate_request`."""
        self.validate_request(input_ids, params)
        stop_ids = self.stop_ids(params)
        rid = rid or uuid.uuid4().hex
        seq = Sequence(rid, list(input_ids), params, deliver, stop_ids, return_input_logprobs, on_token, images)
        if params.grammar is not None:
            seq.matcher = self.grammars.matcher(params.grammar)
        if params.max_new_tokens == 0 and not return_input_logprobs:
            deliver(seq.result({"type": "length", "length": 0}))
            return seq.rid
        with self._cond:
            self._waiting.append(seq)
            self._cond.notify_all()
        return seq.rid

    async def generate(
        self, input_ids: list[int], params: SamplingParams, rid: str | None = None,
        return_input_logprobs: bool = False, images: ImageInputs | None = None,
    ) -> GenerationResult:  # fmt: skip
        """Generate from ``input_ids`` (and ``images``) in the caller's event loop (any loop, any thread)."""
        [res] = await self.generate_many([(input_ids, params, rid)], return_input_logprobs, [images])
        return res

    async def generate_many(
        self,
        jobs: list[tuple[list[int], SamplingParams, str | None]],
        return_input_logprobs: bool = False,
        images: list[ImageInputs | None] | None = None,
    ) -> list[GenerationResult]:
        """`generate` for several ``(input_ids, params, rid)`` queued at once (``images``: each
        one's, None for all without): the scheduler admits them at the same step (rows and the
        prefill budget allowing), so the samples of a group decode in step and an interruption
        finds them all at the same length."""
        images = images or [None] * len(jobs)
        for input_ids, params, _ in jobs:
            self.validate_request(input_ids, params)
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[GenerationResult]] = [loop.create_future() for _ in jobs]
        with self._cond:  # reentrant: submit_request takes it too, and the scheduler thread waits for it
            rids = [
                self.submit_request(
                    input_ids,
                    params,
                    functools.partial(call_in_loop, loop, set_result_once, fut),
                    rid,
                    return_input_logprobs,
                    images=inputs,
                )
                for (input_ids, params, rid), fut, inputs in zip(jobs, futures, images, strict=True)
            ]
        try:
            results = await asyncio.gather(*futures)
        except asyncio.CancelledError:
            for rid in rids:
                self.abort(rid, message="the caller cancelled the request")
            raise
        for rid, res in zip(rids, results):
            if res.error is not None:
                raise GenerationError(f"request {rid} failed in the engine: {res.error}")
        return list(results)

    async def stream(
        self, input_ids: list[int], params: SamplingParams, rid: str | None = None,
        return_input_logprobs: bool = False, images: ImageInputs | None = None,
    ) -> AsyncIterator[TokenOut | GenerationResult]:  # fmt: skip
        """`generate` token by token: yields each `TokenOut` as the scheduler produces it (the first
        carries the prompt's log-probabilities when asked for), then the `GenerationResult`.
        Closing the iterator early aborts the request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenOut | GenerationResult] = asyncio.Queue()

        def put(item: TokenOut | GenerationResult) -> None:
            call_in_loop(loop, queue.put_nowait, item)

        rid = self.submit_request(input_ids, params, put, rid, return_input_logprobs, on_token=put, images=images)
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, GenerationResult):
                    finished = True
                    if item.error is not None:
                        raise GenerationError(f"request {rid} failed in the engine: {item.error}")
                    yield item
                    return
                yield item
        finally:
            if not finished:
                self.abort(rid, message="the caller stopped reading the stream")

    def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "aborted") -> None:
        """End the requests whose rid starts with ``rid`` (or all) with their partial output."""
        with self._cond:
            match = (lambda s: True) if abort_all else (lambda s: rid is not None and s.rid.startswith(rid))
            hit = [s for s in self._waiting if match(s)]
            self._waiting = [s for s in self._waiting if not match(s)]
            running = (list(self._runner.rows) if self._runner else []) + self._admitting
            for s in running:
                if match(s):
                    s.abort_message = message
                    self._abort_pending = True
            self._cond.notify_all()
        for s in hit:
            s.deliver(s.result({"type": "abort", "message": message}))

    def pause_generation(self, mode: str = "in_place") -> None:
        """Stop decoding. ``in_place`` keeps running requests and their cache; ``abort`` ends them
        (and the queued ones) with their partial output; ``retract`` sends them back to the queue.
        New requests are queued until `continue_generation`."""
        if mode not in ("abort", "in_place", "retract"):
            raise ValueError(f"pause mode must be abort, in_place or retract, got {mode!r}")
        with self._cond:
            self._paused = True
        if mode == "abort":
            self.abort(abort_all=True, message="paused")
        elif mode == "retract":
            self._run_in_scheduler(self._retract).result()

    def continue_generation(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def busy(self) -> bool:
        """Whether the loop has requests to run (running or queued) and is not paused. Read
        without the lock: a hint for sharing the cores, at most one step stale."""
        runner = self._runner
        return not self._paused and bool(self._waiting or (runner is not None and runner.rows))

    def generated_tokens(self, rid: str) -> int | None:
        """Tokens generated so far by a running request (None when it is not running)."""
        with self._cond:
            for s in self._runner.rows if self._runner else []:
                if s.rid == rid:
                    return len(s.out)
        return None

    # ----- the loop ------------------------------------------------------------------------

    def yield_threads_to(self, computing: Callable[[], bool], share: int) -> None:
        """Run on ``share`` threads while ``computing()`` says a trainer in this process is
        computing, on the process's count otherwise (checked before each step). Only for an
        engine without a count of its own (``num_threads`` 0): the trainer takes the rest while
        the engine generates (`CoreSharing`), so that either one alone has every thread and both
        at once split them."""
        if share < 1:
            raise ValueError(f"share must be at least 1, got {share}")
        self._yield_to = (computing, share)

    def _loop(self) -> None:
        runner = self._runner
        assert runner is not None
        self._cpu.thread_started()
        whole = current = torch.get_num_threads()
        while True:
            with self._cond:
                idle = False
                while (
                    not self._stopping
                    and not self._commands
                    and not self._abort_pending
                    and (self._paused or not (self._waiting or runner.rows))
                ):
                    if not idle:
                        self._cpu.idle()
                        idle = True
                    self._cond.wait()
                if self._stopping:
                    return
                commands, self._commands = self._commands, []
                abort_pending, self._abort_pending = self._abort_pending, False
                admitted: list[Sequence] = []
                # Admitted as soon as a row is free: their prefill joins the next decode step's
                # pass, which reads the weights once for both.
                if not self._paused:
                    admitted = self._admit(runner.max_rows - len(runner.rows))
                    self._admitting = admitted
            for fn, fut in commands:
                complete(fut, fn)
            if abort_pending:  # also while paused: aborted requests return at once
                self._finish_aborted()
            if self._paused:
                continue
            if self._yield_to is not None and not self.config.num_threads:
                computing, share = self._yield_to
                wanted = min(share, whole) if computing() else whole
                if wanted != current:
                    self._cpu.run_on(wanted)
                    current = wanted
            try:
                version = self.version
                running = len(runner.rows)
                t0 = time.monotonic()
                fresh = runner.step(admitted)
                self._recent_steps.append((time.monotonic() - t0, running + len(fresh)))
                with self._cond:
                    self._admitting = []
                for s in runner.rows[:running]:  # each got one token
                    s.versions.append(version)
                    s.emit()
                for s in fresh:
                    if s.params.max_new_tokens == 0:  # admitted only for its prompt logprobs
                        s.out.clear()
                        s.logprobs.clear()
                        s.top.clear()
                        continue
                    s.versions.append(version)
                    s.ttft = time.monotonic() - s.t0
                    s.emit()
                self._finish_done()
            except Exception as e:  # fail the requests, keep serving
                logger.exception("generation step failed")
                with self._cond:
                    failed, self._admitting = runner.clear(), []
                failed += [s for s in admitted if all(s is not r for r in failed)]
                for s in failed:
                    res = s.result({"type": "abort", "message": f"internal error: {e}"})
                    res.error = f"{type(e).__name__}: {e}"
                    s.deliver(res)

    def _admit(self, free: int) -> list[Sequence]:
        """Take the requests the next step admits from the queue (under the lock): in order, up to
        ``free`` rows, while their distinct prompts stay within ``max_prefill_tokens`` (at
        least one request)."""
        budget = self.config.max_prefill_tokens
        take = min(free, len(self._waiting))
        if budget:
            seen: set[tuple[tuple[int, ...], bytes]] = set()
            tokens = 0
            for i, s in enumerate(self._waiting[:take]):
                key = ModelRunner.prefill_key(s)
                if key in seen:
                    continue
                if i and tokens + len(key[0]) > budget:
                    take = i
                    break
                seen.add(key)
                tokens += len(key[0])
        admitted, self._waiting = self._waiting[:take], self._waiting[take:]
        return admitted

    def _finish_aborted(self) -> None:
        runner = self._runner
        assert runner is not None
        done = {i for i, s in enumerate(runner.rows) if s.abort_message is not None}
        for i in done:
            s = runner.rows[i]
            s.routes = runner.routes_of(i)
            s.deliver(s.result({"type": "abort", "message": s.abort_message}))
        runner.remove(done)

    def _finish_done(self) -> None:
        runner = self._runner
        assert runner is not None
        done: set[int] = set()
        for i, s in enumerate(runner.rows):
            reason = s.finish_reason(self.tokenizer, runner.context_len)
            if reason is not None:
                done.add(i)
                s.routes = runner.routes_of(i)
                s.deliver(s.result(reason))
        runner.remove(done)

    def _retract(self) -> None:
        seqs = self._runner.clear()
        with self._cond:
            self._waiting = seqs + self._waiting

    def _run_in_scheduler(self, fn: Callable[[], object]) -> Future:
        """Run ``fn`` in the scheduler thread between two steps; its result comes in the future."""
        fut: Future = Future()
        if self._thread is None or threading.current_thread() is self._thread:
            complete(fut, fn)
            return fut
        with self._cond:
            self._commands.append((fn, fut))
            self._cond.notify_all()
        return fut

    # ----- weights ----------------------------------------------------------------------------
    # Weight loads are the `WeightLoader`'s (``weights``); the scheduler only reacts to them.

    def _weights_loaded(self, version: int | None) -> None:
        """After a weight load (in the scheduler thread): recompute the running requests' caches
        under the new weights (unless ``keep_cache_on_update``), set the version (unless None)."""
        assert self._runner is not None
        if version is not None:
            self.version = version
        if not self.config.keep_cache_on_update:
            self._runner.prefill(self._runner.clear())
