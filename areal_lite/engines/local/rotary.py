"""The model runner's rotary embedding: the model's cos/sin tables for every position, and the rows
each token of a pass is rotated by, for 1-D positions and for Qwen-VL's multimodal ones.

A vision-language model (Qwen2-VL, Qwen2.5-VL) gives each token three positions (time, height,
width; equal on text tokens) and splits the head's rotary frequencies into three sections, each
rotated by one of them ("mrope"). The tables are those of 1-D positions (the three parts equal), so
a token's rotation takes, for each frequency, the table row of the position part its section
uses. Which part each frequency uses is read from the model's own rotary module
(``recomposition_frequencies``), not re-derived. Text after a prompt's images continues from the
images' largest position plus one, so a decode step only needs 1-D positions (cache length plus
the row's offset, `areal_lite.engines.local.images.ImageInputs.delta`), and the 3-D rows are
needed only where a prefill holds image tokens.
"""

from __future__ import annotations

import torch


class RotaryTables:
    """The rotary cos/sin tables [context_len, head_dim] of a HF decoder's ``rotary_emb``, and,
    for a multimodal rotary, which position part (0 time, 1 height, 2 width) each of the head's
    dimensions is rotated by (``axes``, None for a 1-D rotary)."""

    def __init__(self, rotary_emb: torch.nn.Module, context_len: int, device: torch.device, dtype: torch.dtype) -> None:
        positions = torch.arange(context_len, device=device)[None]
        dummy = torch.zeros(1, device=device, dtype=dtype)
        cos, sin = rotary_emb(dummy, positions)
        self.cos, self.sin = cos[0], sin[0]
        self.axes: torch.Tensor | None = None
        recompose = getattr(rotary_emb, "recomposition_frequencies", None)
        if recompose is not None:
            half = self.cos.shape[-1] // 2
            parts = torch.arange(3, dtype=torch.float32).view(3, 1, 1, 1).expand(3, 1, 1, half)
            self.axes = recompose(parts)[0, 0].long().to(device)

    @property
    def positions(self) -> int:
        """Positions the tables hold."""
        return self.cos.shape[0]

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(cos, sin, index)`` such that token ``n`` is rotated by rows ``index[n]`` of ``cos``
        and ``sin``: the tables and ``positions`` themselves for 1-D positions [N]; for
        multimodal positions [N, 3], each token's own row [N, head_dim] (its dimensions taken
        from the table rows of the position part they use) and ``arange(N)``."""
        if positions.dim() == 1:
            return self.cos, self.sin, positions
        assert self.axes is not None, "multimodal positions need a multimodal rotary"
        index = positions[:, self.axes]  # [N, head_dim]: the position each dimension is rotated by
        n = torch.arange(positions.shape[0], device=positions.device)
        return self.cos.gather(0, index), self.sin.gather(0, index), n


__all__ = ["RotaryTables"]
