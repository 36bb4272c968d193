"""Loading a config: YAML and dotted command-line overrides merged over a config dataclass.

`load_config` merges a YAML file, a named profile (`PROFILES`) and dotted ``key=value`` overrides
over the dataclass schema (`areal_lite.api.config`, `areal_lite.api.experiment_config`) with
OmegaConf: an unknown key, a value of the wrong type, or a value outside a field's choices
(`one_of`) or bounds (`areal_lite.api.bounds`) is a `ConfigError` that says what was meant.
`check_choices` makes the same checks on a config built in code, `input_paths` lists the paths a
config reads, and `save_config` writes the resolved config of a run.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields, is_dataclass
from typing import TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from areal_lite.api.bounds import out_of_bounds
from areal_lite.api.errors import RecurringError

__all__ = [
    "PROFILES",
    "ConfigChecked",
    "ConfigError",
    "check_choices",
    "checking_only",
    "input_paths",
    "load_config",
    "profile_overrides",
    "requested_profile",
    "save_config",
]


class ConfigError(RecurringError, ValueError):
    """A config file or override that does not fit the schema."""


PROFILES: dict[str, list[str]] = {
    "cpu": [
        # Where the work runs: our server and the trainer on the CPU, one of each, in float32 on
        # both sides (the same dtype for training and generation), no activation recomputation.
        "launcher.backend=areal",
        "launcher.server_args=[]",
        "launcher.n_servers=1",
        "launcher.trainer_nproc=1",
        "launcher.server_tp_size=1",
        "launcher.gpus_per_node=0",
        "local_engine.device=cpu",
        "local_engine.dtype=float32",
        "actor.dtype=float32",
        "actor.gradient_checkpointing=false",
        "weight_update=disk",
        "reward_workers=2",
        # Sizes a few cores get through in minutes per step (a GPU recipe's 64 prompts x 8 samples
        # x 1024 tokens take hours there): raise them on a large CPU machine.
        "train_dataset.batch_size=4",
        "actor.group_size=4",
        "gconfig.max_new_tokens=256",
        "rollout.max_concurrent_rollouts=16",
        "actor.mb_spec.max_tokens_per_mb=4096",
    ],
}
"""The overrides of each ``profile``, as dotted ``key=value`` lines. `load_config` applies them
after the config file and before the command line (so the command line still wins), skipping keys
the config class lacks; the launchers apply them to their own sections the same way."""


def profile_overrides(name: str) -> list[str]:
    """The overrides of profile ``name`` ("" = none); `ConfigError` for an unknown name."""
    if not name:
        return []
    if name not in PROFILES:
        raise ConfigError(f"unknown profile {name!r}; profiles: {', '.join(sorted(PROFILES))}")
    return list(PROFILES[name])


def requested_profile(loaded: DictConfig | None, overrides: list[str]) -> str:
    """The ``profile`` a config file and its command-line overrides ask for (the last one wins)."""
    name = str(loaded.get("profile", "") or "") if loaded is not None else ""
    for item in overrides:
        key, _, value = item.partition("=")
        if key.strip() == "profile":
            name = value.strip()
    return name


def _has_key(schema: DictConfig, dotted: str) -> bool:
    node: object = schema
    for part in dotted.split("."):
        if not isinstance(node, DictConfig) or part not in node.keys():  # noqa: SIM118 (`in` skips MISSING fields)
            return False
        node = node._get_node(part)
    return True


class ConfigChecked(BaseException):
    """Raised by `load_config` in place of returning the config inside `checking_only`, to carry it
    out of a training script that is only being checked. A BaseException, so that a script's
    ``except Exception`` does not stop it."""

    def __init__(self, config: object) -> None:
        super().__init__("config checked")
        self.config = config


_check_only = False


@contextmanager
def checking_only() -> Iterator[None]:
    """Within the block, `load_config` validates and then raises `ConfigChecked` instead of
    returning: the launcher's check run (`areal_lite.launcher.check`) runs a script this way, to
    validate the config with the script's own config class without training."""
    global _check_only
    previous, _check_only = _check_only, True
    try:
        yield
    finally:
        _check_only = previous


