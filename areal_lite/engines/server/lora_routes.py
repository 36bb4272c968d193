"""SGLang's LoRA adapter routes on our server (docs/protocol.md, "LoRA adapters").

- ``POST /load_lora_adapter {"lora_name", "lora_path"}``: load a PEFT adapter directory;
- ``POST /unload_lora_adapter {"lora_name"}``: put the base weights back;
- ``POST /register_lora_adapter {"lora_name", "config_dict"}``: hold an adapter of that PEFT config
  with zero weights, whose tensors a broadcast then sends as ``<lora_name>:<tensor name>``;
- ``lora_path`` on ``/generate`` names the adapter a request uses (`check_lora_path`).

Each answers SGLang's shape, ``{"success", "error_message", "loaded_adapters": {name: path}}``,
200 or 400. The server holds one adapter at a time, merged into its weights
(`areal_lite.engines.local.adapter_slot`), so it serves every request with the loaded adapter, whether
or not the request names it; loading an adapter under the loaded one's name replaces it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future

from aiohttp import web

from areal_lite.engines.local.scheduler import Scheduler
from areal_lite.engines.server.common import BadRequest, bool_field, read_json


def _name(body: dict[str, object], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{key} must be a non-empty string")
    return value


def check_lora_path(value: object, n_prompts: int, loaded: str | None) -> None:
    """BadRequest unless ``lora_path`` (absent, a name, or one name or null per prompt) names only
    the loaded adapter."""
    names = value if isinstance(value, list) else [value]
    if isinstance(value, list) and len(value) != n_prompts:
        raise BadRequest(f"lora_path has {len(value)} entries for {n_prompts} prompts")
    for name in names:
        if name is not None and not isinstance(name, str):
            raise BadRequest("lora_path must be an adapter name, or a list of names (or nulls), one per prompt")
        if name is not None and name != loaded:
            raise BadRequest(f"LoRA adapter {name!r} is not loaded (loaded: {loaded or 'none'})")


class LoRARoutes:
    """The LoRA routes over the embedded engine's `Scheduler`."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_post("/load_lora_adapter", self.load)
        router.add_post("/unload_lora_adapter", self.unload)
        router.add_post("/register_lora_adapter", self.register_adapter)

    async def _answer(self, op: Callable[[], Future[None]]) -> web.Response:
        """Run ``op`` and wait for it off the event loop; SGLang's answer either way."""
        try:
            await asyncio.get_running_loop().run_in_executor(None, lambda: op().result())
        except ValueError as e:
            ok, message, status = False, str(e), 400
        else:
            ok, message, status = True, "", 200
        loaded = self.scheduler.adapter.loaded
        return web.json_response({"success": ok, "error_message": message, "loaded_adapters": loaded}, status=status)

    async def load(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        name, path = _name(body, "lora_name"), _name(body, "lora_path")
        bool_field(body, "pinned", False)  # SGLang keeps pinned adapters on the GPU; one adapter here
        return await self._answer(lambda: self.scheduler.weights.load_adapter_from_disk(name, path))

    async def unload(self, request: web.Request) -> web.Response:
        name = _name(await read_json(request), "lora_name")
        return await self._answer(lambda: self.scheduler.weights.unload_adapter(name))

    async def register_adapter(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        name, config = _name(body, "lora_name"), body.get("config_dict")
        if not isinstance(config, dict):
            raise BadRequest("config_dict must be the adapter's PEFT config (an object)")
        return await self._answer(lambda: self.scheduler.weights.register_adapter(name, config))
