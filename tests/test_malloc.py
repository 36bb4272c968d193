"""keep_freed_memory: a large block freed by torch is reused without new page faults (glibc)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from areal_lite.utils.malloc import keep_freed_memory

_PROBE = """
import resource, sys, torch
from areal_lite.utils.malloc import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
big = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, above glibc's largest mmap threshold
del big
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.ones(48 << 20, dtype=torch.uint8)  # fits in the freed block
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read()
    except OSError:
        return ""


def _probe(mode: str, env: dict[str, str]) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], env=env, capture_output=True, text=True, check=True, timeout=120
    )
    kept, faults = out.stdout.split()
    return kept, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")
def test_freed_blocks_are_reused_without_page_faults() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    kept, faults = _probe("keep", env)
    assert kept == "True"
    assert faults < 100
    kept, faults = _probe("default", env)
    assert kept == "False"
    if "[always]" not in _thp_mode():  # huge pages would fault once per 2 MiB
        assert (
            faults > 1000
        )  # glibc's default maps the block afresh  # 48 MiB touched afresh would be 12288 faults of 4 KiB pages


def test_user_malloc_settings_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("areal_lite.utils.malloc._done", False)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000000")
    assert keep_freed_memory() is False
