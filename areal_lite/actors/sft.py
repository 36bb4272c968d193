"""`SFTActor`: supervised fine-tuning (token-mean negative log-likelihood of the ``loss_mask``
tokens, i.e. the completions) over any `TrainEngine`."""

from __future__ import annotations

import math

import torch
from tensordict import TensorDict

from areal_lite.algorithms import functional as F
from areal_lite.api.config import TrainEngineConfig
from areal_lite.api.engine import PackedBatch, TrainEngine


class SFTActor:
    """Trains a language model on the ``loss_mask`` tokens of padded batches."""

    def __init__(self, config: TrainEngineConfig, engine: TrainEngine) -> None:
        self.config = config
        self.engine = engine

    @staticmethod
    def loss_fn(
        logp: torch.Tensor, entropy: torch.Tensor, mb: PackedBatch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = mb["loss_mask"].bool()  # type: ignore[union-attr]
        loss = F.token_mean(F.sft_nll(logp, mask), mask, mb["cu_seqlens"])  # type: ignore[arg-type]
        return loss, {"entropy": F.masked_mean(entropy.detach(), mask)}

    @staticmethod
    def loss_weight(mb: PackedBatch) -> float:
        return float(mb["loss_mask"].sum())  # type: ignore[union-attr]

    def train_lm(self, batch: TensorDict) -> dict[str, float]:
        """One optimizer step; returns ``loss`` (NLL per token), ``ppl`` and ``tokens_trained``."""
        stats = self.engine.train_batch(batch, self.loss_fn, self.loss_weight)
        return self._with_totals(stats, batch)

    def evaluate_lm(self, batch: TensorDict) -> dict[str, float]:
        """The same statistics without an update."""
        return self._with_totals(self.engine.eval_batch(batch, self.loss_fn, self.loss_weight), batch)

    @staticmethod
    def _with_totals(stats: dict[str, float], batch: TensorDict) -> dict[str, float]:
        return {**stats, "ppl": math.exp(min(stats["loss"], 50.0)), "tokens_trained": float(batch["loss_mask"].sum())}

    def step_lr_scheduler(self) -> None:
        self.engine.step_lr_scheduler()
