"""Reward graders and the runner: math answers, formats, combinations, the LLM judge, and graders
that raise, hang or return NaN in a batch of good ones."""

from __future__ import annotations

import asyncio
import math
import pickle
import threading
import time

import pytest
from misbehaving_graders import misbehaving_grader

from areal_lite.api.io import ModelRequest, ModelResponse
from areal_lite.rewards import (
    CombinedGrader,
    LLMJudgeGrader,
    MathAnswerGrader,
    RewardRunner,
    boxed_format_reward,
    math_answer_reward,
    think_format_reward,
)
from areal_lite.rewards.math import boxed_contents
from areal_lite.utils.tiny import build_tokenizer


def score_all(runner: RewardRunner, kinds: list[str]) -> list[float]:
    """The scores of samples of ``kinds``, a failed one as None (the runner gives NaN)."""

    async def go() -> list[float]:
        return await asyncio.gather(*(runner("q", "c", [1], [2], kind=k) for k in kinds))

    return [None if math.isnan(x) else x for x in asyncio.run(go())]  # type: ignore[misc]


@pytest.mark.parametrize(
    "completion,answer,expected",
    [
        ("so the answer is \\boxed{1/2}", "0.5", 1.0),
        ("\\boxed{\\frac{3}{6}}", "1/2", 1.0),
        ("7 + 8 = 15, so \\boxed{15}. Check: \\boxed{15}", "15", 1.0),  # the same answer twice
        ("\\boxed{3 apples}", "3", 1.0),
        ("\\boxed{\\text{\\{nested\\}}} then \\boxed{x=2}", "2", 0.0),  # two different answers
        ("the answer is 42", "42", 0.0),  # no declared answer: strict
        ("\\boxed{41}", "42", 0.0),
        ("no idea", "42", 0.0),
    ],
)
def test_math_answer_reward(completion: str, answer: str, expected: float) -> None:
    assert math_answer_reward("q", completion, [], [], answer=answer) == expected


ADVERSARIAL = [
    ("1. First add.\n2. Then check.\n3. Done", "3"),  # the lenient grader's last number: 1.0
    ("The answer is 3", "3"),  # a number, but not in the declared format
    ("$3$", "3"),
    ("3", "3"),
    ("I counted 1, 2, 3, 4, 5, 6, 7, 8, 9 and 10.", "10"),
    ("\\boxed{}", "3"),
    ("\\boxed{3", "3"),  # unclosed
    ("boxed{3}", "3"),  # no backslash
    ("\\boxed{3}, \\boxed{4}", "4"),  # hedging across boxes
    ("\\boxed{4} is wrong, so \\boxed{3}", "3"),
    ("\\boxed{3, 4}", "3"),  # hedging inside one box
    ("\\boxed{3 \\text{ or } 4}", "4"),
    ("\\boxed{3 \\lor 4}", "4"),  # math-verify reads a disjunction as its last operand
    ("\\boxed{3 \\vee 4}", "4"),
    ("\\boxed{\\pm 3}", "3"),
    ("\\boxed{3\\ 4}", "7"),  # math-verify reads spaced numbers as their sum
    ("\\boxed{[1, 5]}", "3"),  # an interval that contains the answer
    ("\\boxed{1 \\le x \\le 5}", "3"),
    ("\\boxed{\\{1, 2, 3, 4, 5\\}}", "3"),
    ("\\boxed{x}", "3"),
    ("\\boxed{-3}", "3"),
    ("\\boxed{2.9999}", "3"),
    ("\\boxed{33}", "3"),
]


@pytest.mark.parametrize("completion,answer", ADVERSARIAL)
def test_strict_math_grader_scores_adversarial_completions_zero(completion: str, answer: str) -> None:
    assert math_answer_reward("q", completion, [], [], answer=answer) == 0.0


