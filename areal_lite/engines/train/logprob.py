"""Per-token log-probabilities and entropy from final hidden states, chunk by chunk.

A language model head turns ``[T, H]`` hidden states into ``[T, V]`` logits; for a long packed
batch and a large vocabulary those fp32 logits dominate memory. These functions materialise the
logits of at most ``chunk_size`` tokens at a time. With autograd on, each chunk whose logits take
more than `CHECKPOINT_MIN_BYTES` is checkpointed, so the backward pass recomputes one chunk's
logits at a time instead of keeping all of them; smaller ones (a tiny vocabulary) are kept, which
spares the recomputation. On CUDA the head is one autograd function instead
(`areal_lite.engines.train.fused_head`): no logits kept at all, and the full-vocabulary passes of
the log-softmax, the entropy and their gradients fused into one compiled pass each.

Shared by the train engines (FSDP and Megatron) so that both score tokens identically.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from areal_lite.cpu import trainer_linear
from areal_lite.engines.train.fused_head import head_logprobs

CHECKPOINT_MIN_BYTES = 256 << 20
"""A chunk's fp32 logits above this size are recomputed in the backward pass rather than kept.
At 16 MiB, SmolLM2's 49152-token vocabulary recomputed every chunk: a GRPO batch of 286 tokens
spent 1.67 s in the head's forward and backward instead of 1.57 (one thread, AVX-512 CPU); kept,
one chunk costs ~3x its logits (201 MiB for 1024 tokens of that vocabulary)."""


def _chunk_stats(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = trainer_linear(hidden, weight).float()
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - logz
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    probs = torch.softmax(logits, dim=-1)
    entropy = logz - (probs * logits).sum(dim=-1)
    return logp, entropy


def logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 1024,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(hidden @ weight.T)[t, labels[t]]`` for every row ``t``, in fp32.

    Args:
        hidden: ``[T, H]`` final hidden states (after the last norm).
        weight: ``[V, H]`` the output embedding (LM head) weight.
        labels: ``[T]`` int64 token ids to score.
        chunk_size: rows whose ``[chunk, V]`` logits exist at once.
        with_entropy: also return the entropy of each row's distribution.

    Returns ``(logprobs [T], entropy [T] or None)``, differentiable in ``hidden`` and ``weight``.
    No shifting happens here: callers pass the labels each row predicts.
    """
    if hidden.is_cuda:
        return head_logprobs(hidden, weight, labels, chunk_size=chunk_size, with_entropy=with_entropy)
    if hidden.ndim != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(f"expected hidden [T, H] and labels [T], got {tuple(hidden.shape)} and {tuple(labels.shape)}")
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    recompute = grad and min(chunk_size, hidden.shape[0]) * weight.shape[0] * 4 > CHECKPOINT_MIN_BYTES
    lps: list[torch.Tensor] = []
    ents: list[torch.Tensor] = []
    for start in range(0, hidden.shape[0], chunk_size):
        h = hidden[start : start + chunk_size]
        y = labels[start : start + chunk_size]
        if recompute:
            lp, ent = checkpoint(_chunk_stats, h, weight, y, with_entropy, use_reentrant=False)
        else:
            lp, ent = _chunk_stats(h, weight, y, with_entropy)
        lps.append(lp)
        ents.append(ent)
    if not lps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)


def align_to_tokens(next_token_values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Shift per-position values of a packed batch so that they are aligned to the token.

    ``next_token_values[t]`` describes the prediction made at position ``t`` for token ``t + 1``;
    the result at ``t`` describes the prediction of token ``t`` itself, and is 0 at each sequence
    start (no prediction produced the first token).
    """
    shifted = torch.roll(next_token_values, 1, dims=0)
    starts = torch.zeros(next_token_values.shape[0], dtype=torch.bool, device=next_token_values.device)
    starts.index_fill_(0, cu_seqlens[:-1].long().to(next_token_values.device), True)  # no read back, unlike []=
    return torch.where(starts, torch.zeros_like(shifted), shifted)


def next_token_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """The label each packed position predicts: the next token (wrapping at the end; the
    wrapped positions are sequence ends, whose prediction `align_to_tokens` discards)."""
    return torch.roll(input_ids, -1, dims=0)


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk_size: int,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-aligned log-probabilities of the packed ``tokens`` ``[T]`` and the entropies of the
    distributions they were drawn from (zeros without ``with_entropy``), from the final hidden
    states ``[T, H]`` and the head ``weight`` (`logprobs_from_hidden`, chunk by chunk)."""
    logp, entropy = logprobs_from_hidden(
        hidden, weight, next_token_labels(tokens), chunk_size=chunk_size, with_entropy=with_entropy
    )
    logp = align_to_tokens(logp, cu_seqlens)
    entropy = align_to_tokens(entropy, cu_seqlens) if entropy is not None else torch.zeros_like(logp)
    return logp, entropy


def token_values(scores: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A critic's token-aligned values ``[T]`` from its value head's ``[T, 1]`` scores, and zeros
    in place of entropies. The hidden state at t has read tokens[: t + 1]: it values the state in
    which token t + 1 is generated, so values are aligned to the token like log-probabilities."""
    values = align_to_tokens(scores.squeeze(-1).float(), cu_seqlens)
    return values, torch.zeros_like(values)
