"""Causal attention over packed sequences in one kernel call, where the installed torch has one.

torch ships flash attention over variable-length sequences, `torch.nn.attention.varlen.varlen_attn`
(CUDA, fp16 and bf16): the sequences' tokens stay packed in one ``[T, heads, dim]`` tensor and
``cu_seqlens`` says where each starts, so attention costs ``sum(L_i^2)`` and needs no padding,
no mask and no loop over sequences. Its signature moved between releases (``is_causal`` in 2.10,
``window_size=(-1, 0)`` from 2.11; ``enable_gqa`` where grouped-query attention is native), which
`varlen_causal` papers over. Both the train engines (packed micro-batches) and the embedded
engine (batched prefill) call it; elsewhere (CPU, fp32, an older torch) `available` is False and
they keep their own paths.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch


@functools.cache
def _kernel() -> tuple[Callable[..., torch.Tensor], frozenset[str]] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `varlen_causal` runs for tensors on ``device`` in ``dtype``: CUDA, fp16 or bf16, and
    a torch that has it."""
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and _kernel() is not None


def varlen_causal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention within each packed sequence: ``q`` ``[T, heads, dim]``, ``k`` and ``v``
    ``[T, kv heads, dim]``, ``cu_seqlens`` ``[B + 1]`` (int32, on the device), ``max_seqlen`` the
    longest sequence (a host int: no device read). Returns ``[T, heads, dim]``."""
    found = _kernel()
    if found is None:
        raise RuntimeError("this torch has no torch.nn.attention.varlen (torch >= 2.10)")
    kernel, params = found
    kwargs: dict[str, object] = {"scale": scale}
    kwargs.update({"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True})
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    cu = cu_seqlens.to(torch.int32)
    return kernel(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, max_seqlen, max_seqlen, **kwargs)
