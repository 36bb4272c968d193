"""`MultiLoRAEngine`: one frozen base model carrying several named LoRA adapters, each trained on
its own, so that several training runs (tenants of a service) share the base weights.

The base is an `FSDPEngine`'s model, loaded and sharded once without an optimizer. Each adapter is
added by name through peft (`PeftModel.add_adapter`) and has its own AdamW, its own gradients and
its own step count. `use(name)` makes an adapter the one that `forward`, `forward_backward` and
`optim_step` act on: peft routes the layers through it alone and only its parameters require
gradients, so a backward pass accumulates into that adapter's gradients and leaves every other
adapter's untouched (their accumulated gradients wait for their own `optim_step`). Clipping and the
optimizer step see the active adapter's parameters only.

Deliberate limit: adapters are added after the base was sharded, so FSDP does not manage them
(they are plain tensors, neither sharded nor reduced over ranks). The engine therefore runs on one
process, which `initialize` checks; the base itself is FSDP's as everywhere else.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from areal_lite.api.config import LoRAConfig
from areal_lite.api.io import FinetuneSpec
from areal_lite.engines.train.fsdp import FSDPEngine, _fused_adam_supported
from areal_lite.utils.lora import PEFT_PREFIX, config_dict, peft_config

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "adapter_state.json"


@dataclass
class _Adapter:
    lora: LoRAConfig
    params: dict[str, nn.Parameter]
    """Its parameters by name in the HF model (``...q_proj.lora_A.<adapter>.weight``), sorted."""
    optimizer: torch.optim.AdamW
    steps: int = 0
    """Optimizer steps taken (a skipped step does not count)."""
    peft_names: dict[str, str] = field(default_factory=dict)
    """Each parameter's name in a PEFT adapter file (no adapter name in it)."""


