"""Local datasets for training scripts: rows of jsonl or parquet files, checked against what the run
reads, GSM8K items, the synthetic addition task of the examples, and tokenized SFT and preference
batches.

Nothing is downloaded. `read_rows` reads JSON lines itself (``json`` per line) and parquet with
pyarrow, rather than through ``datasets.load_dataset``, to keep where each row came from (file and
line, or file and row) and to tell a missing field from a null one (``datasets`` fills a missing
field with None and may cast a number to a string to fit a column's type). Each row is checked
against the fields the run reads (`RowFields`): a bad row stops the run with an error naming its
file and line, or, with ``on_bad_row="skip"``, is left out, counted and logged (`Rows.stats`).
Batches follow the data contract (`areal_lite.api.engine`): right-padded ``input_ids``,
``attention_mask`` and ``loss_mask`` (1 on the completion tokens trained on).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import random
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch
from tensordict import TensorDict

from areal_lite.api.errors import RecurringError

logger = logging.getLogger(__name__)

GSM8K_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

RowFields = dict[str, type | tuple[type, ...]]
"""The fields a run reads from each row and the type each must have (present, not None, and not
empty when a string or a list)."""
GSM8K_FIELDS: RowFields = {"question": str, "answer": str}
PREFERENCE_FIELDS: RowFields = {"prompt": str, "chosen": str, "rejected": str}
ON_BAD_ROW = ("raise", "skip")


class BadRow(RecurringError, ValueError):
    """A row that lacks a field the run reads, holds a value of the wrong type, or cannot be
    parsed; the message names its file and line (or parquet row)."""


@dataclass
class Rows:
    """The usable rows of a dataset, where each came from, and what was left out and why."""

    items: list[dict[str, object]]
    where: list[str]
    """``file:line`` (JSON lines) or ``file:row N`` (parquet) of each item."""
    left_out: Counter[str] = field(default_factory=Counter)
    """Rows left out, by reason (``bad`` for rows that failed the check, or a filter's reason)."""

    def __len__(self) -> int:
        return len(self.items)

    def drop_if(self, reject: Callable[[dict[str, object]], bool], reason: str) -> int:
        """Leave out the items for which ``reject`` is true (e.g. prompts over ``max_length``),
        counted under ``reason`` and logged; returns how many."""
        kept = [(it, w) for it, w in zip(self.items, self.where) if not reject(it)]
        dropped = len(self.items) - len(kept)
        if dropped:
            self.items, self.where = [it for it, _ in kept], [w for _, w in kept]
            self.left_out[reason] += dropped
            logger.warning("%d of %d rows left out: %s", dropped, dropped + len(kept), reason)
        return dropped

    def stats(self, name: str = "data") -> dict[str, float]:
        """``<name>/rows`` (used) and ``<name>/left_out/<reason>`` for each reason, for the stats logger."""
        out = {f"{name}/rows": float(len(self.items))}
        out.update({f"{name}/left_out/{reason}": float(n) for reason, n in self.left_out.items()})
        return out


def _data_files(path: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(path, "*"))) if os.path.isdir(path) else [path]
    parquet = [f for f in files if f.endswith(".parquet")]
    json_files = [f for f in files if f.endswith((".jsonl", ".json"))]
    if not parquet and not json_files:
        raise FileNotFoundError(f"no .jsonl, .json or .parquet data at {path!r}")
    return parquet or json_files


def _raw_rows(file: str) -> list[tuple[str, object]]:
    """(``file:line``, the parsed row or the `BadRow` that parsing it raised) of each row of one file."""
    if file.endswith(".parquet"):
        import pyarrow.parquet as pq

        return [(f"{file}:row {i + 1}", row) for i, row in enumerate(pq.read_table(file).to_pylist())]
    with open(file, encoding="utf-8") as f:
        text = f.read()
    if file.endswith(".json") and text.lstrip().startswith("["):  # one JSON array, not JSON lines
        try:
            return [(f"{file}:item {i + 1}", row) for i, row in enumerate(json.loads(text))]
        except json.JSONDecodeError as e:
            return [(f"{file}:{e.lineno}", BadRow(f"{file}:{e.lineno}: not valid JSON ({e.msg})"))]
    out: list[tuple[str, object]] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{file}:{n}"
        try:
            out.append((where, json.loads(line)))
        except json.JSONDecodeError as e:
            out.append((where, BadRow(f"{where}: not valid JSON ({e.msg})")))
    return out


