"""Local datasets for training scripts: rows of jsonl or parquet files, GSM8K items, the synthetic
addition task of the examples, and tokenized SFT and preference batches.

Nothing is downloaded: files are read with ``datasets.load_dataset("json" | "parquet",
data_files=...)``. Batches follow the data contract (`areal_lite.api.engine`): right-padded
``input_ids``, ``attention_mask`` and ``loss_mask`` (1 on the completion tokens trained on).
"""

from __future__ import annotations

import glob
import os
import random
from collections.abc import Collection
from dataclasses import dataclass

import torch
from tensordict import TensorDict

GSM8K_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def load_rows(path: str) -> list[dict[str, object]]:
    """The rows of a local ``.jsonl``/``.json`` or ``.parquet`` file, or of every such file in a
    directory, as a list of dicts."""
    from datasets import load_dataset

    files = sorted(glob.glob(os.path.join(path, "*"))) if os.path.isdir(path) else [path]
    parquet = [f for f in files if f.endswith(".parquet")]
    json_files = [f for f in files if f.endswith((".jsonl", ".json"))]
    if not parquet and not json_files:
        raise FileNotFoundError(f"no .jsonl, .json or .parquet data at {path!r}")
    builder, data_files = ("parquet", parquet) if parquet else ("json", json_files)
    return list(load_dataset(builder, data_files=data_files, split="train"))


def gsm8k_item(row: dict[str, object], instruction: str = GSM8K_INSTRUCTION) -> dict[str, object]:
    """A GSM8K row (``question``, and ``answer`` ending in ``#### N``) as a chat prompt with the
    final number as the gold ``answer``."""
    final = str(row["answer"]).split("####")[-1].strip().replace(",", "")
    return {"messages": [{"role": "user", "content": f"{row['question']}\n{instruction}"}], "answer": final}


def addition_problems(n: int, n_digits: int, seed: int, exclude: Collection[str] = ()) -> list[dict[str, object]]:
    """``n`` problems ``{"prompt": "57+68=", "answer": "125"}`` with ``n_digits``-digit operands,
    none of whose prompts is in ``exclude`` (e.g. the held-out evaluation prompts)."""
    rng = random.Random(seed)
    hi = 10**n_digits - 1
    if len(set(exclude)) >= (hi + 1) ** 2:
        raise ValueError(f"every {n_digits}-digit problem is excluded")
    out: list[dict[str, object]] = []
    while len(out) < n:
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        prompt = f"{a}+{b}="
        if prompt not in exclude:
            out.append({"prompt": prompt, "answer": str(a + b)})
    return out


@dataclass
class AdditionTaskConfig:
    """The synthetic addition task (``57+68=`` -> ``125``) of the example scripts."""

    n_digits: int = 2
    """Digits of each operand."""
    n_train_prompts: int = 16384
    """Training prompts."""
    n_eval: int = 500
    """Held-out problems, never among the training prompts."""
    seed: int = 0
    """Seed of the problems."""


def addition_splits(task: AdditionTaskConfig) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """The task's training prompts and its held-out problems (disjoint)."""
    held_out = addition_problems(task.n_eval, task.n_digits, seed=task.seed + 1)
    prompts = {str(p["prompt"]) for p in held_out}
    return addition_problems(task.n_train_prompts, task.n_digits, seed=task.seed + 2, exclude=prompts), held_out


def demonstration_ids(
    tokenizer: object, item: dict[str, object], completion_key: str = "completion", use_chat_template: bool = False
) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of one demonstration: the prompt (not trained on), then the
    completion and eos (trained on).

    The item holds ``messages`` (the last one is the completion; the others are rendered by the
    chat template), or ``prompt`` and ``completion_key`` (raw text, or one user turn through the
    chat template when ``use_chat_template``).
    """
    if item.get("messages"):  # files mixing both layouts give the missing field as None
        messages = list(item["messages"])  # type: ignore[call-overload]
        prompt_msgs, completion = messages[:-1], str(messages[-1]["content"])
        prompt_text = tokenizer.apply_chat_template(prompt_msgs, tokenize=False, add_generation_prompt=True)  # type: ignore[attr-defined]
    else:
        completion = str(item[completion_key])
        prompt_text = str(item["prompt"])
        if use_chat_template:
            prompt_text = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
                [{"role": "user", "content": prompt_text}], tokenize=False, add_generation_prompt=True
            )
    prompt_ids = list(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]
    completion_ids = list(tokenizer(completion, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]  # type: ignore[operator,attr-defined]
    return prompt_ids + completion_ids, [0] * len(prompt_ids) + [1] * len(completion_ids)


def padded_batch(rows: list[tuple[list[int], list[int]]]) -> TensorDict:
    """Right-padded ``input_ids``, ``attention_mask`` and ``loss_mask`` of ``(ids, loss_mask)`` rows."""
    width = max(len(ids) for ids, _ in rows)
    ids_t = torch.zeros(len(rows), width, dtype=torch.int64)
    loss_mask = torch.zeros(len(rows), width, dtype=torch.int32)
    attn = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (ids, mask) in enumerate(rows):
        ids_t[i, : len(ids)] = torch.tensor(ids)
        loss_mask[i, : len(mask)] = torch.tensor(mask, dtype=torch.int32)
        attn[i, : len(ids)] = True
    return TensorDict({"input_ids": ids_t, "attention_mask": attn, "loss_mask": loss_mask}, batch_size=[len(rows)])


def sft_batch(tokenizer: object, items: list[dict[str, object]], use_chat_template: bool = False) -> TensorDict:
    """A padded SFT batch of demonstrations (see `demonstration_ids`)."""
    return padded_batch([demonstration_ids(tokenizer, it, use_chat_template=use_chat_template) for it in items])


def preference_batch(tokenizer: object, items: list[dict[str, object]], use_chat_template: bool = False) -> TensorDict:
    """A padded DPO batch of ``{prompt, chosen, rejected}`` items: row ``2i`` is item i's chosen
    answer, row ``2i + 1`` its rejected one (the layout `DPOActor` expects)."""
    rows = []
    for it in items:
        rows.append(demonstration_ids(tokenizer, it, "chosen", use_chat_template))
        rows.append(demonstration_ids(tokenizer, it, "rejected", use_chat_template))
    return padded_batch(rows)
