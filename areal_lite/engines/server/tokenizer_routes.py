"""``POST /tokenize`` and ``POST /detokenize`` on our server: the served model's tokenizer over
HTTP, as vLLM's OpenAI-compatible server serves it (docs/protocol.md, "Tokenizer routes").

Clients that count or cut prompts with the server's own tokenizer call them: lm-evaluation-harness
probes ``/tokenize`` before it falls back to a local tokenizer, and agent and chat front ends
count a conversation's tokens against the context. ``/tokenize`` takes a text (``prompt``,
``add_special_tokens`` true by default) or a chat (``messages`` rendered by the chat template, with
``tools``, ``add_generation_prompt`` true by default, ``continue_final_message``,
``chat_template_kwargs``, ``add_special_tokens`` false by default: the template writes its own),
and answers ``count``, ``max_model_len``, ``tokens`` and ``token_strs`` (the tokens' vocabulary
strings with ``return_token_strs``, else null). ``/detokenize`` takes ``tokens`` and answers the
decoded ``prompt``. A request may name a served model (``model``) or none; an unknown one is a 404,
bad input a 400, both OpenAI's error object, as on the other OpenAI routes. Differences from vLLM:
a request that has both ``prompt`` and ``messages`` is refused rather than read as one of them,
and so is a token id outside the vocabulary. The chat is rendered as ``/v1/chat/completions``
renders it, so a count is that route's prompt length.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

from areal_lite.engines.server.common import read_json
from areal_lite.engines.server.openai_request import check_messages
from areal_lite.engines.server.openai_routes import OpenAIRoutes
from areal_lite.openai_format.chat import BadRequest, bool_field, chat_tools, render_chat


class TokenizerRoutes:
    """The tokenizer routes over the served model names and tokenizer of ``routes``."""

    def __init__(self, routes: OpenAIRoutes) -> None:
        self.routes = routes

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_post("/tokenize", self.tokenize)
        router.add_post("/detokenize", self.detokenize)

    def _tokenizer(self, param: str) -> object:
        tok = self.routes.scheduler.tokenizer
        if tok is None:
            raise BadRequest("this model directory has no tokenizer", param=param)
        return tok

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        self.routes.model_name(body)
        if ("prompt" in body) == ("messages" in body):
            raise BadRequest("send either prompt (a text) or messages (a chat)", param="prompt")
        tok = self._tokenizer("messages" if "messages" in body else "prompt")
        if "messages" in body:
            encode = self._chat(tok, body)
        else:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise BadRequest(f"prompt must be a string, got {type(prompt).__name__}", param="prompt")
            special = bool_field(body, "add_special_tokens", True)

            def encode() -> list[int]:
                return tok.encode(prompt, add_special_tokens=special)  # type: ignore[attr-defined]

        # A long document's encoding is slow: not on the event loop, where generations stream.
        tokens = await asyncio.get_running_loop().run_in_executor(None, encode)
        with_strs = bool_field(body, "return_token_strs", False)
        strs = tok.convert_ids_to_tokens(tokens) if with_strs else None  # type: ignore[attr-defined]
        context = self.routes.scheduler.context_len
        return web.json_response({"count": len(tokens), "max_model_len": context, "tokens": tokens, "token_strs": strs})

    def _chat(self, tok: object, body: dict[str, object]) -> Callable[[], list[int]]:
        """The encoding of a chat request's messages, checked first (vLLM's rule: a chat that
        continues its final message gets no generation prompt, and asking for both is an error)."""
        check_messages(body)
        chat_tools(body)
        continue_final = bool_field(body, "continue_final_message", False)
        if continue_final and bool_field(body, "add_generation_prompt", False):
            raise BadRequest(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                param="continue_final_message",
            )
        if continue_final:
            body = {**body, "add_generation_prompt": False}
        special = bool_field(body, "add_special_tokens", False)

        def encode() -> list[int]:
            text = render_chat(tok, body, continue_final_message=continue_final)
            return tok.encode(text, add_special_tokens=special)  # type: ignore[attr-defined]

        return encode

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        self.routes.model_name(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise BadRequest("tokens must be a list of integers", param="tokens")
        tok = self._tokenizer("tokens")
        vocab = len(tok)  # type: ignore[arg-type]
        outside = [t for t in tokens if not 0 <= t < vocab]
        if outside:
            raise BadRequest(f"token id {outside[0]} is outside the vocabulary (0 to {vocab - 1})", param="tokens")
        return web.json_response({"prompt": tok.decode(tokens)})  # type: ignore[attr-defined]
