"""Data plumbing of recipes: `DataSet` (an iterator over a rank's share of the items, reshuffled
each epoch, resumable), `get_minibatches` (shuffled mini-batches over mini-epochs) and
`CosineScheduler` (the learning rate as a function of training progress)."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Generic, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def data_parallel_rank() -> tuple[int, int]:
    """``(rank, world_size)`` of this process (``(0, 1)`` outside torch.distributed)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class DataSet(Generic[T]):
    """An iterator over ``items``: shuffled with ``seed`` (a new order each epoch), or in order.

    Under several ranks each rank iterates over its own share of every epoch's order (the shares
    are disjoint and of equal size, the remainder left out), so that ranks never train on the same
    item and take the same number of steps. The share is taken at the first ``next``, once the
    models have joined the process group. ``allow_looping`` starts a new epoch when one ends;
    otherwise the iterator stops. `state_dict` / `load_state_dict` resume at the same position.
    """

    def __init__(self, items: Sequence[T], allow_looping: bool = False, seed: int = 0, shuffle: bool = True) -> None:
        if len(items) == 0:
            raise ValueError("DataSet needs at least one item")
        self.items = list(items)
        self.allow_looping = allow_looping
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        """Items of this rank's share consumed in the current epoch."""
        self._share: list[int] | None = None

    def _order(self) -> list[int]:
        rank, world = data_parallel_rank()
        if len(self.items) < world:
            raise ValueError(f"{len(self.items)} items cannot be shared by {world} ranks")
        order = list(range(len(self.items)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        per_rank = len(order) // world
        return order[rank * per_rank : (rank + 1) * per_rank]

    def __iter__(self) -> DataSet[T]:
        return self

    def __next__(self) -> T:
        if self._share is None:
            self._share = self._order()
        if self.position == len(self._share):
            if not self.allow_looping:
                raise StopIteration
            self.epoch += 1
            self.position = 0
            self._share = self._order()
        self.position += 1
        return self.items[self._share[self.position - 1]]

    def __len__(self) -> int:
        """Items per epoch on this rank."""
        return len(self.items) // data_parallel_rank()[1]

    @property
    def consumed(self) -> int:
        """Items this rank has drawn, over all epochs."""
        return self.epoch * len(self) + self.position

    def state_dict(self) -> dict[str, object]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, object]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"the saved data position is for seed {state['seed']}, this DataSet has seed {self.seed}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])  # type: ignore[call-overload]
        self._share = None


def get_minibatches(data: Sequence[T], size: int, n_epochs: int = 1, seed: int | None = None) -> list[list[T]]:
    """``data`` shuffled and cut into mini-batches of ``size`` (the last of an epoch may be
    smaller), for each of ``n_epochs`` passes; ``seed`` fixes the shuffles."""
    if size < 1 or n_epochs < 1:
        raise ValueError(f"mini-batch size and epochs must be >= 1, got size={size}, n_epochs={n_epochs}")
    rng = random.Random(seed)
    out: list[list[T]] = []
    for _ in range(n_epochs):
        order = list(data)
        rng.shuffle(order)
        out.extend(order[i : i + size] for i in range(0, len(order), size))
    return out


class CosineScheduler:
    """The learning rate at a training progress ``p`` in [0, 1]: linear warm-up over the first
    ``warmup_fraction``, then a cosine from ``lr`` down to ``min_lr_ratio * lr`` at ``p = 1``
    (Loshchilov and Hutter 2017, SGDR, eq. 5 without restarts)."""

    def __init__(self, lr: float, min_lr_ratio: float = 0.0, warmup_fraction: float = 0.0) -> None:
        if lr <= 0 or not 0 <= min_lr_ratio <= 1 or not 0 <= warmup_fraction < 1:
            raise ValueError(f"bad schedule: lr={lr}, min_lr_ratio={min_lr_ratio}, warmup_fraction={warmup_fraction}")
        self.lr = lr
        self.min_lr_ratio = min_lr_ratio
        self.warmup_fraction = warmup_fraction

    def __call__(self, progress: float) -> float:
        p = min(max(progress, 0.0), 1.0)
        if p < self.warmup_fraction:
            return self.lr * max(p / self.warmup_fraction, 1e-3)
        decay = (p - self.warmup_fraction) / (1.0 - self.warmup_fraction)
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * decay)))
