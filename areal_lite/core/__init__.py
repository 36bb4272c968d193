"""The asynchronous rollout runtime: `WorkflowExecutor` and its staleness accounting."""

from areal_lite.core.executor import StalenessManager, WorkflowError, WorkflowExecutor, trajectory_staleness

__all__ = ["StalenessManager", "WorkflowError", "WorkflowExecutor", "trajectory_staleness"]
