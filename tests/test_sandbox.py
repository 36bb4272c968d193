"""Sandboxed code execution: hostile programs (an infinite loop, a fork bomb, a memory bomb, writes
outside the working directory, a network connection, reading the trainer's environment, 100 MB of
output) each score 0 under `CodeGrader` and are counted, while an honest solution passes and the
trainer's event loop keeps running; no process outlives its run. Each hostile program, if it were
not contained, would go on to pass the tests: a 0 means the attack failed.

Runs with every backend available here (``unshare`` needs root; ``bwrap`` needs bubblewrap)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import sys
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
# 6 s of wall time: at 3 s, on a machine loaded far beyond its 2 cores, an attack that is stopped by its
# own limit (a 16 MB file, a refused connection) was sometimes stopped by the clock first.
LIMITS = SandboxLimits(timeout=6.0, cpu_seconds=10, memory_mb=256, processes=16, output_bytes=1 << 16)
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
        # in 1 MB writes: one 100 MB string timed out (3 s) before the 16 MB limit on a loaded machine
        "endless file": ("f = open('big', 'w')\nwhile True:\n    f.write('x' * 1_000_000)\n", "file_size_limit"),
        "infinite loop": ("while True:\n    pass\n", "timeout"),
        # Stopped by the clock or, where the kernel charges the 16 children's copied pages past the
        # memory cap first (it did in two full suites), by the memory limit: contained either way.
        "fork bomb": (
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
            "timeout|memory_limit",
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
    counted = {k.removeprefix("sandbox/"): v for k, v in grader.stats().items() if v and k != "sandbox/runs"}
    expected = {"ok": 1}
    for _, outcome in programs.values():
        if "|" in outcome:  # either way out: take the one that was counted
            outcome = next((o for o in outcome.split("|") if counted.get(o, 0) > expected.get(o, 0)), outcome)
        expected[outcome] = expected.get(outcome, 0) + 1
    assert counted == expected
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

    async def flaky(files, stdin, checker):  # the set-up fails on the first call only
        calls.append(1)
        if len(calls) == 1:
            raise SandboxUnavailable("the sandbox could not be set up: bwrap: Creating new namespace failed")
        return await real_run(files, stdin, checker)

    monkeypatch.setattr(sandbox, "_run", flaky)
    result = asyncio.run(sandbox.run("print(6 * 7)"))
    assert result.ok and result.stdout == "42\n" and len(calls) == 2

    async def broken(files, stdin, checker):
        calls.append(1)
        raise SandboxUnavailable("the sandbox could not be set up: no")

    monkeypatch.setattr(sandbox, "_run", broken)
    calls.clear()
    with pytest.raises(SandboxUnavailable, match="could not be set up"):
        asyncio.run(sandbox.run("print(1)"))
    assert len(calls) == 2


# ---- sockets and kernel interfaces: the seccomp filter -------------------------------------------

SOCKET_PROBE = """
import errno, json, socket
def attempt(make):
    try:
        make()
        return "made"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
def vsock_bind():
    s = socket.socket(40, socket.SOCK_STREAM)  # AF_VSOCK: a port bound here would be taken on the host
    s.bind((0xFFFFFFFF, 52000))
def connect(family, address):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(2)
    s.connect(address)
