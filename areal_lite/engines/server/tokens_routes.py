"""``POST /inference/v1/generate``: token ids in, token ids and log-probabilities out, as vLLM's
token-in-token-out route answers it (docs/protocol.md, "Token in, token out").

It is the route of verifiers' ``TrainClient`` and of prime-rl's orchestrator: the client renders
the chat itself, so what the model saw is exactly the ids it sent, and trains on the ids and
log-probabilities that come back. Request: ``token_ids``, ``sampling_params`` (vLLM's
``SamplingParams``: ``max_tokens``, ``min_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``seed``, ``n``, ``stop``, ``stop_token_ids``, ``ignore_eos``, the penalties, ``logit_bias``, ``structured_outputs``,
``logprobs``, ``skip_special_tokens``, ``include_stop_str_in_output``; unknown keys are ignored, as
vLLM does), ``request_id``, ``model``,
``stream`` (+ ``stream_options.include_usage``), ``return_token_ids``. Answer: ``request_id``,
``usage``, ``prompt_token_ids`` (with ``return_token_ids``), and per choice ``token_ids``,
``finish_reason``, ``stop_reason``, ``logprobs.content`` and ``weight_versions`` (spans of output
tokens sampled by one weight version).

A vision-language model takes images as vLLM 0.32 does here: ``content_parts``, each
``{"type": "image_url", "url": ...}`` with a data URL (the image file inline; URLs are not
fetched), one per image in the order of their placeholders in ``token_ids``, which hold each
image's tokens expanded or one placeholder token per image (expanded as the processor would);
``prompt_token_ids`` answers the expanded prompt. vLLM's pre-rendered ``features`` are refused.

A ``logprobs.content`` entry carries the sampled token both as vLLM 0.32 writes it (``token_id``,
``logprob``, ``top_logprobs`` as ``{token_id, logprob}`` with the sampled token first) and as
earlier vLLM and the ``renderers`` package that verifiers 0.4 uses read it (``token``:
``"token_id:N"``), so both generations of clients read it. Differences from vLLM: ``output_mode``
``text`` is refused (the client detokenizes), and so are the sampling options our engine cannot
honour (allowed token ids, bad words, prompt log-probabilities); ``structured_outputs`` is held to
(`areal_lite.engines.local.grammar`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from aiohttp import web

from areal_lite.engines.local import grammar
from areal_lite.engines.local.images import ImageInputs
from areal_lite.engines.local.request import GenerationResult, SamplingParams, TokenOut
from areal_lite.engines.local.scheduler import Scheduler
from areal_lite.engines.server.common import read_json, token_ids
from areal_lite.engines.server.openai_request import MAX_TOP_LOGPROBS
from areal_lite.engines.server.streaming import merged, send_events
from areal_lite.openai_format.chat import (
    BadRequest,
    bool_field,
    data_url_bytes,
    float_field,
    int_field,
    shaping_fields,
    stop_strings,
)

REFUSED_SAMPLING: dict[str, object] = {
    "allowed_token_ids": None,
    "bad_words": None,
    "prompt_logprobs": None,
    "logprob_token_ids": None,
}
"""vLLM sampling keys taken only at their default (no-op) value: our engine cannot honour others."""


def _sampling(sp: dict[str, object], prompt_len: int, context: int) -> tuple[SamplingParams, int, int | None]:
    """(params, n, logprobs) of a request's ``sampling_params``; ``max_tokens`` absent = the rest
    of the context, as vLLM defaults it on this route."""
    for key, default in REFUSED_SAMPLING.items():
        if sp.get(key) is not None and sp[key] != default and sp[key] not in ({}, []):
            raise BadRequest(f"sampling_params.{key} is not supported by the areal-lite server", param=key)
    max_tokens = sp.get("max_tokens")
    max_tokens = max(context - prompt_len, 0) if max_tokens is None else int_field(sp, "max_tokens", 0)
    if prompt_len + max_tokens > context:
        raise BadRequest(
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} to generate).",
            param="max_tokens",
        )
    logprobs = sp.get("logprobs")
    if logprobs is not None:
        logprobs = int_field(sp, "logprobs", 0)
        if not -1 <= logprobs <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"logprobs must be in [-1, {MAX_TOP_LOGPROBS}], got {logprobs}", param="logprobs")
    stop_ids = sp.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise BadRequest("stop_token_ids must be a list of integers", param="stop_token_ids")
    seed = sp.get("seed")
    top_k = int_field(sp, "top_k", -1)
    shaping = shaping_fields(sp)  # before the try: its BadRequest names the field
    try:
        constraint = grammar.requested(None, sp.get("structured_outputs"))
    except ValueError as e:
        raise BadRequest(str(e), param="structured_outputs") from e
    try:
        params = SamplingParams(
            max_new_tokens=max_tokens,
            min_new_tokens=int_field(sp, "min_tokens", 0),
            temperature=float_field(sp, "temperature", 1.0),
            top_p=float_field(sp, "top_p", 1.0),
            top_k=-1 if top_k == 0 else top_k,
            stop=stop_strings(sp),
            stop_token_ids=list(stop_ids),
            ignore_eos=bool_field(sp, "ignore_eos", False),
            # -1 asks vLLM for the whole vocabulary; we cap it at the route's limit.
            top_logprobs=MAX_TOP_LOGPROBS if logprobs == -1 else (logprobs or 0),
            seed=None if seed is None else int_field(sp, "seed", 0),
            **shaping,
            grammar=constraint,
        )
    except ValueError as e:
        raise BadRequest(str(e)) from e
    return params, int_field(sp, "n", 1), logprobs


def _content_images(parts: object) -> list[bytes]:
    """The image files of vLLM's ``content_parts`` (``image_url`` parts with data URLs)."""
    if parts is None:
        return []
    if not isinstance(parts, list):
        raise BadRequest("content_parts must be a list of parts", param="content_parts")
    files = []
    for i, part in enumerate(parts):
        where = f"content_parts[{i}]"
        if not isinstance(part, dict) or part.get("type") != "image_url" or not isinstance(part.get("url"), str):
            raise BadRequest(f'{where}: a part is {{"type": "image_url", "url": ...}} (images only)', param=where)
        files.append(data_url_bytes(part["url"], where))
    return files


