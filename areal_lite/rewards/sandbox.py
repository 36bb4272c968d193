"""Running untrusted Python (code a model wrote) in a sandbox, for code rewards and agent tools.

Each run is a fresh process tree, contained by layers that each stop something:

1. Namespaces, from ``unshare`` (util-linux: nothing to install, needs root) or ``bwrap``
   (bubblewrap, when installed: also for a trainer that is not root). A network namespace with
   only a loopback that is down: no connection leaves. A PID namespace with a fresh ``/proc``: the
   code sees only its own processes (not the trainer, not its environment), and when the
   namespace's init ends or is killed the kernel kills every process in it, so nothing outlives
   the run. A mount namespace in which every mount is read-only and ``/tmp``, the working
   directory, is a fresh tmpfs of ``tmp_mb``: nothing outside it can be written. IPC and UTS
   namespaces.
2. An unprivileged identity. Under root the code runs as a uid of its own (1,000,000 + the
   launcher's pid), no groups, with ``no_new_privs``: it cannot read the trainer's private files,
   signal or trace any other process, or regain privileges, and ``RLIMIT_NPROC`` counts its
   processes alone. Under bwrap without root it is the trainer's uid in a user namespace, with no
   capabilities.
3. rlimits: CPU seconds (SIGXCPU), address space (a memory bomb gets MemoryError), processes (a
   fork bomb gets EAGAIN), file size (EFBIG), open files, no core files; and ``nice`` 19, so a
   busy sandbox yields the CPU to the trainer.
4. A bare environment (PATH, HOME, TMPDIR, LANG): nothing of the trainer's is inherited, and the
   launcher is started with an empty one.
5. The parent: at most ``output_bytes`` of stdout and stderr are read (a flood is cut there and
   the run killed), a wall-clock ``timeout``, and on either the launcher's whole process group is
   killed with SIGKILL, which takes the PID namespace with it.

Without root and without bwrap no namespace can be made, and rlimits alone contain neither network
access nor writes outside the working directory: `Sandbox` then refuses to run
(`SandboxUnavailable`) rather than run untrusted code half-contained.

The code runs under the system's ``python3`` (``-I``: no environment variables, no user site),
standard library only. Not contained: CPU time shared with the trainer (bounded by the timeout,
the process limit and ``nice``), and memory, which the limits bound per process (``memory_mb`` x
``processes`` in the worst case) rather than in total, as a cgroup would.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Backend = Literal["auto", "unshare", "bwrap"]
Outcome = Literal["ok", "error", "timeout", "cpu_limit", "memory_limit", "file_size_limit", "output_limit", "killed"]
OUTCOMES: tuple[Outcome, ...] = (
    "ok", "error", "timeout", "cpu_limit", "memory_limit", "file_size_limit", "output_limit", "killed",
)  # fmt: skip
logger = logging.getLogger(__name__)

INIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_init.py")
with open(INIT) as _f:
    INIT_SOURCE = _f.read()
"""The init's source, handed to the sandbox's python with ``-c``: inside, the project may not be
visible (bwrap mounts a fresh tmpfs over /tmp, where a checkout or its virtual environment may live)."""
UID_BASE = 1_000_000
"""Under root, a run's code gets uid UID_BASE + its launcher's pid: unique among the runs alive."""


class SandboxUnavailable(RuntimeError):
    """No isolation is available here (no root for ``unshare``, no ``bwrap``), or setting a sandbox
    up failed: untrusted code is not run."""


@dataclass
class SandboxLimits:
    """What one run may use."""

    timeout: float = 10.0
    """Wall-clock seconds before the whole run is killed."""
    cpu_seconds: int = 10
    """CPU seconds per process (SIGXCPU, then SIGKILL a second later)."""
    memory_mb: int = 256
    """Address space per process."""
    processes: int = 16
    """Processes and threads of the run's uid."""
    file_size_mb: int = 16
    """Largest file the code may write."""
    open_files: int = 64
    """Open file descriptors per process."""
    tmp_mb: int = 64
    """Size of the working directory (``/tmp``, a tmpfs)."""
    output_bytes: int = 1 << 20
    """stdout and stderr kept, together; more output kills the run (``output_limit``)."""


@dataclass
class SandboxResult:
    """How a run ended, with what it printed (decoded, at most ``output_bytes``)."""

    outcome: Outcome
    exit_code: int | None
    """The program's exit status; None when a signal ended it or it was killed."""
    stdout: str
    stderr: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