found = {
    "vsock": attempt(lambda: socket.socket(40, socket.SOCK_STREAM)),
    "vsock bind": attempt(vsock_bind),
    "netlink": attempt(lambda: socket.socket(16, socket.SOCK_RAW, 0)),
    "packet": attempt(lambda: socket.socket(17, socket.SOCK_DGRAM, 0)),
    "alg": attempt(lambda: socket.socket(38, socket.SOCK_SEQPACKET, 0)),
    "vsock pair": attempt(lambda: socket.socketpair(40, socket.SOCK_STREAM)),
    "inet": attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM)),
    "inet6": attempt(lambda: socket.socket(socket.AF_INET6, socket.SOCK_STREAM)),
    "unix pair": attempt(lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)),
    "inet connect": attempt(lambda: connect(socket.AF_INET, ("127.0.0.1", INET_PORT))),
    "inet6 connect": attempt(lambda: connect(socket.AF_INET6, ("::1", INET6_PORT))),
    "unix connect": attempt(lambda: connect(socket.AF_UNIX, UNIX_NAME)),
}
print(json.dumps(found))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_the_confined_socket_families_open(backend: str) -> None:
    servers = [socket.create_server(("127.0.0.1", 0))]
    try:
        servers.append(socket.create_server(("::1", 0), family=socket.AF_INET6))
    except OSError:
        servers.append(socket.create_server(("127.0.0.1", 0)))  # no IPv6 here: the connect fails anyway
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix_name = f"\0areal-sandbox-test-{os.getpid()}"  # abstract: seen by network namespace
    unix.bind(unix_name)
    unix.listen()
    servers.append(unix)
    for server in servers:
        server.setblocking(False)
    code = (
        f"INET_PORT, INET6_PORT, UNIX_NAME = {servers[0].getsockname()[1]}, {servers[1].getsockname()[1]}, "
        f"{unix_name!r}\n" + SOCKET_PROBE
    )
    try:
        result = asyncio.run(Sandbox(LIMITS, backend=backend).run(code))
        for server in servers:
            with pytest.raises(BlockingIOError):
                server.accept()  # nothing reached the trainer's side
    finally:
        for server in servers:
            server.close()
    assert result.ok, result.stderr
    found = json.loads(result.stdout)
    refused = {"vsock", "vsock bind", "netlink", "packet", "alg", "vsock pair"}
    assert {k: v for k, v in found.items() if k in refused} == dict.fromkeys(refused, "EAFNOSUPPORT")
    # The families the network namespace confines still open, and still reach nothing outside.
    assert found["inet"] == found["inet6"] == found["unix pair"] == "made"
    unreached = ("ENETUNREACH", "ECONNREFUSED", "EADDRNOTAVAIL")  # loopback down (unshare) or empty (bwrap)
    assert found["inet connect"] in unreached and found["inet6 connect"] in unreached
    assert found["unix connect"] == "ECONNREFUSED"


