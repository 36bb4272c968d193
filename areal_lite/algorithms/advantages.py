"""From rewards to advantages: reward shaping (bias, scale, clip, DAPO's overlong penalty) and the
advantage estimators (GRPO, Dr. GRPO, RLOO, ReMax, REINFORCE++, GAE, on-policy distillation), on
packed 1-D tensors (`areal_lite.algorithms.packed`).

Deliberate choice: the standard deviation in group normalisation is the population one (divides
by n): a group of one gets advantage 0, not NaN.
"""

from __future__ import annotations

from typing import Literal

import torch

from areal_lite.algorithms.packed import from_padded, to_padded, whiten

# ---------------------------------------------------------------------------------------------
# Rewards
# ---------------------------------------------------------------------------------------------


def last_token_rewards(rewards: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-token rewards ``[T]``: each sequence reward on its last masked token, 0 elsewhere.

    A sequence without a masked token gets no reward anywhere."""
    m = to_padded(mask.to(torch.int64), cu_seqlens)
    pos = torch.arange(m.shape[1], device=m.device)
    # the extra column of -1 gives "no masked token" for empty rows (and for a batch of width 0)
    last = torch.cat([torch.where(m.bool(), pos, -1), torch.full((m.shape[0], 1), -1, device=m.device)], 1).amax(dim=1)
    out = torch.zeros_like(m, dtype=rewards.dtype)
    has = last >= 0
    out[has.nonzero().squeeze(1), last[has]] = rewards[has]
    return from_padded(out, cu_seqlens)


def shape_rewards(
    rewards: torch.Tensor, bias: float = 0.0, scale: float = 1.0, clip: float | None = None
) -> torch.Tensor:
    """``clip((r + bias) * scale)`` to ``[-clip, clip]`` (no clipping when ``clip`` is None)."""
    out = (rewards + bias) * scale
    return out if clip is None else out.clamp(-clip, clip)


def overlong_penalty(
    gen_lens: torch.Tensor, max_new_tokens: int, penalty_len: int, factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), to be added to the rewards ``[B]``.

    0 up to ``max_new_tokens - penalty_len`` generated tokens, then falling linearly to
    ``-factor`` at ``max_new_tokens``, and ``-factor`` beyond it.
    """
    start = max_new_tokens - penalty_len
    frac = (gen_lens.to(torch.float32) - start) / max(penalty_len, 1)
    return -factor * frac.clamp(0.0, 1.0)


def zero_truncated_rewards(rewards: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Reward 0 for sequences cut off by the length limit (their outcome is unknown)."""
    return torch.where(truncated.bool(), torch.zeros_like(rewards), rewards)


# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------


def grpo_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    level: Literal["group", "batch"] = "group",
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-normalised advantages ``[B]`` (GRPO, Shao et al. 2024, eq. 3 with outcome rewards).

    ``A_i = (r_i - mean) / (std + eps)``, mean and std over the group of ``group_size``
    consecutive samples of one prompt (``level="group"``) or over the whole batch
    (``level="batch"``). ``scale_by_std=False`` keeps only the mean: Dr. GRPO (Liu et al. 2025,
    "Understanding R1-Zero-Like Training", sec. 3.1) removes the std division as a difficulty bias.
    """
    if level == "group":
        if rewards.numel() % group_size:
            raise ValueError(f"{rewards.numel()} rewards do not form groups of {group_size}")
        r = rewards.view(-1, group_size)
    elif level == "batch":
        r = rewards.view(1, -1)
    else:
        raise ValueError(f"level must be group or batch, got {level!r}")
    adv = r - r.mean(dim=1, keepdim=True)
    if scale_by_std:
        adv = adv / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    return adv.reshape(-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Leave-one-out advantages ``[B]`` (RLOO, Ahmadian et al. 2024, eq. 4 / Kool et al. 2019):
    ``A_i = r_i - mean_{j != i} r_j`` within each group of ``group_size >= 2`` samples."""
    if group_size < 2:
        raise ValueError("RLOO needs at least 2 samples per prompt")
    r = rewards.view(-1, group_size)
    others = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
    return (r - others).reshape(-1)


def remax_advantages(rewards: torch.Tensor, baseline_rewards: torch.Tensor) -> torch.Tensor:
    """ReMax advantages ``[B]`` (Li et al. 2023, Algorithm 1): the reward minus the reward of the
    greedy response to the same prompt."""
    return rewards - baseline_rewards


def discounted_returns(
    token_rewards: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """Per-token returns ``G_t = r_t + gamma * G_{t+1}`` over the masked tokens of each sequence
    (unmasked tokens, such as tool output between turns, are skipped), 0 outside the mask."""
    zeros = torch.zeros_like(token_rewards)
    _, returns = gae_advantages(token_rewards, zeros, mask, cu_seqlens, gamma=gamma, lam=1.0)
    return returns


def reinforce_pp_advantages(
    token_rewards: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """REINFORCE++ advantages ``[T]`` (Hu 2025, eq. 5-7): discounted returns of the per-token
    rewards (the KL penalty on each token, the outcome reward on the last), whitened over all
    masked tokens of the batch."""
    return whiten(discounted_returns(token_rewards, mask, cu_seqlens, gamma), mask)


def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16): ``(advantages, returns)`` ``[T]``.

    ``delta_t = r_t + gamma V_{t+1} - V_t``, ``A_t = delta_t + gamma lam A_{t+1}`` over the masked
    tokens of each sequence in order (unmasked tokens are skipped, the value after the last masked
    token is 0); ``returns = A + V``. Both are 0 outside the mask.
    """
    r = to_padded(token_rewards, cu_seqlens)
    v = to_padded(values, cu_seqlens)
    m = to_padded(mask.to(torch.bool), cu_seqlens)
    adv = torch.zeros_like(r)
    next_value = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma * lam * next_adv
        on = m[:, t]
        adv[:, t] = torch.where(on, a, 0.0)
        next_adv = torch.where(on, a, next_adv)
        next_value = torch.where(on, v[:, t], next_value)
    returns = torch.where(m, adv + v, 0.0)
    return from_padded(adv, cu_seqlens), from_padded(returns, cu_seqlens)


def reverse_kl_advantages(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    gamma: float = 0.0,
    clip: float | None = None,
) -> torch.Tensor:
    """On-policy distillation advantages ``[T]``: the per-token reverse KL to a teacher as a reward.

    On the student's own samples, ``r_t = log pi_teacher - log pi_student`` is minus the k1
    estimate of KL(pi_student || pi_teacher) at token t: the reverse KL that MiniLLM (Gu et al.
    2024, eq. 1) minimises, estimated on student samples as in on-policy distillation (Agarwal et
    al. 2024, GKD). The advantage is the discounted return of these rewards; ``gamma=0`` (each
    token's own term, as Lu et al. 2025, "On-Policy Distillation", Thinking Machines) is the default,
    ``gamma=1`` credits each token with the whole rest of the sequence's KL. 0 outside the mask.
    ``clip`` (None: off) clamps each token's reward to ``[-clip, clip]`` before the returns: a token
    the teacher all but rules out (``log pi_teacher`` of -10 nats) then counts as much as one at
    ``-clip``, which bounds the few tokens that would otherwise dominate a batch's gradient.
    """
    rewards = teacher_logp - student_logp
    if clip is not None:
        rewards = rewards.clamp(-clip, clip)
    return discounted_returns(rewards * mask.to(student_logp.dtype), mask, cu_seqlens, gamma)


def position_baseline(advantages: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``advantages`` ``[T]`` minus a baseline per position: the mean, over the batch's sequences,
    of the advantage of their k-th masked token, subtracted from every k-th masked token (a
    REINFORCE baseline, Williams 1992, that depends on the position only, not on the token
    sampled there, so the expected gradient keeps its direction up to each token's own share of
    the mean). 0 outside the mask."""
    m = mask.bool()
    rank = from_padded(torch.cumsum(to_padded(m.to(torch.int64), cu_seqlens), dim=1) - 1, cu_seqlens)
    k = torch.where(m, rank, 0)
    width = int(k.max()) + 1 if k.numel() else 1
    total = torch.zeros(width, dtype=advantages.dtype).index_add(0, k, torch.where(m, advantages, 0.0))
    count = torch.zeros(width, dtype=advantages.dtype).index_add(0, k, m.to(advantages.dtype))
    return torch.where(m, advantages - (total / count.clamp(min=1))[k], 0.0)
