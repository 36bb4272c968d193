"""Run the service as a child process for a script, a test or a benchmark: `local_service` starts
``python -m areal_lite.service`` on a free loopback port, waits until it answers, and stops it
(killing it if it hangs) when the ``with`` block ends. Its log goes to a file, copied to stderr
at the end when ``TINKER_SERVICE_LOG`` is set."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

from areal_lite.utils.distributed import find_free_port


@contextmanager
def local_service(models: list[str], workdir: str, *extra: str, timeout: float = 180.0) -> Iterator[str]:
    """The service on ``models`` (``PATH`` or ``NAME=PATH``) with checkpoints in ``workdir``;
    yields its base URL and stops it (killing it if it hangs) on the way out."""
    port = find_free_port()
    cmd = [sys.executable, "-m", "areal_lite.service", "--port", str(port), "--workdir", workdir, *extra]
    for m in models:
        cmd += ["--model", m]
    log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the service
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"the service exited: {log.read().decode()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the service did not answer /api/v1/healthz")
            time.sleep(0.2)
        yield url
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if os.environ.get("TINKER_SERVICE_LOG"):
            log.seek(0)
            sys.stderr.write(log.read().decode())
        log.close()
