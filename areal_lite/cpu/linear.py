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
every ``nn.Linear`` forward of a model (`TrainerTuning.tune_model`, for FSDP on CPU) and the
chunked LM head uses `linear` directly. Whether it is used is `enabled()`, by
`CPUConfig.fp32_linear` (or ``$AREAL_LITE_CPU_LINEAR``: `areal_lite.cpu.switches`): ``onednn``
(always), ``torch`` (never) or ``auto`` (the default: on AMD CPUs from Zen 5 on, whose AVX-512 is
full width, unless oneDNN is capped below AVX-512). The chunked head is no module to patch: it
follows the config of the train engine that started last in the process (`follow`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from areal_lite.api.config import CPUConfig
from areal_lite.cpu import switches
from areal_lite.cpu.precision import cpuinfo_fields, onednn_isa_cap

_followed = CPUConfig()
"""The config `linear` and the patched layers follow: the last train engine's on CPU (`follow`)."""

MIN_MACS = 1 << 20
"""Products below this many multiply-adds stay with ``F.linear``: at one thread a 64 x 64 x 64
product took 2-3 us through MKL and 12-15 us through oneDNN; at 256 x 64 x 64 the two were even."""


def full_width_amd(cpuinfo: str | None = None) -> bool:
    """Whether ``cpuinfo`` (/proc/cpuinfo's text; this machine's when None) is an AMD CPU of
    family 26 (Zen 5) or later with AVX-512: where MKL's AVX2 kernels run at half the CPU's fp32
    rate. Zen 4 (family 25) executes AVX-512 in 256-bit halves; there oneDNN's forward products ran
    a few percent faster than MKL's and its weight gradients slower (docs/performance.md), so
    ``auto`` leaves Zen 4 to MKL."""
    fields = cpuinfo_fields(cpuinfo)
    family = fields.get("cpu family", "")
    return (
        fields.get("vendor_id") == "AuthenticAMD"
        and family.isdigit()
        and int(family) >= 26
        and "avx512f" in fields.get("flags", "").split()
    )


_this_cpu_is_full_width_amd = functools.cache(full_width_amd)


ONEDNN_BELOW_AVX512 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2"})
"""oneDNN's instruction-set caps (``ONEDNN_MAX_CPU_ISA``) that leave it no wider than MKL's AVX2
kernels: ``auto`` keeps ``F.linear`` under them (as `make test-avx2` runs, standing in for AVX2-only
CPUs)."""


def follow(config: CPUConfig) -> None:
    """From now on, route this process's fp32 training products as ``config.fp32_linear`` says
    (a train engine on CPU, as it starts: `TrainerTuning`)."""
    global _followed
    _followed = config


def enabled() -> bool:
    """Whether fp32 training products go to oneDNN, by the followed config's ``fp32_linear`` or
    its environment override (`switches.fp32_linear`; ValueError for another value)."""
    choice = switches.fp32_linear(_followed)
    if choice == "torch" or not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    return choice == "onednn" or (_this_cpu_is_full_width_amd() and onednn_isa_cap() not in ONEDNN_BELOW_AVX512)


def onednn_linear(a: torch.Tensor, b_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b_t.T + bias`` through oneDNN (2-D operands, any strides), without autograd."""
    return torch.ops.mkldnn._linear_pointwise(a, b_t, bias, "none", [], "")


class _Linear(torch.autograd.Function):
    """``F.linear`` of 2-D fp32 CPU tensors with its three products through oneDNN."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        need_x, need_w, _ = ctx.needs_input_grad
        # Each gradient needs the other operand only (a frozen weight's input is not kept).
        ctx.save_for_backward(x if need_w else None, weight if need_x else None)
        ctx.has_bias = bias is not None
        return onednn_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        dy = dy.contiguous()
        dx = onednn_linear(dy, weight.t()) if need_x else None
        dw = onednn_linear(dy.t(), x.t()) if need_w else None
        db = dy.sum(0) if ctx.has_bias and need_b else None
        return dx, dw, db


def _fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Plain fp32 CPU tensors (not DTensors: FSDP gives its modules plain unsharded parameters in
    their forward), a product of at least `MIN_MACS`, and no CPU autocast (which would run
    ``F.linear`` in its lower dtype)."""
    return (
        x.dtype == weight.dtype == torch.float32
        and x.device.type == weight.device.type == "cpu"
        and type(x) in _PLAIN
        and type(weight) in _PLAIN
        and x.numel() // max(x.shape[-1], 1) * weight.shape[0] * weight.shape[1] >= MIN_MACS
        and not torch.is_autocast_enabled("cpu")
    )


_PLAIN = (torch.Tensor, torch.nn.Parameter)


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