KERNEL_PROBE = """
import ctypes, errno, json, os, subprocess, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
NR = {"x86_64": {"io_uring_setup": 425, "bpf": 321, "userfaultfd": 323},
      "aarch64": {"io_uring_setup": 425, "bpf": 280, "userfaultfd": 282}}[os.uname().machine]
def attempt(call):
    ctypes.set_errno(0)
    result = call()
    return "made" if result >= 0 else errno.errorcode[ctypes.get_errno()]
params = (ctypes.c_char * 120)()
found = {
    "memfd": attempt(lambda: libc.memfd_create(b"x", 0)),
    "shmget": attempt(lambda: libc.shmget(0, 1 << 20, 0o1600)),
    "io_uring": attempt(lambda: libc.syscall(NR["io_uring_setup"], 4, params)),
    "bpf": attempt(lambda: libc.syscall(NR["bpf"], 0, None, 0)),
    "userfaultfd": attempt(lambda: libc.syscall(NR["userfaultfd"], 0)),
    "user namespace": attempt(lambda: libc.unshare(0x10000000)),
    "mount namespace": attempt(lambda: libc.unshare(0x00020000)),
}
# What ordinary programs do still works: threads (glibc falls back from clone3 to clone), fork, exec.
box = []
thread = threading.Thread(target=box.append, args=(1,))
thread.start(); thread.join()
found["thread"] = "made" if box else "failed"
found["subprocess"] = subprocess.run([sys.executable, "-c", "print(7)"], capture_output=True, text=True).stdout.strip()
print(json.dumps(found))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_interfaces_past_the_limits_are_refused(backend: str) -> None:
    result = asyncio.run(Sandbox(LIMITS, backend=backend).run(KERNEL_PROBE))
    assert result.ok, result.stderr
    found = json.loads(result.stdout)
    refused = ("memfd", "shmget", "io_uring", "bpf", "userfaultfd", "user namespace", "mount namespace")
    assert {k: found[k] for k in refused} == dict.fromkeys(refused, "EPERM")
    assert found["thread"] == "made" and found["subprocess"] == "7"


def test_seccomp_filter_is_refused_for_an_unknown_architecture() -> None:
    from areal_lite.rewards.sandbox_init import seccomp_filter

    assert len(seccomp_filter([1, 2, 10], "x86_64")) % 8 == 0
    with pytest.raises(OSError, match="no seccomp filter for riscv64"):
        seccomp_filter([1, 2, 10], "riscv64")


# ---- memory: a cgroup per run where there is one, the filter and read-only tmpfs everywhere --------

MEMORY_PATHS = {
    # 4 processes of 60 MiB each: each within its address space, together past the run's 128 + 64 MiB
    "processes": (
        "import os, time\nkids = []\nfor _ in range(4):\n    pid = os.fork()\n    if pid == 0:\n"
        "        block = bytearray(60 << 20)\n        for i in range(0, len(block), 4096):\n            block[i] = 1\n"
        "        time.sleep(2)\n        os._exit(0)\n    kids.append(pid)\n"
        "assert all(os.waitpid(pid, 0)[1] == 0 for pid in kids)\nprint('held')\n"
    ),
    "tmp files": "for i in range(24):\n    open(f'f{i}', 'wb').write(b'x' * (10 << 20))\nprint('held')\n",
    "memfd": (
        "import os\nfds = []\nfor _ in range(40):\n    fd = os.memfd_create('x')\n"
        "    os.pwrite(fd, b'x' * (15 << 20), 0)\n    fds.append(fd)\nprint('held')\n"
    ),
    "shared memory": (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmat.restype = ctypes.c_void_p\n"
        "for _ in range(3):\n    sid = libc.shmget(0, 100 << 20, 0o1600)\n    assert sid >= 0, ctypes.get_errno()\n"
        "    address = libc.shmat(sid, None, 0)\n    ctypes.memset(address, 1, 100 << 20)\n"
        "    libc.shmdt(ctypes.c_void_p(address))\nprint('held')\n"
    ),
    "/dev/shm": "for i in range(24):\n    open(f'/dev/shm/f{i}', 'wb').write(b'x' * (10 << 20))\nprint('held')\n",
}


def leftover_cgroups() -> list[str]:
    from areal_lite.rewards.sandbox_cgroup import memory_cgroup_parent

    where = memory_cgroup_parent()
    return [n for n in os.listdir(where[0]) if n.startswith("areal-sandbox-")] if where else []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_memory_is_bounded_per_run_whatever_the_path(backend: str) -> None:
    """Each program holds 240 MiB or more, by another path, with 128 MiB of memory and 64 MiB of
    files: none gets there."""
    limits = SandboxLimits(timeout=20.0, memory_mb=128, tmp_mb=64, file_size_mb=16, output_bytes=1 << 16)
    sandbox = Sandbox(limits, backend=backend)

    async def run_all() -> list:
        return await asyncio.gather(*(sandbox.run(code) for code in MEMORY_PATHS.values()))

    results = dict(zip(MEMORY_PATHS, asyncio.run(run_all())))
    assert {name: "held" in r.stdout for name, r in results.items()} == dict.fromkeys(MEMORY_PATHS, False)
    # Denied by the filter or a read-only mount, with or without a cgroup:
    assert "Operation not permitted" in results["memfd"].stderr
    assert "AssertionError: 1" in results["shared memory"].stderr  # EPERM from shmget
    assert "Read-only file system" in results["/dev/shm"].stderr
    assert "No space left on device" in results["tmp files"].stderr  # /tmp's size
    if sandbox.memory_cgroup:  # the cgroup alone stops this one: the rlimits let each process through
        assert results["processes"].outcome == "memory_limit"
    assert leftover_cgroups() == []
    assert wait_until_no_sandbox_processes() == []


@pytest.mark.skipif(os.geteuid() != 0, reason="a memory cgroup needs root")
def test_memory_cgroup_is_found_where_root_can_make_one() -> None:
    """Where this machine lets root make a memory cgroup (v2 or v1), the sandbox uses one by
    default; asked to use none, it says so; asked to require one where none can be made, it refuses."""
    from areal_lite.rewards.sandbox_cgroup import memory_cgroup_parent

    where = memory_cgroup_parent()
    if where is None:
        with pytest.raises(SandboxUnavailable, match="no memory cgroup can be made here"):
            Sandbox(LIMITS, memory_cgroup=True)
    else:
        assert Sandbox(LIMITS).memory_cgroup and os.path.isdir(where[0]) and where[1] in (1, 2)
    assert not Sandbox(LIMITS, memory_cgroup=False).memory_cgroup


# ---- CodeGrader: tests graded where the solution cannot reach, by value -------------------------

GAMES = {
    # the pass token of the old harness sat in the caller's frame
    "token in the frame": (
        "import os, sys\nframe = sys._getframe(1)\nprint('\\n' + str(frame.f_locals.get('token')))\n"
        "sys.stdout.flush()\nos._exit(0)\n"
    ),
    "equal to anything": (
        "class Anything:\n    def __eq__(self, other):\n        return True\n    def __ne__(self, other):\n"
        "        return False\n    __hash__ = object.__hash__\n"
        "def add(a, b):\n    return Anything()\n"
    ),
    "an int equal to anything": (
        "class Anything(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
        "def add(a, b):\n    return Anything(0)\n"
    ),
    "patched comparison": (
        "import builtins\nbuiltins.AssertionError = type('Quiet', (Exception,), {})\ndef add(a, b):\n    return 0\n"
    ),
    "search the interpreter": (
        "import gc, os, sys\nfound = [o for o in gc.get_objects() if isinstance(o, (dict, str)) and 'assert' in str(o)[:10000]]\n"
        "print([str(o)[:200] for o in found][:5]); sys.stdout.flush()\nos._exit(0)\n"
    ),
    "inspect the other processes": (
        "import ctypes, os, sys\nlibc = ctypes.CDLL(None, use_errno=True)\nseen = []\n"
        "for pid in filter(str.isdigit, os.listdir('/proc')):\n    if int(pid) == os.getpid():\n        continue\n"
        "    for name in ('cmdline', 'environ', 'mem', 'maps', 'fd/3'):\n        try:\n"
        "            seen.append(open(f'/proc/{pid}/{name}', 'rb').read(4096))\n        except OSError:\n            pass\n"
        "    if libc.ptrace(16, int(pid), None, None) == 0:\n        seen.append(b'attached ' + pid.encode())\n"
        "print(b'MARKER-4711' in b''.join(seen), [s[:80] for s in seen if b'attached' in s])\n"
        "def add(a, b):\n    return 0\n"
    ),
}
TESTS_WITH_MARKER = "assert add(2, 3) == 5 and add(-1, 1) == 0  # MARKER-4711\n"


@pytest.mark.parametrize("backend", BACKENDS)
def test_grader_cannot_be_gamed(backend: str) -> None:
    """Each program tries to pass without adding (the token, its own __eq__, a patched builtin,
    the tests' text in memory, the checker's process): all score 0; the honest one passes."""
    grader = CodeGrader(Sandbox(LIMITS, backend=backend))

    async def grade_all() -> list[float]:
        return await asyncio.gather(
            grader("", SOLUTION, [], [], tests=TESTS_WITH_MARKER),
            *(grader("", game, [], [], tests=TESTS_WITH_MARKER) for game in GAMES.values()),
        )

    rewards = asyncio.run(grade_all())
    assert rewards[0] == 1.0
    assert dict(zip(GAMES, rewards[1:])) == dict.fromkeys(GAMES, 0.0)
    inspect = asyncio.run(grader.sandbox.run(GAMES["inspect the other processes"] + "print(add(1, 2))\n"))
    assert inspect.stdout.startswith("False []"), inspect.stdout  # neither read nor traced anything
    assert wait_until_no_sandbox_processes() == []


HONEST = """
import math

