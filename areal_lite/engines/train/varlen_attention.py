"""Attention over packed sequences, one sequence at a time, for transformers models on CPU.

Packed micro-batches hold many sequences in one row. transformers' built-in ``sdpa`` and
``eager`` attention see position ids restarting per sequence and build a block-diagonal causal
mask over the whole row, so attention costs ``T^2`` for ``T`` packed tokens. This attention
function instead runs ``scaled_dot_product_attention`` (causal, no mask) on each sequence's slice,
which costs ``sum(L_i^2)`` and cannot attend across sequences whatever the position ids. It is
what flash-attention's varlen kernel does on CUDA, written with PyTorch ops. When the sequences
are of similar length (padding them to the longest wastes at most ``PAD_WASTE`` x the work), they
are gathered into one padded batch and run as a single masked SDPA call instead: many short
sequences (RL completions on CPU) would otherwise cost one Python-level call each per layer.

On CPU, attention of bf16 or fp16 inputs is computed in fp32: PyTorch's CPU flash-attention
backward ran 14x slower in bf16 than in fp32 on 256 sequences of 12 tokens (and attention is a
small share of the FLOPs of short sequences).

On CUDA in bf16 or fp16, where torch has varlen attention (`areal_lite.utils.flash_varlen`), the
whole packed row goes to that one kernel instead: one call per layer per micro-batch, no loop, no
gather and no read of the boundaries back to the host (``max_length_q`` comes from the packing).

Compiled decoder layers (``compile_layers``) run this function eagerly between their graphs: its
paths read boundaries on the host or pass a new ``max_length_q`` per packing, which would make a
traced graph recompile for every micro-batch.

It needs the sequence boundaries as the ``cu_seq_lens_q`` keyword that transformers forwards from
the model call to every attention layer (the name its flash-attention path uses). Registering
under a name that has no mask function also stops transformers from building the ``T x T`` mask.
A ``tree_branches`` keyword (``[T]``, `areal_lite.engines.train.shared_prefix`) makes the sequences trees
of a shared prefix and suffixes: attention stays causal but never crosses between suffixes.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from areal_lite.utils import flash_varlen

VARLEN_SDPA = "areal_varlen_sdpa"
PAD_WASTE = 2.0
"""Largest ``B * max(L)^2 / sum(L^2)`` for which the padded single-call path is used."""
DENSE_TREE_MAX = 128
"""Tree sequences up to this long are attended with a dense tree mask in one padded call (per-row
overheads dominate short trees: 3.8 vs 8.7 ms per layer forward + backward for the quickstart's
32 trees of ~46 tokens); longer ones a row per prefix and per suffix (2x faster updates than the
dense mask with 200-token prompts: benchmarks/shared_prefix.py)."""


@torch.compiler.disable
def varlen_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed sequence. ``query`` is ``[1, heads, T, dim]`` and
    ``key``/``value`` ``[1, kv_heads, T, dim]``; returns ``[1, T, heads, dim]`` as transformers
    expects."""
    bounds = kwargs.get("cu_seq_lens_q")
    if not isinstance(bounds, torch.Tensor) or query.shape[0] != 1:
        raise ValueError(f"{VARLEN_SDPA} attention needs one packed row and cu_seq_lens_q (packed forward only)")
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"{VARLEN_SDPA} attention does not implement sliding windows")
    gqa = query.shape[1] != key.shape[1]
    p = dropout if module.training else 0.0
    branches = kwargs.get("tree_branches")
    longest = kwargs.get("max_length_q")
    if branches is None and not p and isinstance(longest, int) and flash_varlen.available(query.device, query.dtype):
        out = flash_varlen.varlen_causal(
            query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), bounds, longest, scaling
        )
        return out.unsqueeze(0), None
    dtype = query.dtype
    if dtype in (torch.bfloat16, torch.float16) and query.device.type == "cpu":
        query, key, value = query.float(), key.float(), value.float()
    cu = bounds.tolist()
    lens = [e - s for s, e in itertools.pairwise(cu)]
    if isinstance(branches, torch.Tensor):
        if max(lens) <= DENSE_TREE_MAX:
            out = _padded_sdpa(query, key, value, cu, lens, p, scaling, gqa, branches)
        else:
            out = _branch_sdpa(query, key, value, cu, branches.tolist(), p, scaling, gqa)
        return out.to(dtype).unsqueeze(0), None
    if len(lens) > 1 and len(lens) * max(lens) ** 2 <= PAD_WASTE * sum(n * n for n in lens):
        out = _padded_sdpa(query, key, value, cu, lens, p, scaling, gqa)
        return out.to(dtype).unsqueeze(0), None
    outs = [
        F.scaled_dot_product_attention(
            query[:, :, s:e],
            key[:, :, s:e],
            value[:, :, s:e],
            dropout_p=p,
            is_causal=True,
            scale=scaling,
            enable_gqa=gqa,
        )
        for s, e in itertools.pairwise(cu)
    ]
    return torch.cat(outs, dim=2).transpose(1, 2).to(dtype).contiguous(), None


