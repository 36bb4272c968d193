"""The embedded engine's small per-token operations on CPU, fused: a C++ library built at run time.

Between its matrix products a decoder layer runs, as torch ops, a residual add, an RMS norm (HF's
takes five ops), the rotary embedding (about eight) and SiLU times the up projection (three):
each a pass over a few hundred KB with its own dispatch. At the 16-64 rows of a decode step they
cost more than their arithmetic. `fused_ops.cpp` does each group in one pass over its rows,
rounding where HF's eager modules round (see there), and `ModelRunner` uses it on CPU in fp32 and
bf16 for models with SiLU MLPs; elsewhere, or where it cannot be built (no compiler, or
`CPUConfig.fused_ops` off), the runner keeps the torch ops, with a warning naming the reason.
Built and cached as `cpu_kernels` says.

The trainer's side (`patch_for_training`): the RMS norms and SiLU products of an HF model, forward
and backward in one fp32 pass each, as autograd functions that `FSDPEngine` puts in place of the
modules' forward where they run in fp32 on CPU.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from areal_lite.api.config import CPUConfig
from areal_lite.cpu import build as cpu_kernels
from areal_lite.cpu import switches

SOURCE = Path(__file__).with_name("fused_ops.cpp")
ENV = switches.FUSED_OPS_ENV
"""The variable that overrides `CPUConfig.fused_ops` (``0``: the torch ops run instead)."""
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_lock = threading.Lock()
_loaded: dict[tuple[torch.dtype, str], ctypes.CDLL | None] = {}


class FusedOps:
    """The library's operations: the engine's three on torch tensors of one dtype (CPU), and the
    trainer's raw fp32 functions that `_RMSNorm` and `_SiluMul` call."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype) -> None:
        self.dtype = dtype
        i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._norm = lib.add_rms_norm
        self._norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float, c_int]
        self._silu = lib.silu_mul
        self._silu.argtypes = [ptr, ptr, i64, i64, i64, c_int]
        self._rope = lib.rope_split
        self._rope.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, c_int]
        self.norm_forward = lib.rms_norm_forward
        self.norm_forward.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float, c_int]
        self.norm_backward = lib.rms_norm_backward
        self.norm_backward.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, c_int]
        self.silu_forward = lib.silu_mul_forward
        self.silu_forward.argtypes = [ptr, ptr, ptr, i64, c_int]
        self.silu_backward = lib.silu_mul_backward
        self.silu_backward.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, c_int]
        trainer = (self.norm_forward, self.norm_backward, self.silu_forward, self.silu_backward)
        for fn in (self._norm, self._silu, self._rope, *trainer):
            fn.restype = None

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``h += delta`` in place (skipped for None), then HF's RMS norm of ``h`` times ``weight``:
        [N, H] -> [N, H]."""
        n, width = h.shape
        assert h.is_contiguous() and h.dtype == weight.dtype == self.dtype and weight.shape == (width,)
        if delta is not None:
            delta = delta.contiguous()
            assert delta.shape == h.shape and delta.dtype == self.dtype
        weight = weight.contiguous()
        out = torch.empty_like(h)
        self._norm(
            h.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), out.data_ptr(),
            n, width, eps, torch.get_num_threads(),
        )  # fmt: skip
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of the fused gate/up projection [N, 2I] -> [N, I]."""
        n, two_i = gate_up.shape
        assert gate_up.stride(1) == 1 and gate_up.dtype == self.dtype and two_i % 2 == 0
        out = torch.empty((n, two_i // 2), dtype=self.dtype, device=gate_up.device)
        self._silu(gate_up.data_ptr(), out.data_ptr(), n, two_i // 2, gate_up.stride(0), torch.get_num_threads())
        return out

    def rope_split(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, nq: int, nkv: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused q/k/v projection [N, (nq + 2 nkv) hd] split into contiguous q [N, nq, hd],
        k [N, nkv, hd] and v [N, nkv, hd], q and k rotated by the rows ``positions`` [N] (int64) of
        the rotary tables ``cos`` and ``sin`` [positions, hd]."""
        n, width = qkv.shape
        hd = cos.shape[1]
        assert width == (nq + 2 * nkv) * hd and qkv.stride(1) == 1 and qkv.dtype == cos.dtype == self.dtype
        assert cos.is_contiguous() and sin.is_contiguous() and sin.shape == cos.shape and hd % 2 == 0
        assert positions.dtype == torch.int64 and positions.shape == (n,)
        positions = positions.contiguous()
        q = torch.empty((n, nq, hd), dtype=self.dtype, device=qkv.device)
        k = torch.empty((n, nkv, hd), dtype=self.dtype, device=qkv.device)
        v = torch.empty((n, nkv, hd), dtype=self.dtype, device=qkv.device)
        self._rope(
            qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), q.data_ptr(), k.data_ptr(),
            v.data_ptr(), n, nq, nkv, hd, qkv.stride(0), torch.get_num_threads(),
        )  # fmt: skip
        return q, k, v


def load(device: torch.device, dtype: torch.dtype, config: CPUConfig | None = None) -> FusedOps | None:
    """The fused ops for ``dtype`` on ``device``, built as ``config`` says (`switches`), or None
    where they do not apply, are switched off or cannot be built (the reason is logged once)."""
    if device.type != "cpu" or dtype not in _DTYPES or not switches.fused_ops(config):
        return None
    with _lock:
        key = (dtype, switches.kernel_arch(config))
        if key not in _loaded:
            _loaded[key] = cpu_kernels.load_library(
                SOURCE, [f"-DBF16={_DTYPES[dtype]}"], key[1], switches.kernel_cache(config), "torch ops run instead"
            )
        lib = _loaded[key]
    return None if lib is None else FusedOps(lib, dtype)


# ---- Training: the RMS norms and SiLU products of an HF model, fp32 on CPU, as autograd functions.

NORM_CLASSES = frozenset(
    f"{m}RMSNorm" for m in ("Llama", "Qwen2", "Qwen3", "Mistral", "Qwen2Moe", "Qwen3Moe", "Mixtral")
)
"""HF norm modules computing ``weight * x / sqrt(mean(x^2) + eps)`` (Gemma's ``1 + weight`` is not one)."""
MLP_CLASSES = frozenset(f"{m}MLP" for m in ("Llama", "Qwen2", "Qwen3", "Mistral", "Qwen2Moe", "Qwen3Moe"))
"""HF MLP modules computing ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``."""


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, ops: FusedOps) -> torch.Tensor:
        x2 = x.contiguous().view(-1, x.shape[-1])
        y = torch.empty_like(x2)
        rstd = torch.empty(x2.shape[0], dtype=x.dtype)
        n, width = x2.shape
        ops.norm_forward(
            x2.data_ptr(), weight.data_ptr(), y.data_ptr(), rstd.data_ptr(), n, width, eps, torch.get_num_threads()
        )
        ctx.save_for_backward(x2, weight, rstd)
        ctx.ops, ctx.shape = ops, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        x2, weight, rstd = ctx.saved_tensors
        dy2 = dy.contiguous().view(x2.shape)
        dx, dw = torch.empty_like(x2), torch.empty_like(weight)
        n, width = x2.shape
        ctx.ops.norm_backward(
            x2.data_ptr(), weight.data_ptr(), rstd.data_ptr(), dy2.data_ptr(), dx.data_ptr(), dw.data_ptr(),
            n, width, torch.get_num_threads(),
        )  # fmt: skip
        return dx.view(ctx.shape), dw, None, None


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, ops: FusedOps) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        ops.silu_forward(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(), torch.get_num_threads())
        ctx.save_for_backward(gate, up)
        ctx.ops = ops
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        gate, up = ctx.saved_tensors
        dout = dout.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        ctx.ops.silu_backward(
            gate.data_ptr(), up.data_ptr(), dout.data_ptr(), dg.data_ptr(), du.data_ptr(), gate.numel(),
            torch.get_num_threads(),
        )  # fmt: skip
        return dg, du, None


def _fits(*tensors: torch.Tensor) -> bool:
    """Whether the fused functions take these tensors: plain fp32 CPU tensors (FSDP gives its
    modules plain unsharded parameters in their forward)."""
    return all(
        type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype == torch.float32 and t.device.type == "cpu"
        for t in tensors
    )


def patch_for_training(model: torch.nn.Module, config: CPUConfig | None = None) -> int:
    """Route the forward of ``model``'s HF RMS norms and SiLU MLPs (`NORM_CLASSES`, `MLP_CLASSES`)
    through the fused functions where their inputs are fp32 on CPU; other inputs (bf16, CUDA) go to
    the module's own forward. Returns the number of modules patched (0 where ``config`` switches
    the fused ops off or they cannot be built)."""
    ops = load(torch.device("cpu"), torch.float32, config)
    if ops is None:
        return 0
    patched = 0
    for module in model.modules():
        name = type(module).__name__
        if name in NORM_CLASSES and hasattr(module, "variance_epsilon"):
            module.forward = _norm_forward(module, ops)
        elif name in MLP_CLASSES and type(getattr(module, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation"):
            module.forward = _mlp_forward(module, ops)
        else:
            continue
        patched += 1
    return patched


def _norm_forward(module: torch.nn.Module, ops: FusedOps) -> Callable[[torch.Tensor], torch.Tensor]:
    original = module.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not _fits(x, module.weight):
            return original(x)
        return _RMSNorm.apply(x, module.weight, module.variance_epsilon, ops)

    return forward


def _mlp_forward(module: torch.nn.Module, ops: FusedOps) -> Callable[[torch.Tensor], torch.Tensor]:
    original = module.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not _fits(x):
            return original(x)
        gate, up = module.gate_proj(x), module.up_proj(x)
        if not _fits(gate, up):
            return module.down_proj(module.act_fn(gate) * up)
        return module.down_proj(_SiluMul.apply(gate, up, ops))

    return forward
