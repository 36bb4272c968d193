"""`RemoteEngine`: what every client of a fleet of generation servers shares. Its protocols are
subclasses: `RemoteSGLangEngine` (`areal_lite.engines.remote.sglang`: real SGLang on GPU nodes, or
our server on CPU) and `RemoteVLLMEngine` (`areal_lite.engines.remote.vllm`).

Generation: one async HTTP request per `agenerate` call (docs/protocol.md, ``/generate`` with
``input_ids`` for SGLang), over pooled connections; `agenerate_batch` (a GRPO group) sends its requests as
one batch request to one server, which saves most of the per-request cost on both sides. The
servers, the HTTP session and its event loop, routing and which servers are alive are the
`ServerFleet`'s (`areal_lite.engines.remote.fleet`); this module is what the calls mean. A
generation that comes back aborted (the servers paused for a weight update) is resubmitted as
prompt + generated tokens with the remaining token budget, keeping every token's log-probability
and version (`areal_lite.engines.remote.partial_rollout`); while this client keeps the servers
paused it waits, so that hundreds of resubmissions do not queue up on the paused servers and delay
the weight update. When a server fails (connection error, timeout, 5xx) the request is resent from
its last known state to another server, so a server dying loses no request and returns none twice.
A server that refuses connections or stops answering (this client's `FleetMonitor` watches them:
`areal_lite.engines.remote.monitor`) is set aside by the fleet: it gets no generation or control
calls and the rest of the fleet carries on. When it answers again, this client brings it up to
date before it is readmitted: the last disk update is loaded again (after a broadcast or an ipc
update it waits for the next update, which takes it in), the current version is set and it is
paused or resumed like the others.

While this client keeps the servers paused, new generations wait in the client too: every call is
sent while the weights it will run on are current, which is what tags the tokens of a server that
reports no versions (vLLM).

Control: pause / resume, weight updates (disk, distributed, or ipc for servers on this machine) and
version updates fan out to every server; weight updates pause generation around them unless the
caller already did. A client built with ``control_servers=False`` generates only: its pause, resume
and version change what it does with its own requests (aborted generations wait for the resume;
tokens a server does not tag get its version), while another client of the same servers (the
trainer's) controls them. The rollout controller's episode child uses one.

A subclass says how its protocol spells each of these: the generation call and its answer, the
pause and resume calls, the weight-update and version calls.

Mixture-of-experts routes (``GenerationConfig.return_routed_experts``): SGLang's
``return_routed_experts``; ``meta_info["routed_experts"]`` (base64 int32) is shaped with the
``(num_hidden_layers, num_experts_per_tok)`` of the served model's config, read once from the
``model_path`` that ``/model_info`` names (so the client must see the servers' model directory).

LoRA: a client built with an ``adapter_name`` names that adapter in every generation call, and
takes the weight updates of a LoRA train engine (``WeightUpdateMeta.lora_config``); SGLang's
protocol carries both, through its adapter routes (`areal_lite.engines.remote.sglang`).
"""

from __future__ import annotations

import abc
import asyncio
import logging
from concurrent.futures import Future

import aiohttp

from areal_lite.api.config import InferenceEngineConfig
from areal_lite.api.engine import InferenceEngine
from areal_lite.api.io import GenerationConfig, ModelRequest, ModelResponse, WeightUpdateMeta
from areal_lite.cpu import check_cores, freeze_startup_objects
from areal_lite.engines.remote.fleet import CallTimeout, ServerError, ServerFleet, ServerUnavailable
from areal_lite.engines.remote.monitor import FleetMonitor
from areal_lite.engines.remote.partial_rollout import Answer, PartialRollout, parse_version
from areal_lite.utils.moe import routing_shape
from areal_lite.utils.tensor_handles import on_this_machine

logger = logging.getLogger(__name__)


