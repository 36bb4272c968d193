"""The algorithm presets and the distillation example: each preset config picks the functions its
table in examples/presets.py says, one preset runs end to end for two steps, and so does the
distillation example (SFT of a teacher and a student, then two distillation steps), on tiny models
built here."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from areal_lite.actors.ppo import PPOActor, dr_grpo_estimator, grpo_estimator, rloo_estimator
from areal_lite.algorithms import functional as F
from areal_lite.api.config_loader import load_config
from areal_lite.utils.tiny import build_tiny_model

sys.path.insert(0, str(Path(__file__).parent))
from test_examples import ENV, QUIET, ROOT


def load_script(name: str) -> object:
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclass type hints resolve in the module's namespace
    spec.loader.exec_module(module)
    return module


class NoEngine:
    """Building an actor needs no engine."""


PRESETS = {
    "dapo": (F.ppo_policy_loss, grpo_estimator, "token-mean"),
    "dr_grpo": (F.ppo_policy_loss, dr_grpo_estimator, "seq-mean-token-sum"),
    "gspo": (F.gspo_policy_loss, grpo_estimator, "seq-mean-token-mean"),
    "rloo": (F.reinforce_policy_loss, rloo_estimator, "seq-mean-token-sum"),
}


@pytest.mark.parametrize("preset", list(PRESETS))
def test_each_preset_picks_its_functions(preset: str) -> None:
    presets = load_script("presets")
    cfg = load_config(["--config", str(ROOT / "configs" / f"{preset}.yaml")], presets.PresetConfig, save=False)  # type: ignore[attr-defined]
    actor = PPOActor(cfg.actor, NoEngine())  # type: ignore[arg-type]
    loss, advantages, aggregation = PRESETS[preset]
    assert actor.policy_loss.func is loss  # type: ignore[attr-defined]
    assert actor.advantage_fn is advantages
    assert actor.aggregation is F.AGGREGATIONS[aggregation]
    assert cfg.dynamic_sampling == (preset == "dapo")
    if preset == "dapo":
        assert actor.policy_loss.keywords["eps_clip_higher"] == 0.28  # type: ignore[attr-defined]
        assert cfg.actor.overlong_penalty_len > 0 and cfg.actor.max_new_tokens == cfg.gconfig.max_new_tokens
    if preset == "gspo":
        assert cfg.actor.eps_clip == 3e-4 and cfg.actor.eps_clip_higher == 4e-4


def run(script: str, config: str, *overrides: str, timeout: float = 300) -> str:
    cmd = [sys.executable, f"examples/{script}", "--config", f"configs/{config}", *overrides, *QUIET]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} exited with {proc.returncode}:\n{out[-4000:]}"
    return proc.stdout


def test_dapo_preset_runs(tmp_path: Path) -> None:
    """Two DAPO steps: two minibatches, clip-higher, the overlong penalty. Dynamic sampling is off:
    a random model never answers right, so every group would be dropped (executor tests cover
    ``should_accept``)."""
    tiny = build_tiny_model(
        str(tmp_path / "model"), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, max_position_embeddings=256
    )
    out = run(
        "presets.py", "dapo.yaml", f"cluster.fileroot={tmp_path}", f"actor.path={tiny}", "total_train_steps=2",
        "task.n_eval=4", "task.n_train_prompts=64", "train_dataset.batch_size=4", "actor.group_size=2",
        "dynamic_sampling=false",
    )  # fmt: skip
    assert re.search(r"^RESULT acc_before=[\d.]+ acc_after=[\d.]+ rejected_groups=0$", out, re.MULTILINE), out


def test_distillation_example_runs(tmp_path: Path) -> None:
    out = run(
        "distill.py", "distill.yaml", f"cluster.fileroot={tmp_path}", "total_train_steps=2",
        "task.hidden_size=32", "task.num_layers=1", "task.sft_steps=4", "task.sft_eval_every=2",
        "task.sft_batch_size=16", "task.n_dev=8", "task.n_eval=8", "task.n_train_prompts=64",
        "teacher.hidden_size=32", "teacher.num_layers=1", "teacher.sft_steps=4", "train_dataset.batch_size=4",
        "local_engine.max_running_requests=16",
    )  # fmt: skip
    pattern = r"^RESULT teacher_acc=[\d.]+ student_before=[\d.]+ student_after=[\d.]+ gap_closed=\S+ minutes="
    assert re.search(pattern, out, re.MULTILINE), out
    run_dir = tmp_path / "distill" / "demo"
    assert (run_dir / "teacher_model" / "config.json").exists() and (run_dir / "student_model" / "config.json").exists()
