"""Attention over packed sequences, one sequence at a time, for transformers models on CPU.

Packed micro-batches hold many sequences in one row. transformers' built-in ``sdpa`` and
``eager`` attention see position ids restarting per sequence and build a block-diagonal causal
mask over the whole row, so attention costs ``T^2`` for ``T`` packed tokens. This attention
function instead runs ``scaled_dot_product_attention`` (causal, no mask) on each sequence's slice,
which costs ``sum(L_i^2)`` and cannot attend across sequences whatever the position ids. It is
what flash-attention's varlen kernel does on CUDA, written with PyTorch ops.

It needs the sequence boundaries as the ``cu_seq_lens_q`` keyword that transformers forwards from
the model call to every attention layer (the name its flash-attention path uses). Registering
under a name that has no mask function also stops transformers from building the ``T x T`` mask.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

VARLEN_SDPA = "areal_varlen_sdpa"


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
    cu = bounds.tolist()
    outs = [
        F.scaled_dot_product_attention(
            query[:, :, s:e],
            key[:, :, s:e],
            value[:, :, s:e],
            dropout_p=p,
            is_causal=True,
            scale=scaling,
            enable_gqa=gqa,
        )
        for s, e in itertools.pairwise(cu)
    ]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def register_varlen_sdpa() -> str:
    """Make ``attn_implementation=VARLEN_SDPA`` available to transformers; returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
    return VARLEN_SDPA
