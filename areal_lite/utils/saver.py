"""Periodic HF checkpoints (`Saver`) and the atomic, checksummed directory write that they and
recover checkpoints share.

A checkpoint directory is written under a temporary name, given a ``checksums.sha256`` file (the
SHA-256 of every file, in ``sha256sum`` format: ``sha256sum -c checksums.sha256`` checks it by
hand) and renamed into place only once every rank has finished, so a crash mid-write leaves the
previous checkpoint intact and never a half one. `intact_checkpoint` finds the newest copy whose
files match their checksums: a truncated file, a corrupted one or a few bytes overwritten inside an
intact-looking file is reported and the previous copy used (recover checkpoints keep one,
``<path>.prev``). A write that fails (a full disk, a read-only directory) leaves nothing behind
and raises `CheckpointWriteError` naming the cause, on every rank; a full disk's line names the
space a copy needs and what is free. A new copy that would not fit beside the current one is
refused before anything is written (or, where that makes room, the previous copy is removed
first), and the first recover checkpoint says what its copies need.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import shutil
from collections.abc import Callable

import torch.distributed as dist

from areal_lite.api.config import SaverConfig
from areal_lite.api.engine import TrainEngine
from areal_lite.api.errors import RecurringError
from areal_lite.api.io import SaveLoadMeta
from areal_lite.utils.step import StepInfo, is_due

logger = logging.getLogger(__name__)

CHECKSUMS = "checksums.sha256"
"""The file in a checkpoint directory with the SHA-256 of every other file."""
LOW_SPACE_BYTES = 64 << 20
"""A write that fails with less free space than this on its file system failed for lack of it (the
real cause of e.g. torch.save's ``unexpected pos`` error, which carries no errno)."""


MAKE_ROOM = "free space there, or move the run's output to a larger file system (cluster.fileroot)"


class CheckpointWriteError(RecurringError, OSError):
    """A checkpoint could not be written; the message names the cause (a full disk, a read-only
    file system, a permission). The previous checkpoint is intact."""


class CheckpointDamaged(RecurringError, RuntimeError):
    """No copy of a checkpoint matches its checksums."""


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _any_rank(problem: str | None) -> str | None:
    """The first rank's ``problem`` (None: no rank had one); collective under torch.distributed,
    so that every rank raises the same error instead of the others waiting on a rank that failed."""
    if not (dist.is_available() and dist.is_initialized()):
        return problem
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p is not None), None)


def _errno_of(error: BaseException) -> int | None:
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            return seen.errno
        seen = seen.__cause__ or seen.__context__
    return None


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _existing(directory: str) -> str:
    """``directory`` or its nearest ancestor that exists (where its file system is asked about)."""
    while directory and not os.path.exists(directory):
        directory = os.path.dirname(directory)
    return directory or "."


def size_of(directory: str) -> int:
    """Bytes of the files under ``directory`` (0 when it is absent)."""
    total = 0
    for root, _, names in os.walk(directory):
        for name in names:
            with contextlib.suppress(OSError):  # a file removed meanwhile
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def space_line(directory: str) -> str:
    """The free and total space of ``directory``'s file system, in words."""
    probe = _existing(directory)
    try:
        usage = shutil.disk_usage(probe)
    except OSError as e:
        return f"the space on {probe} is unknown ({e})"
    return f"{_mib(usage.free)} free of {_mib(usage.total)} on {probe}"


def write_failure(error: BaseException, directory: str, need: str = "") -> str:
    """Why writing into ``directory`` failed with ``error``, in words; ``need`` (what the
    checkpoint needs, in words) goes into a full disk's line."""
    code = _errno_of(error)
    probe = _existing(directory)
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        free = None
    if code == errno.EROFS:
        return f"the file system of {probe} is read-only"
    if code in (errno.EACCES, errno.EPERM):
        return f"permission denied in {probe}"
    if code in (errno.ENOSPC, errno.EDQUOT) or (free is not None and free < LOW_SPACE_BYTES):
        what = "the disk quota is exceeded" if code == errno.EDQUOT else "the disk is full"
        return f"{what} ({space_line(probe)}{need}); {MAKE_ROOM}"
    return f"{type(error).__name__}: {error}"


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
        os.fsync(f.fileno())  # on disk before the rename makes the checkpoint the current one
    return h.hexdigest()


