"""Packed 1-D tensors: per-sequence sums, broadcasts and masked statistics.

Per-token tensors are ``[T]``: the real tokens of ``B`` sequences concatenated, with
``cu_seqlens`` (``[B+1]``) marking where each sequence starts, as in the packed-batch contract of
`areal_lite.api.engine`. ``mask`` is the loss mask (true on tokens the policy produced).
Per-sequence tensors are ``[B]``. The losses and advantages of `areal_lite.algorithms.functional`
are written over these helpers.
"""

from __future__ import annotations

import torch


def seq_lens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Length of each sequence, int64 ``[B]``."""
    return (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)


def seq_index(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Sequence index of each token, int64 ``[T]``."""
    lens = seq_lens(cu_seqlens)
    return torch.repeat_interleave(torch.arange(lens.numel(), device=cu_seqlens.device), lens)


def seq_sum(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Sum of a per-token tensor within each sequence, ``[B]`` (differentiable)."""
    b = cu_seqlens.numel() - 1
    return torch.zeros(b, dtype=x.dtype, device=x.device).index_add(0, seq_index(cu_seqlens), x)


def seq_mean(x: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Mean of a per-token tensor over each sequence's masked tokens, ``[B]``; 0 for a sequence
    without one (differentiable)."""
    m = mask.to(x.dtype)
    return seq_sum(x * m, cu_seqlens) / seq_sum(m, cu_seqlens).clamp(min=1)


def to_tokens(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Broadcast a per-sequence tensor ``[B]`` to every token of its sequence, ``[T]``."""
    return x[seq_index(cu_seqlens)]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over ``mask``; 0 for an empty mask."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Population variance of ``x`` over ``mask``; 0 for an empty mask."""
    m = mask.to(x.dtype)
    mean = masked_mean(x, mask)
    return (((x - mean) ** 2) * m).sum() / m.sum().clamp(min=1)


def masked_std(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Population standard deviation of ``x`` over ``mask``; 0 for an empty mask."""
    return masked_var(x, mask).sqrt()


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over ``mask``, 0 outside it (batch whitening)."""
    return (x - masked_mean(x, mask)) * torch.rsqrt(masked_var(x, mask) + eps) * mask.to(x.dtype)


def to_padded(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """A per-token tensor ``[T]`` as one right-padded row per sequence, ``[B, max length]`` (0 on
    padding)."""
    lens = seq_lens(cu_seqlens)
    width = int(lens.max()) if lens.numel() else 0
    out = torch.zeros((lens.numel(), width), dtype=x.dtype, device=x.device)
    out[torch.arange(width, device=x.device).unsqueeze(0) < lens.unsqueeze(1)] = x
    return out


def from_padded(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The inverse of `to_padded`: the real tokens of ``[B, W]`` rows, packed ``[T]``."""
    lens = seq_lens(cu_seqlens)
    return x[torch.arange(x.shape[1], device=x.device).unsqueeze(0) < lens.unsqueeze(1)]
