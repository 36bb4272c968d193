"""Training precision by name, including ``auto``: bf16 where the device computes it natively.

On a CPU with AVX-512 BF16 or AMX (measured here on an AMD EPYC with AVX-512 BF16) PyTorch's bf16
matrix products run 2.2x faster than fp32 ones; on a CPU without them bf16 is emulated and slower
than fp32, so ``auto`` stays in fp32 there. On CUDA, ``auto`` is bf16 where the GPU supports it.
"""

from __future__ import annotations

import torch

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 matrix products in hardware."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
        return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
    return False


def cpu_kind() -> str:
    """This CPU in a few words, for benchmark tables: its name and whether it computes bf16
    natively (AVX-512 BF16 or AMX) or only emulates it (AVX2-only kinds, where bf16 matmul runs
    ~50x slower than fp32)."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    name = str(caps.get("cpu_name") or "unknown CPU")
    cores = caps.get("num_logical_cores")
    if caps.get("amx_bf16"):
        kind = "AMX BF16 (bf16 native)"
    elif caps.get("avx512_bf16"):
        kind = "AVX-512 BF16 (bf16 native)"
    elif caps.get("avx512_f"):
        kind = "AVX-512 without BF16 (bf16 emulated)"
    else:
        kind = "AVX2 only (bf16 emulated)" if caps.get("avx2") else "no AVX2"
    return f"{name}, {cores} logical cores, {kind}" if cores else f"{name}, {kind}"


def compute_dtype(name: str, device: torch.device, allowed: tuple[str, ...] = tuple(COMPUTE_DTYPES)) -> torch.dtype:
    """The dtype a config's ``dtype`` names on ``device``; ``auto`` is bf16 where `native_bf16`,
    else fp32. ValueError for a name outside ``allowed`` (and ``auto``)."""
    if name == "auto":
        return torch.bfloat16 if native_bf16(device) and "bfloat16" in allowed else torch.float32
    if name not in allowed:
        raise ValueError(f"dtype must be auto or one of {sorted(allowed)}, got {name!r}")
    return COMPUTE_DTYPES[name]