def _padded_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu: list[int],
    lens: list[int],
    dropout_p: float,
    scaling: float | None,
    gqa: bool,
    branches: torch.Tensor | None = None,
) -> torch.Tensor:
    """All sequences in one SDPA call over a ``[B, heads, max(L), dim]`` gather, with a causal mask
    (or, given ``branches``, a dense tree mask: no key on another suffix than the query's) that
    also hides each sequence's padding keys (padding queries still see their sequence's first key,
    so no row is empty, and are dropped). Returns ``[T, heads, dim]`` in packed order."""
    device = query.device
    width = max(lens)
    pos = torch.arange(width, device=device)
    lens_t = torch.tensor(lens, device=device)
    valid = pos[None, :] < lens_t[:, None]  # [B, W]
    idx = (torch.tensor(cu[:-1], device=device)[:, None] + pos[None, :]).clamp(max=cu[-1] - 1)

    def gather(x: torch.Tensor) -> torch.Tensor:  # [1, h, T, d] -> [B, h, W, d]
        return x[0][:, idx].transpose(0, 1)

    mask = (pos[None, :] <= pos[:, None])[None] & valid[:, None, :]  # [B, W(query), W(key)]
    if branches is not None:
        b = branches[idx]  # [B, W]; prefix keys (branch 0) are seen from every suffix
        mask = mask & ((b[:, None, :] == 0) | (b[:, None, :] == b[:, :, None]))
    out = F.scaled_dot_product_attention(
        gather(query),
        gather(key),
        gather(value),
        attn_mask=mask[:, None],
        dropout_p=dropout_p,
        scale=scaling,
        enable_gqa=gqa,
    )
    return out.transpose(1, 2)[valid]


def register_varlen_sdpa() -> str:
    """Make ``attn_implementation=VARLEN_SDPA`` available to transformers; returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
    return VARLEN_SDPA


def _branch_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu: list[int],
    branches: list[int],
    dropout_p: float,
    scaling: float | None,
    gqa: bool,
) -> torch.Tensor:
    """Attention over tree sequences (a shared prefix, branch 0, then suffixes 1, 2, ...) in one
    SDPA call: a row per prefix (causal over itself) and a row per suffix, whose keys are its
    tree's prefix followed by itself (all of the prefix, causal over the suffix). This costs
    ``P^2 + sum_i S_i (P + S_i)``, not the ``(P + sum_i S_i)^2`` of a dense tree mask. Returns
    ``[T, heads, dim]`` in packed order; every token is the query of exactly one row."""
    rows: list[tuple[list[int], list[int]]] = []  # (query indices, key indices), prefix keys first
    n_prefix: list[int] = []
    for s, e in itertools.pairwise(cu):
        p = s
        while p < e and branches[p] == 0:
            p += 1
        rows.append((list(range(s, p)), list(range(s, p))))
        n_prefix.append(0)
        t = p
        while t < e:
            u = t
            while u < e and branches[u] == branches[t]:
                u += 1
            rows.append((list(range(t, u)), list(range(s, p)) + list(range(t, u))))
            n_prefix.append(p - s)
            t = u
    device = query.device
    wq = max(len(q) for q, _ in rows)
    wk = max(len(k) for _, k in rows)
    q_idx = torch.tensor([q + [q[0]] * (wq - len(q)) for q, _ in rows], device=device)
    k_idx = torch.tensor([k + [k[0]] * (wk - len(k)) for _, k in rows], device=device)
    q_len = torch.tensor([len(q) for q, _ in rows], device=device)
    k_len = torch.tensor([len(k) for _, k in rows], device=device)
    prefix = torch.tensor(n_prefix, device=device)
    qpos, kpos = torch.arange(wq, device=device), torch.arange(wk, device=device)
    # Key j of a row is seen by query i when j is in the prefix or j - prefix <= i (same suffix).
    seen = (kpos[None, None, :] < prefix[:, None, None]) | (
        kpos[None, None, :] - prefix[:, None, None] <= qpos[None, :, None]
    )
    mask = seen & (kpos[None, None, :] < k_len[:, None, None])  # [R, Wq, Wk]; padding queries see key 0
    out = F.scaled_dot_product_attention(
        query[0][:, q_idx].transpose(0, 1),
        key[0][:, k_idx].transpose(0, 1),
        value[0][:, k_idx].transpose(0, 1),
        attn_mask=mask[:, None],
        dropout_p=dropout_p,
        scale=scaling,
        enable_gqa=gqa,
    ).transpose(1, 2)  # [R, Wq, heads, dim]
    real = qpos[None, :] < q_len[:, None]
    result = torch.empty(query.shape[2], *out.shape[2:], dtype=out.dtype, device=device)
    return result.index_put((q_idx[real],), out[real])
