"""Loss and advantage functions of the RL and preference algorithms, on packed 1-D tensors.

Every function here is pure (no engine, no config, no state). Per-token tensors are ``[T]``: the
real tokens of ``B`` sequences concatenated, with ``cu_seqlens`` (``[B+1]``) marking where each
sequence starts, as in the packed-batch contract of `areal_lite.api.engine`. ``mask`` is the
loss mask (true on tokens the policy produced). Per-sequence tensors are ``[B]``. Position ``i``
of a sequence scores token ``i``: ``logp[i]`` is its log-probability, ``advantages[i]`` its
advantage, ``values[i]`` the value of the state just before it was generated.

Variants are separate functions chosen by passing them (an actor takes ``policy_loss=...``); a
config string picks one only through the small registries at the end of this module.

Deliberate choices, where papers and implementations differ:
- The standard deviation in group normalisation is the population one (divides by n): a group of
  one gets advantage 0, not NaN.
- The behaviour importance weight of decoupled PPO (Fu et al. 2025, AReaL, eq. 5) is capped as in
  AReaL's code: a token whose weight exceeds the cap is dropped from the loss (weight 0), not
  truncated to the cap.
- Losses over an empty mask are 0, not NaN, so a micro-batch with no trained token is harmless.
- The sequence-level importance weights use the sequence's likelihood ratio (the product of its
  token ratios), as Seq-TIS and Seq-MIS define it, not GSPO's geometric mean. The truncating
  weights also take a lower bound (clamping into a band), which the TIS papers leave open.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple, TypeVar

import torch

# ---------------------------------------------------------------------------------------------
# Packed-tensor helpers
# ---------------------------------------------------------------------------------------------


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


def to_tokens(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Broadcast a per-sequence tensor ``[B]`` to every token of its sequence, ``[T]``."""
    return x[seq_index(cu_seqlens)]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over ``mask``; 0 for an empty mask."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)


