"""ServerFleet's fan-out when a server dies between calls: every connection the fleet's pool keeps
open to it is dead, yet the next fan-out must mark it dead and go on with the others (a keep-alive
connection that fails is not proof of death; a refused new connection is). And when a call times
out under a request timeout below the control timeout: a hung server is set aside, a slow one named
with the key to raise."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace

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
import asyncio, sys
from aiohttp import web

async def ok(request):
    if request.path in ("/slow", "/generate"):
        await asyncio.sleep(3.0)
    return web.json_response({"success": True})

app = web.Application()
app.router.add_route("*", "/{tail:.*}", ok)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""


@contextlib.contextmanager
def fleet_of_two(**config: float) -> Iterator[tuple[ServerFleet, list[subprocess.Popen]]]:
    """Two servers that answer every call at once (but ``/slow`` and ``/generate``, after 3 s), and
    a fleet of them."""
    ports = [find_free_port("127.0.0.1") for _ in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", APP, str(p)], start_new_session=True) for p in ports]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    fleet = ServerFleet(InferenceEngineConfig(addresses=addresses, setup_timeout=60, **config))  # type: ignore[arg-type]
    try:
        fleet.call(fleet.wait_healthy()).result()
        yield fleet, procs
    finally:
        fleet.stop()
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.fixture
def two_servers():
    with fleet_of_two() as both:
        yield both


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


@pytest.fixture
def short_timeouts():
    """A fleet whose request timeout (1 s) is below its control timeout (2 s): issue 53's
    combination, scaled down."""
    with fleet_of_two(request_timeout=1.0, control_timeout=2.0) as both:
        yield both


def test_a_fanout_timing_out_on_a_hung_server_sets_it_aside_and_goes_on(short_timeouts) -> None:
    """A stopped server (SIGSTOP: its port still takes connections) leaves a pause unanswered for
    the request timeout and GET /health for the control timeout: the fan-out sets it aside and
    answers with the other server's answer, where it used to raise a message-less TimeoutError."""
    fleet, procs = short_timeouts
    procs[1].send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    answers = fleet.call(fleet.fanout("/pause_generation", {})).result()
    took = time.monotonic() - t0
    assert [i for i, _ in answers] == [0] and fleet.live() == [0]
    assert 1.0 <= took < 1.0 + 2.0 + 3.0, took
    why = fleet._out[1]
    assert "unresponsive" in why and "/pause_generation" in why and "1s" in why
    assert [i for i, _ in fleet.call(fleet.fanout("/continue_generation", {})).result()] == [0]


def test_a_fanout_timing_out_on_a_slow_server_names_the_key(short_timeouts) -> None:
    """Servers that answer GET /health but not the call within the request timeout are slow, not
    hung: the fan-out fails with one line that names the call, the server and the key to raise."""
    from areal_lite.engines.remote.fleet import CallTimeout

    fleet, _ = short_timeouts
    with pytest.raises(CallTimeout) as e:
        fleet.call(fleet.fanout("/slow", {})).result()
    message = str(e.value)
    assert "/slow" in message and "127.0.0.1" in message and "within 1s" in message
    assert "raise rollout.request_timeout" in message and "\n" not in message
    assert fleet.live() == [0, 1], "a slow server is not set aside"


def test_generations_that_time_out_everywhere_fail_naming_the_keys(short_timeouts) -> None:
    """Every server answers GET /health but no generation within the request timeout: each try is
    retried elsewhere, with its cause in the line, and the last failure names both keys."""
    import asyncio

    from areal_lite.api.io import GenerationConfig, ModelRequest
    from areal_lite.engines.remote.sglang import RemoteSGLangEngine

    fleet, _ = short_timeouts
    engine = RemoteSGLangEngine(replace(fleet.config, request_retries=2))
    try:
        engine.initialize()
        request = ModelRequest(input_ids=[1, 2, 3], gconfig=GenerationConfig(max_new_tokens=4))
        with pytest.raises(RuntimeError) as e:
            asyncio.run(engine.agenerate(request))
        message = str(e.value)
        assert "failed 2 times (rollout.request_retries)" in message and "rollout.request_timeout" in message
        assert "POST /generate on http://127.0.0.1:" in message and "within 1s" in message
        assert engine.fleet.live() == [0, 1], "slow servers are not set aside"
    finally:
        engine.destroy()
