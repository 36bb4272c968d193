"""Behaviour importance weights: staleness and the train-inference mismatch.

The tokens of a batch were sampled by the behaviour policy: the inference engine, possibly some
versions back. The proximal policy is the train engine's recomputation. Their ratio per token,
rho_t = pi_prox / pi_behav, corrects for both staleness and the numerical mismatch between the
two engines; the weights here differ only in what they do with a ratio far from 1.

Deliberate choices, where papers and implementations differ:
- The behaviour importance weight of decoupled PPO (Fu et al. 2025, AReaL, eq. 5) is capped as in
  AReaL's code: a token whose weight exceeds the cap is dropped from the loss (weight 0), not
  truncated to the cap.
- The sequence-level weights use the sequence's likelihood ratio (the product of its token
  ratios), as Seq-TIS and Seq-MIS define it, not GSPO's geometric mean. The truncating weights
  also take a lower bound (clamping into a band), which the TIS papers leave open.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from areal_lite.algorithms.kl import kl_k3
from areal_lite.algorithms.packed import masked_mean, seq_sum, to_tokens

ImportanceWeightFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``fn(prox_logp, behav_logp, mask, cu_seqlens) -> weight [T]`` (0 outside the mask), the band
bound with `functools.partial`; a policy loss takes one as ``importance_weight``."""


def behaviour_weight(
    prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor, cap: float | None
) -> torch.Tensor:
    """Decoupled PPO's behaviour importance weight ``pi_prox / pi_behav`` per token (Fu et al. 2025,
    eq. 5), 0 outside the mask and on tokens whose weight exceeds ``cap``: `token_mask_weight`
    with the band ``[0, cap]``."""
    return token_mask_weight(prox_logp, behav_logp, mask, torch.zeros(0), high=cap)


def _masked(w: torch.Tensor, mask: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    """``w`` where it lies in ``[low, high]`` (None: unbounded), 0 outside the band and the mask."""
    keep = mask.bool()
    if low is not None:
        keep = keep & (w >= low)
    if high is not None:
        keep = keep & (w <= high)
    return torch.where(keep, w, 0.0)


def _truncated(w: torch.Tensor, mask: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    """``w`` clamped into ``[low, high]`` (None: unbounded), 0 outside the mask."""
    clamped = w if low is None and high is None else w.clamp(min=low, max=high)
    return torch.where(mask.bool(), clamped, 0.0)


def sequence_log_ratio(
    prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """``log rho(y) = sum_t (log pi_prox - log pi_behav)`` over each sequence's masked tokens, ``[B]``:
    the log of the sequence's likelihood ratio, the product of its token ratios."""
    return seq_sum((prox_logp - behav_logp) * mask.to(prox_logp.dtype), cu_seqlens)


def _sequence_ratio(
    prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """``rho(y)`` of each sequence on every one of its tokens, ``[T]``."""
    return to_tokens(torch.exp(sequence_log_ratio(prox_logp, behav_logp, mask, cu_seqlens)), cu_seqlens)


def token_mask_weight(
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    low: float | None = None,
    high: float | None = None,
) -> torch.Tensor:
    """Masked importance sampling per token, IcePop (Ling Team 2025, "Every Step Evolves: Scaling
    RL for Trillion-Scale Thinking Model", the IcePop objective): ``rho_t`` where
    ``low <= rho_t <= high``, 0 where the ratio leaves the band (the token gets no gradient).
    The paper's band is ``[0.5, 5]``; ``low=None`` gives decoupled PPO's capped weight."""
    return _masked(torch.exp(prox_logp - behav_logp), mask, low, high)


def token_truncate_weight(
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    low: float | None = None,
    high: float | None = None,
) -> torch.Tensor:
    """Truncated importance sampling per token (TIS; Yao et al. 2025, "Your Efficient RL Framework
    Secretly Brings You Off-Policy RL Training", the weight ``min(rho_t, C)``): ``rho_t`` clamped
    into ``[low, high]`` (``high`` is C; ``low=None`` truncates only from above, as the paper)."""
    return _truncated(torch.exp(prox_logp - behav_logp), mask, low, high)


def sequence_mask_weight(
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    low: float | None = None,
    high: float | None = None,
) -> torch.Tensor:
    """Masked importance sampling per sequence (Seq-MIS; Liu, Li et al. 2025, "When Speed Kills
    Stability: Demystifying RL Collapse from the Training-Inference Mismatch", the weight
    ``rho(y) 1[rho(y) <= C]``): every masked token of a sequence carries the sequence ratio
    ``rho(y) = prod_t rho_t`` when ``low <= rho(y) <= high`` and 0 otherwise (IcePop's band at the
    sequence level)."""
    return _masked(_sequence_ratio(prox_logp, behav_logp, mask, cu_seqlens), mask, low, high)


def sequence_truncate_weight(
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    low: float | None = None,
    high: float | None = None,
) -> torch.Tensor:
    """Truncated importance sampling per sequence (Seq-TIS; Liu, Li et al. 2025, as
    `sequence_mask_weight`, the weight ``min(rho(y), C)``): every masked token of a sequence
    carries ``rho(y) = prod_t rho_t`` clamped into ``[low, high]``."""
    return _truncated(_sequence_ratio(prox_logp, behav_logp, mask, cu_seqlens), mask, low, high)


def resolve_behaviour_weight(
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cap: float | None,
    importance_weight: ImportanceWeightFn | None,
) -> torch.Tensor:
    """The behaviour weight a policy loss applies: ``importance_weight`` when given (its band
    replaces the cap, so passing both is an error), else `behaviour_weight` capped at ``cap``."""
    if importance_weight is None:
        return behaviour_weight(prox_logp, behav_logp, mask, cap)
    if cap is not None:
        raise ValueError("pass behav_imp_weight_cap or importance_weight (whose band replaces the cap), not both")
    return importance_weight(prox_logp, behav_logp, mask, cu_seqlens)


def mismatch_stats(train_logp: torch.Tensor, infer_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """How far the train engine's log-probabilities are from the inference engine's on the same
    tokens under the same weights: ``kl``, KL(pi_infer || pi_train) by the k3 estimator over the
    masked tokens (they were sampled from pi_infer), and ``max_abs_diff``, the largest
    ``|log pi_train - log pi_infer|``. Both 0 over an empty mask."""
    m = mask.bool()
    diff = (train_logp - infer_logp).abs()
    return {
        "kl": masked_mean(kl_k3(infer_logp, train_logp), m),
        "max_abs_diff": torch.where(m, diff, 0.0).amax() if diff.numel() else diff.new_zeros(()),
    }
