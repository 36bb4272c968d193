"""Policy losses: per-token loss ``[T]`` (0 outside the mask) and per-token statistics, on packed
1-D tensors (`areal_lite.algorithms.packed`).

Every policy loss takes ``(logp, prox_logp, behav_logp, advantages, mask, cu_seqlens)`` and its
hyper-parameters as keywords (bound with `functools.partial`, see `PolicyLossFn`), and applies the
behaviour importance weight of `areal_lite.algorithms.importance`: the capped one
(``behav_imp_weight_cap``) or a given ``importance_weight``. Aggregate the per-token loss with
`areal_lite.algorithms.aggregation`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from areal_lite.algorithms.importance import ImportanceWeightFn, behaviour_weight, resolve_behaviour_weight
from areal_lite.algorithms.kl import kl_k2
from areal_lite.algorithms.packed import seq_mean, to_tokens


def _clip(ratio: torch.Tensor, eps_clip: float, eps_clip_higher: float | None) -> torch.Tensor:
    """``ratio`` clamped into ``[1 - eps_clip, 1 + eps_clip_higher]`` (``eps_clip`` on both sides
    when ``eps_clip_higher`` is None)."""
    high = eps_clip if eps_clip_higher is None else eps_clip_higher
    return ratio.clamp(1.0 - eps_clip, 1.0 + high)


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_clip: float, eps_clip_higher: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic surrogate ``max(-A ratio, -A clip(ratio))`` per token, and where the
    clipped term is the larger (the token gets no gradient through the ratio)."""
    surr = -advantages * ratio
    surr_clipped = -advantages * _clip(ratio, eps_clip, eps_clip_higher)
    return torch.maximum(surr, surr_clipped), surr_clipped > surr


def ppo_policy_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    behav_imp_weight_cap: float | None = None,
    importance_weight: ImportanceWeightFn | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate per token (Schulman et al. 2017, eq. 7), decoupled.

    ``ratio = pi / pi_prox``; loss ``= w * max(-A ratio, -A clip(ratio, 1 - eps, 1 + eps_high))``
    with ``w`` the capped behaviour weight (`behaviour_weight`), or ``importance_weight`` instead
    (truncated or masked, per token or per sequence); pass ``prox_logp = behav_logp`` for
    standard PPO. ``eps_clip_higher`` is DAPO's clip-higher (Yu et al. 2025, eq. 10);
    ``c_clip > 1`` is dual clip (Ye et al. 2020, eq. 6), bounding the loss of a negative advantage
    by ``-c_clip * A``. Statistics: ``clip_frac`` and ``dual_clip_frac`` (0/1 per token), ``ratio``.
    """
    ratio = torch.exp(logp - prox_logp)
    loss, clipped = _clipped_surrogate(ratio, advantages, eps_clip, eps_clip_higher)
    dual = torch.zeros_like(clipped)
    if c_clip is not None:
        bound = -c_clip * advantages
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
    w = resolve_behaviour_weight(prox_logp, behav_logp, mask, cu_seqlens, behav_imp_weight_cap, importance_weight)
    stats = {"clip_frac": clipped.float(), "dual_clip_frac": dual.float(), "ratio": ratio.detach()}
    return loss * w, stats


def gspo_policy_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    eps_clip: float = 3e-4,
    eps_clip_higher: float | None = 4e-4,
    behav_imp_weight_cap: float | None = None,
    importance_weight: ImportanceWeightFn | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO's sequence-level clipped objective (Zheng et al. 2025, eq. 5-7), per token.

    ``s_i = exp(mean_t (log pi - log pi_prox))`` over the sequence's masked tokens; every masked
    token carries the sequence's loss ``max(-A_i s_i, -A_i clip(s_i, 1 - eps, 1 + eps_high))``
    (with ``seq-mean-token-mean`` aggregation this is exactly the paper's objective). ``A_i`` is
    the sequence's advantage, read at its masked tokens. The behaviour weight is the sequence's
    geometric mean of ``pi_prox / pi_behav``; sequences above the cap are dropped. An
    ``importance_weight`` replaces it (a sequence-level one keeps the loss per sequence).
    """
    s = to_tokens(torch.exp(seq_mean(logp - prox_logp, mask, cu_seqlens)), cu_seqlens)
    adv = to_tokens(seq_mean(advantages, mask, cu_seqlens), cu_seqlens)
    loss, clipped = _clipped_surrogate(s, adv, eps_clip, eps_clip_higher)
    if importance_weight is None:
        log_w = to_tokens(seq_mean(prox_logp - behav_logp, mask, cu_seqlens), cu_seqlens)
        w = behaviour_weight(log_w, torch.zeros_like(log_w), mask, behav_imp_weight_cap)
    else:
        w = resolve_behaviour_weight(prox_logp, behav_logp, mask, cu_seqlens, behav_imp_weight_cap, importance_weight)
    stats = {"clip_frac": clipped.float(), "ratio": s.detach()}
    return loss * w, stats


