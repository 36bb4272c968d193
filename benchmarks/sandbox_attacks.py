"""Hostile programs against the sandbox, many at once: each attack either is contained or not.

Each program attacks (files, /proc, the environment, ptrace, the network, bombs, signals, daemons,
floods, sockets past the network namespace, memory past the rlimits, the grader itself) and prints
``ESCAPED <what>`` when the attack worked; the trainer's side checks what a program cannot report
(a file written outside, a connection that arrived, a process left running) and how long its own
event loop stalled at worst. Every attack runs ``--copies`` times, all of them ``--parallel`` at once on one `Sandbox` per
backend; the grader's attacks go through `CodeGrader` and must score 0 while an honest solution
scores 1. Prints one row per attack (how its runs ended, contained or not) and ends with
``RESULT <backend>_contained=<attacks contained>/<attacks> <backend>_runs_per_s=...``.

Run: ``.venv/bin/python benchmarks/sandbox_attacks.py [--copies 3 --parallel 64]`` (as root, or
with bubblewrap installed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import tempfile
import time
from collections import Counter

from areal_lite.rewards.code import CodeGrader
from areal_lite.rewards.sandbox import UID_BASE, Sandbox, SandboxLimits

SECRET = "areal-attack-secret-81f3"
SOLUTION = "def add(a, b):\n    return a + b\n"
TESTS = "assert add(2, 3) == 5 and add(-1, 1) == 0\n"


def attacks(outside: str, private: str, tcp: int, udp: int, unix: str) -> dict[str, str]:
    """name -> program; a program prints ESCAPED when its attack worked."""
    alloc = "block = bytearray({mb} << 20)\nfor i in range(0, len(block), 4096):\n    block[i] = 1\n"
    return {
        "write outside /tmp": f"open({outside!r} + '/pwned', 'w').write('x')\nprint('ESCAPED write')\n",
        "escape upwards": "open('/tmp/../var/tmp/pwned-areal', 'w').write('x')\nprint('ESCAPED write')\n",
        "read a private file": f"print('ESCAPED read', open({private!r}).read())\n",
        "/proc: the trainer": (
            "import os\nfor pid in filter(str.isdigit, os.listdir('/proc')):\n    try:\n"
            "        if b'sandbox_attacks' in open(f'/proc/{pid}/cmdline', 'rb').read():\n"
            "            print('ESCAPED sees the trainer', pid)\n    except OSError:\n        pass\n"
        ),
        "environment": (
            f"import os\nif {SECRET!r} in str(os.environ):\n    print('ESCAPED env')\n"
            "for pid in filter(str.isdigit, os.listdir('/proc')):\n    try:\n"
            f"        if {SECRET.encode()!r} in open(f'/proc/{{pid}}/environ', 'rb').read():\n"
            "            print('ESCAPED environ', pid)\n    except OSError:\n        pass\n"
        ),
        "ptrace": (
            "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
            "    if int(pid) != os.getpid() and libc.ptrace(16, int(pid), None, None) == 0:\n"
            "        print('ESCAPED ptrace', pid)\n"
        ),
        "tcp to the trainer": (
            f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {tcp}), timeout=2)\n"
            "    print('ESCAPED tcp')\nexcept OSError:\n    pass\n"
        ),
        "udp to the trainer": (
            f"import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\ntry:\n"
            f"    s.sendto(b'x', ('127.0.0.1', {udp}))\nexcept OSError:\n    pass\n"
        ),
        "ipv6 to the trainer": (
            f"import socket\ntry:\n    socket.create_connection(('::1', {tcp}), timeout=2)\n"
            "    print('ESCAPED tcp6')\nexcept OSError:\n    pass\n"
        ),
        "abstract unix socket": (
            f"import socket\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect({unix!r})\n"
            "    print('ESCAPED unix')\nexcept OSError:\n    pass\n"
        ),
        "vsock": (
            "import socket\ntry:\n    s = socket.socket(40, socket.SOCK_STREAM)\n    s.bind((0xFFFFFFFF, 52011))\n"
            "    print('ESCAPED vsock')\nexcept OSError:\n    pass\n"
        ),
        "netlink": "import socket\ntry:\n    socket.socket(16, socket.SOCK_RAW, 0)\n    print('ESCAPED netlink')\nexcept OSError:\n    pass\n",
        "io_uring": (
            "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "if libc.syscall(425, 4, (ctypes.c_char * 120)()) >= 0:\n    print('ESCAPED io_uring')\n"
        ),
        "user namespace": (
            "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "if libc.unshare(0x10000000 | 0x00020000) == 0:\n    print('ESCAPED userns')\n"
        ),
        "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        "thread bomb": (
            "import threading, time\nwhile True:\n    try:\n"
            "        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            "    except RuntimeError:\n        pass\n"
        ),
        "memory bomb": "hoard = []\nwhile True:\n    hoard.append(bytearray(10**8))\n",
        "memory in processes": (
            "import os, time\nkids = []\nfor _ in range(6):\n    pid = os.fork()\n    if pid == 0:\n"
            + "".join("        " + line + "\n" for line in alloc.format(mb=120).splitlines())
            + "        time.sleep(2)\n        os._exit(0)\n    kids.append(pid)\n"
            "if all(os.waitpid(p, 0)[1] == 0 for p in kids):\n    print('ESCAPED 720 MiB held')\n"
        ),
        "memfd": (
            "import os\nfds = []\nfor _ in range(40):\n    fd = os.memfd_create('x')\n"
            "    os.pwrite(fd, b'x' * (15 << 20), 0)\n    fds.append(fd)\nprint('ESCAPED memfd 600 MiB')\n"
        ),
        "shared memory": (
            "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmat.restype = ctypes.c_void_p\n"
            "for _ in range(6):\n    sid = libc.shmget(0, 100 << 20, 0o1600)\n    assert sid >= 0\n"
            "    address = libc.shmat(sid, None, 0)\n    ctypes.memset(address, 1, 100 << 20)\n"
            "    libc.shmdt(ctypes.c_void_p(address))\nprint('ESCAPED shm 600 MiB')\n"
        ),
        "/dev/shm": "for i in range(60):\n    open(f'/dev/shm/f{i}', 'wb').write(b'x' * (10 << 20))\nprint('ESCAPED /dev/shm')\n",
        "fill /tmp": "for i in range(60):\n    open(f'f{i}', 'wb').write(b'x' * (10 << 20))\nprint('ESCAPED /tmp')\n",
        "cpu spin": "while True:\n    pass\n",
        "kill everything": "import os, signal, time\nos.kill(-1, signal.SIGKILL)\ntime.sleep(1)\n",
        "daemon": (
            "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(600)\n"
            "    os._exit(0)\n"
        ),
        "stdout flood": "import sys\nsys.stdout.write('x' * 100_000_000)\n",
        "stderr flood": "import sys\nsys.stderr.write('x' * 100_000_000)\n",
        "open files": "fds = []\nwhile True:\n    fds.append(open('/dev/null'))\n",
    }


GRADER_ATTACKS: dict[str, tuple[str, dict]] = {  # name -> (completion, the item's tests)
    "grader: token in the frame": (
        (
            "import os, sys\nframe = sys._getframe(1)\nprint('\\n' + str(frame.f_locals.get('token')))\n"
            "sys.stdout.flush()\nos._exit(0)\n"
        ),
        {"tests": TESTS},
    ),
    "grader: __eq__ always true": (
        (
            "class Anything:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"
            "def add(a, b):\n    return Anything()\n"
        ),
        {"tests": TESTS},
    ),
    "grader: int subclass": (
        (
            "class Anything(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
            "def add(a, b):\n    return Anything(0)\n"
        ),
        {"tests": TESTS},
    ),
    "grader: lone surrogate": ("print(input())\n", {"test_cases": [{"input": "\udc80", "output": "x"}]}),
}


def sandbox_processes() -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                if next(int(line.split()[1]) for line in f if line.startswith("Uid:")) >= UID_BASE:
                    pids.append(int(pid))
        except (OSError, StopIteration):
            pass
    return pids


def trainer_side() -> tuple[str, str, list[socket.socket]]:
    """A directory with a world-writable folder and a private file; TCP, UDP and abstract unix
    servers of the trainer's (nonblocking, to see whether anything arrived)."""
    work = tempfile.mkdtemp(prefix="areal-attacks-")
    os.mkdir(os.path.join(work, "open"))
    os.chmod(os.path.join(work, "open"), 0o1777)
    with open(os.path.join(work, "private"), "w") as f:
        f.write("trainer's own")
    os.chmod(os.path.join(work, "private"), 0o600)
    os.chmod(work, 0o755)
    tcp = socket.create_server(("127.0.0.1", 0))
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(f"\0areal-attacks-{os.getpid()}")
    unix.listen()
    for s in (tcp, udp, unix):
        s.setblocking(False)
    return work, unix.getsockname(), [tcp, udp, unix]