def test_math_grader_declared_pattern_and_the_lenient_fallback() -> None:
    answer_line = MathAnswerGrader(answer_pattern=r"^Answer:\s*(.+)$")
    assert answer_line("q", "7 + 8 is 15.\nAnswer: 15", [], [], answer="15") == 1.0
    assert answer_line("q", "7 + 8 is 15.", [], [], answer="15") == 0.0
    assert answer_line("q", "Answer: 14\nAnswer: 15", [], [], answer="15") == 0.0
    lenient = MathAnswerGrader(last_number_fallback=True)
    # What the fallback is for, and the hole it opens (hence off by default):
    assert lenient("q", "the answer is 42", [], [], answer="42") == 1.0
    assert lenient("q", ADVERSARIAL[0][0], [], [], answer="3") == 1.0
    assert lenient("q", "\\boxed{3, 4}", [], [], answer="3") == 0.0  # a declared answer is still strict
    assert pickle.loads(pickle.dumps(answer_line)) == answer_line  # runs in worker processes
    assert boxed_contents("a \\boxed{x^{2}} b \\fbox{3} \\boxed{open") == ["x^{2}", "3"]


def test_format_graders() -> None:
    assert boxed_format_reward("", "x \\boxed{a{b}c}", [], []) == 1.0
    assert boxed_format_reward("", "x boxed a", [], []) == 0.0
    assert think_format_reward("", "<think>because</think> 42", [], []) == 1.0
    assert think_format_reward("", "<think>a</think>", [], []) == 0.0
    assert think_format_reward("", "42 <think>a</think> 1", [], []) == 0.0


def test_combined_grader_weights_and_names_each_part() -> None:
    g = CombinedGrader({"answer": (math_answer_reward, 1.0), "format": (boxed_format_reward, 0.5)})
    assert g("q", "\\boxed{2}", [], [], answer="2") == 1.5
    assert g.named_scores("q", "\\boxed{3}", [], [], answer="2") == {"answer": 0.0, "format": 1.0, "total": 0.5}
    assert not g.safe_in_thread
    assert CombinedGrader({"f": (boxed_format_reward, 1.0)}).safe_in_thread


def test_runner_modes_picked_automatically() -> None:
    assert RewardRunner(boxed_format_reward).mode == "thread"
    assert RewardRunner(math_answer_reward).mode == "process"
    assert RewardRunner(LLMJudgeGrader(engine=None, tokenizer=None)).mode == "async"
    with pytest.raises(ValueError):
        RewardRunner(boxed_format_reward, mode="async")


def test_process_runner_survives_raise_hang_nan_and_a_dead_worker() -> None:
    """Good samples score 1; the bad ones have no score (NaN), are counted by kind, and the batch
    completes."""
    runner = RewardRunner(misbehaving_grader, mode="process", timeout=2.0, num_workers=2)
    try:
        kinds = ["ok"] * 4 + ["raise", "hang", "nan", "exit"] + ["ok"] * 4
        rewards = score_all(runner, kinds)
        assert rewards == [1.0] * 4 + [None] * 4 + [1.0] * 4
        s = runner.stats()
        assert (s["reward/errors"], s["reward/timeouts"], s["reward/nonfinite"], s["reward/crashes"]) == (1, 1, 1, 1)
        assert s["reward/samples"] == 12 and s["reward/total"] == 1.0
        assert score_all(runner, ["ok", "ok"]) == [1.0, 1.0]  # the replaced workers serve
    finally:
        runner.close()


def test_thread_runner_counts_failures_and_abandons_a_hung_call() -> None:
    release = threading.Event()

    def grader(prompt, completion, prompt_ids, completion_ids, *, kind: str) -> float:
        if kind == "hang":
            release.wait()
        return misbehaving_grader(prompt, completion, prompt_ids, completion_ids, kind=kind if kind != "hang" else "ok")

    runner = RewardRunner(grader, mode="thread", timeout=1.0, num_workers=4)
    try:
        assert score_all(runner, ["ok", "raise", "hang", "nan", "ok"]) == [1.0, None, None, None, 1.0]
        s = runner.stats(reset=True)
        assert (s["reward/errors"], s["reward/timeouts"], s["reward/nonfinite"]) == (1, 1, 1)
        assert runner.stats()["reward/samples"] == 0
    finally:
        release.set()
        runner.close()


