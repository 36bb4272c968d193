"""A smoke run of every script in examples/recipes with its shipped config and tiny overrides (a
tiny model built here, two SFT warm-up steps, two steps of the recipe), in this process: each
ends with its RESULT line. The full GRPO walkthrough, with its accuracy gain, is the slow test."""

from __future__ import annotations

import asyncio
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from areal_lite.api.config_loader import load_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "recipes"
TINY = [
    "task.n_eval=8", "task.n_dev=8", "task.hidden_size=32", "task.num_layers=1", "task.n_train_prompts=64",
]  # fmt: skip
QUIET = ["run.stats_logger.wandb_mode=disabled", "run.stats_logger.console=false", "run.recover.mode=disabled"]
WARMUP = ["warmup.steps=2", "warmup.eval_every=1"]

CASES = {
    "grpo_walkthrough": [*WARMUP, "grpo_steps=2", "samples_per_batch=16", "samples_per_mini_batch=8"],
    "sft": [*QUIET, "steps=2", "samples_per_batch=16"],
    "grpo": [*QUIET, *WARMUP, "steps=2", "samples_per_batch=16", "samples_per_mini_batch=8"],
    "ppo": [*QUIET, *WARMUP, "steps=2", "samples_per_batch=16", "samples_per_mini_batch=8"],
    "dpo": [*QUIET, *WARMUP, "steps=2", "samples_per_batch=8"],
}


@pytest.mark.parametrize("script", list(CASES))
def test_recipe_example(script: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(EXAMPLES))
    try:
        module = importlib.import_module(script)
    finally:
        sys.path.remove(str(EXAMPLES))
    config_cls = next(v for k, v in vars(module).items() if k.endswith("Config") and v.__module__ == script)
    out_key = "output_dir" if script == "grpo_walkthrough" else "run.output_dir"
    argv = [
        "--config",
        str(ROOT / "configs" / "recipes" / f"{script}.yaml"),
        f"{out_key}={tmp_path}",
        *TINY,
        *CASES[script],
    ]
    asyncio.run(module.main(load_config(argv, config_cls)))
    assert re.search(r"^RESULT ", capsys.readouterr().out, re.MULTILINE)


@pytest.mark.slow
def test_grpo_walkthrough_raises_held_out_accuracy(tmp_path: Path) -> None:
    """The acceptance run: SFT warm-up then GRPO on the quickstart's task, +20 points of held-out
    greedy accuracy in at most 10 minutes on 2 CPU cores."""
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "grpo_walkthrough.py"), "--config", "configs/recipes/grpo_walkthrough.yaml",
         f"output_dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    m = re.search(r"^RESULT acc_before=([\d.]+) acc_after=([\d.]+) minutes=([\d.]+)", proc.stdout, re.MULTILINE)
    assert m, proc.stdout[-3000:]
    before, after, minutes = map(float, m.groups())
    assert after >= before + 0.20 and minutes <= 10.0, m.group(0)
