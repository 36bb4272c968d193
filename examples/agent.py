"""Agent RL on CPU: a tiny model learns to use a calculator through OpenAI tool calls.

The agent is ordinary ``openai-agents`` code (an ``Agent`` with one function tool, run by
``Runner``); only its model client is areal-lite's. `AgentWorkflow` hands it an OpenAI client whose
calls go to the rollout engine through the recording proxy, so every model call of an episode
becomes trajectory tokens with their log-probabilities and versions, and the episode's reward is
whether the agent's final answer is right.

The task: ``What is 37*48?``. A model this small cannot multiply, but it can copy the expression
into a calculator call and the tool's result into its answer. A short SFT warm-up on demonstrations
(recorded by running the same agent against a scripted policy that answers right) teaches the
format partly, stopping once the dev reward reaches ``task.sft_target_reward``; RL then raises the
reward. The advantage is ``rewards - baseline_rewards`` (``adv_estimator: remax``), where
`AgentWorkflow` sets the baseline to the mean reward of the question's episodes: Dr. GRPO over
episodes, however many trajectories each one made.

    python -m areal_lite.launcher.local examples/agent.py --config configs/agent.yaml
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import agents
from tensordict import TensorDict

from areal_lite import kit
from areal_lite.actors.ppo import PPOActor
from areal_lite.api.experiment_config import RLExperimentConfig
from areal_lite.rewards import RewardRunner, exact_answer_reward
from areal_lite.utils.tiny import build_tiny_model, build_tokenizer
from areal_lite.workflows import AgentWorkflow, TokenTrace, calculate
from areal_lite.workflows.agent import episode_means, record_demonstration

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class TaskConfig(kit.RewardWarmUpConfig):
    """The calculator task (its items are questions) and the SFT warm-up."""

    n_digits: int = 2
    """Digits of each factor."""
    n_train: int = 4096
    """Training questions (two digits give 8100 in all, the held-out ones excluded)."""
    sft_pool: int = 512
    """Demonstrations recorded before SFT, shared among the ranks; each step samples its rank's share."""


@dataclass
class AgentExperimentConfig(RLExperimentConfig):
    """``gconfig`` is the sampling of each model call; ``actor.group_size`` is the number of episodes
    per question."""

    task: TaskConfig = field(default_factory=TaskConfig)


INSTRUCTIONS = "Use the calculator, then answer with its result only."


@agents.function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    return calculate(expression)


async def solve(client: object, item: dict[str, object]) -> str | None:
    """The agent: plain openai-agents code, its model calls going through ``client``."""
    model = agents.OpenAIChatCompletionsModel(model="policy", openai_client=client)  # type: ignore[arg-type]
    agent = agents.Agent(name="solver", instructions=INSTRUCTIONS, tools=[calculator], model=model)
    config = agents.RunConfig(tracing_disabled=True)
    try:
        result = await agents.Runner.run(agent, str(item["question"]), max_turns=3, run_config=config)
    except agents.AgentsException:  # a malformed tool call, too many turns: no answer
        return None
    return str(result.final_output)


def questions(n: int, digits: int, seed: int, exclude: set[str] = frozenset()) -> list[dict[str, object]]:
    """``n`` distinct products of two ``digits``-digit numbers, none of them in ``exclude``."""
    rng, out, seen = random.Random(seed), [], set(exclude)
    if n + len(seen) > (9 * 10 ** (digits - 1)) ** 2:
        raise ValueError(f"only {(9 * 10 ** (digits - 1)) ** 2 - len(seen)} such questions, {n} asked for")
    while len(out) < n:
        a, b = (rng.randrange(10 ** (digits - 1), 10**digits) for _ in range(2))
        if f"{a}*{b}" not in seen:
            seen.add(f"{a}*{b}")
            out.append({"question": f"What is {a}*{b}?", "expression": f"{a}*{b}", "answer": str(a * b)})
    return out


