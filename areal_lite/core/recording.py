"""Record and replay of the batches a rollout controller hands out.

An asynchronous run is not repeatable by running it again: which episodes finish first, and so
which tokens each batch holds and which policy version produced them, depends on timing. But
training depends only on the batches. A `BatchRecorder` writes every batch the controller hands
out, in order (training batches with their token ``versions``, the policy version they were
consumed at and their staleness; evaluation batches too), and a `BatchReplay` hands the same
batches out again, so that the same training code, config and seed reproduce the recorded run's
parameters bit for bit without generating anything.

A recording is a directory of ``000000.pt``, ``000001.pt``, ... (one per batch, `torch.save` of
plain tensors, read back with ``weights_only=True``). Replay checks that the loop asks for the
same kind of batch at the same policy version as the recorded run did, and says where it
diverged otherwise.
"""

from __future__ import annotations

import os
from typing import Literal

import torch
from tensordict import TensorDict

BatchKind = Literal["train", "eval"]
"""``train``: a pipeline batch (`prepare_batch`, `wait`); ``eval``: a `rollout_batch` call."""


def _path(directory: str, index: int) -> str:
    return os.path.join(directory, f"{index:06d}.pt")


class BatchRecorder:
    """Writes batches to ``directory``, numbered from `index` (0 for a new recording; a resumed
    run sets it from its checkpoint, overwriting what the crashed run recorded after it)."""

    def __init__(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.index = 0

    def write(self, kind: BatchKind, batch: TensorDict, version: int, staleness: list[int]) -> None:
        record = {
            "kind": kind,
            "version": version,
            "staleness": list(staleness),
            "batch_size": batch.batch_size[0],
            "batch": batch.to_dict(),
        }
        tmp = _path(self.directory, self.index) + ".tmp"
        torch.save(record, tmp)
        os.replace(tmp, _path(self.directory, self.index))  # a crash never leaves half a batch
        self.index += 1


class BatchReplay:
    """Reads the batches of a `BatchRecorder`'s ``directory`` back, in order, from `index`."""

    def __init__(self, directory: str) -> None:
        if not os.path.exists(_path(directory, 0)):
            raise FileNotFoundError(f"no recorded batches in {directory!r} (expected {_path(directory, 0)})")
        self.directory = directory
        self.index = 0
        self.last_staleness: list[int] = []

    def read(self, kind: BatchKind, version: int) -> TensorDict:
        """The next recorded batch, which must be a ``kind`` batch handed out at ``version``."""
        path = _path(self.directory, self.index)
        if not os.path.exists(path):
            raise RuntimeError(f"the recording in {self.directory!r} ends after {self.index} batches")
        record = torch.load(path, weights_only=True)
        if record["kind"] != kind or record["version"] != version:
            raise RuntimeError(
                f"replay diverged at batch {self.index}: the loop asks for a {kind} batch at policy version "
                f"{version}, the recorded run took a {record['kind']} batch at version {record['version']}"
            )
        self.index += 1
        if kind == "train":
            self.last_staleness = list(record["staleness"])
        return TensorDict(record["batch"], batch_size=[record["batch_size"]])
