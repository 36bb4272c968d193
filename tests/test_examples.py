"""A smoke run of every example script with its shipped config and tiny overrides: two or three
steps on a tiny model built here (nothing is downloaded), ending with exit status 0, the script's
RESULT line and its final checkpoint.

The RL examples run with two trainer ranks under the launcher (all but the quickstart marked slow,
half a minute each on two cores, as is a resumed run: `make test-long` runs them, and CI), with a recorder in front of each
(tests/scripts/record_prompts.py) that logs every prompt a rank draws: the ranks' prompts must be
disjoint. The quickstart and the GSM8K recipe use our rollout server in its own process (both
ranks its clients, rank 0 controlling it; GSM8K's weights go by a gloo broadcast, the path NCCL
takes on GPU); the others run an embedded engine in each trainer rank."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from areal_lite.utils.tiny import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
QUIET = [
    "stats_logger.console=false",
    "stats_logger.tensorboard=false",
    "stats_logger.wandb_mode=disabled",
    "recover.mode=disabled",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "model"
    return build_tiny_model(
        str(path), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, max_position_embeddings=256
    )


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def run(script: str, config: str, *overrides: str, launcher: bool = False, timeout: float = 240) -> str:
    """Run an example to completion; return its output, which must hold a RESULT line."""
    cmd = [sys.executable, *(["-m", "areal_lite.launcher.local"] if launcher else []), f"examples/{script}"]
    return _run(cmd + ["--config", f"configs/{config}", *overrides], ENV, script, timeout)


def run_two_ranks(script: str, config: str, record_dir: Path, *overrides: str, timeout: float = 300) -> str:
    """Run an RL example under the launcher with two trainer ranks, recording each rank's prompts
    in ``record_dir``; return its output, which must hold a RESULT line."""
    record_dir.mkdir()
    env = {**ENV, "RECORD_EXAMPLE": f"examples/{script}", "RECORD_DIR": str(record_dir)}
    cmd = [sys.executable, "-m", "areal_lite.launcher.local", str(ROOT / "tests" / "scripts" / "record_prompts.py")]
    cmd += ["--config", f"configs/{config}", *overrides, "launcher.trainer_nproc=2"]
    return _run(cmd, env, script, timeout)


def _run(cmd: list[str], env: dict[str, str], script: str, timeout: float) -> str:
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} exited with {proc.returncode}:\n{out[-4000:]}"
    assert re.search(r"^RESULT ", proc.stdout, re.MULTILINE), f"{script} printed no RESULT line:\n{out[-4000:]}"
    return proc.stdout


def final_checkpoint(output_dir: Path, steps: int) -> Path:
    return output_dir / "checkpoints" / f"globalstep{steps}" / "config.json"


def assert_disjoint_shares(record_dir: Path, at_least: int) -> None:
    """Each of the two ranks drew at least ``at_least`` prompts, and no prompt went to both."""
    shares = [(record_dir / f"rank{r}.jsonl").read_text().splitlines() for r in (0, 1)]
    assert all(len(share) >= at_least for share in shares), [len(share) for share in shares]
    assert not set(shares[0]) & set(shares[1]), "the two trainer ranks drew the same prompts"
    assert all(len(set(share)) == len(share) for share in shares), "a rank drew a prompt twice in one epoch"


def test_quickstart(tmp_path: Path) -> None:
    """The demo's path: the SFT warm-up (on both ranks) in the launcher's prepare run, our server,
    two trainer ranks as its clients."""
    out = run_two_ranks(
        "quickstart.py",
        "quickstart.yaml",
        tmp_path / "prompts",
        f"cluster.fileroot={tmp_path}",
        "local_engine.max_running_requests=32",
        "task.sft_steps=10",
        "task.sft_eval_every=5",
        "task.sft_batch_size=16",
        "task.n_dev=8",
        "task.n_eval=8",
        "task.n_train_prompts=64",
        "task.hidden_size=32",
        "task.num_layers=1",
        "total_train_steps=2",
        "train_dataset.batch_size=4",
        "rollout.consumer_batch_size=4",
        *QUIET,
    )
    assert re.search(r"^RESULT acc_before=[\d.]+ acc_after=[\d.]+ minutes=", out, re.MULTILINE)
    assert out.count("RESULT") == 1, "only rank 0 reports"
    assert_disjoint_shares(tmp_path / "prompts", at_least=2 * 4)


@pytest.mark.slow  # make test-long
def test_gsm8k_grpo_with_a_rollout_server(tmp_path: Path, tiny: str) -> None:
    rows = [
        {"question": f"Tom has {i} apples and buys 3 more. How many?", "answer": f"{i} + 3 = {i + 3}\n#### {i + 3}"}
        for i in range(32)
    ]
    # Rows the run cannot use: left out (train_dataset.on_bad_row=skip) and counted in the statistics.
    bad = [{"question": "No answer here"}, {"question": 7, "answer": "#### 7"}, {"question": "Q?", "answer": "7"}]
    data = write_jsonl(tmp_path / "gsm8k.jsonl", rows[:5] + bad + rows[5:])
    out = run_two_ranks(
        "gsm8k_grpo.py",
        "gsm8k_grpo.yaml",
        tmp_path / "prompts",
        f"cluster.fileroot={tmp_path}",
        f"actor.path={tiny}",
        f"train_dataset.path={data}",
        f"valid_dataset.path={data}",
        "n_eval=4",
        "total_train_steps=2",
        "train_dataset.batch_size=2",
        "actor.group_size=2",
        "actor.dtype=float32",
        "actor.gradient_checkpointing=false",
        "gconfig.max_new_tokens=8",
        "reward_workers=1",
        "weight_update=distributed",  # a gloo broadcast from trainer rank 0 to the server
        "launcher.backend=areal",
        "local_engine.device=cpu",  # our server runs the embedded engine with these settings
        "local_engine.dtype=float32",
        "launcher.n_servers=1",
        "launcher.server_args=[]",
        *QUIET,
        "train_dataset.on_bad_row=skip",
        "valid_dataset.on_bad_row=skip",
        "stats_logger.console=true",
    )
    assert re.search(r"RESULT steps=2 eval_accuracy=[\d.]+", out)
    assert re.search(r"data/left_out/bad +3\b", out), "the left-out rows are in the last step's statistics"
    assert final_checkpoint(tmp_path / "gsm8k-grpo" / "trial0", 2).exists()
    assert_disjoint_shares(tmp_path / "prompts", at_least=2 * 2)


RL_TINY = ["total_train_steps=2", "task.n_eval=4", "task.n_train_prompts=64", "gconfig.max_new_tokens=4"]


@pytest.mark.slow  # make test-long
def test_remax(tmp_path: Path, tiny: str) -> None:
    out = run_two_ranks(
        "remax.py",
        "remax.yaml",
        tmp_path / "prompts",
        f"cluster.fileroot={tmp_path}",
        f"actor.path={tiny}",
        *RL_TINY,
        "train_dataset.batch_size=4",
        *QUIET,
    )
    assert re.search(r"RESULT acc_before=[\d.]+ acc_after=[\d.]+", out)
    assert final_checkpoint(tmp_path / "remax" / "trial0", 2).exists()
    assert_disjoint_shares(tmp_path / "prompts", at_least=2 * 4)


@pytest.mark.slow  # make test-long
def test_ppo_critic(tmp_path: Path, tiny: str) -> None:
    out = run_two_ranks(
        "ppo_critic.py",
        "ppo_critic.yaml",
        tmp_path / "prompts",
        f"cluster.fileroot={tmp_path}",
        f"actor.path={tiny}",
        *RL_TINY,
        "train_dataset.batch_size=4",
        *QUIET,
    )
    assert re.search(r"RESULT acc_before=[\d.]+ acc_after=[\d.]+", out)
    assert final_checkpoint(tmp_path / "ppo-critic" / "trial0", 2).exists()
    assert_disjoint_shares(tmp_path / "prompts", at_least=2 * 4)


@pytest.mark.slow  # make test-long
def test_multi_turn(tmp_path: Path, tiny: str) -> None:
    out = run_two_ranks(
        "multi_turn.py",
        "multi_turn.yaml",
        tmp_path / "prompts",
        f"cluster.fileroot={tmp_path}",
        f"actor.path={tiny}",
        *RL_TINY,
        "train_dataset.batch_size=2",
        "actor.group_size=2",
        *QUIET,
    )
    assert re.search(r"RESULT reward_before=[\d.]+ reward_after=[\d.]+", out)
    assert final_checkpoint(tmp_path / "multi-turn" / "trial0", 2).exists()
    assert_disjoint_shares(tmp_path / "prompts", at_least=2 * 2)


def test_dpo_on_local_pairs(tmp_path: Path, tiny: str) -> None:
    pairs = [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(8)]
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    out = run(
        "dpo.py",
        "dpo.yaml",
        f"cluster.fileroot={tmp_path}",
        f"actor.path={tiny}",
        f"train_dataset.path={data}",
        f"valid_dataset.path={data}",
        "total_train_steps=3",
        "train_dataset.batch_size=2",
        "task.n_eval=4",
        *QUIET,
    )
    assert re.search(r"RESULT loss_before=0\.693 loss_after=[\d.]+ reward_accuracy_after=[\d.]+", out), out
    assert final_checkpoint(tmp_path / "dpo" / "trial0", 3).exists()


def test_sft_on_a_local_jsonl(tmp_path: Path, tiny: str) -> None:
    rows = [{"prompt": f"{i}+2=", "completion": str(i + 2)} for i in range(6)]
    rows.append({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    data = write_jsonl(tmp_path / "sft.jsonl", rows)
    out = run(
        "sft.py",
        "sft.yaml",
        f"cluster.fileroot={tmp_path}",
        f"actor.path={tiny}",
        "task.tiny_model=false",
        f"train_dataset.path={data}",
        f"valid_dataset.path={data}",
        "total_train_steps=3",
        "train_dataset.batch_size=2",
        "task.n_eval=4",
        *QUIET,
    )
    before, after = map(float, re.search(r"RESULT loss_before=([\d.]+) loss_after=([\d.]+)", out).groups())  # type: ignore[union-attr]
    assert after < before, "three steps on the evaluated data lower its loss"
    assert final_checkpoint(tmp_path / "sft" / "trial0", 3).exists()


def test_sft_default_config_builds_its_model(tmp_path: Path) -> None:
    out = run(
        "sft.py",
        "sft.yaml",
        f"cluster.fileroot={tmp_path}",
        "task.hidden_size=32",
        "task.num_layers=1",
        "task.n_train=64",
        "task.n_eval=8",
        "total_train_steps=2",
        "train_dataset.batch_size=8",
        *QUIET,
    )
    assert "RESULT loss_before=" in out
    assert (tmp_path / "sft" / "trial0" / "base_model" / "config.json").exists()


@pytest.mark.slow  # make test-long: two runs of the SFT example
def test_a_resumed_example_reports_the_score_it_measured_before_training(tmp_path: Path) -> None:
    """`RunKit.once`: the held-out score before training goes into every recover checkpoint, and a
    resumed run reports that score, not one of its partly trained model."""
    args = [
        f"cluster.fileroot={tmp_path}",
        "task.hidden_size=32",
        "task.num_layers=1",
        "task.n_train=64",
        "task.n_eval=8",
        "train_dataset.batch_size=8",
        *QUIET,
        "recover.mode=auto",
    ]
    first = run("sft.py", "sft.yaml", *args, "total_train_steps=2")
    second = run("sft.py", "sft.yaml", *args, "total_train_steps=4")
    assert "resumed after step 2" in second
    before = [re.search(r"^RESULT loss_before=([\d.]+)", out, re.MULTILINE).group(1) for out in (first, second)]  # type: ignore[union-attr]
    assert before[0] == before[1]


@pytest.mark.slow  # make test-long
def test_agent(tmp_path: Path) -> None:
    """The openai-agents calculator agent: its SFT warm-up builds the model, then RL over episodes
    on two trainer ranks."""
    pytest.importorskip("agents")
    out = run_two_ranks(
        "agent.py",
        "agent.yaml",
        tmp_path / "prompts",
        f"cluster.fileroot={tmp_path}",
        "task.sft_steps=4",
        "task.sft_eval_every=2",
        "task.sft_pool=16",
        "task.sft_batch_size=4",
        "task.n_dev=4",
        "task.n_eval=4",
        "task.n_train=64",
        "task.hidden_size=32",
        "task.num_layers=1",
        "total_train_steps=2",
        "train_dataset.batch_size=2",
        "actor.group_size=2",
        *QUIET,
    )
    assert re.search(r"^RESULT reward_before=[\d.]+ reward_after=[\d.]+ minutes=", out, re.MULTILINE)
    assert out.count("RESULT") == 1, "only rank 0 reports"
    assert final_checkpoint(tmp_path / "agent" / "trial0", 2).exists()
    assert_disjoint_shares(tmp_path / "prompts", at_least=2 * 2)