class RemoteEngine(InferenceEngine, abc.ABC):
    """`InferenceEngine` over HTTP servers listed in ``config.addresses`` (``host:port``); with
    ``control_servers=False`` a client that generates but never pauses, updates or re-versions
    the servers (another client does). Subclasses implement one protocol's calls."""

    def __init__(
        self, config: InferenceEngineConfig, control_servers: bool = True, adapter_name: str | None = None
    ) -> None:
        if not config.addresses:
            raise ValueError(f"{type(self).__name__} needs at least one server address (config.addresses)")
        check_cores(config.client_cores, "rollout.client_cores")
        self.config = config
        self.fleet = ServerFleet(config)
        self.monitor = FleetMonitor(self.fleet, self._on_return)
        self.control_servers = control_servers
        self.adapter_name = adapter_name
        """The LoRA adapter every generation call names (None: the servers' own weights)."""
        self._version = 0
        self._paused = False
        self._group_members: list[int] = []
        """The servers in the weight-update group (distributed updates), as ranks 1, 2, ..."""
        self._held: dict[int, int] = {}
        """The version of the weights each server holds (servers absent: the initial ones, 0)."""
        self._last_update: WeightUpdateMeta | None = None
        """The last weight update that reached the servers (a returning server loads it from disk)."""
        self._handover_open = False
        """An ipc update has sent some of its buckets, not its last one."""
        self._elsewhere: list[str] | None = None
        """The servers not on this machine (an ipc update needs none), found at the first one."""
        self._control = asyncio.Lock()
        """Held while the servers are paused, and while a returning server is brought up to date,
        so that neither happens during the other (a disk update rewrites the files it would load)."""
        self._told_waiting: set[int] = set()
        self._resumed = asyncio.Event()
        """Clear while this client is paused: generations aborted by the pause, and new ones,
        wait for it instead of queueing on a paused server during the update. Used on the
        fleet's loop only."""
        self._resumed.set()
        self._route_shape: tuple[int, int] | None = None
        """(layers, top_k) of the served model's routes, read when first needed."""
        self.context_len: int | None = None
        """The served model's context length (prompt and completion tokens), read from the servers
        at `initialize`; None where they do not say."""

    # ----- the protocol ---------------------------------------------------------------------

    @abc.abstractmethod
    def _generate_call(
        self, prompts: list[list[int]], rids: list[str], g: GenerationConfig, produced: int, budget: int,
        images: list[list[bytes]],
    ) -> tuple[str, dict[str, object]]:  # fmt: skip
        """(path, payload) of one generation call for ``prompts`` (one, or a batch of several; a
        prompt with ``images``, its image files, is sent alone) that have each produced
        ``produced`` of ``g``'s tokens so far, for at most ``budget`` more (what is left of
        ``g.max_new_tokens``, or less where the context ends first)."""

    @abc.abstractmethod
    async def _context_len_call(self) -> int | None:
        """The served model's context length as a live server reports it (None: not reported)."""

    async def _context_info(self, path: str) -> object:
        """GET ``path`` from a live server, for `_context_len_call`; None (and a warning) when it
        answers an error."""
        try:
            return await self.fleet.request(self.fleet.live()[0], path, None, self.config.request_timeout, method="GET")
        except ServerError as e:
            logger.warning("no context length from the servers (%s): requests are not capped at it", e)
            return None

    @abc.abstractmethod
    def _answers(self, data: object, count: int) -> list[Answer]:
        """The ``count`` answers of a generation call, in the order of its prompts."""

    @abc.abstractmethod
    async def _pause_call(self) -> None:
        """Pause every live server (``config.pause_mode``)."""

    @abc.abstractmethod
    async def _resume_call(self) -> None:
        """Resume every live server."""

    @abc.abstractmethod
    async def _join_group_call(self, payloads: list[dict[str, object]]) -> None:
        """Each live server joins the weight-update group (``payloads[i]``: server i's place in it)."""

    @abc.abstractmethod
    async def _leave_group_call(self, group_name: str) -> None:
        """Every live server leaves the weight-update group."""

    @abc.abstractmethod
    async def _load_from_disk_call(self, meta: WeightUpdateMeta) -> None:
        """Every live server loads the weights in ``meta.path``."""

    @abc.abstractmethod
    async def _receive_broadcast_call(self, meta: WeightUpdateMeta) -> None:
        """Every server of the group receives ``meta.param_specs`` by broadcast; answers once loaded."""

    async def _load_from_handles_call(self, meta: WeightUpdateMeta) -> None:
        """Every live server loads the tensors whose handles ``meta.serialized_tensors`` holds (one
        bucket of an ipc update); answers once loaded. Protocols that take none leave it out and
        refuse in `_check_ipc`."""
        raise NotImplementedError

    def _check_ipc(self, meta: WeightUpdateMeta) -> None:
        """Refuse an ipc update that cannot work: a LoRA adapter's (they go by disk or broadcast),
        one without handles, or any while a server of the fleet is on another machine."""
        if meta.lora_config is not None:
            raise ValueError("LoRA adapter updates go by weight_update=disk or distributed, not ipc")
        if meta.serialized_tensors is None:
            raise ValueError("an ipc weight update carries its bucket's handles (WeightUpdateMeta.serialized_tensors)")
        if self._elsewhere is None:
            self._elsewhere = [a for a in self.fleet.addresses if not on_this_machine(a)]
        if self._elsewhere:
            raise ValueError(
                f"weight_update=ipc hands the trainer's memory to servers on this machine, and "
                f"{', '.join(self._elsewhere)} is not on it: use weight_update=distributed or disk"
            )

    @abc.abstractmethod
    async def _version_call(self, version: int) -> None:
        """Tell every live server the version of later tokens (a no-op where they are not told)."""

    # ----- lifecycle -----------------------------------------------------------------------

    def initialize(self) -> None:
        """Start the client loop, wait until every server is healthy, then watch them (a server
        that stops answering is set aside, and brought up to date when it answers again:
        `FleetMonitor`)."""
        self.fleet.start()
        self.fleet.call(self.fleet.wait_healthy()).result()
        self.context_len = self.fleet.call(self._context_len_call()).result()
        self.monitor.start()
        freeze_startup_objects()

    def destroy(self) -> None:
        self.monitor.stop()
        self.fleet.stop()
        self._resumed = asyncio.Event()  # a new loop would not take one bound to the old
        self._resumed.set()
        self._control = asyncio.Lock()

    # ----- servers that come back ------------------------------------------------------------

    async def _on_return(self, i: int) -> None:
        """A server set aside answers again. A client that controls the servers brings it up to
        the current weights (the last disk update, loaded again; after a distributed or ipc update
        it waits for the next update, whose group or first bucket takes it in) and version, resumed
        or paused as the others, then readmits it. Any other client readmits it once it reports the current version."""
        if not self.control_servers:
            try:
                info = await self.fleet.request(i, "/model_info", None, 10.0, method="GET")
            except ServerError:  # no such route (vLLM): its tokens get this client's version anyway
                info = None
            version = info.get("weight_version") if isinstance(info, dict) else None
            if version is None or parse_version(version, -1) == self._version:
                self.fleet.readmit(i)
            return
        if self._control.locked() or not self._resumed.is_set():
            return  # the servers are paused: the update under way takes it in (`_rejoin_returning`)
        async with self._control:
            held, current = self._held.get(i, 0), self._version
            meta = self._last_update
            if held != current and (meta is None or meta.type != "disk"):
                if i not in self._told_waiting:
                    self._told_waiting.add(i)
                    logger.warning(
                        "server %s holds the weights of version %d; it rejoins with the next weight update",
                        self.fleet.addresses[i],
                        held,
                    )
                return
            with self.fleet.only(i):
                if held != current:
                    assert meta is not None
                    await self._load_from_disk_call(meta)
                await self._version_call(current)
                await self._resume_call()  # it may have taken a pause before it stopped answering
            if i in self.fleet.returning():  # not set aside again meanwhile
                self._held[i] = current
                self._told_waiting.discard(i)
                self.fleet.readmit(i)

    async def _rejoin_returning(self) -> None:
        """While the servers are paused for a weight update: returning servers take the pause too
        and become live, so that the update, the version and the resume reach them."""
        for i in self.fleet.returning():
            with self.fleet.only(i):
                await self._pause_call()
            if i in self.fleet.returning():
                self._told_waiting.discard(i)
                self.fleet.readmit(i)

    # ----- generation ----------------------------------------------------------------------

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        # Runs on the client loop, awaited from the caller's (cancelling one cancels the other).
        return await asyncio.wrap_future(self.fleet.call(self._generate(req)))

    async def agenerate_batch(self, reqs: list[ModelRequest]) -> list[ModelResponse]:
        if len(reqs) < 2 or any(r.gconfig != reqs[0].gconfig or r.images for r in reqs):
            return await super().agenerate_batch(reqs)
        return await asyncio.wrap_future(self.fleet.call(self._generate_batch(reqs)))

    def _budget(self, req: ModelRequest, part: PartialRollout) -> int:
        """The tokens ``req`` may still produce: what is left of its ``max_new_tokens``, and no
        more than fit in the context after its prompt and what it produced (servers refuse a
        request past the context; the embedded engine ends it there, ``length``, and so does this
        client). A prompt that fills the context is an error, as in the embedded engine."""
        left = req.gconfig.max_new_tokens - len(part.out_ids)
        if self.context_len is None:
            return left
        used = len(req.input_ids) + len(part.out_ids)
        if len(req.input_ids) >= self.context_len:
            raise ValueError(f"the prompt has {len(req.input_ids)} tokens; the context length is {self.context_len}")
        return min(left, self.context_len - used)

    def _call_for(self, reqs: list[ModelRequest], parts: list[PartialRollout]) -> tuple[str, dict[str, object]]:
        prompts = [list(r.input_ids) + p.out_ids for r, p in zip(reqs, parts)]
        budget = min(self._budget(r, p) for r, p in zip(reqs, parts))
        rids, images = [r.rid for r in reqs], [r.images for r in reqs]
        return self._generate_call(prompts, rids, reqs[0].gconfig, len(parts[0].out_ids), budget, images)

    async def _generate_batch(
        self, reqs: list[ModelRequest], parts: list[PartialRollout] | None = None
    ) -> list[ModelResponse]:
        """One batch call to one server for requests with the same remaining token budget.
        Requests that come back aborted continue after the resume, again as batch calls (one per
        remaining budget: the call has one set of sampling parameters), so that a pause in
        asynchronous RL, which aborts every group in flight, is not followed by one call per
        sample. If a call fails, its requests are retried one by one in `_generate`, from what
        they had produced before it."""
        parts = parts or [PartialRollout() for _ in reqs]
        budgets = {self._budget(r, p) for r, p in zip(reqs, parts)}
        if len(reqs) == 1 or len(budgets) > 1:  # one call has one budget
            return list(await asyncio.gather(*(self._generate(r, p) for r, p in zip(reqs, parts))))
        await self._until_resumed()
        await self.fleet.until_any_live(self.config.request_timeout)
        sent_version = self._version
        path, payload = self._call_for(reqs, parts)
        idx = self.fleet.choose(reqs[0].rid, set(), also=tuple(r.rid for r in reqs[1:]))
        data, error = await self._post_generate(idx, path, payload, count=len(reqs))
        if error is not None:
            return list(await asyncio.gather(*(self._generate(r, p) for r, p in zip(reqs, parts))))
        out: list[ModelResponse | None] = [None] * len(reqs)
        by_budget: dict[int, list[int]] = {}  # aborted requests by tokens produced so far
        answers = await self._shape_routes(self._answers(data, len(reqs)), idx)
        for i, (req, part, answer) in enumerate(zip(reqs, parts, answers)):
            reason = part.absorb(answer, sent_version)
            if reason != "abort":
                out[i] = part.response(req, reason)
            elif self._budget(req, part) <= 0:
                out[i] = part.response(req, "length")
            else:
                by_budget.setdefault(len(part.out_ids), []).append(i)
        if by_budget:
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
        self, idx: int, path: str, payload: dict[str, object], count: int = 1
    ) -> tuple[object, BaseException | None]:
        """One generation call to server ``idx`` (which `ServerFleet.choose` charged ``count``
        requests): its answer, or the transport / server error it failed with (logged; a server
        refusing connections is marked dead). A 4xx answer is raised: no other server would take it."""
        error: BaseException | None = None
        data: object = None
        try:
            data = await self.fleet.request(idx, path, payload, self.config.request_timeout)
        except (aiohttp.ClientError, asyncio.TimeoutError, ServerError) as e:
            if isinstance(e, ServerError) and e.status < 500:
                raise  # the request itself is bad
            error = e
        finally:  # also when cancelled
            self.fleet.release(idx, failed=error is not None, count=count)
        if error is not None and not isinstance(error, ServerUnavailable):  # that one was reported once
            if isinstance(error, aiohttp.ClientConnectorError):
                self.fleet.mark_dead(idx, error)
            logger.warning(
                "generation on %s failed (%s: %s); retrying elsewhere",
                self.fleet.addresses[idx],
                type(error).__name__,
                error,
            )
        return data, error

    async def _generate(self, req: ModelRequest, part: PartialRollout | None = None) -> ModelResponse:
        """Generate until a stop or the token budget, resuming after aborts and retrying failed
        calls on other servers; ``part`` is what earlier calls produced."""
        part = part or PartialRollout()
        failures = 0
        failed_on: set[int] = set()
        while True:
            if self._budget(req, part) <= 0:
                return part.response(req, "length")
            # Also after an abort by our pause: resume as prompt + generated once it ends.
            await self._until_resumed()
            await self.fleet.until_any_live(self.config.request_timeout)
            sent_version = self._version
            idx = self.fleet.choose(req.rid, failed_on)
            data, error = await self._post_generate(idx, *self._call_for([req], [part]))
            if isinstance(error, ServerUnavailable):
                continue  # set aside while it ran: not this request's failure
            if error is not None:
                failures += 1
                failed_on.add(idx)
                if len(failed_on) == len(self.fleet):
                    failed_on.clear()
                if failures >= self.config.request_retries:
                    # Name the keys: a generation longer than the request timeout fails on every server.
                    key = " (each call is bounded by rollout.request_timeout)" if isinstance(error, CallTimeout) else ""
                    raise RuntimeError(
                        f"request {req.rid} failed {failures} times (rollout.request_retries); last error: {error}{key}"
                    ) from error
                continue
            answer = (await self._shape_routes(self._answers(data, 1), idx))[0]
            reason = part.absorb(answer, sent_version)
            if reason != "abort":
                return part.response(req, reason)

    async def _shape_routes(self, answers: list[Answer], idx: int) -> list[Answer]:
        """``answers`` with their flat routes (if any) shaped ``[tokens, layers, top_k]`` by the
        served model's config, which server ``idx`` names in ``/model_info``."""
        if all(a.routed_experts is None for a in answers):
            return answers
        if self._route_shape is None:
            info = await self.fleet.request(idx, "/model_info", None, self.config.request_timeout, method="GET")
            path = str(info.get("model_path")) if isinstance(info, dict) else ""

            def read_shape() -> tuple[int, int] | None:
                from transformers import AutoConfig

                return routing_shape(AutoConfig.from_pretrained(path))

            try:
                shape = await asyncio.get_running_loop().run_in_executor(None, read_shape)
            except (OSError, ValueError) as e:
                raise RuntimeError(
                    f"cannot read the config of the served model {path!r} to shape its routes: {e}"
                ) from e
            if shape is None:
                raise RuntimeError(f"the served model {path!r} has no mixture-of-experts layers, yet returned routes")
            self._route_shape = shape
        for a in answers:
            if a.routed_experts is not None:
                a.routed_experts = a.routed_experts.view(-1, *self._route_shape)
        return answers

    async def _until_resumed(self) -> None:
        """Wait while this client keeps the servers paused (a no-op when the pause was not ours)."""
        await self._resumed.wait()

    async def _pause_servers(self) -> None:
        if not self.control_servers:
            self._resumed.clear()  # before the aborted generations come back
            return
        async with self._control:  # not while a returning server loads the last update
            self._resumed.clear()
            try:
                await self._pause_call()
            except BaseException:
                self._resumed.set()
                raise

    async def _resume_servers(self) -> None:
        try:
            if self.control_servers:
                await self._resume_call()
        finally:
            self._resumed.set()

    # ----- weights and versions ------------------------------------------------------------

    def init_weights_update_group(self, meta: WeightUpdateMeta) -> Future[None]:
        """Every live server joins ``meta``'s group: the i-th as rank 1 + i of 1 + their number
        (``meta.world_size`` is set here). Called again after a member died, it first asks the
        live servers to leave the old group."""
        self.fleet.call(self._rejoin_returning()).result()
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
                await self._leave_group_call(meta.group_name)
            await self._join_group_call(payloads)

        return self.fleet.call(join())

    def weight_update_group_intact(self) -> bool:
        """Whether every server of the weight-update group is live and still takes TCP connections
        (one that refuses is marked dead), and no server waits to join it (a returning one). A
        connection, not an HTTP call: a paused or busy server answers it at once."""
        intact = self.fleet.call(self.fleet.all_accept_connections(self._group_members)).result()
        return bool(intact) and not self.fleet.returning()

    def destroy_weights_update_group(self, meta: WeightUpdateMeta) -> None:
        self.fleet.call(self._leave_group_call(meta.group_name)).result()

    def update_weights(self, meta: WeightUpdateMeta) -> Future[None]:
        if not self.control_servers:
            raise RuntimeError("this client does not control the servers (control_servers=False)")
        if meta.type == "in_process":
            raise ValueError("remote servers cannot take in_process weight updates: use disk, distributed or ipc")
        if meta.type == "ipc":
            self._check_ipc(meta)
        return self.fleet.call(self._update_weights(meta))

    async def _update_weights(self, meta: WeightUpdateMeta) -> None:
        if meta.lora_config is not None and self.adapter_name is None:
            raise ValueError("a LoRA adapter update needs a client built with adapter_name (the name requests use)")
        pause_here = not self._paused
        if pause_here:
            await self._pause_servers()
        try:
            if meta.type == "disk":
                # (A broadcast's group takes returning servers in when it is formed, not between chunks.)
                await self._rejoin_returning()
                await self._load_from_disk_call(meta)
            elif meta.type == "ipc":
                if not self._handover_open:  # returning servers join at the first bucket, never later
                    await self._rejoin_returning()
                self._handover_open = False  # until this bucket is in: a failed update ends here
                await self._load_from_handles_call(meta)
                self._handover_open = not meta.last_chunk
            else:
                await self._receive_broadcast_call(meta)
            if meta.version is not None:
                self._version = meta.version
            self._last_update = meta
        finally:
            if pause_here:
                await self._resume_servers()

    def set_version(self, version: int) -> None:
        """Tag tokens generated from now on with ``version`` (on every server too, when this
        client controls them and the protocol tells servers versions). Called once the weights
        of ``version`` are whole on the servers (after the last chunk of a broadcast): the live
        servers are then known to hold them."""
        self._version = version
        if self.control_servers:
            self.fleet.call(self._version_call(version)).result()
            for i in self.fleet.live():
                self._held[i] = version

    def get_version(self) -> int:
        return self._version

    def pause(self) -> None:
        """Pause every server (running generations are aborted and resumed after `resume`, or
        frozen, per ``config.pause_mode``); generations of this client that come back aborted,
        and new ones, wait for the resume."""
        self.fleet.call(self._pause_servers()).result()
        self._paused = True

    def resume(self) -> None:
        self.fleet.call(self._resume_servers()).result()
        self._paused = False