def _files(directory: str) -> list[str]:
    out = []
    for root, _, names in os.walk(directory):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), directory)
            if rel != CHECKSUMS:
                out.append(rel)
    return sorted(out)


def write_checksums(directory: str) -> None:
    """Write ``directory/checksums.sha256`` over every file under ``directory``."""
    lines = "".join(f"{_sha256(os.path.join(directory, rel))}  {rel}\n" for rel in _files(directory))
    tmp = os.path.join(directory, CHECKSUMS + ".tmp")
    with open(tmp, "w") as f:
        f.write(lines)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, CHECKSUMS))


def checkpoint_problem(directory: str) -> str | None:
    """What is wrong with the checkpoint ``directory`` (a file missing, of another size or another
    SHA-256 than its checksum), or None when it is intact or predates checksums."""
    listing = os.path.join(directory, CHECKSUMS)
    if not os.path.exists(listing):
        logger.warning("checkpoint %s has no %s: its files cannot be verified", directory, CHECKSUMS)
        return None
    with open(listing) as f:
        entries = [line.rstrip("\n").split("  ", 1) for line in f if line.strip()]
    for entry in entries:
        if len(entry) != 2:
            return f"{CHECKSUMS} is damaged"
        digest, rel = entry
        path = os.path.join(directory, rel)
        if not os.path.isfile(path):
            return f"{rel} is missing"
        if _sha256(path) != digest:
            return f"{rel} does not match its checksum (truncated or overwritten)"
    return None


def _need(size: int, keep_previous: bool) -> str:
    """What copies of ``size`` bytes need while one more is written, in words."""
    if keep_previous:
        return (
            f"; a copy takes {_mib(size)}: {_mib(3 * size)} while one is written beside the current and the"
            f" previous one, {_mib(2 * size)} at least"
        )
    return f"; a copy takes {_mib(size)}: {_mib(2 * size)} while one is written beside the current one"


def _make_room(path: str, keep_previous: bool) -> None:
    """Before a new copy of ``path`` is written beside the current one (of about its size): where
    it does not fit, remove the previous copy if that makes room (the current one stays the
    fallback), else raise ENOSPC naming the need, before anything is written."""
    if not os.path.isdir(path):
        return
    size = size_of(path)
    free = shutil.disk_usage(path).free
    if free >= size:
        return
    previous = path + ".prev"
    if keep_previous and os.path.isdir(previous) and free + size_of(previous) >= size:
        print(
            f"[areal-lite] checkpoint {path}: {space_line(path)}, too little for a new copy of {_mib(size)} beside"
            f" the current and the previous one; the previous one is removed first (the current one stays the"
            f" fallback while the new one is written)",
            flush=True,
        )
        shutil.rmtree(previous)
        return
    raise OSError(errno.ENOSPC, f"no room for a new copy beside the current one{_need(size, keep_previous)}")


def _state_need(path: str) -> None:
    """After the first copy of a recover checkpoint: say what its copies need, and whether the
    next write will fit."""
    size = size_of(path)
    fits = shutil.disk_usage(path).free >= size
    print(
        f"[areal-lite] checkpoint {path} written{_need(size, True)} ({space_line(path)})"
        + ("" if fits else f": the next copy will not fit; {MAKE_ROOM}"),
        flush=True,
    )


