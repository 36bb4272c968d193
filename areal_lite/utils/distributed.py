"""Process groups: the trainer's default group (`init_default_group`, shared by the train engines)
and, outside it, the weight-update group shared by trainer rank 0 and the rollout servers.

The trainer's default group (torchrun) and each server's process know nothing of each other, so
the weight-update group is built directly on a TCP store: rank 0 (the trainer) hosts the store,
every server rank connects to it. The group is a bare `ProcessGroup` object used through its own
methods (`broadcast`), never registered as a default group, so it cannot disturb the trainer's
collectives.
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


def init_default_group() -> bool:
    """Join torchrun's group, or create a one-process group; True when this call created it."""
    if dist.is_initialized():
        return False
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    else:
        port = find_free_port()
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return True


_FINAL_BARRIERS: list[object] = []
"""Handles of the barriers `destroy_default_group` ends with, kept until the interpreter exits."""


def destroy_default_group() -> None:
    """Destroy the default process group at the end of a job, after a barrier; without it while an
    exception is on its way out (called from a ``finally``), where another rank may never arrive.

    Why not ``dist.barrier(); dist.destroy_process_group()``: gloo's barrier holds weak references
    to the collectives still in flight when it was issued, and whichever thread drops the barrier
    last destroys those collectives and the tensors they kept, which takes the GIL. The group
    outlives ``destroy_process_group`` (DTensor's caches keep its device mesh), so when that thread
    is one of gloo's workers and the interpreter is exiting, Python ends the thread inside a C++
    destructor and the process aborts with "terminate called without an active exception" (1 run
    in 20 of an FSDP script on two busy cores). Keeping the barrier's handle until exit makes the
    main thread its last owner (0 aborts in 100 runs)."""
    if not dist.is_initialized():
        return
    if sys.exc_info()[0] is None:
        work = dist.barrier(async_op=True)
        assert work is not None
        work.wait()
        _FINAL_BARRIERS.append(work)
    dist.destroy_process_group()


def init_custom_process_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout: float = 300.0,
) -> CustomGroup:
    """Create (rank 0) or join (other ranks) a standalone process group over a TCP store.

    ``backend`` is ``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors). Blocks until all
    ``world_size`` ranks have joined or ``timeout`` seconds pass.
    """
    td = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(
        master_address, master_port, world_size, is_master=(rank == 0), timeout=td, wait_for_workers=True
    )
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, td)
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = td
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    else:
        raise ValueError(f"weight-update backend must be gloo or nccl, got {backend!r}")
    return CustomGroup(pg=pg, store=store, rank=rank, world_size=world_size)


@dataclass
class CustomGroup:
    """A standalone process group and the store it lives on (the group does not own the store)."""

    pg: dist.ProcessGroup
    store: dist.Store
    rank: int
    world_size: int

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Broadcast ``tensor`` in place from rank ``src`` and wait for it."""
        self.broadcast_async(tensor, src).wait()

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0) -> dist.Work:
        """Start broadcasting ``tensor`` in place from rank ``src``; the caller waits on the work."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        return self.pg.broadcast([tensor], opts)

    def barrier(self) -> None:
        self.pg.barrier().wait()


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free at the time of the call."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
