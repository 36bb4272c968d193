"""``POST /v1/responses`` on our server: OpenAI's Responses API, what the ``openai-agents`` SDK's
default model and ``client.responses.create`` call (docs/protocol.md, "The Responses API").

The request is read as the chat request it stands for (`areal_lite.openai_format.responses`) and
generated like ``/v1/chat/completions`` (`OpenAIRoutes`): the same chat template, tool calls in
the Hermes format, sampling and log-probabilities. Streamed, each piece of text is sent as the
scheduler produces it (``response.output_text.delta``), the function calls once the generation
ends. Nothing is stored: ``GET /v1/responses/{id}`` is a 404 that says so.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from areal_lite.engines.local.request import GenerationResult, TokenOut
from areal_lite.engines.server.common import output_text, read_json
from areal_lite.engines.server.openai_routes import OpenAIRoutes, finish_type, top_logprobs_field, without_stop_token
from areal_lite.engines.server.streaming import TOOL_CALL_START, TextDeltas, merged, send_events
from areal_lite.openai_format.chat import BadRequest, bool_field, chat_tools, max_completion_tokens, render_chat
from areal_lite.openai_format.responses import (
    ResponseEvents,
    chat_body,
    new_response_id,
    output_items,
    response_object,
    status_of,
    usage,
    wants_logprobs,
)
from areal_lite.openai_format.tool_calls import ToolCall, parse_tool_calls


class ResponsesRoute:
    """The Responses API over the chat machinery of ``routes``."""

    def __init__(self, routes: OpenAIRoutes) -> None:
        self.routes = routes

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/responses", self.create)
        router.add_route("*", "/v1/responses/{response_id}", self.not_stored)
        router.add_route("*", "/v1/responses/{response_id}/{action}", self.not_stored)

    async def not_stored(self, request: web.Request) -> web.Response:
        raise BadRequest(
            f"Response {request.match_info['response_id']!r} not found: this server stores no responses",
            status=404,
            code="not_found",
        )

    async def create(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        model = self.routes.model_name(body)
        chat = chat_body(body, structured=True)
        tools = chat_tools(chat, forced=True)
        tool_grammar, _ = self.routes.forced_call(chat, tools)
        tok = self.routes.scheduler.tokenizer
        # vLLM's Responses route encodes the rendered chat with the tokenizer's special tokens
        # (unlike its chat route): a tokenizer that adds a BOS gets one more prompt token here.
        prompt = tok.encode(render_chat(tok, chat))  # type: ignore[union-attr]
        top_n = top_logprobs_field(chat, "top_logprobs")
        params = self.routes.sampling(
            chat,
            max_completion_tokens(chat),
            len(prompt),
            top_n,
            prompt_key="input",
            budget_key="max_output_tokens",
            tool_grammar=tool_grammar,
        )
        response_id = new_response_id()
        jobs = self.routes.jobs([prompt], params, 1, response_id)
        with_logprobs = wants_logprobs(body)
        skip_special = bool_field(chat, "skip_special_tokens", True)

        def answer(r: GenerationResult) -> tuple[str, list[ToolCall]]:
            text = output_text(tok, without_stop_token(r, False), skip_special, False)
            return parse_tool_calls(text) if tools else (text, [])

        def logprobs(
            tokens: list[int], lps: list[float], tops: list | None, before: list[int] | None = None
        ) -> list[dict[str, object]] | None:
            return self.routes.chat_logprobs(tokens, lps, tops, before or []) if with_logprobs else None

        if not bool_field(body, "stream", False):
            [r] = await self.routes.generate(jobs)
            content, calls = answer(r)
            status, incomplete = status_of(finish_type(r))
            lps = logprobs(r.output_ids, r.output_logprobs, r.output_top_logprobs)
            output = output_items(content, calls, lps, status, f"msg_{response_id.removeprefix('resp_')}")
            use = usage(len(prompt), len(r.output_ids))
            return web.json_response(response_object(body, response_id, model, output, status, incomplete, use))

        async def events() -> AsyncIterator[dict[str, object]]:
            stream = ResponseEvents(body, response_id, model)
            for e in stream.start():
                yield e
            markers = (TOOL_CALL_START,) if tools else ()
            texts = TextDeltas(tok, skip_special, params.stop, markers, self.routes.ending_ids(params))
            all_lps: list[dict[str, object]] = []
            sent: list[int] = []
            async for _, event in merged(self.routes.scheduler, jobs):
                if isinstance(event, TokenOut):
                    tops = [event.top] if event.top is not None else None
                    lps = logprobs([event.token], [event.logprob], tops, sent)
                    sent.append(event.token)
                    all_lps += lps or []
                    for e in stream.text(texts.add(event.token), lps):
                        yield e
                    continue
                content, calls = answer(event)
                use = usage(len(prompt), len(event.output_ids))
                for e in stream.finish(content, calls, all_lps if with_logprobs else None, finish_type(event), use):
                    yield e

        return await send_events(request, events(), done_line=False)
