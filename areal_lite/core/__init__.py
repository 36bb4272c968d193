"""The asynchronous rollout runtime: the `RolloutController` a training loop holds, and the
`WorkflowExecutor` with its staleness accounting that it drives, and the record and replay of the
batches it hands out."""

from areal_lite.core.controller import RolloutController
from areal_lite.core.executor import WorkflowError, WorkflowExecutor
from areal_lite.core.recording import BatchRecorder, BatchReplay
from areal_lite.core.staleness import StalenessManager, trajectory_staleness

__all__ = [
    "BatchRecorder",
    "BatchReplay",
    "RolloutController",
    "StalenessManager",
    "WorkflowError",
    "WorkflowExecutor",
    "trajectory_staleness",
]
