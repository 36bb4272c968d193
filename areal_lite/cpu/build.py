"""Building the embedded engine's C++ kernels at run time (`decode_attention`, `fused_ops`).

A kernel's source is compiled with the system's C++ compiler (``$CXX`` or ``g++``, OpenMP, the
``-march`` of `CPUConfig.kernel_arch`: ``native``, or e.g. ``x86-64-v3``, the AVX2 code of the CPUs
without AVX-512, which runs on either kind) into a shared library cached in
`CPUConfig.kernel_cache` (default ``~/.cache/areal_lite/kernels``; both as `areal_lite.cpu.switches`
resolves them), keyed by the source, the flags, the macros, the compiler and the CPU's flags.
Processes building the same kernel at once each compile to a temporary name and rename, so none
loads a half-written file.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-ffast-math", "-fopenmp", "-std=c++20", "-shared", "-fPIC")
"""Besides ``-march``: -ffast-math lets the compiler vectorize ``exp`` (glibc's vector math)."""


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build(compiler: str, source: Path, macros: list[str], march: str, cache: Path) -> Path:
    """The shared library of ``source`` for ``macros`` and ``-march``, compiled into ``cache``
    unless there already."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    flags = [*FLAGS, f"-march={march}"]
    key = hashlib.sha256("\0".join([source.read_text(), *flags, *macros, version, _cpu_flags()]).encode()).hexdigest()
    lib = cache / f"{source.stem}_{key[:24]}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, *macros, str(source), "-o", tmp], capture_output=True, text=True, check=True)
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def load_library(source: Path, macros: list[str], march: str, cache: Path, what: str) -> ctypes.CDLL | None:
    """``source`` built for ``macros`` and ``-march`` (cached in ``cache``) and loaded; None, with a
    warning saying what runs instead (``what``), where there is no compiler or the build fails."""
    compiler = os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None:
        logger.warning("no C++ compiler (%s): %s", compiler, what)
        return None
    try:
        return ctypes.CDLL(str(_build(compiler, source, macros, march, cache)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning("could not build %s: %s; %s", source.name, detail[-2000:], what)
        return None
