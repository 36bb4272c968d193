"""The experts a mixture-of-experts model's tokens went to, recorded beside the model runner's KV
cache for routing replay.

A forward hook on each layer's router records the experts of the pass's tokens; after the pass
they are written per row and cached position (for each position one row of ``top_k`` expert ids
per layer, -1 on layers without experts), where the KV cache holds that position's keys and values.
A finished request takes its rows' routes with it, and the train engine forces them. A position's
routes are those of the pass that computed its cached keys and values: recomputing a request's
cache after a weight update records them again.
"""

from __future__ import annotations

import torch

from areal_lite.utils.moe import NO_EXPERT, layer_routers


class ExpertRoutes:
    """Per cache row and position, the experts each decoder layer sent that token to.

    Args:
        layers: the model's decoder layers (hooks go on their routers).
        shape: (layers, top_k), as `areal_lite.utils.moe.routing_shape` gives it.
        max_rows: rows of the cache.
        device: where the cache lives.
    """

    def __init__(self, layers: list[torch.nn.Module], shape: tuple[int, int], max_rows: int, device: torch.device):
        self.shape, self.max_rows, self.device = shape, max_rows, device
        self.table: torch.Tensor | None = None
        """[max_rows, cache capacity, layers, top_k] int32."""
        self._captured: dict[int, torch.Tensor] = {}
        """Expert ids [tokens, top_k] by layer, from the routers' hooks during one forward pass."""
        for i, router in enumerate(layer_routers(layers)):
            if router is not None:
                router.register_forward_hook(lambda _m, _inp, out, i=i: self._captured.__setitem__(i, out[2]))

    def grow(self, old: int, cap: int) -> None:
        """The cache grew from ``old`` to ``cap`` positions a row: so does the table."""
        table = torch.full((self.max_rows, cap, *self.shape), NO_EXPERT, dtype=torch.int32, device=self.device)
        if self.table is not None:
            table[:, :old] = self.table
        self.table = table

    def start_pass(self) -> None:
        """Forget what the previous pass's hooks captured."""
        self._captured.clear()

    def record(
        self,
        n: int,
        decode_rows: torch.Tensor,
        decode_pos: torch.Tensor,
        spans: list[tuple[int, int]],
        rows_of: list[list[int]],
    ) -> None:
        """Write the last pass's routes of its ``n`` tokens: the first ``len(decode_rows)`` at
        those rows' positions ``decode_pos``, then the tokens ``a:e`` of each prefill span into
        positions ``0..e-a`` of each of its rows ``rows_of``."""
        assert self.table is not None
        routes = torch.full((n, *self.shape), NO_EXPERT, dtype=torch.int32, device=self.device)
        for i, ids in self._captured.items():
            routes[:, i] = ids.view(n, -1)
        d = decode_rows.shape[0]
        if d:
            self.table[decode_rows, decode_pos] = routes[:d]
        for rows, (a, e) in zip(rows_of, spans):
            self.table[rows, : e - a] = routes[a:e]

    def of(self, row: int, length: int) -> torch.Tensor:
        """The routes [length, layers, top_k] (int32, CPU) of cache row ``row``."""
        assert self.table is not None
        return self.table[row, :length].to("cpu", copy=True)  # the row is refilled later

    def move(self, dst: torch.Tensor, src: torch.Tensor, width: int) -> None:
        """Rows ``src`` move to rows ``dst`` (their first ``width`` positions)."""
        assert self.table is not None
        self.table[dst, :width] = self.table[src, :width]


__all__ = ["ExpertRoutes"]
