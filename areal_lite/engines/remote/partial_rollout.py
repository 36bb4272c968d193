"""A generation on remote servers while it is in progress: the `Answer` of each call, whatever the
protocol, and the `PartialRollout` they add up to across resumptions and retries, until it
becomes a `ModelResponse`.

A generation that comes back aborted (the servers paused for a weight update) is resubmitted by
`RemoteEngine` as prompt + generated tokens with the remaining token budget; a call that failed is
resent to another server from the same state. Each answer appends its tokens, keeping every
token's log-probability and version: the version a server reports, else the one that was current
when the call was sent. A resumed generation keeps the mixture-of-experts routes of its last part,
whose prompt is the whole prefix. A stop string that straddles two parts of a resumed generation is
not seen (each part is checked on its own), as with SGLang-based AReaL.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from areal_lite.api.io import ModelRequest, ModelResponse


def parse_version(value: object, fallback: int) -> int:
    """``value`` (a server's ``weight_version``) as an integer; ``fallback`` when it is not one."""
    try:
        return int(str(value))
    except ValueError:
        return fallback


@dataclass
class Answer:
    """One generation answer of a server, whatever its protocol."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int] | None
    """The version of each output token, when the server reports it."""
    finish: str
    """``length``, ``stop`` or ``abort`` (a pause ended it: resume)."""
    routed_experts: torch.Tensor | None = None
    """The routes of a mixture-of-experts model, when asked for: int32, flat as they came, then
    ``[tokens, layers, top_k]`` once shaped (`RemoteEngine._shape_routes`)."""


@dataclass
class PartialRollout:
    """What a generation has produced so far, across resumptions and retries."""

    t0: float = field(default_factory=time.monotonic)
    out_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    ttft: float = 0.0
    routes: torch.Tensor | None = None
    """The routes of the last answer (its prompt held everything generated before it)."""

    def absorb(self, answer: Answer, sent_version: int) -> str:
        """Append one answer to a call sent while ``sent_version`` was current (the version of
        tokens the server does not tag); returns its finish reason (``abort`` = resume)."""
        if len(answer.logprobs) != len(answer.output_ids):
            raise RuntimeError(f"{len(answer.output_ids)} tokens came with {len(answer.logprobs)} log-probabilities")
        if answer.output_ids and not self.out_ids:
            self.ttft = time.monotonic() - self.t0
        self.out_ids += answer.output_ids
        self.logprobs += answer.logprobs
        versions = answer.versions
        if versions is None or len(versions) != len(answer.output_ids):
            versions = [sent_version] * len(answer.output_ids)
        self.versions += versions
        if answer.routed_experts is not None:
            self.routes = answer.routed_experts
        return answer.finish

    def response(self, req: ModelRequest, stop_reason: str) -> ModelResponse:
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=self.out_ids,
            output_logprobs=self.logprobs,
            output_versions=self.versions,
            stop_reason=stop_reason,  # type: ignore[arg-type]
            latency=time.monotonic() - self.t0,
            ttft=self.ttft,
            rid=req.rid,
            routed_experts=self.routes,
        )