def _walk(cfg: object, prefix: str) -> Iterator[tuple[str, dict[str, object], object]]:
    """(dotted name, metadata, value) of every field of a config dataclass, nested ones included."""
    for f in fields(cfg):  # type: ignore[arg-type]
        value = getattr(cfg, f.name)
        yield prefix + f.name, dict(f.metadata), value
        if is_dataclass(value) and not isinstance(value, type):
            yield from _walk(value, f"{prefix}{f.name}.")


def _field_problem(meta: dict[str, object], value: object) -> str | None:
    """What is wrong with a field's ``value`` under its metadata (choices, bounds), or None."""
    choices = meta.get("choices")
    if choices is not None and value not in choices:  # type: ignore[operator]
        return f"choose one of {', '.join(choices)}"  # type: ignore[arg-type]
    problem = out_of_bounds(meta, value)
    return None if problem is None else f"it {problem}"


def check_choices(cfg: object, prefix: str = "") -> None:
    """Raise `ConfigError` for the first field of the config dataclass ``cfg`` (nested ones
    included; their names start with ``prefix``) whose value is not one of its `one_of` choices
    or lies outside its bounds."""
    for name, meta, value in _walk(cfg, prefix):
        problem = _field_problem(meta, value)
        if problem is not None:
            raise ConfigError(f"config field {name!r} is {value!r}; {problem}")


def _check_values(node: DictConfig, prefix: str = "") -> None:
    """`check_choices` on the merged config before it becomes dataclasses, so that a value a
    dataclass's own ``__post_init__`` would reject is still reported under its dotted name."""
    cls = node._metadata.object_type
    if not is_dataclass(cls):
        return
    for f in fields(cls):
        if f.name not in node.keys() or OmegaConf.is_missing(node, f.name):  # noqa: SIM118 (see _check_keys)
            continue
        child = node._get_node(f.name)
        if isinstance(child, DictConfig):
            _check_values(child, f"{prefix}{f.name}.")
            continue
        value = node[f.name]
        problem = _field_problem(dict(f.metadata), value)
        if problem is not None:
            raise ConfigError(f"config field {prefix + f.name!r} is {value!r}; {problem}")


def input_paths(cfg: object, prefix: str = "") -> dict[str, tuple[str, str]]:
    """The non-empty paths in the fields of ``cfg`` marked `READS_MODEL` or `READS_FILE`:
    dotted name -> (``"model"`` or ``"file"``, path)."""
    return {
        name: (str(meta["reads"]), value)
        for name, meta, value in _walk(cfg, prefix)
        if "reads" in meta and isinstance(value, str) and value
    }


T = TypeVar("T")


