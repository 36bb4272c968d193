"""An HTTP server over the embedded engine that answers like an SGLang server, and like vLLM's
OpenAI server too (docs/protocol.md).

    python -m areal_lite.engines.server --model-path DIR [--host 127.0.0.1] [--port 30000] [--api-key K]

It exists so that `RemoteSGLangEngine` and `RemoteVLLMEngine` are tested against a real HTTP server
on machines where SGLang and vLLM cannot run, and so that CPU deployments get rollout servers with
no extra dependency. Same endpoints, payloads, status codes and error shapes as SGLang for what
areal-lite uses; the OpenAI-compatible routes (`areal_lite.engines.server.openai_routes`, the Responses
API in `areal_lite.engines.server.responses_routes`), vLLM's token-in-token-out route
(`areal_lite.engines.server.tokens_routes`) and RL control routes (`areal_lite.engines.server.vllm_routes`) and
SGLang's LoRA adapter routes (`areal_lite.engines.server.lora_routes`) are registered here too. Every
error, on every route (unknown routes and methods included), is OpenAI's error object
``{"error": {"message", "type", "param", "code"}}``, and the server keeps serving.

Deliberate differences from SGLang: weight versions are integers (as strings on the wire, "0" at
start); ``meta_info`` carries one extra key, ``output_token_versions`` (the version of each output
token, which can change inside one request when weights are updated in place); ``json_schema``,
``regex`` and ``ebnf`` are held to with llguidance (`areal_lite.engines.local.grammar`), where SGLang
defaults to xgrammar; ``structural_tag``, ``stop_regex`` and the multimodal, hidden-state and custom-logit-processor
inputs of ``/generate`` are refused with a 400 rather than silently ignored. A mixture-of-experts model answers ``return_routed_experts`` as SGLang started
with ``--enable-return-routed-experts`` does (``meta_info["routed_experts"]``, base64 of int32
``[prompt + completion tokens - 1, layers, top_k]``); a dense model refuses it with a 400.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import logging
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from aiohttp import web

from areal_lite.api.config import LocalEngineConfig
from areal_lite.api.io import WeightUpdateMeta
from areal_lite.cpu import freeze_startup_objects
from areal_lite.engines.local import grammar
from areal_lite.engines.local.request import GenerationResult, SamplingParams
from areal_lite.engines.local.scheduler import Scheduler
from areal_lite.engines.server.common import (
    BadRequest,
    bool_field,
    error_response,
    float_field,
    int_field,
    output_text,
    read_json,
)
from areal_lite.engines.server.lora_routes import LoRARoutes, check_lora_path
from areal_lite.engines.server.openai_routes import MAX_TOP_LOGPROBS, OpenAIRoutes
from areal_lite.engines.server.responses_routes import ResponsesRoute
from areal_lite.engines.server.streaming import TextDeltas, merged, send_events
from areal_lite.engines.server.tokens_routes import TokensRoute
from areal_lite.engines.server.vllm_routes import VLLMRoutes
from areal_lite.openai_format.chat import shaping_fields

logger = logging.getLogger("areal_lite.server")
T = TypeVar("T")

OPEN_PATHS = ("/health", "/ready", "/metrics")
SWITCH_INTERVAL_S = 0.0005
"""The interpreter's thread switch interval in the server process (see `main`)."""
"""Paths that need no API key (as in SGLang)."""

SAMPLING_DEFAULTS: dict[str, object] = {
    "max_new_tokens": 128,
    "min_new_tokens": 0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "stop": None,
    "stop_token_ids": None,
    "ignore_eos": False,
    "n": 1,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "sampling_seed": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "custom_params": None,
    "logit_bias": None,
    "structural_tag": None,
    "stop_regex": None,
    "stream_interval": None,
}
"""Every key SGLang accepts in ``sampling_params`` with its default; any other key is a 400."""

UNSUPPORTED_SAMPLING = (
    "structural_tag",
    "stop_regex",
)
"""Keys this server accepts only at their default (no-op) value."""

