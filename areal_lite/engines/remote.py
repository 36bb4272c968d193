"""The client of a fleet of SGLang-protocol servers (real SGLang on GPU nodes, or ours on CPU).

Generation: one async HTTP request per `agenerate` call (PROTOCOL.md, ``/generate`` with
``input_ids``), over pooled connections; `agenerate_batch` (a GRPO group) sends its requests as
one batch request to one server, which saves most of the per-request cost on both sides. Every
HTTP call runs on the client's own event loop in a background thread (an aiohttp session must not
cross loops), whatever loop awaits `agenerate`. A request whose rid was seen before goes to the
same server; others go to the server with the fewest requests in flight. A generation that comes
back aborted (the servers paused for a weight update) is resubmitted as prompt + generated tokens
with the remaining token budget, keeping every token's log-probability and version; while this
client keeps the servers paused it waits, so that hundreds of resubmissions do not queue up on
the paused servers and delay the weight update. When a server fails (connection error, timeout,
5xx) the request is resent from its last known state to another server, so a
server dying loses no request and returns none twice. A server that refuses connections is
dead: it gets no more generation or control calls, and the rest of the fleet carries on (a
distributed weight update cannot: its process group counted the dead server).

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
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Coroutine
from concurrent.futures import Future
from dataclasses import dataclass, field

import aiohttp

from areal_lite.api.config import InferenceEngineConfig
from areal_lite.api.engine import InferenceEngine
from areal_lite.api.io import ModelRequest, ModelResponse, WeightUpdateMeta
from areal_lite.utils.cpu import check_cores, pin_this_thread
from areal_lite.utils.gc_freeze import freeze_startup_objects

logger = logging.getLogger(__name__)

DOWN_SECONDS = 5.0
"""A server that failed a request gets no new requests for this long (unless all are down)."""
STICKY_RIDS = 100_000
"""How many rid -> server assignments are remembered."""


class ServerError(RuntimeError):
    """A server answered with an error status."""

    def __init__(self, address: str, status: int, message: str) -> None:
        super().__init__(f"{address} answered {status}: {message}")
        self.status = status


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
        self.addresses = [a if a.startswith("http") else f"http://{a}" for a in config.addresses]
        self.control_servers = control_servers
        self._version = 0
        self._paused = False
        self._lock = threading.Lock()
        self._inflight = [0] * len(self.addresses)
        self._down_until = [0.0] * len(self.addresses)
        self._dead: set[int] = set()
        self._group_members: list[int] = []
        """The servers in the weight-update group (distributed updates), as ranks 1, 2, ..."""
        self._sticky: OrderedDict[str, int] = OrderedDict()
        self._session: aiohttp.ClientSession | None = None
        """The one HTTP session; it lives on (and is only used from) the client loop."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._resumed: asyncio.Event | None = None
        """Clear while this client is paused: generations aborted by the pause wait for it before
        they resume, instead of queueing on a paused server during the update."""

    # ----- lifecycle -----------------------------------------------------------------------

    def initialize(self) -> None:
        """Start the client loop and wait until every server is healthy."""
        self._start_client()
        self._call(self._await_healthy()).result()
        freeze_startup_objects()

    def _start_client(self) -> None:
        """Start the client's event loop in a background thread. Every HTTP call runs there,
        whatever loop or thread asked for it."""
        if self._loop is not None:
            return
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            pin_this_thread(self.config.client_cores)
            asyncio.set_event_loop(loop)
            self._resumed = asyncio.Event()
            self._resumed.set()
            loop.call_soon(ready.set)
            loop.run_forever()

        self._loop_thread = threading.Thread(target=run, name="remote-engine-client", daemon=True)
        self._loop_thread.start()
        ready.wait()
        self._loop = loop

    def destroy(self) -> None:
        if self._loop is not None:
            if self._session is not None:
                self._call(self._session.close()).result()
                self._session = None
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._loop_thread is not None:
                self._loop_thread.join()
            self._loop.close()
            self._loop = None

    # ----- HTTP ----------------------------------------------------------------------------

    def _http(self) -> aiohttp.ClientSession:
        """The session (created on first use, on the client loop)."""
        if self._session is None:
            headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else None
            # limit=0: the executor's admission already bounds concurrency; the pool reuses sockets.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=headers)
        return self._session

    async def _request(
        self, idx: int, path: str, payload: dict[str, object] | None, timeout: float, method: str = "POST"
    ) -> object:
        """One call to server ``idx``; returns the decoded JSON body (or text). Raises ServerError
        for a non-200 answer and aiohttp / timeout errors for transport failures."""
        url = self.addresses[idx] + path
        async with self._http().request(
            method, url, json=payload, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            if resp.content_type == "application/json":
                body: object = await resp.json()
            else:
                body = await resp.text()
            if resp.status != 200:
                message = body.get("error", {}).get("message", body.get("message")) if isinstance(body, dict) else body
                raise ServerError(self.addresses[idx], resp.status, str(message))
            return body

    async def _fanout(
        self, path: str, payloads: list[dict[str, object]] | dict[str, object], timeout: float | None = None
    ) -> list[tuple[int, object]]:
        """Send one call to every live server concurrently (``payloads`` per server, or one for
        all); returns (server index, answer) of each. A server that refuses connections is dead:
        it gets no more calls of any kind (the rest of the fleet carries on)."""

        async def call(i: int) -> object:
            try:
                return await self._request(i, path, each[i], timeout)
            except aiohttp.ClientConnectorError:
                raise
            except aiohttp.ClientConnectionError:
                # The connection dropped mid-call (a server killed while it answered): ask once
                # more, so that a dead server shows as refusing connections, not as a failed call.
                return await self._request(i, path, each[i], timeout)

        timeout = timeout if timeout is not None else self.config.request_timeout
        each = payloads if isinstance(payloads, list) else [payloads] * len(self.addresses)
        live = [i for i in range(len(self.addresses)) if i not in self._dead]
        answers = await asyncio.gather(
            *[call(i) for i in live], return_exceptions=True
        )
        out: list[tuple[int, object]] = []
        for i, answer in zip(live, answers):
            if isinstance(answer, aiohttp.ClientConnectorError):
                self._mark_dead(i, answer)
            elif isinstance(answer, BaseException):
                raise answer
            else:
                out.append((i, answer))
        if not out:
            raise RuntimeError(f"no rollout server is reachable (calling {path})")
        return out

    def _mark_dead(self, idx: int, error: BaseException) -> None:
        with self._lock:
            if idx not in self._dead:
                logger.error("server %s is unreachable (%s); it gets no more requests", self.addresses[idx], error)
            self._dead.add(idx)

    def _call(self, coro: Coroutine[object, object, object]) -> Future:
        """Run ``coro`` on the client loop; the returned future completes with its result."""
        if self._loop is None:
            self._start_client()
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _await_healthy(self) -> None:
        deadline = time.monotonic() + self.config.setup_timeout
        for i, address in enumerate(self.addresses):
            while True:
                try:
                    await self._request(i, "/health", None, timeout=5.0, method="GET")
                    break
                except (aiohttp.ClientError, asyncio.TimeoutError, ServerError) as e:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"server {address} not healthy after {self.config.setup_timeout}s: {e}"
                        ) from e
                    await asyncio.sleep(0.5)

    # ----- routing -------------------------------------------------------------------------

    def _choose(self, rid: str, exclude: set[int], also: tuple[str, ...] = ()) -> int:
        """The server for ``rid`` (and the requests ``also`` sent with it in one batch)."""
        with self._lock:
            now = time.monotonic()
            alive = [i for i in range(len(self.addresses)) if i not in self._dead]
            if not alive:
                raise RuntimeError("every rollout server is unreachable")
            up = [i for i in alive if self._down_until[i] <= now and i not in exclude]
            sticky = self._sticky.get(rid)
            if sticky is not None and sticky in up:
                self._sticky.move_to_end(rid)
                idx = sticky
            else:
                candidates = up or [i for i in alive if i not in exclude] or alive
                idx = min(candidates, key=lambda i: (self._inflight[i], self._down_until[i]))
                self._sticky[rid] = idx
            for other in also:
                self._sticky[other] = idx
            while len(self._sticky) > STICKY_RIDS:
                self._sticky.popitem(last=False)
            self._inflight[idx] += 1 + len(also)
            return idx

    def assigned_server(self, rid: str) -> str | None:
        """The server (``host:port``) that requests with ``rid`` go to, if one was chosen."""
        with self._lock:
            idx = self._sticky.get(rid)
        return None if idx is None else self.addresses[idx].removeprefix("http://")

    def _release(self, idx: int, failed: bool, count: int = 1) -> None:
        with self._lock:
            self._inflight[idx] -= count
            if failed:
                self._down_until[idx] = time.monotonic() + DOWN_SECONDS

    # ----- generation ----------------------------------------------------------------------

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        # Runs on the client loop, awaited from the caller's (cancelling one cancels the other).
        return await asyncio.wrap_future(self._call(self._generate(req)))

    async def agenerate_batch(self, reqs: list[ModelRequest]) -> list[ModelResponse]:
        if len(reqs) < 2 or any(r.gconfig != reqs[0].gconfig for r in reqs):
            return await super().agenerate_batch(reqs)
        return await asyncio.wrap_future(self._call(self._generate_batch(reqs)))

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

    async def _generate_batch(self, reqs: list[ModelRequest], parts: list[_Partial] | None = None) -> list[ModelResponse]:
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
        idx = self._choose(reqs[0].rid, set(), also=tuple(r.rid for r in reqs[1:]))
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
            data = await self._request(idx, "/generate", payload, self.config.request_timeout)
        except (aiohttp.ClientError, asyncio.TimeoutError, ServerError) as e:
            if isinstance(e, ServerError) and e.status < 500:
                raise  # the request itself is bad
            error = e
        finally:  # also when cancelled
            self._release(idx, failed=error is not None, count=count)
        if error is not None:
            if isinstance(error, aiohttp.ClientConnectorError):
                self._mark_dead(idx, error)
            logger.warning(
                "generation on %s failed (%s: %s); retrying elsewhere", self.addresses[idx], type(error).__name__, error
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
            idx = self._choose(req.rid, failed_on)
            data, error = await self._post_generate(idx, self._payload(req, part))
            if error is not None:
                failures += 1
                failed_on.add(idx)
                if len(failed_on) == len(self.addresses):
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
        assert self._resumed is not None
        await self._resumed.wait()

    async def _pause_servers(self) -> None:
        assert self._resumed is not None
        self._resumed.clear()  # before the aborted generations come back
        if not self.control_servers:
            return
        try:
            await self._fanout("/pause_generation", {"mode": self.config.pause_mode})
        except BaseException:
            self._resumed.set()
            raise

    async def _resume_servers(self) -> None:
        assert self._resumed is not None
        try:
            if self.control_servers:
                await self._fanout("/continue_generation", {})
        finally:
            self._resumed.set()

    # ----- weights and versions ------------------------------------------------------------

    def init_weights_update_group(self, meta: WeightUpdateMeta) -> Future[None]:
        """Every live server joins ``meta``'s group: the i-th as rank 1 + i of 1 + their number
        (``meta.world_size`` is set here). Called again after a member died, it first asks the
        live servers to leave the old group."""
        with self._lock:
            live = [i for i in range(len(self.addresses)) if i not in self._dead]
        if not live:
            raise RuntimeError("no rollout server is reachable to form a weight-update group with")
        meta.world_size = 1 + len(live)
        payloads: list[dict[str, object]] = [{} for _ in self.addresses]
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
                await self._fanout_checked("/destroy_weights_update_group", {"group_name": meta.group_name})
            await self._fanout_checked("/init_weights_update_group", payloads)

        return self._call(join())

    def weight_update_group_intact(self) -> bool:
        """Whether every server of the weight-update group still takes TCP connections (one that
        refuses is marked dead). A connection, not an HTTP call: a paused or busy server answers
        it at once."""
        return bool(self._call(self._members_alive()).result())

    async def _members_alive(self) -> bool:
        async def refused(i: int) -> OSError | None:
            url = urllib.parse.urlsplit(self.addresses[i])
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(url.hostname, url.port), 5.0)
            except asyncio.TimeoutError:  # before OSError, of which it is a subclass
                return None  # slow, not gone
            except OSError as e:
                return e
            writer.close()
            return None

        members = [i for i in self._group_members if i not in self._dead]
        for i, error in zip(members, await asyncio.gather(*(refused(i) for i in members))):
            if error is not None:
                self._mark_dead(i, error)
        return all(i not in self._dead for i in self._group_members)

    def destroy_weights_update_group(self, meta: WeightUpdateMeta) -> None:
        self._call(self._fanout_checked("/destroy_weights_update_group", {"group_name": meta.group_name})).result()

    async def _fanout_checked(self, path: str, payloads: list[dict[str, object]] | dict[str, object]) -> None:
        for idx, body in await self._fanout(path, payloads):
            if isinstance(body, dict) and body.get("success") is False:
                raise RuntimeError(f"{path} failed on {self.addresses[idx]}: {body.get('message')}")

    def update_weights(self, meta: WeightUpdateMeta) -> Future[None]:
        if not self.control_servers:
            raise RuntimeError("this client does not control the servers (control_servers=False)")
        if meta.type == "in_process":
            raise ValueError("remote servers cannot take in_process weight updates: use disk or distributed")
        return self._call(self._update_weights(meta))

    async def _update_weights(self, meta: WeightUpdateMeta) -> None:
        pause_here = not self._paused
        if pause_here:
            await self._pause_servers()
        try:
            version = str(meta.version) if meta.version is not None else None
            if meta.type == "disk":
                await self._fanout_checked(
                    "/update_weights_from_disk",
                    {
                        "model_path": meta.path,
                        "weight_version": version,
                        "abort_all_requests": False,
                        "flush_cache": True,
                    },
                )
            else:
                session = await self._optional_fanout("/begin_weight_update", {"selector": "all"})
                await self._fanout_checked(
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
                    await self._fanout("/end_weight_update", {})
            if meta.version is not None:
                self._version = meta.version
        finally:
            if pause_here:
                await self._resume_servers()

    async def _optional_fanout(self, path: str, payload: dict[str, object]) -> bool:
        """Call an endpoint that older SGLang versions lack; False when a server answers 404."""
        try:
            await self._fanout(path, payload)
            return True
        except ServerError as e:
            if e.status == 404:
                return False
            raise

    def set_version(self, version: int) -> None:
        """Tag tokens generated from now on with ``version`` (on every server too, when this
        client controls them)."""
        self._version = version
        if self.control_servers:
            self._call(
                self._fanout("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})
            ).result()

    def get_version(self) -> int:
        return self._version

    def pause(self) -> None:
        """Pause every server (running generations are aborted and resumed after `resume`, or
        frozen, per ``config.pause_mode``); generations of this client that come back aborted
        wait for the resume."""
        self._call(self._pause_servers()).result()
        self._paused = True

    def resume(self) -> None:
        self._call(self._resume_servers()).result()
        self._paused = False

