"""The LM head's log-probabilities and entropy without keeping any logits: one autograd function.

``logprobs_from_hidden`` with autograd keeps, per chunk of rows, the fp32 logits (or recomputes
them through a checkpoint) and lets autograd differentiate ``logsumexp``, ``gather`` and the
entropy's softmax as separate full-vocabulary passes. On a GPU with a large vocabulary (151,936
for Qwen2.5) those passes over ``[chunk, V]`` fp32 tensors cost more than the head's matrix
products. `head_logprobs` instead:

- forward: per chunk, ``logits = hidden @ weight.T`` in the compute dtype, then one fused pass that
  reads them once and returns ``logz``, the label's log-probability and the entropy (fp32
  accumulation); nothing of size ``V`` is kept;
- backward: per chunk, the logits again, or the forward's where all of them fit in
  `KEEP_LOGITS_BYTES` (a GPU's memory holds a micro-batch's bf16 logits easily, and a matrix
  product fewer is a quarter of the head's work), one fused pass that writes ``dL/dlogits`` in the
  compute dtype, then ``dL/dhidden`` and ``dL/dweight`` (accumulated over chunks in fp32).

The gradient of the entropy ``H = logz - sum_j p_j l_j`` with respect to the logits is
``-p_k (log p_k + H)``; that of ``log p_y`` is ``onehot_y - p``. On CUDA the two fused passes are
compiled (`torch.compile`, `compile_elementwise`); elsewhere they run as eager torch ops, which is
how the CPU tests check the function against autograd.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

KEEP_LOGITS_BYTES = 8 << 30
"""The forward's logits (in the compute dtype) are kept for the backward up to this many bytes for
the whole call; above it the backward computes them again, one chunk at a time."""


def _forward_stats(
    logits: torch.Tensor, labels: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logz, logp[label], entropy)`` of each row of ``[C, V]`` logits, in fp32."""
    x = logits.float()
    logz = torch.logsumexp(x, dim=-1)
    logp = x.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - logz
    if with_entropy:
        entropy = logz - (torch.exp(x - logz.unsqueeze(-1)) * x).sum(dim=-1)
    else:
        entropy = torch.zeros_like(logz)
    return logz, logp, entropy


def _logits_grad(
    logits: torch.Tensor,
    labels: torch.Tensor,
    logz: torch.Tensor,
    entropy: torch.Tensor,
    g_logp: torch.Tensor,
    g_entropy: torch.Tensor,
) -> torch.Tensor:
    """``dL/dlogits`` for rows scored by ``g_logp`` and ``g_entropy``, in the logits' dtype."""
    x = logits.float()
    logq = x - logz.unsqueeze(-1)
    p = torch.exp(logq)
    onehot = torch.zeros_like(x).scatter_(-1, labels.unsqueeze(-1), 1.0)
    grad = g_logp.unsqueeze(-1) * (onehot - p) - g_entropy.unsqueeze(-1) * p * (logq + entropy.unsqueeze(-1))
    return grad.to(logits.dtype)


_COMPILED: dict[str, Callable[..., object]] = {}
_COMPILE = {"enabled": True}


def compile_elementwise(enabled: bool = True) -> None:
    """Use compiled fused passes on CUDA (the default) or eager torch ops everywhere."""
    _COMPILED.clear()
    _COMPILE["enabled"] = enabled


def _pass(name: str, fn: Callable[..., object], device: torch.device) -> Callable[..., object]:
    """``fn`` compiled on CUDA, else itself. If compiling fails at the first call (no inductor or
    Triton), ``fn`` runs instead from then on: the same values, more passes over memory."""
    if device.type != "cuda" or not _COMPILE["enabled"]:
        return fn
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn, dynamic=True, fullgraph=True)
    compiled = _COMPILED[name]

    def run(*args: object) -> object:
        if not _COMPILE["enabled"]:
            return fn(*args)
        try:
            return compiled(*args)
        except Exception as e:  # noqa: BLE001 - a real fault raises again from the eager ops below
            logger.warning("LM head: the compiled pass failed (%s: %s); running eager ops", type(e).__name__, e)
            _COMPILE["enabled"] = False
            return fn(*args)

    return run


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_size: int,
        with_entropy: bool,
        keep_logits_bytes: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        keep = n * weight.shape[0] * hidden.element_size() <= keep_logits_bytes
        kept: list[torch.Tensor] = []
        logz = hidden.new_empty(n, dtype=torch.float32)
        logp = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n, dtype=torch.float32)
        stats = _pass("forward", _forward_stats, hidden.device)
        for s in range(0, n, chunk_size):
            e = min(n, s + chunk_size)
            logits = hidden[s:e] @ weight.t()
            if keep:
                kept.append(logits)
            lz, lp, ent = stats(logits, labels[s:e], with_entropy)  # type: ignore[misc]
            logz[s:e], logp[s:e], entropy[s:e] = lz, lp, ent
        ctx.save_for_backward(hidden, weight, labels, logz, entropy)
        ctx.chunk_size = chunk_size
        ctx.kept = kept if keep else None
        return logp, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, g_logp: torch.Tensor, g_entropy: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None, None]:
        hidden, weight, labels, logz, entropy = ctx.saved_tensors  # type: ignore[attr-defined]
        chunk = ctx.chunk_size  # type: ignore[attr-defined]
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_logp = g_logp.float() if g_logp is not None else torch.zeros_like(logz)
        g_entropy = g_entropy.float() if g_entropy is not None else torch.zeros_like(logz)
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        grad_fn = _pass("backward", _logits_grad, hidden.device)
        kept = ctx.kept  # type: ignore[attr-defined]
        for i, s in enumerate(range(0, hidden.shape[0], chunk)):
            e = min(hidden.shape[0], s + chunk)
            h = hidden[s:e]
            logits = kept[i] if kept is not None else h @ weight.t()
            g = grad_fn(logits, labels[s:e], logz[s:e], entropy[s:e], g_logp[s:e], g_entropy[s:e])
            if grad_h is not None:
                grad_h[s:e] = g @ weight  # type: ignore[operator]
            if grad_w is not None:
                grad_w.add_(g.t() @ h)
        ctx.kept = None  # type: ignore[attr-defined]
        return grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None), None, None, None, None


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 4096,
    with_entropy: bool = False,
    keep_logits_bytes: int = KEEP_LOGITS_BYTES,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(hidden @ weight.T)[t, labels[t]]`` (and the entropy of each row), fp32,
    differentiable in ``hidden`` and ``weight`` without keeping logits (module docstring).

    Args:
        hidden: ``[T, H]`` final hidden states, in the compute dtype.
        weight: ``[V, H]`` the LM head weight, in the same dtype.
        labels: ``[T]`` int64 token ids to score.
        chunk_size: rows whose ``[chunk, V]`` logits exist at once.
        with_entropy: also return each row's entropy.
        keep_logits_bytes: keep the forward's logits for the backward up to this size.
    """
    logp, entropy = _HeadLogprobs.apply(hidden, weight, labels, chunk_size, with_entropy, keep_logits_bytes)
    return logp, (entropy if with_entropy else None)