REFUSED_INPUTS: dict[str, object] = {
    "input_embeds": None,
    "image_data": None,
    "audio_data": None,
    "video_data": None,
    "token_ids_logprob": None,
    "custom_logit_processor": None,
    "return_hidden_states": False,
    "session_params": None,
}
"""Top-level ``/generate`` keys of SGLang's ``GenerateReqInput`` that this server cannot honour:
a 400 at any value but this default, since ignoring them would change the answer."""


@dataclass
class AnswerOptions:
    """How the answers to one prompt of a ``/generate`` call are written."""

    skip_special_tokens: bool
    no_stop_trim: bool
    return_logprob: bool
    logprob_start_len: int
    """-1: output log-probabilities only (and the prompt's last token, as SGLang answers)."""
    return_text_in_logprobs: bool
    return_routed_experts: bool


def parse_sampling_params(raw: object) -> tuple[SamplingParams, int, bool, bool]:
    """``sampling_params`` -> (params, n, skip_special_tokens, no_stop_trim). Raises BadRequest."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest(f"sampling_params must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(SAMPLING_DEFAULTS))
    if unknown:
        raise BadRequest(f"unknown sampling_params keys: {', '.join(unknown)}")
    for key in UNSUPPORTED_SAMPLING:
        if raw.get(key) is not None and raw[key] != SAMPLING_DEFAULTS[key]:
            raise BadRequest(f"sampling_params.{key} is not supported by the areal-lite server")
    stop = raw.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("stop must be a string or a list of strings")
    stop_ids = raw.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise BadRequest("stop_token_ids must be a list of integers")
    n = int_field(raw, "n", 1)
    if n < 1:
        raise BadRequest(f"n must be >= 1, got {n}")
    max_new, min_new = int_field(raw, "max_new_tokens", 128), int_field(raw, "min_new_tokens", 0)
    if max_new >= 0 and min_new > max_new:
        raise BadRequest(f"min_new_tokens must be in [0, max_new_tokens={max_new}], got {min_new}")
    shaping = shaping_fields(raw)  # before the try: its BadRequest names the field
    constraint = _sglang_grammar(raw)
    try:
        params = SamplingParams(
            max_new_tokens=max_new,
            min_new_tokens=min_new,
            temperature=float_field(raw, "temperature", 1.0),
            top_p=float_field(raw, "top_p", 1.0),
            top_k=int_field(raw, "top_k", -1),
            stop=list(stop),
            stop_token_ids=list(stop_ids),
            ignore_eos=bool_field(raw, "ignore_eos", False),
            seed=_optional_int(raw, "sampling_seed"),
            **shaping,
            grammar=constraint,
        )
    except ValueError as e:
        raise BadRequest(str(e)) from e
    return params, n, bool_field(raw, "skip_special_tokens", True), bool_field(raw, "no_stop_trim", False)


def _sglang_grammar(raw: dict[str, object]) -> str | None:
    """The grammar of SGLang's ``json_schema`` (its JSON text), ``regex`` or ``ebnf`` (at most one)."""
    given = [key for key in ("json_schema", "regex", "ebnf") if raw.get(key) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise BadRequest("Only one of regex, json_schema, or ebnf can be set.", param=given[1])
    [key] = given
    if not isinstance(raw[key], str):
        raise BadRequest(f"sampling_params.{key} must be a string", param=key)
    make = {"json_schema": grammar.json_schema_grammar, "regex": grammar.regex_grammar, "ebnf": grammar.ebnf_grammar}
    try:
        return make[key](raw[key])
    except ValueError as e:
        raise BadRequest(str(e), param=key) from e


def _optional_int(d: dict[str, object], key: str) -> int | None:
    return None if d.get(key) is None else int_field(d, key, 0)


def _per_prompt(
    body: dict[str, object], key: str, count: int, read: Callable[[dict, str, T], T], default: T
) -> list[T]:
    """``body[key]`` for each of ``count`` prompts: SGLang takes one value for all or a list, one per prompt."""
    value = body.get(key)
    if isinstance(value, list):
        if len(value) != count:
            raise BadRequest(
                f"{key} has {len(value)} entries for {count} prompts (give one, or one per prompt)", param=key
            )
        return [read({key: v}, key, default) for v in value]
    return [read(body, key, default)] * count


def _raw(d: dict[str, object], key: str, default: object) -> object:
    return d.get(key, default)


def _rids(rid: object, batch: int | None) -> list[str]:
    """The request id of each prompt (``batch`` of them; None: one, not a batch) as SGLang names
    them: fresh ones when absent, ``rid_0``, ``rid_1``, ... from one string for a batch."""
    if rid is None:
        return [uuid.uuid4().hex for _ in range(batch or 1)]
    if batch is None:
        if not isinstance(rid, str):
            raise BadRequest("rid must be a string (a list of strings for a batch, one per prompt)", param="rid")
        return [rid]
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(batch)]
    if not isinstance(rid, list) or not all(isinstance(r, str) for r in rid):
        raise BadRequest("The rid should be a string or a list of strings.", param="rid")
    if len(rid) != batch:
        raise BadRequest("The specified rids length mismatch with the batch_size for batch processing.", param="rid")
    return rid


