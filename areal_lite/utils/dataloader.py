"""A resumable data loader: each epoch is a seeded permutation, sharded over data-parallel ranks.

Recovery needs the data position to survive a crash exactly: resuming from a checkpoint taken after
step k must yield the same batches as the uninterrupted run from step k + 1 on, so that every
sample is consumed exactly once per epoch. torchdata's `StatefulDataLoader` records how far the
sampler got, but its default random sampler re-seeds each epoch from a generator whose state is not
part of the checkpoint, so the epochs after a resume are shuffled differently. `EpochSampler`
derives epoch ``e``'s permutation from ``seed + e`` alone and saves ``(epoch, position)``, which is
all it takes to resume exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch.utils.data import Sampler
from torchdata.stateful_dataloader import StatefulDataLoader


class EpochSampler(Sampler[int]):
    """Indices of this rank's share of one epoch; a new seeded permutation each epoch.

    The permutation (or ``range`` without ``shuffle``) is cut to a multiple of ``world_size`` and
    rank ``r`` takes positions ``r, r + world_size, ...``, so ranks never share a sample. The
    sampler is its own iterator: `state_dict` is ``{"epoch", "position"}`` at any moment, and
    calling ``iter`` after an epoch is exhausted starts the next one.
    """

    def __init__(
        self, dataset_size: int, *, shuffle: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.dataset_size = dataset_size
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.position = 0
        self._indices: list[int] = []

    def __len__(self) -> int:
        return self.dataset_size // self.world_size

    def _epoch_indices(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_size, generator=g).tolist()
        else:
            order = list(range(self.dataset_size))
        usable = len(self) * self.world_size
        return order[:usable][self.rank :: self.world_size]

    def __iter__(self) -> EpochSampler:
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0
        self._indices = self._epoch_indices()
        return self

    def __next__(self) -> int:
        if self.position >= len(self):
            raise StopIteration
        self.position += 1
        return self._indices[self.position - 1]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


def _as_list(items: list[object]) -> list[object]:
    return items


def stateful_dataloader(
    dataset: Sequence[object],
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    drop_last: bool = True,
    collate_fn: Callable[[list[object]], object] = _as_list,
) -> StatefulDataLoader:
    """A `StatefulDataLoader` over this rank's share of ``dataset`` with an `EpochSampler`.

    ``batch_size`` is per rank. Batches are lists of items by default (workflows take items, not
    tensors). Iterating the loader once is one epoch; iterate it again for the next. Its
    ``state_dict()`` / ``load_state_dict()`` resume at the exact batch, across epochs.
    """
    sampler = EpochSampler(len(dataset), shuffle=shuffle, seed=seed, rank=rank, world_size=world_size)
    return StatefulDataLoader(
        dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, collate_fn=collate_fn
    )


def endless(dataloader: Iterable[object]) -> Iterator[object]:
    """The loader's batches, epoch after epoch (a resumed loader continues where it stopped)."""
    while True:
        yield from dataloader
