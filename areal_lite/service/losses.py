"""The Tinker API's built-in losses, each a composition of `areal_lite.algorithms.functional`.

A Tinker loss is a sum over every token of every datum (no mean: how to weigh tokens is the
caller's, through ``weights`` or the advantages). Its inputs come per datum in
``loss_fn_inputs``, aligned with the model input: position ``i`` holds what the model predicts
after reading input tokens ``0..i``, which is ``target_tokens[i]``. The sampling policy's
log-probabilities are ``logprobs``; the model's own are what the forward pass computes.

| name | per-token loss | functional |
|---|---|---|
| ``cross_entropy`` | ``-w * log p`` (``weights`` w, default 1) | `sft_nll` |
| ``importance_sampling`` | ``-A * p / q`` | `importance_sampling_policy_loss` |
| ``ppo`` | ``-min(r A, clip(r, lo, hi) A)``, ``r = p / q`` | `ppo_policy_loss` |
| ``cispo`` | ``-sg(clip(r, lo, hi)) * A * log p`` | `cispo_policy_loss` |
| ``dro`` | ``-(A log p - beta / 2 (log p - log q)^2)`` | `dro_policy_loss` |
| ``gspo`` | GSPO-token: ``r`` the sequence's geometric-mean ratio over ``sequence_ratio_mask`` | `gspo_token_policy_loss` |
| ``stable_reinforce`` | ``-sg(min(r, tis_cap)) * A * log p + kl_coeff * (log p - log q)^2 / 2`` | `reinforce_policy_loss` with `token_truncate_weight`, `kl_k2` |

``lo`` / ``hi`` are ``clip_low_threshold`` / ``clip_high_threshold`` (``loss_fn_config``, or per
token in ``loss_fn_inputs``), ratios rather than epsilons: PPO's ``eps = 0.2`` is ``0.8`` / ``1.2``.

Deliberate deviation: Thinking Machines has not published StableReinforce's objective, only what it
needs (sampling with ``record_stability_info``, provenance naming the sampled sequences). Ours is
REINFORCE with each token's importance weight truncated at ``tis_cap`` (TIS, Yao et al. 2025), the
weight taken against the sampler's log-probabilities that this service recorded when it sampled
the sequence (read through the datum's provenance), not the client's copy, plus an optional
``kl_coeff`` pull towards the sampler.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
from tensordict import TensorDict

from areal_lite.actors import summed_loss
from areal_lite.algorithms import functional as F
from areal_lite.api.engine import LossFn, LossWeightFn, PackedBatch
from areal_lite.service.wire import BadRequest, Datum, Unsupported

TARGETS = "target_tokens"

PerToken = Callable[[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, dict[str, float]], torch.Tensor]
"""``fn(logp [T], inputs by name [T], cu_seqlens, config) -> per-token loss [T]`` over packed
sequences (``logp`` with gradient)."""


@dataclass(frozen=True)
class TinkerLoss:
    """One built-in loss: the ``loss_fn_inputs`` it takes besides ``target_tokens``, its
    ``loss_fn_config`` keys with their defaults, and its per-token loss."""

    name: str
    per_token: PerToken
    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    config: dict[str, float] = field(default_factory=dict)

    @property
    def inputs(self) -> tuple[str, ...]:
        return (TARGETS, *self.required, *self.optional)


def _ones(logp: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(logp, dtype=torch.bool)


def _thresholds(inputs: dict[str, torch.Tensor], config: dict[str, float]) -> tuple[object, object]:
    """PPO-style epsilons from Tinker's ratio thresholds, per token when either is given per token
    (then both are: ``clamp`` takes two numbers or two tensors)."""
    low = inputs.get("clip_low_threshold", config["clip_low_threshold"])
    high = inputs.get("clip_high_threshold", config["clip_high_threshold"])
    per_token = next((t for t in (low, high) if isinstance(t, torch.Tensor)), None)
    if per_token is not None:
        low, high = (torch.as_tensor(t, dtype=per_token.dtype).expand_as(per_token) for t in (low, high))
    return 1.0 - low, high - 1.0  # type: ignore[operator]


def _cross_entropy(
    logp: torch.Tensor, inputs: dict[str, torch.Tensor], cu: torch.Tensor, cfg: dict[str, float]
) -> torch.Tensor:
    return F.sft_nll(logp, inputs.get("weights", torch.ones_like(logp)))


def _importance_sampling(
    logp: torch.Tensor, inputs: dict[str, torch.Tensor], cu: torch.Tensor, cfg: dict[str, float]
) -> torch.Tensor:
    q = inputs["logprobs"]
    return F.importance_sampling_policy_loss(logp, q, q, inputs["advantages"], _ones(logp), cu)[0]


def _ppo(logp: torch.Tensor, inputs: dict[str, torch.Tensor], cu: torch.Tensor, cfg: dict[str, float]) -> torch.Tensor:
    q = inputs["logprobs"]
    lo, hi = _thresholds(inputs, cfg)
    return F.ppo_policy_loss(logp, q, q, inputs["advantages"], _ones(logp), cu, eps_clip=lo, eps_clip_higher=hi)[0]  # type: ignore[arg-type]


def _cispo(
    logp: torch.Tensor, inputs: dict[str, torch.Tensor], cu: torch.Tensor, cfg: dict[str, float]
) -> torch.Tensor:
    q = inputs["logprobs"]
    lo, hi = _thresholds(inputs, cfg)
    return F.cispo_policy_loss(logp, q, q, inputs["advantages"], _ones(logp), cu, eps_clip=lo, eps_clip_higher=hi)[0]  # type: ignore[arg-type]


def _dro(logp: torch.Tensor, inputs: dict[str, torch.Tensor], cu: torch.Tensor, cfg: dict[str, float]) -> torch.Tensor:
    q = inputs["logprobs"]
    return F.dro_policy_loss(logp, q, q, inputs["advantages"], _ones(logp), cu, beta=cfg["beta"])[0]


def _gspo(logp: torch.Tensor, inputs: dict[str, torch.Tensor], cu: torch.Tensor, cfg: dict[str, float]) -> torch.Tensor:
    q, adv = inputs["logprobs"], inputs["advantages"]
    ratio_mask = inputs["sequence_ratio_mask"] != 0 if "sequence_ratio_mask" in inputs else adv != 0
    lo, hi = _thresholds(inputs, cfg)
    return F.gspo_token_policy_loss(
        logp,
        q,
        q,
        adv,
        _ones(logp),
        cu,
        ratio_mask=ratio_mask,
        eps_clip=lo,
        eps_clip_higher=hi,  # type: ignore[arg-type]
    )[0]


def _stable_reinforce(
    logp: torch.Tensor, inputs: dict[str, torch.Tensor], cu: torch.Tensor, cfg: dict[str, float]
) -> torch.Tensor:
    q, adv = inputs["logprobs"], inputs["advantages"]
    truncated = partial(F.token_truncate_weight, high=cfg["tis_cap"])
    # The weight is taken between the current policy (its value, no gradient) and the sampler.
    pg = F.reinforce_policy_loss(logp, logp.detach(), q, adv, _ones(logp), cu, importance_weight=truncated)[0]
    return pg + cfg["kl_coeff"] * F.kl_k2(logp, q)


_RL = ("logprobs", "advantages")
_CLIP = ("clip_low_threshold", "clip_high_threshold")

LOSSES: dict[str, TinkerLoss] = {
    loss.name: loss
    for loss in (
        TinkerLoss("cross_entropy", _cross_entropy, optional=("weights",)),
        TinkerLoss("importance_sampling", _importance_sampling, required=_RL),
        TinkerLoss("ppo", _ppo, _RL, _CLIP, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
        TinkerLoss("cispo", _cispo, _RL, _CLIP, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
        TinkerLoss("dro", _dro, _RL, (), {"beta": 0.05}),
        TinkerLoss(
            "gspo",
            _gspo,
            _RL,
            ("sequence_ratio_mask", *_CLIP),
            {"clip_low_threshold": 1.0 - 3e-4, "clip_high_threshold": 1.0 + 4e-4},
        ),
        TinkerLoss("stable_reinforce", _stable_reinforce, _RL, (), {"tis_cap": 2.0, "kl_coeff": 0.0}),
    )
}


def resolve(name: str, config: dict[str, float | str]) -> tuple[TinkerLoss, dict[str, float]]:
    """The loss called ``name`` and its full config (defaults filled in); BadRequest for an unknown
    loss or config key."""
    if name == "custom":
        raise Unsupported(
            "server-side custom losses (loss_fn='custom') are not supported: forward_backward_custom runs the "
            "loss on the client when the server says custom_loss_server_side is false, as this one does"
        )
    loss = LOSSES.get(name)
    if loss is None:
        raise BadRequest(f"unknown loss_fn {name!r}; this service has {', '.join(LOSSES)}")
    unknown = set(config) - set(loss.config)
    if unknown:
        valid = ", ".join(loss.config) or "none"
        raise BadRequest(f"loss_fn_config keys {sorted(unknown)} are not {name}'s (it takes: {valid})")
    resolved = dict(loss.config)
    for key, value in config.items():
        if isinstance(value, str):
            raise BadRequest(f"loss_fn_config[{key!r}] must be a number, got {value!r}")
        resolved[key] = float(value)
    return loss, resolved


def check_data(data: list[Datum], loss: TinkerLoss, vocab_size: int, max_len: int) -> None:
    """BadRequest unless every datum has ``loss``'s inputs, each ``[N]`` for its N input tokens,
    with target tokens inside the vocabulary and N + 1 positions within ``max_len``."""
    if not data:
        raise BadRequest("no data: forward_backward needs at least one datum")
    for i, d in enumerate(data):
        n = len(d.tokens)
        if n == 0:
            raise BadRequest(f"datum {i}: model_input is empty")
        if n + 1 > max_len:
            raise BadRequest(f"datum {i}: {n} input tokens exceed the model's context of {max_len - 1} (+1 target)")
        if min(d.tokens) < 0 or max(d.tokens) >= vocab_size:
            raise BadRequest(f"datum {i}: model_input holds token ids outside the vocabulary [0, {vocab_size})")
        unknown = set(d.inputs) - set(loss.inputs)
        if unknown:
            raise BadRequest(f"datum {i}: {loss.name} takes loss_fn_inputs {list(loss.inputs)}, not {sorted(unknown)}")
        for key in (TARGETS, *loss.required):
            if key not in d.inputs:
                raise BadRequest(f"datum {i}: {loss.name} needs loss_fn_inputs[{key!r}]")
        for key, value in d.inputs.items():
            if value.ndim != 1:
                raise Unsupported(
                    f"datum {i}: loss_fn_inputs[{key!r}] has shape {list(value.shape)}; this service takes "
                    f"[N] inputs only (one target per position)"
                )
            if value.shape[0] != n:
                raise BadRequest(
                    f"datum {i}: loss_fn_inputs[{key!r}] has {value.shape[0]} entries for {n} input tokens"
                )
        targets = d.inputs[TARGETS]
        if targets.dtype.kind not in "iu":
            raise BadRequest(f"datum {i}: target_tokens must be integers (int64)")
        if targets.min() < 0 or targets.max() >= vocab_size:
            raise BadRequest(f"datum {i}: target_tokens outside the vocabulary [0, {vocab_size})")


_DEFAULTS: dict[str, Callable[[dict[str, np.ndarray], dict[str, float]], np.ndarray]] = {
    "weights": lambda inputs, cfg: np.ones(len(inputs[TARGETS]), np.float32),
    "clip_low_threshold": lambda inputs, cfg: np.full(len(inputs[TARGETS]), cfg["clip_low_threshold"], np.float32),
    "clip_high_threshold": lambda inputs, cfg: np.full(len(inputs[TARGETS]), cfg["clip_high_threshold"], np.float32),
    "sequence_ratio_mask": lambda inputs, cfg: (inputs["advantages"] != 0).astype(np.float32),
}
"""Each optional input's value where a datum leaves it out: what its loss uses in its absence."""


