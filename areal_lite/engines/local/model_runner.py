"""The embedded engine's model runner: batched prefill and decode over a slot-based KV cache.

It calls the HF model's own modules (embeddings, norms, projections, MLPs, LM head) but runs
attention itself over a slot-based KV cache (row ``i`` of the cache belongs to the ``i``-th
running request; finished rows are refilled from the tail), with per-row positions and one
additive mask per step. This needs the Llama layer layout, shared by the supported
``model_type``s (llama, qwen2, qwen3, mistral, the mixture-of-experts qwen3_moe, qwen2_moe,
mixtral, and the decoders of the vision-language qwen2_vl and qwen2_5_vl); the numerics are those of
the HF forward (same modules, same rotary tables), so reported log-probabilities equal a HF forward
of the same tokens to float tolerance.

A vision-language model's request may carry images (`areal_lite.engines.local.images`): at its
prefill the vision tower's features replace its image tokens' embeddings and its tokens are rotated
by their multimodal positions (`areal_lite.engines.local.rotary`); its decode steps are at its
cache length plus the row's offset ``delta`` (also inside the decode graphs). Rows with and without
images share every pass.

A mixture-of-experts block runs as the HF module; the experts each cached position went to are
recorded beside the KV cache (`areal_lite.engines.local.expert_routes`), and a finished request
takes its own with it (`routes_of`) for routing replay in the train engine.

Each pass ends with a token sampled for each row (`areal_lite.engines.local.sampling`); reported
log-probabilities are those of the policy itself (temperature 1, before top-p/top-k/min-p,
min-token suppression, logit biases and penalties: `areal_lite.engines.local.shaping`), as the train
engine recomputes them. The model is loaded by `areal_lite.engines.local.model_loading`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from itertools import pairwise
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from areal_lite.cpu import engine_kernels
from areal_lite.engines.local.decode_graphs import DecodeGraphs
from areal_lite.engines.local.expert_routes import ExpertRoutes
from areal_lite.engines.local.fused_weights import fuse_layer, fused_views
from areal_lite.engines.local.images import ImageInputs, VisionTower
from areal_lite.engines.local.kv_cache import KVCache
from areal_lite.engines.local.packed_linears import PackedLinears
from areal_lite.engines.local.request import Sequence
from areal_lite.engines.local.rotary import RotaryTables
from areal_lite.engines.local.sampling import (
    choose_plain,
    choose_tokens,
    graph_mode,
    record_chosen,
    record_tokens,
)
from areal_lite.utils import flash_varlen
from areal_lite.utils.moe import routing_shape
from areal_lite.utils.vision import is_vision_config

if TYPE_CHECKING:
    from areal_lite.api.config import CPUConfig

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = (
    "llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "qwen2_moe", "mixtral", "qwen2_vl", "qwen2_5_vl",
)  # fmt: skip
PREFILL_TOKENS = 16 * 1024
"""A batched prefill is split when its distinct sequences hold more tokens than this."""


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A HF RMSNorm module's computation in one fused op."""
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class ModelRunner:
    """The model, its slot-based KV cache and batched prefill / decode / sampling.

    Used only from the scheduler thread. Row ``i`` of the cache holds the ``i``-th running
    sequence; ``lens[i]`` tokens of it are cached and ``last[i]`` is the sampled token not yet fed.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        max_rows: int,
        context_len: int,
        seed: int,
        cuda_graphs: bool = False,
        cpu: CPUConfig | None = None,
    ) -> None:
        cfg = model.config.get_text_config()
        rope_type = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
        if "dynamic" in rope_type:
            # Rotary tables are computed once for all positions; dynamic scaling depends on length.
            raise ValueError(f"the embedded engine does not support rope_type {rope_type!r}")
        model_type = model.config.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"the embedded engine supports model types {SUPPORTED_MODEL_TYPES}, got {model_type!r}")
        self.model = model
        self.vision = VisionTower(model) if is_vision_config(model.config) else None
        """The vision tower of a vision-language model (None for a text model)."""
        self.base = model.model.language_model if self.vision is not None else model.model
        self.layers = list(self.base.layers)
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.scaling = attn.scaling
        self.has_qk_norm = hasattr(attn, "q_norm")
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.linear = PackedLinears(self.device, self.dtype)
        self.max_rows = max_rows
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.context_len = context_len
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.rotary = RotaryTables(self.base.rotary_emb, context_len, self.device, self.dtype)
        kernels = engine_kernels(self.device, self.dtype, self.head_dim, self.n_heads // self.n_kv, cpu)
        self.decode_attention = kernels.attention
        """The compiled decode attention (CPU, fp32 or bf16), None where it is unavailable:
        then decode attention is two batched matmuls."""
        self.ops = kernels.ops
        """The compiled residual add and norm, rotary embedding and SiLU product (CPU, fp32 or
        bf16), None where they are unavailable: then torch ops."""
        self.silu = getattr(cfg, "hidden_act", None) in ("silu", "swish")
        """Whether the MLPs' activation is SiLU (the fused product's)."""
        self.cache = KVCache(
            len(self.layers), max_rows, self.n_kv, self.head_dim, kernels.block, context_len, self.dtype, self.device
        )
        self.lens = torch.zeros(max_rows, dtype=torch.long, device=self.device)
        self.host_lens = [0] * max_rows
        """``lens`` as the host knows it, kept in step with it: sizing the cache, removing rows and
        taking a row's routes need no read from the device."""
        self.last = torch.zeros(max_rows, dtype=torch.long, device=self.device)
        self.delta = torch.zeros(max_rows, dtype=torch.long, device=self.device) if self.vision else None
        """A vision-language model's rows: each row's rotary position minus its cache length
        (`ImageInputs.delta`; 0 for a prompt without images). None for a text model."""
        self.sample_on_device = self.device.type == "cuda"
        """Choose plain rows' tokens as the decode graph does, in eager steps too: on a GPU each
        check `choose_tokens` makes waits for the device (on CPU the lazy checks cost less)."""
        self.uniforms = torch.zeros(max_rows, 1, dtype=torch.float64, device=self.device)
        """This step's uniforms for rows sampled inside the decode graph (drawn before the replay
        from ``generator``, as `choose_tokens` draws them)."""
        self.rows: list[Sequence] = []
        self.route_shape = routing_shape(cfg)
        """(layers, top_k) of a mixture-of-experts model, else None (nothing recorded)."""
        shape = self.route_shape
        self.routes = None if shape is None else ExpertRoutes(self.layers, shape, max_rows, self.device)
        self._ensure_capacity(min(256, context_len))
        self.fused = [fuse_layer(layer) for layer in self.layers]
        self.fused_views = [fused_views(layer) for layer in self.layers]
        """Per layer, the parameters that are views of its fused q/k/v and gate/up weights."""
        self.graphs = (
            self.decode_graphs() if cuda_graphs and self.device.type == "cuda" and self.route_shape is None else None
        )
        """Decode steps replayed as CUDA graphs (``cuda_graphs``, on CUDA, dense models: a
        mixture-of-experts block's routing hooks run Python per pass), else None."""

    def _lm_head(self, h: torch.Tensor) -> torch.Tensor:
        head = self.model.lm_head
        if type(head) is torch.nn.Linear:
            return self.linear(h, head.weight, head.bias)
        return head(h)  # a wrapped head (an adapter's): as the model runs it

    @property
    def cap(self) -> int:
        """Positions each cache row can hold now."""
        return self.cache.cap

    def _ensure_capacity(self, needed: int) -> None:
        """Grow the cache (and a mixture-of-experts model's routes beside it) to ``needed`` positions."""
        old = self.cache.cap
        if self.cache.grow(needed) and self.routes is not None:
            self.routes.grow(old, self.cache.cap)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + _rotate_half(x) * sin

    def _layers_forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run every decoder layer on the tokens ``ids`` [N] at ``positions`` ([N], or [N, 3]
        multimodal ones), token-major: ``attend(layer, q, k, v)`` gets [N, heads, D] queries and
        [N, kv heads, D] keys and values, stores the keys and values in the cache and returns the
        attention output [N, heads, D]. ``embeds``: the input embeddings [N, H] where they are not
        the tokens' own (image features in place). Returns the final hidden states [N, H]. The
        routers' hooks capture this pass's routes (`ExpertRoutes.record` writes them)."""
        if self.routes is not None:
            self.routes.start_pass()
        n = ids.shape[0]
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        embeds = self.base.embed_tokens(ids) if embeds is None else embeds
        h, x = self._add_norm(embeds, None, self.layers[0].input_layernorm)
        cos, sin, index = self.rotary.rows(positions)
        fused_rope = self.ops is not None and not self.has_qk_norm
        if fused_rope and n and int(index.max()) >= cos.shape[0]:
            # The compiled rotary reads the tables unchecked (torch's indexing would raise).
            raise IndexError(f"position {int(index.max())} is past the rotary tables ({cos.shape[0]})")
        rotary = None if fused_rope else (cos[index][:, None], sin[index][:, None])
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            w_qkv, b_qkv, w_gate_up, b_gate_up = self.fused[i]
            qkv_views, gate_up_views = self.fused_views[i]
            qkv = self.linear(x, w_qkv, b_qkv, qkv_views)
            if rotary is None:
                assert self.ops is not None
                q, k, v = self.ops.rope_split(qkv, cos, sin, index, nh, nkv)
            else:
                qk, v = qkv.view(n, nh + 2 * nkv, hd).split([nh + nkv, nkv], dim=1)
                if self.has_qk_norm:
                    qk = torch.cat([attn.q_norm(qk[:, :nh]), attn.k_norm(qk[:, nh:])], dim=1)
                # Rotary embedding on queries and keys in one go.
                q, k = self._rope(qk, *rotary).split([nh, nkv], dim=1)
            o = attend(i, q, k, v)
            o = self.linear(o.reshape(n, nh * hd), attn.o_proj.weight, attn.o_proj.bias)
            h, x = self._add_norm(h, o, layer.post_attention_layernorm)
            if w_gate_up is None:
                out = mlp(x[None])[0]
            else:
                gate_up = self.linear(x, w_gate_up, b_gate_up, gate_up_views)
                if self.ops is not None and self.silu:
                    act = self.ops.silu_mul(gate_up)
                else:
                    gate, up = gate_up.chunk(2, dim=-1)
                    act = mlp.act_fn(gate) * up
                out = self.linear(act, mlp.down_proj.weight, mlp.down_proj.bias)
            after = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.base.norm
            h, x = self._add_norm(h, out, after)
        return x

    def _add_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, norm: torch.nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream ``h + delta`` (``h`` for None) and its RMS norm by ``norm``; the
        fused ops add into ``h`` in place."""
        if self.ops is not None:
            return h, self.ops.add_rms_norm(h, delta, norm.weight, norm.variance_epsilon)
        h = h if delta is None else h + delta
        return h, _rms_norm(norm, h)

    def routes_of(self, row: int) -> torch.Tensor | None:
        """The routes [cached positions, layers, top_k] (int32, CPU) of running row ``row``; None
        for a dense model."""
        return None if self.routes is None else self.routes.of(row, self.host_lens[row])

    @staticmethod
    def prefill_tokens(s: Sequence) -> list[int]:
        """What a new row caches: the prompt, and for a sequence with output (re-prefilled after a
        weight update or a retract) all but its last token, which becomes the next one fed."""
        return s.prompt + s.out[:-1] if s.out else s.prompt

    @staticmethod
    def prefill_key(s: Sequence) -> tuple[tuple[int, ...], bytes]:
        """What rows share one prefill by: their `prefill_tokens` and their images' key."""
        return tuple(ModelRunner.prefill_tokens(s)), s.images.key if s.images is not None else b""

    def _chunks(self, seqs: list[Sequence]) -> list[list[Sequence]]:
        """``seqs`` cut so that no pass prefills more than `PREFILL_TOKENS` distinct tokens (which
        bounds its activations), shortest and longest apart."""
        distinct = {self.prefill_key(s) for s in seqs}
        if len(distinct) <= 1 or sum(len(t) for t, _ in distinct) <= PREFILL_TOKENS:
            return [seqs] if seqs else []
        ordered = sorted(seqs, key=lambda s: len(self.prefill_tokens(s)))
        half = len(ordered) // 2
        return self._chunks(ordered[:half]) + self._chunks(ordered[half:])

    @torch.no_grad()
    def prefill(self, seqs: list[Sequence]) -> list[Sequence]:
        """Add ``seqs`` as new rows and fill their cache. A sequence without output yet gets its
        first token sampled (returned); one with output (re-prefilled after a weight update or a
        retract) caches all but its last token, which becomes the next one fed."""
        return [s for chunk in self._chunks(seqs) for s in self._pass(0, chunk)]

    @torch.no_grad()
    def decode(self) -> None:
        """One decode step for every row: feed ``last``, sample the next token of each row."""
        if self.rows:
            self._pass(len(self.rows), [])

    @torch.no_grad()
    def step(self, admitted: list[Sequence]) -> list[Sequence]:
        """A decode step for every running row and the prefill of ``admitted`` (as `prefill`), in
        one forward pass: every row that was running gets its next token, every admitted sequence
        without output its first (these are returned).

        One pass instead of a prefill pass and a decode pass: the projections and MLPs read their
        weights once for both, and their matrix products see the decode rows and the prompt
        tokens together (with requests arriving one by one, a prefill pass per arrival would read
        the whole model again each time)."""
        running = len(self.rows)
        chunks = self._chunks(admitted)
        if not running and not chunks:
            return []
        # Chunks beyond one pass's budget are prefilled alone first; their rows (after the
        # running ones) are not decoded in this step.
        fresh = [s for chunk in chunks[:-1] for s in self._pass(0, chunk)]
        return fresh + self._pass(running, chunks[-1] if chunks else [])

    def _pass(self, d: int, seqs: list[Sequence]) -> list[Sequence]:
        """One forward pass: feed ``last`` to rows ``0..d-1`` (decode) and prefill ``seqs`` as new
        rows at the end. Returns the sequences of ``seqs`` that got their first token.

        The distinct prefill sequences run packed after the decode tokens (no padding: the
        projections and MLPs, most of the FLOPs, see only real tokens), with causal attention per
        sequence. Rows with the same tokens (the samples of a GRPO group) share one sequence, which
        fills each row's cache and gives each row its own first sample: prompts are most of the
        tokens a group costs when completions are short."""
        first_of: dict[tuple[tuple[int, ...], bytes], int] = {}
        inverse = [first_of.setdefault(self.prefill_key(s), len(first_of)) for s in seqs]
        lengths = [len(t) for t, _ in first_of]
        images = {inverse[j]: s.images for j, s in enumerate(seqs) if s.images is not None}
        start = len(self.rows)
        dev = self.device
        ar = torch.arange(d, device=dev)
        pos_d = self.lens[:d].clone()
        lens_d = pos_d + 1  # positions each decode row attends to, its new one included
        rot_d = pos_d if self.delta is None else pos_d + self.delta[:d]  # their rotary positions
        needed = max(self.host_lens[:d]) + 1 if d else 0
        self._ensure_capacity(max([needed, *(n + 1 for n in lengths)]))
        if d and not seqs and self.graphs is not None:
            return self._decode_static(d)
        offsets = [d]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        ids = torch.tensor([t for u, _ in first_of for t in u], dtype=torch.long, device=dev)
        ids = torch.cat([self.last[:d], ids]) if d else ids
        if lengths:  # one copy of every prefill position, not a kernel per sequence
            prefill_pos = torch.tensor([p for n in lengths for p in range(n)], dtype=torch.long, device=dev)
            pos = torch.cat([rot_d, prefill_pos]) if d else prefill_pos
        else:
            pos = rot_d
        embeds = None
        if images:
            assert self.vision is not None
            pos = self._multimodal_positions(pos, [(offsets[u], offsets[u + 1], inp) for u, inp in images.items()])
            embeds = self.vision.embed(self.base.embed_tokens(ids), [(offsets[u], inp) for u, inp in images.items()])
        rows_of: list[list[int]] = [[] for _ in lengths]
        for j, u in enumerate(inverse):
            rows_of[u].append(start + j)
        cache = self.cache
        # Every distinct prompt in one varlen call where torch has one (CUDA), its keys and values
        # scattered into every row that shares it: not a call and a copy per sequence and row.
        packed = cache.packed_prefill(offsets, rows_of) if lengths and flash_varlen.available(dev, self.dtype) else None
        gqa = self.n_kv != self.n_heads
        kernel = self.decode_attention
        mask = cache.decode_mask(pos_d, needed) if d and kernel is None else None

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            outs = []
            if d and kernel is not None:
                outs.append(kernel(q[:d], k[:d], v[:d], cache.k[i], cache.v[i], lens_d, self.scaling))  # writes k, v
            elif d:
                assert mask is not None
                outs.append(cache.attend_decode(i, q[:d], k[:d], v[:d], ar, pos_d, mask, self.scaling))
            if packed is not None:
                cache.scatter(i, k[d:], v[d:], packed)
                outs.append(flash_varlen.varlen_causal(q[d:], k[d:], v[d:], packed[0], packed[1], self.scaling))
                return torch.cat(outs) if len(outs) > 1 else outs[0]
            for u, (a, e) in enumerate(pairwise(offsets)):
                cache.fill(i, rows_of[u], k[a:e], v[a:e])
                o = F.scaled_dot_product_attention(
                    *(x[a:e].transpose(0, 1)[None] for x in (q, k, v)),
                    is_causal=True,
                    scale=self.scaling,
                    enable_gqa=gqa,
                )
                outs.append(o[0].transpose(0, 1))
            return torch.cat(outs) if len(outs) > 1 else outs[0]

        decoding = self.rows[:d]
        h = self._layers_forward(ids, pos, attend, embeds)
        if self.routes is not None:
            self.routes.record(ids.shape[0], ar, pos_d, list(pairwise(offsets)), rows_of)
        if d:
            self._advance(d)
        self.rows.extend(seqs)
        if seqs:
            cached = [lengths[u] for u in inverse]
            self.lens[start : start + len(seqs)] = torch.tensor(cached, device=dev)
            self.host_lens[start : start + len(seqs)] = cached
            if self.delta is not None:
                deltas = [s.images.delta if s.images is not None else 0 for s in seqs]
                self.delta[start : start + len(seqs)] = torch.tensor(deltas, device=dev)
        fresh = [j for j, s in enumerate(seqs) if not s.out]
        for j, s in enumerate(seqs):
            if s.out:
                self.last[start + j] = s.out[-1]
            if s.want_input_logprobs and s.input_logprobs is None:
                a, e = offsets[inverse[j]], offsets[inverse[j] + 1]
                logp = torch.log_softmax(self._lm_head(h[a : e - 1]).float(), dim=-1)
                s.input_logprobs = [None] + logp.gather(1, ids[a + 1 : e, None])[:, 0].tolist()
                if s.params.top_logprobs:
                    values, top_ids = logp.topk(min(s.params.top_logprobs, logp.shape[-1]), dim=-1)
                    s.input_top = [None] + [list(zip(i, v)) for i, v in zip(top_ids.tolist(), values.tolist())]
        if d or fresh:
            # The decode rows' hidden states and each fresh sequence's last prompt position.
            at = list(range(d)) + [offsets[inverse[j] + 1] - 1 for j in fresh]
            rows = torch.cat([ar, torch.tensor([start + j for j in fresh], dtype=torch.long, device=dev)])
            logits = self._lm_head(h if at == list(range(h.shape[0])) else h[at]).float()
            self._sample_and_append(logits, decoding + [seqs[j] for j in fresh], rows)
        return [seqs[j] for j in fresh]

    @staticmethod
    def _multimodal_positions(pos: torch.Tensor, spans: list[tuple[int, int, ImageInputs]]) -> torch.Tensor:
        """A pass's positions [N] as multimodal ones [N, 3] (the three parts equal) with the
        tokens ``a:e`` of each span at their images' positions."""
        pos3 = pos[:, None].repeat(1, 3)
        for a, e, inp in spans:
            pos3[a:e] = inp.positions_of(e - a).to(pos3.device)
        return pos3

    def decode_graphs(self, eager: bool = False) -> DecodeGraphs:
        """`DecodeGraphs` of this runner's `static_decode_step` (``eager``: run, not captured)."""
        return DecodeGraphs(self.static_decode_step, lambda: self.cap, self.max_rows, self.device, eager)

    def static_decode_step(self, rows: int, mode: str) -> torch.Tensor:
        """A static decode step (`static_decode_logits`) and, unless ``mode`` is ``logits``, the
        choice of each row's token inside it (`graph_mode`: all rows greedy, or all sampled as
        the policy stands from ``uniforms``): the step returns ``[rows, 2]`` float64 (token,
        log-probability; NaN where the probabilities were not finite), so that the host reads one
        small tensor a step. It leaves ``last`` as it was (a capture runs the step more than once):
        the caller feeds the tokens back."""
        logits = self.static_decode_logits(rows)
        if mode == "logits":
            return logits
        return choose_plain(logits, torch.softmax(logits, dim=-1), mode, self.uniforms[:rows])

    def static_decode_logits(self, rows: int) -> torch.Tensor:
        """fp32 logits [rows, vocab] of a decode step of cache rows ``0..rows-1`` (``rows`` may
        exceed the running count: the rows past it are unused slots), every shape fixed by
        ``rows`` and the cache capacity, nothing read back to the host: what `DecodeGraphs`
        records. Feeds ``last``, writes each row's keys and values at ``lens`` (clamped into the
        cache for unused slots, whose entries the next prefill there overwrites) and attends over
        the whole capacity, masked past each row's length. Leaves ``lens`` as it was."""
        ar = torch.arange(rows, device=self.device)
        pos = self.lens[:rows].clamp(max=self.cap - 1)
        mask = self.cache.decode_mask(pos, self.cap)
        rotated = pos if self.delta is None else pos + self.delta[:rows]
        h = self._layers_forward(
            self.last[:rows],
            rotated,
            lambda i, q, k, v: self.cache.attend_decode(i, q, k, v, ar, pos, mask, self.scaling),
        )
        return self._lm_head(h).float()

    def _decode_static(self, d: int) -> list[Sequence]:
        """A decode step of the ``d`` running rows through `graphs` (see `DecodeGraphs`); if its
        capture fails, this and every later step run as before."""
        assert self.graphs is not None
        seqs = self.rows[:d]
        mode = graph_mode(seqs)
        if mode == "sample":
            torch.rand((d, 1), generator=self.generator, dtype=torch.float64, device=self.device, out=self.uniforms[:d])
        try:
            out = self.graphs.run(d, mode)
        except RuntimeError:
            logger.warning("the decode step could not be captured as a CUDA graph; running it eagerly", exc_info=True)
            self.graphs = None
            return self._pass(d, [])
        self._advance(d)
        if mode == "logits":
            self._sample_and_append(out, seqs, torch.arange(d, device=self.device))
        else:
            self.last[:d] = out[:, 0].long()
            record_chosen(seqs, out.tolist(), self.vocab_size)
        return []

    def _advance(self, d: int) -> None:
        """One more cached position for each of rows ``0..d-1``."""
        self.lens[:d] += 1
        for i in range(d):
            self.host_lens[i] += 1

    def _sample_and_append(self, logits: torch.Tensor, seqs: list[Sequence], rows: torch.Tensor) -> None:
        """Sample one token per row of ``logits`` [n, V] (fp32) and record it with its logprob."""
        # The policy's probabilities (temperature 1, nothing suppressed): the log of the chosen
        # token's is its reported log-probability. One softmax serves that and, for rows
        # sampled as the policy stands (the common case), the sampling too, where a log-softmax
        # besides cost one more pass over the vocabulary and one more [n, V] buffer per step.
        policy = torch.softmax(logits, dim=-1)
        mode = graph_mode(seqs) if self.sample_on_device else "logits"
        if mode != "logits":
            # As the decode graph chooses (`static_decode_step`): one read back instead of a
            # synchronising check per step of `choose_tokens` / `record_tokens`.
            g, dev = self.generator, self.device
            u = torch.rand((len(seqs), 1), generator=g, dtype=torch.float64, device=dev) if mode == "sample" else None
            chosen = choose_plain(logits, policy, mode, u)
            self.last[rows] = chosen[:, 0].long()
            record_chosen(seqs, chosen.tolist(), self.vocab_size)
            return
        tokens = choose_tokens(logits, policy, seqs, self.generator)
        self.last[rows] = tokens
        record_tokens(seqs, tokens, logits, policy)

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
            width = max(self.host_lens[:b]) + 1
            self.cache.move(dst, src, width)
            if self.routes is not None:
                self.routes.move(dst, src, width)
            self.lens[dst] = self.lens[src]
            self.last[dst] = self.last[src]
            if self.delta is not None:
                self.delta[dst] = self.delta[src]
            for h_, s_ in zip(holes, sources):
                self.host_lens[h_] = self.host_lens[s_]
            for h_, s_ in zip(holes, sources):
                self.rows[h_] = self.rows[s_]
        del self.rows[keep:]
        if self.delta is not None:
            self.delta[keep:b] = 0  # a free row's decode-graph positions stay within the tables

    def clear(self) -> list[Sequence]:
        """Forget every row (their caches); returns the sequences that were running."""
        seqs, self.rows = self.rows, []
        if self.delta is not None:
            self.delta.zero_()
        return seqs