def _logprob_entry(token: int, logprob: float, top: list[tuple[int, float]] | None, n: int) -> dict[str, object]:
    candidates = [(token, logprob)] + [(t, v) for t, v in top or [] if t != token]
    return {
        "token": f"token_id:{token}",
        "token_id": token,
        "logprob": logprob,
        "rank": None,
        "top_logprobs": [{"token_id": t, "logprob": v, "rank": None} for t, v in candidates[: max(n, 1)]],
    }


def weight_versions(versions: list[int]) -> list[dict[str, object]]:
    """vLLM's ``weight_versions``: ``{version, start, end}`` per run of output tokens sampled by one
    weight version (``end`` exclusive)."""
    spans: list[dict[str, object]] = []
    for k, v in enumerate(versions):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = k + 1
        else:
            spans.append({"version": str(v), "start": k, "end": k + 1})
    return spans


class TokensRoute:
    """The handler of ``/inference/v1/generate`` over the server's `Scheduler`; requests may name
    one of ``model_names`` or none."""

    def __init__(self, scheduler: Scheduler, model_names: list[str]) -> None:
        self.scheduler = scheduler
        self.model_names = model_names

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_post("/inference/v1/generate", self.generate)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        model = body.get("model")
        if model is not None and model not in self.model_names:
            raise BadRequest(f"The model `{model}` does not exist.", status=404, param="model", code="model_not_found")
        prompt = token_ids(body.get("token_ids"), "token_ids")
        if body.get("output_mode", "tokens") != "tokens":
            raise BadRequest("output_mode must be tokens on the areal-lite server", param="output_mode")
        if body.get("features"):
            raise BadRequest("features (pre-rendered multimodal inputs) are not supported: send content_parts",
                             param="features")  # fmt: skip
        images: ImageInputs | None = None
        try:
            prompt, images = await self.scheduler.prepare_images(
                prompt, _content_images(body.get("content_parts")), True
            )
        except ValueError as e:
            raise BadRequest(str(e), param="content_parts") from e
        sp = body.get("sampling_params")
        if not isinstance(sp, dict):
            raise BadRequest("sampling_params must be an object", param="sampling_params")
        params, n, logprobs = _sampling(sp, len(prompt), self.scheduler.context_len)
        if n < 1:
            raise BadRequest(f"n must be >= 1, got {n}", param="n")
        try:
            self.scheduler.validate_request(prompt, params)
        except ValueError as e:
            raise BadRequest(str(e), param="token_ids") from e
        request_id = body.get("request_id") or uuid.uuid4().hex
        if not isinstance(request_id, str):
            raise BadRequest("request_id must be a string", param="request_id")
        seeded = params.seed is not None
        jobs = [
            (
                prompt,
                SamplingParams(**{**vars(params), "seed": params.seed + i}) if seeded else params,
                f"{request_id}-{i}",
            )
            for i in range(n)
        ]
        with_ids = bool_field(body, "return_token_ids", False)
        per_job = [images] * n if images is not None else None
        head: dict[str, object] = {"request_id": request_id}

        def logprob_block(tokens: list[int], lps: list[float], tops: list | None) -> dict[str, object] | None:
            if logprobs is None:
                return None
            width = MAX_TOP_LOGPROBS if logprobs == -1 else logprobs
            content = [
                _logprob_entry(t, lp, tops[k] if tops else None, width) for k, (t, lp) in enumerate(zip(tokens, lps))
            ]
            return {"content": content}

        def usage(results: list[GenerationResult]) -> dict[str, int]:
            out = sum(len(r.output_ids) for r in results)
            return {"prompt_tokens": len(prompt), "completion_tokens": out, "total_tokens": len(prompt) + out}

        def end_fields(r: GenerationResult) -> dict[str, object]:
            matched = r.finish_reason.get("matched")
            stop_reason = matched if isinstance(matched, str) or matched in params.stop_token_ids else None
            return {"finish_reason": str(r.finish_reason["type"]), "stop_reason": stop_reason,
                    "weight_versions": weight_versions(r.output_versions)}  # fmt: skip

        if not bool_field(body, "stream", False):
            results = await self.scheduler.generate_many(jobs, images=per_job)
            choices = [
                {"index": i, "token_ids": r.output_ids,
                 "logprobs": logprob_block(r.output_ids, r.output_logprobs, r.output_top_logprobs), **end_fields(r)}
                for i, r in enumerate(results)
            ]  # fmt: skip
            out = {**head, "model": model or self.model_names[0], "created": int(time.time()), "output_mode": "tokens",
                   "usage": usage(results), "prompt_token_ids": prompt if with_ids else None, "choices": choices}  # fmt: skip
            return web.json_response(out)

        opts = body.get("stream_options")
        include_usage = isinstance(opts, dict) and bool_field(opts, "include_usage", False)

        async def chunks() -> AsyncIterator[dict[str, object]]:
            first = True
            results: list[GenerationResult] = []
            async for i, event in merged(self.scheduler, jobs, images=per_job):
                if isinstance(event, TokenOut):
                    tops = [event.top] if event.top is not None else None
                    choice = {"index": i, "token_ids": [event.token], "finish_reason": None,
                              "logprobs": logprob_block([event.token], [event.logprob], tops)}  # fmt: skip
                else:
                    results.append(event)
                    choice = {"index": i, "token_ids": [], "logprobs": None, **end_fields(event)}
                chunk: dict[str, object] = {**head, "output_mode": "tokens", "choices": [choice]}
                if first and with_ids:
                    chunk["prompt_token_ids"] = prompt
                first = False
                yield chunk
            if include_usage:
                yield {**head, "output_mode": "tokens", "choices": [], "usage": usage(results)}

        return await send_events(request, chunks())
