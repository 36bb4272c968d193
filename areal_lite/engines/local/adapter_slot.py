"""The LoRA adapter the embedded engine serves, merged into its weights.

The engine holds at most one adapter. Loading one computes, for every weight it targets,
``W_base + delta`` from a copy of the base weights kept for as long as an adapter is loaded
(`areal_lite.utils.lora.MergedLoRA`); the scheduler copies the result into the model, as it does
any weight update, so generation runs at the speed of the base model. Unloading copies the base
weights back. Why merged rather than applied on the fly at every decode step: in RL every request
uses the one adapter being trained, and a merge costs less than the extra low-rank matmuls of a
few decode steps (benchmarks/lora.py measures both).

Adapter tensors are named as in a PEFT adapter file. In a broadcast, they are announced as
``<adapter name>:<tensor name>`` (SGLang's spelling) and may arrive in several chunks, each
updating part of the adapter.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from areal_lite.utils.lora import MergedLoRA, peft_name

SEPARATOR = ":"
"""Between an adapter's name and a tensor's name in a broadcast announcement."""


@dataclass
class _Loaded:
    name: str
    source: str
    """Where it came from (a directory, or how it was sent), as SGLang reports loaded adapters."""
    merge: MergedLoRA
    tensors: dict[str, torch.Tensor]


def split_adapter_names(names: list[str]) -> tuple[str | None, list[str]]:
    """(adapter name, tensor names) of a broadcast announcement: (None, names) for base weights.
    ValueError when the names mix adapters, or adapter and base weights."""
    adapters = {n.split(SEPARATOR, 1)[0] for n in names if SEPARATOR in n}
    if not adapters:
        return None, names
    if len(adapters) > 1 or any(SEPARATOR not in n for n in names):
        raise ValueError(f"one update holds the tensors of one adapter, or base weights only; got {sorted(adapters)}")
    return adapters.pop(), [n.split(SEPARATOR, 1)[1] for n in names]


class AdapterSlot:
    """The adapter merged into a model's weights, if any. Not thread-safe: the scheduler thread
    uses it. Each method returns the weights (HF names) to copy into the model."""

    def __init__(self) -> None:
        self._loaded: _Loaded | None = None

    @property
    def name(self) -> str | None:
        return self._loaded.name if self._loaded else None

    @property
    def loaded(self) -> dict[str, str]:
        """Name -> source of the loaded adapters (none or one), as SGLang lists them."""
        return {self._loaded.name: self._loaded.source} if self._loaded else {}

    def targets(self, names: list[str]) -> list[str]:
        """Those of ``names`` (HF weight names) that the loaded adapter's merge overwrites."""
        return [n for n in names if self._loaded is not None and n in self._loaded.merge.layers]

    def load(
        self,
        model: torch.nn.Module,
        name: str,
        config: Mapping[str, object],
        tensors: Mapping[str, torch.Tensor],
        source: str,
    ) -> dict[str, torch.Tensor]:
        """Merge adapter ``name`` (all of its tensors) into ``model``'s weights, in place of the
        loaded one of that name."""
        return self._install(name, source, self._merge_for(model, name, config), tensors)

    def register(self, model: torch.nn.Module, name: str, config: Mapping[str, object]) -> dict[str, torch.Tensor]:
        """Load adapter ``name`` with all-zero tensors (its merge is the base model): its tensors
        arrive later, by broadcast."""
        merge = self._merge_for(model, name, config)
        return self._install(name, "registered", merge, merge.zeros())

    def update(self, name: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Replace some tensors of the loaded adapter ``name`` (a chunk of a broadcast)."""
        cur = self._loaded
        if cur is None or cur.name != name:
            raise ValueError(f"adapter {name!r} is not loaded: register or load it before sending its tensors")
        cur.merge.check(tensors, complete=False)
        return self._install(name, cur.source, cur.merge, {**cur.tensors, **tensors})

    def _merge_for(self, model: torch.nn.Module, name: str, config: Mapping[str, object]) -> MergedLoRA:
        cur = self._loaded
        if cur is not None and cur.name != name:
            raise ValueError(
                f"adapter {cur.name!r} is loaded and this server holds one adapter at a time (merged into its "
                f"weights): unload it first"
            )
        if cur is not None and cur.merge.config == dict(config):
            return cur.merge
        # The model's weights are the base ones except where the loaded adapter is merged in.
        base = {n: p.data for n, p in model.named_parameters()}
        return MergedLoRA(model.config, config, {**base, **(cur.merge.base if cur is not None else {})})

    def _install(
        self, name: str, source: str, merge: MergedLoRA, tensors: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        full = {peft_name(k): v for k, v in tensors.items()}
        merged = merge.merged(full)
        previous = self._loaded.merge.base if self._loaded is not None else {}
        self._loaded = _Loaded(name, source, merge, full)
        # Weights the previous adapter changed and this one does not go back to the base ones.
        return {**{n: w for n, w in previous.items() if n not in merged}, **merged}

    def unload(self, name: str) -> dict[str, torch.Tensor]:
        """Forget adapter ``name``; the base weights to copy back."""
        if self._loaded is None or self._loaded.name != name:
            raise ValueError(f"adapter {name!r} is not loaded (loaded: {sorted(self.loaded) or 'none'})")
        base = self._loaded.merge.base
        self._loaded = None
        return base

    def check_tensors(self, name: str, tensors: Mapping[str, tuple[int, ...]]) -> None:
        """ValueError unless the loaded adapter is ``name`` and has these tensors with these shapes."""
        if self._loaded is None or self._loaded.name != name:
            raise ValueError(f"adapter {name!r} is not loaded: register or load it before sending its tensors")
        self._loaded.merge.check({k: torch.empty(shape, device="meta") for k, shape in tensors.items()}, complete=False)
