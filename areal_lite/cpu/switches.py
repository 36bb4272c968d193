"""The CPU room's switches: each field of `CPUConfig` with the environment variable that overrides it.

A switch is a typed config field (`areal_lite.api.config.CPUConfig`, one in every train engine's
config and one in the embedded engine's). Its environment variable, set to a non-empty value, wins
over every config of the process: for a benchmark or a whole test run (``make test-avx2`` builds
the kernels for AVX2 with ``AREAL_LITE_KERNEL_ARCH=x86-64-v3``). The room reads these variables
here and nowhere else; a call without a config takes the fields' defaults.
"""

from __future__ import annotations

import os
from pathlib import Path

from areal_lite.api.config import CPUConfig

KERNEL_ARCH_ENV = "AREAL_LITE_KERNEL_ARCH"
"""Overrides `CPUConfig.kernel_arch`."""
KERNEL_CACHE_ENV = "AREAL_LITE_KERNEL_CACHE"
"""Overrides `CPUConfig.kernel_cache`."""
FUSED_OPS_ENV = "AREAL_LITE_FUSED_OPS"
"""Overrides `CPUConfig.fused_ops`: ``0`` off, anything else on."""
DECODE_ATTENTION_ENV = "AREAL_LITE_DECODE_KERNEL"
"""Overrides `CPUConfig.decode_attention`: ``0`` off, anything else on."""
FP32_LINEAR_ENV = "AREAL_LITE_CPU_LINEAR"
"""Overrides `CPUConfig.fp32_linear`: ``auto``, ``onednn`` or ``torch``."""
FP32_LINEAR_CHOICES = ("auto", "onednn", "torch")

_DEFAULTS = CPUConfig()


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


def kernel_arch(config: CPUConfig | None = None) -> str:
    """The ``-march`` of the compiled kernels."""
    return _env(KERNEL_ARCH_ENV) or (config or _DEFAULTS).kernel_arch or "native"


def kernel_cache(config: CPUConfig | None = None) -> Path:
    """The directory of the built kernels (default ``~/.cache/areal_lite/kernels``)."""
    root = _env(KERNEL_CACHE_ENV) or (config or _DEFAULTS).kernel_cache
    return Path(root or os.path.join(os.path.expanduser("~"), ".cache", "areal_lite", "kernels"))


def fused_ops(config: CPUConfig | None = None) -> bool:
    """Whether the fused per-token operations run."""
    value = _env(FUSED_OPS_ENV)
    return value != "0" if value else (config or _DEFAULTS).fused_ops


def decode_attention(config: CPUConfig | None = None) -> bool:
    """Whether the embedded engine's decode attention runs as the compiled kernel."""
    value = _env(DECODE_ATTENTION_ENV)
    return value != "0" if value else (config or _DEFAULTS).decode_attention


def fp32_linear(config: CPUConfig | None = None) -> str:
    """``auto``, ``onednn`` or ``torch``: where a train engine's fp32 products run (ValueError for
    another value)."""
    choice = _env(FP32_LINEAR_ENV).lower() or (config or _DEFAULTS).fp32_linear
    if choice not in FP32_LINEAR_CHOICES:
        raise ValueError(f"fp32_linear (or ${FP32_LINEAR_ENV}) must be auto, onednn or torch, got {choice!r}")
    return choice
