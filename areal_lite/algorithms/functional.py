"""Loss and advantage functions of the RL and preference algorithms, on packed 1-D tensors: the
one place to import them from (``from areal_lite.algorithms import functional as F``).

Every function is pure (no engine, no config, no state). Per-token tensors are ``[T]``: the
real tokens of ``B`` sequences concatenated, with ``cu_seqlens`` (``[B+1]``) marking where each
sequence starts, as in the packed-batch contract of `areal_lite.api.engine`. ``mask`` is the
loss mask (true on tokens the policy produced). Per-sequence tensors are ``[B]``. Position ``i``
of a sequence scores token ``i``: ``logp[i]`` is its log-probability, ``advantages[i]`` its
advantage, ``values[i]`` the value of the state just before it was generated.

They are written in one module per job, all re-exported here:

- `areal_lite.algorithms.packed`: per-sequence sums and means, masked statistics, whitening;
- `areal_lite.algorithms.advantages`: reward shaping and the advantage estimators;
- `areal_lite.algorithms.kl`: the KL estimators k1, k2, k3;
- `areal_lite.algorithms.importance`: the behaviour importance weights (staleness, the
  train-inference mismatch) and the mismatch statistics;
- `areal_lite.algorithms.policy_losses`: PPO, GSPO, GSPO-token, REINFORCE, CISPO, DRO and the
  importance-sampled policy gradient;
- `areal_lite.algorithms.aggregation`: per-token loss to scalar, and the micro-batch weights;
- `areal_lite.algorithms.losses`: the value, preference (DPO, IPO) and supervised losses.

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

from typing import TypeVar

from areal_lite.algorithms.advantages import (
    discounted_returns,
    gae_advantages,
    grpo_advantages,
    last_token_rewards,
    overlong_penalty,
    position_baseline,
    reinforce_pp_advantages,
    remax_advantages,
    reverse_kl_advantages,
    rloo_advantages,
    shape_rewards,
    zero_truncated_rewards,
)
from areal_lite.algorithms.aggregation import (
    Aggregation,
    count_sequences,
    count_tokens,
    seq_mean_token_mean,
    seq_mean_token_sum,
    token_mean,
)
from areal_lite.algorithms.importance import (
    ImportanceWeightFn,
    behaviour_weight,
    mismatch_stats,
    resolve_behaviour_weight,
    sequence_log_ratio,
    sequence_mask_weight,
    sequence_truncate_weight,
    token_mask_weight,
    token_truncate_weight,
)
from areal_lite.algorithms.kl import KLEstimator, kl_k1, kl_k2, kl_k3
from areal_lite.algorithms.losses import PreferenceLossFn, clipped_value_loss, dpo_sigmoid_loss, ipo_loss, sft_nll
from areal_lite.algorithms.packed import (
    from_padded,
    masked_mean,
    masked_std,
    masked_var,
    seq_index,
    seq_lens,
    seq_mean,
    seq_sum,
    to_padded,
    to_tokens,
    whiten,
)
from areal_lite.algorithms.policy_losses import (
    PolicyLossFn,
    cispo_policy_loss,
    dro_policy_loss,
    gspo_policy_loss,
    gspo_token_policy_loss,
    importance_sampling_policy_loss,
    ppo_policy_loss,
    reinforce_policy_loss,
)

__all__ = [
    "AGGREGATIONS",
    "IMPORTANCE_WEIGHTS",
    "KL_ESTIMATORS",
    "PREFERENCE_LOSSES",
    "Aggregation",
    "ImportanceWeightFn",
    "KLEstimator",
    "PolicyLossFn",
    "PreferenceLossFn",
    "behaviour_weight",
    "cispo_policy_loss",
    "clipped_value_loss",
    "count_sequences",
    "count_tokens",
    "discounted_returns",
    "dpo_sigmoid_loss",
    "dro_policy_loss",
    "from_padded",
    "gae_advantages",
    "grpo_advantages",
    "gspo_policy_loss",
    "gspo_token_policy_loss",
    "importance_sampling_policy_loss",
    "ipo_loss",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "last_token_rewards",
    "masked_mean",
    "masked_std",
    "masked_var",
    "mismatch_stats",
    "overlong_penalty",
    "pick",
    "position_baseline",
    "ppo_policy_loss",
    "reinforce_policy_loss",
    "reinforce_pp_advantages",
    "remax_advantages",
    "resolve_behaviour_weight",
    "reverse_kl_advantages",
    "rloo_advantages",
    "seq_index",
    "seq_lens",
    "seq_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_sum",
    "sequence_log_ratio",
    "sequence_mask_weight",
    "sequence_truncate_weight",
    "sft_nll",
    "shape_rewards",
    "to_padded",
    "to_tokens",
    "token_mask_weight",
    "token_mean",
    "token_truncate_weight",
    "whiten",
    "zero_truncated_rewards",
]

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
