"""The first process inside a sandbox (`areal_lite.rewards.sandbox`): it sets the sandbox up, runs
the untrusted program as its child (and the trusted checker, when there is one), and reports how
they ended.

Run from its source (``python -I -S -c <this file>``) by ``unshare`` or ``bwrap`` in fresh namespaces,
so it imports nothing but the standard library. It reads one JSON object from stdin:

- ``files``: name -> text, written into the working directory (``/tmp``, a fresh tmpfs);
- ``stdin``: the program's standard input; ``argv``: the program's command line;
- ``limits``: rlimits by name (``RLIMIT_CPU``: seconds, the others bytes or counts);
- ``uid``, ``checker_uid``: the unprivileged uids to run the program and the checker as, when
  started as root; ``mounts``: build the program's root here (the ``unshare`` backend; ``bwrap``
  does it itself) from ``binds`` (host paths shown read-only) and ``links`` (symlinks), with /tmp
  a fresh tmpfs of ``tmp_bytes``;
- ``socket_families``: the address families the program may open sockets of;
- ``status_fd``: the inherited pipe that reports to the parent; ``cgroup_fd``: an inherited
  ``cgroup.procs`` of the run's memory cgroup, or None;
- ``checker``: Python source run in a second process, or None.

Then, as the init of the PID namespace, it forks the program: the child joins the memory cgroup,
sets the rlimits and ``nice`` 19, drops to ``uid`` (no groups, no capabilities, ``no_new_privs``),
installs the seccomp filter (`seccomp_filter`), writes ``ready`` on the status pipe and execs the
program with a bare environment. With a checker it forks a second child the same way (its own
uid, not dumpable, working directory ``/``, connected to the program by two pipes: each reads the
other on fd 3 and writes to it on fd 4) that runs the checker's source without an exec, so nothing
of it is ever in a file or a command line the program could read. The init reaps every process
until the program ends, or with a checker until the checker ends, and writes ``program exit N``,
``program signal N``, ``checker exit N``, ``checker signal N`` on the status pipe. When it exits,
the kernel kills whatever is left in the namespace. Any failure of the set-up is reported on
stderr with exit status 125 and no ``ready``.
"""

import ctypes
import fcntl
import json
import os
import resource
import struct
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 1 << 14, 1 << 18, 1 << 21
MNT_DETACH = 2
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
"""pivot_root's system call number by machine (the C library has no wrapper)."""
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
"""The device nodes a program sees in /dev."""
DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
             "stderr": "/proc/self/fd/2"}  # fmt: skip
PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 4, 22, 38
KEPT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
              "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}  # fmt: skip
FIRST_FREE_FD = 10
"""Inherited descriptors move at or above this, clear of fds 0-4 that the children are given."""