def masked_std(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Population standard deviation of ``x`` over ``mask``; 0 for an empty mask."""
    m = mask.to(x.dtype)
    mean = masked_mean(x, mask)
    return (((x - mean) ** 2) * m).sum().div(m.sum().clamp(min=1)).sqrt()


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over ``mask``, 0 outside it (batch whitening)."""
    m = mask.to(x.dtype)
    mean = masked_mean(x, mask)
    var = (((x - mean) ** 2) * m).sum() / m.sum().clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * m


def _padded(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    lens = seq_lens(cu_seqlens)
    width = int(lens.max()) if lens.numel() else 0
    out = torch.zeros((lens.numel(), width), dtype=x.dtype, device=x.device)
    out[torch.arange(width, device=x.device).unsqueeze(0) < lens.unsqueeze(1)] = x
    return out


def _packed(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    lens = seq_lens(cu_seqlens)
    return x[torch.arange(x.shape[1], device=x.device).unsqueeze(0) < lens.unsqueeze(1)]


def last_token_rewards(rewards: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-token rewards ``[T]``: each sequence reward on its last masked token, 0 elsewhere.

    A sequence without a masked token gets no reward anywhere."""
    m = _padded(mask.to(torch.int64), cu_seqlens)
    pos = torch.arange(m.shape[1], device=m.device)
    # the extra column of -1 gives "no masked token" for empty rows (and for a batch of width 0)
    last = torch.cat([torch.where(m.bool(), pos, -1), torch.full((m.shape[0], 1), -1, device=m.device)], 1).amax(dim=1)
    out = torch.zeros_like(m, dtype=rewards.dtype)
    has = last >= 0
    out[has.nonzero().squeeze(1), last[has]] = rewards[has]
    return _packed(out, cu_seqlens)


# ---------------------------------------------------------------------------------------------
# Rewards
# ---------------------------------------------------------------------------------------------


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
# KL estimators (Schulman 2020, "Approximating KL Divergence"), per token
# ---------------------------------------------------------------------------------------------


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
    r = _padded(token_rewards, cu_seqlens)
    v = _padded(values, cu_seqlens)
    m = _padded(mask.to(torch.bool), cu_seqlens)
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
    return _packed(adv, cu_seqlens), _packed(returns, cu_seqlens)


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
    rank = _packed(torch.cumsum(_padded(m.to(torch.int64), cu_seqlens), dim=1) - 1, cu_seqlens)
    k = torch.where(m, rank, 0)
    width = int(k.max()) + 1 if k.numel() else 1
    total = torch.zeros(width, dtype=advantages.dtype).index_add(0, k, torch.where(m, advantages, 0.0))
    count = torch.zeros(width, dtype=advantages.dtype).index_add(0, k, m.to(advantages.dtype))
    return torch.where(m, advantages - (total / count.clamp(min=1))[k], 0.0)


# ---------------------------------------------------------------------------------------------
# Behaviour importance weights: staleness and the train-inference mismatch
# ---------------------------------------------------------------------------------------------
# The tokens of a batch were sampled by the behaviour policy: the inference engine, possibly some
# versions back. The proximal policy is the train engine's recomputation. Their ratio per token,
# rho_t = pi_prox / pi_behav, corrects for both staleness and the numerical mismatch between the
# two engines; the functions below differ only in what they do with a ratio far from 1.


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


def _clamp(w: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    return w if low is None and high is None else w.clamp(min=low, max=high)


def _in_band(w: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    keep = torch.ones_like(w, dtype=torch.bool)
    if low is not None:
        keep &= w >= low
    if high is not None:
        keep &= w <= high
    return keep


def sequence_log_ratio(
    prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """``log rho(y) = sum_t (log pi_prox - log pi_behav)`` over each sequence's masked tokens, ``[B]``:
    the log of the sequence's likelihood ratio, the product of its token ratios."""
    return seq_sum((prox_logp - behav_logp) * mask.to(prox_logp.dtype), cu_seqlens)


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
    w = torch.exp(prox_logp - behav_logp)
    return torch.where(mask.bool() & _in_band(w, low, high), w, 0.0)


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
    return torch.where(mask.bool(), _clamp(torch.exp(prox_logp - behav_logp), low, high), 0.0)


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
    w = to_tokens(torch.exp(sequence_log_ratio(prox_logp, behav_logp, mask, cu_seqlens)), cu_seqlens)
    return torch.where(mask.bool() & _in_band(w, low, high), w, 0.0)


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
    w = to_tokens(torch.exp(sequence_log_ratio(prox_logp, behav_logp, mask, cu_seqlens)), cu_seqlens)
    return torch.where(mask.bool(), _clamp(w, low, high), 0.0)


def _behaviour_weight(
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cap: float | None,
    importance_weight: ImportanceWeightFn | None,
) -> torch.Tensor:
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


# ---------------------------------------------------------------------------------------------
# Policy losses: per-token loss [T] (0 outside the mask) and per-token statistics
# ---------------------------------------------------------------------------------------------


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
    high = eps_clip if eps_clip_higher is None else eps_clip_higher
    surr = -advantages * ratio
    surr_clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    loss = torch.maximum(surr, surr_clipped)
    clipped = surr_clipped > surr
    dual = torch.zeros_like(clipped)
    if c_clip is not None:
        bound = -c_clip * advantages
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
    w = _behaviour_weight(prox_logp, behav_logp, mask, cu_seqlens, behav_imp_weight_cap, importance_weight)
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
    m = mask.to(logp.dtype)
    n = seq_sum(m, cu_seqlens).clamp(min=1)
    log_s = seq_sum((logp - prox_logp) * m, cu_seqlens) / n
    s = to_tokens(torch.exp(log_s), cu_seqlens)
    adv = to_tokens(seq_sum(advantages * m, cu_seqlens) / n, cu_seqlens)
    high = eps_clip if eps_clip_higher is None else eps_clip_higher
    surr = -adv * s
    surr_clipped = -adv * s.clamp(1.0 - eps_clip, 1.0 + high)
    loss = torch.maximum(surr, surr_clipped)
    if importance_weight is None:
        log_w = to_tokens(seq_sum((prox_logp - behav_logp) * m, cu_seqlens) / n, cu_seqlens)
        w = behaviour_weight(log_w, torch.zeros_like(log_w), mask, behav_imp_weight_cap)
    else:
        w = _behaviour_weight(prox_logp, behav_logp, mask, cu_seqlens, behav_imp_weight_cap, importance_weight)
    stats = {"clip_frac": (surr_clipped > surr).float(), "ratio": s.detach()}
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
    w = _behaviour_weight(prox_logp, behav_logp, mask, cu_seqlens, behav_imp_weight_cap, importance_weight)
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
    high = eps_clip if eps_clip_higher is None else eps_clip_higher
    weight = ratio.clamp(1.0 - eps_clip, 1.0 + high)
    w = _behaviour_weight(prox_logp, behav_logp, mask, cu_seqlens, behav_imp_weight_cap, importance_weight)
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
    w = _behaviour_weight(prox_logp, behav_logp, mask, cu_seqlens, behav_imp_weight_cap, importance_weight)
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
    w = _behaviour_weight(prox_logp, behav_logp, mask, cu_seqlens, behav_imp_weight_cap, importance_weight)
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
    m = (mask if ratio_mask is None else ratio_mask).to(logp.dtype)
    n = seq_sum(m, cu_seqlens).clamp(min=1)
    log_s = seq_sum((logp.detach() - prox_logp) * m, cu_seqlens) / n
    s = torch.exp(to_tokens(log_s, cu_seqlens) + logp - logp.detach())
    high = eps_clip if eps_clip_higher is None else eps_clip_higher
    surr = -advantages * s
    surr_clipped = -advantages * s.clamp(1.0 - eps_clip, 1.0 + high)
    loss = torch.maximum(surr, surr_clipped)
    w = _behaviour_weight(prox_logp, behav_logp, mask, cu_seqlens, behav_imp_weight_cap, importance_weight)
    return loss * w, {"clip_frac": (surr_clipped > surr).float(), "ratio": s.detach()}


PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``fn(logp, prox_logp, behav_logp, advantages, mask, cu_seqlens) -> (per-token loss [T], stats)``,
hyper-parameters bound with `functools.partial`."""


# ---------------------------------------------------------------------------------------------
# Aggregation: per-token loss [T] -> scalar, and the micro-batch weight that keeps it global
# ---------------------------------------------------------------------------------------------


def token_mean(loss: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Mean over all masked tokens of the batch (long sequences weigh more)."""
    return masked_mean(loss, mask)


def seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Mean over sequences of each sequence's token mean (GRPO's original 1/|o_i| normalisation);
    sequences without a masked token do not count."""
    m = mask.to(loss.dtype)
    n = seq_sum(m, cu_seqlens)
    per_seq = seq_sum(loss * m, cu_seqlens) / n.clamp(min=1)
    return per_seq.sum() / (n > 0).sum().clamp(min=1)


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


# ---------------------------------------------------------------------------------------------
# Critic, preference and supervised losses
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Registries: only where a config string must pick a function
# ---------------------------------------------------------------------------------------------

AGGREGATIONS: dict[str, Aggregation] = {
    "token-mean": Aggregation(token_mean, count_tokens),
    "seq-mean-token-mean": Aggregation(seq_mean_token_mean, count_sequences),
    "seq-mean-token-sum": Aggregation(seq_mean_token_sum, count_sequences),
}
KL_ESTIMATORS: dict[str, KLEstimator] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}
IMPORTANCE_WEIGHTS: dict[str, ImportanceWeightFn] = {
    "token_mask": token_mask_weight,
    "token_truncate": token_truncate_weight,
    "sequence_mask": sequence_mask_weight,
    "sequence_truncate": sequence_truncate_weight,
}
PREFERENCE_LOSSES: dict[str, PreferenceLossFn] = {"sigmoid": dpo_sigmoid_loss, "ipo": ipo_loss}


T = TypeVar("T")


def pick(registry: dict[str, T], name: str, what: str) -> T:
    """``registry[name]``, or an error listing the valid names."""
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; choose one of {', '.join(registry)}")
    return registry[name]
