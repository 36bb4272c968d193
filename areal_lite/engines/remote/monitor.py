"""`FleetMonitor`: the watch on a `ServerFleet` that sets aside servers that stop answering and
hands back the ones that answer again.

Once started, the monitor asks every server ``GET /health`` every few seconds. A server that
refuses connections is dead; one that leaves the check unanswered for ``config.control_timeout``
seconds (a hung or stopped process: the kernel still takes its connections) is unresponsive.
Either is set aside at once (`ServerFleet.set_aside`: it gets no new calls, and every call waiting
on it ends). A server set aside keeps being asked; when it answers again it is *returning*, and the
monitor hands it to its owner's ``on_return`` (the remote engine brings it up to the current
weights and version first, then takes it back with `ServerFleet.readmit`), again after each probe
until it is readmitted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine

import aiohttp

from areal_lite.engines.remote.fleet import ServerError, ServerFleet

logger = logging.getLogger(__name__)

PROBE_SECONDS = 5.0
"""How often the monitor asks each server ``GET /health`` (at most; less with a small control timeout)."""
RETURN_PROBE_TIMEOUT = 5.0
"""How long a server set aside may take to answer ``GET /health`` for it to count as back."""


class FleetMonitor:
    """Asks the servers of ``fleet`` ``GET /health`` from `start` to `stop`, on the fleet's loop;
    ``on_return`` is called there with each returning server (see the module docstring)."""

    def __init__(self, fleet: ServerFleet, on_return: Callable[[int], Awaitable[None]]) -> None:
        self.fleet = fleet
        self.on_return = on_return
        self._watcher: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        """The probes and hand-backs in progress."""
        self._probing: set[int] = set()
        self._failing_since: dict[int, float] = {}
        """Live servers whose ``GET /health`` fails (with an error, not a timeout), since when."""
        self._handing_back: set[int] = set()
        self._hand_back_failed: set[int] = set()

    def start(self) -> None:
        """Ask every server ``GET /health`` every few seconds from now on; idempotent."""
        if self._watcher is None:
            self.fleet.call(self._start()).result()

    def stop(self) -> None:
        """Cancel the watch and the probes and hand-backs it started, and wait for them."""
        if self._watcher is not None:
            self.fleet.call(self._stop()).result()

    async def _start(self) -> None:
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _stop(self) -> None:
        tasks = list(self._tasks) + ([self._watcher] if self._watcher is not None else [])
        self._watcher = None
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def probe_interval(self) -> float:
        return min(PROBE_SECONDS, max(0.2, self.fleet.config.control_timeout / 4))

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval())
            for i in range(len(self.fleet)):
                if i not in self._probing:
                    self._probing.add(i)
                    self._spawn(self._probe(i))

    async def _probe(self, i: int) -> None:
        try:
            if i in self.fleet.live():
                await self._probe_live(i)
            else:
                self._failing_since.pop(i, None)  # its clock starts again once it is back
                await self._probe_aside(i)
        except asyncio.CancelledError:
            raise
        except Exception:  # the monitor must outlive any one probe
            logger.exception("probing server %s failed", self.fleet.addresses[i])
        finally:
            self._probing.discard(i)

    async def _probe_live(self, i: int) -> None:
        timeout = self.fleet.config.control_timeout
        try:
            await self.fleet.ask_health(i, timeout)
            self._failing_since.pop(i, None)
            return
        except aiohttp.ClientConnectorError as e:
            self.fleet.mark_dead(i, e)
            return
        except asyncio.TimeoutError:
            self.fleet.set_aside(i, f"unresponsive (no answer to GET /health within {timeout:g}s)")
            return
        except (aiohttp.ClientError, ServerError) as e:
            failing = self._failing_since.setdefault(i, time.monotonic())
            if time.monotonic() - failing >= timeout:
                self.fleet.set_aside(i, f"unresponsive (GET /health failing for {timeout:g}s: {e})")

    async def _probe_aside(self, i: int) -> None:
        """A server set aside that answers is returning: calls reach it again (its owner's, to bring
        it up to date) but it is not live until `ServerFleet.readmit`. One that stops answering
        while returning is set aside again, which ends those calls."""
        returning = i in self.fleet.returning()
        try:
            await self.fleet.ask_health(i, self.fleet.config.control_timeout if returning else RETURN_PROBE_TIMEOUT)
        except (aiohttp.ClientError, asyncio.TimeoutError, ServerError) as e:
            if returning:
                self.fleet.stopped_returning(i, e)
            return
        if not returning:
            self.fleet.mark_returning(i)
        if i not in self._handing_back:  # not inside the probe: a hang while it is brought up to date is seen
            self._handing_back.add(i)
            self._spawn(self._hand_back(i))

    async def _hand_back(self, i: int) -> None:
        try:
            await self.on_return(i)
        except (aiohttp.ClientError, asyncio.TimeoutError, ServerError, RuntimeError) as e:
            if i not in self._hand_back_failed:  # said once; tried again after each probe
                self._hand_back_failed.add(i)
                logger.warning(
                    "bringing server %s back failed (%s: %s); trying again",
                    self.fleet.addresses[i],
                    type(e).__name__,
                    e,
                )
        else:
            self._hand_back_failed.discard(i)
        finally:
            self._handing_back.discard(i)
