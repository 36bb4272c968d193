"""`EpisodeWorkflow`: what the workflows that run a group of episodes per item share
(`MultiTurnWorkflow`, `AgentWorkflow`, ``VerifiersWorkflow``): ``gconfig.n_samples`` counts the
episodes, each model call of an episode samples once, and the chat template's settings and the
context bound hold for every call."""

from __future__ import annotations

from areal_lite.api.io import GenerationConfig
from areal_lite.api.workflow import RolloutWorkflow


class EpisodeWorkflow(RolloutWorkflow):
    """``n_episodes`` (``gconfig.n_samples``) independent episodes per item, each model call with
    ``gconfig`` at one sample; ``max_context_tokens`` bounds an episode's conversation (None: the
    engine's context) and ``template_kwargs`` go to the chat template."""

    def __init__(
        self,
        gconfig: GenerationConfig,
        tokenizer: object,
        max_context_tokens: int | None,
        template_kwargs: dict[str, object],
    ) -> None:
        self.gconfig = gconfig.new(n_samples=1)
        self.n_episodes = gconfig.n_samples
        self.tokenizer = tokenizer
        self.max_context_tokens = max_context_tokens
        self.template_kwargs = template_kwargs
