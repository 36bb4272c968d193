"""Tensors handed to another process on this machine without a copy through a file or a socket:
the payload of SGLang's ``update_weights_from_tensor``, which ``ipc`` weight updates carry from
the trainer to the rollout servers (`areal_lite.api.io.WeightUpdateMeta`).

A `TensorBucket` packs named tensors into one block of memory: on a GPU one device allocation, on
a CPU one POSIX shared-memory segment (``/dev/shm/areal_lite_w_<pid>_<random>``). Its `serialize`
writes one entry of SGLang's ``serialized_named_tensors``: base64 of a pickle of a list of
``(name, tensor)`` in which each tensor is a handle to the block, not its bytes. A GPU tensor
pickles by torch's own reduction (a CUDA IPC handle, what SGLang's servers open); a CPU tensor as
(segment, byte offset, dtype, shape), through pickle's persistent ids. The block belongs to the
process that made it and stays valid until `TensorBucket.free`, which the sender calls once every
receiver has loaded it.

`load_named_tensors` reads an entry back with an unpickler that builds nothing but tensors: torch's
CUDA rebuild, and views of a segment whose name has the buckets' prefix, so that a request cannot
make the receiver map an arbitrary file of ``/dev/shm``. A handle means something only on the
machine that made it; the receiver trusts its caller as it does with a disk path.
"""

from __future__ import annotations

import base64
import binascii
import io
import ipaddress
import os
import pickle
import re
import secrets
import socket
import urllib.parse
from multiprocessing import shared_memory
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # registers torch's CUDA IPC reductions on ForkingPickler

