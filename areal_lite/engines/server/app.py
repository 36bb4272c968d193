"""Our HTTP server over the embedded engine: it answers like an SGLang server, and like vLLM's
OpenAI server too (docs/protocol.md).

    python -m areal_lite.engines.server --model-path DIR [--host 127.0.0.1] [--port 30000] [--api-key K]

It exists so that `RemoteSGLangEngine` and `RemoteVLLMEngine` are tested against a real HTTP server
on machines where SGLang and vLLM cannot run, and so that CPU deployments get rollout servers with
no extra dependency. Same endpoints, payloads, status codes and error shapes as SGLang for what
areal-lite uses. This module builds the server (`Server.build_app`) and starts it (`main`, over
the command line of `areal_lite.engines.server.server_args`); the routes are registered from one
module per family: SGLang's ``/generate`` (`areal_lite.engines.server.generate_routes`) and its
information, control and weight-update routes (`areal_lite.engines.server.sglang_routes`), the
OpenAI-compatible routes (`areal_lite.engines.server.openai_routes`, the Responses API in
`areal_lite.engines.server.responses_routes`), vLLM's token-in-token-out route
(`areal_lite.engines.server.tokens_routes`), tokenizer routes
(`areal_lite.engines.server.tokenizer_routes`) and RL control routes
(`areal_lite.engines.server.vllm_routes`), and SGLang's LoRA adapter routes
(`areal_lite.engines.server.lora_routes`). Every error, on every route (unknown routes and methods
included), is OpenAI's error object ``{"error": {"message", "type", "param", "code"}}``, and the
server keeps serving.
"""

from __future__ import annotations

import logging
import sys

from aiohttp import web

from areal_lite.api.config import LocalEngineConfig
from areal_lite.cpu import freeze_startup_objects
from areal_lite.engines.local.scheduler import Scheduler
from areal_lite.engines.server.common import BadRequest, ServerState, error_response
from areal_lite.engines.server.generate_routes import GenerateRoute
from areal_lite.engines.server.lora_routes import LoRARoutes
from areal_lite.engines.server.openai_routes import OpenAIRoutes
from areal_lite.engines.server.responses_routes import ResponsesRoute
from areal_lite.engines.server.server_args import ServerArgs, parse_args
from areal_lite.engines.server.sglang_routes import SGLangRoutes
from areal_lite.engines.server.tokenizer_routes import TokenizerRoutes
from areal_lite.engines.server.tokens_routes import TokensRoute
from areal_lite.engines.server.vllm_routes import VLLMRoutes

logger = logging.getLogger("areal_lite.server")

OPEN_PATHS = ("/health", "/ready", "/metrics")
"""Paths that need no API key (as in SGLang)."""

SWITCH_INTERVAL_S = 0.0005
"""The interpreter's thread switch interval in the server process (see `main`)."""


class Server:
    """The web application over the embedded engine's `Scheduler`: every family of routes, and the
    middleware that checks the API key and answers every error with OpenAI's error object."""

    def __init__(self, args: ServerArgs, scheduler: Scheduler) -> None:
        self.args = args
        self.scheduler = scheduler
        self.state = ServerState(weight_version=args.weight_version)

    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=1024**3)
        r = app.router
        GenerateRoute(self.scheduler, self.state, self.args.allow_auto_truncate).register(r)
        SGLangRoutes(self.args, self.scheduler, self.state).register(r)
        names = self.args.served_model_name or [self.args.model_path]
        openai_routes = OpenAIRoutes(self.scheduler, names)
        openai_routes.register(r)
        ResponsesRoute(openai_routes).register(r)
        TokenizerRoutes(openai_routes).register(r)
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
        server.state.ready = True
        logger.info("serving %s on http://%s:%d", args.model_path, args.host, args.port)

    async def on_shutdown(_: web.Application) -> None:
        server.state.ready = False
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
