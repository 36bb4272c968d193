"""Running reward functions off the event loop with a timeout, surviving graders that misbehave.

A grader is ``fn(prompt, completion, prompt_ids, completion_ids, **data) -> float`` (or a
`CombinedGrader`, whose components are reported by name, or a coroutine function such as the LLM
judge). `RewardRunner` awaits it in one of four ways:

- ``process``: a small pool of worker processes (forkserver start: no copy of the parent's threads
  or model; a replacement starts fast). A call that times out kills its worker and starts a new
  one, so a grader stuck in C code (a sympy simplification) cannot leak.
- ``thread``: a thread pool; no start-up or pickling cost, but a timed-out call can only be
  abandoned (its thread runs on). For graders marked ``safe_in_thread`` (regular expressions).
- ``async``: coroutine graders, awaited on the caller's event loop under ``asyncio.wait_for``.
- ``inline``: plain graders called directly on the caller's event loop. For graders that take
  microseconds (an exact string comparison), where handing each sample to a thread costs more than
  the grading (the hand-offs compete with training for the interpreter lock). Nothing can interrupt a call on the
  loop's own thread (a grader blocked in C code ignores even an asynchronous exception), so
  ``timeout`` does not apply; the rollout executor bounds it instead: a loop blocked for longer than
  ``rollout.loop_stall_timeout`` stops the run, naming the function it is blocked in.

``auto`` (the default) picks ``async`` for coroutine graders, ``thread`` for graders marked
``safe_in_thread`` and ``process`` for everything else. Whatever the mode, a sample whose grader
raises, times out, kills its worker, or returns NaN, an infinity or something that is not a number
(a string, None) has no score: the runner returns NaN for it, counts it in `stats` by kind and
logs the first few of each kind with their error. The rollout executor drops an episode with a NaN
reward (never trained on) and stops the run when too many do (``rollout.max_reward_failures``).

A grader that times out (or kills its worker) on ``2 * num_workers`` calls in a row, with no
call that ended between them, is taken for hung: calls then fail at once without running
(``skipped``), but for one call every ``timeout`` seconds, which is run to see whether the grader
works again (it does once a call ends). A grader that hangs on every sample then fails a batch
in seconds, not in (samples / workers) timeouts, and the run stops promptly instead of stalling.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from functools import partial
from typing import Literal

logger = logging.getLogger(__name__)

RunnerMode = Literal["auto", "process", "thread", "async", "inline"]
_Outcome = tuple[str, object]
"""``(status, value)``: status ``ok`` (value: float or dict of named floats), ``error`` (value: a
message), ``timeout``, ``crash`` or ``skipped`` (not run: the grader was taken for hung)."""
_KINDS = {"error": "errors", "timeout": "timeouts", "crash": "crashes", "skipped": "skipped"}

_MAX_LOGGED_PER_KIND = 5
_STARTUP_TIMEOUT_S = 300.0
"""A worker's start (imports, unpickling the grader) is not the grader's time: it gets this long."""


def as_score(value: object) -> float:
    """A grader's return value as a float; TypeError for what is not a number (a string, None)
    rather than ``float("0.5")`` guessing."""
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"a grader returns a number, got {type(value).__name__} {value!r:.40}")
    return float(value)  # type: ignore[arg-type]


def _invoke(fn: Callable[..., object], kwargs: dict[str, object]) -> float | dict[str, float]:
    named = getattr(fn, "named_scores", None)
    if named is not None:
        return {k: as_score(v) for k, v in named(**kwargs).items()}
    return as_score(fn(**kwargs))


def _worker_main(conn: multiprocessing.connection.Connection, fn: Callable[..., object]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    conn.send(("ready", None))
    while True:
        try:
            kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            out: _Outcome = ("ok", _invoke(fn, kwargs))
        except BaseException as e:  # noqa: BLE001 - anything a grader raises is reported, not fatal
            out = ("error", f"{type(e).__name__}: {e}")
        conn.send(out)


class _Worker:
    def __init__(self, ctx: multiprocessing.context.BaseContext, fn: Callable[..., object]) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, fn), daemon=True, name="reward-worker")
        self.proc.start()
        child.close()

    def wait_ready(self) -> None:
        if not self.conn.poll(_STARTUP_TIMEOUT_S):
            self.kill()
            raise RuntimeError(f"a reward worker did not start within {_STARTUP_TIMEOUT_S}s")
        try:
            self.conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"a reward worker died while starting (exit code {self.proc.exitcode})") from None

    def call(self, kwargs: dict[str, object], timeout: float) -> _Outcome:
        try:
            self.conn.send(kwargs)
        except (BrokenPipeError, ConnectionError, EOFError):
            return ("crash", "worker gone before the call")
        except Exception as e:  # noqa: BLE001 - e.g. unpicklable data; the worker is untouched
            return ("error", f"cannot send the sample to a worker: {type(e).__name__}: {e}")
        if not self.conn.poll(timeout):
            return ("timeout", None)
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            return ("crash", f"worker died (exit code {self.proc.exitcode})")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join()
        self.conn.close()


class DaemonThreads(Executor):
    """A pool of daemon threads. `ThreadPoolExecutor` joins its threads when the interpreter exits,
    so a thread left running a grader that hangs would keep a finished (or failed) run from ever
    exiting."""

    def __init__(self, n: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future, Callable[[], object]] | None] = queue.SimpleQueue()
        self._n = n
        for i in range(n):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn: Callable[..., object], /, *args: object, **kwargs: object) -> Future:
        future: Future = Future()
        self._jobs.put((future, partial(fn, *args, **kwargs)))
        return future

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, call = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                future.set_exception(e)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if cancel_futures:
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[0].cancel()
        for _ in range(self._n):
            self._jobs.put(None)


def is_coroutine_grader(fn: object) -> bool:
    """A coroutine function, or an object whose ``__call__`` is one (`LLMJudgeGrader`)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


