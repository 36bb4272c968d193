"""Grading a final mathematical answer with the math-verify library, strictly by default.

The gold answer comes from the dataset item (``answer``). The completion's answer is read only
where the completion declares it: the content of its ``\\boxed{...}`` (by default), or the first
group of a declared ``answer_pattern`` (e.g. ``Answer: (.+)``). Equivalent forms (``1/2`` and
``0.5``, ``\\frac{3}{6}``) count as correct. What scores 0:

- no declared answer (no ``\\boxed{}``, or no match of the pattern): numbers elsewhere in the text
  are never read;
- several declared answers that differ (``\\boxed{3}`` ... ``\\boxed{4}``: a hedge);
- an answer that hedges inside one box: several values (``3, 4``, ``3 or 4``, ``\\pm 3``, an
  interval), a disjunction (``3 \\lor 4``, which math-verify reads as its last operand), or
  numbers separated by spaces only (``3\\ 4``, which it reads as their sum);
- an answer that is not the gold one, or that math-verify cannot parse.

``last_number_fallback=True`` restores the lenient behaviour: with no declared answer, the last
expression math-verify extracts from the whole text is graded. That is exploitable and a policy
trained against it finds it: "1. Add.\\n2. Check.\\n3. Done" scores 1.0 for the answer 3. Use it
only to evaluate models that were not trained against it.

math-verify's own timeouts use ``SIGALRM``, which only works in a process's main thread: they are
used there (in the `RewardRunner`'s worker processes) and switched off in other threads, where
only the runner's timeout applies.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

from math_verify import parse, verify

_TIMEOUT_S = 5
_BOXED_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HEDGES = re.compile(r"\\(?:lor|vee|pm|mp|cup)(?![A-Za-z])")
_SPACED_NUMBERS = re.compile(r"\d\s+\d")


def boxed_contents(text: str) -> list[str]:
    """The contents of every complete ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, nested
    braces included, in order; an unclosed box is not an answer."""
    out = []
    for m in _BOXED_OPEN.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append(text[m.end() : i - 1])
    return out


def _is_hedge(content: str) -> bool:
    """Whether one declared answer hedges between several values in a way that the parse below
    would not reject (a disjunction, a plus-minus, numbers separated by spaces)."""
    plain = content.replace("\\ ", " ").replace("\\,", " ").replace("\\;", " ").replace("~", " ")
    return bool(_HEDGES.search(content)) or bool(_SPACED_NUMBERS.search(plain))


def _parse(text: str, timeout: int | None) -> list[object]:
    return parse(text, parsing_timeout=timeout)


def _single_value(parsed: list[object]) -> bool:
    """math-verify parses ``3, 4`` / ``3 or 4`` into a set and ``[1, 5]`` into an interval: one
    answer is one value."""
    if not parsed:
        return False
    value = parsed[0]
    return not isinstance(value, (set, frozenset, list, tuple)) and type(value).__name__ not in {
        "Interval",
        "Union",
        "FiniteSet",
        "And",
        "Or",
    }


@dataclass(frozen=True)
class MathAnswerGrader:
    """A reward function (``fn(prompt, completion, prompt_ids, completion_ids, *, answer,
    **item)``) that reads the completion's declared final answer and checks it against
    ``answer`` with math-verify. Picklable, so `RewardRunner` can run it in worker processes.

    Args:
        answer_pattern: a regular expression whose first group is the answer (the last match
            counts; matched with ``re.MULTILINE``), e.g. ``r"^Answer:\\s*(.+)$"``. None: the
            content of ``\\boxed{...}``.
        last_number_fallback: with no declared answer, grade the last expression found anywhere in
            the text. Exploitable (see the module docstring); off by default.
    """

    answer_pattern: str | None = None
    last_number_fallback: bool = False

    def declared_answers(self, completion: str) -> list[str]:
        """The answers ``completion`` declares, in order (boxes, or matches of the pattern)."""
        if self.answer_pattern is None:
            return boxed_contents(completion)
        return [m.group(1) for m in re.finditer(self.answer_pattern, completion, re.MULTILINE)]

    def __call__(
        self,
        prompt: str,
        completion: str,
        prompt_ids: list[int],
        completion_ids: list[int],
        *,
        answer: object,
        **data: object,
    ) -> float:
        gold_text = str(answer)
        if "\\boxed" not in gold_text and "$" not in gold_text:
            gold_text = f"${gold_text}$"
        timeout = _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
        gold = _parse(gold_text, timeout)
        if not gold:
            return 0.0
        declared = [a.strip() for a in self.declared_answers(completion)]
        if not declared:
            if not self.last_number_fallback:
                return 0.0
            pred = _parse(completion, timeout)
        else:
            if len({" ".join(a.split()) for a in declared}) > 1 or not declared[-1] or _is_hedge(declared[-1]):
                return 0.0
            pred = _parse(f"${declared[-1]}$", timeout)
            if not _single_value(pred) and _single_value(gold):
                return 0.0
        if not pred:
            return 0.0
        return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0


_STRICT = MathAnswerGrader()


def math_answer_reward(
    prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], *, answer: object, **data: object
) -> float:
    """1.0 when the completion's ``\\boxed{}`` answer (one value, stated once or always the same)
    equals ``answer`` mathematically, else 0.0. `MathAnswerGrader` declares another answer format,
    or (exploitably) falls back to the last number."""
    return _STRICT(prompt, completion, prompt_ids, completion_ids, answer=answer, **data)
