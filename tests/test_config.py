"""Config loading: YAML plus dotted overrides over the dataclass schema, with clear errors."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import pytest
import yaml

from areal_lite.api.config import READS_FILE, PPOActorConfig, one_of
from areal_lite.api.config_loader import ConfigChecked, ConfigError, checking_only, input_paths, load_config
from areal_lite.api.experiment_config import BaseExperimentConfig


@dataclass
class TaskConfig:
    mode: str = field(default="fast", metadata=one_of("fast", "slow"))
    data: str = field(default="", metadata=READS_FILE)


@dataclass
class ExpConfig(BaseExperimentConfig):
    actor: PPOActorConfig = field(default_factory=PPOActorConfig)
    task: TaskConfig = field(default_factory=TaskConfig)


def write_yaml(path: str, data: dict) -> str:
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    return path


def test_yaml_then_overrides_merge_over_schema(tmp_path) -> None:
    cfg_file = write_yaml(
        str(tmp_path / "c.yaml"),
        {"actor": {"path": "/m", "optimizer": {"lr": 3e-4}}, "cluster": {"fileroot": str(tmp_path / "out")}},
    )
    cfg = load_config(
        ["--config", cfg_file, "actor.optimizer.lr=1e-5", "actor.mb_spec.max_tokens_per_mb=256"], ExpConfig
    )
    assert isinstance(cfg, ExpConfig)
    assert cfg.actor.path == "/m"
    assert cfg.actor.optimizer.lr == 1e-5  # the command line wins over the file
    assert cfg.actor.mb_spec.max_tokens_per_mb == 256
    assert cfg.actor.optimizer.beta1 == 0.9  # schema default kept
    saved = os.path.join(cfg.output_dir, "config.yaml")
    assert os.path.exists(saved)
    with open(saved) as f:
        assert yaml.safe_load(f)["actor"]["optimizer"]["lr"] == 1e-5


def test_unknown_key_names_closest_valid_keys() -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'actor.optimizer.lrr'.*actor.optimizer.lr"):
        load_config(["actor.path=/m", "actor.optimizer.lrr=1e-5"], ExpConfig, save=False)


def test_unknown_key_in_yaml_names_the_file(tmp_path) -> None:
    cfg_file = write_yaml(str(tmp_path / "c.yaml"), {"actor": {"path": "/m", "eps_clp": 0.1}})
    with pytest.raises(ConfigError, match=r"'actor.eps_clp' \(from .*c.yaml\).*actor.eps_clip"):
        load_config(["--config", cfg_file], ExpConfig, save=False)


def test_wrong_type_names_field_and_expected_type() -> None:
    with pytest.raises(ConfigError, match=r"'actor.optimizer.lr'.*expected float"):
        load_config(["actor.path=/m", "actor.optimizer.lr=fast"], ExpConfig, save=False)


def test_missing_required_value_is_named() -> None:
    with pytest.raises(ConfigError, match="actor.path"):
        load_config([], ExpConfig, save=False)


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "actor.optimizer.lr_scheduler_type=step",
            "'actor.optimizer.lr_scheduler_type' is 'step'; choose one of constant, linear, cosine",
        ),
        ("actor.backend=deepspeed", "'actor.backend' is 'deepspeed'; choose one of fsdp, megatron"),
        ("actor.dtype=fp16", "'actor.dtype' is 'fp16'; choose one of float32, bfloat16, float16, auto"),
        ("stats_logger.wandb_mode=offline_sync", "'stats_logger.wandb_mode'"),
        ("launcher.backend=tgi", "'launcher.backend' is 'tgi'; choose one of local, areal, sglang, vllm"),
        ("task.mode=medium", "'task.mode' is 'medium'; choose one of fast, slow"),  # a script's own section
        ("actor.cpu.fp32_linear=mkl", "'actor.cpu.fp32_linear' is 'mkl'; choose one of auto, onednn, torch"),
    ],
)
def test_invalid_choice_names_the_field_the_value_and_the_choices(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(["actor.path=/m", override], ExpConfig, save=False)


def test_every_choice_field_accepts_its_default() -> None:
    cfg = load_config(["actor.path=/m"], ExpConfig, save=False)
    assert cfg.actor.adv_estimator == "grpo" and cfg.task.mode == "fast"


def test_the_cpu_switches_are_config_fields() -> None:
    """`CPUConfig` sits in a train engine's config (and the embedded engine's): dotted overrides
    reach it, and its fields keep their types."""
    cfg = load_config(
        ["actor.path=/m", "actor.cpu.fused_ops=false", "actor.cpu.kernel_arch=x86-64-v3"], ExpConfig, save=False
    )
    assert cfg.actor.cpu.fused_ops is False and cfg.actor.cpu.kernel_arch == "x86-64-v3"
    assert cfg.actor.cpu.decode_attention is True and cfg.actor.cpu.fp32_linear == "auto"
    with pytest.raises(ConfigError, match="actor.cpu.fused_ops"):
        load_config(["actor.path=/m", "actor.cpu.fused_ops=sometimes"], ExpConfig, save=False)


def test_input_paths_are_the_marked_fields() -> None:
    cfg = load_config(["actor.path=/m", "task.data=/d.jsonl", "train_dataset.path=/t.parquet"], ExpConfig, save=False)
    assert input_paths(cfg) == {
        "actor.path": ("model", "/m"),
        "train_dataset.path": ("file", "/t.parquet"),
        "task.data": ("file", "/d.jsonl"),
    }, "empty paths are left out"


def test_checking_only_validates_and_neither_returns_nor_saves(tmp_path) -> None:
    args = ["actor.path=/m", f"cluster.fileroot={tmp_path}"]
    with checking_only(), pytest.raises(ConfigChecked) as checked:
        load_config(args, ExpConfig)
    assert isinstance(checked.value.config, ExpConfig) and not list(tmp_path.iterdir())
    with checking_only(), pytest.raises(ConfigError, match="task.mode"):
        load_config([*args, "task.mode=x"], ExpConfig)
    assert isinstance(load_config(args, ExpConfig, save=False), ExpConfig), "only inside the block"


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(["--config", "/nonexistent.yaml"], ExpConfig, save=False)
    with pytest.raises(ConfigError, match="unexpected argument"):
        load_config(["--lr", "3"], ExpConfig, save=False)


def test_the_cpu_profile_sits_between_the_file_and_the_command_line(tmp_path) -> None:
    """``profile=cpu`` overrides the file (a GPU recipe's settings), the command line overrides
    the profile, and keys the config class lacks (``reward_workers``, ``local_engine``) are skipped."""
    cfg_file = write_yaml(
        str(tmp_path / "gpu.yaml"),
        {"actor": {"path": "m", "dtype": "auto", "gradient_checkpointing": True, "group_size": 8},
         "launcher": {"backend": "sglang", "n_servers": 4, "server_args": ["--mem-fraction-static", "0.8"]}},
    )  # fmt: skip
    argv = ["--config", cfg_file, "profile=cpu", "actor.group_size=2", f"cluster.fileroot={tmp_path}"]
    cfg = load_config(argv, ExpConfig, save=False)
    assert cfg.profile == "cpu" and cfg.launcher.backend == "areal" and cfg.launcher.server_args == []
    assert cfg.launcher.n_servers == 1 and cfg.actor.dtype == "float32" and not cfg.actor.gradient_checkpointing
    assert cfg.actor.group_size == 2, "the command line wins over the profile"
    assert load_config(["--config", cfg_file], ExpConfig, save=False).launcher.backend == "sglang"
    with pytest.raises(ConfigError, match="unknown profile 'tpu'; profiles: cpu"):
        load_config(["--config", cfg_file, "profile=tpu"], ExpConfig, save=False)


@pytest.mark.parametrize(
    "override, message",
    [
        ("train_dataset.batch_size=-4", "config field 'train_dataset.batch_size' is -4; it must be >= 1"),
        ("gconfig.max_new_tokens=0", "config field 'gconfig.max_new_tokens' is 0; it must be >= 1"),
        ("actor.group_size=0", "config field 'actor.group_size' is 0; it must be >= 1"),
        ("actor.mb_spec.n_mbs=0", "config field 'actor.mb_spec.n_mbs' is 0; it must be >= 1"),
        ("gconfig.top_p=0", "config field 'gconfig.top_p' is 0.0; it must be > 0.0"),
        ("actor.optimizer.warmup_steps_proportion=1.5", "it must be <= 1.0"),
        ("rollout.consumer_batch_size=0", "config field 'rollout.consumer_batch_size' is 0; it must be >= 1"),
    ],
)
def test_values_outside_a_fields_bounds_name_the_field(override: str, message: str) -> None:
    """Bounds are declared in the schema (`areal_lite.api.bounds`) and checked before the config is
    built, so a dataclass's own check (MicroBatchSpec) does not hide the dotted name."""
    from areal_lite.api.experiment_config import RLExperimentConfig

    with pytest.raises(ConfigError) as e:
        load_config(["actor.path=m", "local_engine.path=m", override], RLExperimentConfig, save=False)
    assert message in str(e.value)
    cfg = load_config(["actor.path=m", "local_engine.path=m", "total_train_steps=null"], RLExperimentConfig, save=False)
    assert cfg.total_train_steps is None, "an unset optional field has no bound to check"


def test_bounds_hold_for_dataclasses_built_in_code() -> None:
    from areal_lite.api.io import MicroBatchSpec

    with pytest.raises(ValueError, match="MicroBatchSpec.granularity is 0; it must be >= 1"):
        MicroBatchSpec(granularity=0)
