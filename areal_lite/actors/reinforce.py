"""`ReinforceActor`: on-policy REINFORCE (Williams 1992) with a baseline, over any `TrainEngine`.

One plain policy-gradient step per batch, ``-A * log pi`` per token, with no ratio and no trust
region. The baseline comes from the configured advantage estimator: ReMax (greedy answer's
reward, Li et al. 2023), RLOO, a group mean (GRPO / Dr. GRPO) or REINFORCE++'s whitened returns.
Tokens from an older policy (asynchronous rollout) are weighted by the capped importance weight
against the behaviour policy only when the batch carries ``prox_logp``.
"""

from __future__ import annotations

from dataclasses import replace

from tensordict import TensorDict

from areal_lite.actors.ppo import PPOActor
from areal_lite.api.config import PPOActorConfig
from areal_lite.api.engine import TrainEngine


class ReinforceActor(PPOActor):
    """`PPOActor` with the REINFORCE loss, one minibatch per batch and no log-prob recomputation
    (those fields of ``config`` are overridden)."""

    def __init__(self, config: PPOActorConfig, engine: TrainEngine, ref_engine: TrainEngine | None = None) -> None:
        config = replace(config, ppo_n_minibatches=1, recompute_logprob=False, policy_loss="reinforce")
        super().__init__(config, engine, ref_engine)

    def train_step(self, batch: TensorDict) -> dict[str, float]:
        """Advantages, then one policy-gradient step; returns the update's statistics."""
        self.compute_advantages(batch)
        return self.ppo_update(batch)
