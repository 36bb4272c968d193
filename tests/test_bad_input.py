"""Bad input stops a run early with one line that names it, or is left out and counted: data rows
checked against the fields the run reads (file and line), empty files, a model directory without
a tokenizer, and training data smaller than one batch. (Config values outside their bounds:
tests/test_config.py and tests/test_launcher.py.)"""

from __future__ import annotations

import json
import logging
import os
import shutil

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
    from areal_lite.api.config import ConfigError, LauncherConfig, RecoverConfig
    from areal_lite.launcher.local import LaunchPlan, check_tokenizer
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
