"""A HF model's parameters in two layouts: the runtime one (its modules' parameters) and its
checkpoint's (what ``save_pretrained`` writes and SGLang, vLLM and the hub read).

transformers 5 loads some checkpoints into other tensors than it reads: a mixture-of-experts
model keeps all the experts of a layer in two 3-D parameters (``mlp.experts.gate_up_proj``
``[E, 2I, H]``, ``mlp.experts.down_proj``), while its checkpoint has one tensor per expert and
projection (``mlp.experts.<e>.gate_proj.weight``). transformers' own conversion functions map
between the two; this module applies them to weight updates, which travel in the checkpoint
layout on disk and by broadcast (so that any server reads them) and in the runtime layout in
process (no conversion). For a dense model both layouts are the same and nothing is converted; a
Qwen-VL model's checkpoint names its decoder ``model.*`` and its vision tower ``visual.*`` where
transformers 5 names them ``model.language_model.*`` and ``model.visual.*``.

The receiving side copies a checkpoint tensor into its part of a runtime parameter through the
flat positions it occupies there, found once by converting a tensor of positions: any conversion
that only moves elements (stacking, concatenating, splitting, transposing) is undone this way, and
a broadcast chunk may carry any subset of a parameter's pieces.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from areal_lite.utils.vision import auto_model_class


class CheckpointLayout:
    """The checkpoint layout of the HF causal LMs (or vision-language models) of ``config``'s
    architecture."""

    def __init__(self, config: object) -> None:
        with torch.device("meta"):
            self._model = auto_model_class(config).from_config(config)
        runtime = self._model.state_dict()
        self._runtime_shapes = {n: tuple(t.shape) for n, t in runtime.items()}
        converted = self._revert(runtime)
        self.identity = set(converted) == set(runtime)
        """Whether the two layouts coincide (a dense model)."""
        self._converted = set() if self.identity else {n for n in runtime if set(self._revert({n: runtime[n]})) != {n}}
        self._pieces: dict[str, tuple[str, torch.Tensor]] | None = None

    def _revert(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from transformers.core_model_loading import revert_weight_conversion

        return revert_weight_conversion(self._model, dict(tensors))

    def to_checkpoint(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Runtime-named tensors as checkpoint-named ones, one runtime tensor at a time."""
        for name, t in named:
            if name in self._converted:
                yield from self._revert({name: t}).items()
            else:
                yield name, t

    def locate(self, name: str) -> tuple[str, torch.Tensor | None, tuple[int, ...]]:
        """Where tensor ``name`` (either layout) goes: (runtime parameter name, flat positions in it
        or None for the whole parameter, expected shape). ValueError for an unknown name."""
        shape = self._runtime_shapes.get(name)
        if shape is not None:
            return name, None, shape
        if self._pieces is None:
            self._pieces = {}
            for runtime_name in self._converted:
                numel = int(torch.Size(self._runtime_shapes[runtime_name]).numel())
                positions = torch.arange(numel).view(self._runtime_shapes[runtime_name])
                for piece, where in self._revert({runtime_name: positions}).items():
                    self._pieces[piece] = (runtime_name, where.contiguous())
        found = self._pieces.get(name)
        if found is None:
            raise ValueError(f"unknown parameter {name!r}")
        runtime_name, where = found
        return runtime_name, where.flatten(), tuple(where.shape)


__all__ = ["CheckpointLayout"]
