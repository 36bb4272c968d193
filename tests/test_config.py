"""Config loading: YAML plus dotted overrides over the dataclass schema, with clear errors."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
import yaml

from areal_lite.api.config import BaseExperimentConfig, ConfigError, PPOActorConfig, load_config


@dataclass
class ExpConfig(BaseExperimentConfig):
    actor: PPOActorConfig = field(default_factory=PPOActorConfig)


def write_yaml(path: str, data: dict) -> str:
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    return path


def test_yaml_then_overrides_merge_over_schema(tmp_path) -> None:
    cfg_file = write_yaml(
        str(tmp_path / "c.yaml"),
        {"actor": {"path": "/m", "optimizer": {"lr": 3e-4}}, "cluster": {"fileroot": str(tmp_path / "out")}},
    )
    cfg = load_config(["--config", cfg_file, "actor.optimizer.lr=1e-5", "actor.mb_spec.max_tokens_per_mb=256"], ExpConfig)
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


def test_invalid_choice_is_rejected() -> None:
    with pytest.raises(ConfigError, match="lr_scheduler_type"):
        load_config(["actor.path=/m", "actor.optimizer.lr_scheduler_type=step"], ExpConfig, save=False)


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(["--config", "/nonexistent.yaml"], ExpConfig, save=False)
    with pytest.raises(ConfigError, match="unexpected argument"):
        load_config(["--lr", "3"], ExpConfig, save=False)
