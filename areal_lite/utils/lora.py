"""LoRA through peft, for both ends of a weight update: the peft config of a `LoRAConfig`, the PEFT
adapter directory, and adapters merged into a copy of the base weights.

Adapter tensors carry the names a PEFT adapter file gives them
(``base_model.model.<module>.lora_A.weight``) wherever they travel: in process, on disk and in a
broadcast. `MergedLoRA` computes ``W + delta`` for each weight an adapter targets with peft's own
LoRA layers (``get_delta_weight``: ``(alpha / r) * B A``, or peft's variants of the scale) on a
weightless copy of the model whose adapted layers hold the base weights, so no LoRA arithmetic is
written here and a merge equals what peft's forward computes. That covers adapters on parameters
(peft's ``target_parameters``, its ``ParamWrapper``): the 3-D expert weights of a transformers 5
mixture-of-experts model (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, one low-rank update per
expert), which ``all-linear`` adapts too (with the router's weight), as peft decides for such models.

peft is imported where it is used: importing it takes seconds, which runs without LoRA skip.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from areal_lite.api.config import LoRAConfig

if TYPE_CHECKING:
    from peft import LoraConfig

PEFT_PREFIX = "base_model.model."
"""What a PEFT adapter file puts before a module's name (the `PeftModel` wrapping the model)."""
ALL_LINEAR = "all-linear"
_BASE_LAYERS = re.compile(r"(\.base_layer)+\.")


def base_name(name: str) -> str:
    """A parameter's name in the HF model from its name inside peft's wrappers (which keep an adapted
    layer's own weights under ``<layer>.base_layer``, nested once per adapted parameter)."""
    return _BASE_LAYERS.sub(".", name)


def peft_config(cfg: LoRAConfig) -> LoraConfig:
    """The peft `LoraConfig` of ``cfg`` for a causal language model."""
    from peft import LoraConfig

    targets: str | list[str] = list(cfg.target_modules)
    if ALL_LINEAR in targets:
        if len(targets) > 1:
            raise ValueError(f"lora.target_modules: {ALL_LINEAR!r} already takes every linear layer, got {targets}")
        targets = ALL_LINEAR  # peft takes the shorthand only as a string
    return LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        target_parameters=list(cfg.target_parameters) or None,
        task_type="CAUSAL_LM",
    )


def config_dict(config: LoraConfig) -> dict[str, object]:
    """``config`` as JSON-safe values, as ``adapter_config.json`` holds them."""
    return json.loads(json.dumps(config.to_dict(), default=sorted))


def lora_config_of(config: Mapping[str, object]) -> LoraConfig:
    """The peft config of an adapter config dict (``adapter_config.json``); ValueError for an
    adapter these helpers cannot merge by adding its delta to the base weights."""
    from peft import LoraConfig, PeftConfig

    try:
        parsed = PeftConfig.from_peft_type(**dict(config))
    except (KeyError, TypeError) as e:
        raise ValueError(f"not a PEFT adapter config: {e}") from e
    if not isinstance(parsed, LoraConfig):
        raise ValueError(f"only LoRA adapters are supported, got peft_type {config.get('peft_type')!r}")  # noqa: TRY004 - a bad value, read from a file
    if parsed.use_dora or parsed.modules_to_save or parsed.bias != "none":
        raise ValueError("only plain LoRA adapters are supported (no DoRA, modules_to_save or bias)")
    return parsed


def read_adapter(path: str) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """The config and tensors (on CPU, under their PEFT names) of a PEFT adapter directory."""
    from peft.utils import load_peft_weights

    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise ValueError(f"{path!r} is not a PEFT adapter directory (no adapter_config.json)")
    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    lora_config_of(config)
    return config, load_peft_weights(path, device="cpu")


def peft_name(name: str) -> str:
    """An adapter tensor's name as a PEFT file spells it (SGLang also sends it without the prefix)."""
    return name if name.startswith(PEFT_PREFIX) else PEFT_PREFIX + name


