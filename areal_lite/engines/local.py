"""The embedded inference engine: continuous-batching generation in-process on a HF causal LM.

One scheduler thread owns the model. Requests from any thread or event loop join a queue; between
two decode steps the scheduler admits waiting requests (one batched prefill), then runs one batched
decode step over every running request, so a short request leaves as soon as it is done and never
waits for the longest one.

The model runner is deliberately lean: it calls the HF model's own modules (embeddings, norms,
projections, MLPs, LM head) but runs attention itself over a slot-based KV cache (row ``i`` of the
cache belongs to the ``i``-th running request; finished rows are refilled from the tail), with
per-row positions and one additive mask per step. This needs the Llama layer layout, shared by the
supported ``model_type``s (llama, qwen2, qwen3, mistral); the numerics are those of the HF forward
(same modules, same rotary tables), so reported log-probabilities equal a HF forward of the same
tokens to float tolerance.

Reported log-probabilities are those of the policy itself (temperature 1, before top-p/top-k and
before min-token suppression), as the train engine recomputes them. Weight updates (in-process,
from disk, or received by broadcast in a weight-update group) are applied by the scheduler between
two steps; running requests then get their KV cache recomputed under the new weights and continue,
so every later token is produced by (and tagged with the version of) the new weights.
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from areal_lite.api.config import LocalEngineConfig
from areal_lite.api.engine import InferenceEngine
from areal_lite.api.io import GenerationConfig, ModelRequest, ModelResponse, WeightUpdateMeta
from areal_lite.utils.distributed import CustomGroup, init_custom_process_group
from areal_lite.utils.gc_freeze import freeze_startup_objects

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
PREFILL_MASK_ELEMENTS = 32 * 1024 * 1024
"""A batched prefill is split when its attention mask would hold more elements than this."""
ADMIT_BATCH = 16
"""While requests are decoding, waiting ones are admitted once this many rows (or all they need)
are free."""
GREEDY_TEMPERATURE = 1e-6
"""Temperatures below this mean greedy decoding (SGLang's convention)."""


@dataclass
class SamplingParams:
    """Sampling parameters of one request, in SGLang's vocabulary (``sampling_params``)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (all) or >= 1, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @classmethod
    def from_gconfig(cls, g: GenerationConfig) -> SamplingParams:
        return cls(
            max_new_tokens=g.max_new_tokens,
            min_new_tokens=g.min_new_tokens,
            temperature=0.0 if g.greedy else g.temperature,
            top_p=g.top_p,
            top_k=g.top_k,
            stop=list(g.stop),
            stop_token_ids=list(g.stop_token_ids),
            ignore_eos=g.ignore_eos,
        )


@dataclass
class GenerationResult:
    """What one request produced. ``finish_reason`` is SGLang's dict: ``{"type": "length",
    "length": n}``, ``{"type": "stop", "matched": id_or_str}`` or ``{"type": "abort", "message": s}``."""

    rid: str
    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: dict[str, object]
    input_logprobs: list[float | None] | None
    """Log-probability of each prompt token given the ones before it (None at position 0);
    only when asked for."""
    latency: float
    ttft: float
    error: str | None = None
    """Set when the engine failed while running the request (`generate` raises it)."""


class GenerationError(RuntimeError):
    """The engine failed while running a request (not the request's fault)."""


class _Seq:
    """A request inside the scheduler (plain attributes: touched once per token)."""

    __slots__ = (
        "abort_message", "deliver", "input_logprobs", "logprobs", "out", "params", "prompt", "rid", "stop_ids", "t0",
        "ttft", "versions", "want_input_logprobs",
    )  # fmt: skip

    def __init__(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        deliver: Callable[[GenerationResult], None],
        stop_ids: frozenset[int],
        want_input_logprobs: bool,
    ) -> None:
        self.rid = rid
        self.prompt = prompt
        self.params = params
        self.deliver = deliver
        self.out: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.stop_ids = stop_ids
        self.want_input_logprobs = want_input_logprobs
        self.input_logprobs: list[float | None] | None = None
        self.t0 = time.monotonic()
        self.ttft = 0.0
        self.abort_message: str | None = None

    def result(self, finish_reason: dict[str, object]) -> GenerationResult:
        return GenerationResult(
            rid=self.rid,
            input_ids=self.prompt,
            output_ids=self.out,
            output_logprobs=self.logprobs,
            output_versions=self.versions,
            finish_reason=finish_reason,
            input_logprobs=self.input_logprobs,
            latency=time.monotonic() - self.t0,
            ttft=self.ttft,
        )


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A HF RMSNorm module's computation in one fused op."""
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _ModelRunner:
    """The model, its slot-based KV cache and batched prefill / decode / sampling.

    Used only from the scheduler thread. Row ``i`` of the cache holds the ``i``-th running
    sequence; ``lens[i]`` tokens of it are cached and ``last[i]`` is the sampled token not yet fed.
    """

    def __init__(self, model: torch.nn.Module, max_rows: int, context_len: int, seed: int) -> None:
        cfg = model.config
        rope_type = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
        if "dynamic" in rope_type:
            # Rotary tables are computed once for all positions; dynamic scaling depends on length.
            raise ValueError(f"LocalInferenceEngine does not support rope_type {rope_type!r}")
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"LocalInferenceEngine supports model types {SUPPORTED_MODEL_TYPES}, got {cfg.model_type!r}"
            )
        self.model = model
        self.base = model.model
        self.layers = list(self.base.layers)
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.scaling = attn.scaling
        self.has_qk_norm = hasattr(attn, "q_norm")
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_rows = max_rows
        self.context_len = context_len
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        positions = torch.arange(context_len, device=self.device)[None]
        dummy = torch.zeros(1, device=self.device, dtype=self.dtype)
        cos, sin = self.base.rotary_emb(dummy, positions)
        self.cos, self.sin = cos[0], sin[0]  # [context_len, head_dim]
        self.cap = 0
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self.lens = torch.zeros(max_rows, dtype=torch.long, device=self.device)
        self.last = torch.zeros(max_rows, dtype=torch.long, device=self.device)
        self.rows: list[_Seq] = []
        self._ensure_capacity(min(256, context_len))
        self.fused = [self._fuse(layer) for layer in self.layers]

    @staticmethod
    def _fuse(layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """One matmul for q/k/v and one for gate/up instead of five (fewer ops per step).

        The HF modules' parameters become views into the fused tensors, so a weight update that
        copies into the model's parameters (as every update here does) updates both at once.
        """

        def fuse(linears: list[torch.nn.Linear], attr: str) -> torch.Tensor | None:
            parts = [getattr(m, attr) for m in linears]
            if parts[0] is None:
                return None
            fused = torch.cat([p.data for p in parts])
            start = 0
            for m, p in zip(linears, parts):
                getattr(m, attr).data = fused[start : start + p.shape[0]]
                start += p.shape[0]
            return fused

        attn, mlp = layer.self_attn, layer.mlp
        qkv, gate_up = [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]
        return fuse(qkv, "weight"), fuse(qkv, "bias"), fuse(gate_up, "weight"), fuse(gate_up, "bias")  # type: ignore[return-value]

    def _ensure_capacity(self, needed: int) -> None:
        """Grow the cache (doubling, capped at the context length) to hold ``needed`` positions."""
        if needed <= self.cap:
            return
        cap = max(needed, min(self.context_len, max(2 * self.cap, 64)))
        shape = (self.max_rows, self.n_kv, cap, self.head_dim)
        new_k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        new_v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        for old, new in zip(self.k_cache + self.v_cache, new_k + new_v):
            new[:, :, : self.cap].copy_(old)
        self.k_cache, self.v_cache, self.cap = new_k, new_v, cap

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + _rotate_half(x) * sin

    def _layers_forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        write: Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Run every decoder layer on ``h`` [B, T, H]; ``write(layer, k, v)`` stores the new keys
        and values in the cache and returns the keys and values to attend over."""
        b, t, _ = h.shape
        cos = self.cos[positions][:, None]  # [B, 1, T, D]
        sin = self.sin[positions][:, None]
        nq, nkv = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            w_qkv, b_qkv, w_gate_up, b_gate_up = self.fused[i]
            x = _rms_norm(layer.input_layernorm, h)
            qk, v = F.linear(x, w_qkv, b_qkv).split([nq + nkv, nkv], dim=-1)
            qk = qk.view(b, t, self.n_heads + self.n_kv, self.head_dim)
            v = v.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
            if self.has_qk_norm:
                qk = torch.cat([attn.q_norm(qk[:, :, : self.n_heads]), attn.k_norm(qk[:, :, self.n_heads :])], dim=2)
            # Rotary embedding on queries and keys in one go.
            q, k = self._rope(qk.transpose(1, 2), cos, sin).split([self.n_heads, self.n_kv], dim=1)
            keys, values = write(i, k, v)
            o = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=self.n_kv != self.n_heads
            )
            h = h + attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))
            gate, up = F.linear(_rms_norm(layer.post_attention_layernorm, h), w_gate_up, b_gate_up).chunk(2, dim=-1)
            h = h + mlp.down_proj(mlp.act_fn(gate) * up)
        return _rms_norm(self.base.norm, h)

    @torch.no_grad()
    def prefill(self, seqs: list[_Seq]) -> list[_Seq]:
        """Add ``seqs`` as new rows and fill their cache. A sequence without output yet gets its
        first token sampled (returned); one with output (re-prefilled after a weight update or a
        retract) caches all but its last token, which becomes the next one fed.

        Rows with the same tokens (the samples of a GRPO group) share one forward pass, which
        fills each row's cache and gives each row its own first sample: prompts are most of the
        tokens a group costs when completions are short."""
        if not seqs:
            return []
        tokens = [s.prompt + s.out[:-1] if s.out else s.prompt for s in seqs]
        first_of: dict[tuple[int, ...], int] = {}
        inverse = [first_of.setdefault(tuple(t), len(first_of)) for t in tokens]
        unique = [list(t) for t in first_of]
        lengths = [len(t) for t in tokens]
        n, width = len(unique), max(lengths)
        if n > 1 and n * width * width > PREFILL_MASK_ELEMENTS:
            # The mask is [n, width, width]: split long batches, shortest and longest apart.
            ordered = [seqs[j] for j in sorted(range(len(seqs)), key=lengths.__getitem__)]
            half = len(ordered) // 2
            return self.prefill(ordered[:half]) + self.prefill(ordered[half:])
        start = len(self.rows)
        self._ensure_capacity(width + 1)
        ids = torch.zeros(n, width, dtype=torch.long, device=self.device)
        for j, t in enumerate(unique):
            ids[j, : len(t)] = torch.tensor(t, dtype=torch.long)
        unique_lens = torch.tensor([len(t) for t in unique], device=self.device)
        pos = torch.arange(width, device=self.device)
        allowed = (pos[None, None, :] <= pos[None, :, None]) & (pos[None, None, :] < unique_lens[:, None, None])
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill_(~allowed, float("-inf"))[
            :, None
        ]
        rows = slice(start, start + len(seqs))
        of_row = torch.tensor(inverse, device=self.device)  # row -> its unique token sequence

        def write(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            self.k_cache[i][rows, :, :width] = k[of_row]
            self.v_cache[i][rows, :, :width] = v[of_row]
            return k, v

        h = self._layers_forward(self.base.embed_tokens(ids), pos[None].expand(n, width), mask, write)
        self.rows.extend(seqs)
        self.lens[rows] = unique_lens[of_row]
        fresh = [j for j, s in enumerate(seqs) if not s.out]
        for j, s in enumerate(seqs):
            if s.out:
                self.last[start + j] = s.out[-1]
            if s.want_input_logprobs and s.input_logprobs is None:
                u = inverse[j]
                logp = torch.log_softmax(self.model.lm_head(h[u, : lengths[j] - 1]).float(), dim=-1)
                target = ids[u, 1 : lengths[j]]
                s.input_logprobs = [None] + logp.gather(1, target[:, None])[:, 0].tolist()
        if fresh:
            idx = torch.tensor(fresh, device=self.device)
            u = of_row[idx]
            last_h = h[u, unique_lens[u] - 1]
            self._sample_and_append(self.model.lm_head(last_h).float(), [seqs[j] for j in fresh], start + idx)
        return [seqs[j] for j in fresh]

    @torch.no_grad()
    def decode(self) -> None:
        """One decode step for every row: feed ``last``, sample the next token of each row."""
        b = len(self.rows)
        pos = self.lens[:b]
        needed = int(pos.max()) + 1
        self._ensure_capacity(needed)
        ar = torch.arange(b, device=self.device)
        visible = torch.arange(needed, device=self.device)[None, :] <= pos[:, None]
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device).masked_fill_(~visible, float("-inf"))[
            :, None, None
        ]

        def write(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            kc, vc = self.k_cache[i], self.v_cache[i]
            kc[ar, :, pos] = k[:, :, 0]
            vc[ar, :, pos] = v[:, :, 0]
            return kc[:b, :, :needed], vc[:b, :, :needed]

        h = self._layers_forward(self.base.embed_tokens(self.last[:b, None]), pos[:, None], mask, write)
        self.lens[:b] += 1
        self._sample_and_append(self.model.lm_head(h[:, 0]).float(), self.rows, ar)

    def _sample_and_append(self, logits: torch.Tensor, seqs: list[_Seq], rows: torch.Tensor) -> None:
        """Sample one token per row of ``logits`` [n, V] (fp32) and record it with its logprob."""
        logp = torch.log_softmax(logits, dim=-1)
        params = [s.params for s in seqs]
        suppress = [(j, s.stop_ids) for j, s in enumerate(seqs) if s.stop_ids and len(s.out) < s.params.min_new_tokens]
        if suppress:
            logits = logits.clone()
            for j, ids in suppress:
                logits[j, list(ids)] = float("-inf")
        greedy = [p.greedy for p in params]
        tokens = logits.argmax(dim=-1)
        if not all(greedy):
            temps = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], device=logits.device)
            scores = logits / temps[:, None]
            if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
                scores = _top_k_top_p(scores, params)
            # argmax(p / E) with E ~ Exp(1) samples from p (exponential race). On CPU, -log(U)
            # is several times cheaper than torch.multinomial or Tensor.exponential_.
            probs = torch.softmax(scores, dim=-1)
            race = torch.rand(probs.shape, generator=self.generator, device=probs.device).log_().neg_()
            sampled = (probs / race).argmax(dim=-1)
            tokens = (
                sampled if not any(greedy) else torch.where(torch.tensor(greedy, device=logits.device), tokens, sampled)
            )
        self.last[rows] = tokens
        chosen = logp.gather(1, tokens[:, None])[:, 0]
        for s, t, lp in zip(seqs, tokens.tolist(), chosen.tolist()):
            s.out.append(t)
            s.logprobs.append(lp)

    def remove(self, done: set[int]) -> None:
        """Drop the rows in ``done``, moving tail rows into the holes so that rows stay 0..B-1."""
        if not done:
            return
        b = len(self.rows)
        keep = b - len(done)
        holes = [i for i in sorted(done) if i < keep]
        sources = [i for i in range(keep, b) if i not in done]
        if holes:
            dst = torch.tensor(holes, device=self.device)
            src = torch.tensor(sources, device=self.device)
            width = int(self.lens[:b].max()) + 1
            for cache in self.k_cache + self.v_cache:
                cache[dst, :, :width] = cache[src, :, :width]
            self.lens[dst] = self.lens[src]
            self.last[dst] = self.last[src]
            for h_, s_ in zip(holes, sources):
                self.rows[h_] = self.rows[s_]
        del self.rows[keep:]

    def clear(self) -> list[_Seq]:
        """Forget every row (their caches); returns the sequences that were running."""
        seqs, self.rows = self.rows, []
        return seqs


def _top_k_top_p(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) the tokens outside each row's top-k and top-p nucleus."""
    sorted_scores, order = scores.sort(dim=-1, descending=True)
    vocab = scores.shape[-1]
    ks = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=scores.device)
    ps = torch.tensor([p.top_p for p in params], device=scores.device)
    rank = torch.arange(vocab, device=scores.device)[None]
    cut = rank >= ks[:, None]
    probs = torch.softmax(sorted_scores, dim=-1)
    # A token stays while the mass before it is below top_p, so the most likely token always stays.
    cut |= (probs.cumsum(dim=-1) - probs) >= ps[:, None]
    sorted_scores = sorted_scores.masked_fill(cut, float("-inf"))
    return torch.empty_like(scores).scatter_(1, order, sorted_scores)