async def attack(backend: str, copies: int, parallel: int) -> tuple[dict[str, tuple[Counter, bool]], float, float]:
    work, unix_name, (tcp, udp, unix) = trainer_side()
    outside, private = os.path.join(work, "open"), os.path.join(work, "private")
    programs = attacks(outside, private, tcp.getsockname()[1], udp.getsockname()[1], unix_name)
    limits = SandboxLimits(timeout=15.0, cpu_seconds=4, memory_mb=256, output_bytes=1 << 16)
    sandbox = Sandbox(limits, backend=backend, max_parallel=parallel)
    grader = CodeGrader(sandbox)
    gaps, done = [0.0], asyncio.Event()

    async def ticker() -> None:  # the trainer's event loop must keep running
        last = time.monotonic()
        while not done.is_set():
            await asyncio.sleep(0.05)
            gaps.append(time.monotonic() - last)
            last = time.monotonic()

    tick = asyncio.create_task(ticker())
    names = [name for name in programs for _ in range(copies)]
    graded = [name for name in GRADER_ATTACKS for _ in range(copies)]
    start = time.monotonic()
    results = await asyncio.gather(
        *(sandbox.run(programs[name]) for name in names),
        *(grader("", GRADER_ATTACKS[name][0], [], [], **GRADER_ATTACKS[name][1]) for name in graded),
        grader("", SOLUTION, [], [], tests=TESTS),
        return_exceptions=True,  # an exception is an attack that was not contained
    )
    seconds = time.monotonic() - start
    done.set()
    await tick
    leftover = []
    deadline = time.monotonic() + 10
    while (leftover := sandbox_processes()) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    checks = {
        "write outside /tmp": not os.listdir(outside),
        "escape upwards": not os.path.exists("/var/tmp/pwned-areal"),
        "tcp to the trainer": _nothing_arrived(tcp),
        "ipv6 to the trainer": _nothing_arrived(tcp),
        "udp to the trainer": _nothing_arrived(udp, datagram=True),
        "abstract unix socket": _nothing_arrived(unix),
        "daemon": not leftover,
        "fork bomb": not leftover,
    }
    for s in (tcp, udp, unix):
        s.close()
    shutil.rmtree(work)
    table: dict[str, tuple[Counter, bool]] = {}
    for name, result in zip(names, results[: len(names)]):
        ends, contained = table.get(name, (Counter(), True))
        if isinstance(result, BaseException):
            ends[f"raised {type(result).__name__}"] += 1
            table[name] = (ends, False)
        else:
            ends[result.outcome] += 1
            table[name] = (ends, contained and "ESCAPED" not in result.stdout and checks.get(name, True))
    for name, reward in zip([*graded, "grader: honest solution"], results[len(names) :]):
        ends, contained = table.get(name, (Counter(), True))
        ends[f"raised {type(reward).__name__}" if isinstance(reward, BaseException) else f"reward {reward:g}"] += 1
        table[name] = (ends, contained and reward == (1.0 if name == "grader: honest solution" else 0.0))
    return table, len(results) / seconds, max(gaps)


