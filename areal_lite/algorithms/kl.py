"""KL estimators per token (Schulman 2020, "Approximating KL Divergence"), for a KL penalty in
the reward or the loss, and for measuring how far two policies are apart."""

from __future__ import annotations

from collections.abc import Callable

import torch


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = log pi - log pi_ref: unbiased for KL(pi || pi_ref) on tokens sampled from pi, high variance."""
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = (log pi - log pi_ref)^2 / 2: biased, low variance, always >= 0."""
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = (r - 1) - log r with r = pi_ref / pi: unbiased, low variance, always >= 0."""
    log_r = ref_logp - logp
    return torch.expm1(log_r) - log_r


KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
