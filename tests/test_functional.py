"""The loss and advantage functions against independent float64 references written here, token by
token and sequence by sequence in plain loops (values and gradients), with the edge cases: empty
masks, single-token sequences, groups with equal rewards, truncated sequences."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from areal_lite.algorithms import functional as F

D = torch.float64


def make_packed(lens: list[int], seed: int = 0, empty: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """A packed batch: sequence lengths ``lens``, prompt of 1-2 tokens then completion in the mask;
    the sequences listed in ``empty`` have no masked token."""
    g = torch.Generator().manual_seed(seed)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    mask = []
    for i, n in enumerate(lens):
        prompt = min(n - 1, 1 + i % 2) if n > 1 else 0
        mask += [0] * prompt + [0 if i in empty else 1] * (n - prompt)
    t = int(cu[-1])
    behav = -torch.rand(t, generator=g, dtype=D) * 2
    return {
        "cu": cu,
        "mask": torch.tensor(mask, dtype=torch.bool),
        "behav": behav,
        "prox": behav + 0.3 * torch.randn(t, generator=g, dtype=D),
        "logp": behav + 0.3 * torch.randn(t, generator=g, dtype=D),
        "adv": torch.randn(t, generator=g, dtype=D),
        "values": torch.randn(t, generator=g, dtype=D),
        "rewards": torch.randn(t, generator=g, dtype=D),
    }


def spans(cu: torch.Tensor) -> list[tuple[int, int]]:
    return [(int(cu[i]), int(cu[i + 1])) for i in range(cu.numel() - 1)]


def ref_aggregate(per_token: list[torch.Tensor], mask: torch.Tensor, cu: torch.Tensor, how: str) -> torch.Tensor:
    """Aggregate a list of per-token scalar losses, the reference way."""
    total, count, seq_terms = torch.zeros((), dtype=D), 0, []
    for s, e in spans(cu):
        toks = [per_token[j] for j in range(s, e) if mask[j]]
        if not toks:
            continue
        total = total + sum(toks)
        count += len(toks)
        seq_terms.append(sum(toks) / len(toks) if how == "seq-mean-token-mean" else sum(toks))
    if how == "token-mean":
        return total / max(count, 1)
    return sum(seq_terms) / len(seq_terms) if seq_terms else torch.zeros((), dtype=D)


def assert_value_and_grad(ours_fn, ref_fn, x: torch.Tensor) -> None:
    a = x.clone().requires_grad_(True)
    b = x.clone().requires_grad_(True)
    ours, ref = ours_fn(a), ref_fn(b)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
    ga = (
        torch.autograd.grad(ours, a, allow_unused=True, materialize_grads=True)[0]
        if ours.requires_grad
        else torch.zeros_like(a)
    )
    gb = (
        torch.autograd.grad(ref, b, allow_unused=True, materialize_grads=True)[0]
        if ref.requires_grad
        else torch.zeros_like(b)
    )
    torch.testing.assert_close(ga, gb, rtol=1e-10, atol=1e-12)


LENS = [5, 1, 7, 3, 4]
CASES = [{}, {"empty": (2,)}, {"empty": (0, 1, 2, 3, 4)}]


# ----------------------------------------------------------------------------- helpers


def test_masked_statistics_and_empty_masks():
    x = torch.tensor([1.0, 2.0, 3.0, 10.0], dtype=D)
    m = torch.tensor([1, 1, 1, 0], dtype=torch.bool)
    assert F.masked_mean(x, m).item() == pytest.approx(2.0)
    assert F.masked_std(x, m).item() == pytest.approx(math.sqrt(2 / 3))
    w = F.whiten(x, m)
    assert w[3] == 0 and w[:3].mean().item() == pytest.approx(0.0, abs=1e-12)
    assert w[:3].pow(2).mean().item() == pytest.approx(1.0, rel=1e-6)
    empty = torch.zeros(4, dtype=torch.bool)
    for v in (F.masked_mean(x, empty), F.masked_std(x, empty), F.whiten(x, empty).abs().sum()):
        assert v.item() == 0.0


def test_segment_helpers():
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    assert F.seq_sum(x, cu).tolist() == [3.0, 0.0, 12.0]
    assert F.to_tokens(torch.tensor([7.0, 8.0, 9.0]), cu).tolist() == [7.0, 7.0, 9.0, 9.0, 9.0]


def test_last_token_rewards():
    cu = torch.tensor([0, 3, 4, 8, 10], dtype=torch.int32)
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 0, 0, 0], dtype=torch.bool)
    out = F.last_token_rewards(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask, cu)
    # seq 2 has an unmasked (environment) token after its completion; seq 3 has no masked token
    assert out.tolist() == [0, 0, 1, 2, 0, 0, 3, 0, 0, 0]


# ----------------------------------------------------------------------------- rewards


def test_shape_rewards_and_truncation():
    r = torch.tensor([-30.0, 0.5, 1.0, 40.0])
    assert F.shape_rewards(r, bias=-0.5, scale=2.0, clip=20.0).tolist() == [-20.0, 0.0, 1.0, 20.0]
    assert F.shape_rewards(r, clip=None).tolist() == r.tolist()
    truncated = torch.tensor([False, True, False, True])
    assert F.zero_truncated_rewards(r, truncated).tolist() == [-30.0, 0.0, 1.0, 0.0]


def test_overlong_penalty_matches_dapo_eq13():
    l_max, l_cache = 20, 8
    lens = torch.arange(0, 26)
    ours = F.overlong_penalty(lens, l_max, l_cache, factor=1.0)
    for n, v in zip(lens.tolist(), ours.tolist()):
        if n <= l_max - l_cache:
            ref = 0.0
        elif n <= l_max:
            ref = ((l_max - l_cache) - n) / l_cache
        else:
            ref = -1.0
        assert v == pytest.approx(ref)
    assert F.overlong_penalty(torch.tensor([20]), l_max, l_cache, factor=0.5).item() == pytest.approx(-0.5)


# ----------------------------------------------------------------------------- advantages


def ref_group_norm(rewards: list[float], g: int, scale: bool, level: str, eps: float = 1e-6) -> list[float]:
    groups = [rewards[i : i + g] for i in range(0, len(rewards), g)] if level == "group" else [rewards]
    out = []
    for grp in groups:
        mean = sum(grp) / len(grp)
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / len(grp))
        out += [(x - mean) / (std + eps) if scale else x - mean for x in grp]
    return out


@pytest.mark.parametrize("level", ["group", "batch"])
@pytest.mark.parametrize("scale", [True, False])
def test_grpo_advantages(level, scale):
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 3.0, -1.0, 2.0, 0.0]  # group 2 has equal rewards
    ours = F.grpo_advantages(torch.tensor(rewards, dtype=D), 4, level=level, scale_by_std=scale)
    torch.testing.assert_close(ours, torch.tensor(ref_group_norm(rewards, 4, scale, level), dtype=D))
    if level == "group":
        assert ours[4:8].abs().max().item() == 0.0


def test_grpo_group_of_one_and_bad_sizes():
    assert F.grpo_advantages(torch.tensor([3.0, -2.0]), 1).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError):
        F.grpo_advantages(torch.ones(5), 2)


def test_rloo_and_remax_advantages():
    rewards = [1.0, 0.0, 2.0, 5.0, 5.0, 5.0]
    ours = F.rloo_advantages(torch.tensor(rewards, dtype=D), 3)
    ref = []
    for i in range(0, 6, 3):
        grp = rewards[i : i + 3]
        ref += [grp[k] - sum(grp[j] for j in range(3) if j != k) / 2 for k in range(3)]
    torch.testing.assert_close(ours, torch.tensor(ref, dtype=D))
    assert ours[3:].abs().max().item() == 0.0
    with pytest.raises(ValueError):
        F.rloo_advantages(torch.ones(4), 1)
    assert F.remax_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0.25, 0.5])).tolist() == [0.75, -0.5]


def ref_gae(r: list[float], v: list[float], m: list[bool], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """GAE over the masked positions of one sequence, as a list of (reward, value) steps."""
    steps = [j for j in range(len(r)) if m[j]]
    adv, ret = [0.0] * len(r), [0.0] * len(r)
    running = 0.0
    for k in reversed(range(len(steps))):
        j = steps[k]
        next_v = v[steps[k + 1]] if k + 1 < len(steps) else 0.0
        running = r[j] + gamma * next_v - v[j] + gamma * lam * running
        adv[j], ret[j] = running, running + v[j]
    return adv, ret


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95), (0.5, 0.0)])
def test_gae_and_returns(case, gamma, lam):
    b = make_packed(LENS, seed=1, **case)
    b["mask"][3] = False  # an environment token inside a completion (multi-turn)
    adv, ret = F.gae_advantages(b["rewards"], b["values"], b["mask"], b["cu"], gamma, lam)
    ref_adv, ref_ret = [], []
    for s, e in spans(b["cu"]):
        a, r = ref_gae(b["rewards"][s:e].tolist(), b["values"][s:e].tolist(), b["mask"][s:e].tolist(), gamma, lam)
        ref_adv += a
        ref_ret += r
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=D))
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=D))
    disc = F.discounted_returns(b["rewards"], b["mask"], b["cu"], gamma)
    ref_disc = []
    for s, e in spans(b["cu"]):
        ref_disc += ref_gae(b["rewards"][s:e].tolist(), [0.0] * (e - s), b["mask"][s:e].tolist(), gamma, 1.0)[1]
    torch.testing.assert_close(disc, torch.tensor(ref_disc, dtype=D))


def test_reinforce_pp_whitens_the_returns_over_the_batch():
    b = make_packed(LENS, seed=2, empty=(1,))
    ours = F.reinforce_pp_advantages(b["rewards"], b["mask"], b["cu"], gamma=0.9)
    disc = []
    for s, e in spans(b["cu"]):
        disc += ref_gae(b["rewards"][s:e].tolist(), [0.0] * (e - s), b["mask"][s:e].tolist(), 0.9, 1.0)[1]
    vals = [d for d, m in zip(disc, b["mask"].tolist()) if m]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((x - mean) ** 2 for x in vals) / len(vals) + 1e-8)
    ref = [(d - mean) / std if m else 0.0 for d, m in zip(disc, b["mask"].tolist())]
    torch.testing.assert_close(ours, torch.tensor(ref, dtype=D))


# ----------------------------------------------------------------------------- KL


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_kl_estimators(name):
    b = make_packed(LENS, seed=3)
    ref_logp = b["prox"]
    fn = F.KL_ESTIMATORS[name]

    def ref(logp: torch.Tensor) -> torch.Tensor:
        out = []
        for j in range(logp.numel()):
            lr = ref_logp[j] - logp[j]  # log(pi_ref / pi)
            out.append({"k1": -lr, "k2": lr**2 / 2, "k3": torch.exp(lr) - 1 - lr}[name])
        return sum(out)

    assert_value_and_grad(lambda x: fn(x, ref_logp).sum(), ref, b["logp"])
    same = fn(ref_logp, ref_logp)
    assert same.abs().max().item() == 0.0
    if name != "k1":
        assert (fn(b["logp"], ref_logp) >= 0).all()


def test_k3_is_unbiased_for_kl():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=D)
    q = torch.tensor([0.2, 0.2, 0.6], dtype=D)
    exact = (p * (p / q).log()).sum()
    expectation = (p * F.kl_k3(p.log(), q.log())).sum()
    torch.testing.assert_close(expectation, exact)


# ----------------------------------------------------------------------------- policy losses


def ref_ppo_token(lp, prox, behav, a, eps_lo, eps_hi, c_clip, cap):
    ratio = torch.exp(lp - prox)
    unclipped = -a * ratio
    clipped_ratio = ratio
    if ratio < 1 - eps_lo:
        clipped_ratio = torch.full_like(ratio, 1 - eps_lo)
    elif ratio > 1 + eps_hi:
        clipped_ratio = torch.full_like(ratio, 1 + eps_hi)
    clipped = -a * clipped_ratio
    loss = max(unclipped, clipped)
    if c_clip is not None and a < 0 and loss > -c_clip * a:
        loss = -c_clip * a
    w = math.exp(float(prox - behav))
    if cap is not None and w > cap:
        w = 0.0
    return loss * w


PPO_VARIANTS = [
    {"eps_clip": 0.2},
    {"eps_clip": 0.2, "eps_clip_higher": 0.28},
    {"eps_clip": 0.1, "c_clip": 1.5},
    {"eps_clip": 0.2, "behav_imp_weight_cap": 1.2},
    {"eps_clip": 0.2, "eps_clip_higher": 0.3, "c_clip": 2.0, "behav_imp_weight_cap": 1.5},
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("agg", list(F.AGGREGATIONS))
@pytest.mark.parametrize("kw", PPO_VARIANTS)
def test_ppo_policy_loss(case, agg, kw):
    b = make_packed(LENS, seed=4, **case)
    b["logp"] = b["prox"] + 0.5 * torch.randn(b["prox"].shape, generator=torch.Generator().manual_seed(9), dtype=D)
    reduce = F.AGGREGATIONS[agg].reduce
    loss_fn = functools.partial(F.ppo_policy_loss, **kw)

    def ours(logp):
        per_tok, _ = loss_fn(logp, b["prox"], b["behav"], b["adv"], b["mask"], b["cu"])
        return reduce(per_tok, b["mask"], b["cu"])

    def ref(logp):
        hi = kw.get("eps_clip_higher") or kw["eps_clip"]
        toks = [
            ref_ppo_token(
                logp[j],
                b["prox"][j],
                b["behav"][j],
                b["adv"][j],
                kw["eps_clip"],
                hi,
                kw.get("c_clip"),
                kw.get("behav_imp_weight_cap"),
            )
            for j in range(logp.numel())
        ]
        return ref_aggregate(toks, b["mask"], b["cu"], agg)

    assert_value_and_grad(ours, ref, b["logp"])


def test_ppo_statistics_count_clipped_tokens():
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0])
    logp = torch.log(torch.tensor([1.5, 1.0, 0.5, 1.0, 4.0]))
    zeros = torch.zeros(5)
    mask = torch.ones(5, dtype=torch.bool)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    _, stats = F.ppo_policy_loss(logp, zeros, zeros, adv, mask, cu, eps_clip=0.2, c_clip=3.0)
    assert stats["clip_frac"].tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert stats["dual_clip_frac"].tolist() == [0.0, 0.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize("agg", list(F.AGGREGATIONS))
def test_ppo_at_ratio_one_is_the_policy_gradient(agg):
    b = make_packed(LENS, seed=5)
    reduce = F.AGGREGATIONS[agg].reduce

    def ppo(logp):
        return reduce(
            F.ppo_policy_loss(logp, b["prox"], b["prox"], b["adv"], b["mask"], b["cu"])[0], b["mask"], b["cu"]
        )

    def pg(logp):
        return reduce(
            F.reinforce_policy_loss(logp, b["prox"], b["prox"], b["adv"], b["mask"], b["cu"])[0], b["mask"], b["cu"]
        )

    x = b["prox"].clone().requires_grad_(True)
    y = b["prox"].clone().requires_grad_(True)
    (g_ppo,) = torch.autograd.grad(ppo(x), x)
    (g_pg,) = torch.autograd.grad(pg(y), y)
    torch.testing.assert_close(g_ppo, g_pg)
    assert g_ppo.abs().sum() > 0


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("cap", [None, 1.1])
def test_gspo_policy_loss(case, cap):
    b = make_packed(LENS, seed=6, **case)
    b["logp"] = b["prox"] + 0.02 * torch.randn(b["prox"].shape, generator=torch.Generator().manual_seed(1), dtype=D)
    b["prox"] = b["behav"] + 0.1 * torch.randn(b["prox"].shape, generator=torch.Generator().manual_seed(2), dtype=D)
    seq_adv = torch.randn(len(LENS), generator=torch.Generator().manual_seed(3), dtype=D)
    adv = F.to_tokens(seq_adv, b["cu"])
    eps_lo, eps_hi = 3e-3, 4e-3

    def ours(logp):
        per_tok, _ = F.gspo_policy_loss(
            logp,
            b["prox"],
            b["behav"],
            adv,
            b["mask"],
            b["cu"],
            eps_clip=eps_lo,
            eps_clip_higher=eps_hi,
            behav_imp_weight_cap=cap,
        )
        return F.seq_mean_token_mean(per_tok, b["mask"], b["cu"])

    def ref(logp):
        seq_losses = []
        for i, (s, e) in enumerate(spans(b["cu"])):
            idx = [j for j in range(s, e) if b["mask"][j]]
            if not idx:
                continue
            s_i = torch.exp(sum(logp[j] - b["prox"][j] for j in idx) / len(idx))
            w = math.exp(sum(float(b["prox"][j] - b["behav"][j]) for j in idx) / len(idx))
            if cap is not None and w > cap:
                w = 0.0
            a = seq_adv[i]
            s_clip = torch.clamp(s_i, 1 - eps_lo, 1 + eps_hi)
            seq_losses.append(torch.maximum(-a * s_i, -a * s_clip) * w)
        return sum(seq_losses) / len(seq_losses) if seq_losses else torch.zeros((), dtype=D)

    assert_value_and_grad(ours, ref, b["logp"])


@pytest.mark.parametrize("case", CASES)
def test_reinforce_policy_loss(case):
    b = make_packed(LENS, seed=7, **case)

    def ours(logp):
        per_tok, _ = F.reinforce_policy_loss(
            logp, b["prox"], b["behav"], b["adv"], b["mask"], b["cu"], behav_imp_weight_cap=1.3
        )
        return F.token_mean(per_tok, b["mask"], b["cu"])

    def ref(logp):
        toks = []
        for j in range(logp.numel()):
            w = math.exp(float(b["prox"][j] - b["behav"][j]))
            toks.append(-b["adv"][j] * logp[j] * (w if w <= 1.3 else 0.0))
        return ref_aggregate(toks, b["mask"], b["cu"], "token-mean")

    assert_value_and_grad(ours, ref, b["logp"])


@pytest.mark.parametrize("agg", list(F.AGGREGATIONS))
def test_aggregation_weights_make_microbatches_invariant(agg):
    """sum_k weight_k * reduce(mb_k) / sum_k weight_k == reduce(batch) for any cut into micro-batches."""
    b = make_packed([3, 1, 6, 2, 5, 4], seed=8, empty=(3,))
    per_tok = b["adv"]
    reduce, weight = F.AGGREGATIONS[agg]
    whole = reduce(per_tok, b["mask"], b["cu"])
    sp = spans(b["cu"])
    total, acc = 0.0, torch.zeros((), dtype=D)
    for seqs in ([0, 1], [2], [3, 4, 5]):
        s, e = sp[seqs[0]][0], sp[seqs[-1]][1]
        cu = torch.tensor([0] + [sp[i][1] - s for i in seqs], dtype=torch.int32)
        w = weight(b["mask"][s:e], cu)
        acc = acc + w * reduce(per_tok[s:e], b["mask"][s:e], cu)
        total += w
    torch.testing.assert_close(acc / total, whole)


def test_single_token_sequences():
    """Every sequence one token long (position 0 only): aggregation and GAE still well defined."""
    cu = torch.arange(4, dtype=torch.int32)
    mask = torch.tensor([True, False, True])
    x = torch.tensor([1.0, 5.0, 3.0], dtype=D)
    for name, (reduce, _) in F.AGGREGATIONS.items():
        assert reduce(x, mask, cu).item() == pytest.approx(2.0), name
    adv, ret = F.gae_advantages(x, torch.tensor([0.5, 0.5, 0.5], dtype=D), mask, cu, 0.9, 0.9)
    assert adv.tolist() == [0.5, 0.0, 2.5] and ret.tolist() == [1.0, 0.0, 3.0]


# ----------------------------------------------------------------------------- critic, preference, SFT


@pytest.mark.parametrize("eps", [None, 0.2])
def test_clipped_value_loss(eps):
    b = make_packed(LENS, seed=10, empty=(4,))
    old = b["values"]
    returns = b["rewards"]

    def ours(v):
        return F.token_mean(F.clipped_value_loss(v, old, returns, b["mask"], eps)[0], b["mask"], b["cu"])

    def ref(v):
        toks = []
        for j in range(v.numel()):
            l1 = (v[j] - returns[j]) ** 2
            if eps is None:
                toks.append(0.5 * l1)
                continue
            delta = v[j] - old[j]
            v_clip = old[j] + (eps if delta > eps else (max(delta, -eps)))
            l2 = (v_clip - returns[j]) ** 2
            toks.append(0.5 * (max(l1, l2)))
        return ref_aggregate(toks, b["mask"], b["cu"], "token-mean")

    v = old + 0.4 * torch.randn(old.shape, generator=torch.Generator().manual_seed(0), dtype=D)
    assert_value_and_grad(ours, ref, v)


@pytest.mark.parametrize("ls", [0.0, 0.1])
def test_dpo_sigmoid_loss(ls):
    g = torch.Generator().manual_seed(11)
    pc, pr, rc, rr = (-5 * torch.rand(4, generator=g, dtype=D) for _ in range(4))
    beta = 0.3

    def ref(c):
        out = 0
        for i in range(4):
            h = beta * ((c[i] - rc[i]) - (pr[i] - rr[i]))
            sig = 1 / (1 + torch.exp(-h))
            out = out - (1 - ls) * torch.log(sig) - ls * torch.log(1 - sig)
        return out

    assert_value_and_grad(lambda c: F.dpo_sigmoid_loss(c, pr, rc, rr, beta, ls).sum(), ref, pc)


def test_ipo_loss():
    g = torch.Generator().manual_seed(12)
    pc, pr, rc, rr = (-5 * torch.rand(3, generator=g, dtype=D) for _ in range(4))

    def ref(c):
        return sum(((c[i] - rc[i]) - (pr[i] - rr[i]) - 1 / (2 * 0.5)) ** 2 for i in range(3))

    assert_value_and_grad(lambda c: F.ipo_loss(c, pr, rc, rr, 0.5).sum(), ref, pc)
    with pytest.raises(ValueError):
        F.ipo_loss(pc, pr, rc, rr, 0.5, 0.1)


def test_sft_nll():
    b = make_packed(LENS, seed=13, empty=(1,))

    def ref(logp):
        return ref_aggregate([-logp[j] for j in range(logp.numel())], b["mask"], b["cu"], "token-mean")

    assert_value_and_grad(lambda x: F.token_mean(F.sft_nll(x, b["mask"]), b["mask"], b["cu"]), ref, b["logp"])


def test_registry_names_the_choices():
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-mean, seq-mean-token-sum"):
        F.pick(F.AGGREGATIONS, "token-sum", "loss aggregation")


# ----------------------------------------------------------------------------- importance weights


def ref_weights(prox, behav, mask, cu, level: str, how: str, low, high) -> torch.Tensor:
    """Token or sequence ratio rho, then masked to (or clamped into) [low, high], token by token."""
    out = [0.0] * prox.numel()
    for s, e in spans(cu):
        idx = [j for j in range(s, e) if mask[j]]
        seq_rho = math.exp(sum(float(prox[j] - behav[j]) for j in idx))
        for j in idx:
            rho = seq_rho if level == "sequence" else math.exp(float(prox[j] - behav[j]))
            inside = (low is None or rho >= low) and (high is None or rho <= high)
            if how == "mask":
                out[j] = rho if inside else 0.0
            else:
                out[j] = min(max(rho, low if low is not None else -math.inf), high if high is not None else math.inf)
    return torch.tensor(out, dtype=D)


WEIGHT_BANDS = [(None, 1.2), (0.8, 1.25), (0.5, 5.0), (None, None)]


@pytest.mark.parametrize("name", list(F.IMPORTANCE_WEIGHTS))
@pytest.mark.parametrize("band", WEIGHT_BANDS)
@pytest.mark.parametrize("case", CASES)
def test_importance_weights(name, band, case):
    # short sequences keep some sequence ratios inside every band
    b = make_packed([4, 1, 3, 2, 3, 2], seed=14, **case)
    b["prox"] = b["behav"] + 0.3 * torch.randn(b["prox"].shape, generator=torch.Generator().manual_seed(5), dtype=D)
    low, high = band
    level, how = name.split("_")
    ours = F.IMPORTANCE_WEIGHTS[name](b["prox"], b["behav"], b["mask"], b["cu"], low=low, high=high)
    ref = ref_weights(b["prox"], b["behav"], b["mask"], b["cu"], level, how, low, high)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
    if band in WEIGHT_BANDS[:2] and not case:  # a tight band bites on this data, and lets some through
        rho = ref_weights(b["prox"], b["behav"], b["mask"], b["cu"], level, "mask", None, None)
        changed = (ours != rho) & b["mask"]
        assert 0 < int(changed.sum()) < int(b["mask"].sum())


def test_capped_behaviour_weight_is_the_token_mask_below_the_cap():
    b = make_packed(LENS, seed=15)
    torch.testing.assert_close(
        F.behaviour_weight(b["prox"], b["behav"], b["mask"], 1.2),
        F.token_mask_weight(b["prox"], b["behav"], b["mask"], b["cu"], high=1.2),
    )


def test_mismatch_stats():
    b = make_packed(LENS, seed=16, empty=(1,))
    train, infer, mask = b["prox"], b["behav"], b["mask"]
    ks, diffs = [], []
    for j in range(train.numel()):
        if mask[j]:
            r = math.exp(float(train[j] - infer[j]))  # pi_train / pi_infer, tokens drawn from pi_infer
            ks.append(r - 1 - math.log(r))
            diffs.append(abs(float(train[j] - infer[j])))
    stats = F.mismatch_stats(train, infer, mask)
    assert stats["kl"].item() == pytest.approx(sum(ks) / len(ks), rel=1e-9)
    assert stats["max_abs_diff"].item() == pytest.approx(max(diffs), rel=1e-12)
    empty = F.mismatch_stats(train, infer, torch.zeros_like(mask))
    assert empty["kl"].item() == 0.0 and empty["max_abs_diff"].item() == 0.0


LOSSES_WITH_WEIGHTS = {
    "ppo": (F.ppo_policy_loss, {"eps_clip": 0.2, "eps_clip_higher": 0.28}),
    "reinforce": (F.reinforce_policy_loss, {}),
    "cispo": (F.cispo_policy_loss, {"eps_clip": 1.0, "eps_clip_higher": 0.2}),
}


@pytest.mark.parametrize("loss_name", list(LOSSES_WITH_WEIGHTS))
@pytest.mark.parametrize("weight_name", list(F.IMPORTANCE_WEIGHTS))
def test_policy_losses_take_an_importance_weight(loss_name, weight_name):
    """A loss with ``importance_weight=fn`` is the same loss with the behaviour weight replaced by
    fn's weights, token by token (reference: the loss at prox = behav, times the reference weight)."""
    b = make_packed([4, 1, 3, 2, 3, 2], seed=17, empty=(2,))
    b["prox"] = b["behav"] + 0.15 * torch.randn(b["prox"].shape, generator=torch.Generator().manual_seed(6), dtype=D)
    loss_fn, kw = LOSSES_WITH_WEIGHTS[loss_name]
    low, high = 0.8, 1.25
    iw = functools.partial(F.IMPORTANCE_WEIGHTS[weight_name], low=low, high=high)
    level, how = weight_name.split("_")
    w_ref = ref_weights(b["prox"], b["behav"], b["mask"], b["cu"], level, how, low, high)

    def ours(logp):
        per_tok, _ = loss_fn(logp, b["prox"], b["behav"], b["adv"], b["mask"], b["cu"], importance_weight=iw, **kw)
        return F.token_mean(per_tok, b["mask"], b["cu"])

    def ref(logp):
        unweighted, _ = loss_fn(logp, b["prox"], b["prox"], b["adv"], b["mask"], b["cu"], **kw)
        return ref_aggregate([unweighted[j] * w_ref[j] for j in range(logp.numel())], b["mask"], b["cu"], "token-mean")

    assert_value_and_grad(ours, ref, b["logp"])
    with pytest.raises(ValueError, match="not both"):
        loss_fn(
            b["logp"],
            b["prox"],
            b["behav"],
            b["adv"],
            b["mask"],
            b["cu"],
            behav_imp_weight_cap=2.0,
            importance_weight=iw,
        )