def _nothing_arrived(server: socket.socket, datagram: bool = False) -> bool:
    try:
        server.recv(1) if datagram else server.accept()
    except BlockingIOError:
        return True
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--copies", type=int, default=3, help="runs of each attack")
    parser.add_argument("--parallel", type=int, default=64, help="runs at once")
    args = parser.parse_args()
    with open("/proc/cpuinfo") as f:
        cpu = "Zen 4 / AVX-512 BF16" if "avx512_bf16" in f.read() else "other"
    print(f"CPU: {cpu}, {os.cpu_count()} cores; {args.copies} runs of each attack, {args.parallel} at once")
    result = []
    backends = [b for b in ("unshare", "bwrap") if (b != "unshare" or os.geteuid() == 0) and shutil.which(b)]
    for backend in backends:
        table, rate, gap = asyncio.run(attack(backend, args.copies, args.parallel))
        cgroup = getattr(Sandbox(backend=backend), "memory_cgroup", False)
        print(f"\n{backend} (memory cgroup: {cgroup}); the trainer's event loop stalled {gap:.2f}s at worst")
        print(f"{'attack':<28}{'contained':<11}how the runs ended")
        for name, (ends, contained) in table.items():
            print(
                f"{name:<28}{'yes' if contained else 'NO':<11}{', '.join(f'{k} x{v}' for k, v in sorted(ends.items()))}"
            )
        held = sum(contained for _, contained in table.values())
        result += [f"{backend}_contained={held}/{len(table)}", f"{backend}_runs_per_s={rate:.1f}"]
        result += [f"{backend}_worst_loop_gap_s={gap:.2f}"]
    print("RESULT " + " ".join(result))


if __name__ == "__main__":
    main()
