"""A generation request of the embedded engine: its sampling parameters (SGLang's
``sampling_params``), its state while the scheduler runs it, and its result."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from areal_lite.api.io import GenerationConfig

if TYPE_CHECKING:
    import torch
    from llguidance import LLMatcher
    from transformers import PreTrainedTokenizerBase

    from areal_lite.engines.local.images import ImageInputs

GREEDY_TEMPERATURE = 1e-6
"""Temperatures below this mean greedy decoding (SGLang's convention)."""


@dataclass
class SamplingParams:
    """Sampling parameters of one request, in SGLang's vocabulary (``sampling_params``)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    top_logprobs: int = 0
    """Also report this many most likely tokens (with their log-probabilities) at each output position."""
    seed: int | None = None
    """Sample from a random stream of this request's own: the same seed gives the same tokens
    (None: the engine's shared stream)."""
    min_p: float = 0.0
    """Drop the tokens less likely than this fraction of the most likely one (after temperature)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once for each time it is already in the output (OpenAI's)."""
    presence_penalty: float = 0.0
    """Subtracted from a token's logit if it is already in the output (OpenAI's)."""
    repetition_penalty: float = 1.0
    """A token already in the prompt or the output has its logit divided by this when positive,
    multiplied when negative (CTRL's, as HF, vLLM and SGLang apply it)."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Added to the logits of these token ids (OpenAI's ``logit_bias``, clamped to [-100, 100])."""
    grammar: str | None = None
    """Structured output: llguidance's grammar the output must follow (`areal_lite.engines.local.grammar`
    builds it from a JSON schema, a regex, a choice or EBNF)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (all) or >= 1, got {self.top_k}")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be a finite number above 0, got {self.repetition_penalty}")
        if not all(math.isfinite(b) for b in self.logit_bias.values()):
            raise ValueError("logit_bias values must be finite numbers")
        self.logit_bias = {t: min(100.0, max(-100.0, b)) for t, b in self.logit_bias.items()}

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def reshapes_logits(self) -> bool:
        """Whether a bias or a penalty changes the logits this request samples from."""
        return bool(
            self.logit_bias or self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
        )

    @classmethod
    def from_gconfig(cls, g: GenerationConfig) -> SamplingParams:
        return cls(
            max_new_tokens=g.max_new_tokens,
            min_new_tokens=g.min_new_tokens,
            temperature=0.0 if g.greedy else g.temperature,
            top_p=g.top_p,
            top_k=g.top_k,
            stop=list(g.stop),
            stop_token_ids=list(g.stop_token_ids),
            ignore_eos=g.ignore_eos,
            min_p=g.min_p,
            frequency_penalty=g.frequency_penalty,
            presence_penalty=g.presence_penalty,
            repetition_penalty=g.repetition_penalty,
        )


@dataclass
class GenerationResult:
    """What one request produced. ``finish_reason`` is SGLang's dict: ``{"type": "length",
    "length": n}``, ``{"type": "stop", "matched": id_or_str}`` or ``{"type": "abort", "message": s}``."""

    rid: str
    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: dict[str, object]
    input_logprobs: list[float | None] | None
    """Log-probability of each prompt token given the ones before it (None at position 0);
    only when asked for."""
    latency: float
    ttft: float
    error: str | None = None
    """Set when the engine failed while running the request (`generate` raises it)."""
    output_top_logprobs: list[list[tuple[int, float]]] | None = None
    """With ``top_logprobs`` > 0: the (token id, log-probability) of the most likely tokens at each
    output position, most likely first."""
    routed_experts: torch.Tensor | None = None
    """A mixture-of-experts model's routes: int32 [prompt + output tokens - 1, layers, top_k], the
    experts each token that went through the model was sent to (-1 on layers without experts)."""
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    """With prompt log-probabilities and ``top_logprobs`` > 0: the most likely tokens at each
    prompt position, as ``output_top_logprobs`` (None at position 0)."""


@dataclass
class TokenOut:
    """One output token as a streamed request produces it."""

    token: int
    logprob: float
    version: int
    top: list[tuple[int, float]] | None
    input_logprobs: list[float | None] | None = None
    """The prompt's log-probabilities (and below, its most likely tokens), on the first token of a
    request that asked for them: a stream can answer them before the generation ends."""
    input_top: list[list[tuple[int, float]] | None] | None = None


class GenerationError(RuntimeError):
    """The engine failed while running a request (not the request's fault)."""


class Sequence:
    """A request inside the scheduler: its prompt and parameters, and what it has produced so far
    (plain attributes: touched once per token)."""

    __slots__ = (
        "abort_message", "deliver", "images", "input_logprobs", "input_top", "logprobs", "matcher", "on_token", "out",
        "params", "prompt", "rid", "rng", "routes", "stop_ids", "t0", "top", "ttft", "versions", "want_input_logprobs",
    )  # fmt: skip

    def __init__(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        deliver: Callable[[GenerationResult], None],
        stop_ids: frozenset[int],
        want_input_logprobs: bool,
        on_token: Callable[[TokenOut], None] | None = None,
        images: ImageInputs | None = None,
    ) -> None:
        self.rid = rid
        self.prompt = prompt
        self.images = images
        """The prompt's images (vision-language models), None without."""
        self.params = params
        self.deliver = deliver
        self.out: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.top: list[list[tuple[int, float]]] = []
        self.on_token = on_token
        """Called from the scheduler thread with each new token (streamed requests)."""
        self.rng: torch.Generator | None = None
        """The request's own random stream (``params.seed``), made by the model runner."""
        self.stop_ids = stop_ids
        self.want_input_logprobs = want_input_logprobs
        self.input_logprobs: list[float | None] | None = None
        self.input_top: list[list[tuple[int, float]] | None] | None = None
        self.t0 = time.monotonic()
        self.ttft = 0.0
        self.abort_message: str | None = None
        self.routes: torch.Tensor | None = None
        """Set by the scheduler as the request leaves the batch (mixture-of-experts models)."""
        self.matcher: LLMatcher | None = None
        """The grammar's state (``params.grammar``), set by the scheduler, fed each token."""

    def result(self, finish_reason: dict[str, object]) -> GenerationResult:
        return GenerationResult(
            rid=self.rid,
            input_ids=self.prompt,
            output_ids=self.out,
            output_logprobs=self.logprobs,
            output_versions=self.versions,
            finish_reason=finish_reason,
            input_logprobs=self.input_logprobs,
            latency=time.monotonic() - self.t0,
            ttft=self.ttft,
            output_top_logprobs=self.top if self.params.top_logprobs else None,
            # A request admitted only for its prompt's log-probabilities cached its whole prompt.
            routed_experts=None if self.routes is None else self.routes[: len(self.prompt) + len(self.out) - 1],
            input_top_logprobs=self.input_top,
        )

    def finish_reason(self, tokenizer: PreTrainedTokenizerBase | None, context_len: int) -> dict[str, object] | None:
        """Why the request ends after its last token (`GenerationResult.finish_reason`), None while
        it goes on: aborted, a stop token or string (once past ``min_new_tokens``; ``tokenizer``
        decodes its last tokens for stop strings), ``max_new_tokens`` or the context length."""
        n = len(self.out)
        if self.abort_message is not None:
            return {"type": "abort", "message": self.abort_message}
        p = self.params
        if n >= p.min_new_tokens and n > 0:
            if self.out[-1] in self.stop_ids:
                return {"type": "stop", "matched": self.out[-1]}
            if p.stop:
                text = tokenizer.decode(self.out[-64:])
                for stop in p.stop:
                    if stop in text:
                        return {"type": "stop", "matched": stop}
        if n >= p.max_new_tokens or len(self.prompt) + n >= context_len:
            return {"type": "length", "length": n}
        return None

    def emit(self) -> None:
        """Hand the last token to ``on_token`` (if any)."""
        if self.on_token is not None:
            top = self.top[-1] if self.params.top_logprobs else None
            out = TokenOut(self.out[-1], self.logprobs[-1], self.versions[-1], top)
            if len(self.out) == 1:
                out.input_logprobs, out.input_top = self.input_logprobs, self.input_top
            self.on_token(out)