def test_inline_runner_grades_on_the_loop_and_counts_failures() -> None:
    runner = RewardRunner(misbehaving_grader, mode="inline")
    calls: list[int] = []
    grader = runner.fn
    runner.fn = lambda *a, **k: calls.append(threading.get_ident()) or grader(*a, **k)

    assert score_all(runner, ["ok", "raise", "nan", "ok"]) == [1.0, None, None, 1.0]
    s = runner.stats()
    assert (s["reward/samples"], s["reward/errors"], s["reward/nonfinite"]) == (4, 1, 1)
    assert len(set(calls)) == 1 and calls[0] == threading.get_ident()  # asyncio.run's loop: this thread
    with pytest.raises(ValueError, match="does not fit"):
        RewardRunner(LLMJudgeGrader(engine=None, tokenizer=None), mode="inline")


def returns(value: object):
    def grader(prompt, completion, prompt_ids, completion_ids, **item) -> object:
        return value

    return grader


@pytest.mark.parametrize("value", ["good", "1.0", None, b"1", [1.0]])
def test_a_grader_returning_a_non_number_fails_the_sample(value: object) -> None:
    runner = RewardRunner(returns(value), mode="inline")
    try:
        assert score_all(runner, ["x"]) == [None]
        assert runner.stats()["reward/errors"] == 1
    finally:
        runner.close()
    assert score_all(RewardRunner(returns(True), mode="inline"), ["x"]) == [1.0], "a bool is a number"


HANG_OVER = threading.Event()
"""Set when a hanging-grader test ends, so that its hung threads end too: two threads spinning in
Python for the rest of the run would hold the interpreter lock against every later test in the
process (a fresh clone's make test took 33 minutes with them, 9.4 without)."""


def sleeps(prompt, completion, prompt_ids, completion_ids, **item) -> float:
    HANG_OVER.wait(3600)  # blocked in C: no exception can reach it there
    return 1.0


def spins(prompt, completion, prompt_ids, completion_ids, **item) -> float:
    while not HANG_OVER.is_set():
        pass
    return 1.0


@pytest.mark.parametrize("grader", [sleeps, spins])
def test_a_grader_hanging_in_threads_is_failed_at_once_after_a_few_timeouts(grader) -> None:
    """A grader that hangs (in C or in Python) costs two timeouts per thread, then the runner takes
    it for hung and fails calls without waiting; the hung threads do not keep the process alive."""
    HANG_OVER.clear()
    runner = RewardRunner(grader, mode="thread", timeout=0.5, num_workers=2)
    try:
        t0 = time.monotonic()
        assert score_all(runner, ["x"] * 64) == [None] * 64
        assert time.monotonic() - t0 < 5
        s = runner.stats(reset=True)
        assert s["reward/timeouts"] >= 4 and s["reward/timeouts"] + s["reward/skipped"] == 64
        time.sleep(0.6)  # the hang is taken to be over: calls are tried again
        assert score_all(runner, ["x"]) == [None] and runner.stats()["reward/timeouts"] == 1
        assert all(t.daemon for t in threading.enumerate() if t.name.startswith("reward-thread"))
    finally:
        runner.close()
        HANG_OVER.set()


def test_a_grader_hanging_in_worker_processes_fails_a_batch_promptly() -> None:
    """Process mode (auto for a plain function), 2 workers, a 1 s timeout, 96 samples that all hang:
    without the hung-grader rule they would take 48 timeouts in turn."""
    runner = RewardRunner(misbehaving_grader, mode="process", timeout=1.0, num_workers=2)
    try:
        assert score_all(runner, ["ok"]) == [1.0]  # the workers' start is not the grader's time
        t0 = time.monotonic()
        assert score_all(runner, ["hang"] * 96) == [None] * 96
        assert time.monotonic() - t0 < 15
        s = runner.stats()
        assert s["reward/timeouts"] + s["reward/skipped"] == 96 and s["reward/skipped"] > 80
    finally:
        runner.close()


