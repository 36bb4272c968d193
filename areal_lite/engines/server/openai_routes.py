"""The OpenAI-compatible routes of our server: ``/v1/models`` (and ``/v1/models/{id}``),
``/v1/completions`` and ``/v1/chat/completions`` (docs/protocol.md, "OpenAI-compatible routes");
``/v1/responses`` is `areal_lite.engines.server.responses_routes`, built on this module's `OpenAIRoutes`.
Each handler reads what is its own (the prompt, log-probabilities) and the rest with what the
routes share: the request's options, sampling and one job per choice
(`areal_lite.engines.server.openai_request.ChoiceRequest`), run and answered whole or streamed
(`areal_lite.engines.server.streaming.respond`) by the route's answer writer
(`areal_lite.engines.server.openai_answers`).

They answer as vLLM's OpenAI server does, vLLM's extensions included: prompts as token ids, token
ids back with ``return_token_ids``, ``top_k`` / ``min_tokens`` / ``stop_token_ids`` /
``ignore_eos``, ``finish_reason: "abort"`` for a generation ended by a pause, and vLLM's rule for
the token a generation stops on (end of sequence or a stop token id): counted, but left out of the
text unless ``include_stop_str_in_output``, and named by ``stop_reason`` only when it is a stop
token id. Agent frameworks and the ``openai`` SDK talk to them, and `RemoteVLLMEngine` is tested
against them. Tool calls are read from the completion in the Hermes format
(`areal_lite.openai_format.tool_calls`); what a chat request says is read by `areal_lite.openai_format.chat`,
shared with the agent workflows' recording proxy.

The server answers to the names it is given (``--served-model-name``, default the model path), so a
client that sends a hub name works once that name is served. ``stream: true`` sends each token as
the scheduler produces it (`areal_lite.engines.server.streaming`). ``seed`` gives a request a
random stream of its own (choice ``i`` of ``n`` uses ``seed + i``): the same seed, the same tokens.
``top_logprobs`` (chat) and ``logprobs`` (completions) report up to
`areal_lite.engines.server.openai_request.MAX_TOP_LOGPROBS` most likely tokens per position, the
policy's own (temperature 1, before top-p / top-k), like the sampled token's; a chat entry's
``bytes`` are the token's own (`areal_lite.openai_format.chat.TokenBytes`). ``echo`` (completions)
puts the prompt before the answer. ``frequency_penalty``, ``presence_penalty``, ``logit_bias`` and
vLLM's ``repetition_penalty`` and ``min_p`` shape what is sampled
(`areal_lite.engines.local.shaping`), not the reported log-probabilities. ``response_format``
(``json_object``, ``json_schema``) and vLLM's ``structured_outputs`` (``json``, ``json_object``,
``regex``, ``choice``, ``grammar``) constrain the output (`areal_lite.engines.local.grammar`), and
so does a ``tool_choice`` that forces a call (``required`` or a named function): the answer is held
to Hermes-format calls of the tools, their arguments to each tool's schema, and read back as the
calls. Refused with a 400: what OpenAI's ranges exclude (``temperature`` above 2, ``n`` above
`areal_lite.engines.server.openai_request.MAX_N`). Every error is OpenAI's error object
(``{"error": {"message", "type", "param", "code"}}``); an unknown model is a 404, as in vLLM, and
so are routes this server does not serve (embeddings, images, audio, moderations), with a message
that says so.
"""

from __future__ import annotations

import time
from urllib.parse import unquote

from aiohttp import web

from areal_lite.engines.local.images import ImageInputs
from areal_lite.engines.local.request import GenerationResult, SamplingParams
from areal_lite.engines.local.scheduler import Scheduler
from areal_lite.engines.server.common import read_json, token_ids
from areal_lite.engines.server.openai_answers import AnswerTexts, ChatAnswer, CompletionAnswer
from areal_lite.engines.server.openai_request import (
    ChoiceRequest,
    Options,
    chat_logprobs_fields,
    check_messages,
    completion_logprobs_field,
    forced_call,
)
from areal_lite.engines.server.streaming import respond
from areal_lite.openai_format.chat import (
    BadRequest,
    bool_field,
    chat_tools,
    data_url_bytes,
    image_urls,
    int_field,
    max_completion_tokens,
    refuse_unsupported,
    render_chat,
)

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
        self.texts = AnswerTexts(scheduler)
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

    def chat_prompt(self, body: dict[str, object], special: bool) -> list[int]:
        """A chat request's prompt: its messages and tools rendered by the chat template (a
        vision-language model's processor's, with one placeholder per image), encoded
        (``special``: with the tokenizer's special tokens, a BOS for Llama's)."""
        tok, vision = self.scheduler.tokenizer, self.scheduler.images
        text = render_chat(vision.processor, body, images=True) if vision is not None else render_chat(tok, body)
        return tok.encode(text, add_special_tokens=special)  # type: ignore[union-attr]

    async def chat_images(self, body: dict[str, object], prompt: list[int]) -> tuple[list[int], ImageInputs | None]:
        """A chat prompt with its images' placeholders expanded, and the images (``image_url``
        parts, data URLs) as the engine takes them; None without images."""
        files = [data_url_bytes(url, where) for where, url in image_urls(body)]
        try:
            return await self.scheduler.prepare_images(prompt, files, expand=True)
        except ValueError as e:
            raise BadRequest(str(e), param="messages") from e

    # ----- /v1/completions -----------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        model = self.model_name(body)
        echo = bool_field(body, "echo", False)
        refuse_unsupported({k: v for k, v in body.items() if k != "echo"}, structured=True)  # echo is served here
        # vLLM's default for a completion's text: the tokenizer's special tokens too (a BOS, for Llama's).
        special = bool_field(body, "add_special_tokens", True)
        prompts, prompt_texts = self._completion_prompts(body.get("prompt"), special)
        logprobs = completion_logprobs_field(body)
        top_n = logprobs or 0
        o = Options.parse(body)
        max_tokens = int_field(body, "max_tokens", 16)
        req = ChoiceRequest.read(
            self.scheduler, body, model, o, prompts, max_tokens, top_n, prompt_key="prompt", scoring=echo
        )
        as_ids = bool_field(body, "return_tokens_as_token_ids", False)
        scored = await self._prompt_logprobs(prompts, top_n) if echo and logprobs is not None else None
        answer = CompletionAnswer(self.texts, req, prompts, prompt_texts, logprobs is not None, as_ids, echo, scored)
        return await respond(request, self.scheduler, req.jobs, answer, o.stream)

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

    # ----- /v1/chat/completions ------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        model = self.model_name(body)
        refuse_unsupported(body, structured=True)
        check_messages(body, images=self.scheduler.images is not None)
        tools = chat_tools(body, forced=True)
        tool_grammar, named = forced_call(body, tools)
        # vLLM's default for a chat: none added (the template writes its own).
        prompt = self.chat_prompt(body, special=bool_field(body, "add_special_tokens", False))
        prompt, images = await self.chat_images(body, prompt)
        want_logprobs, top_n = chat_logprobs_fields(body)
        o = Options.parse(body)
        budget = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = max_completion_tokens(body)
        req = ChoiceRequest.read(
            self.scheduler, body, model, o, [prompt], max_tokens, top_n, budget_key=budget, tool_grammar=tool_grammar
        )
        forced = tool_grammar is not None
        answer = ChatAnswer(self.texts, req, prompt, want_logprobs, tools is not None, forced, named)
        return await respond(request, self.scheduler, req.jobs, answer, o.stream, images=images)
