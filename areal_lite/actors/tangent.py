"""Bring your own loss: train on per-token gradients with respect to the log-probabilities.

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
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from areal_lite.api.engine import PackedBatch, TrainEngine


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
    n_tokens = float(batch["attention_mask"].sum())

    def loss_fn(
        logp: torch.Tensor, entropy: torch.Tensor, mb: PackedBatch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # The engine scales this micro-batch by (its tokens / all tokens); undo both factors so
        # that the micro-batches add up to the plain sum of tangent * logp.
        return (logp * mb["tangents"]).sum() * (n_tokens / logp.numel()), {}

    def weight_fn(mb: PackedBatch) -> float:
        return float(mb["input_ids"].numel())  # type: ignore[union-attr]

    return engine.train_batch(data, loss_fn, weight_fn)
