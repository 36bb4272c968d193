"""The plan of a launch: the script, its config file and overrides, and what the launcher reads of
the config (its ``launcher`` and ``recover`` sections, strictly, the servers' model and the run's
output directory), as `read_plan` finds them before anything starts.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from areal_lite.api.config import RecoverConfig
from areal_lite.api.config_loader import ConfigError, check_choices, profile_overrides, requested_profile
from areal_lite.api.experiment_config import BaseExperimentConfig, LauncherConfig

logger = logging.getLogger("areal_lite.launcher")

ENGINE_FLAGS = (
    ("dtype", "--dtype"),
    ("device", "--device"),
    ("max_running_requests", "--max-running-requests"),
    ("max_total_tokens", "--context-length"),
    ("seed", "--random-seed"),
    ("keep_cache_on_update", "--keep-cache-on-update"),
)
"""``local_engine`` keys and the flags of `areal_lite.engines.server` that take them."""


@dataclass
class LaunchPlan:
    """Everything the launcher needs to know about one run."""

    script: str
    config_file: str | None
    overrides: list[str]
    launcher: LauncherConfig
    recover: RecoverConfig
    model_path: str
    """What the servers load: ``launcher.server_model_path``, else ``actor.path``."""
    output_dir: str
    python: str = field(default=sys.executable)
    engine_args: list[str] = field(default_factory=list)
    """Our server's flags for the config's ``local_engine`` settings (before ``server_args``)."""
    tokenizer: tuple[str, str] | None = None
    """(field, path) of the tokenizer the run loads, as the check run found it."""

    @property
    def log_dir(self) -> str:
        return os.path.join(self.output_dir, "logs")

    @property
    def stop_file(self) -> str:
        """Where the trainer writes an error that a restart would meet again (``STOP_FILE_ENV``)."""
        return os.path.join(self.log_dir, "recurring_error")


def _section(raw: DictConfig, name: str, cls: type) -> object:
    try:
        node = OmegaConf.merge(OmegaConf.structured(cls), raw.get(name) or {})
        return OmegaConf.to_object(node)
    except (OmegaConfBaseException, ValueError) as e:
        raise ConfigError(f"config section {name!r}: {e}") from None


def read_plan(script: str, config_file: str | None, overrides: list[str]) -> LaunchPlan:
    """Read the ``launcher`` and ``recover`` sections (strictly) and the model and output paths."""
    if config_file and not os.path.isfile(config_file):
        raise ConfigError(f"config file {config_file!r} does not exist")
    try:
        loaded = OmegaConf.load(config_file) if config_file else OmegaConf.create()
    except Exception as e:  # noqa: BLE001 (YAML errors come as several types)
        raise ConfigError(f"config file {config_file!r}: {' '.join(str(e).split())}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"config file {config_file!r} must hold a mapping at the top level")
    for item in overrides:
        if "=" not in item or item.startswith("-"):
            raise ConfigError(f"unexpected argument {item!r}: expected key=value overrides")
    # Under the defaults every experiment has (as a plain dict: the script's own sections are
    # unknown here), so that interpolations such as ${cluster.fileroot} resolve as in the script.
    defaults = OmegaConf.create(OmegaConf.to_container(OmegaConf.structured(BaseExperimentConfig)))
    profile = OmegaConf.from_dotlist(profile_overrides(requested_profile(loaded, overrides)))
    raw = OmegaConf.merge(defaults, loaded, profile, OmegaConf.from_dotlist(overrides))
    launcher = _section(raw, "launcher", LauncherConfig)
    recover = _section(raw, "recover", RecoverConfig)
    assert isinstance(launcher, LauncherConfig) and isinstance(recover, RecoverConfig)
    check_choices(launcher, "launcher.")
    check_choices(recover, "recover.")
    overrides = list(overrides)
    if recover.retries and recover.mode == "disabled":
        # A restart that began from scratch would redo every step: with retries the trainer
        # writes recover checkpoints, and a restart resumes from the last one.
        logger.warning(
            "recover.retries=%d: recover.mode=auto (restarts resume from the last checkpoint)", recover.retries
        )
        recover.mode = "auto"
        overrides.append("recover.mode=auto")
    model_path = launcher.server_model_path or str(OmegaConf.select(raw, "actor.path", default="") or "")
    if launcher.backend != "local" and not model_path:
        raise ConfigError("the servers need a model: set launcher.server_model_path or actor.path")
    output_dir = os.path.join(str(raw.cluster.fileroot), str(raw.experiment_name), str(raw.trial_name))
    engine_args: list[str] = []
    for key, flag in ENGINE_FLAGS:
        value = OmegaConf.select(raw, f"local_engine.{key}", default=None)
        if value is not None:
            engine_args += [flag, str(value)]
    return LaunchPlan(
        script, config_file, overrides, launcher, recover, model_path, output_dir, engine_args=engine_args
    )