# seccomp: system call numbers by name for (x86_64, aarch64), the audit arch of each.
SYSCALLS = {
    "socket": (41, 198), "socketpair": (53, 199), "clone": (56, 220), "clone3": (435, 435),
    "memfd_create": (319, 279), "memfd_secret": (447, 447), "shmget": (29, 194),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "unshare": (272, 97), "setns": (308, 268), "bpf": (321, 280), "perf_event_open": (298, 241),
    "userfaultfd": (323, 282), "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218),
}  # fmt: skip
ARCHES = {"x86_64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7)}
DENIED = (
    # memory no rlimit bounds: anonymous files, System V shared memory
    "memfd_create", "memfd_secret", "shmget",
    # io_uring opens sockets (and more) without a system call the filter sees
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    # new namespaces: a user namespace would let the program mount a tmpfs of any size
    "unshare", "setns",
    # kernel interfaces no program graded here needs, each a large attack surface
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
)  # fmt: skip
CLONE_NEW_NAMESPACES = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
X32_SYSCALL_BIT = 0x40000000
EPERM, ENOSYS, EAFNOSUPPORT = 1, 38, 97
RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
LD_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|..|K, BPF_RET|K

libc = ctypes.CDLL(None, use_errno=True)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def seccomp_filter(families: list[int], machine: str) -> bytes:
    """A classic BPF program for ``seccomp``: ``socket``/``socketpair`` only for ``families``
    (else EAFNOSUPPORT), no ``clone`` into new namespaces, ``clone3`` ENOSYS (its flags are out of
    the filter's reach; glibc falls back to ``clone``), the `DENIED` calls EPERM; a call of another
    ABI (i386, x32) kills the process or fails."""
    if machine not in ARCHES:
        raise OSError(f"no seccomp filter for {machine} (only {', '.join(ARCHES)})")
    column, audit_arch = ARCHES[machine]
    nr = {name: numbers[column] for name, numbers in SYSCALLS.items()}
    code: list[tuple[int, str | None, str | None, int]] = []
    labels: dict[str, int] = {}

    def op(opcode: int, k: int, jt: str | None = None, jf: str | None = None) -> None:
        code.append((opcode, jt, jf, k))  # a jump to None goes on with the next instruction

    op(LD_ABS, 4)  # seccomp_data.arch
    op(JEQ, audit_arch, None, "kill")
    op(LD_ABS, 0)  # seccomp_data.nr
    if machine == "x86_64":
        op(JGE, X32_SYSCALL_BIT, "eperm")
    op(JEQ, nr["socket"], "family")
    op(JEQ, nr["socketpair"], "family")
    op(JEQ, nr["clone"], "clone")
    op(JEQ, nr["clone3"], "enosys")
    for name in DENIED:
        op(JEQ, nr[name], "eperm")
    op(RET, RET_ALLOW)
    labels["family"] = len(code)
    op(LD_ABS, 16)  # the low half of args[0]: the domain
    for family in families:
        op(JEQ, family, "allow")
    op(RET, RET_ERRNO | EAFNOSUPPORT)
    labels["clone"] = len(code)
    op(LD_ABS, 16)  # the low half of args[0]: the flags
    op(JSET, CLONE_NEW_NAMESPACES, "eperm")
    labels["allow"] = len(code)
    op(RET, RET_ALLOW)
    labels["eperm"] = len(code)
    op(RET, RET_ERRNO | EPERM)
    labels["enosys"] = len(code)
    op(RET, RET_ERRNO | ENOSYS)
    labels["kill"] = len(code)
    op(RET, RET_KILL_PROCESS)
    out = bytearray()
    for i, (opcode, jt, jf, k) in enumerate(code):
        jumps = [0 if label is None else labels[label] - i - 1 for label in (jt, jf)]
        out += struct.pack("=HBBI", opcode, jumps[0], jumps[1], k)
    return bytes(out)


def install_seccomp(families: list[int]) -> None:
    """The filter on this process and all it starts (needs ``no_new_privs`` or root)."""
    instructions = seccomp_filter(families, os.uname().machine)
    program = ctypes.create_string_buffer(instructions, len(instructions))
    fprog = _SockFprog(len(instructions) // 8, ctypes.cast(program, ctypes.c_void_p))
    if libc.prctl(PR_SET_SECCOMP, 2, ctypes.byref(fprog), 0, 0) != 0:  # 2: SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    args = [s.encode() if s is not None else None for s in (source, target, fstype)]
    if libc.mount(args[0], args[1], args[2], ctypes.c_ulong(flags), data.encode() if data else None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _mount_points() -> list[tuple[str, int]]:
    """(mount point, flags to keep) of every mount, parents before children."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")  # octal escapes such as \040
            flags = sum(KEPT_FLAGS.get(opt, 0) for opt in fields[5].split(","))
            out.append((point, flags))
    return out


def _bind(source: str, target: str) -> None:
    """``source`` (a directory or a file) at ``target``, with what is mounted under it."""
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "w").close()  # a mount point
    _mount(source, target, None, MS_BIND | MS_REC, None)


def private_root(binds: list[str], links: dict[str, str], tmp_bytes: int, uid: int) -> None:
    """A new root for this (private) mount namespace holding only ``binds`` (host paths, at the
    same place), ``links`` (symlinks), a few devices in /dev, a fresh /proc of this PID namespace
    and /tmp, a fresh tmpfs of ``tmp_bytes`` for ``uid``; every mount but /tmp and /proc
    read-only. The host's root is detached: nothing else of it can be reached."""
    new = "/tmp"  # any directory is a mount point here: nothing propagates to the host
    _mount("none", "/", None, MS_REC | MS_PRIVATE, None)
    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path in binds:
        _bind(path, new + path)
    for link, target in links.items():
        os.symlink(target, new + link)
    os.makedirs(new + "/dev")
    _mount("tmpfs", new + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
    for name in DEVICES:
        if os.path.exists("/dev/" + name):
            _bind("/dev/" + name, new + "/dev/" + name)
    for name, target in DEV_LINKS.items():
        os.symlink(target, new + "/dev/" + name)
    os.makedirs(new + "/dev/shm")
    os.makedirs(new + "/proc")
    _mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    os.makedirs(new + "/tmp")
    _mount("tmpfs", new + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmp_bytes},mode=0700,uid={uid},gid={uid}")
    os.chdir(new)
    if libc.syscall(PIVOT_ROOT[os.uname().machine], b".", b".") != 0:  # the old root under the new
        raise OSError(ctypes.get_errno(), "pivot_root")
    if libc.umount2(b".", MNT_DETACH) != 0:
        raise OSError(ctypes.get_errno(), "umount the host's root")
    os.chdir("/")
    for point, flags in _mount_points():
        if point in ("/tmp", "/proc"):
            continue
        try:
            _mount("none", point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | flags, None)
        except OSError:
            if os.path.exists(point) and not os.statvfs(point).f_flag & os.ST_RDONLY:
                raise  # a mount we could not make read-only is still writable: refuse


def write_files(files: dict[str, str], stdin: str, uid: int | None) -> None:
    """The files into /tmp, owned by ``uid`` with the directory; ``stdin`` as fd 0."""
    if uid is not None:
        os.chown("/tmp", uid, uid)
    for name, text in files.items():
        path = os.path.join("/tmp", name)
        with open(path, "w") as f:
            f.write(text)
        if uid is not None:
            os.chown(path, uid, uid)
    with open("/tmp/.stdin", "w") as f:
        f.write(stdin)
    fd = os.open("/tmp/.stdin", os.O_RDONLY)
    os.unlink("/tmp/.stdin")
    os.dup2(fd, 0)
    os.close(fd)


def confine(cfg: dict, uid: int | None, pipes: tuple[int, int] | None, all_pipes: tuple[int, ...]) -> None:
    """In a forked child: into the memory cgroup, the rlimits, ``uid``, the seccomp filter; its
    ``pipes`` to the other child on fds 3 (read) and 4 (write), every other end closed (a child
    still holding the other's write end would never see it close)."""
    if cfg["cgroup_fd"] is not None:
        os.write(cfg["cgroup_fd"], b"0")  # 0: this process; its children follow it
        os.close(cfg["cgroup_fd"])
    if pipes is not None:
        kept = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, FIRST_FREE_FD) for fd in pipes]
        for fd in all_pipes:
            os.close(fd)
        for target, fd in zip((3, 4), kept):
            os.dup2(fd, target)  # inheritable: the program keeps them across its exec
            os.close(fd)
    for name, value in cfg["limits"].items():
        hard = value + 1 if name == "RLIMIT_CPU" else value  # SIGXCPU first, SIGKILL a second later
        resource.setrlimit(getattr(resource, name), (value, hard))
    os.nice(19)
    if uid is not None and os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    install_seccomp(cfg["socket_families"])


def run_program(cfg: dict, pipes: tuple[int, int] | None, all_pipes: tuple[int, ...]) -> None:
    """In the forked child: confined, then exec. Never returns."""
    try:
        confine(cfg, cfg.get("uid"), pipes, all_pipes)
        os.chdir("/tmp")
        os.write(cfg["status_fd"], b"ready\n")
        os.close(cfg["status_fd"])
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
        os.execve(cfg["argv"][0], cfg["argv"], env)
    except BaseException as e:  # noqa: BLE001 - report anything, then leave without cleanup
        os.write(2, f"sandbox setup failed: {type(e).__name__}: {e}\n".encode())
        os._exit(125)


def run_checker(cfg: dict, pipes: tuple[int, int], all_pipes: tuple[int, ...]) -> None:
    """In the forked child: confined under its own uid and not dumpable (the program cannot trace
    it or read its memory), then the checker's source; exits with its status. Never returns."""
    try:
        confine(cfg, cfg.get("checker_uid"), pipes, all_pipes)
        if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:  # again: a change of uid may have reset it
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE)")
        os.chdir("/")  # not /tmp, which the program can write
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.write(cfg["status_fd"], b"checker-ready\n")
        os.close(cfg["status_fd"])
        source = compile(cfg["checker"], "checker.py", "exec")
    except BaseException as e:  # noqa: BLE001
        os.write(2, f"sandbox setup failed (checker): {type(e).__name__}: {e}\n".encode())
        os._exit(125)
    code = 0
    try:
        exec(source, {"__name__": "__main__"})  # noqa: S102 - the grader's own source, trusted
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:  # noqa: BLE001 - a failed check is its exit status, with the traceback
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _high(fd: int | None) -> int | None:
    """``fd`` moved to FIRST_FREE_FD or above, close-on-exec."""
    if fd is None:
        return None
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, FIRST_FREE_FD)
    os.close(fd)
    return moved


