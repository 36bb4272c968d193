"""The embedded engine's small per-token operations on CPU, fused: a C++ library built at run time.

Between its matrix products a decoder layer runs, as torch ops, a residual add, an RMS norm (HF's
takes five ops), the rotary embedding (about eight) and SiLU times the up projection (three):
each a pass over a few hundred KB with its own dispatch. At the 16-64 rows of a decode step they
cost more than their arithmetic. `fused_ops.cpp` does each group in one pass over its rows,
rounding where HF's eager modules round (see there), and `ModelRunner` uses it on CPU in fp32 and
bf16 for models with SiLU MLPs; elsewhere, or where it cannot be built (no compiler,
``AREAL_LITE_FUSED_OPS=0``), the runner keeps the torch ops, with a warning naming the reason.
Built and cached as `cpu_kernels` says.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import torch

from areal_lite.engines import cpu_kernels

SOURCE = Path(__file__).with_name("fused_ops.cpp")
ENV = "AREAL_LITE_FUSED_OPS"
"""``0`` turns the fused ops off (the torch ops run instead)."""
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_lock = threading.Lock()
_loaded: dict[tuple[torch.dtype, str], ctypes.CDLL | None] = {}


class FusedOps:
    """The library's three operations on torch tensors of one dtype (CPU)."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype) -> None:
        self.dtype = dtype
        i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._norm = lib.add_rms_norm
        self._norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float, c_int]
        self._silu = lib.silu_mul
        self._silu.argtypes = [ptr, ptr, i64, i64, i64, c_int]
        self._rope = lib.rope_split
        self._rope.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, c_int]
        for fn in (self._norm, self._silu, self._rope):
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


def load(device: torch.device, dtype: torch.dtype) -> FusedOps | None:
    """The fused ops for ``dtype`` on ``device``, or None where they do not apply or cannot be
    built (the reason is logged once)."""
    if device.type != "cpu" or dtype not in _DTYPES or os.environ.get(ENV, "1") == "0":
        return None
    with _lock:
        key = (dtype, cpu_kernels.arch())
        if key not in _loaded:
            _loaded[key] = cpu_kernels.load_library(
                SOURCE, [f"-DBF16={_DTYPES[dtype]}"], key[1], "torch ops run instead"
            )
        lib = _loaded[key]
    return None if lib is None else FusedOps(lib, dtype)
