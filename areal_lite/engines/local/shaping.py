"""What a request's sampling options do to the logits before the engine draws a token, in vLLM's
order (its ``Sampler``): a grammar's mask (`areal_lite.engines.local.grammar`), min-token suppression, logit bias, then the repetition, frequency and
presence penalties (`shaped`); greedy rows take the argmax of that; the others are divided by
their temperature, then min-p drops the unlikely tokens (`min_p_masked`), then top-k / top-p
(`top_k_top_p_masked`). SGLang applies the same options with the same formulas; it adds the
frequency and presence penalties before the repetition penalty, which differs only for a request
that sets both kinds.

None of this touches the log-probabilities the engine reports, which stay the policy's own
(temperature 1, nothing suppressed or penalized), as vLLM's default ``raw_logprobs`` are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from areal_lite.engines.local import grammar

if TYPE_CHECKING:
    from areal_lite.engines.local.request import SamplingParams, Sequence


def suppressing(s: Sequence) -> bool:
    """Whether ``s`` may not end yet: fewer than ``min_new_tokens`` tokens out."""
    return bool(s.stop_ids) and len(s.out) < s.params.min_new_tokens


def shaped(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """``logits`` [n, V] (fp32, one row per sequence) after each row's grammar mask, min-token
    suppression, logit bias and penalties: ``logits`` itself when no row has any, else a changed copy."""
    rows = [j for j, s in enumerate(seqs) if suppressing(s) or s.params.reshapes_logits or s.matcher is not None]
    if not rows:
        return logits
    out = logits.clone()
    constrained = [j for j in rows if seqs[j].matcher is not None]
    if constrained:
        grammar.mask(out, seqs, constrained)
    for j in rows:
        _shape_row(out[j], seqs[j])
    return out


def _shape_row(row: torch.Tensor, s: Sequence) -> None:
    """Apply one sequence's suppression, bias and penalties to its row [V], in place."""
    p, device = s.params, row.device
    if suppressing(s):
        row[list(s.stop_ids)] = float("-inf")
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), device=device)
        row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=device))
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(s.prompt + s.out, device=device).unique()
        values = row[seen]
        row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and s.out:
        ids, counts = torch.tensor(s.out, device=device).unique(return_counts=True)
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty


def min_p_masked(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``scores`` [n, V] (after temperature) with each row's tokens less likely than its
    ``min_p`` times its most likely token's probability set to -inf (``scores`` itself when no
    row has a ``min_p``)."""
    if not any(p.min_p > 0 for p in params):
        return scores
    probs = torch.softmax(scores, dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * torch.tensor([p.min_p for p in params], device=scores.device)[:, None]
    return scores.masked_fill(probs < floor, float("-inf"))


def top_k_top_p_masked(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
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