def demonstrations(tokenizer: object, items: list[dict[str, object]]) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) of each item's demonstration: the agent run against a scripted policy
    that calls the calculator right and answers its result."""

    def replies(item: dict[str, object]) -> list[str]:
        args = json.dumps({"expression": item["expression"]})
        return [f'<tool_call>\n{{"name": "calculator", "arguments": {args}}}\n</tool_call>', str(item["answer"])]

    async def record_all() -> list[list[TokenTrace]]:
        return await asyncio.gather(*(record_demonstration(solve, it, replies(it), tokenizer) for it in items))

    return [(t.input_ids, t.loss_mask) for traces in asyncio.run(record_all()) for t in traces]


def warm_up(cfg: AgentExperimentConfig, base_dir: str, sft_dir: str, held_out: set[str]) -> None:
    """Build the tiny model (its tokenizer's merges learnt on a demonstration, digits left out,
    so the boilerplate is short and every digit a token), then SFT on demonstrations sampled from a
    recorded pool until the dev greedy reward reaches ``task.sft_target_reward``."""
    task = cfg.task

    def build() -> None:
        example = build_tokenizer(vocab_size=0)
        [(ids, _)] = demonstrations(example, questions(1, task.n_digits, seed=-1))
        text = "".join(c for c in example.decode(ids) if not c.isdigit())
        build_tiny_model(base_dir, hidden_size=task.hidden_size, num_layers=task.num_layers, corpus=[text],
                         vocab_size=512, max_position_embeddings=512, seed=task.seed)  # fmt: skip

    def batches(tokenizer: PreTrainedTokenizerBase, rank: int, world: int) -> Iterator[TensorDict]:
        pool = questions(task.sft_pool, task.n_digits, task.seed + 1000, exclude=held_out)[rank::world]
        return kit.resampled_batches(demonstrations(tokenizer, pool), task.sft_batch_size, seed=task.seed + rank)

    engine_cfg = kit.warm_up_engine_config(cfg, base_dir, seed=task.seed)
    kit.warm_up_with_sft(
        cfg, engine_cfg, sft_dir, build=build, batches=batches, judge=functools.partial(greedy_workflow, cfg),
        dev=questions(task.n_dev, task.n_digits, task.seed + 2, exclude=held_out), lr=task.sft_lr,
        max_steps=task.sft_steps, eval_every=task.sft_eval_every, target=task.sft_target_reward, score_name="dev reward",
    )  # fmt: skip


def greedy_workflow(cfg: AgentExperimentConfig, tokenizer: PreTrainedTokenizerBase) -> AgentWorkflow:
    """One greedy episode per question: the dev and held-out reward."""
    reward = RewardRunner(exact_answer_reward, mode="inline")
    return AgentWorkflow(solve, reward, cfg.gconfig.new(n_samples=1, greedy=True), tokenizer)


def main(argv: list[str]) -> None:
    cfg = kit.load_config_and_seed(argv, AgentExperimentConfig)
    t0 = time.time()
    base_dir, sft_dir = os.path.join(cfg.output_dir, "base_model"), os.path.join(cfg.output_dir, "sft_model")
    eval_items = questions(cfg.task.n_eval, cfg.task.n_digits, cfg.task.seed + 1)
    held_out = {str(q["expression"]) for q in eval_items}
    actor_cfg = replace(cfg.actor, path=sft_dir, group_size=1)  # an episode may split: no fixed-size groups
    actor = PPOActor(actor_cfg, kit.make_train_engine(actor_cfg))
    actor.engine.create_process_group()  # before SFT's: torchrun's group cannot be re-made
    if not os.path.exists(os.path.join(sft_dir, "config.json")):
        warm_up(cfg, base_dir, sft_dir, held_out)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(sft_dir)
    train_items = questions(cfg.task.n_train, cfg.task.n_digits, cfg.task.seed + 3, exclude=held_out)
    reward = RewardRunner(exact_answer_reward, mode="inline")
    workflow = AgentWorkflow(solve, reward, cfg.gconfig.new(n_samples=cfg.actor.group_size), tokenizer)
    eval_workflow = greedy_workflow(cfg, tokenizer)

    rollout, weight_meta = kit.make_rollout_controller(cfg, sft_dir)
    dataloader = kit.rank_dataloader(train_items, cfg.train_dataset, actor.engine, seed=cfg.seed)
    run = kit.RunKit(cfg, actor.engine, dataloader, tokenizer=tokenizer, rollout=rollout, weight_meta=weight_meta)
    run.start()
    score = kit.HeldOutScore(rollout, eval_workflow, eval_items, "eval/reward")
    before = run.once("reward_before", score)
    kit.print_rank0(f"[agent] held-out greedy reward after SFT: {before:.3f}")

    for global_step in range(run.start_step, run.total_steps):
        batch, stats = run.rl_step(actor, workflow, global_step)  # the quickstart's step
        stats.update(episode_means(batch))
        run.end_step(global_step, stats, evaluate=score.evaluate)

    after = score()
    run.finish(f"reward_before={before:.3f} reward_after={after:.3f} minutes={(time.time() - t0) / 60:.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
