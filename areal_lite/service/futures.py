"""Requests in flight: the futures ``retrieve_future`` answers, and each model's request order.

Every training and sampling call returns at once with a request id; the work runs later on the
engine thread and ``retrieve_future`` waits (up to a poll timeout) for its result, answering
``try_again`` meanwhile, then the result, or ``{error, category}`` when it failed.

A training client numbers its requests (``seq_id`` 1, 2, ...) and the server must run them in that
order, whatever order they arrive in: the SDK sends the chunks of one ``forward_backward`` at once,
the first last. `Sequencer` holds a request until every lower number has been handed on, and
returns the first answer again for a number it has seen (a client's retry after a lost response).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Literal

from areal_lite.service.wire import BadRequest

logger = logging.getLogger(__name__)

Category = Literal["user", "server", "unknown"]


class Failed(Exception):
    """A request's error as the client sees it."""

    def __init__(self, message: str, category: Category) -> None:
        super().__init__(message)
        self.category: Category = category


@dataclass
class Pending:
    """One request: its id, its result or error once done, and when it finished."""

    request_id: str
    model_id: str | None = None
    future: asyncio.Future[object] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    finished_at: float | None = None
    sample_sequence_ids: list[str] | None = None

    def finish(self, result: object = None, error: Failed | None = None) -> None:
        if self.future.done():
            return
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(result)
        self.finished_at = time.monotonic()

    def answer(self) -> dict[str, object]:
        """The ``UntypedAPIFuture`` a submitting call returns."""
        out: dict[str, object] = {"request_id": self.request_id}
        if self.model_id is not None:
            out["model_id"] = self.model_id
        if self.sample_sequence_ids is not None:
            out["sample_sequence_ids"] = self.sample_sequence_ids
        return out


class Futures:
    """Every request in flight or recently finished, by id."""

    def __init__(self) -> None:
        self._items: dict[str, Pending] = {}
        self._ids = itertools.count()

    def create(self, model_id: str | None = None) -> Pending:
        pending = Pending(f"req-{next(self._ids)}", model_id)
        self._items[pending.request_id] = pending
        return pending

    def get(self, request_id: str) -> Pending | None:
        return self._items.get(request_id)

    def expire(self, ttl: float) -> None:
        """Forget results finished more than ``ttl`` seconds ago."""
        now = time.monotonic()
        for rid in [r for r, p in self._items.items() if p.finished_at is not None and now - p.finished_at > ttl]:
            del self._items[rid]

    def cancel_all(self, model_ids: set[str], message: str) -> None:
        for p in self._items.values():
            if p.model_id in model_ids:
                p.finish(error=Failed(message, "user"))


class Sequencer:
    """Hands one model's requests on in ``seq_id`` order (1, 2, ...)."""

    def __init__(self, first: int = 1) -> None:
        self.next = first
        self._waiting: dict[int, tuple[Pending, Callable[[], None]]] = {}
        self._seen: dict[int, Pending] = {}

    def submit(self, seq_id: int, pending: Pending, start: Callable[[], None]) -> Pending:
        """Queue ``start`` (which hands the request on) as number ``seq_id``; the request that was
        given this number before, when a client sends it again."""
        if seq_id in self._seen:
            return self._seen[seq_id]
        if seq_id < self.next:
            raise ValueError(f"seq_id {seq_id} was handled already (next expected: {self.next})")
        self._seen[seq_id] = pending
        self._waiting[seq_id] = (pending, start)
        while self.next in self._waiting:
            _, go = self._waiting.pop(self.next)
            self.next += 1
            go()
        # Keep the recent numbers only: a retry comes soon after the original.
        for old in [s for s in self._seen if s < self.next - 1024]:
            del self._seen[old]
        return pending


def launch(engine_thread: Executor, pending: Pending, fn: Callable[[], object]) -> None:
    """Run ``fn`` on the engine thread and settle ``pending`` with what it returns or raises: a
    `BadRequest` is the client's error, anything else the server's (logged)."""

    async def go() -> None:
        try:
            result = await asyncio.get_running_loop().run_in_executor(engine_thread, fn)
        except BadRequest as e:
            pending.finish(error=Failed(str(e), "user"))
        except Exception as e:  # noqa: BLE001 - a failure of ours: keep serving the other requests
            logger.error("request %s failed:\n%s", pending.request_id, traceback.format_exc())
            pending.finish(error=Failed(f"{type(e).__name__}: {e}", "server"))
        else:
            pending.finish(result)

    asyncio.get_running_loop().create_task(go())
