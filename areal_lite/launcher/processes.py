"""The processes a launcher starts: each in its own process group, pinned to its cores and dying
with the launcher (``PR_SET_PDEATHSIG``), stopped by group (SIGTERM, then SIGKILL after a grace
period); and whether a server answers ``GET /health``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request

TEARDOWN_GRACE_S = 10.0
"""How long `stop` gives processes to exit on SIGTERM before it sends SIGKILL."""
_PR_SET_PDEATHSIG = 1


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


def spawn(cmd: list[str], *, cores: list[int], env: dict[str, str], log_path: str | None = None) -> subprocess.Popen:
    """Start ``cmd`` in its own process group, pinned to ``cores`` (when given), dying with us."""
    libc = _libc()

    def child_setup() -> None:
        if libc is not None:
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if cores:
            os.sched_setaffinity(0, cores)

    # preexec_fn is unsafe only in a multi-threaded parent; the launcher has a single thread.
    if log_path is None:
        return subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=child_setup)  # noqa: PLW1509
    with open(log_path, "ab") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            cmd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=child_setup,  # noqa: PLW1509
        )


def stop(procs: list[subprocess.Popen], grace: float = TEARDOWN_GRACE_S) -> None:
    """SIGTERM every process group, SIGKILL what is left after ``grace`` seconds, reap them all."""
    for p in procs:
        signal_group(p, signal.SIGTERM)
        signal_group(p, signal.SIGCONT)  # a stopped process (SIGSTOP, Ctrl-Z) acts on SIGTERM once it runs
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        # Also when the leader is gone: torchrun's workers may outlive it in the same group.
        signal_group(p, signal.SIGKILL)
        p.wait()


def signal_group(p: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the process group of ``p`` (gone already: nothing)."""
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def is_healthy(address: str, timeout: float = 2.0) -> bool:
    """Whether the server at ``address`` (``host:port``) answers ``GET /health`` with 200."""
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def log_tail(path: str, n: int = 3000) -> str:
    """The last ``n`` bytes of the log at ``path`` (empty when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""
