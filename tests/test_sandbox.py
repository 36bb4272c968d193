"""Sandboxed code execution: hostile programs (an infinite loop, a fork bomb, a memory bomb, writes
outside the working directory, a network connection, reading the trainer's environment, 100 MB of
output) each score 0 under `CodeGrader` and are counted, while an honest solution passes and the
trainer's event loop keeps running; no process outlives its run. Each hostile program, if it were
not contained, would go on to pass the tests: a 0 means the attack failed.

Runs with every backend available here (``unshare`` needs root; ``bwrap`` needs bubblewrap)."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import time

import pytest

from areal_lite.rewards.code import CodeGrader, extract_code
from areal_lite.rewards.sandbox import UID_BASE, Sandbox, SandboxLimits, SandboxUnavailable, available_backend
from areal_lite.workflows.tools import PythonTool

BACKENDS = [
    pytest.param(
        "unshare", marks=pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root")
    ),
    pytest.param("bwrap", marks=pytest.mark.skipif(not shutil.which("bwrap"), reason="needs bubblewrap")),
]
LIMITS = SandboxLimits(timeout=3.0, cpu_seconds=5, memory_mb=256, processes=16, output_bytes=1 << 16)
TESTS = "assert add(2, 3) == 5 and add(-1, 1) == 0"
SOLUTION = "def add(a, b):\n    return a + b\n"
SECRET = "areal-secret-4b1d"


def sandbox_processes() -> list[int]:
    """Pids of the processes running as a sandbox uid."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if uid >= UID_BASE:
            pids.append(int(pid))
    return pids


