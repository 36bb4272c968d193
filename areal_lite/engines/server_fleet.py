"""The servers a remote client talks to: HTTP calls, routing, and which servers are alive.

Every HTTP call runs on the fleet's own event loop in a background thread, over one pooled
aiohttp session (a session must not cross loops), whatever loop or thread asked for it: `call`
hands a coroutine to that loop. A request whose rid was seen before goes to the same server;
others go to the server with the fewest requests in flight. A server that failed a request gets
no new ones for `DOWN_SECONDS` (unless all are down). A server that refuses connections is dead:
it gets no more calls of any kind, and the rest of the fleet carries on.
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

import aiohttp

from areal_lite.api.config import InferenceEngineConfig
from areal_lite.utils.cpu import pin_this_thread

logger = logging.getLogger(__name__)

DYING_SECONDS = 10.0
"""How long a fan-out call keeps retrying a server whose connections drop but whose port still
takes new ones (a killed process not gone yet) before the error is raised."""
DOWN_SECONDS = 5.0
"""A server that failed a request gets no new requests for this long (unless all are down)."""
STICKY_RIDS = 100_000
"""How many rid -> server assignments are remembered."""


_GONE = object()
"""What `ServerFleet.fanout` gets from a server found dead during the call."""


class ServerError(RuntimeError):
    """A server answered with an error status."""

    def __init__(self, address: str, status: int, message: str) -> None:
        super().__init__(f"{address} answered {status}: {message}")
        self.status = status


class ServerFleet:
    """The servers of ``config.addresses`` (``host:port``), addressed by index."""

    def __init__(self, config: InferenceEngineConfig) -> None:
        self.config = config
        self.addresses = [a if a.startswith("http") else f"http://{a}" for a in config.addresses]
        self._lock = threading.Lock()
        self._inflight = [0] * len(self.addresses)
        self._down_until = [0.0] * len(self.addresses)
        self._dead: set[int] = set()
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
            pin_this_thread(self.config.client_cores)
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()

        self._loop_thread = threading.Thread(target=run, name="remote-engine-client", daemon=True)
        self._loop_thread.start()
        ready.wait()
        self._loop = loop

    def stop(self) -> None:
        """Close the session and stop the loop thread."""
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

    async def fanout(
        self, path: str, payloads: list[dict[str, object]] | dict[str, object], timeout: float | None = None
    ) -> list[tuple[int, object]]:
        """Send one call to every live server concurrently (``payloads`` per server, or one for
        all); returns (server index, answer) of each. A server that refuses connections is marked
        dead; any other failure is raised."""

        async def call(i: int) -> object:
            deadline = time.monotonic() + DYING_SECONDS
            while True:
                try:
                    return await self.request(i, path, each[i], timeout)
                except aiohttp.ClientConnectorError as e:
                    self.mark_dead(i, e)
                    return _GONE
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
        live = self.live()
        answers = await asyncio.gather(*[call(i) for i in live], return_exceptions=True)
        out: list[tuple[int, object]] = []
        for i, answer in zip(live, answers):
            if isinstance(answer, BaseException):
                raise answer
            if answer is not _GONE:
                out.append((i, answer))
        if not out:
            raise RuntimeError(f"no rollout server is reachable (calling {path})")
        return out

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
        """The servers not marked dead."""
        with self._lock:
            return [i for i in range(len(self.addresses)) if i not in self._dead]

    def mark_dead(self, idx: int, error: BaseException) -> None:
        with self._lock:
            if idx not in self._dead:
                logger.error("server %s is unreachable (%s); it gets no more requests", self.addresses[idx], error)
            self._dead.add(idx)

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
        """Whether every server in ``members`` still takes TCP connections; one that refuses is
        marked dead."""
        probed = [i for i in members if i not in self._dead]
        for i, error in zip(probed, await asyncio.gather(*(self._refused(i) for i in probed))):
            if error is not None:
                self.mark_dead(i, error)
        return all(i not in self._dead for i in members)

    # ----- routing -------------------------------------------------------------------------

    def choose(self, rid: str, exclude: set[int], also: tuple[str, ...] = ()) -> int:
        """The server for ``rid`` (and the requests ``also`` sent with it in one batch), charged
        with them until `release`: the one ``rid`` went to before if it is up, else the least
        loaded server that is up and not in ``exclude``."""
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
