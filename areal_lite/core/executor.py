"""The asynchronous rollout runtime shared by every inference engine.

A `WorkflowExecutor` runs workflows (`RolloutWorkflow.arun_episode`) concurrently on an asyncio
event loop in a background thread, admits new rollouts under the staleness bound of docs/design.md
(`areal_lite.core.staleness`) and hands finished trajectories to the trainer (`wait`,
`prepare_batch`). It knows no engine: each episode goes to the ``run_episode`` it was given (a
workflow over the engine in this process, or an `EpisodeWorker`'s child process), and the policy
version reaches it through `set_version`. The `RolloutController` that the training loop holds
owns it. While the trainer waits, a `LoopWatchdog` watches the loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from tensordict import TensorDict

from areal_lite.api.config import InferenceEngineConfig
from areal_lite.api.engine import AcceptFn
from areal_lite.api.errors import RecurringError
from areal_lite.api.workflow import RolloutWorkflow, check_trajectory_layout
from areal_lite.core.loop_watchdog import LoopWatchdog
from areal_lite.core.staleness import StalenessManager, trajectory_staleness
from areal_lite.cpu import check_cores, rollout_client_thread, trainer_waits
from areal_lite.utils.data import concat_padded

logger = logging.getLogger(__name__)

RunEpisode = Callable[[RolloutWorkflow, dict[str, object]], Awaitable[TensorDict | None]]
"""``run_episode(workflow, data)``: one episode, e.g. ``workflow.arun_episode(engine, data)``."""


class WorkflowError(RuntimeError):
    """A workflow (or its ``should_accept``) raised on one input; ``data`` is that input."""

    def __init__(self, data: dict[str, object], cause: BaseException) -> None:
        shown = repr(data)
        if len(shown) > 500:
            shown = shown[:500] + "...}"
        super().__init__(f"rollout workflow failed on input {shown}: {type(cause).__name__}: {cause}")
        self.data = data
        self.cause = cause


class RewardFailure(RecurringError, RuntimeError):
    """Too many episodes of a batch had rewards that are not finite numbers (a failing grader)."""


REWARD_KEYS = ("rewards", "baseline_rewards")
"""Per-trajectory reward keys that must hold finite numbers for an episode to be trained on."""


def rewards_failed(traj: TensorDict) -> bool:
    """Whether any of ``traj``'s rewards (`REWARD_KEYS` it has) is NaN or infinite."""
    return any(key in traj and not bool(torch.isfinite(traj[key]).all()) for key in REWARD_KEYS)


@dataclass
class _Ticket:
    """The tasks of one `rollout_batch` call: outside the pipeline and its staleness accounting."""

    remaining: int
    results: list[tuple[int, TensorDict]] = field(default_factory=list)
    error: WorkflowError | None = None
    reward_failed: int = 0


@dataclass
class _Task:
    seq: int
    data: dict[str, object]
    workflow: RolloutWorkflow
    should_accept: AcceptFn | None
    ticket: _Ticket | None
    version: int = -1
    """Policy version when the task was admitted."""