@dataclass
class ServerArgs:
    """Command-line arguments (names follow SGLang's ``launch_server``)."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    max_running_requests: int = 128
    context_length: int = 0
    random_seed: int = 0
    weight_version: str = "0"
    keep_cache_on_update: bool = False
    served_model_name: list[str] | None = None
    allow_auto_truncate: bool = False


class Server:
    """Request handlers over the embedded engine's `Scheduler`."""

    def __init__(self, args: ServerArgs, scheduler: Scheduler) -> None:
        self.args = args
        self.scheduler = scheduler
        self.weight_version = args.weight_version
        self.ready = False

    # ----- plumbing ------------------------------------------------------------------------

    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=1024**3)
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_put("/generate", self.generate)
        r.add_get("/get_weight_version", self.get_weight_version)
        for path in ("/health", "/health_generate", "/ready"):
            r.add_get(path, self.health)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        r.add_post("/begin_weight_update", self.begin_weight_update)
        r.add_post("/end_weight_update", self.end_weight_update)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_route("*", "/get_weights_by_name", self.get_weights_by_name)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        names = self.args.served_model_name or [self.args.model_path]
        openai_routes = OpenAIRoutes(self.scheduler, names)
        openai_routes.register(r)
        ResponsesRoute(openai_routes).register(r)
        TokensRoute(self.scheduler, names).register(r)
        VLLMRoutes(self.scheduler, self.args.device).register(r)
        LoRARoutes(self.scheduler).register(r)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        key = self.args.api_key
        if (
            key
            and not request.path.startswith(OPEN_PATHS)
            and request.headers.get("Authorization", "") != f"Bearer {key}"
        ):
            return error_response(
                "Unauthorized: send 'Authorization: Bearer <the server's API key>'", 401, code="invalid_api_key"
            )
        return await handler(request)

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except BadRequest as e:
            return error_response(str(e), e.status, e.param, e.code)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return _http_error(request, e)
        except Exception as e:  # one bad request must not take the server down
            logger.exception("request to %s failed", request.path)
            return error_response(f"internal error: {e}", status=500)

    def _version_int(self, value: object) -> int:
        try:
            return int(str(value))
        except ValueError as e:
            raise BadRequest(f"weight versions must be integers on an areal-lite server, got {value!r}") from e

    async def _weight_op(self, op, version: object) -> web.Response:
        """Run a blocking weight operation off the event loop; answer SGLang's success shape."""
        v = self._version_int(version) if version is not None else None
        try:
            await asyncio.get_running_loop().run_in_executor(None, op)
        except ValueError as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        if v is not None:
            self.weight_version = str(v)
        return web.json_response({"success": True, "message": "Succeeded to update model weights."})

    # ----- generation ----------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        try:
            return await self._generate(request, body)
        except BadRequest as e:
            if body.get("stream") is not True:
                raise
            # SGLang checks a streamed request inside its stream: a 200 whose one event is the error.
            return await send_events(request, _events({"error": {"message": str(e)}}))

    async def _generate(self, request: web.Request, body: dict[str, object]) -> web.StreamResponse:
        for key, default in REFUSED_INPUTS.items():
            if body.get(key) is not None and body[key] != default:
                raise BadRequest(f"{key} is not supported by the areal-lite server", param=key)
        stream = bool_field(body, "stream", False)
        has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
        if has_text == has_ids:
            raise BadRequest("give exactly one of text and input_ids")
        prompts = self._prompts(body)
        is_batch = isinstance(body["text"], list) if has_text else isinstance(body["input_ids"][0], list)  # type: ignore[index]
        count = len(prompts)
        raw_params = _per_prompt(body, "sampling_params", count, _raw, None)
        parsed = [parse_sampling_params(raw) for raw in raw_params]
        n = parsed[0][1]
        if any(p[1] != n for p in parsed):
            raise BadRequest("every prompt of a batch must ask for the same n (as SGLang requires)", param="n")
        for key in ("return_logprob", "logprob_start_len", "top_logprobs_num") if n > 1 else ():
            if isinstance(body.get(key), list):
                raise BadRequest(f"Cannot use list {key} with parallel_sample_num > 1", param=key)
        check_lora_path(body.get("lora_path"), count, self.scheduler.adapter.name)
        return_logprob = _per_prompt(body, "return_logprob", count, bool_field, False)
        start_lens = _per_prompt(body, "logprob_start_len", count, int_field, -1)
        top_ns = _per_prompt(body, "top_logprobs_num", count, int_field, 0)
        if not all(0 <= k <= MAX_TOP_LOGPROBS for k in top_ns):
            raise BadRequest(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {top_ns}")
        want_input = any(r and s >= 0 for r, s in zip(return_logprob, start_lens))
        want_routes = bool_field(body, "return_routed_experts", False)
        if want_routes and self.scheduler.routing_shape is None:
            raise BadRequest("return_routed_experts: this model has no mixture-of-experts layers")
        text_in_logprobs = bool_field(body, "return_text_in_logprobs", False)
        rids = _rids(body.get("rid"), count if is_batch else None)
        jobs: list[tuple[list[int], SamplingParams, str]] = []
        options: list[AnswerOptions] = []
        for i, (prompt, rid, raw, (params, _, skip_special, no_stop_trim)) in enumerate(
            zip(prompts, rids, raw_params, parsed)
        ):
            prompt, params = self._fit_context(prompt, raw, params)
            if return_logprob[i] and start_lens[i] > len(prompt):
                raise BadRequest(
                    f"logprob_start_len={start_lens[i]} is higher than the number of input tokens "
                    f"({len(prompt)}). Please use a smaller logprob_start_len.",
                    param="logprob_start_len",
                )
            if return_logprob[i] and top_ns[i]:
                params = dataclasses.replace(params, top_logprobs=top_ns[i])
            opts = AnswerOptions(
                skip_special, no_stop_trim, return_logprob[i], start_lens[i], text_in_logprobs, want_routes
            )
            for k in range(n):
                # The samples of a seeded request differ: sample k draws with seed + k.
                sample = params if params.seed is None or n == 1 else dataclasses.replace(params, seed=params.seed + k)
                jobs.append((prompt, sample, rid if n == 1 else f"{rid}-{k}"))
                options.append(opts)
        try:
            for prompt, params, _ in jobs:
                self.scheduler.validate_request(prompt, params)
        except ValueError as e:
            raise BadRequest(str(e)) from e
        if stream:
            return await send_events(request, self._stream(jobs, options, is_batch or n > 1, want_input))
        results = await self.scheduler.generate_many(jobs, want_input)
        out = [self._answer(r, opts) for r, opts in zip(results, options)]
        return web.json_response(out if is_batch or n > 1 else out[0])

    def _fit_context(self, prompt: list[int], raw: object, params: SamplingParams) -> tuple[list[int], SamplingParams]:
        """SGLang's length checks: a prompt that fills the context, or an explicit
        ``max_new_tokens`` that takes prompt + completion past it, is a 400 with SGLang's
        message; with ``--allow-auto-truncate`` the prompt keeps its head and ``max_new_tokens``
        shrinks instead. An absent ``max_new_tokens`` (128) just ends at the context's end."""
        context = self.scheduler.context_len
        truncate = self.args.allow_auto_truncate
        if len(prompt) >= context:
            if not truncate:
                raise BadRequest(
                    f"The input ({len(prompt)} tokens) is longer than the model's context length ({context} tokens)."
                )
            prompt = prompt[: context - 1]  # our engine keeps one position for the first generated token
        asked = raw.get("max_new_tokens") if isinstance(raw, dict) else None
        if asked is not None and len(prompt) + params.max_new_tokens > context:
            if not truncate:
                raise BadRequest(
                    "Requested token count exceeds the model's maximum context length of "
                    f"{context} tokens. You requested a total of {len(prompt) + params.max_new_tokens} tokens: "
                    f"{len(prompt)} tokens from the input messages and {params.max_new_tokens} tokens for the "
                    "completion. Please reduce the number of tokens in the input messages or the completion to "
                    "fit within the limit.",
                    param="max_new_tokens",
                )
            params = dataclasses.replace(
                params,
                max_new_tokens=context - len(prompt),
                min_new_tokens=min(params.min_new_tokens, context - len(prompt)),
            )
        return prompt, params

    async def _stream(
        self,
        jobs: list[tuple[list[int], SamplingParams, str]],
        options: list[AnswerOptions],
        tagged: bool,
        want_input: bool,
    ) -> AsyncIterator[dict[str, object]]:
        """SGLang's streamed answers: one per token, each with the text, ids and log-probabilities
        so far (the prompt's too, from the first token on, with ``want_input``) and
        ``finish_reason`` null, the last the whole answer; ``index`` (the job) when ``tagged``.
        Text that could be the start of a stop string is held back until it is not."""
        tokenizer = self.scheduler.tokenizer
        deltas = [
            TextDeltas(tokenizer, o.skip_special_tokens, () if o.no_stop_trim else p.stop)
            for (_, p, _), o in zip(jobs, options)
        ]
        partial = [
            GenerationResult(
                rid=rid,
                input_ids=prompt,
                output_ids=[],
                output_logprobs=[],
                output_versions=[],
                finish_reason={},
                input_logprobs=None,
                latency=0.0,
                ttft=0.0,
                output_top_logprobs=[] if p.top_logprobs else None,
            )
            for prompt, p, rid in jobs
        ]
        async for i, event in merged(self.scheduler, jobs, want_input):
            if isinstance(event, GenerationResult):
                answer = self._answer(event, options[i])
            else:
                r = partial[i]
                r.output_ids.append(event.token)
                r.output_logprobs.append(event.logprob)
                r.output_versions.append(event.version)
                if r.output_top_logprobs is not None and event.top is not None:
                    r.output_top_logprobs.append(event.top)
                if event.input_logprobs is not None:
                    r.input_logprobs, r.input_top_logprobs = event.input_logprobs, event.input_top
                deltas[i].add(event.token)
                answer = self._answer(r, options[i], text=deltas[i].sent)
            if tagged:
                answer["index"] = i
            yield answer

    def _prompts(self, body: dict[str, object]) -> list[list[int]]:
        if body.get("input_ids") is not None:
            ids = body["input_ids"]
            if not isinstance(ids, list) or not ids:
                raise BadRequest("input_ids must be a non-empty list of integers (or a list of such lists)")
            batch = ids if isinstance(ids[0], list) else [ids]
            for p in batch:
                if not isinstance(p, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                    raise BadRequest("input_ids must be a list of integers (or a list of such lists)")
            return batch  # type: ignore[return-value]
        text = body["text"]
        texts = text if isinstance(text, list) else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest("text must be a string or a non-empty list of strings")
        if self.scheduler.tokenizer is None:
            raise BadRequest("this model directory has no tokenizer: send input_ids")
        # As SGLang's tokenizer manager: the tokenizer's special tokens too (a BOS, for Llama's).
        return [self.scheduler.tokenizer.encode(t) for t in texts]

    def _answer(self, r: GenerationResult, opts: AnswerOptions, text: str | None = None) -> dict[str, object]:
        """SGLang's answer to one prompt (one sample of it): ``text`` given, a streamed answer so far
        (``finish_reason`` null, no latency yet)."""
        tokenizer = self.scheduler.tokenizer
        final = text is None
        if text is None:
            text = output_text(tokenizer, r, opts.skip_special_tokens, opts.no_stop_trim)

        def entry(lp: float | None, t: int) -> list[object]:
            shown = tokenizer.decode([t]) if opts.return_text_in_logprobs and tokenizer is not None else None
            return [lp, t, shown]

        meta: dict[str, object] = {
            "id": r.rid,
            "prompt_tokens": len(r.input_ids),
            "completion_tokens": len(r.output_ids),
            "cached_tokens": 0,
            "weight_version": str(r.output_versions[-1]) if r.output_versions else self.weight_version,
            "finish_reason": r.finish_reason if final else None,
            "output_token_versions": r.output_versions,
        }
        if final:
            meta["e2e_latency"] = r.latency
        if opts.return_logprob:
            meta["output_token_logprobs"] = [entry(lp, t) for lp, t in zip(r.output_logprobs, r.output_ids)]
            # The prompt from logprob_start_len on (SGLang's default, -1, starts at its last token),
            # the first entry null as in SGLang: it reports no log-probability at the start position.
            start = opts.logprob_start_len if opts.logprob_start_len >= 0 else len(r.input_ids) - 1
            lps = r.input_logprobs if r.input_logprobs is not None else [None] * len(r.input_ids)
            meta["input_token_logprobs"] = [
                entry(None if k == start else lps[k], r.input_ids[k]) for k in range(start, len(r.input_ids))
            ]
            if r.output_top_logprobs is not None:
                tops = r.input_top_logprobs or [None] * len(r.input_ids)
                meta["input_top_logprobs"] = [
                    None if k == start or tops[k] is None else [entry(lp, t) for t, lp in tops[k]]
                    for k in range(start, len(r.input_ids))
                ]
                meta["output_top_logprobs"] = [[entry(lp, t) for t, lp in top] for top in r.output_top_logprobs]
        if opts.return_routed_experts and r.routed_experts is not None:
            # SGLang's encoding: the int32 ids, row-major, base64 (JSON lists of ids are too slow).
            meta["routed_experts"] = base64.b64encode(r.routed_experts.numpy().tobytes()).decode("ascii")
        return {"text": text, "output_ids": r.output_ids, "meta_info": meta}

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        rid = body.get("rid", "")
        if not isinstance(rid, str):
            raise BadRequest("rid must be a string")
        abort_all = bool_field(body, "abort_all", False)
        if abort_all or rid:
            self.scheduler.abort(rid, abort_all=abort_all, message="aborted by /abort_request")
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            raise BadRequest(f"mode must be abort, in_place or retract, got {mode!r}")
        await asyncio.get_running_loop().run_in_executor(None, self.scheduler.pause_generation, mode)
        return web.json_response({"message": "Generation paused."})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await read_json(request)
        self.scheduler.continue_generation()
        return web.json_response({"message": "Generation continued."})

    # ----- info ----------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.ready else 503)

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.weight_version})

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.args.model_path,
                "tokenizer_path": self.args.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.weight_version,
                "context_length": self.scheduler.context_len,
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        """SGLang's answer: its arguments (never the API key), what the scheduler reports
        (``max_total_num_tokens``, ``max_req_input_len``), ``internal_states`` (one per data-parallel
        rank: ``last_gen_throughput``, which SGLang's benchmarks read) and ``version``."""
        args = self.args
        context = self.scheduler.context_len
        info: dict[str, object] = {k: v for k, v in vars(args).items() if k != "api_key"}
        info.update(
            served_model_name=(args.served_model_name or [args.model_path])[0],  # a string in SGLang
            tokenizer_path=args.model_path,
            skip_tokenizer_init=False,
            tp_size=1,
            dp_size=1,
            context_length=context,
            weight_version=self.weight_version,
            max_total_num_tokens=context * args.max_running_requests,  # a KV row of the context per request
            max_req_input_len=context - 1,
            internal_states=[{"last_gen_throughput": self.scheduler.gen_throughput}],
            version="areal-lite",
        )
        return web.json_response(info)

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.scheduler.num_running:
            return web.Response(status=400, text="Cache not flushed: requests are running.")
        return web.Response(status=200, text="Cache flushed.")

    # ----- weights -------------------------------------------------------------------------

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise BadRequest("model_path must be a non-empty string")
        if bool_field(body, "abort_all_requests", False):
            self.scheduler.abort(abort_all=True, message="aborted for a weight update")
        version = body.get("weight_version")
        v = self._version_int(version) if version is not None else None
        return await self._weight_op(lambda: self.scheduler.load_weights_from_disk(path, v).result(), version)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        address = body.get("master_address")
        if not isinstance(address, str):
            raise BadRequest("master_address must be a string")
        backend = body.get("backend", "nccl")
        if backend == "nccl" and self.args.device == "cpu":
            raise BadRequest("backend nccl needs a CUDA device; this server runs on CPU (use gloo)")
        group_name = body.get("group_name", "weight_update_group")
        meta = WeightUpdateMeta(
            type="distributed",
            master_address=address,
            master_port=_port(body.get("master_port")),
            world_size=int_field(body, "world_size", 0),
            group_name=str(group_name),
            backend=str(backend),
        )
        rank = int_field(body, "rank_offset", 1)
        if not 0 < rank < meta.world_size:
            raise BadRequest(f"rank_offset {rank} must be in [1, world_size={meta.world_size})")
        try:
            await asyncio.wrap_future(self.scheduler.join_weights_update_group(meta, rank))
        except (RuntimeError, ValueError, OSError) as e:  # e.g. the trainer never came: the store timed out
            return web.json_response({"success": False, "message": f"could not join the group: {e}"}, status=400)
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        await read_json(request)
        self.scheduler.destroy_weights_update_group()
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        """SGLang >= 0.5.21 brackets distributed updates with begin/end. Here each update call is
        applied between two decode steps on its own, so the session needs no state; both calls
        are accepted so that clients of either SGLang generation work."""
        await read_json(request)
        return web.json_response({"success": True, "message": "Weight update session started."})

    async def end_weight_update(self, request: web.Request) -> web.Response:
        await read_json(request)
        return web.json_response({"success": True, "message": "Weight update session ended."})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not isinstance(names, list) or not isinstance(dtypes, list) or not isinstance(shapes, list):
            raise BadRequest("names, dtypes and shapes must be lists")
        if not all(
            isinstance(s, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in s) for s in shapes
        ):
            raise BadRequest("shapes must be lists of integers")
        if not all(isinstance(x, str) for x in names + dtypes):
            raise BadRequest("names and dtypes must be strings")
        try:
            self.scheduler.check_param_specs(names, dtypes, shapes)
        except ValueError as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        if bool_field(body, "abort_all_requests", False):
            self.scheduler.abort(abort_all=True, message="aborted for a weight update")
        version = body.get("weight_version")
        v = self._version_int(version) if version is not None else None
        return await self._weight_op(
            lambda: self.scheduler.receive_broadcast(names, dtypes, shapes, v).result(), version
        )

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        v = self._version_int(body.get("new_version"))
        if bool_field(body, "abort_all_requests", True):
            self.scheduler.abort(abort_all=True, message="aborted for a weight version update")
        self.scheduler.version = v
        self.weight_version = str(v)
        return web.json_response({"success": True, "message": f"Weight version updated to {v}."})

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = dict(request.query) if request.method == "GET" else await read_json(request)
        name = body.get("name")
        if not isinstance(name, str):
            raise BadRequest("name must be a string")
        size = int(body.get("truncate_size", 100)) if request.method == "GET" else int_field(body, "truncate_size", 100)
        try:
            return web.json_response(self.scheduler.get_weights_by_name(name, size))
        except ValueError as e:
            raise BadRequest(str(e)) from e


