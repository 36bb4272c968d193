"""Bad input stops a run early with one line that names it, or is left out and counted: data rows
checked against the fields the run reads (file and line), empty files, a model directory without
a tokenizer, and training data smaller than one batch. (Config values outside their bounds:
tests/test_config.py and tests/test_launcher.py.)"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

import pytest

from areal_lite.utils.datasets import GSM8K_FIELDS, BadRow, gsm8k_item, load_rows, read_rows

GOOD = {"question": "Tom has 2 apples and buys 3. How many?", "answer": "2 + 3 = 5\n#### 5"}
BAD_LINES = [
    ('{"question": null, "answer": "#### 1"}', "field 'question' is null"),
    ('{"answer": "#### 1"}', "field 'question' is missing"),
    ('{"question": 5, "answer": "#### 1"}', "field 'question' is int 5, expected str"),
    ('{"question": "   ", "answer": "#### 1"}', "field 'question' is empty"),
    ('{"question": "Q", "answer": ["#### 1"]}', "field 'answer' is list"),
    ('{"question": "Q", "answer": "one"}', "the answer has no final '#### N'"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "a row is a JSON object, got list"),
]


@pytest.mark.parametrize("line, problem", BAD_LINES)
def test_a_bad_row_stops_the_run_naming_file_and_line(tmp_path, line: str, problem: str) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + line + "\n" + json.dumps(GOOD) + "\n")
    with pytest.raises(BadRow) as e:
        read_rows(str(path), GSM8K_FIELDS, convert=gsm8k_item, setting="train_dataset.on_bad_row")
    message = str(e.value)
    assert message.startswith(f"bad data row at {path}:3: "), "line 3: the blank line 2 is counted"
    assert problem in message and "train_dataset.on_bad_row=skip" in message
    assert "\n" not in message


def test_skipped_rows_are_left_out_counted_and_logged(tmp_path, caplog) -> None:
    path = tmp_path / "train.jsonl"
    lines = [json.dumps(GOOD)] + [line for line, _ in BAD_LINES] + [json.dumps({**GOOD, "question": "Why?"})]
    path.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING, logger="areal_lite.utils.datasets"):
        rows = read_rows(str(path), GSM8K_FIELDS, on_bad_row="skip", convert=gsm8k_item)
    assert [it["answer"] for it in rows.items] == ["5", "5"]
    assert rows.where == [f"{path}:1", f"{path}:{len(lines)}"]
    assert rows.stats() == {"data/rows": 2.0, "data/left_out/bad": float(len(BAD_LINES))}
    logged = [r.getMessage() for r in caplog.records]
    assert sum("left out the data row at" in m for m in logged) == 5, "the first five are named"
    assert f"left out {len(BAD_LINES)} bad rows of {len(lines)}" in logged[-1]


def test_demonstrations_and_preference_pairs_are_checked_too(tmp_path) -> None:
    from areal_lite.utils.datasets import PREFERENCE_FIELDS, demonstration_row

    sft = tmp_path / "sft.jsonl"
    rows = [
        {"prompt": "1+1=", "completion": "2"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"prompt": "2+2="},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]},
    ]
    sft.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(BadRow, match=rf"at {sft}:3: field 'completion' is missing"):
        read_rows(str(sft), convert=demonstration_row)
    kept = read_rows(str(sft), on_bad_row="skip", convert=demonstration_row)
    assert len(kept) == 2 and kept.stats()["data/left_out/bad"] == 2
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": 3}) + "\n")
    with pytest.raises(BadRow, match="field 'rejected' is int 3, expected str"):
        read_rows(str(pairs), PREFERENCE_FIELDS)


def test_prompts_over_max_length_are_dropped_and_counted(tmp_path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"question": "x" * n, "answer": "#### 1"}) + "\n" for n in (5, 10, 500, 20)))
    rows = read_rows(str(path), GSM8K_FIELDS, convert=gsm8k_item)
    assert rows.drop_if(lambda it: len(it["messages"][0]["content"]) > 300, "prompt_over_300") == 1
    assert len(rows) == 3 and rows.where[-1] == f"{path}:4"
    assert rows.stats() == {"data/rows": 3.0, "data/left_out/prompt_over_300": 1.0}


def test_parquet_rows_are_named_by_row_number(tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD, {"question": "Q", "answer": None}]), str(path))
    with pytest.raises(BadRow, match=rf"at {path}:row 2: field 'answer' is null"):
        read_rows(str(path), GSM8K_FIELDS)
    assert load_rows(str(path))[0] == GOOD


def test_an_empty_file_or_one_without_a_usable_row_is_a_clear_error(tmp_path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=r"holds no rows"):
        load_rows(str(empty))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "Q"}\n')
    with pytest.raises(ValueError, match=r"every one of the 1 rows .* was left out as bad"):
        read_rows(str(bad), GSM8K_FIELDS, on_bad_row="skip")
    with pytest.raises(FileNotFoundError, match="no .jsonl, .json or .parquet data"):
        load_rows(str(tmp_path / "nothing.csv"))


def test_training_data_smaller_than_one_batch_is_refused() -> None:
    from areal_lite.api.config import DatasetConfig
    from areal_lite.kit import rank_dataloader

    class OneRank:  # the two members rank_dataloader reads, and the process group it joins
        data_parallel_rank, data_parallel_world_size = 0, 1

        def create_process_group(self) -> None:
            pass

    with pytest.raises(
        ValueError, match=r"the training data \(d.jsonl\) has 3 items, fewer than one batch of batch_size=8"
    ):
        rank_dataloader([{}] * 3, DatasetConfig(path="d.jsonl", batch_size=8), OneRank(), seed=0)  # type: ignore[arg-type]


def test_a_model_directory_without_a_tokenizer_is_named(tmp_path) -> None:
    from areal_lite.api.config import RecoverConfig
    from areal_lite.api.config_loader import ConfigError
    from areal_lite.api.experiment_config import LauncherConfig
    from areal_lite.launcher.plan import LaunchPlan
    from areal_lite.launcher.preflight import check_tokenizer
    from areal_lite.utils.tiny import build_tiny_model
    from areal_lite.utils.tokenizer import TokenizerMissing, load_tokenizer

    model = build_tiny_model(str(tmp_path / "model"), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    assert load_tokenizer(model).eos_token == "<|im_end|>"
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in os.listdir(model):
        if not name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(os.path.join(model, name), bare / name)
    with pytest.raises(TokenizerMissing, match=rf"the directory '{bare}' \(actor.path\) holds no tokenizer"):
        load_tokenizer(str(bare), "actor.path")
    plan = LaunchPlan("s.py", None, [], LauncherConfig(), RecoverConfig(), str(bare), str(tmp_path / "out"))
    plan.tokenizer = ("actor.path", str(bare))
    with pytest.raises(ConfigError, match="holds no tokenizer"):
        check_tokenizer(plan)
    plan.tokenizer = ("tokenizer_path", model)
    check_tokenizer(plan)


# ---------------------------------------------------------------------------------- rewards


class RewardsWorkflow:
    """Episodes of two samples whose rewards come from ``rewards(data)`` (NaN: a failed grader)."""

    def __init__(self, rewards) -> None:
        self.rewards = rewards

    async def arun_episode(self, engine: object, data: dict) -> object:
        from areal_lite.api.io import ModelResponse
        from areal_lite.workflows.trajectory import from_responses

        resp = ModelResponse(input_tokens=[1, 2], output_tokens=[3], output_logprobs=[-0.5], output_versions=[0])
        return from_responses([resp, resp], self.rewards(data))


def executor(**config: object):
    from areal_lite.api.config import InferenceEngineConfig
    from areal_lite.core import WorkflowExecutor

    cfg = InferenceEngineConfig(consumer_batch_size=4, max_head_offpolicyness=100, **config)  # type: ignore[arg-type]

    async def run_episode(workflow, data):
        return await workflow.arun_episode(None, data)

    ex = WorkflowExecutor(cfg, run_episode)
    ex.initialize()
    return ex


def test_episodes_with_failed_rewards_are_dropped_and_counted_per_step() -> None:
    """One episode in four has a NaN reward: it is never trained on; the step's statistics count it."""
    import math

    ex = executor()
    try:
        wf = RewardsWorkflow(lambda d: [1.0, math.nan] if d["i"] % 4 == 3 else [1.0, 0.0])
        loader = [[{"i": i} for i in range(4 * k, 4 * k + 4)] for k in range(8)]
        batch = ex.prepare_batch(loader, wf)  # type: ignore[arg-type]
        assert batch["rewards"].isfinite().all() and len(batch["rewards"]) == 8
        s = ex.stats()
        assert s["rollout/reward_failed"] >= 1 and s["rollout/reward_failed_total"] >= s["rollout/reward_failed"]
        assert s["rollout/reward_failed_samples"] == s["rollout/reward_failed"], "one NaN sample in each"
        assert s["rollout/rejected"] == 0, "a failed reward is not a rejection"
    finally:
        ex.destroy()


