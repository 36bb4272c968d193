"""Running untrusted Python (code a model wrote) in a sandbox, for code rewards and agent tools.

Each run is a fresh process tree, contained by layers that each stop something:

1. Namespaces, from ``unshare`` (util-linux: nothing to install, needs root) or ``bwrap``
   (bubblewrap, when installed: also for a trainer that is not root). A network namespace with
   only a loopback that is down: no connection leaves. A PID namespace with a fresh ``/proc``: the
   code sees only its own processes (not the trainer, not its environment), and when the
   namespace's init ends or is killed the kernel kills every process in it, so nothing outlives
   the run. A mount namespace whose root holds only what the interpreter needs, read-only: the
   system's programs and libraries, the interpreter's own prefix and a few files of /etc
   (`visible_paths`), a few devices in ``/dev``, its own ``/proc``, and ``/tmp``, the working
   directory, a fresh tmpfs of ``tmp_mb``. Nothing else of the host (the project's checkout, home
   directories, the rest of /etc) can be read, and nothing outside ``/tmp`` written. IPC and UTS
   namespaces.
2. An unprivileged identity. Under root the code runs as a uid of its own (1,000,000 + the
   launcher's pid), no groups, with ``no_new_privs``: it cannot read the trainer's private files,
   signal or trace any other process, or regain privileges, and ``RLIMIT_NPROC`` counts its
   processes alone. Under bwrap without root it is the trainer's uid in a user namespace, with no
   capabilities.
3. A seccomp filter (`sandbox_init.seccomp_filter`): sockets of the `SOCKET_FAMILIES` only
   (UNIX, IPv4, IPv6, which the network namespace confines; not ``AF_VSOCK``, which reaches the
   hypervisor from any namespace, nor netlink, packet, bluetooth ...), no new namespaces, no
   io_uring (it opens sockets past the filter), no ``memfd_create`` or System V shared memory, no
   bpf, perf events, userfaultfd or keyrings.
4. Memory. Under root, where the machine has a memory cgroup this process may write (cgroup v2
   with the memory controller, or the v1 memory hierarchy), each run gets one of its own:
   ``memory_mb + tmp_mb`` bounds everything the run holds (all its processes, the files it writes
   in ``/tmp``, shared mappings), swap included, and a run over it is killed (``memory_limit``).
   Without one (bwrap without root, a container whose cgroups are read-only), the bound is the
   sum of the rlimits: ``memory_mb`` of address space per process (``processes`` of them) plus
   ``tmp_mb`` of files; the filter closes the paths rlimits do not see (memfd, System V shared
   memory, a tmpfs in a new user namespace) and every other tmpfs (the root,
   ``/dev``) is read-only. `Sandbox.memory_cgroup` tells which applies.
5. rlimits: CPU seconds (SIGXCPU), address space (a memory bomb gets MemoryError), processes (a
   fork bomb gets EAGAIN), file size (EFBIG), open files, no core files; and ``nice`` 19, so a
   busy sandbox yields the CPU to the trainer.
6. A bare environment (PATH, HOME, TMPDIR, LANG): nothing of the trainer's is inherited, and the
   launcher is started with an empty one.
7. The parent: at most ``output_bytes`` of stdout and stderr are read (a flood is cut there and
   the run killed), a wall-clock ``timeout``, and on either the launcher's whole process group is
   killed with SIGKILL, which takes the PID namespace with it.

A run may come with a checker: trusted Python source (the grader's side of a test) run in a
second process of the same sandbox, under a uid of its own (1,000,000 + 2**22 + the launcher's
pid) and not dumpable, so the program can neither trace it nor read its memory, files or command
line; the two talk over pipes (fds 3 and 4 on each side), and the run passes when the checker
exits with status 0 (`CodeGrader` grades tests this way).

Without root and without bwrap no namespace can be made, and rlimits alone contain neither network
access nor writes outside the working directory: `Sandbox` then refuses to run
(`SandboxUnavailable`) rather than run untrusted code half-contained. Text that is not valid
Unicode (a lone surrogate) cannot be handed to a program: such a run ends as ``error`` without
starting.

The code runs under the system's ``python3`` (``-I``: no environment variables, no user site),
standard library only. Not contained: CPU time shared with the trainer (bounded by the timeout,
the process limit and ``nice``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Literal

from areal_lite.rewards.sandbox_cgroup import RunCgroup, memory_cgroup_parent
from areal_lite.rewards.sandbox_io import RunOutput, kill_group, read_all, reap, write_all

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
CHECKER_UID_OFFSET = 1 << 22
"""A run's checker gets uid UID_BASE + CHECKER_UID_OFFSET + the launcher's pid (pids stay below
2**22, the kernel's largest ``pid_max``): no program's uid."""
SOCKET_FAMILIES: tuple[int, ...] = (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6)
"""The address families sandboxed code may open sockets of: those the network namespace confines."""
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
"""The system's programs and libraries, shown read-only (or as the symlinks they are, into /usr)."""
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "alternatives")
"""What of /etc a program may see: the dynamic loader's configuration, the time zone, the
alternatives' symlinks. Nothing about the host's users, network, services or secrets."""