def _unknown_key_error(node: DictConfig, full_key: str, source: str) -> ConfigError:
    """``node`` is the schema node that lacks the last part of ``full_key``."""
    parent, _, _ = full_key.rpartition(".")
    prefix = f"{parent}." if parent else ""
    candidates = [prefix + str(k) for k in node]
    close = difflib.get_close_matches(full_key, candidates, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; valid keys here: {', '.join(candidates[:20])}"
    return ConfigError(f"unknown config key {full_key!r} (from {source}){hint}")


def _check_keys(schema: DictConfig, given: DictConfig, source: str, parent: str = "") -> None:
    """Walk ``given`` and fail on the first key the structured ``schema`` lacks."""
    is_structured = is_dataclass(schema._metadata.object_type)
    for key in given:
        full = f"{parent}.{key}" if parent else str(key)
        # keys(): omegaconf 2.4 answers False to `in` for a field whose value is MISSING.
        known = key in schema.keys()  # noqa: SIM118
        sub_schema = schema._get_node(key, throw_on_missing_key=False) if known else None
        if is_structured and sub_schema is None:
            raise _unknown_key_error(schema, full, source)
        sub_given = given._get_node(key)
        if isinstance(sub_schema, DictConfig) and isinstance(sub_given, DictConfig):
            _check_keys(sub_schema, sub_given, source, full)


def _expected_type(cls: type, dotted: str) -> str:
    node: type | None = cls
    annotation: object = "?"
    for part in dotted.split("."):
        if node is None or not is_dataclass(node):
            return "?"
        hints = {f.name: f for f in fields(node)}
        if part not in hints:
            return "?"
        f = hints[part]
        annotation = f.type
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        node = type(default) if is_dataclass(default) else None
    return str(annotation)


def load_config(argv: list[str] | None, config_cls: type[T], save: bool = True) -> T:
    """Build a ``config_cls`` from ``--config FILE.yaml`` and ``dotted.key=value`` overrides.

    The YAML file and then the overrides are merged, in that order, over the dataclass defaults.
    Unknown keys raise `ConfigError` naming the closest valid keys; values of the wrong type raise
    `ConfigError` naming the field and its expected type, and values outside a field's `one_of`
    choices or bounds (`areal_lite.api.bounds`) naming the field, the value and what it must be. When ``save`` is true and the config has
    an ``output_dir``, the resolved config is written to ``output_dir/config.yaml``. Inside
    `checking_only` it raises `ConfigChecked` instead of saving and returning.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    config_file: str | None = None
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a file path")
            config_file = argv[i + 1]
            i += 2
            continue
        if arg.startswith("--config="):
            config_file = arg.split("=", 1)[1]
        elif "=" in arg and not arg.startswith("-"):
            overrides.append(arg)
        else:
            raise ConfigError(f"unexpected argument {arg!r}: expected --config FILE or key=value overrides")
        i += 1

    schema = OmegaConf.structured(config_cls)
    layers: list[tuple[DictConfig, str]] = []
    if config_file is not None:
        if not os.path.exists(config_file):
            raise ConfigError(f"config file {config_file!r} does not exist")
        loaded = OmegaConf.load(config_file)
        if not isinstance(loaded, DictConfig):
            raise ConfigError(f"config file {config_file!r} must hold a mapping at the top level")
        layers.append((loaded, config_file))
    profile = requested_profile(layers[0][0] if layers else None, overrides)
    if profile and "profile" in schema:
        known = [o for o in profile_overrides(profile) if _has_key(schema, o.partition("=")[0])]
        layers.append((OmegaConf.from_dotlist(known), f"profile {profile}"))
    if overrides:
        layers.append((OmegaConf.from_dotlist(overrides), "command line"))

    merged = schema
    for layer, source in layers:
        _check_keys(schema, layer, source)
        try:
            merged = OmegaConf.merge(merged, layer)
        except ValidationError as e:
            key = str(e.full_key) if getattr(e, "full_key", None) else "?"
            raise ConfigError(
                f"config field {key!r} (from {source}): expected {_expected_type(config_cls, key)}, "
                f"got {e.msg.splitlines()[0] if e.msg else e}"
            ) from None
        except (ConfigKeyError, ConfigAttributeError) as e:
            raise ConfigError(f"config error (from {source}): {e}") from None
    missing = sorted(OmegaConf.missing_keys(merged))
    if missing:
        raise ConfigError(f"config fields without a value: {', '.join(missing)}")
    _check_values(merged)
    try:
        cfg = OmegaConf.to_object(merged)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_choices(cfg)
    if _check_only:
        raise ConfigChecked(cfg)
    output_dir = getattr(cfg, "output_dir", None)
    if save and isinstance(output_dir, str):
        save_config(cfg, os.path.join(output_dir, "config.yaml"))
    return cfg  # type: ignore[return-value]


def save_config(cfg: object, path: str) -> None:
    """Write a config dataclass as YAML (the resolved config of a run)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
