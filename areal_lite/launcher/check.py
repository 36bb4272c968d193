"""The launchers' check run: validate a training script's whole config with the script's own config
class, without training, and report the paths the run reads.

    python -m areal_lite.launcher.check REQUEST.json

``REQUEST.json`` holds ``{"script": ..., "argv": [...], "extra": {label: [override, ...]}, "out": ...}``.
The script is imported as a module named ``__areal_lite_check__``, so its
``if __name__ == "__main__":`` block does not run, inside `checking_only`, so a script that loads its
config at import time stops right there with `ConfigChecked`. Otherwise its config class is the one
`BaseExperimentConfig` subclass in its namespace that no other subclasses. ``argv``, and ``argv``
followed by each ``extra`` list (the prepare run's overrides), are then loaded with that class. The
answer, as JSON in ``out``: ``{"error": one line}`` (and ``"logged": true`` when a traceback went
to stderr), ``{"inputs": {field: [kind, path]}, "tokenizer": [field, path] or null}`` (the
tokenizer the run loads) or ``{"unchecked": why}``. This relies on scripts
loading their config with `load_config` before they do any work, as every script here does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import traceback
from dataclasses import is_dataclass

from areal_lite.api.config_loader import ConfigChecked, ConfigError, checking_only, input_paths, load_config
from areal_lite.api.experiment_config import BaseExperimentConfig

MODULE_NAME = "__areal_lite_check__"


class _Unchecked(Exception):
    """The script's config class could not be found; the launch goes on unchecked."""


def config_class(script: str, argv: list[str]) -> type:
    """Import ``script`` (with ``sys.argv`` as the trainer would see it) and return its config
    class; ConfigError when the script's own `load_config` call at import time rejects ``argv``."""
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, script)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot load the training script {script!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE_NAME] = module  # dataclass type hints resolve in the module's namespace
    try:
        with checking_only():
            spec.loader.exec_module(module)
    except ConfigChecked as e:
        return type(e.config)
    found = {
        v
        for v in vars(module).values()
        if isinstance(v, type)
        and is_dataclass(v)
        and issubclass(v, BaseExperimentConfig)
        and v is not BaseExperimentConfig
    }
    leaves = sorted(
        (c for c in found if not any(o is not c and issubclass(o, c) for o in found)), key=lambda c: c.__name__
    )
    if len(leaves) != 1:
        what = ", ".join(c.__name__ for c in leaves) or "none"
        raise _Unchecked(f"{script} defines no single BaseExperimentConfig subclass (found: {what})")
    return leaves[0]


def tokenizer_source(cfg: object) -> tuple[str, str] | None:
    """(field, path) of the tokenizer the run loads: ``tokenizer_path``, else the actor's model
    (``actor.path``) when the config has one."""
    if getattr(cfg, "tokenizer_path", ""):
        return "tokenizer_path", cfg.tokenizer_path  # type: ignore[attr-defined]
    path = getattr(getattr(cfg, "actor", None), "path", None)
    return ("actor.path", path) if isinstance(path, str) and path else None


def check(script: str, argv: list[str], extra: dict[str, list[str]]) -> dict[str, object]:
    """The answer for one request (see the module docstring)."""
    if not os.path.isfile(script):
        return {"error": f"the training script {script!r} does not exist"}
    try:
        cls = config_class(script, argv)
        cfg = load_config(argv, cls, save=False)
        inputs: dict[str, tuple[str, str]] = input_paths(cfg)
        for label, overrides in extra.items():
            try:
                inputs.update(input_paths(load_config(argv + overrides, cls, save=False)))
            except ConfigError as e:
                raise ConfigError(f"{e} (with {label})") from None
    except ConfigError as e:
        return {"error": str(e)}
    except _Unchecked as e:
        return {"unchecked": str(e)}
    except SystemExit as e:
        if e.code in (0, None):
            return {"unchecked": f"{script} exited before loading its config"}
        return {"error": f"{script} exited with {e.code} before loading its config"}
    except Exception as e:  # noqa: BLE001 (the script fails to import: it would fail alike in the trainer)
        traceback.print_exc()
        first = str(e).splitlines()[0] if str(e) else ""
        return {"error": f"{script} failed before loading its config: {type(e).__name__}: {first}", "logged": True}
    return {"inputs": inputs, "tokenizer": tokenizer_source(cfg)}


def main() -> None:
    with open(sys.argv[1]) as f:
        request = json.load(f)
    answer = check(request["script"], request["argv"], request["extra"])
    with open(request["out"], "w") as f:
        json.dump(answer, f)


if __name__ == "__main__":
    main()
    # A script may have started non-daemon threads at import; they must not hold the check up.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
