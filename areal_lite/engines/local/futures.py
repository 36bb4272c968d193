"""Results across threads: how the scheduler's thread runs the commands it is sent between two
steps (`complete`), how the weight loader joins a group or receives a broadcast beside it
(`in_thread`), and how the scheduler thread hands a result or a token to a caller's event loop
(`call_in_loop`)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError


def complete(fut: Future, fn: Callable[[], object]) -> None:
    """Run ``fn`` and put its result, or the exception it raised, into ``fut`` (unless whoever
    waited on it cancelled it meanwhile: ``fn`` has run, and the scheduler thread goes on)."""
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - whoever waits on the future gets it
        with contextlib.suppress(InvalidStateError):
            fut.set_exception(e)
    else:
        with contextlib.suppress(InvalidStateError):
            fut.set_result(result)


def in_thread(fn: Callable[[], None], name: str) -> Future[None]:
    """Run ``fn`` in a new daemon thread; the returned future completes when it returns or raises."""
    fut: Future[None] = Future()
    threading.Thread(target=complete, args=(fut, fn), name=name, daemon=True).start()
    return fut


def set_result_once(fut: asyncio.Future, value: object) -> None:
    """Set ``fut``'s result unless it is done (cancelled by its caller)."""
    if not fut.done():
        fut.set_result(value)


def call_in_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., object], *args: object) -> None:
    """``fn(*args)`` in ``loop``; nothing when the loop is closed (its caller went away, e.g. an
    ``asyncio.run`` that ended on another request's error): the scheduler thread must not die of
    it."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        if not loop.is_closed():
            raise
