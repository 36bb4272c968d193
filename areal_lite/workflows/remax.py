"""ReMax rollouts (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement
Learning Method for Aligning Large Language Models", Algorithm 1).

Per prompt: sampled completions and one greedy completion. The greedy completion's reward is the
baseline: the training signal is ``rewards - baseline_rewards`` (see
`areal_lite.algorithms.functional.remax_advantages`). Only the sampled completions are returned
for training; the greedy one only supplies ``baseline_rewards`` (float32 ``[n]``).
"""

from __future__ import annotations

import asyncio

from tensordict import TensorDict

from areal_lite.api.engine import InferenceEngine
from areal_lite.api.io import ModelRequest
from areal_lite.utils.data import concat_padded
from areal_lite.workflows.rlvr import RLVRWorkflow, score
from areal_lite.workflows.trajectory import from_response


class ReMaxWorkflow(RLVRWorkflow):
    """``gconfig.n_samples`` sampled completions (usually 1) and a greedy baseline per prompt.
    Constructed like `RLVRWorkflow`."""

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, object]) -> TensorDict:
        prompt_ids = self.prompt_ids(data)
        sampled_cfg = self.gconfig.new(n_samples=1, greedy=False)
        greedy_cfg = self.gconfig.new(n_samples=1, greedy=True)
        requests = [ModelRequest(input_ids=prompt_ids, gconfig=greedy_cfg)]
        requests += [ModelRequest(input_ids=prompt_ids, gconfig=sampled_cfg) for _ in range(self.gconfig.n_samples)]
        greedy, *sampled = await asyncio.gather(*(engine.agenerate(r) for r in requests))
        prompt = self.tokenizer.decode(prompt_ids)  # type: ignore[attr-defined]
        baseline, *rewards = await asyncio.gather(
            *(score(self.reward, self.tokenizer, prompt, r, data) for r in [greedy, *sampled])
        )
        return concat_padded(
            [from_response(r, reward, baseline_rewards=baseline) for r, reward in zip(sampled, rewards)]
        )
