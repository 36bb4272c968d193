"""Workflows against the embedded engine with a tiny model (and a scripted engine where the test
needs chosen replies): outputs satisfy the data contract, rewards land on the right samples, and
multi-turn trajectories decode back to the exact conversation."""

from __future__ import annotations

import asyncio

import pytest
import torch
from misbehaving_graders import misbehaving_grader
from tensordict import TensorDict

from areal_lite.api.config import InferenceEngineConfig, LocalEngineConfig
from areal_lite.api.io import GenerationConfig, ModelRequest, ModelResponse
from areal_lite.core import RolloutController
from areal_lite.engines.local.engine import LocalInferenceEngine
from areal_lite.rewards import RewardRunner, math_answer_reward
from areal_lite.utils.tiny import build_tiny_model
from areal_lite.workflows import (
    CalculatorEnv,
    Environment,
    MathFeedbackEnv,
    MultiTurnWorkflow,
    ReMaxWorkflow,
    RLVRWorkflow,
    check_trajectory,
    encode_chat,
    rewards_differ,
)

GCONFIG = GenerationConfig(n_samples=3, max_new_tokens=12)
ITEMS = [
    {"prompt": "What is 6 * 7?", "answer": "42"},
    {"messages": [{"role": "user", "content": "1 + 1 = ?"}], "answer": "2"},
]


def length_reward(
    prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **data: object
) -> float:
    return float(len(completion_ids))


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    """A rollout controller over the embedded engine on a tiny model."""
    path = build_tiny_model(str(tmp_path_factory.mktemp("tiny")), hidden_size=32, num_layers=2)
    controller = RolloutController(
        LocalInferenceEngine(LocalEngineConfig(path=path, max_running_requests=16, seed=1)),
        InferenceEngineConfig(consumer_batch_size=2, max_concurrent_rollouts=4),
    )
    controller.initialize()
    try:
        yield controller
    finally:
        controller.destroy()


@pytest.fixture(scope="module")
def engine(rollout):
    return rollout.engine


class SharedEngine:
    """The module's engine under a second controller: everything but its lifecycle passes through."""

    def __init__(self, engine: LocalInferenceEngine) -> None:
        self._engine = engine

    def initialize(self) -> None:
        pass

    def destroy(self) -> None:
        pass

    def __getattr__(self, name: str) -> object:
        return getattr(self._engine, name)


