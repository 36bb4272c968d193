"""Recording proxies over real HTTP, for agents that run in other processes (a verifiers harness,
a CLI agent): one aiohttp server on a loopback port serves any number of episodes'
`RecordingProxy` objects. Each is reached under a base URL of its own
(``http://127.0.0.1:PORT/<key>/v1``), or under the shared one (``http://127.0.0.1:PORT/v1``) by
naming its key as the request's ``model``: clients that keep one HTTP connection pool per base URL
(verifiers keeps one per endpoint config) then share one across episodes.

The server runs in the event loop of the workflows that register proxies (the rollout
controller's), so a proxy's calls reach ``engine.agenerate`` exactly as in-process calls do.
"""

from __future__ import annotations

import json
import uuid

from aiohttp import web

from areal_lite.workflows.openai_proxy import RecordingProxy


class ProxyServer:
    """An HTTP server holding the recording proxies of running episodes.

    `start` in the event loop the proxies' engine calls run in; `register` a proxy for the
    length of its episode (it returns the proxy's base URL), `unregister` it after; `stop` at the
    end. A request for a key no longer registered is a 404 in OpenAI's error shape.
    """

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port: int | None = None
        self._proxies: dict[str, RecordingProxy] = {}
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application(client_max_size=256 * 1024**2)
        app.router.add_route("*", "/{key}/{tail:.*}", self._route)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        # Port 0: the OS picks a free port at bind time (choosing one first races with other binds).
        await web.TCPSite(self._runner, self.host, 0).start()
        self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def base_url(self) -> str:
        """The shared base URL: a request names its episode's key as its ``model``."""
        if self.port is None:
            raise RuntimeError("start the proxy server first")
        return f"http://{self.host}:{self.port}/v1"

    def register(self, proxy: RecordingProxy) -> tuple[str, str]:
        """(key, base URL ending in ``/v1``) under which ``proxy`` answers; it also answers
        requests to `base_url` whose ``model`` is the key."""
        base = self.base_url
        key = f"episode-{uuid.uuid4().hex}"
        self._proxies[key] = proxy
        return key, f"{base.removesuffix('/v1')}/{key}/v1"

    def unregister(self, key: str) -> None:
        self._proxies.pop(key, None)

    async def _route(self, request: web.Request) -> web.Response:
        content = await request.read()
        key = request.match_info["key"]
        if key == "v1":  # the shared base URL: the episode is the request's model
            try:
                key = json.loads(content or b"{}").get("model") if request.method == "POST" else None
            except (json.JSONDecodeError, AttributeError):
                key = None
        proxy = self._proxies.get(key) if isinstance(key, str) else None
        if proxy is None:
            body = {"error": {"message": "no running episode at this address", "type": "invalid_request_error",
                              "param": None, "code": "unknown_url"}}  # fmt: skip
            return web.json_response(body, status=404)
        status, content_type, content = await proxy.handle(request.method, request.path, content)
        return web.Response(status=status, body=content, content_type=content_type)
