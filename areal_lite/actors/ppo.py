"""`PPOActor` and `PPOCritic`: the PPO family over any `TrainEngine`.

The actor turns a rollout batch into advantages and takes ``ppo_n_minibatches`` optimizer steps
on it with a policy loss from `areal_lite.algorithms.functional`: PPO (decoupled, with clip-higher
and dual clip), GSPO, REINFORCE or CISPO; with GRPO, Dr. GRPO, RLOO, ReMax, REINFORCE++ or GAE
advantages. The behaviour importance weight, which corrects stale tokens and the mismatch between
the inference and the train engine, is capped, truncated or masked per token or per sequence
(``behav_imp_weight_mode``); every update reports that mismatch (``mismatch/*``) on the tokens the
current weights produced. It calls only ``engine.forward`` and ``engine.train_batch``, so it runs unchanged on
FSDP and Megatron. The loop it serves (docs/design.md)::

    actor.compute_advantages(batch)     # adds "advantages" (and "returns" for GAE) [B, L]
    stats = actor.ppo_update(batch)     # proximal log-probs: see `PPOActor.ppo_update`
    actor.step_lr_scheduler()

Batch-level statistics (``adv_norm_level="batch"``, REINFORCE++ whitening) are taken over the
batch each data-parallel rank holds, not over all ranks: the actor sees only its engine.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
from tensordict import TensorDict

from areal_lite.algorithms import functional as F
from areal_lite.api.config import PPOActorConfig, PPOCriticConfig
from areal_lite.api.engine import PackedBatch, TrainEngine
from areal_lite.api.io import WeightUpdateMeta
from areal_lite.utils.data import allocate_balanced, seqlens_of, unpack_sequences


def packed_view(batch: TensorDict, key: str) -> torch.Tensor:
    """A per-token key ``[B, L]`` of a padded batch as a packed ``[T]`` tensor."""
    return batch[key][batch["attention_mask"].bool()]


def per_token_forward(engine: TrainEngine, batch: TensorDict) -> torch.Tensor:
    """``engine.forward(batch)`` without entropy: the per-token log-probabilities ``[B, L]`` (the
    values, for a critic's engine)."""
    out = engine.forward(batch)
    assert isinstance(out, torch.Tensor)
    return out


def cu_seqlens_of(batch: TensorDict) -> torch.Tensor:
    lens = seqlens_of(batch)
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    return cu


def minibatches(batch: TensorDict, n: int, group_size: int) -> list[TensorDict]:
    """Cut a batch into ``n`` minibatches of whole groups, balanced by token count."""
    n_groups = batch.batch_size[0] // group_size
    if n_groups < n:
        # Fewer minibatches on one data-parallel rank than on another would hang the collectives.
        raise ValueError(f"{n_groups} groups of {group_size} cannot make {n} minibatches")
    indices = allocate_balanced(seqlens_of(batch).tolist(), None, min_bins=n, granularity=group_size)
    return [batch[torch.tensor(idx)] for idx in indices]


LOSS_SCALE = "loss_weight_scale"
"""Per-sequence key set by `PPOActor.drop_zero_advantage`: a micro-batch's loss weight is scaled
by it and its loss divided by it, so that the engine's global normaliser still counts the
sequences left out."""


def mean_stats(all_stats: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for s in all_stats for k in s}
    return {k: sum(s[k] for s in all_stats if k in s) / sum(1 for s in all_stats if k in s) for k in sorted(keys)}


class AdvantageInputs(NamedTuple):
    """What an advantage estimator may use, packed over the batch's real tokens."""

    rewards: torch.Tensor
    """Shaped sequence rewards [B], minus the summed KL penalty when it is in the reward."""
    token_rewards: torch.Tensor
    """[T]: each sequence reward on its last masked token, minus the per-token KL penalty."""
    mask: torch.Tensor
    """[T] loss mask."""
    cu_seqlens: torch.Tensor
    batch: TensorDict
    """The padded batch, for estimator-specific keys (``values``, ``baseline_rewards``)."""


AdvantageFn = Callable[[PPOActorConfig, AdvantageInputs], tuple[torch.Tensor, torch.Tensor | None]]
"""``fn(config, inputs) -> (advantages [T], returns [T] or None)``."""


def _per_token(seq_adv: torch.Tensor, x: AdvantageInputs) -> torch.Tensor:
    return F.to_tokens(seq_adv, x.cu_seqlens) * x.mask


def grpo_estimator(cfg: PPOActorConfig, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    if cfg.adv_norm_level == "none":
        return _per_token(x.rewards, x), None
    return _per_token(F.grpo_advantages(x.rewards, cfg.group_size, level=cfg.adv_norm_level), x), None  # type: ignore[arg-type]


def dr_grpo_estimator(cfg: PPOActorConfig, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    level = "group" if cfg.adv_norm_level == "none" else cfg.adv_norm_level
    return _per_token(F.grpo_advantages(x.rewards, cfg.group_size, level=level, scale_by_std=False), x), None  # type: ignore[arg-type]


def rloo_estimator(cfg: PPOActorConfig, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    return _per_token(F.rloo_advantages(x.rewards, cfg.group_size), x), None


def remax_estimator(cfg: PPOActorConfig, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    if "baseline_rewards" not in x.batch:
        raise ValueError("adv_estimator=remax needs batch['baseline_rewards'] (the greedy answers' rewards)")
    baseline = F.shape_rewards(
        x.batch["baseline_rewards"].float(), cfg.reward_bias, cfg.reward_scaling, cfg.reward_clip
    )
    return _per_token(F.remax_advantages(x.rewards, baseline), x), None


def reinforce_pp_estimator(cfg: PPOActorConfig, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    return F.reinforce_pp_advantages(x.token_rewards, x.mask, x.cu_seqlens, cfg.discount), None


def gae_estimator(cfg: PPOActorConfig, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    if "values" not in x.batch:
        raise ValueError("adv_estimator=gae needs batch['values'] from PPOCritic.compute_values")
    values = packed_view(x.batch, "values")
    return F.gae_advantages(x.token_rewards, values, x.mask, x.cu_seqlens, cfg.discount, cfg.gae_lambda)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {
    "grpo": grpo_estimator,
    "dr_grpo": dr_grpo_estimator,
    "rloo": rloo_estimator,
    "remax": remax_estimator,
    "reinforce_pp": reinforce_pp_estimator,
    "gae": gae_estimator,
}


def behaviour_correction(cfg: PPOActorConfig) -> dict[str, object]:
    """The keyword arguments that give a policy loss the configured behaviour weight: the classic
    cap (``token_mask`` without a floor), or an `F.ImportanceWeightFn` bound to the band."""
    if cfg.behav_imp_weight_mode == "token_mask" and cfg.behav_imp_weight_floor is None:
        return {"behav_imp_weight_cap": cfg.behav_imp_weight_cap}
    weight = F.pick(F.IMPORTANCE_WEIGHTS, cfg.behav_imp_weight_mode, "behaviour weight mode")
    band = functools.partial(weight, low=cfg.behav_imp_weight_floor, high=cfg.behav_imp_weight_cap)
    return {"importance_weight": band}


POLICY_LOSSES: dict[str, Callable[[PPOActorConfig], F.PolicyLossFn]] = {
    "ppo": lambda cfg: functools.partial(
        F.ppo_policy_loss,
        eps_clip=cfg.eps_clip,
        eps_clip_higher=cfg.eps_clip_higher,
        c_clip=cfg.c_clip,
        **behaviour_correction(cfg),
    ),
    "gspo": lambda cfg: functools.partial(
        F.gspo_policy_loss, eps_clip=cfg.eps_clip, eps_clip_higher=cfg.eps_clip_higher, **behaviour_correction(cfg)
    ),
    "reinforce": lambda cfg: functools.partial(F.reinforce_policy_loss, **behaviour_correction(cfg)),
    "cispo": lambda cfg: functools.partial(
        F.cispo_policy_loss, eps_clip=cfg.eps_clip, eps_clip_higher=cfg.eps_clip_higher, **behaviour_correction(cfg)
    ),
}
"""The policy losses a config string names, each bound to the config's hyper-parameters."""


class PPOActor:
    """A policy trained by a PPO-family algorithm on a `TrainEngine`.

    ``ref_engine`` (a frozen engine) is needed when ``config.kl_ctl > 0``. ``policy_loss``
    replaces the configured loss: any function with the signature of
    `areal_lite.algorithms.functional.ppo_policy_loss` (hyper-parameters bound);
    ``advantage_fn`` replaces the configured advantage estimator (an `AdvantageFn`).
    """

    def __init__(
        self,
        config: PPOActorConfig,
        engine: TrainEngine,
        ref_engine: TrainEngine | None = None,
        policy_loss: F.PolicyLossFn | None = None,
        advantage_fn: AdvantageFn | None = None,
    ) -> None:
        if config.adv_norm_level not in ("group", "batch", "none"):
            raise ValueError(f"adv_norm_level must be group, batch or none, got {config.adv_norm_level!r}")
        if config.kl_ctl > 0 and ref_engine is None:
            raise ValueError("kl_ctl > 0 needs a reference engine (ref_engine=...)")
        self.config = config
        self.engine = engine
        self.ref_engine = ref_engine
        self.policy_loss = policy_loss or F.pick(POLICY_LOSSES, config.policy_loss, "policy loss")(config)
        self.advantage_fn = advantage_fn or F.pick(ADVANTAGE_ESTIMATORS, config.adv_estimator, "advantage estimator")
        self.aggregation = F.pick(F.AGGREGATIONS, config.loss_agg, "loss aggregation")
        self.kl_estimator = F.pick(F.KL_ESTIMATORS, config.kl_estimator, "KL estimator")
        self.skip_zero_advantage = (
            config.skip_zero_advantage
            and policy_loss is None  # a custom loss may have terms that do not vanish with A = 0
            and not config.entropy_coeff
            and not (config.kl_ctl > 0 and not config.kl_in_reward)
        )
        self._log_weights: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        """Set during ``ppo_update``: for each micro-batch, prox - behav on its loss tokens, and
        which of those tokens the policy at the train engine's version produced."""

    # ---------------------------------------------------------------- before the update

    def compute_logp(self, batch: TensorDict) -> torch.Tensor:
        """Log-probabilities ``[B, L]`` of the batch's tokens under the current policy."""
        return per_token_forward(self.engine, batch)

    def shaped_rewards(self, batch: TensorDict) -> torch.Tensor:
        """Sequence rewards ``[B]`` after the overlong penalty, bias, scale, clip and truncation."""
        cfg = self.config
        rewards = batch["rewards"].float()
        gen_lens = batch["loss_mask"].sum(dim=1)
        if cfg.overlong_penalty_len > 0:
            if cfg.max_new_tokens <= 0:
                raise ValueError("the overlong penalty needs max_new_tokens")
            rewards = rewards + F.overlong_penalty(
                gen_lens, cfg.max_new_tokens, cfg.overlong_penalty_len, cfg.overlong_penalty_factor
            )
        rewards = F.shape_rewards(rewards, cfg.reward_bias, cfg.reward_scaling, cfg.reward_clip)
        if cfg.mask_truncated:
            if "truncated" in batch:
                truncated = batch["truncated"].bool()
            elif cfg.max_new_tokens > 0:
                truncated = gen_lens >= cfg.max_new_tokens
            else:
                raise ValueError("mask_truncated needs a 'truncated' key in the batch or max_new_tokens")
            rewards = F.zero_truncated_rewards(rewards, truncated)
        return rewards

    def compute_advantages(self, batch: TensorDict) -> None:
        """Add ``advantages`` ``[B, L]`` (and ``returns`` for GAE, ``ref_logp`` when a KL penalty
        is on) to the batch, in place."""
        cfg = self.config
        cu = cu_seqlens_of(batch)
        mask = packed_view(batch, "loss_mask").bool()
        rewards = self.shaped_rewards(batch)
        kl = torch.zeros(mask.shape, dtype=torch.float32)
        if cfg.kl_ctl > 0:
            if "ref_logp" not in batch:
                assert self.ref_engine is not None
                batch["ref_logp"] = per_token_forward(self.ref_engine, batch)
            if cfg.kl_in_reward:
                kl = self.kl_estimator(packed_view(batch, "logprobs"), packed_view(batch, "ref_logp")) * mask
        x = AdvantageInputs(
            rewards=rewards - cfg.kl_ctl * F.seq_sum(kl, cu),
            token_rewards=F.last_token_rewards(rewards, mask, cu) - cfg.kl_ctl * kl,
            mask=mask,
            cu_seqlens=cu,
            batch=batch,
        )
        adv, returns = self.advantage_fn(cfg, x)
        width = batch["attention_mask"].shape[1]
        batch["advantages"] = unpack_sequences(adv.float(), cu, width)
        if returns is not None:
            batch["returns"] = unpack_sequences(returns.float(), cu, width)

    # ---------------------------------------------------------------- the update

    def loss_fn(
        self, logp: torch.Tensor, entropy: torch.Tensor, mb: PackedBatch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The per-micro-batch loss given to ``engine.train_batch``."""
        cfg = self.config
        mask, cu = mb["loss_mask"].bool(), mb["cu_seqlens"]  # type: ignore[union-attr]
        if "prox_logp" in mb:
            prox = mb["prox_logp"]
        else:  # one optimizer step per batch: the policy being updated is the proximal policy
            prox = logp.detach()
        behav = mb.get("behav_logp", prox)
        if self._log_weights is not None:
            if "versions" in mb:
                same_version = mb["versions"][mask] == self.engine.get_version()  # type: ignore[index]
            else:  # a batch without versions (the recipe API's): no token is known to be current
                same_version = torch.zeros(int(mask.sum()), dtype=torch.bool)
            self._log_weights.append(((prox - behav)[mask], same_version))
        per_token, token_stats = self.policy_loss(logp, prox, behav, mb["advantages"], mask, cu)
        if cfg.entropy_coeff:
            per_token = per_token - cfg.entropy_coeff * entropy
        stats = {k: F.masked_mean(v.detach(), mask) for k, v in token_stats.items()}
        if "ref_logp" in mb:  # reported whenever there is a reference, for the logger's KL warning
            kl = self.kl_estimator(logp, mb["ref_logp"])
            stats["kl_ref"] = F.masked_mean(kl.detach(), mask)
            if cfg.kl_ctl > 0 and not cfg.kl_in_reward:
                per_token = per_token + cfg.kl_ctl * kl
        stats["entropy"] = F.masked_mean(entropy.detach(), mask)
        stats["approx_kl"] = F.masked_mean(F.kl_k3(prox, logp.detach()), mask)
        if "behav_logp" in mb:  # KL(behaviour || proximal) on the sampled tokens: staleness + mismatch
            stats["behav_kl"] = F.masked_mean(F.kl_k3(behav, prox), mask)
        loss = self.aggregation.reduce(per_token, mask, cu)
        if LOSS_SCALE in mb:
            loss = loss / float(mb[LOSS_SCALE][0])  # type: ignore[index]
        return loss, stats

    def loss_weight(self, mb: PackedBatch) -> float:
        weight = self.aggregation.weight(mb["loss_mask"].bool(), mb["cu_seqlens"])  # type: ignore[union-attr]
        if LOSS_SCALE in mb:
            weight *= float(mb[LOSS_SCALE][0])  # type: ignore[index]
        return weight

    def drop_zero_advantage(self, mb: TensorDict) -> TensorDict:
        """``mb`` without the sequences whose loss tokens all have advantage 0 (their policy
        gradient is exactly 0). The engine scales each micro-batch loss by its weight over the
        total weight of all ranks; the kept sequences carry ``LOSS_SCALE`` = full weight / kept
        weight of this rank's minibatch, which `loss_weight` multiplies in and `loss_fn` divides
        out, so the total is that of the full minibatch and the gradient is unchanged. At least one
        sequence is kept: every rank must run its passes."""
        mask = mb["loss_mask"].bool()
        keep = ((mb["advantages"] != 0) & mask).any(dim=1)
        if bool(keep.all()):
            return mb
        if not bool(keep.any()):
            keep[int(mask.sum(dim=1).argmax())] = True
        kept = mb[keep]
        full = self.aggregation.weight(packed_view(mb, "loss_mask").bool(), cu_seqlens_of(mb))
        part = self.aggregation.weight(packed_view(kept, "loss_mask").bool(), cu_seqlens_of(kept))
        if part > 0:  # else nothing on this rank is trained; the engine reports a zero total
            kept[LOSS_SCALE] = torch.full((kept.batch_size[0],), full / part, dtype=torch.float64)
        return kept

    def ppo_update(self, batch: TensorDict) -> dict[str, float]:
        """``ppo_n_minibatches`` optimizer steps on a batch with ``advantages``; groups of
        ``group_size`` stay in one minibatch. Returns the statistics of the update (means over
        minibatches) and of the batch (importance weights, advantages, rewards, tokens).

        The proximal log-probabilities of decoupled PPO are ``batch["prox_logp"]`` when the caller
        set them; otherwise, with ``recompute_logprob``, the policy's own log-probabilities before
        the update. With one minibatch those are the log-probabilities of the very forward pass
        that computes the loss (no optimizer step comes between), so they are taken from it,
        detached, instead of from a second forward pass over the batch: same values, a third less
        compute. With several minibatches they are recomputed first (``compute_logp``).

        With ``skip_zero_advantage`` each minibatch is trained without its zero-advantage
        sequences (`drop_zero_advantage`); ``skipped_seq_frac`` says how many were left out."""
        cfg = self.config
        if "advantages" not in batch:
            raise ValueError("ppo_update needs batch['advantages']: call compute_advantages first")
        data = batch.clone(recurse=False)
        if "prox_logp" not in batch:
            if not cfg.recompute_logprob:
                data["prox_logp"] = batch["logprobs"]
            elif cfg.ppo_n_minibatches > 1:
                data["prox_logp"] = self.compute_logp(batch)
            # else: loss_fn takes them from the update's own forward pass
        if cfg.use_decoupled_loss:
            data["behav_logp"] = batch["logprobs"]
        elif "prox_logp" in data:
            data["behav_logp"] = data["prox_logp"]
        self._log_weights = []
        trained = 0
        try:
            all_stats = []
            for mb in minibatches(data, cfg.ppo_n_minibatches, cfg.group_size):
                if self.skip_zero_advantage:
                    mb = self.drop_zero_advantage(mb)
                trained += mb.batch_size[0]
                all_stats.append(self.engine.train_batch(mb, self.loss_fn, self.loss_weight))
            stats = mean_stats(all_stats)
            log_w = torch.cat([lw for lw, _ in self._log_weights]) if self._log_weights else torch.zeros(0)
            same = (
                torch.cat([s for _, s in self._log_weights]) if self._log_weights else torch.zeros(0, dtype=torch.bool)
            )
        finally:
            self._log_weights = None
        stats.update(self.batch_stats(data, torch.exp(log_w)))
        stats.update(self.mismatch_stats(log_w, same))
        stats["skipped_seq_frac"] = 1.0 - trained / max(data.batch_size[0], 1)
        return stats

    def batch_stats(self, data: TensorDict, w: torch.Tensor) -> dict[str, float]:
        """Importance-weight (``w``: exp(prox - behav) of the loss tokens), advantage, reward and
        token statistics of a prepared batch."""
        mask = packed_view(data, "loss_mask").bool()
        adv = packed_view(data, "advantages")
        cap = self.config.behav_imp_weight_cap
        rewards = data["rewards"].float()
        out = {
            "advantage_mean": float(F.masked_mean(adv, mask)),
            "advantage_std": float(F.masked_std(adv, mask)),
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std(unbiased=False)) if rewards.numel() else 0.0,
            "tokens_trained": float(mask.sum()),
        }
        if w.numel():
            out.update(
                importance_weight_mean=float(w.mean()),
                importance_weight_max=float(w.max()),
                importance_weight_min=float(w.min()),
                importance_weight_capped_frac=float((w > cap).float().mean()) if cap is not None else 0.0,
            )
        return out

    @staticmethod
    def mismatch_stats(log_w: torch.Tensor, same_version: torch.Tensor) -> dict[str, float]:
        """The train-inference mismatch, from ``log_w`` = proximal - behaviour log-probabilities of
        the trained tokens: over the tokens produced at the train engine's version (same weights on
        both sides), ``mismatch/kl`` (KL(inference || train), k3) and ``mismatch/max_abs_logp_diff``;
        ``mismatch/tokens`` counts them (0 when every token is stale)."""
        zeros = torch.zeros_like(log_w)
        m = F.mismatch_stats(log_w, zeros, same_version)
        return {
            "mismatch/kl": float(m["kl"]),
            "mismatch/max_abs_logp_diff": float(m["max_abs_diff"]),
            "mismatch/tokens": float(same_version.sum()),
        }

    # ---------------------------------------------------------------- pass-throughs of the loop

    def step_lr_scheduler(self) -> None:
        self.engine.step_lr_scheduler()

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        self.engine.update_weights(meta)


class PPOCritic:
    """A value model trained with PPO's clipped value loss, on a critic `TrainEngine`
    (``is_critic``: ``forward`` returns values ``[B, L]`` aligned to the token)::

        batch["values"] = critic.compute_values(batch)
        actor.compute_advantages(batch)     # adv_estimator=gae adds "returns"
        critic.ppo_update(batch)
    """

    def __init__(self, config: PPOCriticConfig, engine: TrainEngine) -> None:
        self.config = config
        self.engine = engine

    def compute_values(self, batch: TensorDict) -> torch.Tensor:
        return per_token_forward(self.engine, batch)

    def loss_fn(
        self, values: torch.Tensor, entropy: torch.Tensor, mb: PackedBatch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = mb["loss_mask"].bool()  # type: ignore[union-attr]
        per_token, stats = F.clipped_value_loss(values, mb["values"], mb["returns"], mask, self.config.value_eps_clip)
        out = {k: F.masked_mean(v, mask) for k, v in stats.items()}
        out["value_mean"] = F.masked_mean(values.detach(), mask)
        out["return_mean"] = F.masked_mean(mb["returns"], mask)  # type: ignore[arg-type]
        return F.token_mean(per_token, mask, mb["cu_seqlens"]), out  # type: ignore[arg-type]

    @staticmethod
    def loss_weight(mb: PackedBatch) -> float:
        return float(mb["loss_mask"].sum())  # type: ignore[union-attr]

    def ppo_update(self, batch: TensorDict) -> dict[str, float]:
        """``ppo_n_minibatches`` steps on the value loss against ``returns``, clipped around the
        rollout-time ``values``."""
        for key in ("values", "returns"):
            if key not in batch:
                raise ValueError(f"PPOCritic.ppo_update needs batch[{key!r}]")
        mbs = minibatches(batch, self.config.ppo_n_minibatches, self.config.group_size)
        stats = mean_stats([self.engine.train_batch(mb, self.loss_fn, self.loss_weight) for mb in mbs])
        return {f"critic/{k}": v for k, v in stats.items()}

    def step_lr_scheduler(self) -> None:
        self.engine.step_lr_scheduler()