def write_atomically(path: str, write: Callable[[str], None], *, keep_previous: bool = False) -> None:
    """Call ``write(tmp_dir)`` on every rank, then checksum ``tmp_dir`` and replace ``path`` with it
    on rank 0.

    Collective when torch.distributed is initialised. The old ``path`` is moved aside first (to
    ``path + ".prev"`` with ``keep_previous``, where it stays as the fallback of
    `intact_checkpoint`; else to ``path + ".old"``, deleted after), so at every instant one
    complete copy exists. A failure on any rank removes ``tmp_dir`` and raises
    `CheckpointWriteError` naming the cause on every rank; a full disk's line names the space a
    copy needs.

    Room: a new copy is written beside the current one and, with ``keep_previous``, the previous
    one. Before writing, the free space is checked against the current copy's size: where the new
    one does not fit, the previous copy is removed first if that makes room, else the write is
    refused before it starts. The first copy written with ``keep_previous`` says what the copies
    need (and when the next one will not fit).
    """
    tmp, aside = path + ".tmp", path + (".prev" if keep_previous else ".old")
    first = not os.path.isdir(path)

    def attempt(step: Callable[[], None], ranks: str) -> None:
        problem = None
        if ranks == "all" or _rank() == 0:
            try:
                step()
            except Exception as e:  # noqa: BLE001 - reported on every rank below, with its cause
                size = size_of(path) if os.path.isdir(path) else 0
                written = f"; {_mib(size_of(tmp))} of this copy were written" if not size else ""
                problem = write_failure(e, tmp, _need(size, keep_previous) if size else written)
                logger.error("writing checkpoint %s failed: %s: %s", path, type(e).__name__, e)
        problem = _any_rank(problem)
        if problem is not None:
            if _rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointWriteError(f"cannot write checkpoint {path}: {problem}")

    def prepare() -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        _make_room(path, keep_previous)
        os.makedirs(tmp)

    def seal() -> None:
        write_checksums(tmp)
        if os.path.exists(path):
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(path, aside)
        os.rename(tmp, path)
        if not keep_previous:
            shutil.rmtree(aside, ignore_errors=True)
        elif first:
            _state_need(path)

    attempt(prepare, "rank0")
    attempt(lambda: write(tmp), "all")
    attempt(seal, "rank0")  # its agreement is the barrier after which every rank sees the new copy


def copies(path: str) -> list[str]:
    """The complete copies `write_atomically` may have left at ``path``, newest first: ``path``
    itself, ``path + ".old"`` (a crash between the two renames) and ``path + ".prev"``."""
    return [p for p in (path, path + ".old", path + ".prev") if os.path.isdir(p)]


def resolve_atomic(path: str) -> str | None:
    """The newest complete copy at ``path`` (`copies`), unverified; None when there is none."""
    found = copies(path)
    return found[0] if found else None


def intact_checkpoint(path: str) -> str | None:
    """The newest copy at ``path`` whose files match their checksums; each damaged one is reported
    (an error line naming the file) and the next one tried. None when there is no copy;
    `CheckpointDamaged` when every copy is damaged."""
    damaged = []
    for copy in copies(path):
        problem = checkpoint_problem(copy)
        if problem is None:
            if damaged:
                logger.error("using the previous checkpoint %s instead", copy)
            return copy
        logger.error("checkpoint %s is damaged: %s", copy, problem)
        damaged.append(f"{copy}: {problem}")
    if damaged:
        raise CheckpointDamaged(f"no intact copy of checkpoint {path} ({'; '.join(damaged)})")
    return None


class Saver:
    """Writes HF model directories every ``freq_steps`` steps / ``freq_epochs`` epochs and after the
    last step, to ``output_dir/checkpoints/globalstep<N>`` (N counts finished steps)."""

    def __init__(self, config: SaverConfig, output_dir: str) -> None:
        self.config = config
        self.root = os.path.join(output_dir, "checkpoints")

    def path_of(self, step: StepInfo) -> str:
        return os.path.join(self.root, f"globalstep{step.global_step + 1}")

    def save(
        self, engine: TrainEngine, step: StepInfo, *, tokenizer: object | None = None, last: bool = False
    ) -> str | None:
        """Save after ``step`` if it is due (collective); returns the directory written, or None."""
        if not is_due(step, self.config.freq_steps, self.config.freq_epochs, last=last):
            return None
        path = self.path_of(step)
        write_atomically(path, lambda tmp: engine.save(SaveLoadMeta(path=tmp, weight_format="hf", tokenizer=tokenizer)))
        return path