def _status(status: int) -> str:
    return f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"


def main() -> None:
    # Nothing in the sandbox may trace this process or read its memory: it holds the status pipe.
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    cfg = json.loads(sys.stdin.buffer.read())
    try:
        cfg["status_fd"], cfg["cgroup_fd"] = _high(cfg["status_fd"]), _high(cfg.get("cgroup_fd"))
        uid = cfg.get("uid") if os.geteuid() == 0 else None
        if cfg.get("mounts"):
            private_root(cfg["binds"], cfg["links"], cfg["tmp_bytes"], uid if uid is not None else os.geteuid())
        write_files(cfg["files"], cfg["stdin"], uid)
        checking = cfg.get("checker") is not None
        calls_r, calls_w = os.pipe() if checking else (-1, -1)  # checker -> program
        replies_r, replies_w = os.pipe() if checking else (-1, -1)  # program -> checker
        all_pipes = (calls_r, calls_w, replies_r, replies_w) if checking else ()
    except BaseException as e:  # noqa: BLE001
        os.write(2, f"sandbox setup failed: {type(e).__name__}: {e}\n".encode())
        os._exit(125)
    program = os.fork()
    if program == 0:
        run_program(cfg, (calls_r, replies_w) if checking else None, all_pipes)
    checker = None
    if checking:
        checker = os.fork()
        if checker == 0:
            run_checker(cfg, (replies_r, calls_w), all_pipes)
        for fd in all_pipes:
            os.close(fd)  # the children alone hold them: each sees the other's end close
    ended: dict[int, int] = {}
    waited_for = program if checker is None else checker
    while waited_for not in ended:  # reap every process the namespace hands to its init
        pid, status = os.wait()
        if pid in (program, checker):
            ended[pid] = status
    report = "".join(
        f"{name} {_status(ended[pid])}\n" for name, pid in (("program", program), ("checker", checker)) if pid in ended
    )
    os.write(cfg["status_fd"], report.encode())
    os._exit(0)


if __name__ == "__main__":
    main()
