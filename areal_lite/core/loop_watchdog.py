"""What the thread that waits for the rollout event loop watches: time passing, and the loop itself.

While the trainer waits for trajectories and no episode finishes, it says so every
`WAIT_LINE_SECONDS`, with what it waits for (`LoopWatchdog.check` says when a line is due).

Code on the `WorkflowExecutor`'s event loop that does not await (a grader in `RewardRunner` mode
``inline``, blocking I/O in a workflow) stops every rollout, and the trainer would wait for
trajectories that never come. While the trainer waits, its thread sends the loop a ping now and
then; a ping left unanswered for ``rollout.loop_stall_timeout`` seconds means the loop is
blocked, and the run stops with `LoopStalled`, naming the function the loop's thread is in.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback

from areal_lite.api.errors import RecurringError

WAIT_LINE_SECONDS = 30.0
"""While the trainer waits for trajectories and none finishes, a line is said this often."""


class LoopStalled(RecurringError, RuntimeError):
    """The rollout event loop did not run for ``rollout.loop_stall_timeout`` seconds."""


class LoopWatchdog:
    """The waiting side's watch over an event loop: how long no episode has finished, and a ping
    to the loop that raises `LoopStalled` once it has gone unanswered for ``timeout`` seconds.

    ``lock`` is the waiting side's lock: `check` and `episode_finished` are called with it held,
    and the loop's answer to a ping takes it. ``skip_file`` is the module whose frames (besides
    asyncio's and this module's) the stall message looks past to name the blocked function: the
    code that runs the loop.
    """

    def __init__(self, timeout: float, lock: threading.Condition, skip_file: str) -> None:
        self.timeout = timeout
        self._lock = lock
        self._skip = {__file__, skip_file}
        self._ping_sent: float | None = None
        """When the waiting thread asked the loop for a sign of life that has not come yet."""
        self._last_finish = 0.0
        """`time.monotonic` when an episode last finished."""
        self._waiting_since: float | None = None
        self._lines_said = 0

    def episode_finished(self) -> None:
        """An episode finished: the quiet time, and the lines said about it, start again."""
        self._last_finish = time.monotonic()
        self._waiting_since, self._lines_said = None, 0

    def check(self, loop: asyncio.AbstractEventLoop | None, thread: threading.Thread | None) -> float | None:
        """Send ``loop`` a ping unless one is on its way, and raise `LoopStalled` (naming where
        ``thread``, the loop's, is) if that one has waited more than ``timeout`` seconds. Returns
        the seconds since an episode last finished (or the wait began) when a line is due, else None."""
        now = time.monotonic()
        if self._ping_sent is None and loop is not None and not loop.is_closed():
            self._ping_sent = now
            try:
                loop.call_soon_threadsafe(self._pong)
            except RuntimeError:  # closed meanwhile
                self._ping_sent = None
        elif self._ping_sent is not None and now - self._ping_sent > self.timeout:
            raise LoopStalled(self._stalled_message(now - self._ping_sent, thread))
        if self._waiting_since is None:
            self._waiting_since = now
        quiet = now - max(self._last_finish, self._waiting_since)
        if quiet < WAIT_LINE_SECONDS * (self._lines_said + 1):
            return None
        self._lines_said += 1
        return quiet

    def _pong(self) -> None:
        with self._lock:
            self._ping_sent = None

    def _stalled_message(self, seconds: float, thread: threading.Thread | None) -> str:
        """Where the loop's thread is: the innermost frame of code not asyncio's nor the loop runner's."""
        where = "an unknown place"
        frame = sys._current_frames().get(thread.ident) if thread is not None and thread.ident is not None else None
        if frame is not None:
            stack = traceback.extract_stack(frame)
            ours = [f for f in stack if "asyncio" not in f.filename and f.filename not in self._skip] or stack
            f = ours[-1]
            where = f"{f.name} ({f.filename}:{f.lineno})"
        return (
            f"the rollout event loop has been blocked for {seconds:.0f}s in {where}: code on the loop that does not "
            "await (a grader in RewardRunner mode 'inline', blocking I/O in a workflow) stops every rollout; "
            f"rollout.loop_stall_timeout={self.timeout:g}"
        )