def wait_until_no_sandbox_processes(seconds: float = 10.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := sandbox_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def hostile_programs(outside: str, port: int) -> dict[str, tuple[str, str]]:
    """name -> (the program, how its run must end). Each attacks, then defines a correct ``add``."""
    return {
        "memory bomb": ("hoard = []\nwhile True:\n    hoard.append(bytearray(10**8))\n", "memory_limit"),
        "write outside": (f"open({outside!r} + '/pwned', 'w').write('x')\n", "error"),
        "escape upwards": ("open('/tmp/../var/tmp/pwned', 'w').write('x')\n", "error"),
        "network": (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n", "error"),
        "read environment": (
            "import os\nfound = " + repr(SECRET) + " in str(os.environ)\n"
            "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
            "    try:\n        found |= " + repr(SECRET.encode()) + " in open(f'/proc/{pid}/environ', 'rb').read()\n"
            "    except OSError:\n        pass\n"
            "assert found\n",
            "error",
        ),
        "100 MB of output": ("import sys\nsys.stdout.write('x' * 100_000_000)\n", "output_limit"),
        "100 MB file": ("open('big', 'w').write('x' * 100_000_000)\n", "file_size_limit"),
        "infinite loop": ("while True:\n    pass\n", "timeout"),
        "fork bomb": (
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
            "timeout",
        ),
    }


@pytest.mark.timeout(300)  # a run that cannot be cleaned up fails here rather than at the suite's limit
@pytest.mark.parametrize("backend", BACKENDS)
def test_hostile_code_is_contained_scored_zero_and_counted(backend: str, tmp_path, monkeypatch) -> None:
    outside = tmp_path / "world-writable"
    outside.mkdir(mode=0o777)
    os.chmod(outside, 0o1777)  # writable by any uid: only the read-only mounts stop a write here
    monkeypatch.setenv("AREAL_TEST_SECRET", SECRET)
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    programs = hostile_programs(str(outside), server.getsockname()[1])
    grader = CodeGrader(Sandbox(LIMITS, backend=backend, max_parallel=3))

    async def grade_all() -> tuple[list[float], float]:
        gaps, last = [0.0], time.monotonic()
        done = asyncio.Event()

        async def ticker() -> None:  # the trainer's event loop must keep running meanwhile
            nonlocal last
            while not done.is_set():
                await asyncio.sleep(0.05)
                gaps.append(time.monotonic() - last)
                last = time.monotonic()

        tick = asyncio.create_task(ticker())
        rewards = await asyncio.gather(
            grader("", f"```python\n{SOLUTION}```", [], [], tests=TESTS),
            *(grader("", program + SOLUTION, [], [], tests=TESTS) for program, _ in programs.values()),
        )
        done.set()
        await tick
        return rewards, max(gaps)

    try:
        rewards, worst_gap = asyncio.run(grade_all())
        with pytest.raises(BlockingIOError):
            server.accept()  # no connection reached the trainer's side
    finally:
        server.close()
    assert rewards[0] == 1.0, "the honest solution passes"
    assert dict(zip(programs, rewards[1:])) == dict.fromkeys(programs, 0.0)
    expected = {"ok": 1}
    for _, outcome in programs.values():
        expected[outcome] = expected.get(outcome, 0) + 1
    assert {k.removeprefix("sandbox/"): v for k, v in grader.stats().items() if v and k != "sandbox/runs"} == expected
    assert os.listdir(outside) == [] and not os.path.exists("/var/tmp/pwned")
    assert worst_gap < 2.0, f"the event loop stalled for {worst_gap:.1f}s"
    assert wait_until_no_sandbox_processes() == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_processes_that_leave_the_group_die_with_the_run(backend: str) -> None:
    daemon = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(600)\n    os._exit(0)\nprint('left one behind')\n"
    result = asyncio.run(Sandbox(LIMITS, backend=backend).run(daemon))
    assert result.ok and result.stdout == "left one behind\n"
    assert wait_until_no_sandbox_processes() == []


def test_cancelled_run_leaves_nothing_running() -> None:
    sandbox = Sandbox(SandboxLimits(timeout=30))

    async def cancel_midway() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(sandbox.run("import time\nwhile True:\n    time.sleep(1)\n"), 1.0)

    asyncio.run(cancel_midway())
    assert wait_until_no_sandbox_processes() == []


def test_test_cases_on_stdin_and_exit_tricks() -> None:
    grader = CodeGrader(Sandbox(LIMITS))
    cases = [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4", "output": "6"}]
    summing = "a, b = map(int, input().split())\nprint(a + b)\n"

    async def grade(completion: str, **tests: object) -> float:
        return await grader("", completion, [], [], **tests)

    assert asyncio.run(grade(summing, test_cases=cases)) == 1.0
    assert asyncio.run(grade("print(5)", test_cases=cases)) == 0.0
    # Leaving with status 0 before the tests run, or raising SystemExit, is no pass.
    assert asyncio.run(grade("import os\nos._exit(0)\n", tests=TESTS)) == 0.0
    assert asyncio.run(grade("raise SystemExit(0)\n", tests=TESTS)) == 0.0
    assert asyncio.run(grade(SOLUTION, tests=TESTS)) == 1.0
    assert extract_code("text\n```py\nx = 1\n```\nmore\n```python\ny = 2\n```") == "y = 2\n"


def test_python_tool_reports_output_and_failures() -> None:
    tool = PythonTool(Sandbox(SandboxLimits(timeout=2.0)), max_chars=100)

    async def use() -> list[str]:
        return [await tool(code) for code in ("print(6 * 7)", "1 / 0", "while True: pass", "print('y' * 10**6)")]

    product, error, loop, flood = asyncio.run(use())
    assert product == "42\n"
    assert "ZeroDivisionError" in error and error.endswith("[error]")
    assert loop == "[timeout]" and len(flood) == 100
    assert tool.openai_tool()["function"]["name"] == "python"


def test_no_isolation_means_no_run(monkeypatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(SandboxUnavailable, match="needs root .* or bubblewrap"):
        available_backend()


def test_a_failed_set_up_is_tried_once_more_then_reported(monkeypatch) -> None:
    sandbox = Sandbox(LIMITS)
    real_run, calls = sandbox._run, []

    async def flaky(files, stdin):  # the set-up fails on the first call only
        calls.append(1)
        if len(calls) == 1:
            raise SandboxUnavailable("the sandbox could not be set up: bwrap: Creating new namespace failed")
        return await real_run(files, stdin)

    monkeypatch.setattr(sandbox, "_run", flaky)
    result = asyncio.run(sandbox.run("print(6 * 7)"))
    assert result.ok and result.stdout == "42\n" and len(calls) == 2

    async def broken(files, stdin):
        calls.append(1)
        raise SandboxUnavailable("the sandbox could not be set up: no")

    monkeypatch.setattr(sandbox, "_run", broken)
    calls.clear()
    with pytest.raises(SandboxUnavailable, match="could not be set up"):
        asyncio.run(sandbox.run("print(1)"))
    assert len(calls) == 2
