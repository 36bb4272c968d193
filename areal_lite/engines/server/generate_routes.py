"""SGLang's ``/generate`` on our server (docs/protocol.md): prompts as text or token ids, one or a
batch, ``n`` samples each, answered whole or streamed one event per token, with SGLang's
``meta_info`` (log-probabilities, versions, routed experts).

Deliberate differences from SGLang: weight versions are integers (as strings on the wire, "0" at
start); ``meta_info`` carries one extra key, ``output_token_versions`` (the version of each output
token, which can change inside one request when weights are updated in place); ``json_schema``,
``regex`` and ``ebnf`` are held to with llguidance (`areal_lite.engines.local.grammar`), where
SGLang defaults to xgrammar; ``structural_tag``, ``stop_regex`` and the audio, video, embedding,
hidden-state and custom-logit-processor inputs of ``/generate`` are refused with a 400 rather than
silently ignored.

A vision-language model takes ``image_data`` as SGLang documents it: for one prompt a list of
images or one image, for a batch one entry per prompt (a list, one image or null); an image is
its file in base64, or a data URL (``data:image/png;base64,...``). URLs and file paths are refused
with a 400 (the server reads nothing a request points to). The prompt holds each image's tokens
expanded or one placeholder per image (``<|vision_start|><|image_pad|><|vision_end|>`` for
Qwen-VL), which is expanded as the processor would; ``meta_info.prompt_tokens`` counts them
expanded. A mixture-of-experts model answers ``return_routed_experts`` as SGLang started with
``--enable-return-routed-experts`` does (``meta_info["routed_experts"]``, base64 of int32
``[prompt + completion tokens - 1, layers, top_k]``); a dense model refuses it with a 400.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from aiohttp import web

from areal_lite.engines.local import grammar
from areal_lite.engines.local.images import ImageInputs
from areal_lite.engines.local.request import GenerationResult, SamplingParams
from areal_lite.engines.local.scheduler import Scheduler
from areal_lite.engines.server.common import (
    BadRequest,
    ServerState,
    bool_field,
    float_field,
    int_field,
    output_text,
    read_json,
)
from areal_lite.engines.server.lora_routes import check_lora_path
from areal_lite.engines.server.openai_request import MAX_TOP_LOGPROBS
from areal_lite.engines.server.streaming import Job, TextDeltas, merged, send_events
from areal_lite.openai_format.chat import data_url_bytes, shaping_fields

T = TypeVar("T")

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


def _image_data(body: dict[str, object], count: int, is_batch: bool) -> list[list[bytes]]:
    """Each prompt's image files from SGLang's ``image_data``: for one prompt a list of images or
    one image, for a batch one entry per prompt (a list, one image or null)."""
    raw = body.get("image_data")
    if raw is None:
        return [[] for _ in range(count)]
    if is_batch and (not isinstance(raw, list) or len(raw) != count):
        raise BadRequest(
            f"image_data of a batch of {count} prompts has one entry per prompt (a list of images, one image or null)",
            param="image_data",
        )
    entries = raw if is_batch else [raw]
    out = []
    for i, entry in enumerate(entries):  # type: ignore[arg-type]
        items = [] if entry is None else entry if isinstance(entry, list) else [entry]
        where = f"image_data[{i}]" if is_batch else "image_data"
        out.append([_image_file(item, f"{where}[{j}]") for j, item in enumerate(items)])
    return out


def _image_file(item: object, where: str) -> bytes:
    """An image of ``image_data``: its file in base64, or a data URL."""
    if not isinstance(item, str):
        raise BadRequest(f"{where}: an image is a string (base64 of its file, or a data URL)", param="image_data")
    if item.startswith("data:") or "://" in item[:16]:
        return data_url_bytes(item, where)
    try:
        return base64.b64decode(item, validate=True)
    except (binascii.Error, ValueError) as e:
        raise BadRequest(
            f"{where}: an image is base64 of its file or a data URL (file paths are not read): {e}", param="image_data"
        ) from e


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


class GenerateRoute:
    """``/generate`` (POST, and PUT as SGLang takes it) over the embedded engine's `Scheduler`."""

    def __init__(self, scheduler: Scheduler, state: ServerState, allow_auto_truncate: bool = False) -> None:
        self.scheduler = scheduler
        self.state = state
        self.allow_auto_truncate = allow_auto_truncate
        """``--allow-auto-truncate``: cut what does not fit the context rather than refuse it (`_fit_context`)."""

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_post("/generate", self.generate)
        router.add_put("/generate", self.generate)

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
        prompts, images = await self._with_images(prompts, _image_data(body, count, is_batch))
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
        jobs: list[Job] = []
        options: list[AnswerOptions] = []
        job_images: list[ImageInputs | None] = []
        for i, (prompt, rid, raw, (params, _, skip_special, no_stop_trim)) in enumerate(
            zip(prompts, rids, raw_params, parsed)
        ):
            if images[i] is not None and self.allow_auto_truncate and len(prompt) >= self.scheduler.context_len:
                raise BadRequest("a prompt with images is not cut to fit the context (its images would be cut)")
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
                job_images.append(images[i])
        try:
            for prompt, params, _ in jobs:
                self.scheduler.validate_request(prompt, params)
        except ValueError as e:
            raise BadRequest(str(e)) from e
        if stream:
            events = self._stream(jobs, options, is_batch or n > 1, want_input, job_images)
            return await send_events(request, events)
        results = await self.scheduler.generate_many(jobs, want_input, job_images)
        out = [self._answer(r, opts) for r, opts in zip(results, options)]
        return web.json_response(out if is_batch or n > 1 else out[0])

    async def _with_images(
        self, prompts: list[list[int]], files: list[list[bytes]]
    ) -> tuple[list[list[int]], list[ImageInputs | None]]:
        """Each prompt with its image placeholders expanded, and its images as the engine takes them."""
        out, images = [], []
        for i, (prompt, given) in enumerate(zip(prompts, files)):
            try:
                prompt, inputs = await self.scheduler.prepare_images(prompt, given, expand=True)
            except ValueError as e:
                raise BadRequest(f"prompt {i}: {e}" if len(prompts) > 1 else str(e), param="image_data") from e
            out.append(prompt)
            images.append(inputs)
        return out, images

    def _fit_context(self, prompt: list[int], raw: object, params: SamplingParams) -> tuple[list[int], SamplingParams]:
        """SGLang's length checks: a prompt that fills the context, or an explicit
        ``max_new_tokens`` that takes prompt + completion past it, is a 400 with SGLang's
        message; with ``--allow-auto-truncate`` the prompt keeps its head and ``max_new_tokens``
        shrinks instead. An absent ``max_new_tokens`` (128) just ends at the context's end."""
        context = self.scheduler.context_len
        truncate = self.allow_auto_truncate
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
        jobs: list[Job],
        options: list[AnswerOptions],
        tagged: bool,
        want_input: bool,
        images: list[ImageInputs | None],
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
        async for i, event in merged(self.scheduler, jobs, want_input, images):
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
            "weight_version": str(r.output_versions[-1]) if r.output_versions else self.state.weight_version,
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


async def _events(*events: dict[str, object]) -> AsyncIterator[dict[str, object]]:
    for event in events:
        yield event
