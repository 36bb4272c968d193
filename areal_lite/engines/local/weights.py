"""Weight loads into the embedded engine's model: from tensors (also views of another process's
memory, an ipc update's), from a model directory on disk, received by broadcast in a weight-update
group, and LoRA adapters.

A `WeightLoader` checks every tensor of a load before it copies any, and copies them in the
scheduler thread between two steps (``between_steps``); the scheduler then sets the version new
tokens are tagged with and recomputes the running requests' caches under the new weights
(``loaded``). Files are read, and broadcasts received, off the scheduler thread.

A LoRA adapter is one more kind of weight load: merged into the weights (`AdapterSlot`), then
copied like any other update.

Weights arrive named as the model's parameters or as its checkpoint names them (what
``save_pretrained`` writes and trainers send by disk and broadcast); they differ for
mixture-of-experts models, whose experts are stacked at runtime (`areal_lite.utils.hf_layout`).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future

import torch

from areal_lite.api.io import WeightUpdateMeta
from areal_lite.engines.local.adapter_slot import AdapterSlot, split_adapter_names
from areal_lite.engines.local.futures import in_thread
from areal_lite.engines.local.model_loading import dtype_of
from areal_lite.utils.distributed import CustomGroup, init_custom_process_group
from areal_lite.utils.hf_layout import CheckpointLayout
from areal_lite.utils.lora import read_adapter


class WeightLoader:
    """The scheduler's weight loads. Its methods may be called from any thread; the copies run in
    the scheduler thread (``between_steps`` runs a function there and returns its future), which
    ``loaded(version)`` afterwards."""

    def __init__(
        self,
        between_steps: Callable[[Callable[[], object]], Future],
        loaded: Callable[[int | None], None],
    ) -> None:
        self._between_steps = between_steps
        self._loaded = loaded
        self.model: torch.nn.Module | None = None
        self.device: torch.device | None = None
        """The device the model runs on (where an nccl group moves tensors)."""
        self.adapter = AdapterSlot()
        """The LoRA adapter merged into the weights, if any (read it from the scheduler thread)."""
        self._group: CustomGroup | None = None
        self._group_backend = "gloo"
        self._layout: CheckpointLayout | None = None
        """The model's checkpoint layout, built when a tensor first arrives under a checkpoint name."""

    def attach(self, model: torch.nn.Module, device: torch.device) -> None:
        """Load into ``model`` (on ``device``) from now on."""
        self.model, self.device = model, device

    def detach(self) -> None:
        """Forget the model and the weight-update group (the scheduler stopped)."""
        self._group = None
        self.model = None
        self.device = None

    def load_tensors(self, named: dict[str, torch.Tensor], version: int | None = None) -> Future[None]:
        """Copy tensors into the model by HF name between two steps (all checked before any is
        copied), recompute the running requests' caches under the new weights, and set the
        version (unless None). The future completes once loaded."""
        return self._between_steps(lambda: self._load_tensors(named.items(), version))

    def load_shared_tensors(self, named: list[tuple[str, torch.Tensor]], version: int | None = None) -> Future[None]:
        """`load_tensors` for views of another process's memory (an ipc update's bucket): the
        future completes only once the copies are done on the device too, since the sender frees
        that memory as soon as it is told."""

        def run() -> None:
            self._load_tensors(named, version)
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        return self._between_steps(run)

    def _load_tensors(self, named: Iterable[tuple[str, torch.Tensor]], version: int | None) -> None:
        pairs = list(named)
        assert self.model is not None
        params = self.model.state_dict()
        merged_into = self.adapter.targets([self._locate(params, name)[0] for name, _ in pairs])
        if merged_into:
            raise ValueError(
                f"adapter {self.adapter.name!r} is merged into {merged_into[0]!r}: unload it before loading base weights"
            )
        self._copy_weights(pairs, version)

    def _locate(
        self, params: Mapping[str, torch.Tensor], name: str
    ) -> tuple[str, torch.Tensor | None, tuple[int, ...]]:
        """(parameter, flat positions in it or None for all of it, shape) of a tensor named in
        either layout; ValueError for an unknown name."""
        if name in params:
            return name, None, tuple(params[name].shape)
        if self._layout is None:
            assert self.model is not None
            self._layout = CheckpointLayout(self.model.config)
        return self._layout.locate(name)

    def _copy_weights(self, pairs: list[tuple[str, torch.Tensor]], version: int | None) -> None:
        """Copy the tensors into the model (all checked first), then tell the scheduler
        (``loaded``): it recomputes the running requests' caches (unless
        ``keep_cache_on_update``) and sets the version (unless None)."""
        assert self.model is not None
        params = self.model.state_dict()
        targets = []
        for name, t in pairs:
            param, where, shape = self._locate(params, name)
            if tuple(t.shape) != shape:
                raise ValueError(f"parameter {name!r} has shape {shape}, got {tuple(t.shape)}")
            targets.append((params[param], where, t))
        with torch.no_grad():
            for param, where, t in targets:
                if where is None:
                    param.copy_(t)
                else:
                    param.view(-1)[where] = t.flatten().to(param.dtype)
        self._loaded(version)

    def load_weights_from_disk(self, path: str, version: int | None = None) -> Future:
        """Load every ``*.safetensors`` file of a HF model directory (reading off the scheduler)."""
        from safetensors.torch import load_file

        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            fut: Future = Future()
            fut.set_exception(ValueError(f"no *.safetensors files in {path!r}"))
            return fut
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update(load_file(f))
        return self.load_tensors(tensors, version)

    def load_adapter(
        self, name: str, config: Mapping[str, object], tensors: Mapping[str, torch.Tensor], version: int | None = None,
        source: str = "tensors",
    ) -> Future[None]:  # fmt: skip
        """Merge LoRA adapter ``name`` (its PEFT config and every tensor, PEFT names) into the
        weights between two steps, replacing the loaded adapter of that name (another name is a
        ValueError), as `load_tensors` does with weights."""
        return self._adapter_op(lambda model: self.adapter.load(model, name, config, tensors, source), version)

    def load_adapter_from_disk(self, name: str, path: str, version: int | None = None) -> Future[None]:
        """`load_adapter` from a PEFT adapter directory (read off the scheduler thread)."""
        try:
            config, tensors = read_adapter(path)
        except (OSError, ValueError) as e:
            fut: Future[None] = Future()
            fut.set_exception(ValueError(f"cannot read the adapter in {path!r}: {e}"))
            return fut
        return self.load_adapter(name, config, tensors, version, source=path)

    def register_adapter(self, name: str, config: Mapping[str, object]) -> Future[None]:
        """Load adapter ``name`` with zero tensors (the base model's outputs): a broadcast fills it."""
        return self._adapter_op(lambda model: self.adapter.register(model, name, config), None)

    def unload_adapter(self, name: str) -> Future[None]:
        """Put the base weights back in place of adapter ``name``."""
        return self._adapter_op(lambda model: self.adapter.unload(name), None)

    def _adapter_op(
        self, op: Callable[[torch.nn.Module], dict[str, torch.Tensor]], version: int | None
    ) -> Future[None]:
        def run() -> None:
            assert self.model is not None
            self._copy_weights(list(op(self.model).items()), version)

        return self._between_steps(run)

    def join_weights_update_group(self, meta: WeightUpdateMeta, rank: int) -> Future[None]:
        """Join ``meta``'s group at ``rank`` in a helper thread (the trainer joins concurrently)."""

        def join() -> None:
            if meta.backend == "nccl" and self.device is not None:
                # NCCL binds a rank to the current device of the thread that joins: the model's GPU.
                torch.cuda.set_device(self.device)
            self._group = init_custom_process_group(
                meta.backend, meta.master_address, meta.master_port, rank, meta.world_size, meta.group_name
            )
            self._group_backend = meta.backend

        return in_thread(join, "weight-group-join")

    def destroy_weights_update_group(self) -> None:
        self._group = None

    def check_param_specs(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> None:
        """Raise ValueError when a broadcast announcement does not fit the model."""
        assert self.model is not None
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}")
        for dtype in dtypes:
            dtype_of(dtype)
        adapter, names = split_adapter_names(names)
        if adapter is not None:
            specs = {n: tuple(shape) for n, shape in zip(names, shapes)}
            self.adapter.check_tensors(adapter, specs)  # reads one reference: safe from any thread
            return
        params = self.model.state_dict()
        for name, shape in zip(names, shapes):
            expected = self._locate(params, name)[2]
            if tuple(shape) != expected:
                raise ValueError(f"parameter {name!r} has shape {expected}, got {tuple(shape)}")

    def receive_broadcast(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], version: int | None
    ) -> Future[None]:
        """Receive the announced tensors from rank 0 in order, in a helper thread (the sender
        broadcasts after this returns), then load them. The future completes once loaded, or
        fails with ValueError when the announcement does not fit the model or no group exists."""

        def receive() -> None:
            if self._group is None:
                raise ValueError("no weight-update group: call join_weights_update_group first")
            self.check_param_specs(names, dtypes, shapes)
            # gloo moves CPU tensors, nccl CUDA tensors on the model's GPU (not the thread's default one).
            device = self.device if self._group_backend == "nccl" and self.device is not None else torch.device("cpu")
            received: dict[str, torch.Tensor] = {}
            for name, dtype, shape in zip(names, dtypes, shapes):
                t = torch.empty(tuple(shape), dtype=dtype_of(dtype), device=device)
                self._group.broadcast(t, src=0)
                received[name] = t
            adapter, tensor_names = split_adapter_names(list(received))
            if adapter is None:
                self.load_tensors(received, version).result()
            else:
                part = dict(zip(tensor_names, received.values()))
                self._adapter_op(lambda model: self.adapter.update(adapter, part), version).result()

        return in_thread(receive, "weight-receive")

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        assert self.model is not None
        params = self.model.state_dict()
        if name not in params:
            raise ValueError(f"unknown parameter {name!r}")
        return params[name].detach().flatten()[:truncate_size].float().tolist()