def reinforce_policy_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    behav_imp_weight_cap: float | None = None,
    importance_weight: ImportanceWeightFn | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE (Williams 1992): ``-w * A * log pi`` per token, ``w`` the capped behaviour weight
    or ``importance_weight`` (1 on-policy). Its gradient is the plain policy gradient; there is no
    trust region."""
    w = resolve_behaviour_weight(prox_logp, behav_logp, mask, cu_seqlens, behav_imp_weight_cap, importance_weight)
    ratio = torch.exp(logp.detach() - prox_logp)
    return -advantages * logp * w, {"clip_frac": torch.zeros_like(logp), "ratio": ratio}


def cispo_policy_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    eps_clip: float = 1.0,
    eps_clip_higher: float | None = None,
    behav_imp_weight_cap: float | None = None,
    importance_weight: ImportanceWeightFn | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax 2025, "MiniMax-M1", sec. 3.1: the CISPO objective and its clipped weight):
    ``-w * sg(clip(ratio, 1 - eps, 1 + eps_high)) * A * log pi`` per token, ``ratio = pi / pi_prox``.

    PPO clips the token's update (a clipped token gets no gradient); CISPO clips only the
    stopped-gradient weight, so every token keeps a policy gradient of bounded size. MiniMax leaves
    the lower side open: the default ``eps_clip=1`` (a weight never below 0). ``w`` is the capped
    behaviour weight or ``importance_weight``. At ratio 1 this is REINFORCE. Statistics:
    ``clip_frac`` (tokens whose weight was clipped), ``ratio``.
    """
    ratio = torch.exp(logp.detach() - prox_logp)
    weight = _clip(ratio, eps_clip, eps_clip_higher)
    w = resolve_behaviour_weight(prox_logp, behav_logp, mask, cu_seqlens, behav_imp_weight_cap, importance_weight)
    stats = {"clip_frac": (weight != ratio).float(), "ratio": ratio}
    return -weight * advantages * logp * w, stats


def importance_sampling_policy_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    behav_imp_weight_cap: float | None = None,
    importance_weight: ImportanceWeightFn | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The importance-sampled policy-gradient surrogate: ``-w * A * pi / pi_prox`` per token, the
    surrogate that TRPO maximises (Schulman et al. 2015, eq. 14) without its trust region, with
    the ratio keeping its gradient (``d ratio = ratio * d log pi``). Its gradient is the policy
    gradient of samples drawn from ``pi_prox``, unbiased for any ratio; nothing bounds it (PPO,
    CISPO and GSPO do). ``w`` is the capped behaviour weight or ``importance_weight``."""
    ratio = torch.exp(logp - prox_logp)
    w = resolve_behaviour_weight(prox_logp, behav_logp, mask, cu_seqlens, behav_imp_weight_cap, importance_weight)
    return -advantages * ratio * w, {"clip_frac": torch.zeros_like(logp), "ratio": ratio.detach()}


def dro_policy_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    beta: float = 0.05,
    behav_imp_weight_cap: float | None = None,
    importance_weight: ImportanceWeightFn | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Direct reward optimisation's policy loss per token (Richemond et al. 2024, "Offline
    Regularised Reinforcement Learning for Large Language Models Alignment", the DRO objective;
    as Kimi k1.5 uses it, Kimi Team 2025, sec. 2.3.2): ``-w * (A * log pi - beta / 2 *
    (log pi - log pi_prox)^2)``. The quadratic term pulls the policy back towards the one that
    sampled (``beta * k2``, `kl_k2`), so the objective stays well posed off-policy, even offline.
    ``A`` is DRO's soft advantage, computed by the caller. ``w`` is the capped behaviour weight or
    ``importance_weight``."""
    w = resolve_behaviour_weight(prox_logp, behav_logp, mask, cu_seqlens, behav_imp_weight_cap, importance_weight)
    ratio = torch.exp(logp.detach() - prox_logp)
    loss = -(advantages * logp - beta * kl_k2(logp, prox_logp))
    return loss * w, {"clip_frac": torch.zeros_like(logp), "ratio": ratio}


def gspo_token_policy_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    ratio_mask: torch.Tensor | None = None,
    eps_clip: float = 3e-4,
    eps_clip_higher: float | None = 4e-4,
    behav_imp_weight_cap: float | None = None,
    importance_weight: ImportanceWeightFn | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token (Zheng et al. 2025, sec. 4.3, the GSPO-token objective): every token carries
    its sequence's ratio ``s_i = exp(mean_t (log pi - log pi_prox))`` as its value, but the
    gradient of its own log-probability, ``s_t = sg(s_i) * pi_t / sg(pi_t)``; the loss is PPO's
    ``max(-A_t s_t, -A_t clip(s_t, 1 - eps, 1 + eps_high))`` with per-token advantages ``A_t``.
    With one advantage per sequence it has GSPO's gradient (`gspo_policy_loss`, whose loss is
    per sequence). The mean runs over ``ratio_mask`` (the sampled tokens; ``mask`` when None).
    ``w`` is the capped behaviour weight or ``importance_weight``."""
    log_s = seq_mean(logp.detach() - prox_logp, mask if ratio_mask is None else ratio_mask, cu_seqlens)
    s = torch.exp(to_tokens(log_s, cu_seqlens) + logp - logp.detach())
    loss, clipped = _clipped_surrogate(s, advantages, eps_clip, eps_clip_higher)
    w = resolve_behaviour_weight(prox_logp, behav_logp, mask, cu_seqlens, behav_imp_weight_cap, importance_weight)
    return loss * w, {"clip_frac": clipped.float(), "ratio": s.detach()}


PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``fn(logp, prox_logp, behav_logp, advantages, mask, cu_seqlens) -> (per-token loss [T], stats)``,
hyper-parameters bound with `functools.partial`."""
