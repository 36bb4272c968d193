"""The losses besides the policy losses: PPO's clipped value loss (a critic), the preference
losses of DPO and IPO, and supervised fine-tuning's negative log-likelihood."""

from __future__ import annotations

from collections.abc import Callable

import torch


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float | None = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss per token (as in OpenAI baselines' PPO2 and Ouyang et al. 2022):
    ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2)``; unclipped when ``eps_clip``
    is None. 0 outside the mask; statistic ``value_clip_frac``."""
    loss = (values - returns) ** 2
    clipped = torch.zeros_like(mask, dtype=torch.bool)
    if eps_clip is not None:
        v_clip = old_values + (values - old_values).clamp(-eps_clip, eps_clip)
        loss_clip = (v_clip - returns) ** 2
        clipped = loss_clip > loss
        loss = torch.maximum(loss, loss_clip)
    m = mask.to(values.dtype)
    return 0.5 * loss * m, {"value_clip_frac": clipped.float()}


def dpo_sigmoid_loss(
    chosen_logp: torch.Tensor,
    rejected_logp: torch.Tensor,
    ref_chosen_logp: torch.Tensor,
    ref_rejected_logp: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """DPO loss per pair ``[N]`` (Rafailov et al. 2023, eq. 7), from sequence log-probabilities.

    ``h = beta * ((log pi_c - log ref_c) - (log pi_r - log ref_r))``; loss
    ``= -(1 - ls) log sigmoid(h) - ls log sigmoid(-h)`` with label smoothing ``ls`` (conservative
    DPO, Mitchell 2023: the preference label is flipped with probability ``ls``).
    """
    h = beta * ((chosen_logp - ref_chosen_logp) - (rejected_logp - ref_rejected_logp))
    return -(1.0 - label_smoothing) * torch.nn.functional.logsigmoid(
        h
    ) - label_smoothing * torch.nn.functional.logsigmoid(-h)


def ipo_loss(
    chosen_logp: torch.Tensor,
    rejected_logp: torch.Tensor,
    ref_chosen_logp: torch.Tensor,
    ref_rejected_logp: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """IPO loss per pair ``[N]`` (Azar et al. 2023, eq. 17): ``(h - 1 / (2 beta))^2`` with
    ``h = (log pi_c - log ref_c) - (log pi_r - log ref_r)``; ``beta`` is the paper's tau. IPO has no
    label smoothing; the argument is accepted so both DPO losses share one signature, and must be 0."""
    if label_smoothing:
        raise ValueError("IPO has no label smoothing")
    h = (chosen_logp - ref_chosen_logp) - (rejected_logp - ref_rejected_logp)
    return (h - 1.0 / (2.0 * beta)) ** 2


PreferenceLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, float], torch.Tensor]


def sft_nll(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood per token, 0 outside the mask (aggregate with `token_mean`)."""
    return -logp * mask.to(logp.dtype)
