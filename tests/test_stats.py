"""Stats tracker reductions (one process and two ranks) and the stats logger's outputs: the console
(a short line per step, the full table every N steps, no control characters off a terminal),
tensorboard, wandb offline, warnings on a failing run, the curves PNG, and its recover state."""

from __future__ import annotations

import glob
import io
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from areal_lite.api.config import StatsLoggerConfig
from areal_lite.utils.distributed import find_free_port
from areal_lite.utils.stats import StatsTracker, StepStats
from areal_lite.utils.stats_logger import StatsLogger

HERE = os.path.dirname(os.path.abspath(__file__))


def test_tracker_reductions_in_one_process() -> None:
    t = StatsTracker()
    t.scalar(loss=1.0)
    t.scalar(loss=3.0)
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[True, True, False], [True, False, True]])
    t.stat("reward", values, mask=mask)
    t.total(n_tokens=5)
    t.total(n_tokens=7)
    t.dist("staleness", torch.tensor([0, 1, 1, 2]))
    with t.timer("train"):
        pass
    out = t.export()
    kept = values[mask]
    assert out.scalars["loss"] == 2.0
    assert out.scalars["reward/mean"] == pytest.approx(kept.mean().item())
    assert out.scalars["reward/std"] == pytest.approx(kept.std(unbiased=False).item())
    assert (out.scalars["reward/min"], out.scalars["reward/max"]) == (1.0, 6.0)
    assert out.scalars["n_tokens"] == 12
    assert out.histograms["staleness"] == [0.0, 1.0, 1.0, 2.0]
    assert out.scalars["staleness/max"] == 2.0
    assert out.scalars["timing/train"] >= 0.0
    assert t.export().scalars == {}, "export starts a fresh step"


