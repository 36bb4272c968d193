"""Training precision by name, including ``auto``: bf16 where the device computes it natively.

On a CPU with AVX-512 BF16 or AMX (measured here on an AMD EPYC with AVX-512 BF16) PyTorch's bf16
matrix products run 2.2x faster than fp32 ones; on a CPU without them bf16 is emulated and slower
than fp32, so ``auto`` stays in fp32 there. On CUDA, ``auto`` is bf16 where the GPU supports it.

oneDNN, which runs the CPU's matrix products, can be capped at a lower instruction set
(``ONEDNN_MAX_CPU_ISA``): capped below AVX-512 BF16 it emulates bf16 as on a CPU without it (on the
Zen 4 CPU: 0.9 GFLOP/s capped at ``AVX2``, 38 at ``AVX512_CORE``, 207 uncapped, fp32 ~90 in all
three), so a cap counts as the CPU's kind here. That also lets one machine stand in for the AVX2-only
kind (``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``, with the decode kernel built by
``AREAL_LITE_KERNEL_ARCH=x86-64-v3``: ``make test-avx2``; docs/performance.md).
"""

from __future__ import annotations

import os
import re

import torch

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


ONEDNN_BELOW_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"})
"""oneDNN's instruction-set names (``ONEDNN_MAX_CPU_ISA``) below AVX-512 BF16: capped at one of
these, oneDNN emulates bf16 matrix products."""


def onednn_isa_cap() -> str | None:
    """The instruction set oneDNN is capped at (``ONEDNN_MAX_CPU_ISA``, or its older name
    ``DNNL_MAX_CPU_ISA``), upper case; None when it is not capped."""
    value = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip()
    return value.upper() or None


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 matrix products in hardware (on a CPU: it has AVX-512 BF16
    or AMX, and oneDNN is not capped below them)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
        return bool(caps.get("avx512_bf16") or caps.get("amx_bf16")) and onednn_isa_cap() not in ONEDNN_BELOW_BF16
    return False


def cpu_kind() -> str:
    """This CPU in a few words, for benchmark tables: its name and whether it computes bf16
    natively (AVX-512 BF16 or AMX) or only emulates it (AVX2-only kinds, where bf16 matmul runs
    ~50x slower than fp32, or oneDNN capped below AVX-512 BF16), with any instruction-set cap."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    name = str(caps.get("cpu_name") or "unknown CPU")
    generation = _amd_generation()
    if generation:
        name += f" ({generation})"
    cores = caps.get("num_logical_cores")
    if caps.get("amx_bf16"):
        isa = "AMX BF16"
    elif caps.get("avx512_bf16"):
        isa = "AVX-512 BF16"
    elif caps.get("avx512_f"):
        isa = "AVX-512 without BF16"
    else:
        isa = "AVX2 only" if caps.get("avx2") else "no AVX2"
    kind = f"{isa} (bf16 {'native' if native_bf16(torch.device('cpu')) else 'emulated'})"
    cap = onednn_isa_cap()
    if cap is not None:
        kind += f", oneDNN capped at {cap}"
    if os.environ.get("ATEN_CPU_CAPABILITY"):
        kind += f", torch kernels at {torch.backends.cpu.get_cpu_capability()}"
    return f"{name}, {cores} logical cores, {kind}" if cores else f"{name}, {kind}"


def compute_dtype(name: str, device: torch.device, allowed: tuple[str, ...] = tuple(COMPUTE_DTYPES)) -> torch.dtype:
    """The dtype a config's ``dtype`` names on ``device``; ``auto`` is bf16 where `native_bf16`,
    else fp32. ValueError for a name outside ``allowed`` (and ``auto``)."""
    if name == "auto":
        return torch.bfloat16 if native_bf16(device) and "bfloat16" in allowed else torch.float32
    if name not in allowed:
        raise ValueError(f"dtype must be auto or one of {sorted(allowed)}, got {name!r}")
    return COMPUTE_DTYPES[name]


def cpuinfo_fields(text: str | None = None) -> dict[str, str]:
    """The first processor's ``vendor_id``, ``cpu family``, ``model`` and ``flags`` from
    /proc/cpuinfo's text (``text``, or the file's; {} where it cannot be read)."""
    if text is None:
        try:
            with open("/proc/cpuinfo") as f:
                text = f.read(8192)
        except OSError:
            return {}
    found = re.findall(r"^(vendor_id|cpu family|model|flags)\s*:(.*)$", text, flags=re.MULTILINE)
    fields: dict[str, str] = {}
    for key, value in found:
        fields.setdefault(key, value.strip())  # the first processor's
    return fields


def _amd_generation() -> str | None:
    """An AMD CPU's core generation from /proc/cpuinfo's family and model ("Zen 4, family 25
    model 17"): one name ("AMD EPYC") covers kinds whose bf16 and fp32 rates differ by 2x and more;
    None elsewhere."""
    fields = cpuinfo_fields()
    if fields.get("vendor_id") != "AuthenticAMD" or not fields.get("cpu family", "").isdigit():
        return None
    family, model = int(fields["cpu family"]), int(fields.get("model", "0") or "0")
    zen4 = family == 25 and (0x10 <= model <= 0x1F or 0x60 <= model <= 0x7F or 0xA0 <= model <= 0xAF)
    label = {23: "Zen 1-2", 26: "Zen 5"}.get(family) or ("Zen 4" if zen4 else "Zen 3" if family == 25 else None)
    where = f"family {family} model {model}"
    return f"{label}, {where}" if label else where
