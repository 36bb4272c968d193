"""The servers a remote client talks to: HTTP calls, routing, and which servers are alive.

Every HTTP call runs on the fleet's own event loop in a background thread, over one pooled
aiohttp session (a session must not cross loops), whatever loop or thread asked for it: `call`
hands a coroutine to that loop. A request whose rid was seen before goes to the same server;
others go to the server with the fewest requests in flight. A server that failed a request gets
no new ones for `DOWN_SECONDS` (unless all are down).

Servers that stop answering are set aside, and taken back when they answer again. A server that
refuses connections is dead; the `FleetMonitor` (`areal_lite.engines.remote.monitor`) also finds
the ones that stop answering its health checks. Either is set aside at once, reported in one line:
it gets no new calls, and every call waiting on it (a generation, a pause, a weight update) ends
with `ServerUnavailable`, so that generations are resent elsewhere and fan-outs go on with the
others, after a bounded time rather than after the request timeout. Where the request timeout is
the shorter, a fan-out sets aside itself a server that leaves both its call and ``GET /health``
unanswered. A server set aside that answers again is *returning* until its owner, having brought
it up to date, takes it back with `readmit`. While no server is live but some may return,
generations wait (`until_any_live`, with a line every `WAITING_LINE_SECONDS`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Coroutine, Iterator
from concurrent.futures import Future

import aiohttp

from areal_lite.api.config import InferenceEngineConfig
from areal_lite.cpu import rollout_client_thread

logger = logging.getLogger(__name__)

DYING_SECONDS = 10.0
"""How long a fan-out call keeps retrying a server whose connections drop but whose port still
takes new ones (a killed process not gone yet) before the error is raised."""
DOWN_SECONDS = 5.0
"""A server that failed a request gets no new requests for this long (unless all are down)."""
STICKY_RIDS = 100_000
"""How many rid -> server assignments are remembered."""
WAITING_LINE_SECONDS = 30.0
"""While generations wait for a server to come back, a line is said this often."""

_only: contextvars.ContextVar[tuple[int, ...] | None] = contextvars.ContextVar("fleet_only", default=None)
"""The servers that fan-outs of the current task go to instead of the live ones (`ServerFleet.only`)."""


_GONE = object()
"""What `ServerFleet.fanout` gets from a server found dead during the call."""


class ServerError(RuntimeError):
    """A server answered with an error status."""

    def __init__(self, address: str, status: int, message: str) -> None:
        super().__init__(f"{address} answered {status}: {message}")
        self.status = status


class CallTimeout(TimeoutError):
    """A call got no answer within its timeout (aiohttp's own timeout error says nothing)."""

    def __init__(self, address: str, method: str, path: str, timeout: float, advice: str = "") -> None:
        super().__init__(f"{method} {path} on {address} got no answer within {timeout:g}s{advice}")
        self.address, self.method, self.path, self.timeout = address, method, path, timeout


class ServerUnavailable(aiohttp.ClientError):
    """The server was set aside (dead or unresponsive) before or while the call waited on it."""

    def __init__(self, address: str, why: str) -> None:
        super().__init__(f"{address} is set aside: {why}")


class ServerFleet:
    """The servers of ``config.addresses`` (``host:port``), addressed by index."""

    def __init__(self, config: InferenceEngineConfig) -> None:
        self.config = config
        self.addresses = [a if a.startswith("http") else f"http://{a}" for a in config.addresses]
        self._lock = threading.Lock()
        self._inflight = [0] * len(self.addresses)
        self._down_until = [0.0] * len(self.addresses)
        self._out: dict[int, str] = {}
        """Servers set aside: index -> why (``dead`` ones refused a connection)."""
        self._dead: set[int] = set()
        self._out_since: dict[int, float] = {}
        self._returning: set[int] = set()
        """Servers set aside that answer again, until their owner takes them back (`readmit`)."""
        self._aside: dict[int, asyncio.Event] = {}
        """Per server, set while it is set aside (calls waiting on it end); on the fleet's loop."""
        self._live_again: asyncio.Event | None = None
        self._none_live_since: float | None = None
        self._waiting_line_at = 0.0
        self._sticky: OrderedDict[str, int] = OrderedDict()
        self._session: aiohttp.ClientSession | None = None
        """The one HTTP session; it lives on (and is only used from) the fleet's loop."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None

    def __len__(self) -> int:
        return len(self.addresses)

    # ----- the client loop -----------------------------------------------------------------

    def start(self) -> None:
        """Start the event loop thread (pinned to ``config.client_cores``); idempotent."""
        if self._loop is not None:
            return
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            rollout_client_thread(self.config.client_cores)
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()

        self._loop_thread = threading.Thread(target=run, name="remote-engine-client", daemon=True)
        self._loop_thread.start()
        ready.wait()
        self._loop = loop

    def stop(self) -> None:
        """Close the session and stop the loop thread (stop the `FleetMonitor` first)."""
        if self._loop is not None:
            if self._session is not None:
                self.call(self._session.close()).result()
                self._session = None
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._loop_thread is not None:
                self._loop_thread.join()
            self._loop.close()
            self._loop = None

    def call(self, coro: Coroutine[object, object, object]) -> Future:
        """Run ``coro`` on the fleet's loop (started if need be); the returned future completes
        with its result."""
        self.start()
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _http(self) -> aiohttp.ClientSession:
        """The session (created on first use, on the fleet's loop)."""
        if self._session is None:
            headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else None
            # limit=0: the executor's admission already bounds concurrency; the pool reuses sockets.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=headers)
        return self._session

    # ----- calls ---------------------------------------------------------------------------

    async def request(
        self, idx: int, path: str, payload: dict[str, object] | None, timeout: float, method: str = "POST"
    ) -> object:
        """One call to server ``idx``; returns the decoded JSON body (or text). Raises ServerError
        for a non-200 answer, aiohttp / timeout errors for transport failures, and
        `ServerUnavailable` when the server is set aside before or while the call waits on it."""
        aside = self._aside_event(idx)
        if aside.is_set():
            raise ServerUnavailable(self.addresses[idx], self._out.get(idx, "set aside"))
        call = asyncio.ensure_future(self._call(idx, path, payload, timeout, method))
        ended = asyncio.ensure_future(aside.wait())
        try:
            done, _ = await asyncio.wait((call, ended), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            call.cancel()
            ended.cancel()
            raise
        ended.cancel()
        if call in done:
            return call.result()
        call.cancel()
        await asyncio.wait((call,))  # let the HTTP call unwind (a cancellation of ours still propagates)
        raise ServerUnavailable(self.addresses[idx], self._out.get(idx, "set aside"))

    async def _call(
        self, idx: int, path: str, payload: dict[str, object] | None, timeout: float, method: str = "POST"
    ) -> object:
        url = self.addresses[idx] + path
        try:
            async with self._http().request(
                method, url, json=payload, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                if resp.content_type == "application/json":
                    body: object = await resp.json()
                else:
                    body = await resp.text()
        except TimeoutError as e:
            if isinstance(e, (aiohttp.ClientError, CallTimeout)):  # these say what timed out
                raise
            raise CallTimeout(self.addresses[idx], method, path, timeout) from e
        if resp.status != 200:
            message = body.get("error", {}).get("message", body.get("message")) if isinstance(body, dict) else body
            raise ServerError(self.addresses[idx], resp.status, str(message))
        return body

    async def ask_health(self, idx: int, timeout: float) -> object:
        """``GET /health`` of server ``idx``, set aside or not (the `FleetMonitor`'s probe); raises
        as `request` does, never `ServerUnavailable`."""
        return await self._call(idx, "/health", None, timeout, method="GET")

    async def fanout(
        self, path: str, payloads: list[dict[str, object]] | dict[str, object], timeout: float | None = None
    ) -> list[tuple[int, object]]:
        """Send one call to every live server concurrently (``payloads`` per server, or one for
        all); returns (server index, answer) of each. A server that refuses connections is marked
        dead; one that leaves the call unanswered for ``timeout`` (the request timeout by default)
        and ``GET /health`` for ``config.control_timeout`` is set aside; any other failure is
        raised (a server that answers ``GET /health`` but not the call: `CallTimeout`, naming the
        key to raise)."""

        async def call(i: int) -> object:
            deadline = time.monotonic() + DYING_SECONDS
            while True:
                try:
                    return await self.request(i, path, each[i], timeout)
                except ServerUnavailable:
                    return _GONE
                except aiohttp.ClientConnectorError as e:
                    self.mark_dead(i, e)
                    return _GONE
                except CallTimeout as e:
                    # The request timeout may be shorter than the health watch's: the server is set
                    # aside here once it leaves GET /health unanswered too, as the watch would.
                    if not await self._answers_health(i):
                        self.set_aside(i, f"unresponsive (no answer to {path} within {timeout:g}s nor to GET /health)")
                        return _GONE
                    raise CallTimeout(
                        self.addresses[i],
                        "POST",
                        path,
                        timeout,
                        " (rollout.request_timeout), though it answers GET /health: it is slow, not hung;"
                        " raise rollout.request_timeout",
                    ) from e
                except aiohttp.ClientConnectionError:
                    # The connection dropped mid-call: the server was killed while it answered, a
                    # pooled keep-alive connection reached one killed since, or its process is still
                    # dying (the kernel takes connections on its port until it is gone). A new TCP
                    # connection tells once it is over: a dead server refuses it.
                    refused = await self._refused(i)
                    if refused is not None:
                        self.mark_dead(i, refused)
                        return _GONE
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.2)

        timeout = timeout if timeout is not None else self.config.request_timeout
        each = payloads if isinstance(payloads, list) else [payloads] * len(self.addresses)
        targets = _only.get()
        live = list(targets) if targets is not None else self.live()
        answers = await asyncio.gather(*[call(i) for i in live], return_exceptions=True)
        out: list[tuple[int, object]] = []
        for i, answer in zip(live, answers):
            if isinstance(answer, BaseException):
                raise answer
            if answer is not _GONE:
                out.append((i, answer))
        if not out and targets is None and not self.may_return():
            raise RuntimeError(f"no rollout server is reachable (calling {path})")
        return out

    async def _answers_health(self, i: int) -> bool:
        """Whether server ``i`` answers ``GET /health`` (if with an error status) within
        ``config.control_timeout``, and is not set aside meanwhile."""
        try:
            await self.request(i, "/health", None, self.config.control_timeout, method="GET")
        except ServerError:
            return True
        except aiohttp.ClientConnectorError as e:
            self.mark_dead(i, e)
            return False
        except (aiohttp.ClientError, TimeoutError):  # ServerUnavailable too
            return False
        return True

    @contextlib.contextmanager
    def only(self, *servers: int) -> Iterator[None]:
        """Within the block, fan-outs of this task go to ``servers`` alone, live or not (to bring a
        returning server up to date with the protocol's own calls)."""
        token = _only.set(servers)
        try:
            yield
        finally:
            _only.reset(token)

    async def fanout_checked(self, path: str, payloads: list[dict[str, object]] | dict[str, object]) -> None:
        """`fanout` to an endpoint that answers ``{"success": bool, "message": str}``; raises
        RuntimeError when a server answers ``success: false``."""
        for idx, body in await self.fanout(path, payloads):
            if isinstance(body, dict) and body.get("success") is False:
                raise RuntimeError(f"{path} failed on {self.addresses[idx]}: {body.get('message')}")

    async def optional_fanout(self, path: str, payload: dict[str, object]) -> bool:
        """`fanout` to an endpoint that older SGLang versions lack; False when a server answers 404."""
        try:
            await self.fanout(path, payload)
            return True
        except ServerError as e:
            if e.status == 404:
                return False
            raise

    async def wait_healthy(self) -> None:
        """Wait until every server answers ``GET /health`` (TimeoutError after ``setup_timeout``)."""
        deadline = time.monotonic() + self.config.setup_timeout
        for i, address in enumerate(self.addresses):
            while True:
                try:
                    await self.request(i, "/health", None, timeout=5.0, method="GET")
                    break
                except (aiohttp.ClientError, asyncio.TimeoutError, ServerError) as e:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"server {address} not healthy after {self.config.setup_timeout}s: {e}"
                        ) from e
                    await asyncio.sleep(0.5)

    # ----- liveness ------------------------------------------------------------------------

    def live(self) -> list[int]:
        """The servers that take calls: not set aside, nor returning."""
        with self._lock:
            return [i for i in range(len(self.addresses)) if i not in self._out and i not in self._returning]

    def returning(self) -> list[int]:
        """Servers set aside that answer again and wait for `readmit`."""
        with self._lock:
            return sorted(self._returning)

    def may_return(self) -> bool:
        """Whether a server that is not live now may be again: one returning, or set aside for not
        answering (rather than for refusing connections)."""
        with self._lock:
            return bool(self._returning) or any(i not in self._dead for i in self._out)

    def mark_dead(self, idx: int, error: BaseException) -> None:
        """Set server ``idx`` aside for refusing connections (its process is gone)."""
        self.set_aside(idx, f"unreachable ({error})", dead=True)

    def set_aside(self, idx: int, why: str, *, dead: bool = False) -> None:
        """No more calls to server ``idx``, and every call waiting on it ends (`ServerUnavailable`);
        reported once. The `FleetMonitor` keeps asking it and hands it back when it answers. A
        returning server (being brought up to date) is set aside again."""
        with self._lock:
            if dead:
                self._dead.add(idx)
            if idx in self._out and idx not in self._returning:
                return
            self._out[idx] = why
            self._out_since.setdefault(idx, time.monotonic())
            self._returning.discard(idx)
        logger.error(
            "server %s is %s; it gets no requests, pauses or weight updates until it answers again",
            self.addresses[idx],
            why,
        )
        if self._loop is not None:
            self._loop.call_soon_threadsafe(lambda: self._aside_event(idx).set())

    def mark_returning(self, idx: int) -> None:
        """Server ``idx``, set aside, answers again: calls reach it again (its owner's, to bring it
        up to date) but it is not live until `readmit`."""
        with self._lock:
            self._returning.add(idx)
        self._aside_event(idx).clear()
        logger.warning("server %s answers again", self.addresses[idx])

    def stopped_returning(self, idx: int, error: BaseException) -> None:
        """A returning server stopped answering again: it is set aside again, which ends the calls
        waiting on it."""
        with self._lock:
            self._returning.discard(idx)
        self._aside_event(idx).set()
        logger.error("server %s stopped answering again (%s)", self.addresses[idx], type(error).__name__)

    def readmit(self, idx: int) -> None:
        """Take a returning (or set-aside) server back: it gets calls again. On the fleet's loop."""
        with self._lock:
            was = self._out.pop(idx, None)
            self._dead.discard(idx)
            self._returning.discard(idx)
            since = self._out_since.pop(idx, None)
            self._down_until[idx] = 0.0
        if was is not None or since is not None:
            logger.warning(
                "server %s is back after %.0fs; it takes requests again",
                self.addresses[idx],
                time.monotonic() - (since or 0),
            )
        self._aside_event(idx).clear()
        if self._live_again is not None:
            self._live_again.set()

    def _aside_event(self, idx: int) -> asyncio.Event:
        """Only on the fleet's loop (an Event binds to the loop it is first awaited on)."""
        event = self._aside.get(idx)
        if event is None:
            event = self._aside[idx] = asyncio.Event()
            if idx in self._out and idx not in self._returning:
                event.set()
        return event

    async def until_any_live(self, timeout: float) -> None:
        """Return once a server is live; raise when none is or may be again, or after ``timeout``
        seconds, naming the servers. While none is, one line (for all the waiting calls) is said
        every `WAITING_LINE_SECONDS`."""
        t0 = time.monotonic()
        while not self.live():
            if not self.may_return():
                raise RuntimeError("every rollout server is unreachable")
            now = time.monotonic()
            if self._none_live_since is None:
                self._none_live_since = now
            with self._lock:
                why = "; ".join(
                    f"{self.addresses[i]} {self._out.get(i, 'is returning')}"
                    for i in sorted(set(self._out) | self._returning)
                )
            if now - t0 >= timeout:
                raise RuntimeError(f"no rollout server came back within {timeout:.0f}s ({why})")
            since = now - self._none_live_since
            if since >= WAITING_LINE_SECONDS and now - self._waiting_line_at >= WAITING_LINE_SECONDS:
                self._waiting_line_at = now
                logger.warning("no rollout server is available for %.0fs; waiting for one to answer (%s)", since, why)
            self._live_again = self._live_again or asyncio.Event()
            self._live_again.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._live_again.wait(), min(1.0, timeout - (now - t0)) + 1e-3)
        self._none_live_since = None

    # ----- connections ---------------------------------------------------------------------

    async def _refused(self, i: int) -> OSError | None:
        """The error of a new TCP connection to server ``i``, or None when it takes one. A
        connection, not an HTTP call: a paused or busy server answers it at once, and a slow
        answer is taken for a busy server, not a dead one."""
        url = urllib.parse.urlsplit(self.addresses[i])
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(url.hostname, url.port), 5.0)
        except asyncio.TimeoutError:  # before OSError, of which it is a subclass
            return None
        except OSError as e:
            return e
        writer.close()
        return None

    async def all_accept_connections(self, members: list[int]) -> bool:
        """Whether every server in ``members`` is live and still takes TCP connections; one that
        refuses is marked dead."""
        probed = [i for i in members if i not in self._out]
        for i, error in zip(probed, await asyncio.gather(*(self._refused(i) for i in probed))):
            if error is not None:
                self.mark_dead(i, error)
        return all(i not in self._out and i not in self._returning for i in members)

    # ----- routing -------------------------------------------------------------------------

    def choose(self, rid: str, exclude: set[int], also: tuple[str, ...] = ()) -> int:
        """The server for ``rid`` (and the requests ``also`` sent with it in one batch), charged
        with them until `release`: the one ``rid`` went to before if it is up, else the least
        loaded server that is up and not in ``exclude``."""
        with self._lock:
            now = time.monotonic()
            alive = [i for i in range(len(self.addresses)) if i not in self._out and i not in self._returning]
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

    def release(self, idx: int, failed: bool, count: int = 1) -> None:
        """``count`` requests `choose` sent to ``idx`` are done; a failed one takes the server
        down for `DOWN_SECONDS`."""
        with self._lock:
            self._inflight[idx] -= count
            if failed:
                self._down_until[idx] = time.monotonic() + DOWN_SECONDS

    def assigned_server(self, rid: str) -> str | None:
        """The server (``host:port``) that requests with ``rid`` go to, if one was chosen."""
        with self._lock:
            idx = self._sticky.get(rid)
        return None if idx is None else self.addresses[idx].removeprefix("http://")