class MultiLoRAEngine(FSDPEngine):
    """See the module docstring. ``config.lora`` must stay disabled (adapters are added by name)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._adapters: dict[str, _Adapter] = {}
        self._active: str | None = None
        self._wrapper: nn.Module | None = None
        """peft's `PeftModel` around the HF model, once the first adapter is added."""

    def initialize(self, ft_spec: FinetuneSpec | None = None) -> None:
        if self.config.lora.enabled:
            raise ValueError("MultiLoRAEngine adds its adapters by name (add_adapter): leave lora.rank at 0")
        if self.config.is_critic:
            raise ValueError("MultiLoRAEngine trains policies' adapters, not a critic")
        super().initialize(None)  # the base stays frozen: no optimizer of its own
        if dist.get_world_size() != 1:
            raise RuntimeError(
                "MultiLoRAEngine runs on one process: adapters added after sharding are not FSDP's to reduce"
            )

    # ---------------------------------------------------------------- adapters

    @property
    def adapters(self) -> list[str]:
        return list(self._adapters)

    @property
    def active(self) -> str | None:
        return self._active

    def add_adapter(self, name: str, lora: LoRAConfig, seed: int | None = None) -> None:
        """A new adapter ``name`` of ``lora``'s shape (B = 0: it starts as the base model), its A
        drawn from ``seed`` (the engine's seed when None), with a fresh AdamW."""
        from peft import get_peft_model

        if name in self._adapters:
            raise ValueError(f"adapter {name!r} exists already")
        if not lora.enabled:
            raise ValueError("an adapter needs lora.rank > 0")
        if "." in name:
            raise ValueError(f"adapter names cannot contain '.', got {name!r}")
        hf = self._module().hf
        cfg = peft_config(lora)
        with torch.random.fork_rng():
            torch.manual_seed(self.config.seed if seed is None else seed)
            if self._wrapper is None:
                self._wrapper = get_peft_model(hf, cfg, adapter_name=name)
            else:
                self._wrapper.add_adapter(name, cfg)
        own = (f".lora_A.{name}.", f".lora_B.{name}.")
        params = {n: p for n, p in sorted(hf.named_parameters()) if any(tag in n for tag in own)}
        if not params:
            raise ValueError(f"LoRA target_modules {lora.target_modules} match no layer of the model")
        opt = self.config.optimizer
        optimizer = torch.optim.AdamW(
            [{"params": list(params.values()), "weight_decay": 0.0, "wd_mult": 1.0}],
            lr=opt.lr,
            betas=(opt.beta1, opt.beta2),
            eps=opt.eps,
            fused=_fused_adam_supported(list(params.values())),
        )
        peft_names = {n: PEFT_PREFIX + n.replace(f".{name}.", ".") for n in params}
        self._adapters[name] = _Adapter(lora, params, optimizer, peft_names=peft_names)
        self.use(self._active if self._active is not None else name)

    def remove_adapter(self, name: str) -> None:
        """Forget adapter ``name``: its parameters, gradients and optimizer state."""
        self._adapter(name)
        assert self._wrapper is not None
        del self._adapters[name]
        if len(self._adapters) == 0:
            # peft keeps at least one adapter; a fresh wrapper is built for the next one.
            self._wrapper.delete_adapter(name) if len(self._wrapper.peft_config) > 1 else self._strip_adapters()
            self._active = None
            self.optimizer = None
            return
        self._wrapper.delete_adapter(name)
        if self._active == name:
            self._active = None
        self.use(self._active or next(iter(self._adapters)))

    def _strip_adapters(self) -> None:
        """Take every LoRA layer out of the model, putting each base layer back (peft's unload)."""
        assert self._wrapper is not None
        self._wrapper.unload()
        self._wrapper = None

    def use(self, name: str) -> None:
        """Make ``name`` the adapter that forward passes run through and that training updates."""
        adapter = self._adapter(name)
        assert self._wrapper is not None
        self._wrapper.set_adapter(name)
        for other, a in self._adapters.items():
            for p in a.params.values():
                p.requires_grad_(other == name)
        self._active = name
        self.optimizer = adapter.optimizer

    def _adapter(self, name: str) -> _Adapter:
        if name not in self._adapters:
            raise KeyError(f"no adapter {name!r} (adapters: {', '.join(self._adapters) or 'none'})")
        return self._adapters[name]

    def adapter_config(self, name: str) -> dict[str, object]:
        """Adapter ``name``'s PEFT config, as ``adapter_config.json`` holds it."""
        self._adapter(name)
        assert self._wrapper is not None
        return config_dict(self._wrapper.peft_config[name])

    def adapter_tensors(self, name: str) -> dict[str, torch.Tensor]:
        """Copies of adapter ``name``'s tensors under their PEFT file names (fp32, CPU)."""
        adapter = self._adapter(name)
        return {
            adapter.peft_names[n]: p.detach().to("cpu", torch.float32, copy=True) for n, p in adapter.params.items()
        }

    def set_adapter_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        """Overwrite adapter ``name``'s weights with ``tensors`` (PEFT names, all of them)."""
        adapter = self._adapter(name)
        by_peft = {adapter.peft_names[n]: p for n, p in adapter.params.items()}
        if set(by_peft) != set(tensors):
            missing, extra = set(by_peft) - set(tensors), set(tensors) - set(by_peft)
            raise ValueError(
                f"adapter tensors do not match {name!r}: missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]}"
            )
        with torch.no_grad():
            for key, p in by_peft.items():
                if tuple(tensors[key].shape) != tuple(p.shape):
                    raise ValueError(f"{key}: shape {tuple(tensors[key].shape)}, the adapter has {tuple(p.shape)}")
                p.copy_(tensors[key])

    def adapter_steps(self, name: str) -> int:
        return self._adapter(name).steps

    # ---------------------------------------------------------------- training the active adapter

    def _require_active(self, method: str) -> str:
        if self._active is None:
            raise RuntimeError(f"{method} needs an adapter: add_adapter, then use(name)")
        return self._active

    def forward_backward(self, *args: object, **kwargs: object) -> dict[str, float]:
        self._require_active("forward_backward")
        return super().forward_backward(*args, **kwargs)  # type: ignore[arg-type]

    def optim_step(self, *args: object, **kwargs: object) -> dict[str, float]:
        name = self._require_active("optim_step")
        stats = super().optim_step(*args, **kwargs)  # type: ignore[arg-type]
        self._adapters[name].steps += int(stats["update_successful"])
        return stats

    def _clip_gradients(self, max_norm: float) -> float:
        params = [p for p in self._adapter(self._require_active("optim_step")).params.values() if p.grad is not None]
        if not params:
            return 0.0
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf")))

    def _hf_tensors(self, cast: bool = True):  # type: ignore[no-untyped-def]
        """The base model's tensors (every adapter left out)."""
        for name, t in super()._hf_tensors(cast):
            if ".lora_" not in name:
                yield name, t

    # ---------------------------------------------------------------- an adapter's training state

    def save_adapter(self, name: str, path: str, with_optimizer: bool = True) -> None:
        """A PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``) of
        adapter ``name``, and with ``with_optimizer`` its AdamW state and step count beside it."""
        adapter = self._adapter(name)
        os.makedirs(path, exist_ok=True)
        save_file(self.adapter_tensors(name), os.path.join(path, ADAPTER_FILE), metadata={"format": "pt"})
        with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
            json.dump(self.adapter_config(name), f, indent=2)
        if with_optimizer:
            torch.save(adapter.optimizer.state_dict(), os.path.join(path, OPTIMIZER_FILE))
            with open(os.path.join(path, STATE_FILE), "w") as f:
                json.dump({"steps": adapter.steps}, f)

    def load_adapter(self, name: str, path: str, with_optimizer: bool) -> None:
        """Load what `save_adapter` wrote into adapter ``name`` (of the same shape): its weights,
        and with ``with_optimizer`` its AdamW state and step count (else a fresh AdamW)."""
        adapter = self._adapter(name)
        self.set_adapter_tensors(name, load_file(os.path.join(path, ADAPTER_FILE)))
        adapter.optimizer.state.clear()
        adapter.steps = 0
        if not with_optimizer:
            return
        opt_file = os.path.join(path, OPTIMIZER_FILE)
        if not os.path.exists(opt_file):
            raise FileNotFoundError(f"{path} holds no optimizer state ({OPTIMIZER_FILE}): it was saved without one")
        adapter.optimizer.load_state_dict(torch.load(opt_file, weights_only=True))
        with open(os.path.join(path, STATE_FILE)) as f:
            adapter.steps = int(json.load(f)["steps"])


__all__ = ["MultiLoRAEngine"]