async def _events(*events: dict[str, object]) -> AsyncIterator[dict[str, object]]:
    for event in events:
        yield event


def _port(value: object) -> int:
    """A port as an integer or a string of digits: AReaL's client sends ``str(port)``, and SGLang's
    request model takes both."""
    if isinstance(value, str) and value.isdigit():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"master_port must be an integer, got {value!r}", param="master_port")
    return value


def _http_error(request: web.Request, e: web.HTTPException) -> web.Response:
    """An error aiohttp raised (no such route, a method the route does not take, ...) as
    OpenAI's error object, so that SDKs show its message rather than a bare status."""
    if isinstance(e, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(e.allowed_methods))
        resp = error_response(f"{request.method} is not allowed on {request.path}: use {allowed}", 405)
        resp.headers["Allow"] = allowed
        return resp
    if isinstance(e, web.HTTPNotFound):
        return error_response(f"{request.method} {request.path} is not a route of this server", 404, code="unknown_url")
    return error_response(e.text or e.reason, e.status)


def argument_parser() -> argparse.ArgumentParser:
    """The server's command line (the launcher also checks ``launcher.server_args`` against it)."""
    p = argparse.ArgumentParser(prog="python -m areal_lite.engines.server", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True, help="HF model directory")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (except /health*)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-running-requests", type=int, default=128)
    p.add_argument("--context-length", type=int, default=0, help="0 = the model's max_position_embeddings")
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--weight-version", default="0", help="initial weight version (an integer)")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the names the OpenAI routes answer to (e.g. a hub name that clients send); default: the model path",
    )
    p.add_argument(
        "--allow-auto-truncate",
        action="store_true",
        help="as SGLang: cut a prompt that fills the context and shrink a max_new_tokens past it, instead of a 400",
    )
    p.add_argument(
        "--keep-cache-on-update",
        type=_true_or_false,
        default=False,
        help="true: running requests keep their KV caches across a weight update (no recompute)",
    )
    return p


