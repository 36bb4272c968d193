"""The parent's side of one sandbox run (`areal_lite.rewards.sandbox`), on the event loop: the
launcher's stdout and stderr read up to a shared budget (`RunOutput`), its stdin written, the
launcher awaited through its pidfd, and its process group killed. Every wait is on a descriptor
the run owns (`Sandbox` starts the launcher with ``Popen``, not asyncio's subprocess transport)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Callable


class RunOutput:
    """stdout and stderr of one run, read together up to a shared byte budget."""

    def __init__(self, limit: int, on_overflow: Callable[[], None]) -> None:
        self.limit = limit
        self.on_overflow = on_overflow
        self.parts: list[bytearray] = [bytearray(), bytearray()]
        self.overflow = False

    async def read(self, fd: int, which: int) -> None:
        """Keep what fits; past the budget, kill the run and drain the pipe until it closes."""
        os.set_blocking(fd, False)
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                await _until_ready(fd, writing=False)
                continue
            if not chunk:
                return
            room = self.limit - len(self.parts[0]) - len(self.parts[1])
            self.parts[which] += chunk[: max(room, 0)]
            if len(chunk) > room and not self.overflow:
                self.overflow = True
                self.on_overflow()

    def text(self, which: int) -> str:
        return self.parts[which].decode(errors="replace")


async def _until_ready(fd: int, writing: bool) -> None:
    """Until ``fd`` can be read (or written) without blocking."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    (loop.add_writer if writing else loop.add_reader)(fd, wake)
    try:
        await ready
    finally:
        (loop.remove_writer if writing else loop.remove_reader)(fd)


async def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to the pipe ``fd`` without blocking the event loop."""
    os.set_blocking(fd, False)
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            await _until_ready(fd, writing=True)


async def _until_exited(proc: subprocess.Popen) -> None:
    """Until the launcher has exited (and is reaped): its pidfd turns readable then."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3): a thread waits instead
        await asyncio.to_thread(proc.wait)
        return
    try:
        while proc.poll() is None:
            await _until_ready(pidfd, writing=False)
    finally:
        os.close(pidfd)


async def reap(proc: subprocess.Popen, readers: asyncio.Future) -> None:
    """Wait for the launcher, then for its pipes to close (the namespace dies with it)."""
    await _until_exited(proc)
    try:
        await asyncio.wait_for(readers, 10.0)
    except asyncio.TimeoutError:
        readers.cancel()


def kill_group(pid: int) -> None:
    """SIGKILL to the process group of ``pid`` (the launcher's), if it is still there."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def read_all(fd: int) -> str:
    """What the status pipe holds (a few short lines, written before its writers exited)."""
    os.set_blocking(fd, False)
    chunks = []
    try:
        while chunk := os.read(fd, 4096):
            chunks.append(chunk)
    except BlockingIOError:
        pass
    finally:
        os.close(fd)
    return b"".join(chunks).decode(errors="replace")
