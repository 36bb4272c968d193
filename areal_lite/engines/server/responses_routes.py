"""``POST /v1/responses`` on our server: OpenAI's Responses API, what the ``openai-agents`` SDK's
default model and ``client.responses.create`` call (docs/protocol.md, "The Responses API").

The request is read as the chat request it stands for (`areal_lite.openai_format.responses`) and
generated like ``/v1/chat/completions`` (`OpenAIRoutes`): the same chat template, tool calls in
the Hermes format, sampling and log-probabilities. Streamed, each piece of text is sent as the
scheduler produces it (``response.output_text.delta``), the function calls once the generation
ends. Nothing is stored: ``GET /v1/responses/{id}`` is a 404 that says so.
"""

from __future__ import annotations

from aiohttp import web

from areal_lite.engines.local.request import GenerationResult, SamplingParams, TokenOut
from areal_lite.engines.server.common import read_json
from areal_lite.engines.server.openai_answers import AnswerTexts, finish_type, top_of
from areal_lite.engines.server.openai_request import choice_jobs, forced_call, sampling_params, top_logprobs_field
from areal_lite.engines.server.openai_routes import OpenAIRoutes
from areal_lite.engines.server.streaming import TOOL_CALL_START, Answer, respond
from areal_lite.openai_format.chat import BadRequest, bool_field, chat_tools, max_completion_tokens
from areal_lite.openai_format.responses import (
    ResponseEvents,
    chat_body,
    finished_response,
    new_response_id,
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
        tool_grammar, _ = forced_call(chat, tools)
        # vLLM's Responses route encodes the rendered chat with the tokenizer's special tokens
        # (unlike its chat route): a tokenizer that adds a BOS gets one more prompt token here.
        prompt = self.routes.chat_prompt(chat, special=True)
        top_n = top_logprobs_field(chat, "top_logprobs")
        scheduler = self.routes.scheduler
        params = sampling_params(
            scheduler,
            chat,
            max_completion_tokens(chat),
            len(prompt),
            top_n,
            prompt_key="input",
            budget_key="max_output_tokens",
            tool_grammar=tool_grammar,
        )
        response_id = new_response_id()
        jobs = choice_jobs(scheduler, [prompt], params, 1, response_id)
        skip_special = bool_field(chat, "skip_special_tokens", True)
        answer = ResponseAnswer(
            self.routes.texts, body, model, response_id, params, prompt, tools is not None, skip_special
        )
        return await respond(request, scheduler, jobs, answer, bool_field(body, "stream", False), done_line=False)


class ResponseAnswer(Answer):
    """The answer to one Responses request: the ``response`` object, or streamed, its events
    (`ResponseEvents`): the text as it comes, the function calls once the generation ends."""

    def __init__(
        self,
        texts: AnswerTexts,
        body: dict[str, object],
        model: str,
        response_id: str,
        params: SamplingParams,
        prompt: list[int],
        tools: bool,
        skip_special: bool,
    ) -> None:
        self.texts, self.body, self.model, self.response_id = texts, body, model, response_id
        self.params, self.prompt, self.tools, self.skip_special = params, prompt, tools, skip_special
        self.with_logprobs = wants_logprobs(body)

    def answer(self, r: GenerationResult) -> tuple[str, list[ToolCall]]:
        text = self.texts.output(r, self.skip_special, False)
        return parse_tool_calls(text) if self.tools else (text, [])

    def logprobs(
        self, tokens: list[int], lps: list[float], tops: list | None, before: list[int] | None = None
    ) -> list[dict[str, object]] | None:
        return self.texts.chat_logprobs(tokens, lps, tops, before or []) if self.with_logprobs else None

    def whole(self, results: list[GenerationResult]) -> dict[str, object]:
        [r] = results
        content, calls = self.answer(r)
        lps = self.logprobs(r.output_ids, r.output_logprobs, r.output_top_logprobs)
        return finished_response(
            self.body,
            self.response_id,
            self.model,
            content,
            calls,
            lps,
            finish=finish_type(r),
            prompt_tokens=len(self.prompt),
            output_tokens=len(r.output_ids),
            item_id=f"msg_{self.response_id.removeprefix('resp_')}",
        )

    def opening(self) -> list[dict[str, object]]:
        self.stream = ResponseEvents(self.body, self.response_id, self.model)
        markers = (TOOL_CALL_START,) if self.tools else ()
        self.deltas = self.texts.deltas(self.params, self.skip_special, False, markers)
        self.all_lps: list[dict[str, object]] = []
        self.sent: list[int] = []
        return self.stream.start()

    def token(self, i: int, event: TokenOut) -> list[dict[str, object]]:
        lps = self.logprobs([event.token], [event.logprob], top_of(event), self.sent)
        self.sent.append(event.token)
        self.all_lps += lps or []
        return self.stream.text(self.deltas.add(event.token), lps)

    def ending(self, i: int, r: GenerationResult) -> list[dict[str, object]]:
        content, calls = self.answer(r)
        use = usage(len(self.prompt), len(r.output_ids))
        return self.stream.finish(content, calls, self.all_lps if self.with_logprobs else None, finish_type(r), use)
