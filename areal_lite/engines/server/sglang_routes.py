"""SGLang's routes on our server other than ``/generate`` (docs/protocol.md): health and
information (``/health``, ``/model_info``, ``/server_info``, ``/get_weight_version``), control of
running generations (``/abort_request``, ``/pause_generation``, ``/continue_generation``,
``/flush_cache``) and weight updates (from a checkpoint directory, broadcast by the trainer in a
process group, or handed over in memory by a trainer on this machine), with SGLang's payloads and
answers. Weight versions are integers here (as strings on the wire).

``/update_weights_from_tensor`` maps the sender's memory (`areal_lite.utils.tensor_handles`): it
answers only callers on this machine (a loopback peer, or one whose address is the address it
called), where those handles mean something; like ``/update_weights_from_disk`` with its path, it
otherwise trusts the caller it lets in (behind ``--api-key`` when one is set).
"""

from __future__ import annotations

import asyncio
import ipaddress

from aiohttp import web

from areal_lite.api.io import WeightUpdateMeta
from areal_lite.engines.local.scheduler import Scheduler
from areal_lite.engines.server.common import BadRequest, ServerState, bool_field, int_field, read_json
from areal_lite.engines.server.server_args import ServerArgs
from areal_lite.utils.tensor_handles import load_named_tensors