class WorkflowExecutor:
    """Runs rollout workflows on a background event loop under the staleness bound.

    Two kinds of work share the loop and the concurrency cap: the *pipeline* (`submit`, `wait`,
    `prepare_batch`), which the staleness bound governs, and synchronous batches (`rollout_batch`,
    e.g. evaluation), which are admitted at once and never counted as pipeline trajectories.
    """

    def __init__(self, config: InferenceEngineConfig, run_episode: RunEpisode, version: int = 0) -> None:
        self.config = config
        self._run_episode = run_episode
        """Runs a workflow on one input: here, or elsewhere (`EpisodeWorker.run_episode`)."""
        self._version = version
        """The policy version new rollouts are admitted at (`set_version`)."""
        bs = config.consumer_batch_size
        if config.on_workflow_error not in ("raise", "skip"):
            raise ValueError(f"on_workflow_error must be raise or skip, got {config.on_workflow_error!r}")
        self.max_concurrent = config.max_concurrent_rollouts or bs
        self.staleness = StalenessManager(
            batch_size=bs,
            max_head_offpolicyness=config.max_head_offpolicyness,
            max_concurrent=self.max_concurrent,
            queue_size=config.queue_size or 16 * bs,
        )
        self._cond = threading.Condition()
        self._pending: deque[_Task] = deque()
        self._direct_pending: deque[_Task] = deque()
        self._ready: list[tuple[int, TensorDict]] = []
        self._error: WorkflowError | None = None
        self._running_direct = 0
        self._paused = False
        self._stopping = False
        self._seq = itertools.count()
        self._drawn: dict[int, dict[str, object]] = {}
        """Items `prepare_batch` drew from the dataloader whose trajectories are not consumed yet."""
        self._replay: deque[dict[str, object]] = deque()
        """Items of a recovered run that were in flight at its checkpoint; drawn before new data."""
        self._data_source: Iterable[list[dict[str, object]]] | None = None
        self._data_iter: Iterator[list[dict[str, object]]] | None = None
        self.totals: Counter[str] = Counter()
        """Episodes accepted, consumed, rejected and failed over the whole run (a resumed run
        continues from the checkpoint's counts, `load_state_dict`)."""
        self.staleness_histogram: Counter[int] = Counter()
        """Trajectories consumed by `wait`, keyed by staleness (current version - oldest token version)."""
        self.last_batch_staleness: list[int] = []
        self._reward_window: deque[bool] = deque(maxlen=bs)
        """Whether each of the last ``consumer_batch_size`` finished pipeline episodes had failed rewards."""
        self._since_batch: Counter[str] = Counter()
        """Counts since the last batch was handed out (``reward_failed``)."""
        self.last_batch_counts: dict[str, int] = {}
        """`_since_batch` as it was when the last batch was handed out: per-step counts."""
        self._watchdog = LoopWatchdog(config.loop_stall_timeout, self._cond, __file__)
        """Pings the loop while the trainer waits: a loop blocked by code that does not await stops the run."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._loop_ready = threading.Event()
        self._loop_error: BaseException | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # ----------------------------------------------------------------- lifecycle

    def initialize(self) -> None:
        """Start the background thread and its event loop."""
        if self._thread is not None:
            return
        check_cores(self.config.client_cores, "rollout.client_cores")
        self._thread = threading.Thread(target=self._thread_main, name="rollout-executor", daemon=True)
        self._thread.start()
        self._loop_ready.wait()
        if self._loop_error is not None:
            raise RuntimeError("the rollout executor's event loop failed to start") from self._loop_error

    def destroy(self) -> None:
        """Cancel running rollouts and stop the thread."""
        if self._thread is None:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._wake_loop()
        self._thread.join(timeout=30)
        self._thread = None

    # ----------------------------------------------------------------- public API

    def submit(self, data: dict[str, object], workflow: RolloutWorkflow, should_accept: AcceptFn | None = None) -> None:
        """Queue one pipeline rollout; it starts when the staleness bound admits it."""
        self._submit(data, workflow, should_accept, drawn=False)

    def _submit(
        self, data: dict[str, object], workflow: RolloutWorkflow, should_accept: AcceptFn | None, drawn: bool
    ) -> None:
        self._check_alive()
        with self._cond:
            task = _Task(next(self._seq), data, workflow, should_accept, ticket=None)
            if drawn:
                self._drawn[task.seq] = data
            self._pending.append(task)
        self._wake_loop()

    def state_dict(self) -> dict[str, object]:
        """What a recover checkpoint needs besides the dataloader's position: the items
        `prepare_batch` drew whose trajectories were not consumed yet (queued, running or ready),
        and the run's counters. With rollouts running ahead of training (eta > 0) the items would
        otherwise be lost in a crash; `load_state_dict` replays them, so every item is consumed
        exactly once. Their episodes run again, so the accepted count saved is the consumed one."""
        with self._cond:
            totals = self.totals.copy()
            totals["accepted"] = totals["consumed"]
            return {
                "unconsumed": list(self._replay) + [self._drawn[k] for k in sorted(self._drawn)],
                "totals": dict(totals),
            }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Replay the unconsumed items of a checkpoint before drawing from the dataloader again,
        and continue its counters."""
        with self._cond:
            self._replay.extend(state.get("unconsumed", []))  # type: ignore[arg-type]
            self.totals = Counter(state.get("totals", {}))  # type: ignore[arg-type]

    def set_version(self, version: int) -> None:
        """The policy version is now ``version``: admission under the staleness bound moves on."""
        with self._cond:
            self._version = version
            self._cond.notify_all()
        self._wake_loop()

    def wait(self, count: int, timeout: float | None = None) -> TensorDict:
        """Block until ``count`` accepted pipeline trajectories are ready and return them padded and
        concatenated, oldest submission first. Raises TimeoutError after ``timeout`` seconds and
        `WorkflowError` when a workflow failed (``on_workflow_error=raise``)."""
        if not 1 <= count <= self.staleness.queue_size:
            raise ValueError(f"wait needs 1 <= count <= queue_size ({self.staleness.queue_size}), got {count}")
        deadline = None if timeout is None else time.monotonic() + timeout
        self._wake_loop()
        with self._cond:
            while True:
                self._raise_if_broken()
                if len(self._ready) >= count:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(
                        f"wait({count}) timed out after {timeout}s: {len(self._ready)} ready, "
                        f"{self.staleness.running} running, {len(self._pending)} queued, paused={self._paused}"
                    )
                self._wait_locked(f"{count} trajectories", left)
            taken = self._ready[:count]
            del self._ready[:count]
            for seq, _ in taken:
                self._drawn.pop(seq, None)
        self._wake_loop()
        return self._consume(taken)

    def rollout_batch(
        self, data: list[dict[str, object]], workflow: RolloutWorkflow, should_accept: AcceptFn | None = None
    ) -> TensorDict:
        """Run ``workflow`` on every item of ``data`` now (outside the staleness accounting) and
        return the accepted trajectories in the order of ``data``."""
        if not data:
            raise ValueError("rollout_batch needs at least one item")
        self._check_alive()
        ticket = _Ticket(remaining=len(data))
        with self._cond:
            for item in data:
                self._direct_pending.append(_Task(next(self._seq), item, workflow, should_accept, ticket))
        self._wake_loop()
        with self._cond:
            while ticket.remaining > 0 and ticket.error is None:
                self._raise_if_broken(pipeline=False)
                self._wait_locked(f"{len(data)} episodes outside the pipeline (e.g. an evaluation)", None)
            if ticket.error is not None:
                raise ticket.error
        if not ticket.results and ticket.reward_failed:
            others = "" if ticket.reward_failed == len(data) else ", and the others were rejected"
            raise RewardFailure(
                f"the rewards of {ticket.reward_failed} of the {len(data)} episodes of a batch outside the pipeline "
                "(e.g. an evaluation) failed (NaN, an error, a timeout or a non-number: the reward function's "
                f"warnings above name them){others}"
            )
        if not ticket.results:
            raise RuntimeError(f"rollout_batch: all {len(data)} trajectories were rejected or failed")
        return concat_padded([t for _, t in sorted(ticket.results, key=lambda r: r[0])])

    def prepare_batch(
        self,
        dataloader: Iterable[list[dict[str, object]]],
        workflow: RolloutWorkflow,
        should_accept: AcceptFn | None = None,
    ) -> TensorDict:
        """Keep the pipeline fed from ``dataloader`` (cycled across epochs) and return the next
        ``consumer_batch_size`` accepted trajectories. Rollouts still running when this returns
        carry over to the next call."""
        bs = self.config.consumer_batch_size
        while True:
            with self._cond:
                self._raise_if_broken()
                # Top up before returning, so the pipeline runs on while the caller trains.
                room = self._capacity_locked()
                need = room - len(self._pending)
                if need <= 0:
                    if len(self._ready) >= bs:
                        break
                    stuck = (
                        room == 0
                        and not self._paused
                        and self.staleness.running == 0
                        and not self._pending
                        and self._running_direct == 0
                    )
                    if stuck:
                        raise RuntimeError(
                            f"the staleness bound admits nothing at version {self._version} with "
                            f"{self.staleness.accepted} trajectories accepted: call set_version(step + 1) after "
                            "each training step (or raise max_head_offpolicyness)"
                        )
                    self._wait_locked(f"{bs} trajectories", None)  # woken by completions, set_version, resume
                    continue
            # Pull outside the lock: a dataloader may be slow (worker processes, disk).
            while need > 0:
                items = [self._replay.popleft()] if self._replay else self._next_items(dataloader)
                for item in items:
                    self._submit(item, workflow, should_accept, drawn=True)
                need -= len(items)
        return self.wait(bs)

    def pause(self) -> None:
        """Stop admitting rollouts (running ones go on; the engine interrupts generation)."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        """Admit rollouts again."""
        with self._cond:
            self._paused = False
            self._cond.notify_all()
        self._wake_loop()

    def stats(self) -> dict[str, float]:
        """Counters for the stats logger: episodes accepted, rejected, failed, in flight, dropped for
        failed rewards (since the previous batch, with their failed samples, and in total), and the
        staleness of the last consumed batch."""
        with self._cond:
            last = self.last_batch_staleness
            return {
                "rollout/accepted": float(self.totals["accepted"]),
                "rollout/consumed": float(self.totals["consumed"]),
                "rollout/rejected": float(self.totals["rejected"]),
                "rollout/failed": float(self.totals["failed"]),
                "rollout/reward_failed": float(self.last_batch_counts.get("reward_failed", 0)),
                "rollout/reward_failed_samples": float(self.last_batch_counts.get("reward_failed_samples", 0)),
                "rollout/reward_failed_total": float(self.totals["reward_failed"]),
                "rollout/running": float(self.staleness.running + self._running_direct),
                "rollout/queued": float(len(self._pending)),
                "rollout/ready": float(len(self._ready)),
                "rollout/staleness_max": float(max(last, default=0)),
                "rollout/staleness_mean": float(sum(last) / len(last)) if last else 0.0,
            }

    # ----------------------------------------------------------------- internals (caller side)

    def _check_alive(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("the rollout executor is not running: call initialize() first")

    def _raise_if_broken(self, pipeline: bool = True) -> None:
        if pipeline and self._error is not None:
            err, self._error = self._error, None
            raise err
        if self._stopping:
            raise RuntimeError("the rollout executor was destroyed")
        if self._loop_error is not None:
            raise RuntimeError("the rollout executor's event loop died") from self._loop_error

    def _wait_locked(self, what: str, timeout: float | None) -> None:
        """One wait on the condition (its lock held), of at most a second. While nothing finishes,
        a line is said every `WAIT_LINE_SECONDS`; a loop that leaves a ping unanswered for
        ``loop_stall_timeout`` seconds is blocked in code that does not await, and the run stops
        with `LoopStalled` naming the function it is blocked in (`LoopWatchdog`)."""
        trainer_waits()  # the engine generates meanwhile: this thread's OpenMP workers go
        quiet = self._watchdog.check(self._loop, self._thread)
        if quiet is not None:
            logger.warning(
                "waiting for %s for %.0fs: %d ready, %d running, %d queued%s; no episode finished since",
                what,
                quiet,
                len(self._ready),
                self.staleness.running + self._running_direct,
                len(self._pending) + len(self._direct_pending),
                ", admission paused" if self._paused else "",
            )
        self._cond.wait(1.0 if timeout is None else min(timeout, 1.0))

    def _capacity_locked(self) -> int:
        if self._paused:
            return 0
        return self.staleness.capacity(self._version, len(self._ready), self._running_direct)

    def _next_items(self, dataloader: Iterable[list[dict[str, object]]]) -> list[dict[str, object]]:
        if self._data_source is not dataloader or self._data_iter is None:
            self._data_source = dataloader
            self._data_iter = iter(dataloader)
        for _ in range(2):
            try:
                items = next(self._data_iter)
            except StopIteration:
                self._data_iter = iter(dataloader)  # next epoch
                continue
            if not isinstance(items, list):
                raise TypeError(
                    f"the dataloader must yield lists of items (use collate_fn=lambda x: x), got {type(items).__name__}"
                )
            return items
        raise ValueError("the dataloader is empty")

    def _consume(self, taken: list[tuple[int, TensorDict]]) -> TensorDict:
        batch = concat_padded([t for _, t in sorted(taken, key=lambda r: r[0])])
        staleness = trajectory_staleness(batch, self._version)
        with self._cond:
            self.totals["consumed"] += len(taken)
            self.staleness_histogram.update(staleness)
            self.last_batch_staleness = staleness
            self.last_batch_counts = dict(self._since_batch)
            self._since_batch.clear()
        return batch

    def _wake_loop(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop closed between the check and the call
                pass

    # ----------------------------------------------------------------- internals (loop side)

    def _thread_main(self) -> None:
        rollout_client_thread(self.config.client_cores)
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        except BaseException as e:
            self._loop_error = e
            logger.exception("rollout executor loop died")
        finally:
            self._loop_ready.set()
            with self._cond:
                self._cond.notify_all()
            loop.close()

    async def _main(self) -> None:
        self._wake = asyncio.Event()
        self._loop_ready.set()
        while not self._stopping:
            self._wake.clear()
            self._admit()
            await self._wake.wait()  # set by submit, completion, set_version, resume, destroy
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _admit(self) -> None:
        with self._cond:
            version = self._version
            if self._paused or self._stopping:
                return
            while self._direct_pending and self.staleness.running + self._running_direct < self.max_concurrent:
                task = self._direct_pending.popleft()
                task.version = version
                self._running_direct += 1
                self._spawn(task)
            room = self.staleness.capacity(version, len(self._ready), self._running_direct)
            for _ in range(min(room, len(self._pending))):
                task = self._pending.popleft()
                task.version = version
                self.staleness.on_admit(version)
                self._spawn(task)

    def _spawn(self, task: _Task) -> None:
        t = asyncio.get_running_loop().create_task(self._run(task))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _run(self, task: _Task) -> None:
        traj: TensorDict | None = None
        error: WorkflowError | None = None
        reward_failed = False
        failed_samples = 0
        try:
            traj = await self._run_episode(task.workflow, task.data)
            if traj is not None:
                check_trajectory_layout(traj, type(task.workflow).__name__)
                reward_failed = rewards_failed(traj)
                if reward_failed:
                    failed_samples = int((~torch.isfinite(traj["rewards"])).sum())
                    traj = None  # never trained on: its advantages would be NaN or made up
            if traj is not None and task.should_accept is not None and not task.should_accept(traj):
                traj = None
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any workflow bug is reported with its input
            error = WorkflowError(task.data, e)
            error.__cause__ = e
            logger.warning("%s", error)
        with self._cond:
            if task.ticket is None:
                self.staleness.on_finish(task.version, accepted=traj is not None)
            else:
                self._running_direct -= 1
                task.ticket.remaining -= 1
            if reward_failed:
                self._count_reward_failure(task, failed_samples)
            elif task.ticket is None and error is None:
                self._reward_window.append(False)
            if error is not None:
                self.totals["failed"] += 1
                if self.config.on_workflow_error == "raise":
                    if task.ticket is None:
                        self._error = self._error or error
                    else:
                        task.ticket.error = task.ticket.error or error
            elif traj is None:
                if not reward_failed:
                    self.totals["rejected"] += 1
            elif task.ticket is None:
                self.totals["accepted"] += 1
                self._ready.append((task.seq, traj))
            else:
                task.ticket.results.append((task.seq, traj))
            if traj is None and (error is None or self.config.on_workflow_error == "skip"):
                self._drawn.pop(task.seq, None)  # used up (rejected or skipped): never replayed
            self._watchdog.episode_finished()
            self._cond.notify_all()
        assert self._wake is not None
        self._wake.set()

    def _count_reward_failure(self, task: _Task, samples: int) -> None:
        """Count an episode dropped for failed rewards, and its ``samples`` that failed (under the
        lock); stop the pipeline when more than ``max_reward_failures`` of the last
        ``consumer_batch_size`` episodes were dropped so."""
        self.totals["reward_failed"] += 1
        if task.ticket is not None:
            task.ticket.reward_failed += 1  # an evaluation: counted; the run stops only if all fail
            return
        self._since_batch["reward_failed"] += 1
        self._since_batch["reward_failed_samples"] += samples
        self._reward_window.append(True)
        failed, window = sum(self._reward_window), self.config.consumer_batch_size
        limit = self.config.max_reward_failures
        if failed > limit * window and limit < 1.0 and self._error is None:
            self._error = RewardFailure(
                f"the rewards of {failed} of the last {len(self._reward_window)} episodes failed (NaN, an error, a "
                f"timeout or a non-number: the reward function's warnings above name them), more than "
                f"rollout.max_reward_failures={limit} of a batch of {window}; stopping"
            )
            logger.error("%s", self._error)
