"""ServerFleet's fan-out when a server dies between calls: every connection the fleet's pool keeps
open to it is dead, yet the next fan-out must mark it dead and go on with the others (a keep-alive
connection that fails is not proof of death; a refused new connection is)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from areal_lite.api.config import InferenceEngineConfig
from areal_lite.engines.remote.fleet import ServerFleet
from areal_lite.utils.distributed import find_free_port

DYING = """
import socket, struct, sys, time
# A server on its way out: the port takes connections, and each request is answered by a reset, until
# the process ends.
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen(64)
s.settimeout(0.05)
print("listening", flush=True)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    try:
        c, _ = s.accept()
    except TimeoutError:
        continue
    c.settimeout(1.0)
    try:
        c.recv(65536)  # the request, left unanswered
    except OSError:
        pass
    c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    c.close()
"""

APP = """
import sys
from aiohttp import web

async def ok(request):
    return web.json_response({"success": True})

app = web.Application()
app.router.add_route("*", "/{tail:.*}", ok)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""


@pytest.fixture
def two_servers():
    ports = [find_free_port("127.0.0.1") for _ in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", APP, str(p)], start_new_session=True) for p in ports]
    fleet = ServerFleet(InferenceEngineConfig(addresses=[f"127.0.0.1:{p}" for p in ports], setup_timeout=60))
    try:
        fleet.call(fleet.wait_healthy()).result()
        yield fleet, procs
    finally:
        fleet.stop()
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_a_server_killed_between_fanouts_is_marked_dead_not_raised(two_servers) -> None:
    import asyncio

    fleet, procs = two_servers

    async def many_at_once(n: int) -> None:  # leaves n keep-alive connections to each server in the pool
        await asyncio.gather(*(fleet.fanout("/pause_generation", {}) for _ in range(n)))

    fleet.call(many_at_once(8)).result()
    procs[1].send_signal(signal.SIGKILL)
    procs[1].wait()
    time.sleep(0.2)
    answers = fleet.call(fleet.fanout("/continue_generation", {})).result()
    assert [i for i, _ in answers] == [0]
    assert fleet.live() == [0]
    assert [i for i, _ in fleet.call(fleet.fanout("/continue_generation", {})).result()] == [0]


def test_a_dying_server_is_retried_until_it_refuses_connections(two_servers) -> None:
    """Server 1 is replaced by a process that resets every request for 1.5 s, then exits: the
    fan-out neither raises nor waits on it longer than that; it ends up marked dead."""
    fleet, procs = two_servers
    procs[1].send_signal(signal.SIGKILL)
    procs[1].wait()
    port = int(fleet.addresses[1].rsplit(":", 1)[1])
    dying = subprocess.Popen([sys.executable, "-c", DYING, str(port), "1.5"], stdout=subprocess.PIPE, text=True)
    try:
        assert dying.stdout is not None and dying.stdout.readline().strip() == "listening"
        t0 = time.monotonic()
        answers = fleet.call(fleet.fanout("/pause_generation", {})).result()
        assert [i for i, _ in answers] == [0] and fleet.live() == [0]
        assert time.monotonic() - t0 < 8
    finally:
        dying.kill()
        dying.wait()