def test_gspo_with_a_sequence_weight_keeps_one_weight_per_sequence():
    b = make_packed(LENS, seed=18)
    b["logp"] = b["prox"] + 0.02 * torch.randn(b["prox"].shape, generator=torch.Generator().manual_seed(1), dtype=D)
    b["prox"] = b["behav"] + 0.1 * torch.randn(b["prox"].shape, generator=torch.Generator().manual_seed(2), dtype=D)
    adv = F.to_tokens(torch.randn(len(LENS), generator=torch.Generator().manual_seed(3), dtype=D), b["cu"])
    iw = functools.partial(F.sequence_truncate_weight, high=1.1)
    per_tok, _ = F.gspo_policy_loss(b["logp"], b["prox"], b["behav"], adv, b["mask"], b["cu"], importance_weight=iw)
    plain, _ = F.gspo_policy_loss(b["logp"], b["prox"], b["prox"], adv, b["mask"], b["cu"])
    w = ref_weights(b["prox"], b["behav"], b["mask"], b["cu"], "sequence", "truncate", None, 1.1)
    torch.testing.assert_close(per_tok, plain * w, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------- CISPO, decoupled = PPO


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("agg", list(F.AGGREGATIONS))
@pytest.mark.parametrize("eps", [(1.0, 0.2), (0.1, 0.1), (0.2, None)])
def test_cispo_policy_loss(case, agg, eps):
    b = make_packed(LENS, seed=19, **case)
    b["logp"] = b["prox"] + 0.4 * torch.randn(b["prox"].shape, generator=torch.Generator().manual_seed(9), dtype=D)
    eps_lo, eps_hi = eps
    reduce = F.AGGREGATIONS[agg].reduce

    def ours(logp):
        per_tok, _ = F.cispo_policy_loss(
            logp,
            b["prox"],
            b["behav"],
            b["adv"],
            b["mask"],
            b["cu"],
            eps_clip=eps_lo,
            eps_clip_higher=eps_hi,
            behav_imp_weight_cap=1.3,
        )
        return reduce(per_tok, b["mask"], b["cu"])

    def ref(logp):
        hi = eps_lo if eps_hi is None else eps_hi
        toks = []
        for j in range(logp.numel()):
            r = math.exp(float(logp[j].detach() - b["prox"][j]))  # a constant: the weight carries no gradient
            r = min(max(r, 1 - eps_lo), 1 + hi)
            w = math.exp(float(b["prox"][j] - b["behav"][j]))
            toks.append(-r * b["adv"][j] * logp[j] * (w if w <= 1.3 else 0.0))
        return ref_aggregate(toks, b["mask"], b["cu"], agg)

    assert_value_and_grad(ours, ref, b["logp"])


def test_cispo_at_ratio_one_is_reinforce_and_clipped_tokens_keep_a_gradient():
    b = make_packed(LENS, seed=20)
    x, y = b["prox"].clone().requires_grad_(True), b["prox"].clone().requires_grad_(True)
    cispo = F.token_mean(
        F.cispo_policy_loss(x, b["prox"], b["prox"], b["adv"], b["mask"], b["cu"])[0], b["mask"], b["cu"]
    )
    pg = F.token_mean(
        F.reinforce_policy_loss(y, b["prox"], b["prox"], b["adv"], b["mask"], b["cu"])[0], b["mask"], b["cu"]
    )
    (g1,), (g2,) = torch.autograd.grad(cispo, x), torch.autograd.grad(pg, y)
    torch.testing.assert_close(g1, g2)
    # far outside the clip range PPO's gradient vanishes; CISPO's is the clipped weight times A
    far = (b["prox"] + 1.0).requires_grad_(True)
    per_tok, stats = F.cispo_policy_loss(far, b["prox"], b["prox"], b["adv"], b["mask"], b["cu"], eps_clip_higher=0.2)
    (g,) = torch.autograd.grad(per_tok.sum(), far)
    torch.testing.assert_close(g, torch.where(b["mask"], -1.2 * b["adv"], 0.0))
    assert stats["clip_frac"][b["mask"]].min().item() == 1.0


def ref_plain_ppo(logp, old, adv, mask, cu, eps, agg):
    """Standard PPO (Schulman et al. 2017, eq. 7) with ratio pi / pi_old and no other weight."""
    toks = []
    for j in range(logp.numel()):
        ratio = torch.exp(logp[j] - old[j])
        clipped = torch.clamp(ratio, 1 - eps, 1 + eps)
        toks.append(-torch.minimum(ratio * adv[j], clipped * adv[j]))
    return ref_aggregate(toks, mask, cu, agg)


@pytest.mark.parametrize("agg", list(F.AGGREGATIONS))
@pytest.mark.parametrize("cap", [None, 5.0])
def test_decoupled_ppo_is_plain_ppo_when_behaviour_is_proximal(agg, cap):
    b = make_packed(LENS, seed=21, empty=(3,))
    b["logp"] = b["prox"] + 0.4 * torch.randn(b["prox"].shape, generator=torch.Generator().manual_seed(2), dtype=D)
    reduce = F.AGGREGATIONS[agg].reduce

    def decoupled(logp):
        per_tok, _ = F.ppo_policy_loss(
            logp, b["prox"], b["prox"], b["adv"], b["mask"], b["cu"], eps_clip=0.2, behav_imp_weight_cap=cap
        )
        return reduce(per_tok, b["mask"], b["cu"])

    assert_value_and_grad(
        decoupled, lambda x: ref_plain_ppo(x, b["prox"], b["adv"], b["mask"], b["cu"], 0.2, agg), b["logp"]
    )


# ----------------------------------------------------------------------------- distillation


@pytest.mark.parametrize("gamma", [0.0, 0.5, 1.0])
def test_reverse_kl_advantages(gamma):
    b = make_packed(LENS, seed=22, empty=(2,))
    student, teacher = b["behav"], b["prox"]
    ours = F.reverse_kl_advantages(student, teacher, b["mask"], b["cu"], gamma)
    ref = [0.0] * student.numel()
    for s, e in spans(b["cu"]):
        idx = [j for j in range(s, e) if b["mask"][j]]
        future = 0.0
        for j in reversed(idx):
            future = float(teacher[j] - student[j]) + gamma * future
            ref[j] = future
    torch.testing.assert_close(ours, torch.tensor(ref, dtype=D), rtol=1e-10, atol=1e-12)
    # where the student already matches the teacher there is nothing to learn
    assert F.reverse_kl_advantages(teacher, teacher, b["mask"], b["cu"], gamma).abs().max().item() == 0.0


@pytest.mark.parametrize("gamma", [0.0, 0.5])
@pytest.mark.parametrize("clip", [0.1, 0.5])
def test_reverse_kl_advantages_clip_each_term_before_the_returns(gamma, clip):
    b = make_packed(LENS, seed=24, empty=(2,))
    student, teacher = b["behav"], 3.0 * b["prox"]  # wider terms, so that some are clipped
    ours = F.reverse_kl_advantages(student, teacher, b["mask"], b["cu"], gamma, clip=clip)
    ref = [0.0] * student.numel()
    n_clipped = 0
    for s, e in spans(b["cu"]):
        idx = [j for j in range(s, e) if b["mask"][j]]
        future = 0.0
        for j in reversed(idx):
            term = float(teacher[j] - student[j])
            n_clipped += abs(term) > clip
            future = min(max(term, -clip), clip) + gamma * future
            ref[j] = future
    assert n_clipped > 0
    torch.testing.assert_close(ours, torch.tensor(ref, dtype=D), rtol=1e-10, atol=1e-12)
    # a clip wider than every term changes nothing
    wide = F.reverse_kl_advantages(student, teacher, b["mask"], b["cu"], gamma, clip=1e6)
    torch.testing.assert_close(wide, F.reverse_kl_advantages(student, teacher, b["mask"], b["cu"], gamma))


@pytest.mark.parametrize("case", CASES)
def test_position_baseline(case):
    b = make_packed(LENS, seed=23, **case)
    ours = F.position_baseline(b["adv"], b["mask"], b["cu"])
    masked = [[j for j in range(s, e) if b["mask"][j]] for s, e in spans(b["cu"])]
    ref = [0.0] * b["adv"].numel()
    for k in range(max((len(idx) for idx in masked), default=0)):
        at_k = [idx[k] for idx in masked if len(idx) > k]
        mean = sum(float(b["adv"][j]) for j in at_k) / len(at_k)
        for j in at_k:
            ref[j] = float(b["adv"][j]) - mean
    torch.testing.assert_close(ours, torch.tensor(ref, dtype=D), rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------- sum-reduced losses of the Tinker API


@pytest.mark.parametrize("case", CASES)
def test_importance_sampling_policy_loss(case):
    """``-sum exp(logp - q) * A`` over the tokens (its gradient is ratio * A * dlogp)."""
    b = make_packed(LENS, seed=31, **case)

    def ours(logp):
        per_tok, _ = F.importance_sampling_policy_loss(logp, b["behav"], b["behav"], b["adv"], b["mask"], b["cu"])
        return per_tok.sum()

    def ref(logp):
        return sum(
            -torch.exp(logp[j] - b["behav"][j]) * b["adv"][j] for j in range(logp.numel()) if b["mask"][j]
        ) + torch.zeros((), dtype=D)

    assert_value_and_grad(ours, ref, b["logp"])


@pytest.mark.parametrize("beta", [0.0, 0.05, 1.0])
def test_dro_policy_loss(beta):
    """``-sum (logp * A - beta / 2 * (logp - q)^2)``."""
    b = make_packed(LENS, seed=32)

    def ours(logp):
        per_tok, _ = F.dro_policy_loss(logp, b["behav"], b["behav"], b["adv"], b["mask"], b["cu"], beta=beta)
        return per_tok.sum()

    def ref(logp):
        return sum(
            -(logp[j] * b["adv"][j] - 0.5 * beta * (logp[j] - b["behav"][j]) ** 2)
            for j in range(logp.numel())
            if b["mask"][j]
        )

    assert_value_and_grad(ours, ref, b["logp"])


@pytest.mark.parametrize("eps", [(0.2, 0.2), (3e-4, 4e-4), (0.05, None)])
def test_gspo_token_policy_loss(eps):
    """GSPO-token: each token's ratio has its sequence's value (the geometric mean over the ratio
    mask) and its own log-probability's gradient; PPO's clipped surrogate per token, summed."""
    b = make_packed(LENS, seed=33)
    ratio_mask = b["mask"].clone()
    ratio_mask[int(b["cu"][2])] = False  # a masked token left out of the ratio still trains
    eps_lo, eps_hi = eps
    hi = eps_lo if eps_hi is None else eps_hi

    def ours(logp):
        per_tok, _ = F.gspo_token_policy_loss(
            logp, b["behav"], b["behav"], b["adv"], b["mask"], b["cu"],
            ratio_mask=ratio_mask, eps_clip=eps_lo, eps_clip_higher=eps_hi,
        )  # fmt: skip
        return per_tok.sum()

    def ref(logp):
        total = torch.zeros((), dtype=D)
        for s, e in spans(b["cu"]):
            inside = [j for j in range(s, e) if ratio_mask[j]]
            log_s = sum(float(logp[j].detach() - b["behav"][j]) for j in inside) / max(len(inside), 1)
            for j in range(s, e):
                if not b["mask"][j]:
                    continue
                ratio = math.exp(log_s) * torch.exp(logp[j] - logp[j].detach())
                a = b["adv"][j]
                total = total - torch.minimum(ratio * a, ratio.clamp(1 - eps_lo, 1 + hi) * a)
        return total

    assert_value_and_grad(ours, ref, b["logp"])


def test_gspo_token_with_one_advantage_per_sequence_has_gspos_gradient():
    b = make_packed(LENS, seed=34)
    adv = F.to_tokens(torch.randn(len(LENS), dtype=D, generator=torch.Generator().manual_seed(3)), b["cu"])
    x, y = b["logp"].clone().requires_grad_(True), b["logp"].clone().requires_grad_(True)
    token = F.seq_mean_token_mean(
        F.gspo_token_policy_loss(x, b["behav"], b["behav"], adv, b["mask"], b["cu"], eps_clip=0.2)[0],
        b["mask"],
        b["cu"],
    )
    seq = F.seq_mean_token_mean(
        F.gspo_policy_loss(y, b["behav"], b["behav"], adv, b["mask"], b["cu"], eps_clip=0.2)[0], b["mask"], b["cu"]
    )
    torch.testing.assert_close(token, seq)
    torch.testing.assert_close(torch.autograd.grad(token, x)[0], torch.autograd.grad(seq, y)[0])
