"""The model runner's fused projections: each decoder layer's q/k/v weights (and biases) in one
tensor and its MLP's gate/up in another, so that a step runs one matmul for each instead of five.

The HF modules' parameters become views into the fused tensors, so a weight update that copies
into the model's parameters (as every update of the embedded engine does) updates both at once.
A mixture-of-experts block (no ``gate_proj``) gets no fused gate/up and runs as its HF module.
"""

from __future__ import annotations

import torch

Fused = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
"""A layer's fused (q/k/v weight, q/k/v bias, gate/up weight, gate/up bias); None where absent."""


def _fuse(linears: list[torch.nn.Linear], attr: str) -> torch.Tensor | None:
    parts = [getattr(m, attr) for m in linears]
    if parts[0] is None:
        return None
    fused = torch.cat([p.data for p in parts])
    start = 0
    for m, p in zip(linears, parts):
        getattr(m, attr).data = fused[start : start + p.shape[0]]
        start += p.shape[0]
    return fused


def fuse_layer(layer: torch.nn.Module) -> Fused:
    """Fuse ``layer``'s projections in place (its parameters become views of the results)."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
    w_qkv = _fuse(qkv, "weight")
    assert w_qkv is not None
    if not hasattr(mlp, "gate_proj"):
        return w_qkv, _fuse(qkv, "bias"), None, None
    gate_up = [mlp.gate_proj, mlp.up_proj]
    return w_qkv, _fuse(qkv, "bias"), _fuse(gate_up, "weight"), _fuse(gate_up, "bias")


def fused_views(layer: torch.nn.Module) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The parameters of ``layer`` that are views of its fused q/k/v and gate/up weights."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = tuple(m.weight for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    gate_up = tuple(m.weight for m in (mlp.gate_proj, mlp.up_proj)) if hasattr(mlp, "gate_proj") else ()
    return qkv, gate_up


__all__ = ["Fused", "fuse_layer", "fused_views"]
