"""The OpenAI-compatible routes of our server: ``/v1/models`` (and ``/v1/models/{id}``),
``/v1/completions`` and ``/v1/chat/completions`` (docs/protocol.md, "OpenAI-compatible routes");
``/v1/responses`` is `areal_lite.engines.server.responses_routes`, built on this module's `OpenAIRoutes`.

They answer as vLLM's OpenAI server does, vLLM's extensions included: prompts as token ids, token
ids back with ``return_token_ids``, ``top_k`` / ``min_tokens`` / ``stop_token_ids`` /
``ignore_eos``, ``finish_reason: "abort"`` for a generation ended by a pause, and vLLM's rule for
the token a generation stops on (end of sequence or a stop token id): counted, but left out of the
text unless ``include_stop_str_in_output``, and named by ``stop_reason`` only when it is a stop
token id. Agent frameworks and the ``openai`` SDK talk to them, and `RemoteVLLMEngine` is tested
against them. Tool calls are read from the completion in the Hermes format
(`areal_lite.openai_format.tool_calls`); what a chat request says is read by `areal_lite.openai_format.chat`,
shared with the agent workflows' recording proxy.

The server answers to the names it is given (``--served-model-name``, default the model path), so
a client that sends a hub name works once that name is served. ``stream: true`` sends each token as
the scheduler produces it (`areal_lite.engines.server.streaming`). ``seed`` gives a request a random
stream of its own (choice ``i`` of ``n`` uses ``seed + i``): the same seed, the same tokens.
``top_logprobs`` (chat) and ``logprobs`` (completions) report up to `MAX_TOP_LOGPROBS` most likely
tokens per position, the policy's own (temperature 1, before top-p / top-k), like the sampled
token's; a chat entry's ``bytes`` are the token's own (`TokenBytes`). ``echo`` (completions) puts
the prompt before the answer. ``frequency_penalty``, ``presence_penalty``, ``logit_bias`` and vLLM's
``repetition_penalty`` and ``min_p`` shape what is sampled (`areal_lite.engines.local.shaping`), not the
reported log-probabilities. ``response_format`` (``json_object``, ``json_schema``) and vLLM's
``structured_outputs`` (``json``, ``json_object``, ``regex``, ``choice``, ``grammar``) constrain the
output (`areal_lite.engines.local.grammar`), and so does a ``tool_choice`` that forces a call (``required``
or a named function): the answer is held to Hermes-format calls of the tools, their arguments to
each tool's schema, and read back as the calls. Refused with a 400:
what OpenAI's ranges exclude (``temperature`` above 2, ``n`` above
`MAX_N`). Every error is OpenAI's error object (``{"error": {"message", "type", "param", "code"}}``);
an unknown model is a 404, as in vLLM, and so are routes this server does not serve (embeddings,
images, audio, moderations), with a message that says so.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from urllib.parse import unquote

from aiohttp import web

from areal_lite import __version__
from areal_lite.engines.local import grammar
from areal_lite.engines.local.request import GenerationResult, SamplingParams, TokenOut
from areal_lite.engines.local.scheduler import Scheduler
from areal_lite.engines.server.common import CONTEXT_TOKENS, TokenBytes, output_text, read_json, token_ids, token_text
from areal_lite.engines.server.streaming import TOOL_CALL_START, TextDeltas, merged, send_events
from areal_lite.openai_format.chat import (
    BadRequest,
    assistant_message,
    bool_field,
    chat_finish_reason,
    chat_messages,
    chat_tools,
    float_field,
    int_field,
    max_completion_tokens,
    refuse_unsupported,
    render_chat,
    shaping_fields,
    stop_strings,
)
from areal_lite.openai_format.tool_calls import parse_tool_calls

MAX_TOP_LOGPROBS = 20
"""The most top log-probabilities a request may ask for per position (OpenAI's and vLLM's limit)."""

NOT_SERVED = (
    "/v1/embeddings",
    "/v1/images/generations",
    "/v1/images/edits",
    "/v1/images/variations",
    "/v1/audio/speech",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/moderations",
)
"""OpenAI routes a text-generation server does not serve: answered with a 404 that says so."""

SYSTEM_FINGERPRINT = f"areal-lite-{__version__}"
"""An answer's ``system_fingerprint`` (vLLM's names its version): the server software that
answered, for telling answers of different builds apart."""

MAX_N = 128
"""The most choices a request may ask for (OpenAI's limit on ``n``)."""

MAX_TEMPERATURE = 2.0
"""OpenAI's upper bound on ``temperature`` (the API reference: "between 0 and 2")."""


def finish_type(r: GenerationResult) -> str:
    """OpenAI's (and vLLM's) name for why a generation ended: stop, length or abort."""
    return str(r.finish_reason["type"])


def stop_reason(r: GenerationResult, params: SamplingParams) -> int | str | None:
    """vLLM's ``stop_reason``: the stop string or ``stop_token_ids`` token a generation ended on;
    None for any other end, end of sequence included."""
    matched = r.finish_reason.get("matched")
    return matched if isinstance(matched, str) or matched in params.stop_token_ids else None


def without_stop_token(r: GenerationResult, keep: bool) -> GenerationResult:
    """``r`` without the token it stopped on (end of sequence or a ``stop_token_ids`` one), whose
    text vLLM leaves out of the answer's unless ``include_stop_str_in_output`` (``keep``); its
    log-probability and usage still count it."""
    if keep or not isinstance(r.finish_reason.get("matched"), int):
        return r
    return dataclasses.replace(r, output_ids=r.output_ids[:-1])


@dataclass
class Options:
    """What both routes read alike from a request: how to answer, and its id."""

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


def check_messages(body: dict[str, object]) -> None:
    """Raise `BadRequest` naming ``messages`` for a chat request's messages OpenAI refuses: none,
    not objects with a known role, or a message without content where its role needs some (every
    role but an assistant's message with tool calls)."""
    chat_messages(body.get("messages"))
    for i, m in enumerate(body["messages"]):  # type: ignore[arg-type]
        if m.get("content") is None and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise BadRequest(
                f"messages[{i}].content is required for a {m['role']} message", param=f"messages[{i}].content"
            )


class OpenAIRoutes:
    """Handlers of the OpenAI-compatible routes over the server's `Scheduler`.

    ``model_names`` are the names the server answers to (``/v1/models`` lists them; a request
    must name one of them or none); the first is the name answers carry when a request names none.
    """

    def __init__(self, scheduler: Scheduler, model_names: list[str]) -> None:
        if not model_names:
            raise ValueError("give the server at least one model name")
        self.scheduler = scheduler
        self.model_names = list(model_names)
        self.token_bytes = TokenBytes(scheduler.tokenizer)
        self.created = int(time.time())
        """The models' ``created`` (Unix seconds): when the server started serving them."""

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_get("/v1/models", self.models)
        router.add_get("/v1/models/{model_id:.+}", self.model)
        router.add_post("/v1/completions", self.completions)
        router.add_post("/v1/chat/completions", self.chat_completions)
        for path in NOT_SERVED:
            router.add_route("*", path, self.not_served)

    # ----- models and what is not served -------------------------------------------------------

    def _card(self, name: str) -> dict[str, object]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "areal-lite",
            "root": self.scheduler.config.path,
            "parent": None,
            "max_model_len": self.scheduler.context_len,
        }

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card(name) for name in self.model_names]})

    async def model(self, request: web.Request) -> web.Response:
        name = unquote(request.match_info["model_id"])
        return web.json_response(self._card(self.model_name({"model": name})))

    async def not_served(self, request: web.Request) -> web.Response:
        raise BadRequest(
            f"{request.path} is not served: this server generates text with one model "
            "(/v1/chat/completions, /v1/completions, /v1/responses)",
            status=404,
            code="unsupported_endpoint",
        )

    # ----- shared by the routes ------------------------------------------------------------

    def model_name(self, body: dict[str, object]) -> str:
        """The served name a request names (the first one when it names none); 404 otherwise."""
        model = body.get("model")
        if model is None:
            return self.model_names[0]
        if model not in self.model_names:
            raise BadRequest(f"The model `{model}` does not exist.", status=404, param="model", code="model_not_found")
        return str(model)

    def sampling(
        self,
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
        context = self.scheduler.context_len
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
            raise BadRequest(
                f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}", param="min_tokens"
            )
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
                self.scheduler.grammars.check(constraint)
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

    @staticmethod
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

    def jobs(
        self, prompts: list[list[int]], params: SamplingParams, n: int, request_id: str
    ) -> list[tuple[list[int], SamplingParams, str]]:
        """(prompt, params, rid) of each choice: ``n`` of each prompt, in the order prompt 0's
        choices, prompt 1's, ...; choice ``i`` of a seeded request samples with ``seed + i``."""
        if not 1 <= n <= MAX_N:
            raise BadRequest(f"n must be in [1, {MAX_N}], got {n}", param="n")
        try:
            for p in prompts:
                self.scheduler.validate_request(p, params)
        except ValueError as e:
            raise BadRequest(str(e)) from e
        out = []
        for i in range(len(prompts) * n):
            p = params if params.seed is None else dataclasses.replace(params, seed=params.seed + i)
            out.append((prompts[i // n], p, f"{request_id}-{i}"))
        return out

    async def generate(self, jobs: list[tuple[list[int], SamplingParams, str]]) -> list[GenerationResult]:
        """The results of ``jobs`` (prompt, params, rid), not streamed: no per-token hand-over."""
        return await self.scheduler.generate_many(jobs)

    def token_text(self, token: int, as_ids: bool = False, before: Sequence[int] = ()) -> str:
        """A token's text in log-probabilities (`token_text`: vLLM's, ``before`` the tokens before it)."""
        tok = self.scheduler.tokenizer
        return f"token_id:{token}" if as_ids or tok is None else token_text(tok, token, before)

    def text_of(self, r: GenerationResult, o: Options) -> str:
        return output_text(self.scheduler.tokenizer, without_stop_token(r, o.keep_stop), o.skip_special, o.keep_stop)

    def ending_ids(self, params: SamplingParams, keep: bool = False) -> frozenset[int]:
        """The tokens a generation of ``params`` may stop on, which a stream holds back
        (`TextDeltas`): none when ``keep`` (their text is kept)."""
        return frozenset() if keep else self.scheduler.stop_ids(params)

    def chat_logprobs(
        self, tokens: list[int], logprobs: list[float], tops: list | None, before: Sequence[int] = ()
    ) -> list[dict[str, object]]:
        """Chat's ``logprobs.content`` entries for these output tokens (``tops``: their top lists;
        ``before``: the output tokens before them, in a stream)."""

        def entry(token: int, logprob: float, context: list[int]) -> dict[str, object]:
            text = self.token_text(token, before=context)
            return {"token": text, "logprob": logprob, "bytes": self.token_bytes(token, text)}

        out = []
        for k, (token, lp) in enumerate(zip(tokens, logprobs)):
            context = [*before[-CONTEXT_TOKENS:], *tokens[:k]]
            top = [entry(tid, v, context) for tid, v in (tops[k] if tops else [])]
            out.append({**entry(token, lp, context), "top_logprobs": top})
        return out

    @staticmethod
    def usage(results: list[GenerationResult], prompt_tokens: int) -> dict[str, int]:
        completion = sum(len(r.output_ids) for r in results)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }

    # ----- /v1/completions -----------------------------------------------------------------

    def _completion_prompts(self, prompt: object, special: bool) -> tuple[list[list[int]], list[str] | None]:
        """The prompts as token-id lists (from a string, a list of strings, token ids, lists of
        token ids; strings encoded with the tokenizer's special tokens when ``special``, vLLM's
        ``add_special_tokens``, true by default for a completion) and the strings given (None for
        token ids)."""
        tok = self.scheduler.tokenizer
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            return [token_ids(p, "prompt") for p in prompt], None
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) and not isinstance(prompt[0], bool):
            return [token_ids(prompt, "prompt")], None
        texts = [prompt] if isinstance(prompt, str) else prompt
        if prompt == "" or not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest(
                "prompt must be a non-empty string, a list of strings, token ids or lists of token ids", param="prompt"
            )
        if tok is None:
            raise BadRequest("this model directory has no tokenizer: send the prompt as token ids", param="prompt")
        prompts = [tok.encode(t, add_special_tokens=special) for t in texts]
        if not all(prompts):  # as in vLLM, "" in a list is a prompt where the tokenizer adds a BOS
            raise BadRequest("the prompt cannot be empty", param="prompt")
        return prompts, texts

    async def _prompt_logprobs(self, prompts: list[list[int]], top_n: int) -> list[GenerationResult]:
        """Each prompt's tokens' log-probabilities (the first None) and ``top_n`` most likely
        tokens at each position, for ``echo`` with ``logprobs``."""
        jobs = [(p, SamplingParams(max_new_tokens=0, top_logprobs=top_n), None) for p in prompts]
        return await self.scheduler.generate_many(jobs, return_input_logprobs=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        model = self.model_name(body)
        echo = bool_field(body, "echo", False)
        refuse_unsupported({k: v for k, v in body.items() if k != "echo"}, structured=True)  # echo is served here
        # vLLM's default for a completion's text: the tokenizer's special tokens too (a BOS, for Llama's).
        special = bool_field(body, "add_special_tokens", True)
        prompts, prompt_texts = self._completion_prompts(body.get("prompt"), special)
        logprobs = body.get("logprobs")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)):
            raise BadRequest(f"logprobs must be an integer, got {logprobs!r}", param="logprobs")
        top_n = top_logprobs_field(body, "logprobs")
        o = Options.parse(body)
        max_tokens = int_field(body, "max_tokens", 16)
        params = self.sampling(body, max_tokens, max(len(p) for p in prompts), top_n, prompt_key="prompt", scoring=echo)
        jobs = self.jobs(prompts, params, o.n, o.request_id)
        as_ids = bool_field(body, "return_tokens_as_token_ids", False)
        head = {
            "id": f"cmpl-{o.request_id}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }
        prompt_tokens = sum(len(p) for p in prompts)

        def logprob_block(
            tokens: list[int],
            lps: list[float] | list[float | None],
            tops: list | None,
            offset: int,
            before: Sequence[int] = (),
        ) -> dict[str, list]:
            # vLLM reads each token's text after the tokens before it that have log-probabilities
            # (not an echoed prompt's first token); ``before``: a stream's earlier output tokens.
            contexts = [[*before[-CONTEXT_TOKENS:], *(t for t, lp in zip(tokens[:k], lps) if lp is not None)]
                        for k in range(len(tokens))]  # fmt: skip
            strings = [self.token_text(t, as_ids, c) for t, c in zip(tokens, contexts)]
            offsets = []
            for s in strings:
                offsets.append(offset)
                offset += len(s)
            top: list[dict[str, float] | None] = []
            for k, (s, lp) in enumerate(zip(strings, lps)):
                if lp is None:  # an echoed prompt's first token
                    top.append(None)
                    continue
                entry = {s: lp}  # vLLM: the sampled token, then the most likely ones
                for tid, v in tops[k] if tops else []:
                    entry.setdefault(self.token_text(tid, as_ids, contexts[k]), v)
                top.append(entry)
            return {"tokens": strings, "token_logprobs": list(lps), "top_logprobs": top, "text_offset": offsets}

        # Echoed, a choice's text and log-probabilities start with its prompt's (top ones included,
        # as vLLM and OpenAI answer).
        tok = self.scheduler.tokenizer
        if prompt_texts is None:  # token ids, checked by self.jobs: decoded
            prompt_texts = [tok.decode(p) if tok is not None else "" for p in prompts]
        echoed = [prompt_texts[i // o.n] if echo else "" for i in range(len(jobs))]
        echo_blocks: list[dict[str, list] | None] = [None] * len(jobs)
        if echo and logprobs is not None:
            scored = await self._prompt_logprobs(prompts, top_n)
            echo_blocks = [
                logprob_block(p, scored[i // o.n].input_logprobs or [], scored[i // o.n].input_top_logprobs, 0)
                for i, (p, _, _) in enumerate(jobs)
            ]

        # A choice's output offsets go on from its echoed tokens' texts (a BOS's included, as vLLM counts).
        starts = [len(e) if b is None else sum(map(len, b["tokens"])) for e, b in zip(echoed, echo_blocks)]

        def with_echo(i: int, block: dict[str, list]) -> dict[str, list]:
            pre = echo_blocks[i]
            return {k: pre[k] + v for k, v in block.items()} if pre is not None else block

        if not o.stream:
            results = await self.generate(jobs)
            choices = []
            for i, r in enumerate(results):
                block = logprob_block(r.output_ids, r.output_logprobs, r.output_top_logprobs, starts[i])
                choice: dict[str, object] = {
                    "index": i,
                    "text": echoed[i] + self.text_of(r, o),
                    "logprobs": with_echo(i, block) if logprobs is not None else None,
                    "finish_reason": finish_type(r),
                    "stop_reason": stop_reason(r, params),
                }
                if o.with_ids:
                    choice.update(prompt_token_ids=r.input_ids, token_ids=r.output_ids)
                choices.append(choice)
            return web.json_response({**head, "choices": choices, "usage": self.usage(results, prompt_tokens)})

        async def chunks() -> AsyncIterator[dict[str, object]]:
            texts = [
                TextDeltas(
                    self.scheduler.tokenizer,
                    o.skip_special,
                    () if o.keep_stop else params.stop,
                    held_ids=self.ending_ids(params, o.keep_stop),
                )
                for _ in jobs
            ]
            first = [True] * len(jobs)
            offsets = list(starts)
            sent: list[list[int]] = [[] for _ in jobs]
            if echo:
                for i, (prompt, _, _) in enumerate(jobs):
                    choice: dict[str, object] = {"index": i, "text": echoed[i], "logprobs": echo_blocks[i],
                                                 "finish_reason": None}  # fmt: skip
                    if o.with_ids:
                        choice["prompt_token_ids"] = prompt
                    first[i] = False
                    yield {**head, "choices": [choice]}
            results: list[GenerationResult] = []
            async for i, event in merged(self.scheduler, jobs):
                if isinstance(event, TokenOut):
                    choice = {"index": i, "text": texts[i].add(event.token), "finish_reason": None}
                    tops = [event.top] if event.top is not None else None
                    block = logprob_block([event.token], [event.logprob], tops, offsets[i], sent[i])
                    choice["logprobs"] = block if logprobs is not None else None
                    offsets[i] += len(block["tokens"][0])
                    sent[i].append(event.token)
                    if o.with_ids:
                        choice["token_ids"] = [event.token]
                        if first[i]:
                            choice["prompt_token_ids"] = jobs[i][0]
                    first[i] = False
                    yield {**head, "choices": [choice]}
                    continue
                results.append(event)
                rest = texts[i].rest(self.text_of(event, o))
                if rest:
                    yield {**head, "choices": [{"index": i, "text": rest, "logprobs": None, "finish_reason": None}]}
                end = {"index": i, "text": "", "logprobs": None, "finish_reason": finish_type(event),
                       "stop_reason": stop_reason(event, params)}  # fmt: skip
                yield {**head, "choices": [end]}
            if o.include_usage:
                yield {**head, "choices": [], "usage": self.usage(results, prompt_tokens)}

        return await send_events(request, chunks())

    # ----- /v1/chat/completions ------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        model = self.model_name(body)
        refuse_unsupported(body, structured=True)
        check_messages(body)
        tools = chat_tools(body, forced=True)
        tool_grammar, named = self.forced_call(body, tools)
        forced = tool_grammar is not None
        tok = self.scheduler.tokenizer
        # vLLM's default for a chat: none added (the template writes its own).
        special = bool_field(body, "add_special_tokens", False)
        prompt = tok.encode(render_chat(tok, body), add_special_tokens=special)  # type: ignore[union-attr]
        want_logprobs = bool_field(body, "logprobs", False)
        top_n = top_logprobs_field(body, "top_logprobs")
        if top_n and not want_logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        o = Options.parse(body)
        budget = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        params = self.sampling(
            body, max_completion_tokens(body), len(prompt), top_n, budget_key=budget, tool_grammar=tool_grammar
        )
        jobs = self.jobs([prompt], params, o.n, o.request_id)
        head = {
            "id": f"chatcmpl-{o.request_id}",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }
        prompt_tokens = len(prompt)

        def answer(r: GenerationResult) -> tuple[str, list]:
            text = self.text_of(r, o)
            return parse_tool_calls(text) if tools else (text, [])

        def message(content: str, calls: list) -> dict[str, object]:
            # vLLM's answer to a forced call: content "" beside the calls (OpenAI's: null).
            return (
                {**assistant_message(content, calls), "content": content}
                if forced
                else assistant_message(content, calls)
            )

        def finish(r: GenerationResult, calls: list) -> str:
            # OpenAI's and vLLM's: a named tool's call ends with "stop", auto and required ones with "tool_calls".
            return finish_type(r) if named is not None else chat_finish_reason(finish_type(r), calls)

        if not o.stream:
            results = await self.generate(jobs)
            choices = []
            for i, r in enumerate(results):
                content, calls = answer(r)
                entries = self.chat_logprobs(r.output_ids, r.output_logprobs, r.output_top_logprobs)
                choice: dict[str, object] = {
                    "index": i,
                    "message": message(content, calls),
                    "logprobs": {"content": entries} if want_logprobs else None,
                    "finish_reason": finish(r, calls),
                    "stop_reason": stop_reason(r, params),
                }
                if o.with_ids:
                    choice["token_ids"] = r.output_ids
                choices.append(choice)
            out = {**head, "object": "chat.completion", "choices": choices, "usage": self.usage(results, prompt_tokens)}
            if o.with_ids:
                out["prompt_token_ids"] = prompt
            return web.json_response(out)

        def chunk(choice: dict[str, object]) -> dict[str, object]:
            return {**head, "object": "chat.completion.chunk", "choices": [choice]}

        async def chunks() -> AsyncIterator[dict[str, object]]:
            stop = () if o.keep_stop else params.stop
            markers = (TOOL_CALL_START,) if tools else ()
            held = self.ending_ids(params, o.keep_stop)
            texts = [TextDeltas(tok, o.skip_special, stop, markers, held) for _ in jobs]
            sent: list[list[int]] = [[] for _ in jobs]
            for i in range(len(jobs)):
                first: dict[str, object] = {"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}  # fmt: skip
                if o.with_ids:
                    first["prompt_token_ids"] = prompt
                yield chunk(first)
            results: list[GenerationResult] = []
            async for i, event in merged(self.scheduler, jobs):
                if isinstance(event, TokenOut):
                    tops = [event.top] if event.top is not None else None
                    c: dict[str, object] = {
                        "index": i,
                        "delta": {"content": texts[i].add(event.token)},
                        "logprobs": {"content": self.chat_logprobs([event.token], [event.logprob], tops, sent[i])}
                        if want_logprobs
                        else None,
                        "finish_reason": None,
                    }
                    if o.with_ids:
                        c["token_ids"] = [event.token]
                    sent[i].append(event.token)
                    yield chunk(c)
                    continue
                results.append(event)
                content, calls = answer(event)
                rest = texts[i].rest(content)
                if rest:
                    yield chunk({"index": i, "delta": {"content": rest}, "logprobs": None, "finish_reason": None})
                if calls:
                    tool_calls = [{"index": j, **c.to_openai()} for j, c in enumerate(calls)]
                    yield chunk(
                        {"index": i, "delta": {"tool_calls": tool_calls}, "logprobs": None, "finish_reason": None}
                    )
                reason = finish(event, calls)
                yield chunk({"index": i, "delta": {}, "logprobs": None, "finish_reason": reason,
                             "stop_reason": stop_reason(event, params)})  # fmt: skip
            if o.include_usage:
                yield {
                    **head,
                    "object": "chat.completion.chunk",
                    "choices": [],
                    "usage": self.usage(results, prompt_tokens),
                }

        return await send_events(request, chunks())
