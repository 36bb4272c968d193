"""`DPOActor`: direct preference optimisation (DPO, Rafailov et al. 2023; or IPO, Azar et al.
2023) against a frozen reference model, over any `TrainEngine`.

A batch holds pairs: row ``2i`` is the chosen and row ``2i + 1`` the rejected answer to the same
prompt, with ``loss_mask`` on the answer tokens. A sequence's log-probability is the sum over its
masked tokens. Micro-batches must keep pairs together (``mb_spec.granularity`` even).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from areal_lite.actors.ppo import per_token_forward
from areal_lite.algorithms import functional as F
from areal_lite.api.config import DPOConfig
from areal_lite.api.engine import PackedBatch, TrainEngine


class DPOActor:
    """A policy trained on preference pairs; ``ref_engine`` is the frozen reference policy.
    ``loss`` replaces the configured one (signature of `functional.dpo_sigmoid_loss`)."""

    def __init__(
        self, config: DPOConfig, engine: TrainEngine, ref_engine: TrainEngine, loss: F.PreferenceLossFn | None = None
    ) -> None:
        if config.mb_spec.granularity % 2:
            raise ValueError("DPO needs mb_spec.granularity even, so that a pair is never cut between micro-batches")
        self.config = config
        self.engine = engine
        self.ref_engine = ref_engine
        self.loss = loss or F.pick(F.PREFERENCE_LOSSES, config.dpo_loss, "DPO loss")

    def compute_ref_logp(self, batch: TensorDict) -> torch.Tensor:
        """Per-token log-probabilities ``[B, L]`` under the reference model."""
        return per_token_forward(self.ref_engine, batch)

    def loss_fn(
        self, logp: torch.Tensor, entropy: torch.Tensor, mb: PackedBatch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = mb["loss_mask"].to(logp.dtype)  # type: ignore[union-attr]
        cu = mb["cu_seqlens"]
        seq = F.seq_sum(logp * mask, cu).view(-1, 2)  # type: ignore[arg-type]
        ref = F.seq_sum(mb["ref_logp"] * mask, cu).view(-1, 2)  # type: ignore[arg-type,operator]
        losses = self.loss(seq[:, 0], seq[:, 1], ref[:, 0], ref[:, 1], self.config.beta, self.config.label_smoothing)
        chosen = (seq[:, 0] - ref[:, 0]).detach() * self.config.beta
        rejected = (seq[:, 1] - ref[:, 1]).detach() * self.config.beta
        stats = {
            "reward_accuracy": (chosen > rejected).float().mean(),
            "reward_margin": (chosen - rejected).mean(),
            "chosen_reward": chosen.mean(),
            "rejected_reward": rejected.mean(),
            "entropy": F.masked_mean(entropy.detach(), mask.bool()),
        }
        return losses.mean(), stats

    @staticmethod
    def loss_weight(mb: PackedBatch) -> float:
        return (mb["cu_seqlens"].numel() - 1) / 2  # type: ignore[union-attr]

    def train_dpo(self, batch: TensorDict) -> dict[str, float]:
        """One optimizer step on a batch of pairs (``ref_logp`` is computed when missing)."""
        self._check_pairs(batch)
        if "ref_logp" not in batch:
            batch["ref_logp"] = self.compute_ref_logp(batch)
        stats = self.engine.train_batch(batch, self.loss_fn, self.loss_weight)
        return {**stats, "tokens_trained": float(batch["loss_mask"].sum())}

    def evaluate_dpo(self, batch: TensorDict) -> dict[str, float]:
        """The loss and implicit-reward statistics without an update."""
        self._check_pairs(batch)
        if "ref_logp" not in batch:
            batch["ref_logp"] = self.compute_ref_logp(batch)
        return self.engine.eval_batch(batch, self.loss_fn, self.loss_weight)

    @staticmethod
    def _check_pairs(batch: TensorDict) -> None:
        if batch.batch_size[0] % 2:
            raise ValueError("a DPO batch holds (chosen, rejected) pairs: an even number of rows")

    def step_lr_scheduler(self) -> None:
        self.engine.step_lr_scheduler()