def test_tracker_reduces_across_two_ranks(tmp_path) -> None:
    out_file = tmp_path / "out.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(find_free_port()),
        os.path.join(HERE, "scripts", "stats_reduce.py"),
        str(out_file),
    ]
    proc = subprocess.run(
        cmd, check=False, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(out_file.read_text())
    s = out["scalars"]
    rewards = torch.tensor([0.0, 1.0, 2.0, 10.0, 11.0])  # rank 1's third element is masked out
    assert s["loss"] == 1.5
    assert s["only_rank1"] == 7.0
    assert s["reward/mean"] == pytest.approx(rewards.mean().item())
    assert s["reward/std"] == pytest.approx(rewards.std(unbiased=False).item())
    assert (s["reward/min"], s["reward/max"]) == (0.0, 11.0)
    assert s["n_tokens"] == 300
    assert sorted(out["histograms"]["staleness"]) == [0.0, 1.0, 1.0, 2.0]


def _config(**kw: object) -> StatsLoggerConfig:
    return StatsLoggerConfig(**{"console": False, "wandb_mode": "disabled", **kw})  # type: ignore[arg-type]


def test_warnings_on_a_failing_run(tmp_path) -> None:
    log = StatsLogger(_config(collapse_steps=3, kl_max=0.5), str(tmp_path))
    for step in range(5):
        log.commit(step, {"reward_std": 0.0, "approx_kl": 0.01})
    collapse = [w for w in log.warnings if "reward_std" in w]
    assert len(collapse) == 1 and collapse[0].startswith("step 3:"), log.warnings
    log.commit(5, {"reward_std": 0.3, "approx_kl": 2.0})
    log.commit(6, {"reward_std": 0.3, "approx_kl": float("nan")})
    assert any("approx_kl=2" in w for w in log.warnings)
    assert any("non-finite" in w and "approx_kl" in w for w in log.warnings)
    healthy = StatsLogger(_config(collapse_steps=3), str(tmp_path / "ok"))
    for step in range(5):
        healthy.commit(step, {"reward_std": 0.0 if step % 2 else 0.4, "approx_kl": 0.01})
    assert healthy.warnings == []


def test_kl_warning_watches_the_kl_to_the_reference_when_there_is_one(tmp_path) -> None:
    log = StatsLogger(_config(kl_max=0.5), str(tmp_path))
    log.commit(0, {"approx_kl": 0.01, "kl_ref": 0.7})  # the reference has drifted
    log.commit(1, {"approx_kl": 0.9, "kl_ref": 0.1})  # a large step, still near the reference
    log.commit(2, {"approx_kl": 0.9})  # no reference: the per-update KL is watched
    assert len(log.warnings) == 2, log.warnings
    assert log.warnings[0].startswith("step 1: kl_ref=0.7") and "reference" in log.warnings[0]
    assert log.warnings[1].startswith("step 3: approx_kl=0.9")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


PPO_STEP = {
    "reward_mean": 0.52,
    "reward_std": 0.3,
    "approx_kl": 0.0031,
    "behav_kl": 0.0042,
    "loss": -0.012,
    "advantage_mean": 0.0,
    "grad_norm": 1.7,
    "rollout/staleness_max": 2.0,
    "rollout/staleness_mean": 1.25,
    "rollout/accepted": 64.0,
}


def test_console_shows_one_short_line_per_step(tmp_path) -> None:
    out = io.StringIO()
    log = StatsLogger(_config(console=True), str(tmp_path), total_steps=3, stream=out)
    log.commit(0, PPO_STEP)
    log.commit(1, PPO_STEP, {"eval/accuracy": 0.61})
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    first = r"step 1/3  reward 0\.52  loss -0\.012  kl_behav 0\.0042  stale 2  time [\d.e-]+s"
    assert re.fullmatch(first, lines[0]), lines[0]
    assert re.fullmatch(r"step 2/3  reward 0\.52  acc 0\.61  loss .*  time [\d.e-]+s  eta \d+s", lines[1]), lines[1]
    assert "kl_ref" not in lines[1] and "grad_norm" not in lines[1], "missing keys and keys not asked for stay out"
    custom = io.StringIO()
    log = StatsLogger(
        _config(console=True, console_keys=["grad_norm", "mean stale=rollout/staleness_mean", "nope"]),
        str(tmp_path),
        stream=custom,
    )
    log.commit(0, PPO_STEP)
    assert custom.getvalue() == "step 1  grad_norm 1.7  mean stale 1.25\n"


def test_console_prints_the_full_table_every_n_steps(tmp_path) -> None:
    out = io.StringIO()
    log = StatsLogger(_config(console=True, full_stats_every=2), str(tmp_path), total_steps=5, stream=out)
    for step in range(5):
        log.commit(step, PPO_STEP)
    text = out.getvalue()
    tables = re.findall(r"^step (\d+), all statistics:$", text, re.MULTILINE)
    assert tables == ["2", "4", "5"], "every 2 steps and the last"
    table = text.split("step 4, all statistics:\n")[1].split("step 5/5")[0]
    for key in [*PPO_STEP, "timing/step"]:
        assert re.search(rf"(^  |   ){re.escape(key)} +-?[\d.]", table, re.MULTILINE), f"{key} missing from\n{table}"
    out = io.StringIO()
    log = StatsLogger(_config(console=True, full_stats_every=0), str(tmp_path), total_steps=2, stream=out)
    log.commit(0, PPO_STEP)
    log.commit(1, PPO_STEP)
    assert "all statistics" not in out.getvalue()


def test_no_control_characters_unless_on_a_terminal(tmp_path) -> None:
    plain, terminal = io.StringIO(), _Terminal()
    for stream in (plain, terminal):
        cfg = _config(console=True, full_stats_every=2)
        log = StatsLogger(cfg, str(tmp_path), total_steps=3, run_name="run", stream=stream)
        for step in range(3):
            log.commit(step, PPO_STEP)
        log.close()
    assert not re.search(r"[\r\x1b]", plain.getvalue()), repr(plain.getvalue())
    assert "run:" not in plain.getvalue(), "no progress bar in a log file"
    assert "\r" in terminal.getvalue() and "3/3" in terminal.getvalue(), "a progress bar on a terminal"
    assert re.search(r"\rstep 2  reward 0\.52", terminal.getvalue()), "the line above the bar"


def test_tensorboard_wandb_and_curves_get_every_statistic(tmp_path) -> None:
    cfg = StatsLoggerConfig(
        console=False, tensorboard=True, wandb_mode="offline", plot_keys=["reward/mean", "eval/accuracy"]
    )
    log = StatsLogger(cfg, str(tmp_path), total_steps=4, run_name="t")
    for step in range(4):
        log.commit(
            step,
            {"reward/mean": 0.1 * step, "n_tokens": 100.0},
            StepStats({"eval/accuracy": 0.2 * step}, {"staleness": [0.0, 1.0]}),
        )
    png = log.close()
    assert png == os.path.join(str(tmp_path), "curves.png")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(str(tmp_path), "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("eval/accuracy")] == pytest.approx([0.0, 0.2, 0.4, 0.6])
    assert "perf/tokens_per_s" in acc.Tags()["scalars"]
    assert "staleness" in acc.Tags()["histograms"]
    assert glob.glob(os.path.join(str(tmp_path), "wandb", "offline-run-*", "run-*.wandb"))


def test_state_dict_keeps_the_curves_across_a_resume(tmp_path) -> None:
    first = StatsLogger(_config(collapse_steps=2), str(tmp_path))
    first.commit(0, {"reward_mean": 0.5, "reward_std": 0.0})
    state = first.state_dict()
    resumed = StatsLogger(_config(collapse_steps=2), str(tmp_path))
    resumed.load_state_dict(json.loads(json.dumps(state)))
    resumed.commit(1, {"reward_mean": 0.7, "reward_std": 0.0})
    assert resumed.history["reward_mean"] == [(0, 0.5), (1, 0.7)]
    assert len(resumed.warnings) == 1, "the collapse streak continues across the resume"
    assert resumed.close() is not None
