"""The staleness bound of asynchronous RL: which rollouts may start, and how stale a batch is.

Staleness bound (eta = ``max_head_offpolicyness``, B = ``consumer_batch_size``): at policy version
t a rollout is admitted only while ``accepted + running < (eta + t + 1) * B`` and fewer than
``max_concurrent_rollouts`` run. ``accepted`` counts every accepted trajectory of the run and is
never decremented when consumed. Batches are the accepted trajectories in acceptance order, B at
a time, so batch t is consumed at version t.

Deliberate deviation from AReaL-lite: AReaL evaluates the bound at the *current* version t. A
straggler admitted at an old version v can then end up in a batch later than v + eta (the slots of
later batches fill with rollouts admitted after it). Here t in the bound is the version of the
oldest rollout still running (or the current version if none runs). While a rollout admitted at v
runs, ``accepted + running <= (eta + v + 1) * B``, so at most ``(eta + v + 1) * B - 1`` others are
accepted before it and it lands in a batch <= v + eta: every token of a batch consumed at step t
was produced by a policy of version >= t - eta. Completed rollouts are never dropped for staleness;
the bound only delays admission while a straggler runs.

`StalenessManager` keeps that count for the `WorkflowExecutor` (no threads, no I/O, so the bound
can be property-tested); `trajectory_staleness` measures what a consumed batch holds.
"""

from __future__ import annotations

from collections import Counter

import torch
from tensordict import TensorDict


class StalenessManager:
    """Admission accounting of the pipeline (no threads, no I/O), so the bound can be property-tested.

    ``capacity`` says how many more rollouts may start now; the executor calls ``on_admit`` and
    ``on_finish`` around each pipeline rollout.
    """

    def __init__(self, batch_size: int, max_head_offpolicyness: int, max_concurrent: int, queue_size: int) -> None:
        if batch_size < 1 or max_head_offpolicyness < 0 or max_concurrent < 1 or queue_size < batch_size:
            raise ValueError(
                f"bad staleness settings: batch_size={batch_size} eta={max_head_offpolicyness} "
                f"max_concurrent={max_concurrent} queue_size={queue_size}"
            )
        self.batch_size = batch_size
        self.eta = max_head_offpolicyness
        self.max_concurrent = max_concurrent
        self.queue_size = queue_size
        self.accepted = 0
        """Accepted trajectories so far (plus the baseline of a run resumed at version > 0)."""
        self.running = 0
        self._running_versions: Counter[int] = Counter()
        self._started = False

    def oldest_running_version(self, version: int) -> int:
        return min(self._running_versions, default=version)

    def capacity(self, version: int, ready: int, running_other: int = 0) -> int:
        """Rollouts that may start now at ``version``, with ``ready`` accepted trajectories not yet
        consumed and ``running_other`` rollouts outside the pipeline sharing the concurrency cap."""
        accepted = self.accepted if self._started else version * self.batch_size
        v = min(version, self.oldest_running_version(version))
        by_staleness = (self.eta + v + 1) * self.batch_size - (accepted + self.running)
        by_concurrency = self.max_concurrent - self.running - running_other
        by_queue = self.queue_size - ready - self.running
        return max(0, min(by_staleness, by_concurrency, by_queue))

    def on_admit(self, version: int) -> None:
        if not self._started:
            # A run resumed at version t has consumed t batches that this process never counted.
            self.accepted = version * self.batch_size
            self._started = True
        self.running += 1
        self._running_versions[version] += 1

    def on_finish(self, admitted_version: int, accepted: bool) -> None:
        self.running -= 1
        self._running_versions[admitted_version] -= 1
        if self._running_versions[admitted_version] == 0:
            del self._running_versions[admitted_version]
        if accepted:
            self.accepted += 1


def trajectory_staleness(traj: TensorDict, version: int) -> list[int]:
    """``version`` minus the oldest version among the generated tokens (``loss_mask`` 1) of each
    row; rows without generated tokens are skipped. Padding carries version 0 and is not counted."""
    versions = traj["versions"]
    produced = traj["loss_mask"].bool() & (versions >= 0)
    oldest = torch.where(produced, versions, torch.iinfo(versions.dtype).max).amin(dim=1)
    return (version - oldest[produced.any(dim=1)]).tolist()