def fill_defaults(data: list[Datum], loss: TinkerLoss, config: dict[str, float]) -> None:
    """Give every datum the optional inputs that another datum of the batch carries, at their
    defaults: the batch holds one tensor per input, and each datum is its own (a checked batch)."""
    for key in loss.optional:
        if any(key in d.inputs for d in data):
            for d in data:
                if key not in d.inputs:
                    d.inputs[key] = _DEFAULTS[key](d.inputs, config)


def tinker_batch(data: list[Datum]) -> TensorDict:
    """The engine batch of ``data`` (data contract of `areal_lite.api.engine`): datum ``d`` is the
    sequence ``tokens + [last target]`` with ``target_ids = [0] + targets``, so that the engine's
    log-probability at position ``i + 1`` is datum position ``i``'s, and each loss input likewise
    shifted right by one (0 at position 0, which scores nothing)."""
    width = max(len(d.tokens) for d in data) + 1
    n = len(data)
    ids = torch.zeros(n, width, dtype=torch.int64)
    targets = torch.zeros(n, width, dtype=torch.int64)
    attn = torch.zeros(n, width, dtype=torch.bool)
    keys = sorted({k for d in data for k in d.inputs} - {TARGETS})
    values = {k: torch.zeros(n, width, dtype=torch.float32) for k in keys}
    for row, d in enumerate(data):
        t = d.inputs[TARGETS]
        length = len(d.tokens) + 1
        ids[row, :length] = torch.tensor([*d.tokens, int(t[-1])])
        targets[row, 1:length] = torch.from_numpy(t.astype(np.int64))
        attn[row, :length] = True
        for k in keys:
            if k in d.inputs:
                values[k][row, 1:length] = torch.from_numpy(d.inputs[k].astype(np.float32))
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": attn.to(torch.int32), "target_ids": targets}
    return TensorDict({**batch, **values}, batch_size=[n])


