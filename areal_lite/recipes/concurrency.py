"""Fan-out helpers of recipes: `async_map` (every item at once) and `async_map_batch` (draw items
from an iterator until a batch of them has succeeded, retrying failures).

Everything a recipe awaits runs concurrently on one event loop; the models gather concurrent
requests into packed batches (`areal_lite.recipes.model`), so mapping a model method over a
mini-batch costs about one batched call, not one call per item.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


async def async_map(fn: Callable[[T], Awaitable[R]], items: Iterable[T], *, desc: str | None = None) -> list[R]:
    """``[await fn(x) for x in items]``, all at once; results in the order of ``items``. The first
    exception is raised once every call has finished (none is left running). With ``desc`` a
    progress bar counts the finished calls."""
    items = list(items)
    bar = tqdm(total=len(items), desc=desc, leave=False) if desc else None

    async def one(x: T) -> R:
        try:
            return await fn(x)
        finally:
            if bar is not None:
                bar.update()

    try:
        results = await asyncio.gather(*(one(x) for x in items), return_exceptions=True)
    finally:
        if bar is not None:
            bar.close()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results  # type: ignore[return-value]


async def async_map_batch(
    fn: Callable[[T], Awaitable[R]],
    items: Iterator[T] | Iterable[T],
    batch_size: int,
    *,
    retries: int = 1,
    max_failures: int | None = None,
) -> list[R]:
    """``batch_size`` results of ``fn`` over items drawn from ``items``, ``batch_size`` running at
    once. An item whose call raises is tried again up to ``retries`` times, then replaced by the
    next item; after ``max_failures`` failed calls in all (default ``batch_size``) the last error
    is raised (the calls still running are cancelled). Results come in the order their items were
    drawn. Raises ValueError when ``items`` runs out before the batch is full."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    it = iter(items)
    limit = batch_size if max_failures is None else max_failures
    failures = 0
    drawn = 0

    def draw() -> tuple[int, T] | None:
        nonlocal drawn
        try:
            item = next(it)
        except StopIteration:
            return None
        drawn += 1
        return drawn - 1, item

    async def run(index: int, item: T, attempt: int) -> tuple[int, T, int, R | BaseException]:
        try:
            return index, item, attempt, await fn(item)
        except Exception as e:  # noqa: BLE001 - counted and retried below
            return index, item, attempt, e

    pending: set[asyncio.Task] = set()
    for _ in range(batch_size):
        first = draw()
        if first is None:
            break
        pending.add(asyncio.ensure_future(run(*first, 0)))
    done_results: dict[int, R] = {}
    try:
        while pending:
            finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                index, item, attempt, result = task.result()
                if not isinstance(result, BaseException):
                    done_results[index] = result
                    continue
                failures += 1
                logger.warning("async_map_batch: item %d failed (attempt %d): %r", index, attempt + 1, result)
                if failures >= limit:
                    raise result
                if attempt < retries:
                    pending.add(asyncio.ensure_future(run(index, item, attempt + 1)))
                else:
                    nxt = draw()
                    if nxt is not None:
                        pending.add(asyncio.ensure_future(run(*nxt, 0)))
    finally:
        for task in pending:
            task.cancel()
    if len(done_results) < batch_size:
        raise ValueError(f"async_map_batch: the items ran out after {len(done_results)} of {batch_size} results")
    return [done_results[i] for i in sorted(done_results)]
