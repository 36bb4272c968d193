"""The weight-update extension that vLLM's workers load, and the RPC vocabulary it answers.

vLLM's OpenAI server has what RL needs for generation (token ids in and out, log-probabilities,
``/pause`` and ``/resume``) and calls methods of its workers through ``POST /collective_rpc``
(with ``VLLM_SERVER_DEV_MODE=1``). Its own weight transfer joins the trainer through vLLM's
process-group helpers, which a trainer that broadcasts with ``torch.distributed`` (our FSDP and
Megatron engines) cannot join, and it has no call that loads a new checkpoint directory. This
module adds both, as a worker extension::

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL \\
        --worker-extension-cls areal_lite.engines.vllm_worker.WeightUpdateExtension

vLLM mixes `WeightUpdateExtension` into each worker's class, so its methods run inside every
worker process (one per tensor-parallel rank) with the worker's ``model_runner``, ``rank`` and
``device``. `RemoteVLLMEngine` calls them as ``{"method": NAME, "args": [JSON]}``: the arguments
travel as one JSON string, as vLLM's RPC route asks. Our own server answers the same calls
(`areal_lite.engines.vllm_routes`), so the client is tested against it.

The calls (docs/protocol.md, "The vLLM protocol"):

- `JOIN_GROUP` ``{"master_address", "master_port", "rank_offset", "world_size", "group_name",
  "backend"}``: join the trainer's weight-update group as rank ``rank_offset + worker rank``;
- `RECEIVE` ``{"names", "dtypes", "shapes"}``: receive those tensors, broadcast from rank 0 in that
  order, and load each with the model's ``load_weights`` (which shards it for tensor parallelism);
- `LEAVE_GROUP` ``{"group_name"}``;
- `LOAD_FROM_DISK` ``{"model_path"}``: load every ``*.safetensors`` file of that directory.

Only this module's imports (torch, safetensors, our process-group helper) are needed inside vLLM.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from areal_lite.utils.distributed import CustomGroup, init_custom_process_group

JOIN_GROUP = "areal_join_weight_update_group"
RECEIVE = "areal_receive_weights"
LEAVE_GROUP = "areal_leave_weight_update_group"
LOAD_FROM_DISK = "areal_load_weights_from_disk"
METHODS = (JOIN_GROUP, RECEIVE, LEAVE_GROUP, LOAD_FROM_DISK)


def _args(raw: str) -> dict[str, object]:
    try:
        args = json.loads(raw)
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"the call's argument must be one JSON object as a string: {e}") from e
    if not isinstance(args, dict):
        raise ValueError("the call's argument must be one JSON object as a string")  # noqa: TRY004 - a 400, not a bug
    return args


def _field(args: dict[str, object], key: str, kind: type) -> object:
    value = args.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{key} must be a {kind.__name__}, got {value!r}")
    return value


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")  # noqa: TRY004 - a 400, not a bug
    return dtype


@dataclass
class GroupSpec:
    """`JOIN_GROUP`'s argument."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str

    @classmethod
    def parse(cls, raw: str) -> GroupSpec:
        a = _args(raw)
        spec = cls(
            str(_field(a, "master_address", str)),
            int(_field(a, "master_port", int)),  # type: ignore[call-overload]
            int(_field(a, "rank_offset", int)),  # type: ignore[call-overload]
            int(_field(a, "world_size", int)),  # type: ignore[call-overload]
            str(a.get("group_name", "weight_update_group")),
            str(a.get("backend", "nccl")),
        )
        if not 0 < spec.rank_offset < spec.world_size:
            raise ValueError(f"rank_offset {spec.rank_offset} must be in [1, world_size={spec.world_size})")
        if spec.backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be nccl or gloo, got {spec.backend!r}")
        return spec


@dataclass
class BroadcastSpec:
    """`RECEIVE`'s argument: the tensors rank 0 broadcasts, in order."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]

    @classmethod
    def parse(cls, raw: str) -> BroadcastSpec:
        a = _args(raw)
        names, dtypes, shapes = a.get("names"), a.get("dtypes"), a.get("shapes")
        if not isinstance(names, list) or not isinstance(dtypes, list) or not isinstance(shapes, list):
            raise ValueError("names, dtypes and shapes must be lists")  # noqa: TRY004 - a 400, not a bug
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}")
        if not all(isinstance(x, str) for x in names + dtypes):
            raise ValueError("names and dtypes must be strings")
        if not all(isinstance(s, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in s)
                   for s in shapes):  # fmt: skip
            raise ValueError("shapes must be lists of non-negative integers")
        for d in dtypes:
            torch_dtype(d)
        return cls(names, dtypes, shapes)


def model_path_arg(raw: str) -> str:
    """`LOAD_FROM_DISK`'s argument: a directory holding ``*.safetensors`` files."""
    path = _field(_args(raw), "model_path", str)
    assert isinstance(path, str)
    if not glob.glob(os.path.join(path, "*.safetensors")):
        raise ValueError(f"no *.safetensors files in {path!r}")
    return path


def safetensors_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every ``*.safetensors`` file in ``path``, one file open at a time."""
    from safetensors import safe_open

    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(f, framework="pt", device="cpu") as h:
            for name in h.keys():  # noqa: SIM118 - a safetensors handle is not a mapping
                yield name, h.get_tensor(name)


class WeightUpdateExtension:
    """Methods vLLM adds to its worker class (``--worker-extension-cls``); ``self`` is the worker,
    with ``model_runner.model`` (a vLLM model with ``load_weights``), ``rank`` and ``device``."""

    _areal_group: CustomGroup | None = None
    _areal_backend: str = "nccl"

    def areal_join_weight_update_group(self, raw: str) -> None:
        spec = GroupSpec.parse(raw)
        rank = spec.rank_offset + int(self.rank)  # type: ignore[attr-defined]
        self._areal_group = init_custom_process_group(
            spec.backend, spec.master_address, spec.master_port, rank, spec.world_size, spec.group_name
        )
        self._areal_backend = spec.backend

    def areal_receive_weights(self, raw: str) -> None:
        spec = BroadcastSpec.parse(raw)
        if self._areal_group is None:
            raise RuntimeError(f"no weight-update group: call {JOIN_GROUP} first")
        device = self.device  # type: ignore[attr-defined]
        model = self.model_runner.model  # type: ignore[attr-defined]
        # nccl moves tensors on the GPU, gloo on the CPU.
        buffer_device = device if self._areal_backend == "nccl" else "cpu"
        for name, dtype, shape in zip(spec.names, spec.dtypes, spec.shapes):
            t = torch.empty(tuple(shape), dtype=torch_dtype(dtype), device=buffer_device)
            self._areal_group.broadcast(t, src=0)
            model.load_weights(weights=[(name, t.to(device))])

    def areal_leave_weight_update_group(self, raw: str) -> None:
        _args(raw)
        self._areal_group = None

    def areal_load_weights_from_disk(self, raw: str) -> None:
        self.model_runner.model.load_weights(weights=safetensors_weights(model_path_arg(raw)))  # type: ignore[attr-defined]