def test_combined_grader_in_worker_processes_reports_each_component() -> None:
    g = CombinedGrader({"answer": (math_answer_reward, 1.0), "format": (boxed_format_reward, 0.5)})
    runner = RewardRunner(g, mode="process", timeout=20.0, num_workers=1)
    try:

        async def go() -> list[float]:
            return await asyncio.gather(
                runner("q", "\\boxed{2}", [], [], answer="2"), runner("q", "3", [], [], answer="2")
            )

        assert asyncio.run(go()) == [1.5, 0.0]
        s = runner.stats()
        assert (s["reward/answer"], s["reward/format"], s["reward/total"]) == (0.5, 0.5, 0.75)
    finally:
        runner.close()


class ScriptedJudgeEngine:
    """Answers 'yes' when the judge prompt's response contains 42, else 'no'."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.prompts: list[str] = []

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        text = self.tok.decode(req.input_ids)
        self.prompts.append(text)
        verdict = "yes" if "Response: 42" in text else "no"
        out = self.tok(verdict, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        return ModelResponse(req.input_ids, out, [-0.1] * len(out), [0] * len(out), "stop")


def test_llm_judge_asks_the_engine_and_parses_the_verdict() -> None:
    tok = build_tokenizer()
    engine = ScriptedJudgeEngine(tok)
    runner = RewardRunner(LLMJudgeGrader(engine, tok), timeout=10.0)

    async def go() -> list[float]:
        return await asyncio.gather(
            runner("What is 6*7?", "42", [], [], answer="42"), runner("What is 6*7?", "41", [], [])
        )

    assert asyncio.run(go()) == [1.0, 0.0]
    assert "Question: What is 6*7?" in engine.prompts[0] and "Reference answer: 42" in engine.prompts[0]
    assert engine.prompts[0].endswith("<|im_start|>assistant\n")


def test_combined_grader_with_an_llm_judge_awaits_it_and_runs_the_rest_in_workers() -> None:
    """The judge is awaited on the runner's loop (its engine stays in this process); the plain
    math grader runs in its own worker processes; each part is reported by name, and a failing
    part fails the sample (counted), as with plain graders."""
    tok = build_tokenizer()
    engine = ScriptedJudgeEngine(tok)
    g = CombinedGrader({"judge": (LLMJudgeGrader(engine, tok), 1.0), "answer": (math_answer_reward, 0.5)})
    assert g.is_async and not g.safe_in_thread
    with pytest.raises(ValueError, match="does not fit"):
        RewardRunner(g, mode="thread")  # it used to score 0 there without a word
    with pytest.raises(TypeError, match="anamed_scores"):
        g.named_scores("q", "42", [], [], answer="42")
    runner = RewardRunner(g, timeout=60.0)
    assert runner.mode == "async"
    try:

        async def go() -> list[float]:
            return await asyncio.gather(
                runner("What is 6*7?", "42 = \\boxed{42}", [], [], answer="42"),
                runner("What is 6*7?", "41 = \\boxed{41}", [], [], answer="42"),
                runner("What is 6*7?", "42 = \\boxed{42}", [], []),  # no reference: math_answer_reward raises
            )

        assert [x if math.isfinite(x) else None for x in asyncio.run(go())] == [1.5, 0.0, None]
        s = runner.stats()
        assert (s["reward/judge"], s["reward/answer"], s["reward/total"]) == (0.5, 0.5, 0.75)
        assert s["reward/errors"] == 1.0 and s["reward/samples"] == 3.0
        assert len(engine.prompts) == 3
        assert g._runners["answer"].mode == "process"  # type: ignore[attr-defined]
    finally:
        runner.close()
    assert g._runners == {}
