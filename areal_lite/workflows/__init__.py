"""Rollout workflows, one per file: RLVR (GRPO groups), vision RLVR (prompts with images), ReMax,
multi-turn agents with their environments, and agents written with the OpenAI SDK
(`AgentWorkflow`, through the recording `RecordingProxy`); `episodes` holds what the workflows with
a group of episodes per item share, `trajectory` builds and checks the data contract's tensors."""

from areal_lite.workflows.agent import AgentWorkflow
from areal_lite.workflows.envs import CalculatorEnv, MathFeedbackEnv, calculate
from areal_lite.workflows.multi_turn import ChatTurnGlue, Environment, MultiTurnWorkflow
from areal_lite.workflows.openai_proxy import RecordingProxy
from areal_lite.workflows.remax import ReMaxWorkflow
from areal_lite.workflows.rlvr import RLVRWorkflow, rewards_differ
from areal_lite.workflows.trajectory import TokenTrace, check_trajectory, encode_chat, from_response
from areal_lite.workflows.vision_rlvr import VisionRLVRWorkflow

__all__ = [
    "AgentWorkflow",
    "CalculatorEnv",
    "ChatTurnGlue",
    "Environment",
    "MathFeedbackEnv",
    "MultiTurnWorkflow",
    "RLVRWorkflow",
    "ReMaxWorkflow",
    "RecordingProxy",
    "TokenTrace",
    "VisionRLVRWorkflow",
    "calculate",
    "check_trajectory",
    "encode_chat",
    "from_response",
    "rewards_differ",
]
