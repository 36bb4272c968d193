"""vLLM's RL control routes on our server, so that `RemoteVLLMEngine` is tested against a real HTTP
server where vLLM cannot run (docs/protocol.md, "The vLLM protocol").

- ``POST /pause?mode=abort|keep`` (vLLM's names for our ``abort`` and ``in_place``), ``POST
  /resume``, ``GET /is_paused``;
- ``POST /collective_rpc {"method", "args"}`` for the methods of our vLLM worker extension
  (`areal_lite.engines.remote.vllm_worker`), applied to the scheduler: join / leave the weight-update
  group, receive a broadcast, load a checkpoint directory. Answers ``{"results": [null]}`` (one
  worker);
- ``POST /reset_prefix_cache``: our engine keeps no prefix cache between requests, so there is
  nothing to drop.

Differences from vLLM: ``mode=wait`` is refused; a call's bad arguments are a 400 (vLLM answers a
failed RPC with a 500); the weight version is the client's business (vLLM does not tag tokens).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from areal_lite.api.io import WeightUpdateMeta
from areal_lite.engines.local.scheduler import Scheduler
from areal_lite.engines.remote.vllm_worker import (
    JOIN_GROUP,
    LEAVE_GROUP,
    LOAD_FROM_DISK,
    METHODS,
    RECEIVE,
    BroadcastSpec,
    GroupSpec,
    model_path_arg,
)
from areal_lite.engines.server.common import BadRequest, read_json

PAUSE_MODES = {"abort": "abort", "keep": "in_place"}
"""vLLM's pause modes and the scheduler's names for them."""


class VLLMRoutes:
    """Handlers of vLLM's control routes over the server's `Scheduler` (``device`` is where it runs)."""

    def __init__(self, scheduler: Scheduler, device: str) -> None:
        self.scheduler = scheduler
        self.device = device

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_post("/pause", self.pause)
        router.add_post("/resume", self.resume)
        router.add_get("/is_paused", self.is_paused)
        router.add_post("/collective_rpc", self.collective_rpc)
        router.add_post("/reset_prefix_cache", self.reset_prefix_cache)

    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise BadRequest(f"mode must be abort or keep on the areal-lite server, got {mode!r}")
        await asyncio.get_running_loop().run_in_executor(None, self.scheduler.pause_generation, PAUSE_MODES[mode])
        return web.json_response({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        self.scheduler.continue_generation()
        return web.json_response({"status": "resumed"})

    async def is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.scheduler.paused})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def collective_rpc(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        method, args = body.get("method"), body.get("args", [])
        if method not in METHODS:
            raise BadRequest(f"method must be one of {', '.join(METHODS)} on the areal-lite server, got {method!r}")
        if not isinstance(args, list) or len(args) != 1 or not isinstance(args[0], str):
            raise BadRequest("args must hold one JSON object as a string")
        try:
            if method == JOIN_GROUP:
                await self._join(GroupSpec.parse(args[0]))
            elif method == RECEIVE:
                await self._receive(BroadcastSpec.parse(args[0]))
            elif method == LOAD_FROM_DISK:
                path = model_path_arg(args[0])
                await asyncio.wrap_future(self.scheduler.weights.load_weights_from_disk(path))
            else:
                assert method == LEAVE_GROUP
                self.scheduler.weights.destroy_weights_update_group()
        except ValueError as e:
            raise BadRequest(f"{method}: {e}") from e
        return web.json_response({"results": [None]})

    async def _join(self, spec: GroupSpec) -> None:
        if spec.backend == "nccl" and self.device == "cpu":
            raise ValueError("backend nccl needs a CUDA device; this server runs on CPU (use gloo)")
        meta = WeightUpdateMeta(
            type="distributed",
            master_address=spec.master_address,
            master_port=spec.master_port,
            world_size=spec.world_size,
            group_name=spec.group_name,
            backend=spec.backend,
        )
        await asyncio.wrap_future(self.scheduler.weights.join_weights_update_group(meta, spec.rank_offset))

    async def _receive(self, spec: BroadcastSpec) -> None:
        self.scheduler.weights.check_param_specs(spec.names, spec.dtypes, spec.shapes)
        await asyncio.wrap_future(self.scheduler.weights.receive_broadcast(spec.names, spec.dtypes, spec.shapes, None))
