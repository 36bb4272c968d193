"""keep_freed_memory: a large block freed by torch is reused without new page faults (glibc), until
the last holder releases the setting; the CPU train engine holds it from initialize to destroy, the
CPU inference engine while it runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from areal_lite.api.config import LocalEngineConfig, TrainEngineConfig
from areal_lite.api.io import FinetuneSpec
from areal_lite.cpu.malloc import _USER_SETTINGS, keep_freed_memory, kept_holders, release_freed_memory
from areal_lite.engines.local.engine import LocalInferenceEngine
from areal_lite.engines.train.fsdp import FSDPEngine
from areal_lite.utils.tiny import build_tiny_model

_PROBE = """
import resource, sys, torch
from areal_lite.cpu.malloc import keep_freed_memory, release_freed_memory
kept = keep_freed_memory() if sys.argv[1] in ("keep", "released") else False
if sys.argv[1] == "released":
    keep_freed_memory()  # two holders: the defaults come back only after both released
    release_freed_memory()
    release_freed_memory()
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
    for mode, expect_kept in (("default", "False"), ("released", "True")):
        kept, faults = _probe(mode, env)
        assert kept == expect_kept
        if "[always]" not in _thp_mode():  # huge pages would fault once per 2 MiB
            # glibc's defaults map the block afresh: 48 MiB touched anew is 12288 faults of 4 KiB pages
            assert faults > 1000, mode


def test_user_malloc_settings_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000000")
    before = kept_holders()
    assert keep_freed_memory() is False
    assert kept_holders() == before


def test_release_without_keep_is_an_error() -> None:
    if kept_holders() == 0:
        with pytest.raises(RuntimeError, match="without a keep_freed_memory"):
            release_freed_memory()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")
def test_cpu_train_engine_holds_the_setting_until_destroy(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _USER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    before = kept_holders()
    engine = FSDPEngine(TrainEngineConfig(path=build_tiny_model(str(tmp_path / "m"), hidden_size=32, num_layers=1)))
    engine.initialize(FinetuneSpec(total_train_epochs=1, dataset_size=4, train_batch_size=1))
    try:
        assert kept_holders() == before + 1
    finally:
        engine.destroy()
    assert kept_holders() == before
    engine.destroy()  # a second destroy releases nothing more
    assert kept_holders() == before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")
def test_cpu_inference_engine_holds_the_setting_until_destroy(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _USER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    before = kept_holders()
    path = build_tiny_model(str(tmp_path / "m"), hidden_size=32, num_layers=1)
    engine = LocalInferenceEngine(LocalEngineConfig(path=path))
    engine.initialize()
    try:
        assert kept_holders() == before + 1
    finally:
        engine.destroy()
    assert kept_holders() == before


_SAMPLER_PROBE = """
import resource, sys, threading, torch
from areal_lite.engines.local.sampling import inverse_cdf, running_sum_sample
from areal_lite.cpu.malloc import keep_freed_memory
torch.set_num_threads(1)
assert keep_freed_memory()
sampler = inverse_cdf if sys.argv[1] == "ours" else running_sum_sample
probs = torch.softmax(torch.randn(64, 151936), dim=-1)
u = torch.rand(64, 1, dtype=torch.float64)

def run():  # in a thread of its own, as the engine samples
    for _ in range(3):
        sampler(probs, u)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        sampler(probs, u)
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)

t = threading.Thread(target=run)
t.start()
t.join()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")
def test_sampling_in_the_engine_thread_faults_no_pages() -> None:
    """64 rows of a 151936-token vocabulary (Qwen's), sampled in a thread of its own as the engine
    samples, with freed memory kept: the engine's sampler reuses its memory from call to call,
    where one float64 running sum over each row (a 78 MB copy: glibc maps a block that large
    afresh in a thread's own arena whatever the settings) faulted it in at every call."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}

    def faults_per_call(sampler: str) -> float:
        cmd = [sys.executable, "-c", _SAMPLER_PROBE, sampler]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=300)
        return float(out.stdout.split()[-1])

    assert faults_per_call("ours") < 100
    if "[always]" not in _thp_mode():
        assert faults_per_call("one_level") > 10000  # 78 MB of 4 KiB pages is 19 thousand
