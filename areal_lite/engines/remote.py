"""The client of a fleet of SGLang-protocol servers (real SGLang on GPU nodes, or ours on CPU).

Generation: one async HTTP request per `agenerate` call (docs/protocol.md, ``/generate`` with
``input_ids``), over pooled connections; `agenerate_batch` (a GRPO group) sends its requests as
one batch request to one server, which saves most of the per-request cost on both sides. The
servers, the HTTP session and its event loop, routing and which servers are alive are the
`ServerFleet`'s (`areal_lite.engines.server_fleet`); this module is what the calls mean. A
generation that comes back aborted (the servers paused for a weight update) is resubmitted as
prompt + generated tokens with the remaining token budget, keeping every token's log-probability
and version; while this client keeps the servers paused it waits, so that hundreds of
resubmissions do not queue up on the paused servers and delay the weight update. When a server
fails (connection error, timeout, 5xx) the request is resent from its last known state to another
server, so a server dying loses no request and returns none twice. A server that refuses
connections is dead: it gets no more generation or control calls, and the rest of the fleet
carries on (a distributed weight update cannot: its process group counted the dead server).

A stop string that straddles two parts of a resumed generation is not seen (each part is checked
on its own), as with SGLang-based AReaL.

Control: pause / resume, weight updates (disk or distributed) and version updates fan out to every
server; weight updates pause generation around them unless the caller already did. A client built
with ``control_servers=False`` generates only: its pause, resume and version change what it does
with its own requests (aborted generations wait for the resume; tokens a server does not tag get
its version), while another client of the same servers (the trainer's) controls them. The
rollout controller's episode child uses one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import aiohttp

from areal_lite.api.config import InferenceEngineConfig
from areal_lite.api.engine import InferenceEngine
from areal_lite.api.io import ModelRequest, ModelResponse, WeightUpdateMeta
from areal_lite.engines.server_fleet import ServerError, ServerFleet
from areal_lite.utils.cpu import check_cores
from areal_lite.utils.gc_freeze import freeze_startup_objects

logger = logging.getLogger(__name__)


def _parse_version(value: object, fallback: int) -> int:
    try:
        return int(str(value))
    except ValueError:
        return fallback


@dataclass
class _Partial:
    """What a generation has produced so far, across resumptions and retries."""

    t0: float = field(default_factory=time.monotonic)
    out_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    ttft: float = 0.0

    def absorb(self, data: dict[str, object], fallback_version: int) -> str:
        """Append one ``/generate`` answer; returns its finish reason (``abort`` = resume)."""
        meta = data["meta_info"]
        assert isinstance(meta, dict)
        new_ids = list(data["output_ids"])  # type: ignore[call-overload]
        if new_ids and not self.out_ids:
            self.ttft = time.monotonic() - self.t0
        self.out_ids += new_ids
        self.logprobs += [float(x[0]) for x in meta["output_token_logprobs"]]
        server_versions = meta.get("output_token_versions")
        if server_versions is None or len(server_versions) != len(new_ids):
            server_versions = [_parse_version(meta.get("weight_version"), fallback_version)] * len(new_ids)
        self.versions += [int(v) for v in server_versions]
        return meta["finish_reason"]["type"] if meta.get("finish_reason") else "length"

    def response(self, req: ModelRequest, stop_reason: str) -> ModelResponse:
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=self.out_ids,
            output_logprobs=self.logprobs,
            output_versions=self.versions,
            stop_reason=stop_reason,  # type: ignore[arg-type]
            latency=time.monotonic() - self.t0,
            ttft=self.ttft,
            rid=req.rid,
        )


class RemoteSGLangEngine(InferenceEngine):
    """`InferenceEngine` over HTTP servers listed in ``config.addresses`` (``host:port``); with
    ``control_servers=False`` a client that generates but never pauses, updates or re-versions
    the servers (another client does)."""

    def __init__(self, config: InferenceEngineConfig, control_servers: bool = True) -> None:
        if not config.addresses:
            raise ValueError("RemoteSGLangEngine needs at least one server address (config.addresses)")
        check_cores(config.client_cores, "rollout.client_cores")
        self.config = config
        self.fleet = ServerFleet(config)
        self.control_servers = control_servers
        self._version = 0
        self._paused = False
        self._group_members: list[int] = []
        """The servers in the weight-update group (distributed updates), as ranks 1, 2, ..."""
        self._resumed = asyncio.Event()
        """Clear while this client is paused: generations aborted by the pause wait for it before
        they resume, instead of queueing on a paused server during the update. Used on the
        fleet's loop only."""
        self._resumed.set()

    # ----- lifecycle -----------------------------------------------------------------------

    def initialize(self) -> None:
        """Start the client loop and wait until every server is healthy."""
        self.fleet.start()
        self.fleet.call(self.fleet.wait_healthy()).result()
        freeze_startup_objects()

    def destroy(self) -> None:
        self.fleet.stop()
        self._resumed = asyncio.Event()  # a new loop would not take one bound to the old

    # ----- generation ----------------------------------------------------------------------

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        # Runs on the client loop, awaited from the caller's (cancelling one cancels the other).
        return await asyncio.wrap_future(self.fleet.call(self._generate(req)))

    async def agenerate_batch(self, reqs: list[ModelRequest]) -> list[ModelResponse]:
        if len(reqs) < 2 or any(r.gconfig != reqs[0].gconfig for r in reqs):
            return await super().agenerate_batch(reqs)
        return await asyncio.wrap_future(self.fleet.call(self._generate_batch(reqs)))

    def _payload(self, req: ModelRequest, part: _Partial) -> dict[str, object]:
        g = req.gconfig
        params = g.to_sglang()
        params["max_new_tokens"] = g.max_new_tokens - len(part.out_ids)
        params["min_new_tokens"] = max(0, g.min_new_tokens - len(part.out_ids))
        return {
            "input_ids": list(req.input_ids) + part.out_ids,
            "sampling_params": params,
            "return_logprob": True,
            "rid": req.rid,
        }

    async def _generate_batch(
        self, reqs: list[ModelRequest], parts: list[_Partial] | None = None
    ) -> list[ModelResponse]:
        """One batch ``/generate`` call to one server (SGLang's list forms of ``input_ids`` and
        ``rid``) for requests with the same remaining token budget. Requests that come back
        aborted continue after the resume, again as batch calls (one per remaining budget: the
        call has one ``sampling_params``), so that a pause in asynchronous RL, which aborts every
        group in flight, is not followed by one call per sample. If a call fails, its requests are
        retried one by one in `_generate`, from what they had produced before it."""
        if len(reqs) == 1 and parts is not None:
            return [await self._generate(reqs[0], parts[0])]
        parts = parts or [_Partial() for _ in reqs]
        payloads = [self._payload(r, p) for r, p in zip(reqs, parts)]
        payload = {
            "input_ids": [p["input_ids"] for p in payloads],
            "sampling_params": payloads[0]["sampling_params"],
            "return_logprob": True,
            "rid": [r.rid for r in reqs],
        }
        idx = self.fleet.choose(reqs[0].rid, set(), also=tuple(r.rid for r in reqs[1:]))
        data, error = await self._post_generate(idx, payload, count=len(reqs))
        if error is not None:
            return list(await asyncio.gather(*(self._generate(r, p) for r, p in zip(reqs, parts))))
        assert isinstance(data, list) and len(data) == len(reqs), "a batch request answers one result per prompt"
        out: list[ModelResponse | None] = [None] * len(reqs)
        by_budget: dict[int, list[int]] = {}  # aborted requests by tokens produced so far
        for i, (req, part, answer) in enumerate(zip(reqs, parts, data)):
            reason = part.absorb(answer, self._version)
            if reason != "abort":
                out[i] = part.response(req, reason)
            elif len(part.out_ids) >= req.gconfig.max_new_tokens:
                out[i] = part.response(req, "length")
            else:
                by_budget.setdefault(len(part.out_ids), []).append(i)
        if by_budget:
            await self._until_resumed()
            groups = list(by_budget.values())
            resumed = await asyncio.gather(
                *(self._generate_batch([reqs[i] for i in g], [parts[i] for i in g]) for g in groups)
            )
            for g, resps in zip(groups, resumed):
                for i, resp in zip(g, resps):
                    out[i] = resp
        assert all(r is not None for r in out)
        return out  # type: ignore[return-value]

    async def _post_generate(
        self, idx: int, payload: dict[str, object], count: int = 1
    ) -> tuple[object, BaseException | None]:
        """One ``/generate`` call to server ``idx`` (which `_choose` charged ``count`` requests):
        its answer, or the transport / server error it failed with (logged; a server refusing
        connections is marked dead). A 4xx answer is raised: no other server would take it."""
        error: BaseException | None = None
        data: object = None
        try:
            data = await self.fleet.request(idx, "/generate", payload, self.config.request_timeout)
        except (aiohttp.ClientError, asyncio.TimeoutError, ServerError) as e:
            if isinstance(e, ServerError) and e.status < 500:
                raise  # the request itself is bad
            error = e
        finally:  # also when cancelled
            self.fleet.release(idx, failed=error is not None, count=count)
        if error is not None:
            if isinstance(error, aiohttp.ClientConnectorError):
                self.fleet.mark_dead(idx, error)
            logger.warning(
                "generation on %s failed (%s: %s); retrying elsewhere",
                self.fleet.addresses[idx],
                type(error).__name__,
                error,
            )
        return data, error

    async def _generate(self, req: ModelRequest, part: _Partial | None = None) -> ModelResponse:
        """Generate until a stop or the token budget, resuming after aborts and retrying failed
        calls on other servers; ``part`` is what earlier calls produced."""
        part = part or _Partial()
        failures = 0
        failed_on: set[int] = set()
        while True:
            if len(part.out_ids) >= req.gconfig.max_new_tokens:
                return part.response(req, "length")
            idx = self.fleet.choose(req.rid, failed_on)
            data, error = await self._post_generate(idx, self._payload(req, part))
            if error is not None:
                failures += 1
                failed_on.add(idx)
                if len(failed_on) == len(self.fleet):
                    failed_on.clear()
                if failures >= self.config.request_retries:
                    raise RuntimeError(f"request {req.rid} failed {failures} times; last error: {error}") from error
                continue
            assert isinstance(data, dict)
            reason = part.absorb(data, self._version)
            if reason != "abort":
                return part.response(req, reason)
            # Aborted by a pause for a weight update: resume as prompt + generated.
            await self._until_resumed()

    async def _until_resumed(self) -> None:
        """Wait while this client keeps the servers paused (a no-op when the pause was not ours)."""
        await self._resumed.wait()

    async def _pause_servers(self) -> None:
        self._resumed.clear()  # before the aborted generations come back
        if not self.control_servers:
            return
        try:
            await self.fleet.fanout("/pause_generation", {"mode": self.config.pause_mode})
        except BaseException:
            self._resumed.set()
            raise

    async def _resume_servers(self) -> None:
        try:
            if self.control_servers:
                await self.fleet.fanout("/continue_generation", {})
        finally:
            self._resumed.set()

    # ----- weights and versions ------------------------------------------------------------

    def init_weights_update_group(self, meta: WeightUpdateMeta) -> Future[None]:
        """Every live server joins ``meta``'s group: the i-th as rank 1 + i of 1 + their number
        (``meta.world_size`` is set here). Called again after a member died, it first asks the
        live servers to leave the old group."""
        live = self.fleet.live()
        if not live:
            raise RuntimeError("no rollout server is reachable to form a weight-update group with")
        meta.world_size = 1 + len(live)
        payloads: list[dict[str, object]] = [{} for _ in range(len(self.fleet))]
        for rank, i in enumerate(live, start=1):
            payloads[i] = {
                "master_address": meta.master_address,
                "master_port": meta.master_port,
                "rank_offset": rank,
                "world_size": meta.world_size,
                "group_name": meta.group_name,
                "backend": meta.backend,
            }
        regroup = bool(self._group_members)
        self._group_members = live

        async def join() -> None:
            if regroup:
                await self.fleet.fanout_checked("/destroy_weights_update_group", {"group_name": meta.group_name})
            await self.fleet.fanout_checked("/init_weights_update_group", payloads)

        return self.fleet.call(join())

    def weight_update_group_intact(self) -> bool:
        """Whether every server of the weight-update group still takes TCP connections (one that
        refuses is marked dead). A connection, not an HTTP call: a paused or busy server answers
        it at once."""
        return bool(self.fleet.call(self.fleet.all_accept_connections(self._group_members)).result())

    def destroy_weights_update_group(self, meta: WeightUpdateMeta) -> None:
        self.fleet.call(
            self.fleet.fanout_checked("/destroy_weights_update_group", {"group_name": meta.group_name})
        ).result()

    def update_weights(self, meta: WeightUpdateMeta) -> Future[None]:
        if not self.control_servers:
            raise RuntimeError("this client does not control the servers (control_servers=False)")
        if meta.type == "in_process":
            raise ValueError("remote servers cannot take in_process weight updates: use disk or distributed")
        return self.fleet.call(self._update_weights(meta))

    async def _update_weights(self, meta: WeightUpdateMeta) -> None:
        pause_here = not self._paused
        if pause_here:
            await self._pause_servers()
        try:
            version = str(meta.version) if meta.version is not None else None
            if meta.type == "disk":
                await self.fleet.fanout_checked(
                    "/update_weights_from_disk",
                    {
                        "model_path": meta.path,
                        "weight_version": version,
                        "abort_all_requests": False,
                        "flush_cache": True,
                    },
                )
            else:
                session = await self.fleet.optional_fanout("/begin_weight_update", {"selector": "all"})
                await self.fleet.fanout_checked(
                    "/update_weights_from_distributed",
                    {
                        "names": [s.name for s in meta.param_specs],
                        "dtypes": [s.dtype for s in meta.param_specs],
                        "shapes": [list(s.shape) for s in meta.param_specs],
                        "group_name": meta.group_name,
                        "weight_version": version,
                        "flush_cache": True,
                        "abort_all_requests": False,
                    },
                )
                if session:
                    await self.fleet.fanout("/end_weight_update", {})
            if meta.version is not None:
                self._version = meta.version
        finally:
            if pause_here:
                await self._resume_servers()

    def set_version(self, version: int) -> None:
        """Tag tokens generated from now on with ``version`` (on every server too, when this
        client controls them)."""
        self._version = version
        if self.control_servers:
            self.fleet.call(
                self.fleet.fanout("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})
            ).result()

    def get_version(self) -> int:
        return self._version

    def pause(self) -> None:
        """Pause every server (running generations are aborted and resumed after `resume`, or
        frozen, per ``config.pause_mode``); generations of this client that come back aborted
        wait for the resume."""
        self.fleet.call(self._pause_servers()).result()
        self._paused = True

    def resume(self) -> None:
        self.fleet.call(self._resume_servers()).result()
        self._paused = False
