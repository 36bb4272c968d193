"""Reward graders (math answers, formats, weighted combinations, an LLM judge) and the runner
that scores samples off the event loop with timeouts."""

from areal_lite.rewards.combined import CombinedGrader, RewardFn
from areal_lite.rewards.format import boxed_format_reward, exact_answer_reward, safe_in_thread, think_format_reward
from areal_lite.rewards.judge import LLMJudgeGrader
from areal_lite.rewards.math import MathAnswerGrader, math_answer_reward
from areal_lite.rewards.runner import RewardRunner

__all__ = [
    "CombinedGrader",
    "LLMJudgeGrader",
    "MathAnswerGrader",
    "RewardFn",
    "RewardRunner",
    "boxed_format_reward",
    "exact_answer_reward",
    "math_answer_reward",
    "safe_in_thread",
    "think_format_reward",
]
