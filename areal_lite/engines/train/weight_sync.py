"""The sending side of weight updates, shared by the train engines (`FSDPEngine`, `MegatronEngine`).

An engine only knows how to produce its full HF-named tensors (a collective iteration over its own
shards) and how to write a HF directory; `WeightSender` does the rest of
`TrainEngine.connect_engine` / `TrainEngine.update_weights`: trainer rank 0 builds the weight-update
group and talks to the inference engine, and every rank runs the engine's collectives.

An ``ipc`` update packs rank 0's tensors into buckets of memory the servers of this machine map
(`areal_lite.utils.tensor_handles.TensorBucket`), two at most alive at once: the next bucket is
gathered and packed while the servers load the previous one, which is freed once they all have.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from dataclasses import replace

import torch
import torch.distributed as dist

from areal_lite.api.engine import InferenceEngine
from areal_lite.api.io import ParamSpec, WeightUpdateMeta
from areal_lite.utils.distributed import CustomGroup, find_free_port, init_custom_process_group
from areal_lite.utils.tensor_handles import TensorBucket

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.05
"""How often a broadcast in flight checks whether the call that announced it has failed."""
NamedTensors = Callable[[], Iterator[tuple[str, torch.Tensor]]]
"""Full HF-named tensors, one at a time; collective: every trainer rank iterates to the end."""


class WeightSender:
    """The connected inference engine and, for distributed updates, the weight-update group."""

    def __init__(self) -> None:
        self.engine: InferenceEngine | None = None
        self.group: CustomGroup | None = None
        self.group_meta: WeightUpdateMeta | None = None
        """The meta the group was formed with (its port changes when the group is formed again)."""

    def connect(self, engine: InferenceEngine, meta: WeightUpdateMeta) -> None:
        """Remember ``engine``. For distributed updates rank 0 also builds the weight-update group:
        a ``master_port`` of 0 is replaced (in ``meta``, in place) by a free port before the engine
        is asked to join, and ``meta.world_size`` (trainer rank 0 + server ranks) must be set by
        the caller or by ``engine.init_weights_update_group``."""
        self.engine = engine
        if meta.type != "distributed" or dist.get_rank() != 0:
            return
        if meta.master_port == 0:
            meta.master_port = find_free_port(meta.master_address)
        self.group_meta = meta
        self.group = self._form_group(meta)

    def _form_group(self, meta: WeightUpdateMeta) -> CustomGroup:
        fut = self._engine().init_weights_update_group(meta)
        if meta.world_size < 2:
            raise ValueError(
                f"WeightUpdateMeta.world_size must count rank 0 and the server ranks, got {meta.world_size}"
            )
        group = init_custom_process_group(
            meta.backend,
            meta.master_address,
            meta.master_port,
            rank=0,
            world_size=meta.world_size,
            group_name=meta.group_name,
        )
        fut.result()
        return group

    def _regroup_if_broken(self) -> None:
        """A server of the group has died (its rollouts went to the others): form a new group of
        the live servers, on a new port, before broadcasting to a member that is gone."""
        if self._engine().weight_update_group_intact():
            return
        assert self.group_meta is not None
        logger.warning("a rollout server of the weight-update group is gone: forming a new group of the live servers")
        self.group = None  # the old group's dead member would fail every broadcast
        self.group_meta.master_port = find_free_port(self.group_meta.master_address)
        self.group = self._form_group(self.group_meta)
        logger.warning("new weight-update group of %d ranks formed", self.group_meta.world_size)

    def send(
        self, meta: WeightUpdateMeta, version: int, tensors: NamedTensors, write_disk: Callable[[str], None]
    ) -> None:
        """Send the weights and wait until the engine has loaded them; collective over the
        trainer's ranks. ``meta.version`` defaults to ``version``; ``write_disk(path)`` writes the
        directory of a disk update, whose ``*.safetensors`` files the servers load (collective,
        rank 0 writes)."""
        rank = dist.get_rank()
        if rank == 0 and self.engine is None:
            raise RuntimeError("update_weights needs connect_engine() first")
        meta = replace(meta, version=version if meta.version is None else meta.version)
        if meta.type == "distributed":
            self._send_distributed(meta, tensors())
        elif meta.type == "ipc":
            self._send_ipc(meta, tensors())
        elif meta.type == "disk":
            assert meta.path is not None
            write_disk(meta.path)
            if rank == 0:
                self._engine().update_weights(meta).result()
        else:
            # In process: each rank's own engine (the examples give every rank one) gets the weights.
            named = {name: t.cpu() for name, t in tensors()}
            if self.engine is not None:
                self.engine.update_weights(replace(meta, named_tensors=named)).result()
        dist.barrier()

    def _engine(self) -> InferenceEngine:
        assert self.engine is not None
        return self.engine

    def _send_distributed(self, meta: WeightUpdateMeta, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        rank = dist.get_rank()
        if rank == 0 and self.group is None:
            raise RuntimeError("a distributed weight update needs connect_engine() with a distributed meta first")
        if rank == 0:
            self._regroup_if_broken()
        send_device = (
            torch.device("cuda", torch.cuda.current_device()) if meta.backend == "nccl" else torch.device("cpu")
        )
        chunk: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in tensors:
            if rank != 0:
                continue
            nbytes = tensor.numel() * tensor.element_size()
            if chunk and size + nbytes > meta.chunk_bytes:
                self._send_chunk(chunk, meta, last=False)  # a tensor follows: not the last chunk
                chunk, size = [], 0
            chunk.append((name, tensor.to(send_device)))
            size += nbytes
        if rank == 0 and chunk:
            self._send_chunk(chunk, meta, last=True)

    def _send_ipc(self, meta: WeightUpdateMeta, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Rank 0 sends bucket after bucket; the other ranks only take part in the gathers."""
        rank = dist.get_rank()
        chunk: list[tuple[str, torch.Tensor]] = []
        size = 0
        loading: tuple[TensorBucket, Future[None]] | None = None
        try:
            for name, tensor in tensors:
                if rank != 0:
                    continue
                nbytes = tensor.numel() * tensor.element_size()
                if chunk and size + nbytes > meta.chunk_bytes:
                    loading = self._send_bucket(chunk, meta, loading, last=False)
                    chunk, size = [], 0
                chunk.append((name, tensor))
                size += nbytes
            if rank == 0 and chunk:
                loading = self._send_bucket(chunk, meta, loading, last=True)
            if loading is not None:
                loading[1].result()
        finally:
            if loading is not None:
                loading[0].free()

    def _send_bucket(
        self,
        chunk: list[tuple[str, torch.Tensor]],
        meta: WeightUpdateMeta,
        loading: tuple[TensorBucket, Future[None]] | None,
        last: bool,
    ) -> tuple[TensorBucket, Future[None]]:
        """Pack ``chunk`` into a bucket while the servers load the previous one (``loading``),
        free that one once they have, then send this one's handles."""
        bucket = TensorBucket(chunk)
        try:
            if loading is not None:
                try:
                    loading[1].result()
                finally:
                    loading[0].free()
            sent = replace(meta, serialized_tensors=bucket.serialize(), last_chunk=last)
            return bucket, self._engine().update_weights(sent)
        except BaseException:
            bucket.free()
            raise

    def _send_chunk(self, chunk: list[tuple[str, torch.Tensor]], meta: WeightUpdateMeta, last: bool) -> None:
        """Announce the chunk's specs, broadcast its tensors in that order, wait for the load."""
        assert self.group is not None
        specs = [ParamSpec(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in chunk]
        fut = self._engine().update_weights(replace(meta, param_specs=specs, last_chunk=last))
        for _, t in chunk:
            self._broadcast_watching(t.contiguous(), fut)
        fut.result()

    def _broadcast_watching(self, tensor: torch.Tensor, announced: Future[None]) -> None:
        """Broadcast ``tensor`` while watching the call that announced it: a server that failed
        the call (bad specs, a failed load) may never receive, and a plain broadcast would then
        wait for the group's timeout (minutes) instead of reporting the server's error."""
        assert self.group is not None
        work = self.group.broadcast_async(tensor)
        while not work.is_completed():
            done, _ = wait([announced], timeout=WATCH_INTERVAL_S)
            if done and announced.exception() is not None:
                raise RuntimeError(
                    f"weight update failed on the inference side during the broadcast: {announced.exception()}"
                ) from announced.exception()
        work.wait()  # raises the transport's error, if any
