"""The asynchronous rollout runtime: the `RolloutController` a training loop holds, and the
`WorkflowExecutor` with its staleness accounting that it drives."""

from areal_lite.core.controller import RolloutController
from areal_lite.core.executor import StalenessManager, WorkflowError, WorkflowExecutor, trajectory_staleness

__all__ = ["RolloutController", "StalenessManager", "WorkflowError", "WorkflowExecutor", "trajectory_staleness"]