class ListNode:
    def __init__(self, val, next=None):
        self.val, self.next = val, next

class Solution:
    def two_sum(self, nums, target):
        seen = {}
        for i, n in enumerate(nums):
            if target - n in seen:
                return [seen[target - n], i]
            seen[n] = i

def stats(xs, *, digits=2):
    return {"mean": round(sum(xs) / len(xs), digits), "range": (min(xs), max(xs)), "unique": set(xs)}

def factorial(n):
    if n < 0:
        raise ValueError("negative")
    return math.factorial(n)

def countdown(n):
    yield from range(n, 0, -1)

def from_list(values):
    head = None
    for v in reversed(values):
        head = ListNode(v, head)
    return head

def encode(s):
    return s.encode(), None, 1.5, complex(1, 2)

LIMIT = 10 ** 30

if __name__ == "__main__":
    input()  # a main block does not run under the tests
"""
HONEST_TESTS = """
assert Solution().two_sum([2, 7, 11, 15], 9) == [0, 1]
assert stats([1, 2, 2, 5], digits=1) == {"mean": 2.5, "range": (1, 5), "unique": {1, 2, 5}}
assert factorial(30) == 265252859812191058636308480000000 and LIMIT == 10 ** 30
try:
    factorial(-1)
except ValueError as e:
    assert str(e) == "negative"