def _true_or_false(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() == "true"


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    return ServerArgs(**vars(argument_parser().parse_args(argv)))


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    # The scheduler thread takes the interpreter lock back after every torch op; while the event
    # loop's thread turns tokens into streamed events it holds the lock, and the scheduler waits
    # up to the switch interval (5 ms by default) per op. A shorter interval hands it back sooner.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    scheduler = Scheduler(
        LocalEngineConfig(
            path=args.model_path,
            dtype=args.dtype,
            device=args.device,
            max_running_requests=args.max_running_requests,
            max_total_tokens=args.context_length,
            seed=args.random_seed,
            keep_cache_on_update=args.keep_cache_on_update,
        )
    )
    scheduler.start()
    scheduler.version = int(args.weight_version)
    freeze_startup_objects()
    server = Server(args, scheduler)
    app = server.build_app()

    async def on_startup(_: web.Application) -> None:
        server.ready = True
        logger.info("serving %s on http://%s:%d", args.model_path, args.host, args.port)

    async def on_shutdown(_: web.Application) -> None:
        server.ready = False
        scheduler.stop()

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    # handler_cancellation: a client that goes away (timeout, failover) aborts its generation.
    web.run_app(
        app,
        host=args.host,
        port=args.port,
        print=None,
        access_log=None,
        shutdown_timeout=1.0,
        handler_cancellation=True,
    )


if __name__ == "__main__":
    main()
