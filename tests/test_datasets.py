"""`areal_lite.utils.datasets`: local files load through `datasets` without a download, GSM8K
answers reduce to their final number, and SFT / preference batches train on the completion only,
in the row order the actors expect."""

from __future__ import annotations

import json

import pytest

from areal_lite.utils.datasets import (
    addition_problems,
    demonstration_ids,
    gsm8k_item,
    load_rows,
    preference_batch,
    sft_batch,
)
from areal_lite.utils.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(vocab_size=0)


def test_load_rows_reads_jsonl_and_parquet(tmp_path) -> None:
    rows = [{"question": "q1", "answer": "a #### 1"}, {"question": "q2", "answer": "b #### 2"}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_rows(str(tmp_path / "a.jsonl")) == rows
    from datasets import Dataset

    Dataset.from_list(rows).to_parquet(str(tmp_path / "pq" / "train.parquet"))
    assert load_rows(str(tmp_path / "pq")) == rows
    with pytest.raises(FileNotFoundError):
        load_rows(str(tmp_path / "nothing"))


def test_gsm8k_item_keeps_the_final_number() -> None:
    item = gsm8k_item({"question": "How many?", "answer": "3 * 500 = 1,500\n#### 1,500"})
    assert item["answer"] == "1500"
    assert item["messages"][0]["role"] == "user" and item["messages"][0]["content"].startswith("How many?")  # type: ignore[index]


def test_addition_problems_are_right_and_seeded() -> None:
    problems = addition_problems(20, 2, seed=3)
    assert problems == addition_problems(20, 2, seed=3)
    for p in problems:
        a, b = str(p["prompt"]).rstrip("=").split("+")
        assert int(a) + int(b) == int(p["answer"])  # type: ignore[call-overload]


def test_demonstrations_train_on_the_completion_and_eos(tokenizer) -> None:
    ids, mask = demonstration_ids(tokenizer, {"prompt": "1+2=", "completion": "3"})
    assert tokenizer.decode([i for i, m in zip(ids, mask) if m]) == "3<|im_end|>"
    assert tokenizer.decode([i for i, m in zip(ids, mask) if not m]) == "1+2="
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    ids, mask = demonstration_ids(tokenizer, chat)
    assert tokenizer.decode([i for i, m in zip(ids, mask) if not m]).endswith("<|im_start|>assistant\n")
    batch = sft_batch(tokenizer, [{"prompt": "1+2=", "completion": "3"}, chat])
    assert batch["input_ids"].shape[0] == 2 and batch["attention_mask"].sum(1).tolist() == [6, len(ids)]


def test_preference_batch_puts_chosen_before_rejected(tokenizer) -> None:
    batch = preference_batch(tokenizer, [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}] * 2)
    answers = [tokenizer.decode(row[mask.bool()]) for row, mask in zip(batch["input_ids"], batch["loss_mask"])]
    assert answers == ["2<|im_end|>", "3<|im_end|>"] * 2


def test_addition_problems_exclude_held_out_prompts() -> None:
    from areal_lite.utils.datasets import addition_problems

    held_out = {str(p["prompt"]) for p in addition_problems(500, 1, seed=0)}  # most of the 100 one-digit sums
    drawn = addition_problems(300, 1, seed=1, exclude=held_out - {"3+4="})
    assert {p["prompt"] for p in drawn} <= {"3+4="} | ({f"{a}+{b}=" for a in range(10) for b in range(10)} - held_out)
    for p in drawn:
        a, b = str(p["prompt"]).rstrip("=").split("+")
        assert p["answer"] == str(int(a) + int(b))
