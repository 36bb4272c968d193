"""What the OpenAI routes of our server read alike from a request (``/v1/completions``,
``/v1/chat/completions``, ``/v1/responses``), held to OpenAI's and vLLM's limits: how to answer
(`Options`), the sampling with its output constraint (`sampling_params`: ``response_format``,
vLLM's ``structured_outputs``, or the grammar of a forced tool call, `forced_call`), and the
generation of each choice (`choice_jobs`); for a completion or chat request, all of it at once
once its prompts are read (`ChoiceRequest.read`)."""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass

from areal_lite.engines.local import grammar
from areal_lite.engines.local.request import SamplingParams
from areal_lite.engines.local.scheduler import Scheduler
from areal_lite.engines.server.streaming import Job
from areal_lite.openai_format.chat import (
    BadRequest,
    bool_field,
    chat_messages,
    float_field,
    int_field,
    shaping_fields,
    stop_strings,
)

MAX_TOP_LOGPROBS = 20
"""The most top log-probabilities a request may ask for per position (OpenAI's and vLLM's limit)."""

MAX_N = 128
"""The most choices a request may ask for (OpenAI's limit on ``n``)."""

MAX_TEMPERATURE = 2.0
"""OpenAI's upper bound on ``temperature`` (the API reference: "between 0 and 2")."""


@dataclass
class Options:
    """What the completion and chat routes read alike from a request: how to answer, and its id."""

    stream: bool
    include_usage: bool
    """A streamed answer ends with a usage chunk (``stream_options.include_usage``)."""
    n: int
    skip_special: bool
    keep_stop: bool
    """``include_stop_str_in_output``: keep a matched stop string in the text."""
    with_ids: bool
    """``return_token_ids``: add the prompt's and the output's token ids (vLLM)."""
    request_id: str

    @classmethod
    def parse(cls, body: dict[str, object]) -> Options:
        stream = bool_field(body, "stream", False)
        opts = body.get("stream_options")
        if opts is not None and not stream:
            raise BadRequest("stream_options can only be given with stream: true", param="stream_options")
        if opts is not None and not isinstance(opts, dict):
            raise BadRequest("stream_options must be an object", param="stream_options")
        request_id = body.get("request_id") or uuid.uuid4().hex
        if not isinstance(request_id, str):
            raise BadRequest("request_id must be a string", param="request_id")
        return cls(
            stream=stream,
            include_usage=opts is not None and bool_field(opts, "include_usage", False),
            n=int_field(body, "n", 1),
            skip_special=bool_field(body, "skip_special_tokens", True),
            keep_stop=bool_field(body, "include_stop_str_in_output", False),
            with_ids=bool_field(body, "return_token_ids", False),
            request_id=request_id,
        )


def top_logprobs_field(body: dict[str, object], key: str) -> int:
    """A request's count of top log-probabilities per position, checked against the limit."""
    n = int_field(body, key, 0)
    if not 0 <= n <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"{key} must be in [0, {MAX_TOP_LOGPROBS}], got {n}", param=key)
    return n


def completion_logprobs_field(body: dict[str, object]) -> int | None:
    """A completion request's ``logprobs``: None (none asked for), or how many top
    log-probabilities to report per position beside the sampled token's."""
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)):
        raise BadRequest(f"logprobs must be an integer, got {logprobs!r}", param="logprobs")
    top_n = top_logprobs_field(body, "logprobs")
    return None if logprobs is None else top_n


def chat_logprobs_fields(body: dict[str, object]) -> tuple[bool, int]:
    """A chat request's ``logprobs`` (report them) and ``top_logprobs`` (how many most likely
    tokens per position, which needs ``logprobs``)."""
    want_logprobs = bool_field(body, "logprobs", False)
    top_n = top_logprobs_field(body, "top_logprobs")
    if top_n and not want_logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    return want_logprobs, top_n


def check_messages(body: dict[str, object], images: bool = False) -> None:
    """Raise `BadRequest` naming ``messages`` for a chat request's messages OpenAI refuses: none,
    not objects with a known role, parts other than text (and ``image_url`` where ``images``),
    or a message without content where its role needs some (every role but an assistant's
    message with tool calls)."""
    chat_messages(body.get("messages"), images)
    for i, m in enumerate(body["messages"]):  # type: ignore[arg-type]
        if m.get("content") is None and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise BadRequest(
                f"messages[{i}].content is required for a {m['role']} message", param=f"messages[{i}].content"
            )


