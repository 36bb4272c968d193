"""Actors on the real `FSDPEngine` (one process, gloo) with a tiny model: the PPO update at ratio
1 equals the plain policy-gradient update, the tangent update equals training on the loss that
produced the tangents, advantages land where the data contract says, and each actor's objective
moves the right way over a few steps."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from test_fsdp import torchrun

from areal_lite.actors import DistillActor, DPOActor, PPOActor, PPOCritic, ReinforceActor, SFTActor, train_on_tangents
from areal_lite.actors.distill import reverse_kl_advantage_fn, reverse_kl_with_baseline
from areal_lite.actors.ppo import minibatches
from areal_lite.algorithms import functional as F
from areal_lite.api.config import DPOConfig, OptimizerConfig, PPOActorConfig, PPOCriticConfig, TrainEngineConfig
from areal_lite.api.io import FinetuneSpec, MicroBatchSpec
from areal_lite.engines.train.fsdp import FSDPEngine
from areal_lite.utils.tiny import build_tiny_model

# Adam's first step is lr * g / (|g| + eps): with eps = lr much larger than |g| it is g itself,
# so parameter changes compare gradients without Adam's sign-like normalisation.
SGD_LIKE = OptimizerConfig(lr=1e3, eps=1e3, gradient_clipping=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(
        str(tmp_path_factory.mktemp("tiny")), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=300
    )


@contextmanager
def engines(*configs: TrainEngineConfig, frozen: tuple[int, ...] = ()) -> Iterator[list[FSDPEngine]]:
    """Initialised engines, destroyed in reverse order (the first owns the process group)."""
    made: list[FSDPEngine] = []
    try:
        for i, cfg in enumerate(configs):
            e = FSDPEngine(cfg)
            e.initialize(
                None if i in frozen else FinetuneSpec(total_train_epochs=1, dataset_size=100, train_batch_size=1)
            )
            made.append(e)
        yield made
    finally:
        for e in reversed(made):
            e.destroy()


def make_batch(n: int, seed: int = 0, vocab: int = 290, prompt: int = 3, max_gen: int = 6) -> TensorDict:
    """Random sequences: ``prompt`` prompt tokens then 1..max_gen completion tokens."""
    g = torch.Generator().manual_seed(seed)
    gen = torch.randint(1, max_gen + 1, (n,), generator=g)
    width = prompt + max_gen
    ids = torch.randint(0, vocab, (n, width), generator=g)
    pos = torch.arange(width).unsqueeze(0)
    attn = pos < (prompt + gen).unsqueeze(1)
    loss_mask = attn & (pos >= prompt)
    return TensorDict(
        {
            "input_ids": ids * attn,
            "attention_mask": attn,
            "loss_mask": loss_mask.int(),
            "logprobs": torch.zeros(n, width),
            "versions": torch.where(loss_mask, 0, -1).int(),
            "rewards": torch.randn(n, generator=g),
        },
        batch_size=[n],
    )


def params(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    return {
        k: v.full_tensor().clone() if hasattr(v, "full_tensor") else v.detach().clone()
        for k, v in engine.model.state_dict().items()
    }


def deltas(before: dict[str, torch.Tensor], engine: FSDPEngine) -> dict[str, torch.Tensor]:
    after = params(engine)
    return {k: after[k] - before[k] for k in before}


def assert_same_update(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    total = sum(float(v.abs().sum()) for v in a.values())
    assert total > 0, "the update did nothing"
    for k, v in a.items():
        torch.testing.assert_close(v, b[k], rtol=1e-4, atol=1e-6, msg=k)


# ----------------------------------------------------------------------------- invariants


def test_ppo_first_minibatch_equals_policy_gradient(model_dir):
    cfg = PPOActorConfig(
        path=model_dir, optimizer=SGD_LIKE, group_size=4, adv_estimator="grpo", eps_clip=0.1, c_clip=2.0
    )
    with engines(cfg, cfg) as (e_ppo, e_pg):
        batch = make_batch(8, seed=1)
        actor = PPOActor(cfg, e_ppo)
        batch["logprobs"] = actor.compute_logp(batch)  # on-policy: behaviour = proximal = current
        batch["prox_logp"] = actor.compute_logp(batch)
        actor.compute_advantages(batch)
        before = params(e_ppo)
        stats = actor.ppo_update(batch)
        assert stats["clip_frac"] == 0.0 and stats["importance_weight_max"] == pytest.approx(1.0)

        def pg_loss(logp, entropy, mb):
            mask = mb["loss_mask"].bool()
            return -(mb["advantages"] * logp)[mask].sum() / mask.sum(), {}

        e_pg.train_batch(batch, pg_loss, lambda mb: float(mb["loss_mask"].sum()))
        assert_same_update(deltas(before, e_ppo), deltas(before, e_pg))


def test_single_minibatch_takes_the_proximal_logp_from_the_update_itself(model_dir):
    """With one minibatch, ppo_update without ``prox_logp`` runs no extra forward pass and makes
    the same update and the same importance-weight statistics as with recomputed ``prox_logp``."""
    cfg = PPOActorConfig(path=model_dir, optimizer=SGD_LIKE, group_size=4, behav_imp_weight_cap=1.3)
    with engines(cfg, cfg) as (e_given, e_own):
        batch = make_batch(8, seed=3)
        given = PPOActor(cfg, e_given)
        current = given.compute_logp(batch)
        noise = 0.4 * torch.randn(current.shape, generator=torch.Generator().manual_seed(0))
        batch["logprobs"] = current + noise * batch["loss_mask"]  # an older behaviour policy
        given.compute_advantages(batch)
        own_batch = batch.clone()
        batch["prox_logp"] = given.compute_logp(batch)
        before = params(e_given)
        stats_given = given.ppo_update(batch)

        def no_forward(*args, **kwargs):
            raise AssertionError("the proximal log-probs should come from the update's own forward pass")

        e_own.forward = no_forward
        stats_own = PPOActor(cfg, e_own).ppo_update(own_batch)
        assert_same_update(deltas(before, e_given), deltas(before, e_own))
        assert 0 < stats_given["importance_weight_capped_frac"] < 1
        for key in ("loss", "importance_weight_mean", "importance_weight_max", "importance_weight_min",
                    "importance_weight_capped_frac", "clip_frac", "approx_kl"):  # fmt: skip
            assert stats_own[key] == pytest.approx(stats_given[key], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize(("loss_agg", "n_minibatches"), [("token-mean", 1), ("seq-mean-token-mean", 2)])
def test_zero_advantage_sequences_are_left_out_of_the_same_update(model_dir, loss_agg, n_minibatches):
    """Groups whose samples all got the same reward have zero advantages: they are not trained,
    and the update (and the loss) equal those of training on the whole batch."""
    cfgs = [
        PPOActorConfig(
            path=model_dir, optimizer=SGD_LIKE, group_size=4, loss_agg=loss_agg, ppo_n_minibatches=n_minibatches,
            behav_imp_weight_cap=1.5, mb_spec=MicroBatchSpec(n_mbs=2), skip_zero_advantage=skip,
        )
        for skip in (True, False)
    ]  # fmt: skip
    with engines(*cfgs) as (e_skip, e_all):
        batch = make_batch(16, seed=4)
        batch["rewards"][0:4] = 1.0  # groups 0 and 2 are uniform: zero advantages
        batch["rewards"][8:12] = 0.0
        skip, full = PPOActor(cfgs[0], e_skip), PPOActor(cfgs[1], e_all)
        assert skip.skip_zero_advantage and not full.skip_zero_advantage
        current = skip.compute_logp(batch)
        batch["logprobs"] = current + 0.3 * torch.randn(current.shape) * batch["loss_mask"]
        skip.compute_advantages(batch)
        rows = []
        train_batch = e_skip.train_batch
        e_skip.train_batch = lambda mb, *a: rows.append(mb.batch_size[0]) or train_batch(mb, *a)
        before = params(e_skip)
        stats_skip = skip.ppo_update(batch.clone())
        stats_full = full.ppo_update(batch.clone())
        assert sum(rows) == 8 and stats_skip["skipped_seq_frac"] == 0.5 and stats_full["skipped_seq_frac"] == 0.0
        assert_same_update(deltas(before, e_skip), deltas(before, e_all))
        assert stats_skip["loss"] == pytest.approx(stats_full["loss"], rel=1e-5, abs=1e-7)


def test_zero_advantage_skipping_is_off_when_the_loss_has_other_terms():
    cfg = PPOActorConfig(path="unused")
    assert PPOActor(cfg, None).skip_zero_advantage  # type: ignore[arg-type]
    for other in ({"entropy_coeff": 0.01}, {"kl_ctl": 0.1}):
        assert not PPOActor(PPOActorConfig(path="unused", **other), None, ref_engine=object()).skip_zero_advantage  # type: ignore[arg-type]
    with_kl_in_reward = PPOActorConfig(path="unused", kl_ctl=0.1, kl_in_reward=True)
    assert PPOActor(with_kl_in_reward, None, ref_engine=object()).skip_zero_advantage  # type: ignore[arg-type]
    assert not PPOActor(cfg, None, policy_loss=F.reinforce_policy_loss).skip_zero_advantage  # type: ignore[arg-type]


def test_decoupled_update_is_plain_ppo_when_behaviour_is_proximal(model_dir):
    """Decoupled PPO with behaviour = proximal makes the update of standard PPO (ratio to the old
    policy, clipped), written out here, with clipping active."""
    cfg = PPOActorConfig(path=model_dir, optimizer=SGD_LIKE, group_size=4, eps_clip=0.1, behav_imp_weight_cap=5.0)
    with engines(cfg, cfg) as (e_dec, e_ppo):
        batch = make_batch(8, seed=5)
        actor = PPOActor(cfg, e_dec)
        current = actor.compute_logp(batch)
        old = (
            current + 0.3 * torch.randn(current.shape, generator=torch.Generator().manual_seed(1)) * batch["loss_mask"]
        )
        batch["logprobs"] = old  # behaviour
        batch["prox_logp"] = old  # = proximal
        actor.compute_advantages(batch)
        before = params(e_dec)
        stats = actor.ppo_update(batch)
        assert 0 < stats["clip_frac"] < 1 and stats["importance_weight_max"] == pytest.approx(1.0)

        def plain_ppo(logp, entropy, mb):
            mask = mb["loss_mask"].bool()
            ratio = torch.exp(logp - mb["logprobs"])
            a = mb["advantages"]
            per_token = -torch.minimum(ratio * a, ratio.clamp(0.9, 1.1) * a)
            return per_token[mask].sum() / mask.sum(), {}

        e_ppo.train_batch(batch, plain_ppo, lambda mb: float(mb["loss_mask"].sum()))
        assert_same_update(deltas(before, e_dec), deltas(before, e_ppo))


def test_mismatch_statistics_compare_tokens_of_the_current_version(model_dir):
    """``mismatch/*`` look only at tokens produced by the weights the trainer holds (version 2
    here); stale tokens (version 1) differ by much more and are left out."""
    cfg = PPOActorConfig(path=model_dir, optimizer=SGD_LIKE, group_size=4, behav_imp_weight_cap=None)
    with engines(cfg) as (engine,):
        engine.set_version(2)
        batch = make_batch(8, seed=6)
        actor = PPOActor(cfg, engine)
        current = actor.compute_logp(batch)
        mask = batch["loss_mask"].bool()
        fresh = torch.arange(8).unsqueeze(1) < 4
        noise = torch.where(fresh, 0.01, 0.5) * torch.randn(current.shape, generator=torch.Generator().manual_seed(2))
        batch["logprobs"] = (current + noise) * mask
        batch["versions"] = torch.where(mask, torch.where(fresh, 2, 1), -1).int()
        actor.compute_advantages(batch)
        stats = actor.ppo_update(batch)
        same = mask & fresh
        assert stats["mismatch/tokens"] == float(same.sum())
        assert stats["mismatch/max_abs_logp_diff"] == pytest.approx(float(noise[same].abs().max()), abs=1e-5)
        log_r = -noise[same].double()  # log(pi_train / pi_infer)
        assert stats["mismatch/kl"] == pytest.approx(float((log_r.exp() - 1 - log_r).mean()), rel=1e-3, abs=1e-7)


def test_distillation_moves_the_student_towards_the_teacher(model_dir, tmp_path):
    """A few DistillActor updates on the student's tokens shrink the student-teacher gap in
    log-probability on those tokens (the teacher is another tiny model)."""
    teacher_dir = build_tiny_model(
        str(tmp_path / "teacher"), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=300, seed=7
    )
    student_cfg = PPOActorConfig(
        path=model_dir, optimizer=OptimizerConfig(lr=2e-3, gradient_clipping=0.0), discount=0.0, group_size=1
    )
    with engines(student_cfg, TrainEngineConfig(path=teacher_dir), frozen=(1,)) as (student, teacher):
        actor = DistillActor(student_cfg, student, teacher=teacher.forward)
        tokens = make_batch(8, seed=7)
        mask = tokens["loss_mask"].bool()
        gaps = []
        for _ in range(6):
            batch = tokens.clone()
            batch["logprobs"] = actor.compute_logp(batch) * mask  # on-policy log-probs of these tokens
            actor.compute_advantages(batch)
            gaps.append(float((batch["logprobs"] - batch["teacher_logp"])[mask].abs().mean()))
            actor.ppo_update(batch)
        assert gaps[-1] < 0.5 * gaps[0], gaps


def test_tangent_update_equals_training_on_the_loss(model_dir):
    cfg = TrainEngineConfig(path=model_dir, optimizer=SGD_LIKE, mb_spec=MicroBatchSpec(n_mbs=3))
    with engines(cfg, cfg) as (e_tan, e_loss):
        batch = make_batch(7, seed=2)
        adv = torch.randn(batch["input_ids"].shape, generator=torch.Generator().manual_seed(0))
        mask = batch["loss_mask"].bool()

        def my_loss(logp: torch.Tensor) -> torch.Tensor:
            # any function of the log-probabilities: a policy gradient term plus a nonlinear pull
            return ((-adv * logp + 0.5 * (logp + 3.0) ** 2) * mask).sum() / mask.sum()

        logp = e_tan.forward(batch).requires_grad_(True)
        (tangents,) = torch.autograd.grad(my_loss(logp), logp)
        before = params(e_tan)
        train_on_tangents(e_tan, batch, tangents)

        data = batch.clone(recurse=False)
        data["adv"] = adv

        def loss_fn(logp, entropy, mb):
            m = mb["loss_mask"].bool()
            return ((-mb["adv"] * logp + 0.5 * (logp + 3.0) ** 2) * m).sum() / m.sum().clamp(min=1), {}

        e_loss.train_batch(data, loss_fn, lambda mb: float(mb["loss_mask"].sum()))
        assert_same_update(deltas(before, e_tan), deltas(before, e_loss))


# ----------------------------------------------------------------------------- advantages in the batch


class NoEngine:
    """Advantages need no engine unless a reference or critic is involved."""


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "remax", "reinforce_pp", "gae"])
def test_compute_advantages_follows_the_data_contract(estimator):
    batch = make_batch(8, seed=3)
    batch["rewards"][:4] = 1.0  # the first group has equal rewards
    batch["baseline_rewards"] = torch.full((8,), 0.5)
    batch["values"] = torch.randn(batch["input_ids"].shape) * batch["attention_mask"]
    cfg = PPOActorConfig(path="unused", group_size=4, adv_estimator=estimator, discount=0.9, gae_lambda=0.8)
    PPOActor(cfg, NoEngine()).compute_advantages(batch)  # type: ignore[arg-type]
    adv, mask = batch["advantages"], batch["loss_mask"].bool()
    assert adv.shape == mask.shape and adv.dtype == torch.float32
    assert adv[~mask].abs().max() == 0
    rewards = batch["rewards"]
    if estimator in ("grpo", "dr_grpo", "rloo"):
        assert adv[:4].abs().max() == 0  # equal rewards: no signal
        expected = {
            "grpo": F.grpo_advantages(rewards, 4),
            "dr_grpo": F.grpo_advantages(rewards, 4, scale_by_std=False),
            "rloo": F.rloo_advantages(rewards, 4),
        }[estimator]
        for i in range(8):
            assert torch.allclose(adv[i][mask[i]], expected[i].expand(int(mask[i].sum())))
    if estimator == "remax":
        assert torch.allclose(adv[mask], (rewards - 0.5).unsqueeze(1).expand_as(mask)[mask])
    if estimator == "gae":
        assert "returns" in batch
        assert torch.allclose(batch["returns"][mask], adv[mask] + batch["values"][mask])


def test_missing_inputs_are_named():
    batch = make_batch(4)
    with pytest.raises(ValueError, match="baseline_rewards"):
        PPOActor(PPOActorConfig(path="x", adv_estimator="remax"), NoEngine()).compute_advantages(batch)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="values"):
        PPOActor(PPOActorConfig(path="x", adv_estimator="gae"), NoEngine()).compute_advantages(batch)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reference engine"):
        PPOActor(PPOActorConfig(path="x", kl_ctl=0.1), NoEngine())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="choose one of"):
        PPOActor(PPOActorConfig(path="x", policy_loss="trpo"), NoEngine())  # type: ignore[arg-type]


def test_reward_shaping_and_truncation():
    batch = make_batch(4, seed=4, max_gen=6)
    batch["rewards"] = torch.tensor([1.0, 1.0, 1.0, 1.0])
    gen = batch["loss_mask"].sum(1)
    cfg = PPOActorConfig(
        path="x",
        reward_bias=1.0,
        reward_scaling=0.5,
        mask_truncated=True,
        max_new_tokens=6,
        overlong_penalty_len=2,
        overlong_penalty_factor=1.0,
    )
    shaped = PPOActor(cfg, NoEngine()).shaped_rewards(batch)  # type: ignore[arg-type]
    expected = (1.0 + F.overlong_penalty(gen, 6, 2) + 1.0) * 0.5
    expected[gen >= 6] = 0.0
    torch.testing.assert_close(shaped, expected)


def test_kl_in_the_reward_lowers_the_sequence_reward():
    batch = make_batch(8, seed=10)
    mask = batch["loss_mask"].bool()
    batch["logprobs"] = -torch.rand(batch["input_ids"].shape) * mask
    batch["ref_logp"] = batch["logprobs"] - 0.5 * mask  # the policy is more confident than the reference
    cfg = PPOActorConfig(
        path="x",
        group_size=8,
        adv_estimator="grpo",
        adv_norm_level="none",
        kl_ctl=0.2,
        kl_in_reward=True,
        kl_estimator="k1",
    )
    PPOActor(cfg, NoEngine(), ref_engine=NoEngine()).compute_advantages(batch)  # type: ignore[arg-type]
    expected = batch["rewards"] - 0.2 * 0.5 * mask.sum(1)
    for i in range(8):
        assert torch.allclose(batch["advantages"][i][mask[i]], expected[i].expand(int(mask[i].sum())))


def test_actor_loss_adds_the_kl_and_entropy_terms():
    """The actor's micro-batch loss against a float64 reference: PPO surrogate + KL(k2) - entropy."""
    g = torch.Generator().manual_seed(11)
    t = 9
    mb = {
        "loss_mask": torch.tensor([0, 1, 1, 1, 0, 0, 1, 1, 1]),
        "cu_seqlens": torch.tensor([0, 4, 9], dtype=torch.int32),
        "prox_logp": -torch.rand(t, generator=g, dtype=torch.float64),
        "advantages": torch.randn(t, generator=g, dtype=torch.float64),
        "ref_logp": -torch.rand(t, generator=g, dtype=torch.float64),
    }
    mb["behav_logp"] = mb["prox_logp"]
    logp = mb["prox_logp"] + 0.3 * torch.randn(t, generator=g, dtype=torch.float64)
    entropy = torch.rand(t, generator=g, dtype=torch.float64)
    cfg = PPOActorConfig(path="x", kl_ctl=0.1, kl_estimator="k2", entropy_coeff=0.05, eps_clip=0.2)
    loss, stats = PPOActor(cfg, NoEngine(), ref_engine=NoEngine()).loss_fn(logp, entropy, mb)  # type: ignore[arg-type]
    terms = []
    for j in range(t):
        if not mb["loss_mask"][j]:
            continue
        r = torch.exp(logp[j] - mb["prox_logp"][j])
        a = mb["advantages"][j]
        surrogate = max(-a * r, -a * r.clamp(0.8, 1.2))
        terms.append(surrogate + 0.1 * 0.5 * (logp[j] - mb["ref_logp"][j]) ** 2 - 0.05 * entropy[j])
    torch.testing.assert_close(loss, sum(terms) / len(terms))
    assert set(stats) >= {"clip_frac", "approx_kl", "entropy", "kl_ref"}


def test_kl_to_the_reference_is_reported_when_it_is_in_the_reward():
    """With the KL penalty in the reward the loss has no KL term, but the update still reports
    ``kl_ref`` (the statistic the logger's KL warning watches)."""
    g = torch.Generator().manual_seed(12)
    t = 6
    mb = {
        "loss_mask": torch.tensor([0, 1, 1, 0, 1, 1]),
        "cu_seqlens": torch.tensor([0, 3, 6], dtype=torch.int32),
        "prox_logp": -torch.rand(t, generator=g, dtype=torch.float64),
        "advantages": torch.randn(t, generator=g, dtype=torch.float64),
        "ref_logp": -torch.rand(t, generator=g, dtype=torch.float64),
    }
    logp = mb["prox_logp"] + 0.1 * torch.randn(t, generator=g, dtype=torch.float64)
    entropy = torch.zeros(t, dtype=torch.float64)
    in_reward = PPOActorConfig(path="x", kl_ctl=0.1, kl_in_reward=True, kl_estimator="k1")
    loss, stats = PPOActor(in_reward, NoEngine(), ref_engine=NoEngine()).loss_fn(logp, entropy, mb)  # type: ignore[arg-type]
    plain, _ = PPOActor(PPOActorConfig(path="x"), NoEngine()).loss_fn(logp, entropy, mb)  # type: ignore[arg-type]
    torch.testing.assert_close(loss, plain)
    m = mb["loss_mask"].bool()
    assert stats["kl_ref"].item() == pytest.approx(float((logp - mb["ref_logp"])[m].mean()))


def test_config_picks_the_behaviour_weight_and_the_policy_loss():
    """``behav_imp_weight_mode`` and its band reach the loss as an importance-weight function;
    the default stays decoupled PPO's cap."""
    default = PPOActor(PPOActorConfig(path="x", behav_imp_weight_cap=3.0), NoEngine()).policy_loss  # type: ignore[arg-type]
    assert default.func is F.ppo_policy_loss and default.keywords["behav_imp_weight_cap"] == 3.0  # type: ignore[attr-defined]
    cfg = PPOActorConfig(
        path="x", policy_loss="cispo", behav_imp_weight_mode="sequence_mask", behav_imp_weight_floor=0.5,
        behav_imp_weight_cap=2.0, eps_clip=1.0, eps_clip_higher=0.3,
    )  # fmt: skip
    loss = PPOActor(cfg, NoEngine()).policy_loss  # type: ignore[arg-type]
    assert loss.func is F.cispo_policy_loss and "behav_imp_weight_cap" not in loss.keywords  # type: ignore[attr-defined]
    weight = loss.keywords["importance_weight"]  # type: ignore[attr-defined]
    assert weight.func is F.sequence_mask_weight and weight.keywords == {"low": 0.5, "high": 2.0}
    assert loss.keywords["eps_clip_higher"] == 0.3  # type: ignore[attr-defined]


class FixedStudent:
    """A student engine whose forward returns fixed log-probabilities."""

    def __init__(self, logp: torch.Tensor) -> None:
        self.logp = logp

    def forward(self, b: TensorDict) -> torch.Tensor:
        return self.logp


def distill_case(n: int, seed: int) -> tuple[TensorDict, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch, its answer mask, and random log-probabilities of the trained student and the teacher."""
    batch = make_batch(n, seed=seed)
    mask = batch["loss_mask"].bool()
    return batch, mask, -torch.rand(batch["input_ids"].shape) * mask, -torch.rand(batch["input_ids"].shape)


def test_distill_actor_advantages_are_the_reverse_kl_of_the_trained_student_to_the_teacher():
    """The student's log-probabilities in the reward are the trained (proximal) student's, not the
    sampling ones: with stale samples the two differ."""
    batch, mask, current, teacher_logp = distill_case(4, seed=13)
    batch["logprobs"] = -torch.rand(batch["input_ids"].shape) * mask  # an older student sampled
    cfg = PPOActorConfig(path="x", discount=0.0)
    actor = DistillActor(cfg, FixedStudent(current), teacher=lambda b: teacher_logp)  # type: ignore[arg-type]
    actor.compute_advantages(batch)
    torch.testing.assert_close(batch["prox_logp"], current)
    torch.testing.assert_close(batch["advantages"], (teacher_logp - current) * mask)
    stats = actor.batch_stats(batch, torch.zeros(0))
    assert stats["reverse_kl_mean"] == pytest.approx(float((current - teacher_logp)[mask].mean()), rel=1e-6, abs=1e-6)


def test_distill_baseline_centres_the_reverse_kl_at_each_answer_position():
    """With `reverse_kl_with_baseline` the k-th answer token's advantage is its reverse-KL term minus
    the batch's mean term at answer position k (every prompt here has 3 tokens, so position k is
    column 3 + k)."""
    batch, mask, current, teacher_logp = distill_case(6, seed=14)
    cfg = PPOActorConfig(path="x", discount=0.0)
    advantages = reverse_kl_with_baseline
    actor = DistillActor(cfg, FixedStudent(current), teacher=lambda b: teacher_logp, advantage_fn=advantages)  # type: ignore[arg-type]
    actor.compute_advantages(batch)
    kl_term = (teacher_logp - current) * mask
    column_mean = kl_term.sum(0) / mask.sum(0).clamp(min=1)
    torch.testing.assert_close(batch["advantages"], (kl_term - column_mean) * mask)


def test_distill_clip_bounds_each_reverse_kl_term_before_the_baseline():
    """`reverse_kl_advantage_fn(baseline=True, clip=c)`: each token's term is clamped to [-c, c],
    then the per-position mean of the clamped terms is subtracted."""
    batch, mask, current, teacher_logp = distill_case(6, seed=15)
    teacher_logp = 4.0 * teacher_logp  # terms down to -4 nats
    cfg = PPOActorConfig(path="x", discount=0.0)
    advantages = reverse_kl_advantage_fn(baseline=True, clip=1.0)
    actor = DistillActor(cfg, FixedStudent(current), teacher=lambda b: teacher_logp, advantage_fn=advantages)  # type: ignore[arg-type]
    actor.compute_advantages(batch)
    kl_term = (teacher_logp - current).clamp(-1.0, 1.0) * mask
    assert bool(((teacher_logp - current).abs() > 1.0)[mask].any())
    column_mean = kl_term.sum(0) / mask.sum(0).clamp(min=1)
    torch.testing.assert_close(batch["advantages"], (kl_term - column_mean) * mask)


def test_minibatches_keep_groups_and_refuse_too_few():
    batch = make_batch(12, seed=12)
    batch["rewards"] = torch.arange(12.0)
    mbs = minibatches(batch, 3, group_size=4)
    assert sorted(int(r) for mb in mbs for r in mb["rewards"]) == list(range(12))
    for mb in mbs:
        assert mb.batch_size[0] == 4 and int(mb["rewards"][0]) % 4 == 0
    with pytest.raises(ValueError, match="minibatches"):
        minibatches(batch, 4, group_size=4)


# ----------------------------------------------------------------------------- the update and its statistics


def test_ppo_update_statistics_and_minibatches(model_dir):
    cfg = PPOActorConfig(
        path=model_dir,
        optimizer=OptimizerConfig(lr=1e-2),
        group_size=2,
        ppo_n_minibatches=2,
        eps_clip=0.2,
        kl_ctl=0.1,
        kl_estimator="k3",
        entropy_coeff=0.01,
        behav_imp_weight_cap=1.5,
    )
    with engines(cfg, cfg, frozen=(1,)) as (policy, ref):
        actor = PPOActor(cfg, policy, ref_engine=ref)
        batch = make_batch(8, seed=5)
        behav = actor.compute_logp(batch)
        batch["logprobs"] = behav + 0.3 * torch.randn(behav.shape) * batch["loss_mask"]  # an older behaviour policy
        batch["prox_logp"] = actor.compute_logp(batch)
        actor.compute_advantages(batch)
        stats = actor.ppo_update(batch)
        for key in (
            "loss",
            "clip_frac",
            "approx_kl",
            "entropy",
            "kl_ref",
            "importance_weight_mean",
            "importance_weight_max",
            "importance_weight_capped_frac",
            "advantage_mean",
            "advantage_std",
            "reward_mean",
            "reward_std",
            "tokens_trained",
            "grad_norm",
        ):
            assert key in stats, key
        assert stats["tokens_trained"] == float(batch["loss_mask"].sum())
        assert stats["importance_weight_capped_frac"] > 0
        # the second minibatch is trained after the first step: its ratio is no longer 1
        assert stats["approx_kl"] > 0
        # KL(behaviour || proximal) of the 0.3-nat perturbation: about E[(e^x - 1) - x] = 0.046
        assert 0.02 < stats["behav_kl"] < 0.08
        actor.step_lr_scheduler()


def test_critic_fits_the_returns(model_dir):
    cfg = PPOCriticConfig(path=model_dir, optimizer=OptimizerConfig(lr=3e-3), value_eps_clip=None)
    assert cfg.is_critic
    with engines(cfg) as (engine,):
        critic = PPOCritic(cfg, engine)
        batch = make_batch(8, seed=6)
        values = critic.compute_values(batch)
        assert values.shape == batch["attention_mask"].shape and values[:, 0].abs().max() == 0
        batch["returns"] = batch["loss_mask"].float() * 0.7
        losses = []
        for _ in range(15):
            batch["values"] = critic.compute_values(batch)
            losses.append(critic.ppo_update(batch)["critic/loss"])
        assert losses[-1] < 0.2 * losses[0]


def test_reinforce_actor_raises_the_reward_of_preferred_tokens(model_dir):
    """Reward = fraction of completion tokens below 100: REINFORCE with an RLOO baseline makes
    them likelier (measured on the batch's own tokens: the log-prob of rewarded sequences rises)."""
    cfg = PPOActorConfig(path=model_dir, optimizer=OptimizerConfig(lr=1e-2), group_size=4, adv_estimator="rloo")
    with engines(cfg) as (engine,):
        actor = ReinforceActor(cfg, engine)
        batch = make_batch(16, seed=7)
        batch["rewards"] = ((batch["input_ids"] < 100) & batch["loss_mask"].bool()).sum(1) / batch["loss_mask"].sum(1)
        before = actor.compute_logp(batch)
        for _ in range(3):
            batch["logprobs"] = actor.compute_logp(batch)
            actor.train_step(batch)
        gain = ((actor.compute_logp(batch) - before) * batch["loss_mask"]).sum(1)
        adv = F.rloo_advantages(batch["rewards"].float(), 4)
        assert (gain * adv).sum() > 0 and gain[adv > 0].mean() > gain[adv < 0].mean()


def test_dpo_actor_raises_the_preference_margin(model_dir):
    cfg = DPOConfig(
        path=model_dir, optimizer=OptimizerConfig(lr=1e-2), beta=0.5, mb_spec=MicroBatchSpec(n_mbs=2, granularity=2)
    )
    with pytest.raises(ValueError, match="granularity"):
        DPOActor(DPOConfig(path=model_dir), None, None)  # type: ignore[arg-type]
    with engines(cfg, cfg, frozen=(1,)) as (policy, ref):
        actor = DPOActor(cfg, policy, ref)
        batch = make_batch(8, seed=8)
        first = actor.train_dpo(batch)
        assert first["reward_margin"] == pytest.approx(0.0, abs=1e-5)  # policy == reference at the start
        for _ in range(4):
            last = actor.train_dpo(batch)
        assert last["reward_margin"] > 0.5 and last["reward_accuracy"] == 1.0 and last["loss"] < first["loss"]
    ipo = DPOConfig(path=model_dir, dpo_loss="ipo", mb_spec=MicroBatchSpec(granularity=2))
    assert DPOActor(ipo, None, None).loss is F.ipo_loss  # type: ignore[arg-type]


def test_sft_actor_lowers_the_nll(model_dir):
    cfg = TrainEngineConfig(path=model_dir, optimizer=OptimizerConfig(lr=1e-2), mb_spec=MicroBatchSpec(n_mbs=2))
    with engines(cfg) as (engine,):
        actor = SFTActor(cfg, engine)
        batch = make_batch(8, seed=9)
        first = actor.evaluate_lm(batch)
        for _ in range(5):
            actor.train_lm(batch)
        last = actor.evaluate_lm(batch)
        assert last["loss"] < 0.7 * first["loss"] and last["tokens_trained"] == float(batch["loss_mask"].sum())


def test_ppo_update_on_two_ranks_equals_one_rank(model_dir, tmp_path):
    """Global loss weighting through the actor: seq-mean-token-mean with clipping and the cap on,
    each rank holding half of the groups and leaving out its zero-advantage ones (one rank has
    nothing else), gives the one-rank update on the whole batch."""
    sys.path.insert(0, str(Path(__file__).parent / "scripts"))
    from actor_worker import ppo_delta

    one, stats_one = ppo_delta(model_dir, skip_zero_advantage=False)
    assert stats_one["clip_frac"] > 0 and stats_one["importance_weight_capped_frac"] > 0
    code, output = torchrun(2, Path(__file__).parent / "scripts" / "actor_worker.py", model_dir, str(tmp_path))
    assert code == 0, output[-4000:]
    two = torch.load(tmp_path / "ppo_delta_w2.pt")["delta"]
    assert_same_update(one, two)


@pytest.mark.slow
def test_every_algorithm_raises_its_objective(tmp_path):
    """benchmarks/algorithms.py end to end (about 1.5 minutes on 2 idle cores)."""
    script = Path(__file__).parent.parent / "benchmarks" / "algorithms.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--steps", "60"], capture_output=True, text=True, timeout=900, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1]
    assert "raised=7/7" in result, proc.stdout[-3000:]
