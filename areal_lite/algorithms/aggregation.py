"""Aggregation: a per-token loss ``[T]`` to a scalar, and the micro-batch weight under which
micro-batch losses combine into the same value as aggregating the whole batch at once.

Losses over an empty mask are 0, not NaN, so a micro-batch with no trained token is harmless.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from areal_lite.algorithms.packed import masked_mean, seq_mean, seq_sum


def token_mean(loss: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Mean over all masked tokens of the batch (long sequences weigh more)."""
    return masked_mean(loss, mask)


def seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Mean over sequences of each sequence's token mean (GRPO's original 1/|o_i| normalisation);
    sequences without a masked token do not count."""
    n = seq_sum(mask.to(loss.dtype), cu_seqlens)
    return seq_mean(loss, mask, cu_seqlens).sum() / (n > 0).sum().clamp(min=1)


def seq_mean_token_sum(loss: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Mean over sequences of each sequence's token sum (Dr. GRPO, Liu et al. 2025, eq. 3: no
    length normalisation); sequences without a masked token do not count."""
    m = mask.to(loss.dtype)
    n = seq_sum(m, cu_seqlens)
    return seq_sum(loss * m, cu_seqlens).sum() / (n > 0).sum().clamp(min=1)


def count_tokens(mask: torch.Tensor, cu_seqlens: torch.Tensor) -> float:
    """Weight of a micro-batch under `token_mean`: its masked tokens."""
    return float(mask.sum())


def count_sequences(mask: torch.Tensor, cu_seqlens: torch.Tensor) -> float:
    """Weight of a micro-batch under the sequence means: its sequences with a masked token."""
    return float((seq_sum(mask.to(torch.float32), cu_seqlens) > 0).sum())


class Aggregation(NamedTuple):
    """A loss aggregation and the micro-batch weight under which micro-batch losses combine into
    the same value as aggregating the whole batch at once."""

    reduce: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    weight: Callable[[torch.Tensor, torch.Tensor], float]