def test_the_run_stops_when_rewards_fail_on_most_of_a_batch() -> None:
    """A workflow (or grader) whose every reward is NaN: the run stops with a line that says so,
    instead of skipping every update and exiting 0."""
    import math

    from areal_lite.core.executor import RewardFailure

    ex = executor(max_reward_failures=0.5)
    try:
        wf = RewardsWorkflow(lambda d: [math.nan, math.nan])
        loader = [[{"i": i} for i in range(4 * k, 4 * k + 4)] for k in range(8)]
        with pytest.raises(RewardFailure, match=r"rollout.max_reward_failures=0.5 of a batch of 4; stopping"):
            ex.prepare_batch(loader, wf)  # type: ignore[arg-type]
    finally:
        ex.destroy()


def sleeping_grader(prompt, completion, prompt_ids, completion_ids, **item) -> float:
    time.sleep(3600)  # blocked in C: nothing interrupts it on the loop's own thread
    return 1.0


def test_a_grader_hanging_inline_stops_the_run_naming_it(monkeypatch, caplog) -> None:
    """The quickstart's mode (inline): the rollout loop blocked in the grader is found within
    rollout.loop_stall_timeout and the run stops with a line naming the grader; meanwhile the wait
    says what it waits for."""
    import areal_lite.core.loop_watchdog as watchdog_module
    from areal_lite.core.loop_watchdog import LoopStalled
    from areal_lite.rewards.runner import RewardRunner

    monkeypatch.setattr(watchdog_module, "WAIT_LINE_SECONDS", 1.0)
    runner = RewardRunner(sleeping_grader, mode="inline")

    class Graded(RewardsWorkflow):
        async def arun_episode(self, engine: object, data: dict) -> object:
            await runner("p", "c", [1], [2])
            return await super().arun_episode(engine, data)

    ex = executor(loop_stall_timeout=3.0)
    try:
        t0 = time.monotonic()
        stalled = r"blocked for \d+s in sleeping_grader \(.*test_bad_input.py:\d+\)"
        with (
            caplog.at_level(logging.WARNING, logger="areal_lite.core.executor"),
            pytest.raises(LoopStalled, match=stalled),
        ):
            ex.prepare_batch([[{"i": 0}] * 4], Graded(lambda d: [1.0, 1.0]))  # type: ignore[arg-type]
        assert time.monotonic() - t0 < 15
        assert "waiting for 4 trajectories" in caplog.text
    finally:
        ex._thread = None  # its loop is stuck in the grader: leave that daemon thread behind