def segments(mask: list[int]) -> list[tuple[int, int, int]]:
    """Runs of equal values: (value, start, end)."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def test_rlvr_groups_follow_the_contract(engine, rollout) -> None:
    engine.set_version(3)
    wf = RLVRWorkflow(RewardRunner(length_reward, mode="thread"), GCONFIG, engine.tokenizer)
    batch = rollout.rollout_batch(ITEMS, wf)
    check_trajectory(batch)
    assert batch.batch_size[0] == 2 * GCONFIG.n_samples
    prompt0 = encode_chat(engine.tokenizer, [{"role": "user", "content": ITEMS[0]["prompt"]}])
    for row in range(batch.batch_size[0]):
        ids = batch["input_ids"][row][batch["attention_mask"][row]].tolist()
        trained = batch["loss_mask"][row][: len(ids)].bool()
        if row < GCONFIG.n_samples:
            assert ids[: len(prompt0)] == prompt0 and not trained[: len(prompt0)].any()
        n_out = int(trained.sum())
        assert 1 <= n_out <= GCONFIG.max_new_tokens
        assert batch["rewards"][row].item() == n_out  # each sample's reward is its own
        assert (batch["versions"][row][: len(ids)][trained] == 3).all()
    engine.set_version(0)


def test_dynamic_sampling_drops_groups_without_signal(engine, rollout) -> None:
    """Rewards are the parity of the first sampled token: groups where all agree are dropped."""

    def parity(prompt, completion, prompt_ids, completion_ids, **data) -> float:
        return float(completion_ids[0] % 2)

    flat = TensorDict({"rewards": torch.tensor([1.0, 1.0, 1.0])}, batch_size=[3])
    assert not rewards_differ(flat) and rewards_differ(
        TensorDict({"rewards": torch.tensor([1.0, 0.0, 1.0])}, batch_size=[3])
    )
    wf = RLVRWorkflow(
        RewardRunner(parity, mode="thread"), GenerationConfig(n_samples=4, max_new_tokens=2), engine.tokenizer
    )
    rejected_before = rollout.stats()["rollout/rejected"]
    batch = rollout.rollout_batch(ITEMS * 4, wf, should_accept=rewards_differ)
    n_groups = batch.batch_size[0] // 4
    assert all(rewards_differ(batch[4 * g : 4 * g + 4]) for g in range(n_groups))
    assert n_groups + rollout.stats()["rollout/rejected"] - rejected_before == 8


def test_rlvr_raw_prompt_without_chat_template(engine, rollout) -> None:
    wf = RLVRWorkflow(
        RewardRunner(length_reward, mode="thread"),
        GenerationConfig(n_samples=2, max_new_tokens=4),
        engine.tokenizer,
        use_chat_template=False,
    )
    batch = rollout.rollout_batch([{"prompt": "12+30="}], wf)
    check_trajectory(batch)
    raw = engine.tokenizer("12+30=", add_special_tokens=False)["input_ids"]
    assert batch["input_ids"][0, : len(raw)].tolist() == raw and not batch["loss_mask"][:, : len(raw)].any()


def test_rlvr_default_runner_grades_math_in_worker_processes(engine, rollout) -> None:
    wf = RLVRWorkflow(math_answer_reward, GenerationConfig(n_samples=2, max_new_tokens=6), engine.tokenizer)
    try:
        assert wf.reward.mode == "process"
        batch = rollout.rollout_batch(ITEMS[:1], wf)
        check_trajectory(batch)
        stats = wf.reward.stats()
        assert stats["reward/samples"] == 2 and stats["reward/errors"] == 0 and stats["reward/timeouts"] == 0
    finally:
        wf.reward.close()


def test_rlvr_batch_completes_despite_bad_graders(engine, rollout) -> None:
    """Graders that raise, hang and return NaN have no score inside an RLVR batch: their groups are
    dropped and counted, never trained on; the batch completes with the others."""
    runner = RewardRunner(misbehaving_grader, mode="process", timeout=2.0, num_workers=2)
    wf = RLVRWorkflow(runner, GenerationConfig(n_samples=2, max_new_tokens=3), engine.tokenizer)
    try:
        items = [{"prompt": f"q{k}", "kind": k} for k in ("ok", "raise", "hang", "nan", "ok")]
        failed_before = rollout.stats()["rollout/reward_failed_total"]
        batch = rollout.rollout_batch(items, wf)
        check_trajectory(batch)
        assert batch["rewards"].tolist() == [1.0] * 4
        assert rollout.stats()["rollout/reward_failed_total"] == failed_before + 3
        s = runner.stats()
        assert (s["reward/errors"], s["reward/timeouts"], s["reward/nonfinite"]) == (2, 2, 2)
    finally:
        runner.close()


def test_rlvr_through_prepare_batch(engine, rollout) -> None:
    wf = RLVRWorkflow(
        RewardRunner(length_reward, mode="thread"), GenerationConfig(n_samples=2, max_new_tokens=4), engine.tokenizer
    )
    loader = [[ITEMS[0], ITEMS[1]], [ITEMS[1], ITEMS[0]]]
    batch = rollout.prepare_batch(loader, wf)
    check_trajectory(batch)
    assert batch.batch_size[0] == 2 * 2  # consumer_batch_size groups of n_samples


def test_async_training_loop_with_weight_updates_keeps_the_bound(engine) -> None:
    """A rollout controller over the real engine with eta = 1: weights are updated (in place, the
    same tensors) and the version bumped after every batch while groups are mid-generation; every
    consumed batch holds tokens of versions >= step - 1."""
    from areal_lite.api.io import WeightUpdateMeta

    config = InferenceEngineConfig(consumer_batch_size=2, max_head_offpolicyness=1, max_concurrent_rollouts=4)
    controller = RolloutController(SharedEngine(engine), config)
    controller.initialize()
    weights = {k: v.clone() for k, v in engine.model.state_dict().items()}
    wf = RLVRWorkflow(
        RewardRunner(length_reward, mode="thread"), GenerationConfig(n_samples=2, max_new_tokens=24), engine.tokenizer
    )
    loader = [[{"prompt": f"{a} + {a} = ?"}, {"prompt": f"{a} * 2 = ?"}] for a in range(40)]
    ex = controller.executor
    try:
        for step in range(5):
            batch = controller.prepare_batch(loader, wf)
            check_trajectory(batch)
            produced = batch["versions"][batch["loss_mask"].bool()]
            assert int(produced.min()) >= step - 1
            controller.pause()
            engine.update_weights(WeightUpdateMeta(type="in_process", named_tensors=weights, version=step + 1)).result()
            controller.set_version(step + 1)
            controller.resume()
        ex.pause()
        with ex._cond:  # let the rollouts in flight finish before the loop they wait on closes
            assert ex._cond.wait_for(lambda: ex.staleness.running == 0, timeout=120), ex.staleness.running
    finally:
        controller.destroy()
        engine.set_version(0)
    # Step 0 admitted 2 batches at version 0; the second was consumed at version 1.
    assert max(ex.staleness_histogram) == 1


def test_remax_returns_samples_with_the_greedy_baseline(engine, rollout) -> None:
    wf = ReMaxWorkflow(
        RewardRunner(length_reward, mode="thread"), GenerationConfig(n_samples=2, max_new_tokens=10), engine.tokenizer
    )
    batch = rollout.rollout_batch(ITEMS[:1], wf)
    check_trajectory(batch)
    assert batch.batch_size[0] == 2 and batch["baseline_rewards"].dtype == torch.float32
    prompt = encode_chat(engine.tokenizer, [{"role": "user", "content": ITEMS[0]["prompt"]}])

    async def greedy() -> ModelResponse:
        return await engine.agenerate(ModelRequest(prompt, GenerationConfig(max_new_tokens=10, greedy=True)))

    greedy_len = asyncio.run(greedy()).output_len
    assert batch["baseline_rewards"].tolist() == [float(greedy_len)] * 2


class RecordingEnv(Environment):
    """Never done; rewards 0.5 per turn; records what it was told."""

    def __init__(self) -> None:
        self.replies: list[str] = []

    async def reset(self, data: dict[str, object]) -> str:
        return str(data["prompt"])

    async def step(self, action: str) -> tuple[str, float, bool]:
        self.replies.append(action)
        return f"observation {len(self.replies)}", 0.5, False


def assert_decodes_to_conversation(
    tokenizer, row_ids: list[int], loss_mask: list[int], first: str, observations, role: str
) -> None:
    """Rebuild the conversation from the trained segments (the model's replies) and the
    environment's messages; its chat-template rendering must equal the decoded tokens."""
    eos = tokenizer.eos_token_id
    replies = [row_ids[s:e] for v, s, e in segments(loss_mask) if v == 1]
    conv = [{"role": "user", "content": first}]
    for i, reply in enumerate(replies):
        text = tokenizer.decode(reply[:-1] if reply[-1] == eos else reply)
        conv.append({"role": "assistant", "content": text})
        if i < len(replies) - 1:
            conv.append({"role": role, "content": observations[i]})
    rendered = tokenizer.apply_chat_template(conv, tokenize=False)
    decoded = tokenizer.decode(row_ids)
    tail = "\n" if replies[-1][-1] == eos else "<|im_end|>\n"  # the last turn's closing is not in the trajectory
    assert decoded + tail == rendered


def test_multi_turn_with_the_engine_decodes_to_the_conversation(engine, rollout) -> None:
    envs: list[RecordingEnv] = []

    def factory() -> RecordingEnv:
        envs.append(RecordingEnv())
        return envs[-1]

    wf = MultiTurnWorkflow(
        factory, GenerationConfig(n_samples=2, max_new_tokens=8), engine.tokenizer, max_turns=3, turn_discount=0.5
    )
    batch = rollout.rollout_batch([{"prompt": "Count with me."}], wf)
    check_trajectory(batch)
    assert batch["rewards"].tolist() == [0.5 + 0.25 + 0.125] * 2 and batch["num_turns"].tolist() == [3.0, 3.0]
    for row in range(2):
        n = int(batch["attention_mask"][row].sum())
        ids, mask = batch["input_ids"][row, :n].tolist(), batch["loss_mask"][row, :n].tolist()
        assert [v for v, _, _ in segments(mask)] == [0, 1, 0, 1, 0, 1]
        assert_decodes_to_conversation(
            engine.tokenizer, ids, mask, "Count with me.", ["observation 1", "observation 2"], "user"
        )


class ScriptedEngine:
    """Replies with the given texts in order, version 5; a reply ending in <|im_end|> stops."""

    def __init__(self, tokenizer, replies: list[str]) -> None:
        self.tok, self.replies, self.requests = tokenizer, list(replies), []

    def get_version(self) -> int:
        return 5

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        self.requests.append(list(req.input_ids))
        text = self.replies.pop(0)
        out = self.tok(text, add_special_tokens=False)["input_ids"]
        stop = "stop" if text.endswith(self.tok.eos_token) else "length"
        return ModelResponse(req.input_ids, out, [-0.5] * len(out), [5] * len(out), stop)


def run(workflow, engine, data):
    return asyncio.run(workflow.arun_episode(engine, data))


def test_multi_turn_requests_are_exactly_the_trajectory_so_far(engine) -> None:
    tok = engine.tokenizer
    scripted = ScriptedEngine(tok, ["first try<|im_end|>", "cut off", "done<|im_end|>"])
    wf = MultiTurnWorkflow(RecordingEnv, GenerationConfig(max_new_tokens=8), tok, max_turns=3)
    traj = run(wf, scripted, {"prompt": "Go."})
    check_trajectory(traj)
    ids, mask = traj["input_ids"][0].tolist(), traj["loss_mask"][0].tolist()
    for req in scripted.requests:  # every request is a prefix of the final token sequence
        assert ids[: len(req)] == req
    text = tok.decode(ids)
    assert "first try<|im_end|>\n<|im_start|>user" in text  # the model's eos is not written twice
    assert "cut off<|im_end|>\n<|im_start|>user" in text  # a reply cut by length is closed
    assert_decodes_to_conversation(tok, ids, mask, "Go.", ["observation 1", "observation 2"], "user")


def test_multi_turn_stops_before_the_context_limit(engine) -> None:
    tok = engine.tokenizer
    scripted = ScriptedEngine(tok, ["a<|im_end|>", "b<|im_end|>", "c<|im_end|>"])
    first = encode_chat(tok, [{"role": "user", "content": "Go."}])
    limit = len(first) + 2 + 8 + 10  # room for one reply and a little, not for a second turn
    wf = MultiTurnWorkflow(RecordingEnv, GenerationConfig(max_new_tokens=8), tok, max_turns=3, max_context_tokens=limit)
    traj = run(wf, scripted, {"prompt": "Go."})
    check_trajectory(traj)
    assert traj["num_turns"].item() == 1 and len(scripted.requests) == 1


def test_math_feedback_env_retries_with_a_discount(engine) -> None:
    tok = engine.tokenizer
    grader = RewardRunner(math_answer_reward, mode="thread")
    scripted = ScriptedEngine(tok, ["\\boxed{41}<|im_end|>", "\\boxed{42}<|im_end|>", "unused"])
    wf = MultiTurnWorkflow(
        lambda: MathFeedbackEnv(grader), GenerationConfig(max_new_tokens=8), tok, max_turns=3, turn_discount=0.9
    )
    traj = run(wf, scripted, {"prompt": "What is 6 * 7?", "answer": "42"})
    check_trajectory(traj)
    assert traj["rewards"].item() == pytest.approx(0.9) and traj["num_turns"].item() == 2
    assert "That is not right. Try again." in tok.decode(traj["input_ids"][0])


def test_calculator_env_tool_call_then_answer(engine) -> None:
    tok = engine.tokenizer
    grader = RewardRunner(math_answer_reward, mode="thread")
    scripted = ScriptedEngine(tok, ["<calc>6*(3+4)</calc><|im_end|>", "\\boxed{42}<|im_end|>"])
    wf = MultiTurnWorkflow(
        lambda: CalculatorEnv(grader), GenerationConfig(max_new_tokens=16), tok, max_turns=4, turn_discount=1.0
    )
    traj = run(wf, scripted, {"question": "What is 6*(3+4)?", "answer": "42"})
    check_trajectory(traj)
    assert traj["rewards"].item() == 1.0 and traj["num_turns"].item() == 2
    ids, mask = traj["input_ids"][0].tolist(), traj["loss_mask"][0].tolist()
    assert "<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n" in tok.decode(ids)
    first = "What is 6*(3+4)?\nYou may use a calculator: write <calc>expression</calc>."
    assert_decodes_to_conversation(tok, ids, mask, first, ["42"], "tool")


def test_from_responses_equals_concatenated_single_responses() -> None:
    """A group built at once is exactly the padded concatenation of its samples' trajectories."""
    from areal_lite.utils.data import concat_padded
    from areal_lite.workflows.trajectory import check_trajectory, from_response, from_responses

    g = torch.Generator().manual_seed(0)
    resps = []
    for i, n_out in enumerate([3, 0, 5, 1]):
        resps.append(
            ModelResponse(
                input_tokens=torch.randint(1, 50, (2 + i,), generator=g).tolist(),
                output_tokens=torch.randint(1, 50, (n_out,), generator=g).tolist(),
                output_logprobs=(-torch.rand(n_out, generator=g)).tolist(),
                output_versions=[3 + i] * n_out,
            )
        )
    rewards = [1.0, 0.0, 0.5, -1.0]
    group = from_responses(resps, rewards)
    expected = concat_padded([from_response(r, w) for r, w in zip(resps, rewards)])
    check_trajectory(group)
    assert set(group.keys()) == set(expected.keys())
    for key in expected.keys():  # noqa: SIM118 - iterating a TensorDict yields rows, not keys
        assert group[key].dtype == expected[key].dtype, key
        assert torch.equal(group[key], expected[key]), key
