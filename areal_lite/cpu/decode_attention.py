"""The embedded engine's decode attention on CPU: a small C++ kernel built at run time.

One decode step attends one query per cache row to that row's cached keys and values. As two
batched matmuls over the (row, KV head) pairs, torch runs hundreds of tiny products per layer:
on the AVX-512 BF16 Zen 4 CPU, 4 ms per SmolLM2 layer at 64 rows of ~250 positions, about half a
decode step, at a few GB/s of cache read. This kernel walks each pair's keys and values once,
with the scores of a block of positions in vector registers, softmax and the value sum in float32,
and each row only as far as its own length (no mask, no padding to the longest row).

It is compiled at run time (`cpu_kernels`: the system's C++ compiler, the ``-march`` of
`CPUConfig.kernel_arch`, cached) for one (dtype, head dim, query heads per KV head). Where it does
not apply or cannot be built (no compiler, another device or dtype, a head dimension not a
multiple of 16, `CPUConfig.decode_attention` off), `load` returns None and the model runner keeps
its batched matmuls, with a warning naming the reason.
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

SOURCE = Path(__file__).with_name("decode_attention.cpp")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
BLOCK = 16
"""Positions per block of the key cache the kernel reads: keys are stored [rows, kv heads,
capacity / BLOCK, head_dim, BLOCK]."""
_lock = threading.Lock()
_loaded: dict[tuple[torch.dtype, int, int, str], Callable[..., None] | None] = {}

DecodeAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]
"""``(q [rows, heads, D], new keys [rows, kv heads, D], new values [rows, kv heads, D], k cache
[>=rows, kv heads, cap / BLOCK, D, BLOCK], v cache [>=rows, kv heads, cap, D], lens [rows] int64,
scale) -> [rows, heads, D]``: writes each row's new key and value at its position ``lens - 1``,
then attends to positions ``0 .. lens - 1``."""


def _load_kernel(dtype: torch.dtype, head_dim: int, group: int, march: str, cache: Path) -> Callable[..., None] | None:
    macros = [f"-DBF16={_DTYPES[dtype]}", f"-DHD={head_dim}", f"-DGROUP={group}"]
    lib = cpu_kernels.load_library(SOURCE, macros, march, cache, "decode attention runs as batched matmuls")
    if lib is None:
        return None
    fn = lib.decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, i64, ctypes.c_int]
    fn.restype = None
    return fn


def load(
    device: torch.device, dtype: torch.dtype, head_dim: int, group: int, config: CPUConfig | None = None
) -> DecodeAttention | None:
    """The decode attention kernel for these shapes, built as ``config`` says (`switches`), or None
    where it does not apply, is switched off or cannot be built (the reason is logged once)."""
    if device.type != "cpu" or dtype not in _DTYPES or head_dim % 16 or not switches.decode_attention(config):
        return None
    with _lock:
        key = (dtype, head_dim, group, switches.kernel_arch(config))
        if key not in _loaded:
            _loaded[key] = _load_kernel(*key, switches.kernel_cache(config))
        fn = _loaded[key]
    if fn is None:
        return None

    def attend(
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        rows = q.shape[0]
        assert q.dtype == k.dtype == v.dtype == k_new.dtype == v_new.dtype == dtype and lens.dtype == torch.int64
        assert k_new.shape == v_new.shape == (rows, k.shape[1], head_dim) and lens.shape == (rows,)
        assert int(lens.min()) >= 1
        assert k.shape[3:] == (head_dim, BLOCK) and k.stride(2) == head_dim * BLOCK and k.stride(4) == 1
        assert v.stride(3) == 1 and v.stride(2) == head_dim
        longest = int(lens.max())
        assert q.shape[0] <= min(k.shape[0], v.shape[0]) and longest <= min(k.shape[2] * BLOCK, v.shape[2])
        q, k_new, v_new, lens = q.contiguous(), k_new.contiguous(), v_new.contiguous(), lens.contiguous()
        out = torch.empty_like(q)
        fn(
            q.data_ptr(), k_new.data_ptr(), v_new.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
            lens.data_ptr(), rows, k.shape[1],
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), scale, longest,
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    return attend
