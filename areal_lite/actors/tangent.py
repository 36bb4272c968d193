"""Bring your own loss: a loss summed over tokens as the engine's loss (`summed_loss`), and
training on per-token gradients with respect to the log-probabilities (`train_on_tangents`).

A loss written anywhere (torch autograd, numpy, a closed form) is a function ``L(logp)`` of the
per-token log-probabilities. Its gradient ``g = dL/dlogp`` (the tangents, ``[B, L]``) is all the
engine needs: by the chain rule ``dL/dtheta = sum_t g_t dlogp_t/dtheta``, which is the gradient of
the surrogate ``sum_t g_t logp_t`` with ``g`` held fixed. So::

    logp = actor.compute_logp(batch)             # or engine.forward(batch)
    tangents = my_loss_gradient(logp, batch)      # anything that gives dL/dlogp, [B, L]
    train_on_tangents(engine, batch, tangents)

takes the same optimizer step as training on ``L`` directly, without touching the engine. With
several data-parallel ranks, each rank's tangents are the gradient of its own local loss, and the
update is the token-weighted mean of the local losses' gradients.

`summed_loss` is the adapter under it, and under every loss that is a plain sum over tokens: the
recipe API's ``forward_backward`` (`areal_lite.recipes.losses`) and the Tinker service's built-in
losses (`areal_lite.service.losses`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tensordict import TensorDict

from areal_lite.api.engine import LossFn, LossWeightFn, PackedBatch, TrainEngine

SumLoss = Callable[[torch.Tensor, PackedBatch], torch.Tensor]
"""``loss(logp, mb) -> scalar``: a micro-batch's part of a loss that is a sum over the batch's
sequences, given the micro-batch's log-probabilities ``[T]`` (with gradient)."""


def summed_loss(loss: SumLoss, batch: TensorDict) -> tuple[LossFn, LossWeightFn]:
    """The engine's ``(loss_fn, loss_weight_fn)`` for ``batch`` whose gradient is that of the plain
    sum of ``loss`` over the micro-batches (on one rank; with several, the token-weighted mean of
    the ranks' sums). The engine scales micro-batch ``m``'s loss by its weight (its tokens) over
    the total weight; the loss undoes that factor."""
    n_tokens = float(batch["attention_mask"].sum())

    def loss_fn(
        logp: torch.Tensor, entropy: torch.Tensor, mb: PackedBatch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return loss(logp, mb) * (n_tokens / logp.numel()), {}

    def weight_fn(mb: PackedBatch) -> float:
        return float(mb["input_ids"].numel())  # type: ignore[union-attr]

    return loss_fn, weight_fn


def tangent_surrogate(logp: torch.Tensor, mb: PackedBatch) -> torch.Tensor:
    """``sum_t tangents[t] * logp_t`` over a micro-batch that carries ``tangents``: its gradient is
    ``sum_t tangents[t] * dlogp_t/dtheta``."""
    return (logp * mb["tangents"]).sum()


def train_on_tangents(engine: TrainEngine, batch: TensorDict, tangents: torch.Tensor) -> dict[str, float]:
    """One optimizer step whose gradient is ``sum_t tangents[t] * dlogp_t/dtheta`` over the
    batch's real tokens. ``tangents`` ``[B, L]`` is aligned like the log-probabilities.
    Returns the engine's statistics; ``loss`` is the surrogate ``sum_t tangents[t] logp_t``."""
    if tangents.shape != batch["attention_mask"].shape:
        raise ValueError(
            f"tangents must be [B, L] = {tuple(batch['attention_mask'].shape)}, got {tuple(tangents.shape)}"
        )
    data = batch.clone(recurse=False)
    data["tangents"] = tangents.detach().float()
    return engine.train_batch(data, *summed_loss(tangent_surrogate, data))
