"""The CPU room's switches and entry points: each `CPUConfig` field and the environment variable
that overrides it, and the switches reaching the kernels of the engines that hold the config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from areal_lite.api.config import CPUConfig, LocalEngineConfig
from areal_lite.cpu import EngineTuning, TrainerTuning, engine_kernels, switches
from areal_lite.cpu import linear as cpu_linear

ENVS = (
    switches.KERNEL_ARCH_ENV,
    switches.KERNEL_CACHE_ENV,
    switches.FUSED_OPS_ENV,
    switches.DECODE_ATTENTION_ENV,
    switches.FP32_LINEAR_ENV,
)


@pytest.fixture
def no_overrides(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ENVS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_defaults_are_the_fields_defaults(no_overrides: pytest.MonkeyPatch) -> None:
    assert switches.kernel_arch() == "native"
    assert switches.kernel_cache() == Path.home() / ".cache" / "areal_lite" / "kernels"
    assert switches.fused_ops() and switches.decode_attention()
    assert switches.fp32_linear() == "auto"


def test_a_config_sets_each_switch(no_overrides: pytest.MonkeyPatch, tmp_path) -> None:
    config = CPUConfig(
        kernel_arch="x86-64-v3",
        kernel_cache=str(tmp_path),
        fused_ops=False,
        decode_attention=False,
        fp32_linear="torch",
    )
    assert switches.kernel_arch(config) == "x86-64-v3"
    assert switches.kernel_cache(config) == tmp_path
    assert not switches.fused_ops(config) and not switches.decode_attention(config)
    assert switches.fp32_linear(config) == "torch"


def test_a_set_variable_overrides_the_config(no_overrides: pytest.MonkeyPatch, tmp_path) -> None:
    """As ``make test-avx2`` sets ``AREAL_LITE_KERNEL_ARCH`` for a whole run; an empty variable
    counts as unset."""
    config = CPUConfig(fused_ops=False, decode_attention=True, fp32_linear="onednn")
    no_overrides.setenv(switches.KERNEL_ARCH_ENV, "x86-64-v3")
    no_overrides.setenv(switches.KERNEL_CACHE_ENV, str(tmp_path))
    no_overrides.setenv(switches.FUSED_OPS_ENV, "1")
    no_overrides.setenv(switches.DECODE_ATTENTION_ENV, "0")
    no_overrides.setenv(switches.FP32_LINEAR_ENV, " Torch ")
    assert switches.kernel_arch(config) == "x86-64-v3"
    assert switches.kernel_cache(config) == tmp_path
    assert switches.fused_ops(config) and not switches.decode_attention(config)
    assert switches.fp32_linear(config) == "torch"
    for name in ENVS:
        no_overrides.setenv(name, "")
    assert switches.kernel_arch(config) == "native" and not switches.fused_ops(config)
    assert switches.fp32_linear(config) == "onednn"


def test_engine_kernels_follow_the_config(no_overrides: pytest.MonkeyPatch) -> None:
    off = CPUConfig(fused_ops=False, decode_attention=False)
    kernels = engine_kernels(torch.device("cpu"), torch.float32, 64, 1, off)
    assert kernels.attention is None and kernels.ops is None and kernels.block == 1
    meta = engine_kernels(torch.device("meta"), torch.float32, 64, 1)
    assert meta.attention is None and meta.ops is None and meta.block == 1


def test_the_embedded_engine_takes_its_configs_switches(no_overrides: pytest.MonkeyPatch, tmp_path) -> None:
    from areal_lite.engines.local.engine import LocalInferenceEngine
    from areal_lite.utils.tiny import build_tiny_model

    path = build_tiny_model(str(tmp_path / "m"), hidden_size=64, num_layers=1)
    cpu = CPUConfig(fused_ops=False, decode_attention=False)
    engine = LocalInferenceEngine(LocalEngineConfig(path=path, cpu=cpu))
    engine.initialize()
    try:
        runner = engine.scheduler._runner
        assert runner is not None
        assert runner.ops is None and runner.decode_attention is None and runner.cache.block == 1
    finally:
        engine.destroy()


def test_a_train_engine_off_the_cpu_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off the CPU a train engine's tuning patches no layer and leaves the followed route alone."""
    monkeypatch.setattr(cpu_linear, "_followed", CPUConfig())
    tuning = TrainerTuning(CPUConfig(fp32_linear="onednn"))
    layer = torch.nn.Linear(4, 4)
    tuning.tune_model(layer, torch.device("meta"))
    tuning.keep_step_memory(torch.device("meta"))
    tuning.startup_done(torch.device("meta"))
    assert "forward" not in vars(layer)
    assert cpu_linear._followed.fp32_linear == "auto"
    tuning.release()  # holds nothing: a no-op
    tuning.stop_sharing_cores()


def test_the_engines_cores_are_checked_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"local_engine.cores=\[4096\]"):
        EngineTuning(LocalEngineConfig(path="unused", cores=[4096])).check_cores()