def visible_paths(python: str) -> tuple[list[str], dict[str, str]]:
    """The host paths sandboxed code sees, read-only at the same place (`SYSTEM_DIRS`, the
    `ETC_FILES`, the interpreter's own prefix where it lies outside them), and the symlinks among
    the system directories (``/bin`` -> ``usr/bin`` on a merged /usr): nothing else of the host."""
    binds: list[str] = []
    links: dict[str, str] = {}
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            links[path] = os.readlink(path)
        elif os.path.isdir(path):
            binds.append(path)
    binds += [p for p in (os.path.join("/etc", name) for name in ETC_FILES) if os.path.lexists(p)]
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(python)))  # <prefix>/bin/python3.X
    if not any(prefix == b or prefix.startswith(b + "/") for b in (os.path.realpath(p) for p in binds)):
        binds.append(prefix)
    return binds, links


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
    """Address space per process; where a memory cgroup is available (`Sandbox.memory_cgroup`),
    the run's processes and its files together hold at most ``memory_mb + tmp_mb``."""
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
    """The program's exit status (with a checker, the checker's, unless the program failed
    first); None when a signal ended it or it was killed."""
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
        python: the interpreter inside (default `system_python`), by its real path: a virtual
            environment's packages are not in the sandbox, its interpreter is.
        memory_cgroup: bound each run's memory in total with a cgroup of its own: None (the
            default) where the machine allows it, True to require it (`SandboxUnavailable`
            where it cannot), False never (the rlimits alone: see the module's docstring).
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        backend: Backend = "auto",
        max_parallel: int | None = None,
        python: str | None = None,
        memory_cgroup: bool | None = None,
    ) -> None:
        self.limits = limits or SandboxLimits()
        self.backend = available_backend(backend)
        self.max_parallel = max_parallel or os.cpu_count() or 1
        # The file itself: a symlink's directory (a virtual environment's bin) is not in the sandbox.
        self.python = os.path.realpath(python or system_python())
        self._binds, self._links = visible_paths(self.python)
        self._memory_cgroup_asked = memory_cgroup
        self._cgroups = memory_cgroup_parent() if memory_cgroup is not False else None
        if memory_cgroup and self._cgroups is None:
            raise SandboxUnavailable(
                "memory_cgroup=True, but no memory cgroup can be made here: it needs root and a writable "
                "cgroup v2 with the memory controller enabled, or the cgroup v1 memory hierarchy"
            )
        self.memory_cgroup = self._cgroups is not None
        """Whether ``memory_mb`` bounds each run in total (a cgroup per run) or per process."""
        self.counts: Counter[str] = Counter()
        self._slots: asyncio.Semaphore | None = None

    def __getstate__(self) -> dict[str, object]:
        """A copy (another process) keeps the settings and starts its own counts."""
        return {
            "limits": self.limits,
            "backend": self.backend,
            "max_parallel": self.max_parallel,
            "python": self.python,
            "memory_cgroup": self._memory_cgroup_asked,
        }

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(
            state["limits"],
            backend=state["backend"],
            max_parallel=state["max_parallel"],
            python=state["python"],
            memory_cgroup=state["memory_cgroup"],
        )  # type: ignore[misc,arg-type]

    def stats(self, reset: bool = False) -> dict[str, float]:
        """``sandbox/<outcome>``: how many runs ended each way (``sandbox/runs`` in all)."""
        out = {f"sandbox/{k}": float(self.counts[k]) for k in OUTCOMES}
        out["sandbox/runs"] = float(sum(self.counts.values()))
        if reset:
            self.counts.clear()
        return out

    async def run(
        self, code: str, stdin: str = "", files: dict[str, str] | None = None, *, checker: str | None = None
    ) -> SandboxResult:
        """Run ``code`` (as ``main.py`` in the working directory, next to ``files``) with ``stdin``;
        with a ``checker`` (trusted Python source, see the module's docstring) the run ends when
        the checker does, and is ``ok`` when it exits with status 0."""
        files = {**(files or {}), "main.py": code}
        invalid = _not_unicode({**files, "stdin": stdin, "checker": checker or ""})
        if invalid:  # a program that cannot be written down cannot run: an error, like a syntax error
            result = SandboxResult("error", None, "", f"sandbox: {invalid}\n", 0.0)
            self.counts[result.outcome] += 1
            return result
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_parallel)
        async with self._slots:
            try:
                result = await self._run(files, stdin, checker)
            except SandboxUnavailable as first:
                # The set-up failed before any of ``code`` ran (it never reported ready): once more,
                # in case that was passing pressure on the machine; a second failure is reported.
                logger.warning("sandbox set-up failed, trying once more: %s", first)
                await asyncio.sleep(0.5)
                result = await self._run(files, stdin, checker)
        self.counts[result.outcome] += 1
        return result

    def _command(self) -> list[str]:
        boot = [self.python, "-I", "-S", "-c", INIT_SOURCE]
        if self.backend == "unshare":
            # The init mounts a fresh /proc in the root it builds (`sandbox_init.private_root`).
            namespaces = ["--net", "--pid", "--fork", "--kill-child", "--mount", "--ipc", "--uts"]
            return [shutil.which("unshare") or "unshare", *namespaces, "--", *boot]
        user = [] if os.geteuid() == 0 else ["--unshare-user", "--cap-drop", "ALL"]
        # bwrap's root is an empty tmpfs: the visible paths are bound into it. /dev is a tmpfs that
        # the code's uid owns in a user namespace: read-only, like every other mount but /tmp (and
        # the root itself, last), so that no file is written outside /tmp's size.
        fs: list[str] = []
        parents: set[str] = set()
        for path in self._binds:
            while (path := os.path.dirname(path)) != "/":
                parents.add(path)
        for parent in sorted(parents):
            fs += ["--perms", "0755", "--dir", parent]  # bwrap would make them 0700: not the code's
        for path in self._binds:
            fs += ["--ro-bind", path, path]
        for link, target in self._links.items():
            fs += ["--symlink", target, link]
        fs += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev",
               "--size", str(self.limits.tmp_mb << 20), "--perms", "0700", "--tmpfs", "/tmp",
               "--remount-ro", "/"]  # fmt: skip
        # --as-pid-1: the init is the namespace's pid 1 (not dumpable), with no reaper of bwrap's
        # that the code's uid could trace (under bwrap without root the uids are the same).
        spaces = ["--unshare-pid", "--as-pid-1", "--unshare-net", "--unshare-ipc", "--unshare-uts"]
        return [shutil.which("bwrap") or "bwrap", *spaces, *user, "--die-with-parent", "--new-session",
                *fs, "--clearenv", "--", *boot]  # fmt: skip

    def _payload(
        self, pid: int, status_fd: int, cgroup_fd: int | None, files: dict[str, str], stdin: str, checker: str | None
    ) -> bytes:
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
            "checker_uid": UID_BASE + CHECKER_UID_OFFSET + pid,
            "mounts": self.backend == "unshare",
            "binds": self._binds,
            "links": self._links,
            "tmp_bytes": lim.tmp_mb << 20,
            "socket_families": [int(f) for f in SOCKET_FAMILIES],
            "status_fd": status_fd,
            "cgroup_fd": cgroup_fd,
            "checker": checker,
        }
        return json.dumps(cfg).encode()

    async def _run(self, files: dict[str, str], stdin: str, checker: str | None) -> SandboxResult:
        lim = self.limits
        start = time.monotonic()
        try:
            # memory_mb + tmp_mb: one process may reach its address space with /tmp full, as
            # without a cgroup, and no number of processes more than that.
            limit = (lim.memory_mb + lim.tmp_mb) << 20
            cgroup = RunCgroup(*self._cgroups, limit) if self._cgroups else None
        except OSError as e:
            raise SandboxUnavailable(f"the run's memory cgroup could not be made: {e}") from e
        try:
            return await self._run_in(files, stdin, checker, cgroup, start)
        finally:
            if cgroup is not None:
                await cgroup.remove()

    async def _run_in(
        self, files: dict[str, str], stdin: str, checker: str | None, cgroup: RunCgroup | None, start: float
    ) -> SandboxResult:
        lim = self.limits
        cgroup_fd = cgroup.procs_fd if cgroup is not None else None
        status_r, status_w = os.pipe()
        try:
            # Popen, not asyncio's subprocess transport: a transport cancelled while it connects
            # its pipes (asyncio.run's clean-up cancels every task at once) waits forever for them
            # (CPython 3.11). Here every wait is on a descriptor this function owns.
            proc = subprocess.Popen(  # noqa: ASYNC220 - returns at the exec, as asyncio's own transport does
                self._command(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_w,) if cgroup_fd is None else (status_w, cgroup_fd),
                env={},
                start_new_session=True,
            )
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
            if cgroup is not None:
                cgroup.close_procs()
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        output = RunOutput(lim.output_bytes, on_overflow=lambda: kill_group(proc.pid))
        readers = asyncio.gather(output.read(proc.stdout.fileno(), 0), output.read(proc.stderr.fileno(), 1))
        timed_out = False
        try:
            try:
                await write_all(
                    proc.stdin.fileno(), self._payload(proc.pid, status_w, cgroup_fd, files, stdin, checker)
                )
            except (BrokenPipeError, ConnectionResetError):
                pass  # the launcher died first: its stderr says why
            finally:
                proc.stdin.close()
            try:
                await asyncio.wait_for(asyncio.shield(readers), lim.timeout)
            except asyncio.TimeoutError:
                timed_out = True
                kill_group(proc.pid)
        except BaseException:  # cancelled (the caller's timeout, shutdown)
            kill_group(proc.pid)
            raise
        finally:  # in every case, nothing outlives the run
            try:
                await reap(proc, readers)
            finally:
                proc.stdout.close()
                proc.stderr.close()
                status = read_all(status_r)
        cut = "output_limit" if output.overflow else ("timeout" if timed_out else None)
        oom_kills = cgroup.oom_kills() if cgroup is not None else 0
        return self._result(cut, status, output, checker is not None, oom_kills, time.monotonic() - start)

    def _result(
        self, cut: str | None, status: str, output: RunOutput, checked: bool, oom_kills: int, seconds: float
    ) -> SandboxResult:
        stdout, stderr = output.text(0), output.text(1)
        lines = status.splitlines()
        ready = "ready" in lines and (not checked or "checker-ready" in lines)
        if cut is None and not oom_kills and not ready:
            raise SandboxUnavailable(f"the sandbox could not be set up: {stderr.strip()}")
        ends: dict[str, tuple[str, int]] = {}
        for line in lines:
            who, _, end = line.partition(" ")
            kind, _, value = end.partition(" ")
            if who in ("program", "checker") and kind in ("exit", "signal"):
                ends[who] = (kind, int(value))
        judged = ends.get("program")
        if checked and judged in (None, ("exit", 0)):
            judged = ends.get("checker")  # the program serves until the checker is done, or failed first
        outcome: Outcome
        if cut is not None:
            outcome = cut  # type: ignore[assignment]
        elif oom_kills:
            outcome = "memory_limit"
        else:
            outcome = _outcome(judged, stderr)
        code = judged[1] if judged is not None and judged[0] == "exit" else None
        return SandboxResult(outcome, code, stdout, stderr, seconds)


def _outcome(end: tuple[str, int] | None, stderr: str) -> Outcome:
    """How a process that ended so (``("exit", N)``, ``("signal", N)``, None: unknown) ended."""
    if end is None:
        return "killed"
    kind, value = end
    if kind == "signal":
        return {signal.SIGXCPU: "cpu_limit", signal.SIGXFSZ: "file_size_limit"}.get(value, "killed")  # type: ignore[return-value]
    if value == 0:
        return "ok"
    if "MemoryError" in stderr or "[Errno 12] Cannot allocate memory" in stderr:
        return "memory_limit"
    if "[Errno 27] File too large" in stderr:  # Python ignores SIGXFSZ: the write fails instead
        return "file_size_limit"
    return "error"


def _not_unicode(texts: dict[str, str]) -> str | None:
    """Why one of ``texts`` cannot be written as UTF-8 (a lone surrogate), or None."""
    for name, text in texts.items():
        try:
            text.encode()
        except UnicodeEncodeError as e:
            return f"{name} is not valid Unicode text ({e.reason}: {e.object[e.start : e.end]!a} at {e.start})"
    return None