class SGLangRoutes:
    """SGLang's information, control and weight-update routes over the embedded engine's `Scheduler`;
    ``state`` holds the weight version they report and set, shared with ``/generate``."""

    def __init__(self, args: ServerArgs, scheduler: Scheduler, state: ServerState) -> None:
        self.args = args
        self.scheduler = scheduler
        self.state = state

    def register(self, router: web.UrlDispatcher) -> None:
        r = router
        r.add_get("/get_weight_version", self.get_weight_version)
        for path in ("/health", "/health_generate", "/ready"):
            r.add_get(path, self.health)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        r.add_post("/begin_weight_update", self.begin_weight_update)
        r.add_post("/end_weight_update", self.end_weight_update)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/update_weights_from_tensor", self.update_weights_from_tensor)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_route("*", "/get_weights_by_name", self.get_weights_by_name)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)

    # ----- running generations -------------------------------------------------------------

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        rid = body.get("rid", "")
        if not isinstance(rid, str):
            raise BadRequest("rid must be a string")
        abort_all = bool_field(body, "abort_all", False)
        if abort_all or rid:
            self.scheduler.abort(rid, abort_all=abort_all, message="aborted by /abort_request")
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            raise BadRequest(f"mode must be abort, in_place or retract, got {mode!r}")
        await asyncio.get_running_loop().run_in_executor(None, self.scheduler.pause_generation, mode)
        return web.json_response({"message": "Generation paused."})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await read_json(request)
        self.scheduler.continue_generation()
        return web.json_response({"message": "Generation continued."})

    # ----- info ----------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.state.ready else 503)

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.state.weight_version})

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.args.model_path,
                "tokenizer_path": self.args.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.state.weight_version,
                "context_length": self.scheduler.context_len,
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        """SGLang's answer: its arguments (never the API key), what the scheduler reports
        (``max_total_num_tokens``, ``max_req_input_len``), ``internal_states`` (one per data-parallel
        rank: ``last_gen_throughput``, which SGLang's benchmarks read) and ``version``."""
        args = self.args
        context = self.scheduler.context_len
        info: dict[str, object] = {k: v for k, v in vars(args).items() if k != "api_key"}
        info.update(
            served_model_name=(args.served_model_name or [args.model_path])[0],  # a string in SGLang
            tokenizer_path=args.model_path,
            skip_tokenizer_init=False,
            tp_size=1,
            dp_size=1,
            context_length=context,
            weight_version=self.state.weight_version,
            max_total_num_tokens=context * args.max_running_requests,  # a KV row of the context per request
            max_req_input_len=context - 1,
            internal_states=[{"last_gen_throughput": self.scheduler.gen_throughput}],
            version="areal-lite",
        )
        return web.json_response(info)

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.scheduler.num_running:
            return web.Response(status=400, text="Cache not flushed: requests are running.")
        return web.Response(status=200, text="Cache flushed.")

    # ----- weights -------------------------------------------------------------------------

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise BadRequest("model_path must be a non-empty string")
        if bool_field(body, "abort_all_requests", False):
            self.scheduler.abort(abort_all=True, message="aborted for a weight update")
        version = body.get("weight_version")
        v = self._version_int(version) if version is not None else None
        return await self._weight_op(lambda: self.scheduler.weights.load_weights_from_disk(path, v).result(), version)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        address = body.get("master_address")
        if not isinstance(address, str):
            raise BadRequest("master_address must be a string")
        backend = body.get("backend", "nccl")
        if backend == "nccl" and self.args.device == "cpu":
            raise BadRequest("backend nccl needs a CUDA device; this server runs on CPU (use gloo)")
        group_name = body.get("group_name", "weight_update_group")
        meta = WeightUpdateMeta(
            type="distributed",
            master_address=address,
            master_port=_port(body.get("master_port")),
            world_size=int_field(body, "world_size", 0),
            group_name=str(group_name),
            backend=str(backend),
        )
        rank = int_field(body, "rank_offset", 1)
        if not 0 < rank < meta.world_size:
            raise BadRequest(f"rank_offset {rank} must be in [1, world_size={meta.world_size})")
        try:
            await asyncio.wrap_future(self.scheduler.weights.join_weights_update_group(meta, rank))
        except (RuntimeError, ValueError, OSError) as e:  # e.g. the trainer never came: the store timed out
            return web.json_response({"success": False, "message": f"could not join the group: {e}"}, status=400)
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        await read_json(request)
        self.scheduler.weights.destroy_weights_update_group()
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        """SGLang >= 0.5.21 brackets distributed updates with begin/end. Here each update call is
        applied between two decode steps on its own, so the session needs no state; both calls
        are accepted so that clients of either SGLang generation work."""
        await read_json(request)
        return web.json_response({"success": True, "message": "Weight update session started."})

    async def end_weight_update(self, request: web.Request) -> web.Response:
        await read_json(request)
        return web.json_response({"success": True, "message": "Weight update session ended."})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not isinstance(names, list) or not isinstance(dtypes, list) or not isinstance(shapes, list):
            raise BadRequest("names, dtypes and shapes must be lists")
        if not all(
            isinstance(s, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in s) for s in shapes
        ):
            raise BadRequest("shapes must be lists of integers")
        if not all(isinstance(x, str) for x in names + dtypes):
            raise BadRequest("names and dtypes must be strings")
        try:
            self.scheduler.weights.check_param_specs(names, dtypes, shapes)
        except ValueError as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        if bool_field(body, "abort_all_requests", False):
            self.scheduler.abort(abort_all=True, message="aborted for a weight update")
        version = body.get("weight_version")
        v = self._version_int(version) if version is not None else None
        return await self._weight_op(
            lambda: self.scheduler.weights.receive_broadcast(names, dtypes, shapes, v).result(), version
        )

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        """SGLang's payload: ``serialized_named_tensors`` (one entry per tensor-parallel rank; this
        server has one and reads the first), ``load_format`` (None, or ``direct``: both mean a
        list of (name, tensor) here), ``weight_version``, ``abort_all_requests``, ``flush_cache``
        (the caches of running requests are recomputed anyway). Answers once the tensors are
        copied into the model, after which the sender may free its memory."""
        if not _from_this_machine(request):
            raise BadRequest(
                f"tensor handles resolve only on this server's machine; {request.remote} is another one: "
                "use /update_weights_from_disk or /update_weights_from_distributed",
                status=403,
            )
        body = await read_json(request)
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or not entries or not all(isinstance(e, str) for e in entries):
            raise BadRequest(
                "serialized_named_tensors must be a non-empty list of base64 strings, one per tensor-parallel rank",
                param="serialized_named_tensors",
            )
        load_format = body.get("load_format")
        if load_format not in (None, "direct"):
            message = f"load_format {load_format!r} is not served here: send null (a list of (name, tensor))"
            return web.json_response({"success": False, "message": message}, status=400)
        bool_field(body, "flush_cache", True)
        if bool_field(body, "abort_all_requests", False):
            self.scheduler.abort(abort_all=True, message="aborted for a weight update")
        version = body.get("weight_version")
        v = self._version_int(version) if version is not None else None

        def load() -> None:
            self.scheduler.weights.load_shared_tensors(load_named_tensors(entries[0]), v).result()

        return await self._weight_op(load, version)

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        v = self._version_int(body.get("new_version"))
        if bool_field(body, "abort_all_requests", True):
            self.scheduler.abort(abort_all=True, message="aborted for a weight version update")
        self.scheduler.version = v
        self.state.weight_version = str(v)
        return web.json_response({"success": True, "message": f"Weight version updated to {v}."})

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = dict(request.query) if request.method == "GET" else await read_json(request)
        name = body.get("name")
        if not isinstance(name, str):
            raise BadRequest("name must be a string")
        size = int(body.get("truncate_size", 100)) if request.method == "GET" else int_field(body, "truncate_size", 100)
        try:
            return web.json_response(self.scheduler.weights.get_weights_by_name(name, size))
        except ValueError as e:
            raise BadRequest(str(e)) from e

    def _version_int(self, value: object) -> int:
        try:
            return int(str(value))
        except ValueError as e:
            raise BadRequest(f"weight versions must be integers on an areal-lite server, got {value!r}") from e

    async def _weight_op(self, op, version: object) -> web.Response:
        """Run a blocking weight operation off the event loop; answer SGLang's success shape."""
        v = self._version_int(version) if version is not None else None
        try:
            await asyncio.get_running_loop().run_in_executor(None, op)
        except ValueError as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        if v is not None:
            self.state.weight_version = str(v)
        return web.json_response({"success": True, "message": "Succeeded to update model weights."})


def _from_this_machine(request: web.Request) -> bool:
    """Whether the caller runs on this machine: a loopback peer, or one whose address is the
    address of this server it called."""
    peer = request.remote
    if not peer:
        return False
    try:
        ip = ipaddress.ip_address(peer.partition("%")[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    if ip.is_loopback or (mapped is not None and mapped.is_loopback):
        return True
    local = request.transport.get_extra_info("sockname") if request.transport is not None else None
    return isinstance(local, tuple) and local[0] == peer


def _port(value: object) -> int:
    """A port as an integer or a string of digits: AReaL's client sends ``str(port)``, and SGLang's
    request model takes both."""
    if isinstance(value, str) and value.isdigit():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"master_port must be an integer, got {value!r}", param="master_port")
    return value