else:
    raise AssertionError("no ValueError")
assert list(countdown(3)) == [3, 2, 1] and 2 in countdown(3) and 5 not in countdown(3)
node, seen = from_list([1, 2, 3]), []
while node is not None:
    seen.append(node.val)
    node = node.next
assert seen == [1, 2, 3] and from_list([4])
assert encode("é") == ("é".encode(), None, 1.5, 1 + 2j)
"""


def test_grader_compares_plain_values_of_honest_solutions() -> None:
    """Classes, methods, keyword arguments, exceptions, generators, linked objects, big ints and
    every plain type cross between the two processes; an object where a value is expected fails."""
    grader = CodeGrader(Sandbox(LIMITS))

    async def grade(solution: str, tests: str) -> float:
        return await grader("", solution, [], [], tests=tests)

    assert asyncio.run(grade(HONEST, HONEST_TESTS)) == 1.0
    assert asyncio.run(grade(HONEST, HONEST_TESTS + "assert factorial(3) == 7\n")) == 0.0
    # A node is an object, not a value: comparing it fails even when its fields match.
    assert asyncio.run(grade(HONEST, "assert from_list([1]) == from_list([1])\n")) == 0.0
    assert asyncio.run(grade(HONEST, "assert from_list([1]) != 0\n")) == 0.0


def test_harness_codec_keeps_plain_data_and_refers_to_the_rest() -> None:
    from areal_lite.rewards.code_harness import decode, encode

    class Number(int):
        pass

    refs: list[object] = []

    def ref(value: object) -> dict:
        refs.append(value)
        return {"ref": len(refs) - 1}

    plain = [None, True, 3, -(2**80), 2.5, "é", b"\x00\xff", (1, (2,)), {1, 2}, frozenset({3}), {(1, 2): [{}]}, 1j]
    wire = json.loads(json.dumps(encode(plain, ref)))
    assert decode(wire, refs.__getitem__) == plain and refs == []
    odd = [Number(5), object(), [Number(1)]]
    assert decode(json.loads(json.dumps(encode(odd, ref))), refs.__getitem__) == [refs[0], refs[1], [refs[2]]]
    assert type(refs[0]) is Number and len(refs) == 3
    with pytest.raises(ValueError, match="not plain data"):
        decode({"object": "os.system"}, refs.__getitem__)


# ---- text that is not valid Unicode ---------------------------------------------------------------


def test_undecodable_text_scores_zero() -> None:
    """A lone surrogate in the code, the tests' input or a file cannot be written down: the run is
    an error (counted), never a retried set-up failure."""
    grader = CodeGrader(Sandbox(LIMITS))

    async def grade_all() -> list[float]:
        return await asyncio.gather(
            grader("", "print('\ud800')", [], [], test_cases=[{"input": "", "output": "x"}]),
            grader("", "print(input())", [], [], test_cases=[{"input": "\udc80", "output": "x"}]),
            grader("", SOLUTION + "# \udfff\n", [], [], tests=TESTS),
        )

    assert asyncio.run(grade_all()) == [0.0, 0.0, 0.0]
    assert grader.stats()["sandbox/error"] == 3.0
    result = asyncio.run(grader.sandbox.run("print(1)", files={"data.txt": "\ud800"}))
    assert result.outcome == "error" and "data.txt is not valid Unicode" in result.stderr


@pytest.mark.timeout(120)  # before the fix asyncio.run's clean-up waited forever here
def test_runs_cancelled_by_a_failing_sibling_end_cleanly() -> None:
    """``asyncio.gather`` of many runs and one coroutine that raises: ``asyncio.run`` cancels the
    runs at every stage (starting, writing, running) and returns; nothing is left behind."""
    sandbox = Sandbox(SandboxLimits(timeout=30.0), max_parallel=16)

    async def fail_after(delay: float) -> None:
        await asyncio.sleep(delay)
        raise RuntimeError("a sibling failed")

    async def main(delay: float) -> None:
        await asyncio.gather(*(sandbox.run("import time\ntime.sleep(30)\n") for _ in range(16)), fail_after(delay))

    for delay in (0.0, 0.005, 0.05, 0.3):
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="a sibling failed"):
            asyncio.run(main(delay))
        assert time.monotonic() - start < 20.0
    assert wait_until_no_sandbox_processes() == [] and leftover_cgroups() == []


HOST_VIEW = r"""
import json, os, sys
seen, read = [], {}
for root, dirs, files in os.walk("/"):
    if root in ("/proc", "/dev", "/tmp") or root.startswith(tuple(sys.argv[1:])):
        dirs[:] = []  # the kernel's own, the run's own, and the system's trees (listed at their top)
    seen += [os.path.join(root, n) for n in dirs + files]
