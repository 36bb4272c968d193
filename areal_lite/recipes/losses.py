"""What a ``train_*`` call of the recipe API trains on, and the actor loss that trains it.

A ``train_*`` call turns a thread and its per-token arguments into `TrainRow`s (token ids, the
trained tokens, per-token values laid out like the log-probabilities of the data contract) and
hands them, with a `Loss`, to the model. The model keeps them until ``optim_step``, then builds one
padded batch per distinct `Loss` (all pending calls with the same settings) and adds its gradient
with one ``forward_backward`` on the train engine, micro-batched by the engine. So every call
made between two steps is packed into the same batch, however the calls were awaited, and N calls
then a step equal one ``train_batch`` on their union: the loss is normalised over all of them (and
over every rank), exactly as the actors normalise a batch.

The losses are the actors' own ``loss_fn`` / ``loss_weight`` (`areal_lite.actors`), over the
functions of `areal_lite.algorithms.functional`, or a sum over tokens through
`areal_lite.actors.summed_loss` (as the Tinker service's losses); nothing here computes a loss. A
model builds each distinct `Loss`'s actor once (`Loss.accumulator`) and keeps it.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch
from tensordict import TensorDict

from areal_lite.actors import DPOActor, PPOActor, PPOCritic, SFTActor, summed_loss
from areal_lite.actors.tangent import tangent_surrogate
from areal_lite.api.config import DPOConfig, PPOActorConfig, PPOCriticConfig
from areal_lite.api.engine import LossFn, LossWeightFn, PackedBatch, TrainEngine
from areal_lite.utils.datasets import padded_batch


@dataclass
class TrainRow:
    """One sequence to train on. ``values`` maps a per-token key (``advantages``, ``ref_logp``...)
    to one float per token of ``input_ids`` (0 where ``loss_mask`` is 0)."""

    input_ids: list[int]
    loss_mask: list[int]
    values: dict[str, list[float]] = field(default_factory=dict)


def batch_order(input_ids: list[int], loss_mask: list[int]) -> tuple[int, list[int]]:
    """Where a sequence goes in a batch: sequences with the same prompt (the tokens before the first
    trained one) sit together, so that the engine runs a GRPO group's prompt once
    (``shared_prefix``), and different prompts in an order that depends only on their tokens (a
    hash), so that the batch does not depend on the order the calls arrived in and unrelated
    neighbours rarely share a few leading tokens (which would only add a small, costly tree)."""
    start = next((i for i, m in enumerate(loss_mask) if m), len(input_ids))
    return hash(tuple(input_ids[:start])), input_ids


def placeholder_row(keys: tuple[str, ...]) -> TrainRow:
    """A row that trains nothing (empty loss mask): what a rank without calls of a `Loss` passes
    while other ranks train on it, so that every rank runs the same collectives."""
    return TrainRow([0, 0], [0, 0], {k: [0.0, 0.0] for k in keys})


def rows_to_batch(rows: list[TrainRow]) -> TensorDict:
    """A right-padded batch (data contract) of ``rows``, with their per-token values as float32 ``[B, L]``."""
    batch = padded_batch([(r.input_ids, r.loss_mask) for r in rows])
    width = batch["input_ids"].shape[1]
    for key in rows[0].values:
        t = torch.zeros(len(rows), width, dtype=torch.float32)
        for i, r in enumerate(rows):
            t[i, : len(r.values[key])] = torch.tensor(r.values[key], dtype=torch.float32)
        batch[key] = t
    return batch


def _zero_without_trained_tokens(weight_fn: LossWeightFn) -> LossWeightFn:
    """``weight_fn``, but 0 for a micro-batch without a trained token (a placeholder)."""

    def weight(mb: PackedBatch) -> float:
        return weight_fn(mb) if bool(mb["loss_mask"].any()) else 0.0  # type: ignore[union-attr]

    return weight


def _forward_backward(
    engine: TrainEngine, batch: TensorDict, loss_fn: LossFn, weight_fn: LossWeightFn
) -> dict[str, float]:
    return engine.forward_backward(batch, loss_fn, _zero_without_trained_tokens(weight_fn))


Accumulate = Callable[[TensorDict], dict[str, float]]
"""Adds a loss's gradient over a batch to the engine's accumulated gradients; returns the loss's
statistics."""


class Loss(abc.ABC):
    """A loss and its settings: calls with equal `Loss` objects share one batch at ``optim_step``."""

    name: ClassVar[str]
    keys: ClassVar[tuple[str, ...]] = ()
    """The per-token values a row carries."""
    rows_per_call: ClassVar[int] = 1

    @abc.abstractmethod
    def accumulator(self, engine: TrainEngine) -> Accumulate:
        """What adds this loss's gradient over a batch to ``engine``'s. A model asks once per
        distinct `Loss` and keeps the answer, so its actor is built once, not at every step."""


@dataclass(frozen=True)
class SFTLoss(Loss):
    """Token-mean negative log-likelihood of the trained tokens (`SFTActor.loss_fn`)."""

    name: ClassVar[str] = "sft"

    def accumulator(self, engine: TrainEngine) -> Accumulate:
        return lambda batch: _forward_backward(engine, batch, SFTActor.loss_fn, SFTActor.loss_weight)


@dataclass(frozen=True)
class PolicyLoss(Loss):
    """A PPO-family policy loss against given log-probabilities (`PPOActor.loss_fn`): the ratio
    is taken against the log-probabilities the caller passed (the policy that produced or scored
    the sample), with an optional KL penalty to a reference in the loss.

    ``policy_loss`` is ``ppo`` (GRPO and PPO: a per-token clipped ratio) or ``gspo`` (a
    sequence-level ratio)."""

    policy_loss: str = "ppo"
    eps_clip: float = 0.2
    eps_clip_higher: float | None = None
    kl_beta: float = 0.0
    kl_estimator: str = "k3"
    loss_agg: str = "token-mean"
    reference: bool = True
    """Whether the rows' ``ref_logp`` are a reference policy's (False: placeholders, so that the
    actor neither reports ``kl_ref`` nor lets the logger warn about it)."""

    name: ClassVar[str] = "policy"
    keys: ClassVar[tuple[str, ...]] = ("advantages", "prox_logp", "behav_logp", "ref_logp")

    def actor(self, engine: TrainEngine) -> PPOActor:
        cfg = PPOActorConfig(
            policy_loss=self.policy_loss,
            eps_clip=self.eps_clip,
            eps_clip_higher=self.eps_clip_higher,
            kl_ctl=self.kl_beta,
            kl_estimator=self.kl_estimator,
            loss_agg=self.loss_agg,
            behav_imp_weight_cap=None,
            use_decoupled_loss=False,
        )
        # Every row carries its reference log-probabilities, so the actor never runs a reference
        # forward pass; it only insists on having an engine for one when the KL term is on.
        return PPOActor(cfg, engine, ref_engine=engine if self.kl_beta > 0 else None)

    def accumulator(self, engine: TrainEngine) -> Accumulate:
        actor = self.actor(engine)

        def accumulate(batch: TensorDict) -> dict[str, float]:
            if not self.reference:
                batch = batch.exclude("ref_logp")
            return _forward_backward(engine, batch, actor.loss_fn, actor.loss_weight)

        return accumulate


@dataclass(frozen=True)
class ValueLoss(Loss):
    """PPO's clipped value loss (`PPOCritic.loss_fn`) against ``returns``, clipped around the
    ``values`` the caller passed (None = unclipped)."""

    eps_clip: float | None = 0.2

    name: ClassVar[str] = "value"
    keys: ClassVar[tuple[str, ...]] = ("values", "returns")

    def accumulator(self, engine: TrainEngine) -> Accumulate:
        critic = PPOCritic(PPOCriticConfig(value_eps_clip=self.eps_clip), engine)
        return lambda batch: _forward_backward(engine, batch, critic.loss_fn, critic.loss_weight)


@dataclass(frozen=True)
class DPOLoss(Loss):
    """DPO's loss on (preferred, dispreferred) pairs against reference log-probabilities
    (`DPOActor.loss_fn`); ``dpo_loss`` is ``sigmoid`` (DPO) or ``ipo``."""

    beta: float = 0.1
    label_smoothing: float = 0.0
    dpo_loss: str = "sigmoid"

    name: ClassVar[str] = "dpo"
    keys: ClassVar[tuple[str, ...]] = ("ref_logp",)
    rows_per_call: ClassVar[int] = 2

    def accumulator(self, engine: TrainEngine) -> Accumulate:
        pairs = replace(engine.config.mb_spec, granularity=2)  # type: ignore[attr-defined]
        cfg = DPOConfig(beta=self.beta, label_smoothing=self.label_smoothing, dpo_loss=self.dpo_loss, mb_spec=pairs)
        actor = DPOActor(cfg, engine, ref_engine=engine)  # ref_logp comes with every pair

        def accumulate(batch: TensorDict) -> dict[str, float]:
            # The engine cuts micro-batches by its own spec: keep each pair in one micro-batch.
            configured = engine.config.mb_spec  # type: ignore[attr-defined]
            engine.config.mb_spec = replace(configured, granularity=2)  # type: ignore[attr-defined]
            try:
                return _forward_backward(engine, batch, actor.loss_fn, actor.loss_weight)
            finally:
                engine.config.mb_spec = configured  # type: ignore[attr-defined]

        return accumulate


SAMPLE = "sample_index"
"""The per-sequence key `per_sample_loss` reads: which sample of the call a row is (-1: none)."""

SampleLoss = Callable[[torch.Tensor, int], torch.Tensor]
"""``loss(logp, i) -> scalar``: sample ``i``'s loss given the log-probabilities of its trained
tokens (``[n_i]``, with gradient), for `TrainingModel.forward_backward`."""


def per_sample_loss(loss: SampleLoss, batch: TensorDict) -> tuple[LossFn, LossWeightFn]:
    """The engine's ``(loss_fn, loss_weight_fn)`` whose gradient is that of ``sum_i loss(logp_i, i)``
    over the rows of ``batch`` (which carries `SAMPLE`): `areal_lite.actors.summed_loss` of it, so
    with one rank the sum is the plain sum."""

    def sample_sum(logp: torch.Tensor, mb: PackedBatch) -> torch.Tensor:
        cu, rows, mask = mb["cu_seqlens"], mb[SAMPLE], mb["loss_mask"]
        assert isinstance(cu, torch.Tensor) and isinstance(rows, torch.Tensor) and isinstance(mask, torch.Tensor)
        total = logp.sum() * 0.0
        for j, i in enumerate(rows.tolist()):
            start, end = int(cu[j]), int(cu[j + 1])
            if i >= 0:
                total = total + loss(logp[start:end][mask[start:end].bool()], i)
        return total

    loss_fn, weight_fn = summed_loss(sample_sum, batch)
    return loss_fn, _zero_without_trained_tokens(weight_fn)


@dataclass(frozen=True)
class TangentLoss(Loss):
    """The surrogate ``sum_t tangent_t * log p_t`` whose gradient is ``sum_t tangent_t dlog p_t/dtheta``
    (`areal_lite.actors.train_on_tangents`; its docstring says how ranks combine)."""

    name: ClassVar[str] = "tangents"
    keys: ClassVar[tuple[str, ...]] = ("tangents",)

    def accumulator(self, engine: TrainEngine) -> Accumulate:
        return lambda batch: _forward_backward(engine, batch, *summed_loss(tangent_surrogate, batch))
