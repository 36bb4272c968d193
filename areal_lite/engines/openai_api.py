"""The OpenAI-compatible routes of our server: ``/v1/models``, ``/v1/completions`` and
``/v1/chat/completions`` (docs/protocol.md, "OpenAI-compatible routes").

They answer as vLLM's OpenAI server does, vLLM's extensions included: prompts as token ids, token
ids back with ``return_token_ids``, ``top_k`` / ``min_tokens`` / ``stop_token_ids`` /
``ignore_eos``, ``finish_reason: "abort"`` for a generation ended by a pause. Agent frameworks and
the ``openai`` SDK talk to them, and `RemoteVLLMEngine` is tested against them. Tool calls are read
from the completion in the Hermes format (`areal_lite.utils.tool_calls`); what a chat request
says is read by `areal_lite.utils.openai_chat`, shared with the agent workflows' recording proxy.

Deliberate differences from vLLM: with ``stream: true`` the server answers in server-sent events of
the same shape, one chunk per token, but sends them once the generation has ended (the scheduler
reports a request only when it finishes); only the sampled token's log-probability is available,
so ``top_logprobs`` (chat) and ``logprobs`` (completions) above 0 are refused, as are penalties,
seeds, logit biases, structured output and forced tool choice. Bad input is a 400 with
``{"error": {"message": ...}}``; an unknown model name is a 404, as in vLLM.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from aiohttp import web

from areal_lite.engines.request import GenerationResult, SamplingParams
from areal_lite.engines.scheduler import Scheduler
from areal_lite.engines.server_common import output_text, read_json, token_ids
from areal_lite.utils.openai_chat import (
    BadRequest,
    assistant_message,
    bool_field,
    chat_finish_reason,
    chat_tools,
    float_field,
    int_field,
    max_completion_tokens,
    refuse_unsupported,
    render_chat,
    stop_strings,
)
from areal_lite.utils.tool_calls import parse_tool_calls


def _finish_reason(r: GenerationResult) -> str:
    """OpenAI's (and vLLM's) name for why a generation ended: stop, length or abort."""
    return str(r.finish_reason["type"])


def _stop_reason(r: GenerationResult) -> int | str | None:
    matched = r.finish_reason.get("matched")
    return matched if isinstance(matched, (int, str)) else None


def _sse(obj: object) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


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
            raise BadRequest("stream_options can only be given with stream: true")
        if opts is not None and not isinstance(opts, dict):
            raise BadRequest("stream_options must be an object")
        request_id = body.get("request_id") or uuid.uuid4().hex
        if not isinstance(request_id, str):
            raise BadRequest("request_id must be a string")
        return cls(
            stream=stream,
            include_usage=opts is not None and bool_field(opts, "include_usage", False),
            n=int_field(body, "n", 1),
            skip_special=bool_field(body, "skip_special_tokens", True),
            keep_stop=bool_field(body, "include_stop_str_in_output", False),
            with_ids=bool_field(body, "return_token_ids", False),
            request_id=request_id,
        )


class OpenAIRoutes:
    """Handlers of the OpenAI-compatible routes over the server's `Scheduler`; ``model_name`` is the
    one model served (``/v1/models``), which requests must name."""

    def __init__(self, scheduler: Scheduler, model_name: str) -> None:
        self.scheduler = scheduler
        self.model_name = model_name

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_get("/v1/models", self.models)
        router.add_post("/v1/completions", self.completions)
        router.add_post("/v1/chat/completions", self.chat_completions)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "areal-lite",
                        "max_model_len": self.scheduler.context_len,
                    }
                ],
            }
        )

    # ----- shared by both routes -----------------------------------------------------------

    def _check_model(self, body: dict[str, object]) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise BadRequest(f"The model `{model}` does not exist.", status=404)

    def _sampling(self, body: dict[str, object], max_tokens: int | None, prompt_len: int) -> SamplingParams:
        """The request's sampling options; ``max_tokens`` None = up to the context length."""
        context = self.scheduler.context_len
        if max_tokens is None:
            max_tokens = max(context - prompt_len, 0)
        if max_tokens < 0:
            raise BadRequest(f"max_tokens must be >= 0, got {max_tokens}")
        if prompt_len + max_tokens > context:
            raise BadRequest(
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} to generate)."
            )
        stop_ids = body.get("stop_token_ids") or []
        if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
            raise BadRequest("stop_token_ids must be a list of integers")
        top_k = int_field(body, "top_k", -1)
        try:
            return SamplingParams(
                max_new_tokens=max_tokens,
                min_new_tokens=int_field(body, "min_tokens", 0),
                temperature=float_field(body, "temperature", 1.0),
                top_p=float_field(body, "top_p", 1.0),
                top_k=-1 if top_k == 0 else top_k,  # vLLM: 0 or -1 = every token
                stop=stop_strings(body),
                stop_token_ids=list(stop_ids),
                ignore_eos=bool_field(body, "ignore_eos", False),
            )
        except ValueError as e:
            raise BadRequest(str(e)) from e

    async def _generate(
        self, prompts: list[list[int]], params: SamplingParams, n: int, request_id: str
    ) -> list[GenerationResult]:
        """``n`` samples of each prompt, in the order prompt 0's samples, prompt 1's, ..."""
        if n < 1:
            raise BadRequest(f"n must be >= 1, got {n}")
        try:
            for p in prompts:
                self.scheduler.validate_request(p, params)
        except ValueError as e:
            raise BadRequest(str(e)) from e
        rids = [f"{request_id}-{i}" for i in range(len(prompts) * n)]
        jobs = [self.scheduler.generate(prompts[i // n], params, rid) for i, rid in enumerate(rids)]
        return list(await asyncio.gather(*jobs))

    def _token_text(self, token: int, as_ids: bool) -> str:
        tok = self.scheduler.tokenizer
        return f"token_id:{token}" if as_ids or tok is None else tok.decode([token])

    def _deltas(self, r: GenerationResult, text: str, skip_special: bool) -> Iterator[tuple[int, str]]:
        """(token index, the text it adds) per output token; the texts add up to ``text``. A token
        that ends inside a multi-byte character adds nothing until the character is complete."""
        tok = self.scheduler.tokenizer
        prev = ""
        last = len(r.output_ids) - 1
        for k in range(len(r.output_ids)):
            if k == last:
                cur = text
            else:
                cur = tok.decode(r.output_ids[: k + 1], skip_special_tokens=skip_special)[: len(text)] if tok else ""
                if cur.endswith("\ufffd") or not cur.startswith(prev):
                    yield k, ""
                    continue
            yield k, cur[len(prev) :]
            prev = cur

    async def _stream(self, request: web.Request, chunks: Iterator[dict[str, object]]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for chunk in chunks:
            await resp.write(_sse(chunk))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    @staticmethod
    def _usage(results: list[GenerationResult], prompt_tokens: int) -> dict[str, int]:
        completion = sum(len(r.output_ids) for r in results)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }

    # ----- /v1/completions -----------------------------------------------------------------

    def _completion_prompts(self, prompt: object) -> list[list[int]]:
        """The prompt as token-id lists: a string, a list of strings, token ids, lists of token ids."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            return [token_ids(p, "prompt") for p in prompt]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) and not isinstance(prompt[0], bool):
            return [token_ids(prompt, "prompt")]
        texts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
            raise BadRequest("prompt must be a non-empty string, a list of strings, token ids or lists of token ids")
        if self.scheduler.tokenizer is None:
            raise BadRequest("this model directory has no tokenizer: send the prompt as token ids")
        return [self.scheduler.tokenizer.encode(t, add_special_tokens=False) for t in texts]

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        self._check_model(body)
        refuse_unsupported(body)
        prompts = self._completion_prompts(body.get("prompt"))
        logprobs = body.get("logprobs")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)):
            raise BadRequest(f"logprobs must be an integer, got {logprobs!r}")
        if logprobs:
            raise BadRequest("logprobs above 0 (top log-probabilities) are not supported by the areal-lite server")
        o = Options.parse(body)
        params = self._sampling(body, int_field(body, "max_tokens", 16), max(len(p) for p in prompts))
        as_ids = bool_field(body, "return_tokens_as_token_ids", False)
        results = await self._generate(prompts, params, o.n, o.request_id)
        head = {"id": f"cmpl-{o.request_id}", "created": int(time.time()), "model": self.model_name}
        texts = [output_text(self.scheduler.tokenizer, r, o.skip_special, o.keep_stop) for r in results]
        usage = self._usage(results, sum(len(p) for p in prompts) * o.n)

        def logprob_block(r: GenerationResult, tokens: range) -> dict[str, object]:
            strings = [self._token_text(r.output_ids[k], as_ids) for k in tokens]
            offsets, pos = [], 0
            for s in strings:
                offsets.append(pos)
                pos += len(s)
            lps = [r.output_logprobs[k] for k in tokens]
            return {"tokens": strings, "token_logprobs": lps, "top_logprobs": [{s: lp} for s, lp in zip(strings, lps)],
                    "text_offset": offsets}  # fmt: skip

        if not o.stream:
            choices = []
            for i, (r, text) in enumerate(zip(results, texts)):
                choice: dict[str, object] = {
                    "index": i,
                    "text": text,
                    "logprobs": logprob_block(r, range(len(r.output_ids))) if logprobs is not None else None,
                    "finish_reason": _finish_reason(r),
                    "stop_reason": _stop_reason(r),
                }
                if o.with_ids:
                    choice.update(prompt_token_ids=r.input_ids, token_ids=r.output_ids)
                choices.append(choice)
            return web.json_response({**head, "object": "text_completion", "choices": choices, "usage": usage})

        def chunks() -> Iterator[dict[str, object]]:
            for i, (r, text) in enumerate(zip(results, texts)):
                for k, delta in self._deltas(r, text, o.skip_special):
                    choice: dict[str, object] = {
                        "index": i,
                        "text": delta,
                        "logprobs": logprob_block(r, range(k, k + 1)) if logprobs is not None else None,
                        "finish_reason": None,
                    }
                    if o.with_ids:
                        choice["token_ids"] = [r.output_ids[k]]
                        if k == 0:
                            choice["prompt_token_ids"] = r.input_ids
                    yield {**head, "object": "text_completion", "choices": [choice]}
                end = {"index": i, "text": "", "logprobs": None, "finish_reason": _finish_reason(r),
                       "stop_reason": _stop_reason(r)}  # fmt: skip
                yield {**head, "object": "text_completion", "choices": [end]}
            if o.include_usage:
                yield {**head, "object": "text_completion", "choices": [], "usage": usage}

        return await self._stream(request, chunks())

    # ----- /v1/chat/completions ------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        self._check_model(body)
        refuse_unsupported(body)
        tools = chat_tools(body)
        tok = self.scheduler.tokenizer
        prompt = tok.encode(render_chat(tok, body, tools), add_special_tokens=False)  # type: ignore[union-attr]
        want_logprobs = bool_field(body, "logprobs", False)
        if int_field(body, "top_logprobs", 0):
            raise BadRequest("top_logprobs above 0 are not supported by the areal-lite server")
        o = Options.parse(body)
        params = self._sampling(body, max_completion_tokens(body), len(prompt))
        results = await self._generate([prompt], params, o.n, o.request_id)
        head = {"id": f"chatcmpl-{o.request_id}", "created": int(time.time()), "model": self.model_name}
        usage = self._usage(results, len(prompt) * o.n)
        answers = []  # (result, full text, content, tool calls)
        for r in results:
            text = output_text(self.scheduler.tokenizer, r, o.skip_special, o.keep_stop)
            content, calls = parse_tool_calls(text) if tools else (text, [])
            answers.append((r, text, content, calls))

        def finish(r: GenerationResult, calls: list) -> str:
            return chat_finish_reason(_finish_reason(r), calls)

        def logprob_entries(r: GenerationResult, tokens: range) -> list[dict[str, object]]:
            out = []
            for k in tokens:
                s = self._token_text(r.output_ids[k], False)
                out.append({"token": s, "logprob": r.output_logprobs[k], "bytes": list(s.encode()), "top_logprobs": []})
            return out

        if not o.stream:
            choices = []
            for i, (r, _, content, calls) in enumerate(answers):
                choice: dict[str, object] = {
                    "index": i,
                    "message": assistant_message(content, calls),
                    "logprobs": {"content": logprob_entries(r, range(len(r.output_ids)))} if want_logprobs else None,
                    "finish_reason": finish(r, calls),
                    "stop_reason": _stop_reason(r),
                }
                if o.with_ids:
                    choice["token_ids"] = r.output_ids
                choices.append(choice)
            out = {**head, "object": "chat.completion", "choices": choices, "usage": usage}
            if o.with_ids:
                out["prompt_token_ids"] = prompt
            return web.json_response(out)

        def chunk(choice: dict[str, object]) -> dict[str, object]:
            return {**head, "object": "chat.completion.chunk", "choices": [choice]}

        def chunks() -> Iterator[dict[str, object]]:
            for i, (r, text, content, calls) in enumerate(answers):
                first: dict[str, object] = {"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}  # fmt: skip
                if o.with_ids:
                    first["prompt_token_ids"] = prompt
                yield chunk(first)
                if calls:  # the text around the calls, then the calls, each as one delta
                    if content:
                        yield chunk(
                            {"index": i, "delta": {"content": content}, "logprobs": None, "finish_reason": None}
                        )
                    tool_calls = [{"index": j, **c.to_openai()} for j, c in enumerate(calls)]
                    yield chunk(
                        {"index": i, "delta": {"tool_calls": tool_calls}, "logprobs": None, "finish_reason": None}
                    )
                else:
                    for k, delta in self._deltas(r, text, o.skip_special):
                        c: dict[str, object] = {
                            "index": i,
                            "delta": {"content": delta},
                            "logprobs": {"content": logprob_entries(r, range(k, k + 1))} if want_logprobs else None,
                            "finish_reason": None,
                        }
                        if o.with_ids:
                            c["token_ids"] = [r.output_ids[k]]
                        yield chunk(c)
                yield chunk({"index": i, "delta": {}, "logprobs": None, "finish_reason": finish(r, calls)})
            if o.include_usage:
                yield {**head, "object": "chat.completion.chunk", "choices": [], "usage": usage}

        return await self._stream(request, chunks())