for path in json.loads(open("wanted.json").read()):
    try:
        read[path] = open(path, "rb").read(64).decode(errors="replace") if not os.path.isdir(path) else os.listdir(path)
    except OSError as e:
        read[path] = type(e).__name__
wrote = {}
for path in ("/usr/x", "/etc/x", "/x", "/dev/x", "/tmp/x"):
    try:
        open(path, "w").close()
        wrote[path] = "written"
    except OSError as e:
        wrote[path] = type(e).__name__
print(json.dumps({"seen": sorted(seen), "read": read, "wrote": wrote}))
"""


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("interpreter", ["system", "this one"])
def test_a_program_sees_no_host_file_but_what_the_interpreter_needs(backend: str, interpreter: str, tmp_path) -> None:
    """Issue 53: a program that lists the whole tree it can see and reads world-readable host files
    (this checkout, the home directory, /etc/passwd, /etc/hostname, a file the trainer left in its
    /tmp) sees only the system directories, the interpreter's prefix, a few files of /etc, its
    devices, /proc and its own /tmp, and can read none of those files; nothing outside /tmp can be
    written. Under the system's python3, and under this interpreter wherever it lives (named by its
    virtual environment's link; a prefix outside /usr, e.g. pyenv's under the home directory, is
    shown alone)."""
    from areal_lite.rewards.sandbox import ETC_FILES, system_python, visible_paths

    python = system_python() if interpreter == "system" else sys.executable  # a virtual environment's link
    binds, links = visible_paths(python)
    left = tmp_path / "left-behind.txt"
    left.write_text("a file of the trainer's\n")
    left.chmod(0o644)
    here = os.path.dirname(os.path.abspath(__file__))
    wanted = [os.path.join(os.path.dirname(here), "README.md"), os.path.expanduser("~"), "/etc/passwd",
              "/etc/hostname", "/etc/hosts", str(left), here, "/home", "/root", "/var", "/sys"]  # fmt: skip
    wanted = [p for p in wanted if os.path.exists(p) and not any(p == b or p.startswith(b + "/") for b in binds)]
    assert len(wanted) >= 5, wanted  # readable here, hidden there
    big = [p for p in binds if os.path.isdir(p)] + list(links)
    code = f"import sys\nsys.argv[1:] = {big!r}\n" + HOST_VIEW
    sandbox = Sandbox(LIMITS, backend=backend, python=python)
    result = asyncio.run(sandbox.run(code, files={"wanted.json": json.dumps(wanted)}))
    assert result.ok, result.stderr
    view = json.loads(result.stdout)

    shown = ["/dev", "/proc", "/tmp", *binds, *links]
    through = set()  # the directories a deep path is reached through
    for path in shown:
        while (path := os.path.dirname(path)) != "/":
            through.add(path)
    outside = [p for p in view["seen"] if p not in through and not any(p == s or p.startswith(s + "/") for s in shown)]
    assert not outside, f"host paths visible in the sandbox: {outside}"
    etc = sorted(p for p in view["seen"] if os.path.dirname(p) == "/etc")
    assert etc == sorted(f"/etc/{n}" for n in ETC_FILES if os.path.lexists(f"/etc/{n}"))
    # A directory a shown path is reached through (pyenv's prefix: /root) lists that path alone.
    leads = {p: sorted({s[len(p) + 1 :].split("/")[0] for s in shown if s.startswith(p + "/")}) for p in through}
    assert view["read"] == {p: leads.get(p, "FileNotFoundError") for p in wanted}
    assert view["wrote"].pop("/tmp/x") == "written"
    assert all(v in ("OSError", "PermissionError") for v in view["wrote"].values()), view["wrote"]