def _mb_inputs(mb: PackedBatch, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    return {k: mb[k] for k in keys if k in mb}  # type: ignore[misc]


def engine_loss(loss: TinkerLoss, config: dict[str, float], batch: TensorDict) -> tuple[LossFn, LossWeightFn]:
    """``(loss_fn, loss_weight_fn)`` for `TrainEngine.forward_backward` whose gradient is that of
    the plain sum of ``loss`` over every token of ``batch`` (on one rank):
    `areal_lite.actors.summed_loss` of it."""

    def token_sum(logp: torch.Tensor, mb: PackedBatch) -> torch.Tensor:
        cu = mb["cu_seqlens"]
        assert isinstance(cu, torch.Tensor)
        return loss.per_token(logp, _mb_inputs(mb, loss.inputs), cu, config).sum()

    return summed_loss(token_sum, batch)


def loss_sum(loss: TinkerLoss, config: dict[str, float], batch: TensorDict, logprobs: torch.Tensor) -> float:
    """The value of ``loss`` summed over ``batch`` given its per-token log-probabilities ``[B, L]``
    (a forward pass done already, as for a forward-only call)."""
    from areal_lite.utils.data import pack_batch

    data = batch.clone(recurse=False)
    data["logp"] = logprobs
    packed = pack_batch(data)
    logp, cu = packed["logp"], packed["cu_seqlens"]
    assert isinstance(logp, torch.Tensor) and isinstance(cu, torch.Tensor)
    with torch.no_grad():
        return float(loss.per_token(logp, _mb_inputs(packed, loss.inputs), cu, config).sum())


def datum_logprobs(data: list[Datum], logprobs: torch.Tensor) -> list[np.ndarray]:
    """Each datum's log-probabilities ``[N]`` (of its target tokens) out of the batch's ``[B, L]``."""
    return [logprobs[row, 1 : len(d.tokens) + 1].numpy().astype(np.float32) for row, d in enumerate(data)]
