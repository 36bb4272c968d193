"""The memory cgroups of sandbox runs (`areal_lite.rewards.sandbox`, layer 4 of its docstring).

Under root, where the machine has a memory cgroup this process may write (cgroup v2 with the
memory controller enabled for the children of a directory, or the v1 memory hierarchy), each run
gets a cgroup of its own whose limit bounds everything the run holds (all its processes, the files
it writes in its tmpfs, shared mappings), swap included. `memory_cgroup_parent` finds where such
cgroups can be made; `RunCgroup` is one run's.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import itertools
import logging
import os
import signal

logger = logging.getLogger(__name__)

_RUN_IDS = itertools.count()


@functools.cache
def memory_cgroup_parent() -> tuple[str, int] | None:
    """(directory, cgroup version) under which this process can make per-run memory cgroups, or
    None: cgroup v2 where the memory controller is enabled for the directory's children, else the
    v1 memory hierarchy; the nearest such directory to this process's own cgroup that it may
    write (root only). Found once, by making and removing a probe."""
    if os.geteuid() != 0:
        return None
    own: dict[str, str] = {}  # "v2" or a v1 controller -> this process's cgroup in that hierarchy
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                own.update(dict.fromkeys(controllers.split(",") if controllers else ["v2"], path))
        with open("/proc/self/mountinfo") as f:
            mounts = [_cgroup_mount(line) for line in f]
    except OSError:
        return None
    for version, point, root, options in sorted(filter(None, mounts), reverse=True):  # v2 first
        path = own.get("v2" if version == 2 else "memory")
        if path is None or (version == 1 and "memory" not in options):
            continue
        root = root.rstrip("/")
        if not (path + "/").startswith(root + "/"):
            continue  # this process's cgroup is outside what the mount shows
        here = os.path.normpath(point + "/" + path[len(root) :])
        while True:  # from this process's cgroup up to the hierarchy's root
            if _can_make_children(here, version):
                _remove_stale(here)
                return here, version
            if here == os.path.normpath(point):
                break
            here = os.path.dirname(here)
    return None


def _cgroup_mount(line: str) -> tuple[int, str, str, list[str]] | None:
    """A line of /proc/self/mountinfo as (cgroup version, mount point, root, super options), or
    None for a mount that is not a cgroup hierarchy."""
    fields = line.split()
    dash = fields.index("-")
    fstype, options = fields[dash + 1], fields[dash + 3].split(",")
    if fstype not in ("cgroup", "cgroup2"):
        return None
    return (2 if fstype == "cgroup2" else 1), fields[4], fields[3], options


def _can_make_children(directory: str, version: int) -> bool:
    """Whether a child of ``directory`` can be made and has a memory limit (probed)."""
    if version == 2:
        try:
            with open(os.path.join(directory, "cgroup.subtree_control")) as f:
                if "memory" not in f.read().split():
                    return False
        except OSError:
            return False
    probe = os.path.join(directory, f"areal-sandbox-{os.getpid()}-probe")
    try:
        os.mkdir(probe)
    except OSError:
        return False
    try:
        return os.path.exists(os.path.join(probe, "memory.max" if version == 2 else "memory.limit_in_bytes"))
    finally:
        os.rmdir(probe)


def _remove_stale(directory: str) -> None:
    """The empty run cgroups a trainer that was killed left behind (its pid is gone)."""
    for name in os.listdir(directory):
        parts = name.split("-")
        if len(parts) == 4 and name.startswith("areal-sandbox-") and parts[2].isdigit():
            try:
                os.kill(int(parts[2]), 0)
            except ProcessLookupError:
                try:
                    os.rmdir(os.path.join(directory, name))
                except OSError:
                    pass  # processes still in it: left alone
            except PermissionError:
                pass  # alive


class RunCgroup:
    """The memory cgroup of one run: made with its limit, joined by the sandbox's children through
    the open ``cgroup.procs`` (`procs_fd`), asked how many processes the kernel killed for memory,
    and removed."""

    def __init__(self, parent: str, version: int, limit_bytes: int) -> None:
        self.path = os.path.join(parent, f"areal-sandbox-{os.getpid()}-{next(_RUN_IDS)}")
        self.version = version
        os.mkdir(self.path)
        try:
            if version == 2:
                self._write("memory.max", limit_bytes)
                self._write("memory.swap.max", 0, optional=True)
            else:
                self._write("memory.limit_in_bytes", limit_bytes)
                self._write("memory.memsw.limit_in_bytes", limit_bytes, optional=True)  # no swap either
            self.procs_fd: int | None = os.open(os.path.join(self.path, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)
        except BaseException:
            os.rmdir(self.path)
            raise

    def _write(self, name: str, value: int, optional: bool = False) -> None:
        try:
            with open(os.path.join(self.path, name), "w") as f:
                f.write(str(value))
        except FileNotFoundError:
            if not optional:
                raise

    def close_procs(self) -> None:
        if self.procs_fd is not None:
            os.close(self.procs_fd)
            self.procs_fd = None

    def oom_kills(self) -> int:
        """Processes of the run killed for memory (``oom_kill`` in memory.events or memory.oom_control)."""
        try:
            with open(os.path.join(self.path, "memory.events" if self.version == 2 else "memory.oom_control")) as f:
                counts = dict(line.split() for line in f if line.strip())
        except OSError:
            return 0
        return int(counts.get("oom_kill", 0))

    async def remove(self) -> None:
        """Removed once empty: the PID namespace's processes are gone when its launcher is; any
        straggler is killed, and a cgroup that cannot be removed is reported."""
        self.close_procs()
        for attempt in range(50):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError as e:
                if e.errno != errno.EBUSY:
                    break
                if attempt == 5:
                    self._kill_members()
                await asyncio.sleep(0.02)
        logger.warning("sandbox: could not remove the memory cgroup %s", self.path)

    def _kill_members(self) -> None:
        try:
            with open(os.path.join(self.path, "cgroup.procs")) as f:
                pids = [int(p) for p in f.read().split()]
        except OSError:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
