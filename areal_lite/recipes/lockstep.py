"""`EngineThread`: the one thread of a process that runs every engine operation of the recipe API,
packing concurrent requests and keeping the ranks of a torchrun job in step.

Recipes are async programs: many coroutines ask the models for log-probabilities at once, and
every rank of a job runs the same program on its own share of the data. Engine operations are
collectives (FSDP gathers parameters, the loss is normalised over ranks), so every rank must run
the same operations in the same order, and a rank's coroutines decide when they ask. Two kinds of
operation cover what the models need:

- a *packed* operation (a forward pass, a weight sync) gathers every request of its key that is
  pending on this rank into one call of the key's handler. When any rank has such requests, all
  ranks run the handler, those with none on an empty list (the handler then takes part in the
  collectives with a placeholder);
- a *call* (an optimizer step, a save, a clone) runs once each rank has asked for it; ranks that
  ask for different calls get an error that names both.

Each round the ranks exchange (over a gloo group of their own) which keys they have pending and
which call is next, and all take the same decision: the smallest packed key pending anywhere,
else the call every rank is waiting at. A rank's requests run in the order it made them: a packed
request made after a call waits until that call has run. With one rank no message is exchanged;
requests are still gathered for ``settle_s`` after the last one arrives, so that the requests of
one ``async_map`` land in one batch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import torch.distributed as dist

logger = logging.getLogger(__name__)

PackHandler = Callable[[list[object]], list[object]]
"""``handler(items) -> results``, one result per item; called with ``[]`` on a rank that has no
request when another rank has some (it must still take part in the collectives)."""

_CLOSE = "\x00close"
_IDLE_MIN_S = 0.001
_IDLE_MAX_S = 0.02
_WAIT_WARN_S = 120.0


@dataclass
class _Request:
    key: str
    future: Future
    item: object = None
    fn: Callable[[], object] | None = None
    """Set for calls; None for packed requests."""
    submitted: float = field(default_factory=time.monotonic)


class EngineThread:
    """Runs packed requests and calls on one daemon thread (see the module docstring)."""

    def __init__(self, settle_s: float = 0.002, max_gather_s: float = 0.05) -> None:
        self.settle_s = settle_s
        self.max_gather_s = max_gather_s
        self._cond = threading.Condition()
        self._requests: list[_Request] = []
        self._handlers: dict[str, PackHandler] = {}
        self._group: dist.ProcessGroup | None = None
        self._world = 1
        self._thread: threading.Thread | None = None
        self.rounds = 0
        """Exchanges made with the other ranks (0 with one rank): for tests and benchmarks."""

    def start(self) -> None:
        """Start the thread. Under several ranks this is collective (it creates a gloo group):
        every rank starts its thread at the same point, after the default group exists."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._world = dist.get_world_size()
            self._group = dist.new_group(backend="gloo")
        self._thread = threading.Thread(target=self._loop, name="recipe-engine", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def register(self, key: str, handler: PackHandler) -> None:
        """Declare a packed operation; every rank registers the same keys before using them."""
        with self._cond:
            if key in self._handlers:
                raise ValueError(f"a packed operation {key!r} is already registered (two models with one name?)")
            self._handlers[key] = handler

    def unregister(self, key: str) -> None:
        """Forget a packed operation (its model was closed)."""
        with self._cond:
            self._handlers.pop(key, None)

    def pack(self, key: str, item: object) -> Future:
        """Request ``item`` be processed by ``key``'s handler, with every other pending request of that key."""
        if key not in self._handlers:
            raise KeyError(f"no packed operation {key!r}")
        return self._submit(_Request(key, Future(), item=item))

    def call(self, key: str, fn: Callable[[], object]) -> Future:
        """Run ``fn()`` on the engine thread once every rank has called ``key``."""
        return self._submit(_Request(key, Future(), fn=fn))

    def close(self) -> None:
        """Stop the thread once every rank has asked to (collective under several ranks)."""
        if self._thread is None:
            return
        self.call(_CLOSE, lambda: None).result()
        self._thread.join()
        self._thread = None
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None

    def _submit(self, request: _Request) -> Future:
        if not self.running:
            raise RuntimeError("the engine thread is not running (models closed?)")
        with self._cond:
            self._requests.append(request)
            self._cond.notify()
        return request.future

    # ---------------------------------------------------------------- the thread

    def _runnable(self) -> tuple[dict[str, int], _Request | None]:
        """Packed keys pending before this rank's first call (with counts), and that call."""
        counts: dict[str, int] = {}
        for r in self._requests:
            if r.fn is not None:
                return counts, r
            counts[r.key] = counts.get(r.key, 0) + 1
        return counts, None

    def _gather(self, idle_s: float) -> None:
        """Wait for requests: until one arrives (one rank) or at most ``idle_s`` (several ranks,
        which must keep exchanging); then while more keep arriving, for up to ``max_gather_s``."""
        with self._cond:
            if not self._requests:
                self._cond.wait(None if self._world == 1 else idle_s)
            if not self._requests:
                return
            deadline = time.monotonic() + self.max_gather_s
            while time.monotonic() < deadline:
                n = len(self._requests)
                self._cond.wait(self.settle_s)
                if len(self._requests) == n:
                    return

    def _loop(self) -> None:
        idle_s = _IDLE_MIN_S
        warned = False
        while True:
            self._gather(idle_s)
            with self._cond:
                counts, call = self._runnable()
            mine = (sorted(counts), None if call is None else call.key)
            views = [mine]
            if self._world > 1:
                views = [None] * self._world
                dist.all_gather_object(views, mine, group=self._group)
                self.rounds += 1
            packed = sorted({k for v in views for k in v[0]})
            heads = [v[1] for v in views]
            if packed:
                self._run_packed(packed[0])
            elif all(h is not None for h in heads) and len(set(heads)) == 1:
                assert call is not None
                self._run_call(call)
                if call.key == _CLOSE:
                    return
            elif all(h is not None for h in heads):
                assert call is not None
                self._remove(call)
                asked = ", ".join(f"rank {i}: {h!r}" for i, h in enumerate(heads))
                _settle(
                    call.future,
                    error=RuntimeError(
                        f"the ranks asked for different collective operations ({asked}); every rank must "
                        "call optim_step, save, clone_inf and close in the same order"
                    ),
                )
            else:
                if call is not None and not warned and time.monotonic() - call.submitted > _WAIT_WARN_S:
                    waiting = [i for i, h in enumerate(heads) if h is None]
                    logger.warning("%r has waited %.0f s for ranks %s to call it too", call.key, _WAIT_WARN_S, waiting)
                    warned = True
                idle_s = min(idle_s * 2, _IDLE_MAX_S)
                continue
            idle_s, warned = _IDLE_MIN_S, False

    def _remove(self, request: _Request) -> None:
        with self._cond:
            self._requests.remove(request)

    def _run_call(self, call: _Request) -> None:
        self._remove(call)
        try:
            result = call.fn()  # type: ignore[misc]
        except BaseException as e:  # noqa: BLE001 - the caller gets it
            _settle(call.future, error=e)
        else:
            _settle(call.future, result)

    def _run_packed(self, key: str) -> None:
        with self._cond:
            taken = []
            for r in self._requests:
                if r.fn is not None:
                    break
                if r.key == key:
                    taken.append(r)
            for r in taken:
                self._requests.remove(r)
        try:
            results = self._handlers[key]([r.item for r in taken])
            if len(results) != len(taken):
                raise RuntimeError(f"{key}: {len(results)} results for {len(taken)} requests")
        except BaseException as e:
            if not taken:  # nobody on this rank waits for it: say so, or it would go unseen
                logger.exception("%s failed on a rank that joined it for the others", key)
            for r in taken:
                _settle(r.future, error=e)
            return
        for r, result in zip(taken, results):
            _settle(r.future, result)


def _settle(future: Future, result: object = None, error: BaseException | None = None) -> None:
    """Complete ``future``, unless its caller cancelled it meanwhile (an asyncio timeout, a failed
    task group): the call still ran, in step with the other ranks; nobody wants its result."""
    with contextlib.suppress(InvalidStateError):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


_THREAD: EngineThread | None = None


def engine_thread() -> EngineThread:
    """This process's engine thread, started on first use (collective under several ranks: the
    first model spawn of every rank starts it)."""
    global _THREAD
    if _THREAD is None or not _THREAD.running:
        _THREAD = EngineThread()
        _THREAD.start()
    return _THREAD


def close_engine_thread() -> None:
    """Stop this process's engine thread (collective under several ranks)."""
    global _THREAD
    if _THREAD is not None:
        _THREAD.close()
        _THREAD = None