class MergedLoRA:
    """Weights with a LoRA adapter merged in: ``W + delta(adapter)`` for each weight ``W`` that the
    adapter's config targets.

    ``base`` maps HF weight names (``model.layers.0.self_attn.q_proj.weight``) to the base weights;
    copies of those of the targeted layers are kept.
    """

    def __init__(
        self, model_config: object, adapter_config: Mapping[str, object], base: Mapping[str, torch.Tensor]
    ) -> None:
        from peft import inject_adapter_in_model
        from peft.tuners.lora import LoraLayer, ParamWrapper
        from peft.utils import get_peft_model_state_dict
        from transformers import AutoModelForCausalLM

        config = lora_config_of(adapter_config)
        with torch.device("meta"):
            shadow = AutoModelForCausalLM.from_config(model_config)
        inject_adapter_in_model(config, shadow, low_cpu_mem_usage=True)
        self.layers: dict[str, LoraLayer] = {}
        """HF weight name -> the peft layer that adapts it."""
        self._holders: dict[str, tuple[torch.nn.Module, str]] = {}
        for name, m in shadow.named_modules():
            if isinstance(m, ParamWrapper):  # a parameter, held by the innermost wrapped module
                weight = f"{base_name(name + '.')}{m.parameter_name}"
                self._holders[weight] = (m.get_base_layer(), m.parameter_name)
            elif isinstance(m, LoraLayer):
                weight = f"{name}.weight"
                self._holders[weight] = (m.base_layer, "weight")
            else:
                continue
            self.layers[weight] = m
        if not self.layers:
            raise ValueError(f"the adapter's target_modules {config.target_modules} match no layer of the model")
        for name, (holder, attr) in self._holders.items():
            setattr(holder, attr, torch.nn.Parameter(base[name].detach().clone(), requires_grad=False))
        self.config = dict(adapter_config)
        self.shapes = {peft_name(k): tuple(v.shape) for k, v in get_peft_model_state_dict(shadow).items()}
        """The adapter's tensors (PEFT names) and their shapes."""
        self._shadow = shadow

    @property
    def base(self) -> dict[str, torch.Tensor]:
        """The base weights of the targeted layers."""
        return {name: getattr(holder, attr).data for name, (holder, attr) in self._holders.items()}

    def check(self, tensors: Mapping[str, torch.Tensor], complete: bool) -> None:
        """ValueError unless every tensor is one of the adapter's with its shape (and, when
        ``complete``, every one of them is there)."""
        for name, t in tensors.items():
            shape = self.shapes.get(peft_name(name))
            if shape is None:
                raise ValueError(f"{name!r} is not a tensor of this adapter (e.g. {next(iter(self.shapes))!r})")
            if tuple(t.shape) != shape:
                raise ValueError(f"adapter tensor {name!r} has shape {shape}, got {tuple(t.shape)}")
        missing = set(self.shapes) - {peft_name(n) for n in tensors}
        if complete and missing:
            raise ValueError(f"{len(missing)} adapter tensors are missing, e.g. {min(missing)!r}")

    def merged(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every targeted weight with the adapter ``tensors`` (all of them) merged in, as new
        tensors in the base weights' dtype (the sum is taken in fp32)."""
        from peft import set_peft_model_state_dict

        self.check(tensors, complete=True)
        set_peft_model_state_dict(self._shadow, {peft_name(k): v for k, v in tensors.items()}, low_cpu_mem_usage=True)
        out = {}
        base = self.base
        with torch.no_grad():
            for name, layer in self.layers.items():
                w = base[name]
                out[name] = (w.float() + layer.get_delta_weight("default").float()).to(w.dtype)
        return out

    def zeros(self) -> dict[str, torch.Tensor]:
        """An adapter of all zeros (its merge is the base model)."""
        return {name: torch.zeros(shape) for name, shape in self.shapes.items()}


__all__ = [
    "ALL_LINEAR",
    "PEFT_PREFIX",
    "MergedLoRA",
    "base_name",
    "config_dict",
    "lora_config_of",
    "peft_config",
    "peft_name",
    "read_adapter",
]