SEGMENT_PREFIX = "areal_lite_w_"
"""The name of every bucket's shared-memory segment starts with this (the receiver refuses others)."""
SHM_DIR = "/dev/shm"
"""Where POSIX shared-memory segments appear as files on Linux."""
ALIGN = 64
"""Byte alignment of each tensor in a bucket (any dtype's view of the block is then aligned)."""
_SEGMENT = re.compile(rf"^{SEGMENT_PREFIX}\d+_[0-9a-f]+$")
_TORCH_CLASSES = {
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("torch.storage", "UntypedStorage"),
    ("torch.nn.parameter", "Parameter"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
}
"""What a CUDA tensor's pickle names (torch's reduction), besides dtypes."""
_DTYPES = {name: d for name, d in vars(torch).items() if isinstance(d, torch.dtype)}


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


class TensorBucket:
    """Named tensors copied into one block of memory that another process of this machine can
    map: a shared-memory segment for CPU tensors, a device allocation for GPU tensors (on the
    device of the first one)."""

    def __init__(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        if not tensors:
            raise ValueError("a bucket needs at least one tensor")
        device = tensors[0][1].device
        offsets, size = [], 0
        for _, t in tensors:
            offsets.append(size)
            size += _aligned(t.numel() * t.element_size())
        self.nbytes = size
        self._shm: shared_memory.SharedMemory | None = None
        if device.type == "cpu":
            name = f"{SEGMENT_PREFIX}{os.getpid()}_{secrets.token_hex(8)}"
            self._shm = shared_memory.SharedMemory(name=name, create=True, size=max(size, 1))
            block = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=size)
        else:
            block = torch.empty(size, dtype=torch.uint8, device=device)
        self.named: list[tuple[str, torch.Tensor]] = []
        """The tensors, as views of the block."""
        for (name, t), offset in zip(tensors, offsets):
            view = block[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            view.copy_(t)
            self.named.append((name, view))
        self._block: torch.Tensor | None = block

    @property
    def segment(self) -> str | None:
        """The shared-memory segment's name (None for a bucket on a GPU)."""
        return None if self._shm is None else self._shm.name

    def serialize(self) -> str:
        """One entry of SGLang's ``serialized_named_tensors``: base64 of the pickled (name, handle) list."""
        if self._block is None:
            raise RuntimeError("the bucket was freed")
        buf = io.BytesIO()
        _HandlePickler(buf, self).dump(self.named)
        return base64.b64encode(buf.getvalue()).decode("ascii")

    def handle(self, t: torch.Tensor) -> tuple[str, str, int, str, list[int]]:
        """The persistent id of a CPU tensor of this bucket: (``"shm"``, segment, offset, dtype, shape)."""
        assert self._block is not None and self._shm is not None
        offset = t.data_ptr() - self._block.data_ptr()
        if not 0 <= offset <= self.nbytes - t.numel() * t.element_size() or not t.is_contiguous():
            raise ValueError("only the bucket's own tensors can be handed over from its segment")
        return ("shm", self._shm.name, offset, str(t.dtype).removeprefix("torch."), list(t.shape))

    def free(self) -> None:
        """Give the block back: unlink the segment (receivers that still map it keep their
        mapping until they drop it), or release the GPU allocation."""
        self.named = []
        on_gpu = self._block is not None and self._block.is_cuda
        self._block = None
        if self._shm is not None:
            self._shm.unlink()
            try:
                self._shm.close()
            except BufferError:  # a view is still referenced elsewhere: the mapping goes with it
                pass
            self._shm = None
        elif on_gpu:
            torch.cuda.ipc_collect()  # the block waits for the receivers' reference counts


class _HandlePickler(ForkingPickler):
    """Pickles a bucket's CPU tensors as persistent ids naming its segment; GPU tensors go through
    torch's CUDA IPC reduction (registered on `ForkingPickler`)."""

    def __init__(self, file: io.BytesIO, bucket: TensorBucket) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.bucket = bucket

    def persistent_id(self, obj: object) -> tuple[str, str, int, str, list[int]] | None:
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            return self.bucket.handle(obj)
        return None


class _HandleUnpickler(pickle.Unpickler):
    """Builds only tensors: torch's CUDA rebuild (with the classes and dtypes its arguments name)
    and views of a bucket's shared-memory segment, each segment mapped once."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self._segments: dict[str, torch.Tensor] = {}

    def find_class(self, module: str, name: str) -> object:
        if (module, name) in _TORCH_CLASSES or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a tensor handle")

    def persistent_load(self, pid: object) -> torch.Tensor:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "shm"):
            raise pickle.UnpicklingError(f"not a shared-memory tensor handle: {pid!r}")
        _, segment, offset, dtype_name, shape = pid
        if not isinstance(segment, str) or not _SEGMENT.match(segment):
            raise pickle.UnpicklingError(f"segment {segment!r} is not a weight bucket's ({SEGMENT_PREFIX}...)")
        if not (
            isinstance(offset, int)
            and offset >= 0
            and isinstance(shape, list)
            and all(isinstance(d, int) and d >= 0 for d in shape)
        ):
            raise pickle.UnpicklingError(f"bad offset or shape in handle {pid!r}")
        dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise pickle.UnpicklingError(f"unknown dtype {dtype_name!r}")
        block = self._segments.get(segment)
        if block is None:
            path = os.path.join(SHM_DIR, segment)
            size = os.stat(path).st_size
            # MAP_PRIVATE (shared=False): pages are read from the segment as touched, never copied up front.
            block = torch.from_file(path, shared=False, size=size, dtype=torch.uint8) if size else torch.empty(0)
            self._segments[segment] = block
        nbytes = dtype.itemsize * _numel(shape)
        if offset + nbytes > block.numel():
            raise pickle.UnpicklingError(f"handle {pid!r} reaches past the end of its segment ({block.numel()} bytes)")
        return block[offset : offset + nbytes].view(dtype).view(shape)


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def load_named_tensors(entry: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) list of one ``serialized_named_tensors`` entry (base64, or the raw
    pickle), each tensor a view of the sender's memory. ValueError, with the reason, for anything
    else (a handle whose memory is gone, a class outside the allowed ones, bad base64)."""
    if isinstance(entry, str):
        try:
            entry = base64.b64decode(entry, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"serialized_named_tensors entries must be base64: {e}") from e
    try:
        named = _HandleUnpickler(io.BytesIO(entry)).load()
    except Exception as e:  # anything a crafted or stale payload raises is the request's fault
        raise ValueError(f"cannot read the tensor handles: {type(e).__name__}: {e}") from e
    if not isinstance(named, list) or not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor) for p in named
    ):
        raise ValueError("serialized_named_tensors entries must hold a list of (name, tensor) pairs")
    return named


def on_this_machine(address: str) -> bool:
    """Whether the server at ``address`` (``http://host:port``) runs on this machine: every IP
    address its host resolves to is a loopback address or one a socket here can bind."""
    host = urllib.parse.urlsplit(address).hostname or ""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        return False
    for family, _, _, _, sockaddr in infos:
        ip = str(sockaddr[0])
        if ipaddress.ip_address(ip.partition("%")[0]).is_loopback:
            continue
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.bind((ip, 0))
            except OSError:
                return False
    return bool(infos)
