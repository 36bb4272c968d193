"""The first process inside a sandbox (`areal_lite.rewards.sandbox`): it sets the sandbox up, runs
the untrusted program as its child, and reports how that ended.

Run from its source (``python -I -S -c <this file>``) by ``unshare`` or ``bwrap`` in fresh namespaces,
so it imports nothing but the standard library. It reads one JSON object from stdin:

- ``files``: name -> text, written into the working directory (``/tmp``, a fresh tmpfs);
- ``stdin``: the program's standard input; ``argv``: the program's command line;
- ``limits``: rlimits by name (``RLIMIT_CPU``: seconds, the others bytes or counts);
- ``uid``: the unprivileged uid to run as, when started as root; ``mounts``: make every mount
  read-only and mount the tmpfs here (the ``unshare`` backend; ``bwrap`` does it itself);
- ``tmp_bytes``: the tmpfs's size; ``status_fd``: the inherited pipe that reports to the parent.

Then, as the init of the PID namespace, it forks the program: the child sets the rlimits and
``nice`` 19, drops to ``uid`` (no groups, no capabilities, ``no_new_privs``), writes ``ready`` on
the status pipe (``status_fd``) and execs the program with a bare environment. The parent reaps every process until the program
ends and writes ``exit N`` or ``signal N`` on the status pipe (``status_fd``). When it exits, the kernel kills whatever the
program left running in the namespace. Any failure before the exec is reported on stderr with exit
status 125 and no ``ready``.
"""

import ctypes
import json
import os
import resource
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_RELATIME = 1024, 2048, 4096, 1 << 21
PR_SET_NO_NEW_PRIVS = 38
KEPT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
              "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}  # fmt: skip

libc = ctypes.CDLL(None, use_errno=True)


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


def read_only_root(tmp_bytes: int, uid: int) -> None:
    """Every mount of this (private) mount namespace read-only; /tmp a fresh tmpfs for ``uid``."""
    for point, flags in _mount_points():
        try:
            _mount("none", point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | flags, None)
        except OSError:
            if os.path.exists(point) and not os.statvfs(point).f_flag & os.ST_RDONLY:
                raise  # a mount we could not make read-only is still writable: refuse
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmp_bytes},mode=0700,uid={uid},gid={uid}")


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


def run_program(cfg: dict) -> None:
    """In the forked child: limits, privileges, then exec. Never returns."""
    try:
        for name, value in cfg["limits"].items():
            hard = value + 1 if name == "RLIMIT_CPU" else value  # SIGXCPU first, SIGKILL a second later
            resource.setrlimit(getattr(resource, name), (value, hard))
        os.nice(19)
        uid = cfg.get("uid")
        if uid is not None and os.geteuid() == 0:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        os.chdir("/tmp")
        os.write(cfg["status_fd"], b"ready\n")
        os.close(cfg["status_fd"])
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
        os.execve(cfg["argv"][0], cfg["argv"], env)
    except BaseException as e:  # noqa: BLE001 - report anything, then leave without cleanup
        os.write(2, f"sandbox setup failed: {type(e).__name__}: {e}\n".encode())
        os._exit(125)


def main() -> None:
    cfg = json.loads(sys.stdin.buffer.read())
    try:
        uid = cfg.get("uid") if os.geteuid() == 0 else None
        if cfg.get("mounts"):
            read_only_root(cfg["tmp_bytes"], uid if uid is not None else os.geteuid())
        write_files(cfg["files"], cfg["stdin"], uid)
    except BaseException as e:  # noqa: BLE001
        os.write(2, f"sandbox setup failed: {type(e).__name__}: {e}\n".encode())
        os._exit(125)
    program = os.fork()
    if program == 0:
        run_program(cfg)
    while True:  # reap every process the namespace hands to its init, until the program ends
        pid, status = os.wait()
        if pid == program:
            break
    report = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
    os.write(cfg["status_fd"], f"{report}\n".encode())
    os._exit(0)


if __name__ == "__main__":
    main()
