"""fp32 matrix products of training on CPU through oneDNN where MKL runs below the CPU's width.

PyTorch's CPU build sends an fp32 ``F.linear`` or ``mm`` to MKL. MKL picks its kernels by CPU
vendor, and on AMD CPUs it runs its AVX2 kernels even where the CPU has AVX-512. On Zen 4, whose
AVX-512 units are 256 bits wide, that costs little; on Zen 5, whose units are 512 bits wide, it
halves the rate: measured on a 2-core Zen 5 EPYC at one thread, the 20M model's training products
(2112 tokens; forward, input gradient and weight gradient) ran at 104-112 GFLOP/s through MKL and
at 205-257 through oneDNN, which picks its kernels by instruction set (the same library torch
already uses for bf16 products and the engine's packed linears). Results agree with MKL's to fp32
rounding (both ~1e-6 of a float64 reference).

`linear` is ``F.linear`` with that routing, differentiable: forward, input gradient and weight
gradient each through oneDNN, for fp32 CPU tensors whose product is at least `MIN_MACS` (below
that oneDNN's ~10 us per call costs more than it gains). `patch_for_training` puts it in place of
every ``nn.Linear`` forward of a model; `FSDPEngine` calls it on CPU and the chunked LM head uses
`linear` directly. Whether it is used is `enabled()`: ``AREAL_LITE_CPU_LINEAR`` = ``onednn`` (always),
``torch`` (never) or ``auto`` (the default: on AMD CPUs with AVX-512, where MKL takes its AVX2 path).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable

import torch
import torch.nn.functional as F

ENV = "AREAL_LITE_CPU_LINEAR"
"""``auto`` (default), ``onednn`` or ``torch``: see the module docstring."""

MIN_MACS = 1 << 20
"""Products below this many multiply-adds stay with ``F.linear``: at one thread a 64 x 64 x 64
product took 2-3 us through MKL and 12-15 us through oneDNN; at 256 x 64 x 64 the two were even."""


@functools.cache
def _amd_with_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            head = f.read(8192)
    except OSError:
        return False
    vendor = re.search(r"^vendor_id\s*:\s*(\S+)", head, flags=re.MULTILINE)
    flags = re.search(r"^flags\s*:(.*)$", head, flags=re.MULTILINE)
    return bool(vendor and vendor.group(1) == "AuthenticAMD" and flags and "avx512f" in flags.group(1).split())


def enabled() -> bool:
    """Whether fp32 training products go to oneDNN (`ENV`; ValueError for another value)."""
    choice = os.environ.get(ENV, "auto").strip().lower()
    if choice not in ("auto", "onednn", "torch"):
        raise ValueError(f"{ENV} must be auto, onednn or torch, got {choice!r}")
    if choice == "torch" or not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    return choice == "onednn" or _amd_with_avx512()


def _mm(a: torch.Tensor, b_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b_t.T + bias`` through oneDNN (2-D operands, any strides)."""
    return torch.ops.mkldnn._linear_pointwise(a, b_t, bias, "none", [], "")


class _Linear(torch.autograd.Function):
    """``F.linear`` of 2-D fp32 CPU tensors with its three products through oneDNN."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        need_x, need_w, _ = ctx.needs_input_grad
        # Each gradient needs the other operand only (a frozen weight's input is not kept).
        ctx.save_for_backward(x if need_w else None, weight if need_x else None)
        ctx.has_bias = bias is not None
        return _mm(x, weight, bias)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        dy = dy.contiguous()
        dx = _mm(dy, weight.t()) if need_x else None
        dw = _mm(dy.t(), x.t()) if need_w else None
        db = dy.sum(0) if ctx.has_bias and need_b else None
        return dx, dw, db


def _fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.dtype == weight.dtype == torch.float32
        and x.device.type == weight.device.type == "cpu"
        and type(weight) in (torch.Tensor, torch.nn.Parameter)
        and x.numel() // max(x.shape[-1], 1) * weight.shape[0] * weight.shape[1] >= MIN_MACS
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through oneDNN where `enabled` and the operands fit (fp32,
    CPU, plain tensors, at least `MIN_MACS`); ``F.linear`` otherwise."""
    if not (_fits(x, weight) and enabled()):
        return F.linear(x, weight, bias)
    y = _Linear.apply(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


def patch_for_training(model: torch.nn.Module) -> int:
    """Route the forward of every ``nn.Linear`` in ``model`` through `linear` (a no-op where
    `enabled` is false). Returns the number of layers patched."""
    if not enabled():
        return 0
    patched = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = _forward(module)
            patched += 1
    return patched


def _forward(module: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return linear(x, module.weight, module.bias)

    return forward