class RewardRunner:
    """Awaitable wrapper of a grader: ``await runner(prompt, completion, prompt_ids, completion_ids, **data)``.

    Args:
        fn: the grader (picklable for ``process`` mode: a module-level function or a
            `CombinedGrader` of them).
        mode: ``auto``, ``process``, ``thread``, ``async`` or ``inline`` (see the module docstring).
        timeout: seconds one sample may take before it is given up (no score: NaN).
        num_workers: worker processes (``process``) or threads (``thread``); default
            ``min(4, cpu count)``.
    """

    def __init__(
        self,
        fn: Callable[..., object],
        *,
        mode: RunnerMode = "auto",
        timeout: float = 15.0,
        num_workers: int | None = None,
    ) -> None:
        is_async = is_coroutine_grader(fn) or getattr(fn, "is_async", False)
        if mode == "auto":
            mode = "async" if is_async else ("thread" if getattr(fn, "safe_in_thread", False) else "process")
        if mode not in ("process", "thread", "async", "inline"):
            raise ValueError(f"mode must be auto, process, thread, async or inline, got {mode!r}")
        if (mode == "async") != is_async:
            raise ValueError(f"mode {mode!r} does not fit {'a coroutine' if is_async else 'a plain'} grader {fn!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        self.fn = fn
        self.mode = mode
        self.timeout = timeout
        self.num_workers = num_workers or min(4, os.cpu_count() or 1)
        self._threads: ThreadPoolExecutor | None = None
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._workers_started = False
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._sums: defaultdict[str, float] = defaultdict(float)
        self._ns: Counter[str] = Counter()
        self._stuck_in_a_row = 0
        """Calls that timed out or crashed since the last one that ended (ok or error)."""
        self._next_probe = 0.0
        """While the grader seems hung: when (`time.monotonic`) one call may run again."""
        self._probing = False

    def __getstate__(self) -> dict[str, object]:
        """A copy (in another process: ``rollout.episode_process``) gets the grader and settings,
        and starts its own workers and counts."""
        return {"fn": self.fn, "mode": self.mode, "timeout": self.timeout, "num_workers": self.num_workers}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(state["fn"], mode=state["mode"], timeout=state["timeout"], num_workers=state["num_workers"])  # type: ignore[misc,arg-type]

    async def __call__(
        self, prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **data: object
    ) -> float:
        return self._record(await self.outcome(prompt, completion, prompt_ids, completion_ids, **data))

    async def outcome(
        self, prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **data: object
    ) -> _Outcome:
        """One sample's ``(status, value)``, not recorded in `stats`: status ``ok`` (value: the
        score, or a `CombinedGrader`'s named scores), ``error``, ``timeout`` or ``crash``."""
        kwargs = dict(data, prompt=prompt, completion=completion, prompt_ids=prompt_ids, completion_ids=completion_ids)
        if self.mode != "process" and not self._may_run():
            outcome = self._skipped()
        elif self.mode == "async":
            outcome = await self._call_async(kwargs)
        elif self.mode == "inline":
            try:
                outcome = ("ok", _invoke(self.fn, kwargs))
            except Exception as e:  # noqa: BLE001
                outcome = ("error", f"{type(e).__name__}: {e}")
        else:
            loop = asyncio.get_running_loop()
            if self.mode == "process":
                outcome = await loop.run_in_executor(self._pool(), self._call_in_worker, kwargs)
            else:
                try:
                    value = await asyncio.wait_for(
                        loop.run_in_executor(self._pool(), partial(_invoke, self.fn, kwargs)), self.timeout
                    )
                    outcome = ("ok", value)
                except asyncio.TimeoutError:
                    outcome = ("timeout", None)
                except Exception as e:  # noqa: BLE001
                    outcome = ("error", f"{type(e).__name__}: {e}")
        if self.mode != "process":  # a worker's call is noted by its thread, before the restart
            self._note(outcome)
        return outcome

    def stats(self, reset: bool = False) -> dict[str, float]:
        """``reward/<name>`` means (``total`` and each `CombinedGrader` component) over the samples
        scored, and counts: ``reward/samples``, ``reward/errors`` (raised, or returned a
        non-number), ``reward/timeouts``, ``reward/crashes``, ``reward/nonfinite``,
        ``reward/skipped`` (not run: the grader was taken for hung). ``reset`` starts a new window."""
        with self._lock:
            out = {f"reward/{k}": self._sums[k] / n for k, n in self._ns.items() if n}
            for kind in ("samples", "errors", "timeouts", "crashes", "nonfinite", "skipped"):
                out[f"reward/{kind}"] = float(self._counts[kind])
            if reset:
                self._counts.clear()
                self._sums.clear()
                self._ns.clear()
        return out

    def close(self) -> None:
        """Stop the worker processes and threads (and those of a combination's graders)."""
        if callable(getattr(self.fn, "close", None)) and getattr(self.fn, "is_async", False):
            self.fn.close()  # type: ignore[attr-defined]
        with self._lock:
            while True:
                try:
                    self._idle.get_nowait().kill()
                except queue.Empty:
                    break
            self._workers_started = False
            if self._threads is not None:
                self._threads.shutdown(wait=False, cancel_futures=True)
                self._threads = None

    # ------------------------------------------------------------------ internals

    def _pool(self) -> Executor:
        with self._lock:
            if self._threads is None:
                # process mode: threads that each wait on a worker (they never hang); thread mode:
                # daemon threads, so that one left running a hung grader cannot hold the exit up.
                if self.mode == "process":
                    self._threads = ThreadPoolExecutor(self.num_workers, thread_name_prefix="reward-process")
                else:
                    self._threads = DaemonThreads(self.num_workers, "reward-thread")
            return self._threads

    def _call_in_worker(self, kwargs: dict[str, object]) -> _Outcome:
        """Runs in one of ``num_workers`` threads, each holding at most one of as many workers."""
        if not self._may_run():  # before waiting for a worker: skipped calls never queue
            return self._skipped()
        with self._lock:
            if not self._workers_started:
                ctx = multiprocessing.get_context("forkserver")
                # The fork server imports these once, so that a worker replacing a killed one
                # starts in milliseconds, not in the seconds its imports take (no effect if the
                # fork server of this process is running already).
                module = getattr(self.fn, "__module__", None) or type(self.fn).__module__
                ctx.set_forkserver_preload([__name__] + ([module] if module != "__main__" else []))
                workers = [_Worker(ctx, self.fn) for _ in range(self.num_workers)]
                for w in workers:  # they start in parallel; each waits for its imports
                    w.wait_ready()
                    self._idle.put(w)
                self._workers_started = True
        worker = self._idle.get()
        outcome = worker.call(kwargs, self.timeout)
        self._note(outcome)
        if outcome[0] in ("timeout", "crash"):
            worker.kill()
            worker = _Worker(multiprocessing.get_context("forkserver"), self.fn)
            worker.wait_ready()
        self._idle.put(worker)
        return outcome

    def _limit(self) -> int:
        return 2 * self.num_workers

    def _may_run(self) -> bool:
        """Whether a call may run now: always, unless the grader seems hung (then one call every
        ``timeout`` seconds)."""
        with self._lock:
            if self._stuck_in_a_row < self._limit():
                return True
            if self._probing or time.monotonic() < self._next_probe:
                return False
            self._probing = True
            return True

    def _skipped(self) -> _Outcome:
        return ("skipped", f"not run: the grader timed out or crashed on {self._stuck_in_a_row} calls in a row")

    def _note(self, outcome: _Outcome) -> None:
        """Count calls that timed out or crashed in a row (see the module docstring)."""
        status = outcome[0]
        if status == "skipped":
            return
        with self._lock:
            probe, self._probing = self._probing, False
            if status not in ("timeout", "crash"):
                self._stuck_in_a_row = 0
                return
            self._stuck_in_a_row += 1
            if self._stuck_in_a_row >= self._limit():
                self._next_probe = time.monotonic() + self.timeout
            if self._stuck_in_a_row == self._limit() and not probe:
                logger.warning(
                    "reward grader %r timed out or crashed on %d calls in a row: it seems hung; calls fail at once "
                    "(trying one every %gs)",
                    self.fn,
                    self._stuck_in_a_row,
                    self.timeout,
                )

    async def _call_async(self, kwargs: dict[str, object]) -> _Outcome:
        try:
            if getattr(self.fn, "is_async", False):  # a CombinedGrader holding a coroutine grader
                named = await asyncio.wait_for(self.fn.anamed_scores(timeout=self.timeout, **kwargs), self.timeout)  # type: ignore[attr-defined]
                return ("ok", {k: float(v) for k, v in named.items()})
            value = await asyncio.wait_for(self.fn(**kwargs), self.timeout)  # type: ignore[misc]
            return ("ok", float(value))
        except asyncio.TimeoutError:
            return ("timeout", None)
        except Exception as e:  # noqa: BLE001
            return ("error", f"{type(e).__name__}: {e}")

    def _record(self, outcome: _Outcome) -> float:
        status, value = outcome
        kind = _KINDS.get(status)
        scores: dict[str, float] = {}
        if status == "ok":
            scores = dict(value) if isinstance(value, dict) else {"total": float(value)}  # type: ignore[arg-type]
            if not math.isfinite(scores.get("total", math.nan)):
                kind, scores = "nonfinite", {}
        with self._lock:
            self._counts["samples"] += 1
            if kind is not None:
                self._counts[kind] += 1
                if self._counts[kind] <= _MAX_LOGGED_PER_KIND:
                    logger.warning("reward grader %r: %s (%s); the sample has no score (NaN)", self.fn, kind, value)
            for name, v in scores.items():
                if math.isfinite(v):
                    self._sums[name] += v
                    self._ns[name] += 1
        return scores.get("total", math.nan)
