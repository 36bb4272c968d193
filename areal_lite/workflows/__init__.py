"""Rollout workflows, one per file: RLVR (GRPO groups), ReMax, and multi-turn agents with their
environments; `trajectory` builds and checks the data contract's tensors."""

from areal_lite.workflows.envs import CalculatorEnv, MathFeedbackEnv, calculate
from areal_lite.workflows.multi_turn import ChatTurnGlue, Environment, MultiTurnWorkflow
from areal_lite.workflows.remax import ReMaxWorkflow
from areal_lite.workflows.rlvr import RLVRWorkflow, rewards_differ
from areal_lite.workflows.trajectory import TokenTrace, check_trajectory, encode_chat, from_response

__all__ = [
    "CalculatorEnv",
    "ChatTurnGlue",
    "Environment",
    "MathFeedbackEnv",
    "MultiTurnWorkflow",
    "RLVRWorkflow",
    "ReMaxWorkflow",
    "TokenTrace",
    "calculate",
    "check_trajectory",
    "encode_chat",
    "from_response",
    "rewards_differ",
]