def row_problem(row: object, fields: RowFields) -> str | None:
    """What is wrong with ``row`` for a run that reads ``fields``, or None."""
    if not isinstance(row, dict):
        return f"a row is a JSON object, got {type(row).__name__}"
    for name, kind in fields.items():
        kinds = kind if isinstance(kind, tuple) else (kind,)
        value = row.get(name)
        if value is None:
            return f"field {name!r} is {'null' if name in row else 'missing'}"
        # A JSON true is not a number, though Python's bool is an int.
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            expected = " or ".join(k.__name__ for k in kinds)
            return f"field {name!r} is {type(value).__name__} {value!r:.60}, expected {expected}"
        if isinstance(value, str) and not value.strip() or isinstance(value, (list, dict)) and not value:
            return f"field {name!r} is empty"
    return None


def read_rows(
    path: str,
    fields: RowFields | None = None,
    *,
    on_bad_row: str = "raise",
    convert: Callable[[dict[str, object]], dict[str, object]] | None = None,
    setting: str = "on_bad_row",
) -> Rows:
    """The rows of a local ``.jsonl``/``.json`` or ``.parquet`` file, or of every such file in a
    directory, checked against ``fields`` and passed through ``convert`` (which may raise
    ValueError for a row it cannot use).

    A row that fails the check or the conversion raises `BadRow` naming its file and line
    (``on_bad_row="raise"``), or is left out, counted and its first occurrences logged
    (``"skip"``); ``setting`` is the config key of the policy, for the message. A file without
    rows, or whose rows were all left out, is a ValueError.
    """
    if on_bad_row not in ON_BAD_ROW:
        raise ValueError(f"on_bad_row must be raise or skip, got {on_bad_row!r}")
    files = _data_files(path)
    rows = Rows(items=[], where=[])
    seen = 0
    for file in files:
        for where, row in _raw_rows(file):
            seen += 1
            if isinstance(row, BadRow):
                problem = str(row).removeprefix(f"{where}: ")
            else:
                problem = row_problem(row, fields or {})
            if problem is None and convert is not None:
                try:
                    row = convert(row)  # type: ignore[arg-type]
                except ValueError as e:  # the conversion refuses the row, saying why
                    problem = str(e)
                except (KeyError, TypeError) as e:
                    problem = f"{type(e).__name__}: {e}"
            if problem is not None:
                if on_bad_row == "raise":
                    raise BadRow(f"bad data row at {where}: {problem} ({setting}=skip leaves such rows out)")
                rows.left_out["bad"] += 1
                if rows.left_out["bad"] <= 5:
                    logger.warning("left out the data row at %s: %s", where, problem)
                continue
            rows.items.append(row)  # type: ignore[arg-type]
            rows.where.append(where)
    if seen == 0:
        raise ValueError(f"the data at {path!r} holds no rows ({', '.join(files)})")
    if rows.left_out["bad"]:
        logger.warning("left out %d bad rows of %d at %s", rows.left_out["bad"], seen, path)
    if not rows.items:
        raise ValueError(f"every one of the {seen} rows at {path!r} was left out as bad")
    return rows


def load_rows(path: str) -> list[dict[str, object]]:
    """The rows of a local ``.jsonl``/``.json`` or ``.parquet`` file, or of every such file in a
    directory, as a list of dicts (`read_rows` without a check of their fields)."""
    return read_rows(path).items


def gsm8k_item(row: dict[str, object], instruction: str = GSM8K_INSTRUCTION) -> dict[str, object]:
    """A GSM8K row (``question``, and ``answer`` ending in ``#### N``) as a chat prompt with the
    final number as the gold ``answer``; ValueError for an answer without ``#### N``."""
    text = str(row["answer"])
    if "####" not in text:
        raise ValueError(f"the answer has no final '#### N': {text[-60:]!r}")
    final = text.split("####")[-1].strip().replace(",", "")
    if not final:
        raise ValueError("the answer's '####' is followed by nothing")
    return {"messages": [{"role": "user", "content": f"{row['question']}\n{instruction}"}], "answer": final}


def demonstration_row(row: dict[str, object]) -> dict[str, object]:
    """``row`` when `demonstration_ids` can read it: a non-empty ``messages`` list of
    ``{"role", "content"}`` turns (strings) ending in the answer, or non-empty ``prompt`` and
    ``completion`` strings; ValueError saying what is wrong otherwise (`read_rows` ``convert``)."""
    messages = row.get("messages")
    if messages:
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise ValueError("'messages' must be a list of {'role': str, 'content': str} turns")
        if not str(messages[-1]["content"]).strip():
            raise ValueError("the last turn of 'messages' (the answer trained on) is empty")
        return row
    problem = row_problem(row, {"prompt": str, "completion": str})
    if problem is not None:
        raise ValueError(f"{problem} (a demonstration holds 'messages', or 'prompt' and 'completion')")
    return row


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