def available_backend(preferred: Backend = "auto") -> Literal["unshare", "bwrap"]:
    """The isolation this machine offers: ``unshare`` under root, else ``bwrap`` when installed.
    Raises `SandboxUnavailable` naming what is missing."""
    root = os.geteuid() == 0
    if preferred in ("auto", "unshare") and root and shutil.which("unshare"):
        return "unshare"
    if preferred in ("auto", "bwrap") and shutil.which("bwrap"):
        return "bwrap"
    missing = "bubblewrap (apt-get install bubblewrap)" if preferred == "bwrap" else (
        "root (for unshare's namespaces) or bubblewrap (apt-get install bubblewrap)"
    )  # fmt: skip
    raise SandboxUnavailable(f"no sandbox for untrusted code here: it needs {missing}")


def system_python() -> str:
    """The interpreter sandboxed code runs under: the system's python3 (its path readable by any
    uid, unlike a virtual environment under a private home), else this one."""
    for path in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(path, os.X_OK):
            return path
    return sys.executable


class Sandbox:
    """Runs Python source in a fresh sandbox per call; counts how runs ended (`stats`).

    Args:
        limits: what each run may use.
        backend: ``auto`` (``unshare`` under root, else ``bwrap``), ``unshare`` or ``bwrap``.
        max_parallel: runs at once (more wait their turn; the timeout starts with the run).
        python: the interpreter inside (default `system_python`).
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        backend: Backend = "auto",
        max_parallel: int | None = None,
        python: str | None = None,
    ) -> None:
        self.limits = limits or SandboxLimits()
        self.backend = available_backend(backend)
        self.max_parallel = max_parallel or os.cpu_count() or 1
        self.python = python or system_python()
        self.counts: Counter[str] = Counter()
        self._slots: asyncio.Semaphore | None = None

    def __getstate__(self) -> dict[str, object]:
        """A copy (another process) keeps the settings and starts its own counts."""
        return {
            "limits": self.limits,
            "backend": self.backend,
            "max_parallel": self.max_parallel,
            "python": self.python,
        }

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(
            state["limits"], backend=state["backend"], max_parallel=state["max_parallel"], python=state["python"]
        )  # type: ignore[misc,arg-type]

    def stats(self, reset: bool = False) -> dict[str, float]:
        """``sandbox/<outcome>``: how many runs ended each way (``sandbox/runs`` in all)."""
        out = {f"sandbox/{k}": float(self.counts[k]) for k in OUTCOMES}
        out["sandbox/runs"] = float(sum(self.counts.values()))
        if reset:
            self.counts.clear()
        return out

    async def run(self, code: str, stdin: str = "", files: dict[str, str] | None = None) -> SandboxResult:
        """Run ``code`` (as ``main.py`` in the working directory, next to ``files``) with ``stdin``."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_parallel)
        async with self._slots:
            try:
                result = await self._run({**(files or {}), "main.py": code}, stdin)
            except SandboxUnavailable as first:
                # The set-up failed before any of ``code`` ran (it never reported ready): once more,
                # in case that was passing pressure on the machine; a second failure is reported.
                logger.warning("sandbox set-up failed, trying once more: %s", first)
                await asyncio.sleep(0.5)
                result = await self._run({**(files or {}), "main.py": code}, stdin)
        self.counts[result.outcome] += 1
        return result

    def _command(self) -> list[str]:
        boot = [self.python, "-I", "-S", "-c", INIT_SOURCE]
        if self.backend == "unshare":
            namespaces = ["--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc", "--ipc", "--uts"]
            return [shutil.which("unshare") or "unshare", *namespaces, "--", *boot]
        user = [] if os.geteuid() == 0 else ["--unshare-user", "--cap-drop", "ALL"]
        fs = ["--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev",
              "--size", str(self.limits.tmp_mb << 20), "--perms", "0700", "--tmpfs", "/tmp"]  # fmt: skip
        if os.geteuid() != 0 and os.environ.get("HOME"):
            fs += ["--tmpfs", os.environ["HOME"]]  # the trainer's own files are readable by its uid
        spaces = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"]
        return [shutil.which("bwrap") or "bwrap", *spaces, *user, "--die-with-parent", "--new-session",
                *fs, "--clearenv", "--", *boot]  # fmt: skip

    def _payload(self, pid: int, status_fd: int, files: dict[str, str], stdin: str) -> bytes:
        lim = self.limits
        limits = {
            "RLIMIT_CPU": lim.cpu_seconds,
            "RLIMIT_AS": lim.memory_mb << 20,
            "RLIMIT_NPROC": lim.processes,
            "RLIMIT_FSIZE": lim.file_size_mb << 20,
            "RLIMIT_NOFILE": lim.open_files,
            "RLIMIT_CORE": 0,
        }
        cfg = {
            "files": files,
            "stdin": stdin,
            "argv": [self.python, "-I", "main.py"],
            "limits": limits,
            "uid": UID_BASE + pid,
            "mounts": self.backend == "unshare",
            "tmp_bytes": lim.tmp_mb << 20,
            "status_fd": status_fd,
        }
        return json.dumps(cfg).encode()

    async def _run(self, files: dict[str, str], stdin: str) -> SandboxResult:
        lim = self.limits
        start = time.monotonic()
        status_r, status_w = os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._command(),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=(status_w,),
                env={},
                start_new_session=True,
            )
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        output = _Output(lim.output_bytes, on_overflow=lambda: _kill_group(proc.pid))
        readers = asyncio.gather(output.read(proc.stdout, 0), output.read(proc.stderr, 1))
        timed_out = False
        try:
            try:
                proc.stdin.write(self._payload(proc.pid, status_w, files, stdin))
                await proc.stdin.drain()
                proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the launcher died first: its stderr says why
            try:
                await asyncio.wait_for(asyncio.shield(readers), lim.timeout)
            except asyncio.TimeoutError:
                timed_out = True
                _kill_group(proc.pid)
        except BaseException:  # cancelled (the caller's timeout, shutdown)
            _kill_group(proc.pid)
            raise
        finally:  # in every case, nothing outlives the run
            await _reap(proc, readers)
            status = _read_all(status_r)
        cut = "output_limit" if output.overflow else ("timeout" if timed_out else None)
        return self._result(cut, status, output, time.monotonic() - start)

    def _result(self, cut: str | None, status: str, output: _Output, seconds: float) -> SandboxResult:
        stdout, stderr = output.text(0), output.text(1)
        if cut is None and "ready" not in status.split():
            raise SandboxUnavailable(f"the sandbox could not be set up: {stderr.strip()}")
        code: int | None = None
        sig: int | None = None
        for line in status.splitlines():
            kind, _, value = line.partition(" ")
            if kind == "exit":
                code = int(value)
            elif kind == "signal":
                sig = int(value)
        outcome: Outcome
        if cut is not None:
            outcome = cut  # type: ignore[assignment]
        elif sig == signal.SIGXCPU:
            outcome = "cpu_limit"
        elif sig == signal.SIGXFSZ:
            outcome = "file_size_limit"
        elif sig is not None or code is None:
            outcome = "killed"
        elif code == 0:
            outcome = "ok"
        elif "MemoryError" in stderr:
            outcome = "memory_limit"
        elif "[Errno 27] File too large" in stderr:  # Python ignores SIGXFSZ: the write fails instead
            outcome = "file_size_limit"
        else:
            outcome = "error"
        return SandboxResult(outcome, code if sig is None else None, stdout, stderr, seconds)


class _Output:
    """stdout and stderr of one run, read together up to a shared byte budget."""

    def __init__(self, limit: int, on_overflow: Callable[[], None]) -> None:
        self.limit = limit
        self.on_overflow = on_overflow
        self.parts: list[bytearray] = [bytearray(), bytearray()]
        self.overflow = False

    async def read(self, stream: asyncio.StreamReader, which: int) -> None:
        """Keep what fits; past the budget, kill the run and drain the pipe until it closes."""
        while chunk := await stream.read(65536):
            room = self.limit - len(self.parts[0]) - len(self.parts[1])
            self.parts[which] += chunk[: max(room, 0)]
            if len(chunk) > room and not self.overflow:
                self.overflow = True
                self.on_overflow()

    def text(self, which: int) -> str:
        return self.parts[which].decode(errors="replace")


async def _reap(proc: asyncio.subprocess.Process, readers: asyncio.Future) -> None:
    """Wait for the launcher, then for its pipes to close (the namespace dies with it)."""
    await proc.wait()
    try:
        await asyncio.wait_for(readers, 10.0)
    except asyncio.TimeoutError:
        readers.cancel()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _read_all(fd: int) -> str:
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
