"""The model runner's linear layers on CPU: ``F.linear`` with each weight laid out once for oneDNN
(`PackedLinears`), where ``F.linear`` lays it out again at every call (docs/performance.md,
"Linear layers through oneDNN with weights laid out once")."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class PackedLinears:
    """``F.linear`` with each weight reordered once into oneDNN's blocked layout (CPU, fp32 or bf16).

    Laid out once, a decode step's matmuls run faster than through ``F.linear``, which lays the
    weight out again at every call; the LM head's gains the most. A reordered copy goes stale
    when its weight changes, so each is keyed by the weight tensor and its in-place version
    counters (which every copy into the tensor bumps; for a fused weight, also those of the
    parameters that are views of it, whose counters are their own): a weight changed in any way
    is reordered again before its next use. Costs one more copy of the weights in memory.
    Elsewhere (CUDA, float16, a torch without oneDNN) it is plain ``F.linear``."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.enabled = (
            device.type == "cpu"
            and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        )
        self._packed: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        views: tuple[torch.Tensor, ...] = (),
    ) -> torch.Tensor:
        """``F.linear(x, weight, bias)``; ``views``: parameters whose data are parts of ``weight``."""
        if not self.enabled:
            return F.linear(x, weight, bias)
        version = weight._version + sum(v._version for v in views)
        entry = self._packed.get(id(weight))
        if entry is None or entry[0] is not weight or entry[1] != version:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH)
            entry = self._packed[id(weight)] = (weight, version, packed)
        return torch.ops.mkldnn._linear_pointwise(x, entry[2], bias, "none", [], "")


PACK_BATCH = 16
"""The batch size oneDNN lays a weight out for (any batch works; decode batches are 16-64)."""
