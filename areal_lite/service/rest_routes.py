"""The routes of the SDK's ``RestClient``: training runs, their checkpoints and the sessions, listed
and read (checkpoints also deleted). They read the workdir (`areal_lite.service.runs.Storage`)
and the service's sessions, and queue nothing: no model is touched."""

from __future__ import annotations

import asyncio
import shutil
from concurrent.futures import Executor
from datetime import datetime, timezone
from typing import Literal

from aiohttp import web

from areal_lite.service import wire
from areal_lite.service.runs import Storage
from areal_lite.service.sessions import Session
from areal_lite.service.wire import BadRequest, error_response, json_response, str_field


class RestRoutes:
    """The ``RestClient``'s routes over ``storage`` and ``sessions``; a deletion runs on
    ``engine_thread``, in turn with the work that may be writing the checkpoint."""

    def __init__(self, storage: Storage, sessions: dict[str, Session], engine_thread: Executor) -> None:
        self.storage = storage
        self.sessions = sessions
        self.engine_thread = engine_thread

    def register(self, router: web.UrlDispatcher, prefix: str) -> None:
        router.add_get(f"{prefix}/training_runs", self.list_training_runs)
        router.add_get(f"{prefix}/training_runs/{{model_id}}", self.training_run)
        router.add_get(f"{prefix}/checkpoints", self.list_user_checkpoints)
        router.add_get(f"{prefix}/sessions", self.list_sessions)
        router.add_get(f"{prefix}/sessions/{{session_id}}", self.get_session)
        router.add_get(f"{prefix}/training_runs/{{model_id}}/checkpoints", self.list_checkpoints)
        router.add_delete(
            f"{prefix}/training_runs/{{model_id}}/checkpoints/{{checkpoint_id:.+}}", self.delete_checkpoint
        )
        router.add_post(f"{prefix}/weights_info", self.weights_info)

    def _training_run(self, model_id: str) -> dict[str, object]:
        info = self.storage.read_info(model_id)
        checkpoints = self.storage.checkpoints(model_id)
        last = {kind: c for c in checkpoints for kind in [c[1]]}
        return {
            "training_run_id": model_id,
            "base_model": info.base_model,
            "model_owner": "local",
            "is_lora": info.lora is not None,
            "lora_rank": None if info.lora is None else info.lora["rank"],
            "last_request_time": _iso(info.created),
            "last_checkpoint": _checkpoint(last["weights"]) if "weights" in last else None,
            "last_sampler_checkpoint": _checkpoint(last["sampler_weights"]) if "sampler_weights" in last else None,
            "user_metadata": {k: str(v) for k, v in info.user_metadata.items()},
        }

    async def training_run(self, request: web.Request) -> web.Response:
        return json_response(self._training_run(request.match_info["model_id"]))

    async def list_training_runs(self, request: web.Request) -> web.Response:
        ids = self.storage.run_ids()
        offset, limit = _page(request, 20)
        page = [self._training_run(m) for m in ids[offset : offset + limit]]
        return json_response({"training_runs": page, "cursor": _cursor(offset, limit, len(ids))})

    async def list_user_checkpoints(self, request: web.Request) -> web.Response:
        every = sorted(
            (c for m in self.storage.run_ids() for c in self.storage.checkpoints(m)), key=lambda c: c[2], reverse=True
        )  # newest first, as Tinker lists them
        offset, limit = _page(request, 100)
        page = [_checkpoint(c) for c in every[offset : offset + limit]]
        return json_response({"checkpoints": page, "cursor": _cursor(offset, limit, len(every))})

    async def list_sessions(self, request: web.Request) -> web.Response:
        offset, limit = _page(request, 20)
        return json_response({"sessions": list(self.sessions)[offset : offset + limit]})

    async def get_session(self, request: web.Request) -> web.Response:
        session = self.sessions.get(request.match_info["session_id"])
        if session is None:
            return error_response("no such session", 404)
        return json_response({"training_run_ids": session.runs, "sampler_ids": session.samplers})

    async def list_checkpoints(self, request: web.Request) -> web.Response:
        model_id = request.match_info["model_id"]
        self.storage.read_info(model_id)
        return json_response({"checkpoints": [_checkpoint(c) for c in self.storage.checkpoints(model_id)]})

    async def delete_checkpoint(self, request: web.Request) -> web.Response:
        model_id, checkpoint_id = request.match_info["model_id"], request.match_info["checkpoint_id"]
        _, _, directory = self.storage.resolve(f"tinker://{model_id}/{checkpoint_id}")
        await asyncio.get_running_loop().run_in_executor(self.engine_thread, shutil.rmtree, directory)
        return json_response({})

    async def weights_info(self, request: web.Request) -> web.Response:
        info, _, _ = self.storage.resolve(str_field(wire.json_object(await request.read()), "tinker_path"))
        lora = info.lora or {}
        return json_response(
            {
                "base_model": info.base_model,
                "is_lora": info.lora is not None,
                "lora_rank": lora.get("rank"),
                **{flag: lora.get(flag, True) for flag in ("train_mlp", "train_attn", "train_unembed") if info.lora},
            }
        )


def _page(request: web.Request, default_limit: int) -> tuple[int, int]:
    """``(offset, limit)`` of a listing's query string."""
    try:
        offset, limit = int(request.query.get("offset", 0)), int(request.query.get("limit", default_limit))
    except ValueError as e:
        raise BadRequest(f"offset and limit must be integers: {e}") from e
    if offset < 0 or limit < 0:
        raise BadRequest("offset and limit must be >= 0")
    return offset, limit


def _cursor(offset: int, limit: int, total: int) -> dict[str, int]:
    return {"offset": offset, "limit": limit, "total_count": total}


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat()


def _checkpoint(c: tuple[str, str, float]) -> dict[str, object]:
    path, kind, mtime = c
    types: dict[str, Literal["training", "sampler", "external"]] = {
        "weights": "training",
        "sampler_weights": "sampler",
        "external_weights": "external",
    }
    return {
        "checkpoint_id": path.split("/", 3)[3],
        "checkpoint_type": types[kind],
        "time": _iso(mtime),
        "tinker_path": path,
    }
