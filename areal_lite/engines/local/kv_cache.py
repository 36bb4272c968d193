"""The embedded engine's slot-based KV cache, and attention over it.

Row ``i`` of the cache belongs to the ``i``-th running sequence (the model runner refills finished
rows from the tail, `move`). Per layer, keys are ``[rows, kv heads, capacity / block, head_dim,
block]``: in blocks of ``block`` positions, transposed within a block, as the CPU decode-attention
kernel (`areal_lite.cpu.decode_attention`) reads them; with ``block`` 1 (CUDA, or no kernel) that
is ``[rows, kv heads, capacity, head_dim]``. Values are ``[rows, kv heads, capacity, head_dim]``.
The capacity grows by doubling, up to the context length (`grow`).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

PackedPrefill = tuple[torch.Tensor, int, torch.Tensor, torch.Tensor, torch.Tensor]
"""What `KVCache.packed_prefill` builds once per pass: the prefill sequences' boundaries ``cu``
(int32), the longest one, and for every cache entry they fill its token, row and position."""


class KVCache:
    """Keys and values of every running row, per layer, and the attention that reads them."""

    def __init__(
        self,
        layers: int,
        max_rows: int,
        kv_heads: int,
        head_dim: int,
        block: int,
        context_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layers, self.max_rows, self.kv_heads, self.head_dim = layers, max_rows, kv_heads, head_dim
        self.block, self.context_len, self.dtype, self.device = block, context_len, dtype, device
        self.cap = 0
        """Positions each row can hold now (whole blocks)."""
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def grow(self, needed: int) -> bool:
        """Make room for ``needed`` positions (doubling, capped at the context length), keeping
        what is cached; True when the tensors were replaced."""
        if needed <= self.cap:
            return False
        cap = max(needed, min(self.context_len, max(2 * self.cap, 64)))
        cap = -(-cap // self.block) * self.block  # whole blocks (past the context: never attended)
        k_shape = (self.max_rows, self.kv_heads, cap // self.block, self.head_dim, self.block)
        v_shape = (self.max_rows, self.kv_heads, cap, self.head_dim)
        new_k = [torch.zeros(k_shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        new_v = [torch.zeros(v_shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        for old, new in zip(self.k, new_k):
            new[:, :, : self.cap // self.block].copy_(old)
        for old, new in zip(self.v, new_v):
            new[:, :, : self.cap].copy_(old)
        self.k, self.v, self.cap = new_k, new_v, cap
        return True

    def decode_mask(self, pos: torch.Tensor, n: int) -> torch.Tensor:
        """The additive mask [rows x KV heads, 1, n] of decode rows at ``pos`` over their first
        ``n`` cached positions: one row per (row, KV head), shared by that head's queries."""
        visible = torch.arange(n, device=self.device)[None, :] <= pos[:, None]
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device).masked_fill_(~visible, float("-inf"))
        return mask[:, None, None].expand(pos.shape[0], self.kv_heads, 1, n).reshape(-1, 1, n)

    def attend_decode(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rows: torch.Tensor,
        pos: torch.Tensor,
        mask: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        """Decode attention without the compiled kernel: store ``k``, ``v`` [R, kv heads, D] of
        cache rows ``rows`` (0..R-1) at ``pos``, then attend each row's one query (``q`` [R,
        heads, D]) to its first ``mask.shape[-1]`` cached positions (``mask``: `decode_mask`).

        The query heads of a KV head go in as that head's queries, so grouped-query attention
        reads each key once. Two batched matmuls over (row, KV head) read the cache in place; on
        CPU they ran faster than SDPA's kernel, which is built for long query blocks."""
        kc, vc = self.k[layer], self.v[layer]
        r, n, nkv, hd, blk = q.shape[0], mask.shape[-1], self.kv_heads, self.head_dim, self.block
        kc[rows, :, pos // blk, :, pos % blk] = k
        vc[rows, :, pos] = v
        nb = -(-n // blk)
        keys = kc[:r, :, :nb].transpose(3, 4).reshape(r * nkv, nb * blk, hd)[:, :n]
        values = vc[:r, :, :n].reshape(r * nkv, n, hd)
        scores = torch.baddbmm(mask, q.reshape(r * nkv, q.shape[1] // nkv, hd), keys.transpose(1, 2), alpha=scaling)
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(values.dtype)  # fp32 softmax in bf16 too
        return torch.bmm(probs, values).view(r, q.shape[1], hd)

    def fill(self, layer: int, rows: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one prefilled sequence's keys and values (``[L, kv heads, D]``) at positions
        ``0..L-1`` of each of ``rows`` (the rows of a group share its prompt)."""
        n, nkv, hd, blk = k.shape[0], self.kv_heads, self.head_dim, self.block
        ku, vu = k.transpose(0, 1), v.transpose(0, 1)  # [kv heads, L, D]
        nb = -(-n // blk)
        # Padded to whole blocks: the positions past L are never attended.
        kb = F.pad(ku, (0, 0, 0, nb * blk - n)).view(nkv, nb, blk, hd).transpose(2, 3)
        for row in rows:
            self.k[layer][row, :, :nb] = kb
            self.v[layer][row, :, :n] = vu

    def packed_prefill(self, offsets: list[int], rows_of: list[list[int]]) -> PackedPrefill:
        """`PackedPrefill` of a pass's prefill sequences, packed at ``offsets`` (counted from the
        first decode token) and cached in ``rows_of`` each, built once for all layers."""
        first = offsets[0]
        cu = torch.tensor([o - first for o in offsets], dtype=torch.int32, device=self.device)
        src, row, pos = [], [], []
        for u, (a, e) in enumerate(itertools.pairwise(offsets)):
            for r in rows_of[u]:
                src.extend(range(a - first, e - first))
                row.extend([r] * (e - a))
                pos.extend(range(e - a))
        index = torch.tensor([src, row, pos], dtype=torch.long, device=self.device)
        longest = max(e - a for a, e in itertools.pairwise(offsets))
        return cu, longest, index[0], index[1], index[2]

    def scatter(self, layer: int, k: torch.Tensor, v: torch.Tensor, packed: PackedPrefill) -> None:
        """Store every prefill token's key and value (``[T, kv heads, D]``) in every row that
        shares its sequence, one scatter each (`packed_prefill`)."""
        _, _, src, row, pos = packed
        blk = self.block
        self.k[layer][row, :, pos // blk, :, pos % blk] = k[src]
        self.v[layer][row, :, pos] = v[src]

    def move(self, dst: torch.Tensor, src: torch.Tensor, width: int) -> None:
        """Copy rows ``src`` into rows ``dst``, their first ``width`` positions."""
        blocks = -(-width // self.block)
        for cache in self.k:
            cache[dst, :, :blocks] = cache[src, :, :blocks]
        for cache in self.v:
            cache[dst, :, :width] = cache[src, :, :width]
