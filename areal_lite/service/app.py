"""The Tinker API over aiohttp: sessions, training runs, samplers and futures.

Routes are those the ``tinker`` SDK calls (``/api/v1/...``; bodies in `areal_lite.service.wire`;
the ``RestClient``'s listings of runs, checkpoints and sessions in `areal_lite.service.rest_routes`).
Handlers only parse and queue work: every call that touches a model runs on one engine thread
(`concurrent.futures.ThreadPoolExecutor` of one worker, `areal_lite.service.futures.launch`), in
the order each training client numbered its requests (`areal_lite.service.futures.Sequencer`),
and its result waits in a future for ``retrieve_future``. A training call's error never fails its
HTTP request: the request is accepted (it holds a place in the client's order) and its future fails
with ``{error, category}``, ``user`` for what the caller sent wrong, ``server`` otherwise.
So a training call's checks (a checkpoint that does not exist, a bad name, its data) run in its
turn, not in its handler: refused there, it would leave a gap in the order that every later
request of the client waits on.

Sessions end when the client says so (``/sessions/{id}/finish``) or after ``session_timeout``
seconds without a heartbeat or request; their runs' adapters or engines and their samplers are then
released. Checkpoints stay on disk.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from areal_lite.service import wire
from areal_lite.service.config import ServiceConfig
from areal_lite.service.futures import Failed, Futures, Sequencer, launch
from areal_lite.service.rest_routes import RestRoutes
from areal_lite.service.runs import BaseModel, Run, RunInfo, Snapshot, Storage, snapshot_from_checkpoint
from areal_lite.service.sampler import SamplingParams
from areal_lite.service.samplers import Samplers, SamplerSession
from areal_lite.service.sessions import Session
from areal_lite.service.wire import BadRequest, error_response, int_field, json_response, str_field
from areal_lite.utils.distributed import destroy_default_group, init_default_group

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Service:
    """The state behind the routes. See the module docstring."""

    def __init__(self, cfg: ServiceConfig) -> None:
        if not cfg.models:
            raise ValueError("the service needs at least one base model (--model NAME=PATH)")
        self.cfg = cfg
        self.storage = Storage(cfg.workdir)
        self.bases = {name: BaseModel(name, path, cfg) for name, path in cfg.models.items()}
        self.sessions: dict[str, Session] = {}
        self.runs: dict[str, Run] = {}
        self.samplers = Samplers(cfg, self.bases, self.storage)
        self.futures = Futures()
        self.sequencers: dict[str, Sequencer] = {}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-engine")
        self._ids = 0

    # ---------------------------------------------------------------- plumbing

    def build_app(self) -> web.Application:
        # Bodies are decompressed here (`wire.decompress`): aiohttp's own zstd needs a package
        # the SDK does not bring (it brings `zstandard`).
        app = web.Application(
            middlewares=[self._middleware], client_max_size=1 << 30, handler_args={"auto_decompress": False}
        )
        post, get = app.router.add_post, app.router.add_get
        v1 = "/api/v1"
        get(f"{v1}/healthz", self.healthz)
        get(f"{v1}/get_server_capabilities", self.capabilities)
        post(f"{v1}/client/config", self.client_config)
        post(f"{v1}/client/dynamic_config", self.dynamic_config)
        post(f"{v1}/telemetry", self.telemetry)
        post(f"{v1}/create_session", self.create_session)
        post(f"{v1}/session_heartbeat", self.heartbeat)
        post(f"{v1}/sessions/{{session_id}}/finish", self.finish_session)
        post(f"{v1}/create_model", self.create_model)
        post(f"{v1}/get_info", self.get_info)
        post(f"{v1}/forward_backward", self.forward_backward)
        post(f"{v1}/forward", self.forward)
        post(f"{v1}/optim_step", self.optim_step)
        post(f"{v1}/save_weights", self.save_weights)
        post(f"{v1}/save_weights_for_sampler", self.save_weights_for_sampler)
        post(f"{v1}/save_weights_external", self.save_weights_external)
        post(f"{v1}/load_weights", self.load_weights)
        post(f"{v1}/create_sampling_session", self.create_sampling_session)
        post(f"{v1}/join_sampling_session", self.join_sampling_session)
        get(f"{v1}/samplers/{{sampler_id}}", self.get_sampler)
        post(f"{v1}/asample", self.asample)
        post(f"{v1}/retrieve_future", self.retrieve_future)
        post(f"{v1}/cancel_future", self.cancel_future)
        RestRoutes(self.storage, self.sessions, self.pool).register(app.router, v1)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        key = self.cfg.api_key
        if key is not None and request.path != "/api/v1/healthz" and request.headers.get("X-API-Key") != key:
            return error_response("invalid or missing API key (X-API-Key)", 401)
        try:
            return await handler(request)
        except BadRequest as e:
            return error_response(str(e))
        except KeyError as e:
            return error_response(str(e.args[0]) if e.args else "not found", 404)

    async def _start(self, app: web.Application) -> None:
        # The process group every engine joins, owned by the service: an engine that created it
        # would end it when released (a run's session ending) under the engines still in use.
        await asyncio.get_running_loop().run_in_executor(self.pool, init_default_group)
        self._reaper = asyncio.create_task(self._reap())

    async def _stop(self, app: web.Application) -> None:
        self._reaper.cancel()
        await asyncio.get_running_loop().run_in_executor(self.pool, destroy_default_group)
        self.pool.shutdown(wait=True, cancel_futures=True)

    def _new_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}{self._ids}-{int(time.time() * 1000) % 10**8}"

    def _session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise KeyError(f"no session {session_id!r}")
        if session.finished:
            raise BadRequest(f"session {session_id} has finished")
        session.last_seen = time.monotonic()
        return session

    def _run(self, model_id: str) -> Run:
        run = self.runs.get(model_id)
        if run is None:
            raise BadRequest(f"no training run {model_id!r} is loaded (its session ended, or it was never created)")
        self._session(model_id.split(":train:")[0]).last_seen = time.monotonic()
        return run

    def _sequenced(self, model_id: str, seq_id: int, fn: Callable[[], object]) -> web.Response:
        """Queue ``fn`` as request ``seq_id`` of ``model_id``; the answer a submitting call gets."""
        pending = self.futures.create(model_id)
        sequencer = self.sequencers.setdefault(model_id, Sequencer())
        try:
            answer = sequencer.submit(seq_id, pending, lambda: launch(self.pool, pending, fn))
        except ValueError as e:
            raise BadRequest(str(e)) from e
        return json_response(answer.answer())

    async def _reap(self) -> None:
        """End idle sessions and forget old results, now and then."""
        while True:
            await asyncio.sleep(min(30.0, self.cfg.session_timeout / 4))
            now = time.monotonic()
            for session in list(self.sessions.values()):
                if not session.finished and now - session.last_seen > self.cfg.session_timeout:
                    logger.info("session %s timed out", session.session_id)
                    await self._end_session(session)
            self.futures.expire(self.cfg.result_ttl)

    async def _end_session(self, session: Session) -> None:
        session.finished = True
        self.futures.cancel_all(set(session.runs), f"session {session.session_id} has ended")

        def release() -> None:
            for model_id in session.runs:
                run = self.runs.pop(model_id, None)
                if run is not None:
                    run.close()
            for sid in session.samplers:
                self.samplers.drop(sid)
            session.recorded.clear()

        await asyncio.get_running_loop().run_in_executor(self.pool, release)

    # ---------------------------------------------------------------- service and sessions

    async def healthz(self, request: web.Request) -> web.Response:
        return json_response({"status": "ok"})

    async def capabilities(self, request: web.Request) -> web.Response:
        models = [
            {"model_name": b.name, "max_context_length": b.max_len, "trainable": True, "sampleable": True}
            for b in self.bases.values()
        ]
        return json_response({"supported_models": models})

    async def client_config(self, request: web.Request) -> web.Response:
        # The flags the SDK reads before anything else: plain API keys, our protobuf bodies, and
        # the features this service does not have turned off.
        return json_response(
            {
                "pjwt_auth_enabled": False,
                "proto_compress_fwdbwd": self.cfg.compress_requests,
                "parallel_fwdbwd_chunks": True,
                "sample_use_retrieve_futures": False,
                "custom_loss_server_side": False,
                "sample_join_sampling_session": False,
                "use_pyqwest_transport": False,
            }
        )

    async def dynamic_config(self, request: web.Request) -> web.Response:
        return json_response({"sample_cancel_enabled": True})

    async def telemetry(self, request: web.Request) -> web.Response:
        return json_response({"status": "accepted"})

    async def create_session(self, request: web.Request) -> web.Response:
        await request.read()
        session = Session(self._new_id("session-"))
        self.sessions[session.session_id] = session
        logger.info("session %s started", session.session_id)
        return json_response({"type": "create_session", "session_id": session.session_id})

    async def heartbeat(self, request: web.Request) -> web.Response:
        session_id = str_field(wire.json_object(await request.read()), "session_id")
        session = self.sessions.get(session_id)
        if session is None:
            return error_response(f"no session {session_id!r}", 404)
        if session.finished:
            return error_response(f"session {session_id} has finished", 410)
        session.last_seen = time.monotonic()
        return json_response({"type": "session_heartbeat"})

    async def finish_session(self, request: web.Request) -> web.Response:
        session = self.sessions.get(request.match_info["session_id"])
        if session is None:
            return error_response("no such session", 404)
        if not session.finished:
            await self._end_session(session)
        return json_response({})

    # ---------------------------------------------------------------- models

    def _base(self, name: str) -> BaseModel:
        if name not in self.bases:
            raise BadRequest(f"base model {name!r} is not served here; this service serves {', '.join(self.bases)}")
        return self.bases[name]

    async def create_model(self, request: web.Request) -> web.Response:
        body = wire.json_object(await request.read())
        session = self._session(str_field(body, "session_id"))
        model_id = f"{session.session_id}:train:{int_field(body, 'model_seq_id')}"
        base = self._base(str_field(body, "base_model"))
        optimizer = body.get("optimizer_config") or {}
        if isinstance(optimizer, dict) and optimizer.get("type", "adamw") != "adamw":
            raise BadRequest(f"optimizer {optimizer.get('type')!r} is not supported: this service trains with AdamW")
        lora = body.get("lora_config")
        if lora is not None:
            if not isinstance(lora, dict) or int_field(lora, "rank") < 1:
                raise BadRequest("lora_config.rank must be an integer >= 1")
            lora = {**lora, "alpha": self.cfg.lora_alpha}
        info = RunInfo(model_id, base.name, lora, dict(body.get("user_metadata") or {}))  # type: ignore[arg-type]
        info.lora_config()  # checks the targets now
        pending = self.futures.create(model_id)
        session.runs.append(model_id)

        def create() -> dict[str, object]:
            self.runs[model_id] = Run(info, base, self.storage)
            logger.info("run %s: %s, %s", model_id, base.name, f"LoRA rank {lora['rank']}" if lora else "full")
            return {"type": "create_model", "model_id": model_id}

        launch(self.pool, pending, create)
        return json_response(pending.answer())

    async def get_info(self, request: web.Request) -> web.Response:
        model_id = str_field(wire.json_object(await request.read()), "model_id")
        run = self.runs.get(model_id)
        info = run.info if run is not None else self.storage.read_info(model_id)
        base = self._base(info.base_model)
        return json_response(
            {
                "type": "get_info",
                "model_id": model_id,
                "model_name": base.name,
                "model_data": {"arch": base.arch, "model_name": base.name, "tokenizer_id": base.path},
                "is_lora": info.lora is not None,
                "lora_rank": None if info.lora is None else info.lora["rank"],
            }
        )

    # ---------------------------------------------------------------- training

    async def _fwdbwd(self, request: web.Request, forward_only: bool) -> web.Response:
        body = wire.decompress(await request.read(), request.headers.get("Content-Encoding"))
        call = wire.forward_backward_call(body, request.headers.get("Content-Type", ""), forward_only)
        run = self._run(call.model_id)
        session = self.sessions[call.model_id.split(":train:")[0]]
        return self._sequenced(call.model_id, call.seq_id, lambda: run.forward_backward(call, session.recorded))

    async def forward_backward(self, request: web.Request) -> web.Response:
        return await self._fwdbwd(request, forward_only=False)

    async def forward(self, request: web.Request) -> web.Response:
        return await self._fwdbwd(request, forward_only=True)

    async def optim_step(self, request: web.Request) -> web.Response:
        body = wire.json_object(await request.read())
        model_id = str_field(body, "model_id")
        run = self._run(model_id)
        params = body.get("adam_params") or body.get("optim_params") or body.get("optimizer_params")

        def step() -> dict[str, object]:
            if not isinstance(params, dict):
                raise BadRequest("optim_step needs adam_params")
            return {"metrics": run.optim_step(params)}

        return self._sequenced(model_id, int_field(body, "seq_id"), step)

    async def save_weights(self, request: web.Request) -> web.Response:
        body = wire.json_object(await request.read())
        model_id = str_field(body, "model_id")
        run = self._run(model_id)
        name = str(body.get("path") or self._new_id("state-"))
        overwrite = bool(body.get("overwrite", False))

        def save() -> dict[str, object]:
            path, directory = self.storage.checkpoint(model_id, "weights", name)
            _fresh(directory, path, overwrite)
            run.save_state(directory)
            return {"type": "save_weights", "path": path}

        return self._sequenced(model_id, int_field(body, "seq_id"), save)

    async def save_weights_external(self, request: web.Request) -> web.Response:
        body = wire.json_object(await request.read())
        model_id = str_field(body, "model_id")
        run = self._run(model_id)

        def save() -> dict[str, object]:
            path, directory = self.storage.checkpoint(model_id, "external_weights", str_field(body, "path"))
            _fresh(directory, path, overwrite=False)
            run.save_external(directory)
            return {"type": "save_weights_external", "path": path, "size_bytes": _size(directory)}

        return self._sequenced(model_id, int_field(body, "seq_id"), save)

    async def save_weights_for_sampler(self, request: web.Request) -> web.Response:
        body = wire.json_object(await request.read())
        model_id = str_field(body, "model_id")
        run = self._run(model_id)
        session = self.sessions[model_id.split(":train:")[0]]
        name = body.get("path")

        def unnamed() -> dict[str, object]:
            sid = f"{session.session_id}:sample:{int_field(body, 'sampling_session_seq_id')}"
            # kind="inflight" gets a snapshot too: its contract (the saved weights or newer) holds.
            self._add_sampler(SamplerSession(sid, session.session_id, run.snapshot(None), sid), run.info.model_id)
            return {"type": "save_weights_for_sampler", "sampling_session_id": sid}

        def named() -> dict[str, object]:
            path, directory = self.storage.checkpoint(model_id, "sampler_weights", str(name))
            _fresh(directory, path, overwrite=False)
            run.snapshot(directory)
            return {"type": "save_weights_for_sampler", "path": path}

        return self._sequenced(model_id, int_field(body, "seq_id"), unnamed if name is None else named)

    def _training_checkpoint(self, body: dict[str, object]) -> tuple[RunInfo, str]:
        """The run and directory of the training checkpoint ``body["path"]`` names."""
        source, kind, directory = self.storage.resolve(str_field(body, "path"))
        if kind != "weights":
            raise BadRequest(f"load a training checkpoint (tinker://<run>/weights/<name>), not {kind}")
        return source, directory

    async def load_weights(self, request: web.Request) -> web.Response:
        body = wire.json_object(await request.read())
        with_optimizer = bool(body.get("optimizer", False))
        path = str(body.get("path"))
        if body.get("model_id") is not None:  # into an existing run, as its next request
            model_id = str_field(body, "model_id")
            run = self._run(model_id)

            def load() -> dict[str, object]:
                run.load_state(*self._training_checkpoint(body), with_optimizer)
                return {"type": "load_weights", "path": path, "model_id": model_id}

            return self._sequenced(model_id, int_field(body, "seq_id"), load)
        source, directory = self._training_checkpoint(body)
        # A new run made from the checkpoint: its first request.
        session = self._session(str_field(body, "session_id"))
        model_id = f"{session.session_id}:train:{int_field(body, 'model_seq_id')}"
        base = self._base(str(body.get("base_model") or source.base_model))
        info = RunInfo(model_id, base.name, source.lora, dict(body.get("user_metadata") or {}))  # type: ignore[arg-type]
        pending = self.futures.create(model_id)
        session.runs.append(model_id)

        def create_and_load() -> dict[str, object]:
            run = Run(info, base, self.storage)
            try:
                run.load_state(source, directory, with_optimizer)
            except BaseException:
                run.close()
                raise
            self.runs[model_id] = run
            return {"type": "load_weights", "path": path, "model_id": model_id}

        launch(self.pool, pending, create_and_load)
        return json_response(pending.answer())

    # ---------------------------------------------------------------- sampling

    def _add_sampler(self, sampler: SamplerSession, unnamed_of: str | None = None) -> None:
        """Register ``sampler`` with its session (engine thread)."""
        self.samplers.add(sampler, unnamed_of)
        session = self.sessions.get(sampler.session_id)
        if session is not None:
            session.samplers.append(sampler.sampling_session_id)

    async def create_sampling_session(self, request: web.Request) -> web.Response:
        body = wire.json_object(await request.read())
        session = self._session(str_field(body, "session_id"))
        sid = f"{session.session_id}:sample:{int_field(body, 'sampling_session_seq_id')}"
        model_path = body.get("model_path")
        if model_path:
            info, kind, directory = self.storage.resolve(str(model_path))
            self._base(info.base_model)
            snapshot = snapshot_from_checkpoint(info, kind, directory)
            key = f"{info.model_id}/{kind}/{directory.rsplit('/', 1)[-1]}"
        else:
            snapshot = Snapshot(self._base(str_field(body, "base_model")).name, "base")
            key = f"base:{snapshot.base}"
        sampler = SamplerSession(sid, session.session_id, snapshot, key, str(model_path) if model_path else None)
        await asyncio.get_running_loop().run_in_executor(self.pool, self._add_sampler, sampler)
        return json_response({"type": "create_sampling_session", "sampling_session_id": sid})

    async def join_sampling_session(self, request: web.Request) -> web.Response:
        sid = str_field(wire.json_object(await request.read()), "sampling_session_id")
        sampler = self.samplers.get(sid)
        if sampler is None:
            raise KeyError(f"no sampling session {sid!r}")
        sampler.clients += 1
        return json_response({"type": "join_sampling_session", "client_counter": sampler.clients - 1})

    async def get_sampler(self, request: web.Request) -> web.Response:
        sid = request.match_info["sampler_id"]
        sampler = self.samplers.get(sid)
        if sampler is None:
            raise KeyError(f"no sampling session {sid!r}")
        return json_response({"sampler_id": sid, "base_model": sampler.snapshot.base, "model_path": sampler.model_path})

    async def asample(self, request: web.Request) -> web.Response:
        body = wire.json_object(await request.read())
        sid = body.get("sampling_session_id")
        if not isinstance(sid, str) or self.samplers.get(sid) is None:
            raise BadRequest(
                f"no sampling session {sid!r}: create one with create_sampling_client (or it was released: "
                f"unnamed snapshots are kept for a run's last few saves only)"
            )
        sampler = self.samplers.get(sid)
        assert sampler is not None
        session = self._session(sampler.session_id)
        prompt = wire.model_input_tokens(body.get("prompt"))
        raw = body.get("sampling_params") or {}
        if not isinstance(raw, dict):
            raise BadRequest("sampling_params must be an object")
        params = SamplingParams.from_request(raw, body)
        n = int_field(body, "num_samples", 1)
        record = bool(body.get("record_stability_info"))
        pending = self.futures.create()
        seq = body.get("seq_id", pending.request_id)
        pending.sample_sequence_ids = [f"{sid}:{seq}:{i}" for i in range(n)]

        def sample() -> wire.Samples:
            if self.samplers.get(sid) is None:
                raise BadRequest(f"sampling session {sid} was released")
            gen, adapter = self.samplers.generator(sampler)
            samples = gen.sample(prompt, n, params, adapter)
            if record:
                session.record(pending.sample_sequence_ids or [], prompt, samples)
            return samples

        launch(self.pool, pending, sample)
        return json_response(pending.answer())

    # ---------------------------------------------------------------- futures

    async def retrieve_future(self, request: web.Request) -> web.Response:
        body = wire.json_object(await request.read())
        request_id = str_field(body, "request_id")
        pending = self.futures.get(request_id)
        if pending is None:
            raise KeyError(f"no request {request_id!r} (unknown, or its result expired)")
        owner = self.sessions.get((pending.model_id or "").split(":train:")[0])
        if owner is not None and not owner.finished:
            owner.last_seen = time.monotonic()  # waiting on a run's result is activity too
        try:
            result = await asyncio.wait_for(asyncio.shield(pending.future), self.cfg.poll_timeout)
        except asyncio.TimeoutError:
            return json_response({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        except Failed as e:
            return json_response({"error": str(e), "category": e.category})
        proto = wire.PROTOBUF in request.headers.get("Accept", "")
        if isinstance(result, wire.ForwardBackwardResult):
            if proto:
                return web.Response(body=wire.forward_backward_proto(result), content_type=wire.PROTOBUF)
            return json_response(wire.forward_backward_json(result))
        if isinstance(result, wire.Samples):
            if proto:
                return web.Response(body=wire.samples_proto(result), content_type=wire.PROTOBUF)
            return json_response(wire.samples_json(result))
        return json_response(result)

    async def cancel_future(self, request: web.Request) -> web.Response:
        body = wire.json_object(await request.read())
        pending = self.futures.get(str(body.get("request_id")))
        if pending is not None and pending.model_id is None:  # a sample; training requests keep their order
            pending.finish(error=Failed("cancelled by the client", "user"))
        return json_response({})


def _fresh(directory: str, path: str, overwrite: bool) -> None:
    if os.path.exists(directory):
        if not overwrite:
            raise BadRequest(f"a checkpoint {path} exists already (pass overwrite=True to replace it)")
        shutil.rmtree(directory)


def _size(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files)
