"""Attention over packed sequences, one sequence at a time, for transformers models on CPU.

Packed micro-batches hold many sequences in one row. transformers' built-in ``sdpa`` and
``eager`` attention see position ids restarting per sequence and build a block-diagonal causal
mask over the whole row, so attention costs ``T^2`` for ``T`` packed tokens. This attention
function instead runs ``scaled_dot_product_attention`` (causal, no mask) on each sequence's slice,
which costs ``sum(L_i^2)`` and cannot attend across sequences whatever the position ids. It is
what flash-attention's varlen kernel does on CUDA, written with PyTorch ops. When the sequences
are of similar length (padding them to the longest wastes at most ``PAD_WASTE`` x the work), they
are gathered into one padded batch and run as a single masked SDPA call instead: many short
sequences (RL completions on CPU) would otherwise cost one Python-level call each per layer.

On CPU, attention of bf16 or fp16 inputs is computed in fp32: PyTorch's CPU flash-attention
backward ran 14x slower in bf16 than in fp32 on 256 sequences of 12 tokens (and attention is a
small share of the FLOPs of short sequences).

It needs the sequence boundaries as the ``cu_seq_lens_q`` keyword that transformers forwards from
the model call to every attention layer (the name its flash-attention path uses). Registering
under a name that has no mask function also stops transformers from building the ``T x T`` mask.
A ``tree_branches`` keyword (``[T]``, `areal_lite.utils.shared_prefix`) makes the sequences trees
of a shared prefix and suffixes: attention stays causal but never crosses between suffixes.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from areal_lite.utils.shared_prefix import tree_attention_mask

VARLEN_SDPA = "areal_varlen_sdpa"
PAD_WASTE = 2.0
"""Largest ``B * max(L)^2 / sum(L^2)`` for which the padded single-call path is used."""


def varlen_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed sequence. ``query`` is ``[1, heads, T, dim]`` and
    ``key``/``value`` ``[1, kv_heads, T, dim]``; returns ``[1, T, heads, dim]`` as transformers
    expects."""
    bounds = kwargs.get("cu_seq_lens_q")
    if not isinstance(bounds, torch.Tensor) or query.shape[0] != 1:
        raise ValueError(f"{VARLEN_SDPA} attention needs one packed row and cu_seq_lens_q (packed forward only)")
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"{VARLEN_SDPA} attention does not implement sliding windows")
    gqa = query.shape[1] != key.shape[1]
    p = dropout if module.training else 0.0
    dtype = query.dtype
    if dtype in (torch.bfloat16, torch.float16) and query.device.type == "cpu":
        query, key, value = query.float(), key.float(), value.float()
    branches = kwargs.get("tree_branches")
    assert branches is None or isinstance(branches, torch.Tensor)
    cu = bounds.tolist()
    lens = [e - s for s, e in itertools.pairwise(cu)]
    if len(lens) > 1 and len(lens) * max(lens) ** 2 <= PAD_WASTE * sum(n * n for n in lens):
        out = _padded_sdpa(query, key, value, cu, lens, p, scaling, gqa, branches)
        return out.to(dtype).unsqueeze(0), None
    outs = [
        F.scaled_dot_product_attention(
            query[:, :, s:e],
            key[:, :, s:e],
            value[:, :, s:e],
            attn_mask=None if branches is None else tree_attention_mask(branches[s:e]),
            dropout_p=p,
            is_causal=branches is None,
            scale=scaling,
            enable_gqa=gqa,
        )
        for s, e in itertools.pairwise(cu)
    ]
    return torch.cat(outs, dim=2).transpose(1, 2).to(dtype).contiguous(), None


def _padded_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu: list[int],
    lens: list[int],
    dropout_p: float,
    scaling: float | None,
    gqa: bool,
    branches: torch.Tensor | None = None,
) -> torch.Tensor:
    """All sequences in one SDPA call over a ``[B, heads, max(L), dim]`` gather, with a causal (or
    tree) mask that also hides each sequence's padding keys (padding queries still see their
    sequence's first key, so no row is empty, and are dropped). Returns ``[T, heads, dim]`` in
    packed order."""
    device = query.device
    width = max(lens)
    pos = torch.arange(width, device=device)
    lens_t = torch.tensor(lens, device=device)
    valid = pos[None, :] < lens_t[:, None]  # [B, W]
    idx = (torch.tensor(cu[:-1], device=device)[:, None] + pos[None, :]).clamp(max=cu[-1] - 1)

    def gather(x: torch.Tensor) -> torch.Tensor:  # [1, h, T, d] -> [B, h, W, d]
        return x[0][:, idx].transpose(0, 1)

    if branches is None:
        mask = (pos[None, :] <= pos[:, None])[None] & valid[:, None, :]  # [B, W(query), W(key)]
    else:
        mask = tree_attention_mask(branches[idx]) & valid[:, None, :]
    out = F.scaled_dot_product_attention(
        gather(query), gather(key), gather(value), attn_mask=mask[:, None], dropout_p=dropout_p, scale=scaling, enable_gqa=gqa
    )
    return out.transpose(1, 2)[valid]


def register_varlen_sdpa() -> str:
    """Make ``attn_implementation=VARLEN_SDPA`` available to transformers; returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
    return VARLEN_SDPA