def _complete(fut: Future, fn: Callable[[], object]) -> None:
    """Run ``fn`` and put its result, or the exception it raised, into ``fut``."""
    try:
        fut.set_result(fn())
    except Exception as e:  # noqa: BLE001 - whoever waits on the future gets it
        fut.set_exception(e)


def _set_future(fut: asyncio.Future, value: GenerationResult) -> None:
    if not fut.done():
        fut.set_result(value)


_DTYPES = {
    n: getattr(torch, n)
    for n in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool")
}


def _dtype_of(name: str) -> torch.dtype:
    """A torch dtype from its name (``float32`` or ``torch.float32``); ValueError when unknown."""
    dtype = _DTYPES.get(name.removeprefix("torch."))
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(_DTYPES)}")
    return dtype


class LocalInferenceEngine(InferenceEngine):
    """Generation in this process on a HF causal LM (CPU or CUDA), with continuous batching.

    `agenerate` may be awaited from any event loop and any thread.
    """

    def __init__(self, config: LocalEngineConfig) -> None:
        self.config = config
        self.model: torch.nn.Module | None = None
        self.tokenizer = None
        self._runner: _ModelRunner | None = None
        self._version = 0
        self._cond = threading.Condition()
        self._waiting: list[_Seq] = []
        self._commands: list[tuple[Callable[[], object], Future]] = []
        self._paused = False
        self._stopping = False
        self._abort_pending = False
        self._admitting: list[_Seq] = []
        """Taken from the queue, not yet in the batch (an abort must still find them)."""
        self._thread: threading.Thread | None = None
        self._group: CustomGroup | None = None
        self._group_backend = "gloo"
        self._eos_ids: frozenset[int] = frozenset()

    # ----- lifecycle -----------------------------------------------------------------------

    def initialize(self) -> None:
        """Load the model and tokenizer and start the scheduler thread."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        cfg = self.config
        dtype = _dtype_of(cfg.dtype)
        model = AutoModelForCausalLM.from_pretrained(cfg.path, dtype=dtype).to(cfg.device).eval()
        model.requires_grad_(False)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.path)
        except (OSError, ValueError):
            logger.warning("no tokenizer in %s: stop strings and text prompts are unavailable", cfg.path)
        eos = (
            model.generation_config.eos_token_id
            if model.generation_config.eos_token_id is not None
            else model.config.eos_token_id
        )
        self._eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        max_pos = model.config.max_position_embeddings
        context_len = min(cfg.max_total_tokens, max_pos) if cfg.max_total_tokens > 0 else max_pos
        window = getattr(model.config, "sliding_window", None)
        if window and (model.config.model_type == "mistral" or getattr(model.config, "use_sliding_window", False)):
            # The runner attends over the whole cache; within one window that is exact.
            context_len = min(context_len, window)
        self.model = model
        self._runner = _ModelRunner(model, cfg.max_running_requests, context_len, cfg.seed)
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="local-engine-scheduler", daemon=True)
        self._thread.start()
        freeze_startup_objects()

    def destroy(self) -> None:
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
            fut.set_exception(RuntimeError("the engine was destroyed before this command ran"))
        self._commands.clear()
        self._group = None
        self.model = None
        self._runner = None

    @property
    def context_len(self) -> int:
        assert self._runner is not None, "call initialize() first"
        return self._runner.context_len

    @property
    def num_running(self) -> int:
        """Requests admitted or waiting."""
        with self._cond:
            return len(self._waiting) + (len(self._runner.rows) if self._runner else 0)

    # ----- generation ----------------------------------------------------------------------

    def validate_request(self, input_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a request the engine cannot serve (empty or too long prompt,
        token ids outside the vocabulary, stop strings without a tokenizer)."""
        if self._runner is None:
            raise RuntimeError("LocalInferenceEngine is not initialized")
        if not input_ids:
            raise ValueError("the prompt is empty")
        if len(input_ids) >= self._runner.context_len:
            raise ValueError(
                f"the prompt has {len(input_ids)} tokens; the context length is {self._runner.context_len}"
            )
        vocab = self._runner.model.config.vocab_size
        if min(input_ids) < 0 or max(input_ids) >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model directory has none")

    def submit_request(
        self,
        input_ids: list[int],
        params: SamplingParams,
        deliver: Callable[[GenerationResult], None],
        rid: str | None = None,
        return_input_logprobs: bool = False,
    ) -> str:
        """Queue a request; ``deliver`` is called once, from the scheduler thread, with its
        result. Returns the rid. Raises ValueError for an empty or too long prompt."""
        self.validate_request(input_ids, params)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self._eos_ids)
        seq = _Seq(rid or uuid.uuid4().hex, list(input_ids), params, deliver, stop_ids, return_input_logprobs)
        if params.max_new_tokens == 0 and not return_input_logprobs:
            deliver(seq.result({"type": "length", "length": 0}))
            return seq.rid
        with self._cond:
            self._waiting.append(seq)
            self._cond.notify_all()
        return seq.rid

    async def generate(
        self, input_ids: list[int], params: SamplingParams, rid: str | None = None, return_input_logprobs: bool = False
    ) -> GenerationResult:
        """Generate from ``input_ids`` in the caller's event loop (any loop, any thread)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[GenerationResult] = loop.create_future()
        rid = self.submit_request(
            input_ids, params, lambda r: loop.call_soon_threadsafe(_set_future, fut, r), rid, return_input_logprobs
        )
        try:
            res = await fut
        except asyncio.CancelledError:
            self.abort(rid, message="the caller cancelled the request")
            raise
        if res.error is not None:
            raise GenerationError(f"request {rid} failed in the engine: {res.error}")
        return res

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        res = await self.generate(req.input_ids, SamplingParams.from_gconfig(req.gconfig), rid=req.rid)
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=res.output_ids,
            output_logprobs=res.output_logprobs,
            output_versions=res.output_versions,
            stop_reason=res.finish_reason["type"],  # type: ignore[arg-type]
            latency=res.latency,
            ttft=res.ttft,
            rid=req.rid,
        )

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

    def generated_tokens(self, rid: str) -> int | None:
        """Tokens generated so far by a running request (None when it is not running)."""
        with self._cond:
            for s in self._runner.rows if self._runner else []:
                if s.rid == rid:
                    return len(s.out)
        return None

    # ----- the scheduler -------------------------------------------------------------------

    def _loop(self) -> None:
        runner = self._runner
        assert runner is not None
        while True:
            with self._cond:
                while (
                    not self._stopping
                    and not self._commands
                    and not self._abort_pending
                    and (self._paused or not (self._waiting or runner.rows))
                ):
                    self._cond.wait()
                if self._stopping:
                    return
                commands, self._commands = self._commands, []
                abort_pending, self._abort_pending = self._abort_pending, False
                admitted: list[_Seq] = []
                free = runner.max_rows - len(runner.rows)
                # While others decode, wait until a batch's worth of rows is free: one prefill of
                # many requests costs about what one of a few does.
                if not self._paused and (not runner.rows or free >= min(len(self._waiting), ADMIT_BATCH)):
                    admitted, self._waiting = self._waiting[:free], self._waiting[free:]
                    self._admitting = admitted
            for fn, fut in commands:
                _complete(fut, fn)
            if abort_pending:  # also while paused: aborted requests return at once
                self._finish_aborted()
            if self._paused:
                continue
            try:
                version = self._version
                fresh = runner.prefill(admitted)
                with self._cond:
                    self._admitting = []
                for s in fresh:
                    if s.params.max_new_tokens == 0:  # admitted only for its prompt logprobs
                        s.out.clear()
                        s.logprobs.clear()
                        continue
                    s.versions.append(version)
                    s.ttft = time.monotonic() - s.t0
                self._finish_done()
                if runner.rows and not self._paused:
                    before = [len(s.out) for s in runner.rows]
                    runner.decode()
                    for s, n in zip(runner.rows, before):
                        if len(s.out) > n:
                            s.versions.append(version)
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

    def _finish_aborted(self) -> None:
        runner = self._runner
        assert runner is not None
        done = {i for i, s in enumerate(runner.rows) if s.abort_message is not None}
        for i in done:
            s = runner.rows[i]
            s.deliver(s.result({"type": "abort", "message": s.abort_message}))
        runner.remove(done)

    def _finish_done(self) -> None:
        runner = self._runner
        assert runner is not None
        done: set[int] = set()
        for i, s in enumerate(runner.rows):
            reason = self._finish_reason(s)
            if reason is not None:
                done.add(i)
                s.deliver(s.result(reason))
        runner.remove(done)

    def _finish_reason(self, s: _Seq) -> dict[str, object] | None:
        n = len(s.out)
        if s.abort_message is not None:
            return {"type": "abort", "message": s.abort_message}
        p = s.params
        if n >= p.min_new_tokens and n > 0:
            if s.out[-1] in s.stop_ids:
                return {"type": "stop", "matched": s.out[-1]}
            if p.stop:
                text = self.tokenizer.decode(s.out[-64:])
                for stop in p.stop:
                    if stop in text:
                        return {"type": "stop", "matched": stop}
        if n >= p.max_new_tokens or len(s.prompt) + n >= self._runner.context_len:
            return {"type": "length", "length": n}
        return None

    def _retract(self) -> None:
        seqs = self._runner.clear()
        with self._cond:
            self._waiting = seqs + self._waiting

    def _run_in_scheduler(self, fn: Callable[[], object]) -> Future:
        """Run ``fn`` in the scheduler thread between two steps; its result comes in the future."""
        fut: Future = Future()
        if self._thread is None or threading.current_thread() is self._thread:
            _complete(fut, fn)
            return fut
        with self._cond:
            self._commands.append((fn, fut))
            self._cond.notify_all()
        return fut

    # ----- weights -------------------------------------------------------------------------

    def _load_tensors(self, named: Iterable[tuple[str, torch.Tensor]], version: int | None) -> None:
        """Copy tensors into the model by HF name (all checked before any is copied), recompute the
        running requests' caches under the new weights, and set the version."""
        assert self.model is not None and self._runner is not None
        params = self.model.state_dict()
        pairs = list(named)
        for name, t in pairs:
            if name not in params:
                raise ValueError(f"unknown parameter {name!r}")
            if tuple(t.shape) != tuple(params[name].shape):
                raise ValueError(f"parameter {name!r} has shape {tuple(params[name].shape)}, got {tuple(t.shape)}")
        with torch.no_grad():
            for name, t in pairs:
                params[name].copy_(t)
        if version is not None:
            self._version = version
        seqs = self._runner.clear()
        self._runner.prefill(seqs)

    def load_weights_from_disk(self, path: str, version: int | None = None) -> Future:
        """Load every ``*.safetensors`` file of a HF model directory (reading off the scheduler)."""
        from safetensors.torch import load_file

        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            fut: Future = Future()
            fut.set_exception(ValueError(f"no *.safetensors files in {path!r}"))
            return fut
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update(load_file(f))
        return self._run_in_scheduler(lambda: self._load_tensors(tensors.items(), version))

    def init_weights_update_group(self, meta: WeightUpdateMeta) -> Future[None]:
        """Join the weight-update group as rank 1 of 2 (the trainer is rank 0)."""
        meta.world_size = 2
        return self.join_weights_update_group(meta, rank=1)

    def join_weights_update_group(self, meta: WeightUpdateMeta, rank: int) -> Future[None]:
        """Join ``meta``'s group at ``rank`` in a helper thread (the trainer joins concurrently)."""
        fut: Future[None] = Future()

        def join() -> None:
            self._group = init_custom_process_group(
                meta.backend, meta.master_address, meta.master_port, rank, meta.world_size, meta.group_name
            )
            self._group_backend = meta.backend

        threading.Thread(target=_complete, args=(fut, join), name="weight-group-join", daemon=True).start()
        return fut

    def destroy_weights_update_group(self) -> None:
        self._group = None

    def check_param_specs(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> None:
        """Raise ValueError when a broadcast announcement does not fit the model."""
        assert self.model is not None
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}")
        params = self.model.state_dict()
        for name, dtype, shape in zip(names, dtypes, shapes):
            _dtype_of(dtype)
            if name not in params:
                raise ValueError(f"unknown parameter {name!r}")
            if tuple(shape) != tuple(params[name].shape):
                raise ValueError(f"parameter {name!r} has shape {tuple(params[name].shape)}, got {tuple(shape)}")

    def receive_broadcast(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], version: int | None
    ) -> None:
        """Receive the announced tensors from rank 0 in order, then load them (blocking)."""
        if self._group is None:
            raise ValueError("no weight-update group: call init_weights_update_group first")
        self.check_param_specs(names, dtypes, shapes)
        # gloo moves CPU tensors, nccl CUDA tensors, whatever device the model is on.
        device = "cuda" if self._group_backend == "nccl" else "cpu"
        received = []
        for name, dtype, shape in zip(names, dtypes, shapes):
            t = torch.empty(tuple(shape), dtype=_dtype_of(dtype), device=device)
            self._group.broadcast(t, src=0)
            received.append((name, t))
        self._run_in_scheduler(lambda: self._load_tensors(received, version)).result()

    def update_weights(self, meta: WeightUpdateMeta) -> Future[None]:
        if meta.type == "in_process":
            if meta.named_tensors is None:
                raise ValueError("an in_process weight update needs named_tensors")
            tensors = dict(meta.named_tensors)
            return self._run_in_scheduler(lambda: self._load_tensors(tensors.items(), meta.version))
        if meta.type == "disk":
            return self.load_weights_from_disk(meta.path or "", meta.version)
        specs = list(meta.param_specs)
        fut: Future[None] = Future()

        def receive() -> None:
            self.receive_broadcast(
                [s.name for s in specs], [s.dtype for s in specs], [list(s.shape) for s in specs], meta.version
            )

        threading.Thread(target=_complete, args=(fut, receive), name="weight-receive", daemon=True).start()
        return fut

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        assert self.model is not None
        params = self.model.state_dict()
        if name not in params:
            raise ValueError(f"unknown parameter {name!r}")
        return params[name].detach().flatten()[:truncate_size].float().tolist()

    def set_version(self, version: int) -> None:
        self._version = version

    def get_version(self) -> int:
        return self._version

    def pause(self) -> None:
        """Freeze running requests in place (their caches are recomputed if weights change)."""
        self.pause_generation("in_place")

    def resume(self) -> None:
        self.continue_generation()


__all__ = ["GenerationError", "GenerationResult", "LocalInferenceEngine", "SamplingParams"]