def sampling_params(
    scheduler: Scheduler,
    body: dict[str, object],
    max_tokens: int | None,
    prompt_len: int,
    top_logprobs: int = 0,
    prompt_key: str = "messages",
    budget_key: str = "max_tokens",
    scoring: bool = False,
    tool_grammar: str | None = None,
) -> SamplingParams:
    """The request's sampling options; ``max_tokens`` None = up to the context length, and
    no more than fits after the prompt (vLLM's rule; OpenAI's service answers a 400 instead).
    A prompt that fills the context is a 400 (``context_length_exceeded``) naming
    ``prompt_key``; a budget below 1 is a 400 naming ``budget_key``, except 0 when
    ``scoring`` (a completion echoing its prompt, to score it). ``tool_grammar``: a forced
    tool call's, which takes the place of ``response_format``."""
    context = scheduler.context_len
    if prompt_len >= context:
        raise BadRequest(
            f"This model's maximum context length is {context} tokens. However, your {prompt_key} "
            f"resulted in {prompt_len} tokens. Please reduce the length of the {prompt_key}.",
            param=prompt_key,
            code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = context - prompt_len
    if max_tokens < (0 if scoring else 1):
        raise BadRequest(f"{budget_key} must be at least 1, got {max_tokens}", param=budget_key)
    if max_tokens > context:
        raise BadRequest(
            f"{budget_key}={max_tokens} cannot be greater than the context length {context}. "
            "Please request fewer output tokens.",
            param=budget_key,
        )
    # As vLLM: a budget that only the prompt takes past the context is cut to what fits
    # (the answer ends with `length`).
    max_tokens = min(max_tokens, context - prompt_len)
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise BadRequest("stop_token_ids must be a list of integers", param="stop_token_ids")
    min_tokens = int_field(body, "min_tokens", 0)
    if not 0 <= min_tokens <= max_tokens:  # vLLM's rule
        raise BadRequest(f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}", param="min_tokens")
    stop = stop_strings(body)
    top_k = int_field(body, "top_k", -1)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**63):
        raise BadRequest(f"seed must be a 64-bit integer, got {seed!r}", param="seed")
    temperature = float_field(body, "temperature", 1.0)
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise BadRequest(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature}", param="temperature")
    top_p = float_field(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    shaping = shaping_fields(body)  # before the try: its BadRequest names the field
    try:
        constraint = tool_grammar or grammar.requested(body.get("response_format"), body.get("structured_outputs"))
        if constraint is not None:
            scheduler.grammars.check(constraint)
    except ValueError as e:
        if tool_grammar is not None:
            key = "tools"  # a tool's parameters schema that does not compile
        elif body.get("response_format") not in (None, {"type": "text"}):
            key = "response_format"
        else:
            key = "structured_outputs"
        raise BadRequest(str(e), param=key) from e
    try:
        return SamplingParams(
            max_new_tokens=max_tokens,
            min_new_tokens=min_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=-1 if top_k == 0 else top_k,  # vLLM: 0 or -1 = every token
            stop=stop,
            stop_token_ids=list(stop_ids),
            ignore_eos=bool_field(body, "ignore_eos", False),
            top_logprobs=top_logprobs,
            seed=seed,
            **shaping,
            grammar=constraint,
        )
    except ValueError as e:
        raise BadRequest(str(e)) from e


def forced_call(body: dict[str, object], tools: list[dict[str, object]] | None) -> tuple[str | None, str | None]:
    """(grammar, named tool) of a chat request whose ``tool_choice`` forces a call
    (`grammar.forced_tool_call`); (None, None) when it does not."""
    choice = body.get("tool_choice")
    if tools is None or not (choice == "required" or isinstance(choice, dict)):
        return None, None
    try:
        return grammar.forced_tool_call(choice, tools, body.get("parallel_tool_calls"))
    except ValueError as e:
        raise BadRequest(str(e), param="tool_choice") from e


def choice_jobs(
    scheduler: Scheduler, prompts: list[list[int]], params: SamplingParams, n: int, request_id: str
) -> list[Job]:
    """(prompt, params, rid) of each choice: ``n`` of each prompt, in the order prompt 0's
    choices, prompt 1's, ...; choice ``i`` of a seeded request samples with ``seed + i``."""
    if not 1 <= n <= MAX_N:
        raise BadRequest(f"n must be in [1, {MAX_N}], got {n}", param="n")
    try:
        for p in prompts:
            scheduler.validate_request(p, params)
    except ValueError as e:
        raise BadRequest(str(e)) from e
    out = []
    for i in range(len(prompts) * n):
        p = params if params.seed is None else dataclasses.replace(params, seed=params.seed + i)
        out.append((prompts[i // n], p, f"{request_id}-{i}"))
    return out


@dataclass
class ChoiceRequest:
    """A completion or chat request, read: the model it names, how to answer, its sampling and
    the generation of each choice."""

    model: str
    o: Options
    params: SamplingParams
    jobs: list[Job]

    @classmethod
    def read(
        cls,
        scheduler: Scheduler,
        body: dict[str, object],
        model: str,
        o: Options,
        prompts: list[list[int]],
        max_tokens: int | None,
        top_logprobs: int,
        *,
        prompt_key: str = "messages",
        budget_key: str = "max_tokens",
        scoring: bool = False,
        tool_grammar: str | None = None,
    ) -> ChoiceRequest:
        """The sampling of ``body`` (`sampling_params`, the longest prompt against the context)
        and ``o.n`` choices of each prompt (`choice_jobs`)."""
        longest = max(len(p) for p in prompts)
        params = sampling_params(
            scheduler, body, max_tokens, longest, top_logprobs, prompt_key, budget_key, scoring, tool_grammar
        )
        return cls(model, o, params, choice_jobs(scheduler, prompts, params, o.n, o.request_id))
