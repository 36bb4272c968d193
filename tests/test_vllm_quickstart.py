"""The quickstart under the launcher with ``launcher.backend=vllm`` on this machine: the SFT warm-up
in the prepare run, one real vLLM server (vLLM's CPU build without a GPU) started by the launcher
from vLLM's own venv, two trainer ranks as its clients, weights pushed by gloo broadcast after each
step. A short run: the full one, and what it learns, is in the README. Marked ``vllm``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_with_a_vllm_server(tmp_path: Path) -> None:
    overrides = [
        "launcher.backend=vllm",
        "launcher.trainer_nproc=2",
        "weight_update=distributed",
        f"cluster.fileroot={tmp_path}",
        "task.sft_steps=20",
        "task.sft_eval_every=10",
        "task.sft_batch_size=32",
        "task.n_dev=16",
        "task.n_eval=16",
        "task.n_train_prompts=128",
        "task.num_layers=1",  # hidden 128, 4 heads: head size 32, which vLLM's CPU attention takes
        "total_train_steps=3",
        "train_dataset.batch_size=4",
        "rollout.consumer_batch_size=4",
        "stats_logger.tensorboard=false",
        "stats_logger.wandb_mode=disabled",
        "recover.mode=disabled",
    ]
    cmd = [sys.executable, "-m", "areal_lite.launcher.local", "examples/quickstart.py"]
    cmd += ["--config", "configs/quickstart.yaml", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    out = proc.stdout + proc.stderr
    logs = tmp_path / "quickstart" / "demo" / "logs"
    server_log = (logs / "server0.log").read_text(errors="replace") if (logs / "server0.log").exists() else ""
    assert proc.returncode == 0, f"exited with {proc.returncode}:\n{out[-4000:]}\nserver log:\n{server_log[-3000:]}"
    assert re.search(r"^RESULT acc_before=[\d.]+ acc_after=[\d.]+ minutes=", proc.stdout, re.MULTILINE), out[-4000:]
    assert len(json.loads((logs / "servers.json").read_text())) == 1
    # The broadcasts went through vLLM's own reload (a failed one would have failed the trainer).
    assert "Reloading weights inplace" in server_log, server_log[-3000:]
