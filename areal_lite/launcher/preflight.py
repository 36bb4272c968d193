"""The checks a launch makes before it starts anything, so that a config error ends it at once.

The whole config is checked (`check_config`): a check run (`areal_lite.launcher.check`) loads it with the
script's own config class without training (unknown keys, wrong types, values outside a field's
choices), and every path the config marks as read (`READS_MODEL`, `READS_FILE`) must exist, unless
it is a hub id or lies inside the run's output directory (which the run may write first). The
machine must have what the config asks for (`check_machine`: GPUs, vLLM, our server's flags), and
the tokenizer the run loads must be there once the prepare run may have written it
(`check_tokenizer`). Each check raises `ConfigError` of one line, which the launcher reports
(`areal_lite.launcher.cli`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import tempfile

from areal_lite.api.config_loader import ConfigError
from areal_lite.launcher.commands import GPU_BACKENDS, script_args, vllm_python
from areal_lite.launcher.plan import LaunchPlan
from areal_lite.launcher.processes import spawn, stop

logger = logging.getLogger("areal_lite.launcher")

_HUB_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")


def is_hub_id(path: str) -> bool:
    """Whether ``path`` has the form of a Hugging Face hub id (``org/name``)."""
    return bool(_HUB_ID.match(path)) and ".." not in path


def missing_inputs(inputs: dict[str, tuple[str, str]], output_dir: str) -> list[str]:
    """``field='path'`` for each of ``inputs`` (field -> ("model" or "file", path)) that does not
    exist, is not a model's hub id, and lies outside ``output_dir`` (which the run may write
    before it reads it)."""
    inside = os.path.abspath(output_dir) + os.sep
    return [
        f"{name}={path!r}"
        for name, (kind, path) in inputs.items()
        if not os.path.exists(path)
        and not (kind == "model" and is_hub_id(path))
        and not os.path.abspath(path).startswith(inside)
    ]


def check_config(plan: LaunchPlan, *, paths: bool = True) -> None:
    """Validate the run's whole config in a check run of the script (`areal_lite.launcher.check`;
    the prepare run's overrides too) and, with ``paths``, that the paths it reads exist (see
    `missing_inputs`); `ConfigError` of one line otherwise. The check run's output goes to
    ``logs/check.log``."""
    os.makedirs(plan.log_dir, exist_ok=True)
    log = os.path.join(plan.log_dir, "check.log")
    extra = {"launcher.prepare_overrides": plan.launcher.prepare_overrides} if plan.launcher.prepare_overrides else {}
    with tempfile.TemporaryDirectory() as tmp:
        request, out = os.path.join(tmp, "request.json"), os.path.join(tmp, "answer.json")
        with open(request, "w") as f:
            json.dump({"script": plan.script, "argv": script_args(plan, [])[1:], "extra": extra, "out": out}, f)
        proc = spawn(
            [plan.python, "-m", "areal_lite.launcher.check", request],
            cores=plan.launcher.trainer_cores,
            env={**os.environ},
            log_path=log,
        )
        try:
            rc = proc.wait()
        finally:
            stop([proc], grace=0.0)
        if not os.path.exists(out):
            raise ConfigError(f"the config check of {plan.script} exited with {rc} without an answer; see {log}")
        with open(out) as f:
            answer = json.load(f)
    if "error" in answer:
        raise ConfigError(answer["error"] + (f" (the traceback is in {log})" if answer.get("logged") else ""))
    if "unchecked" in answer:
        logger.warning("config not checked before the start: %s", answer["unchecked"])
        return
    if answer.get("tokenizer"):
        plan.tokenizer = (answer["tokenizer"][0], answer["tokenizer"][1])
    missing = missing_inputs({k: (v[0], v[1]) for k, v in answer["inputs"].items()}, plan.output_dir)
    if paths and missing:
        raise ConfigError(f"the config names paths that do not exist: {', '.join(missing)}")


CPU_OVERRIDES = "profile=cpu"
"""What a GPU config needs on a machine without one: the ``cpu`` profile (`areal_lite.api.config_loader.PROFILES`):
our server on the CPU instead of SGLang, one server and one trainer, float32 on both sides, CPU sizes."""


def check_machine(plan: LaunchPlan) -> None:
    """`ConfigError` naming the overrides to set when the config asks for what this machine lacks
    (SGLang or an engine on a GPU without one) or gives our server flags it does not take."""
    import torch

    cfg = plan.launcher
    if cfg.backend == "sglang" and not torch.cuda.is_available():
        raise ConfigError(
            f"launcher.backend={cfg.backend} needs GPUs and this machine has none; on CPU set {CPU_OVERRIDES}"
        )
    if cfg.backend == "vllm":
        python = vllm_python(cfg)
        has_vllm = [python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"]
        if subprocess.run(has_vllm, capture_output=True, check=False).returncode != 0:
            raise ConfigError(
                f"launcher.backend=vllm runs its servers with {python}, which cannot import vllm: build the "
                "checkout's .venv-vllm with `make install-vllm`, or set launcher.vllm_python to a Python with vLLM"
            )
    flags = dict(zip(plan.engine_args[::2], plan.engine_args[1::2]))
    device = flags.get("--device", "cpu")
    if cfg.backend not in GPU_BACKENDS and device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"local_engine.device={device} but this machine has no GPU; set {CPU_OVERRIDES} (or "
            "local_engine.device=cpu local_engine.dtype=float32)"
        )
    if cfg.backend == "areal":
        from areal_lite.engines.server.server_args import argument_parser

        _, unknown = argument_parser().parse_known_args(["--model-path", "-", *plan.engine_args, *cfg.server_args])
        if unknown:
            raise ConfigError(
                f"launcher.server_args {unknown} are not flags of our server (launcher.backend=areal): "
                "set launcher.server_args=[] or see python -m areal_lite.engines.server --help"
            )


def check_tokenizer(plan: LaunchPlan) -> None:
    """`ConfigError` when the tokenizer the run loads is a local directory without one (checked
    once the prepare run may have written it, before any server starts)."""
    if plan.tokenizer is None or not os.path.isdir(plan.tokenizer[1]):
        return
    from areal_lite.utils.tokenizer import TokenizerMissing, load_tokenizer

    name, path = plan.tokenizer
    try:
        load_tokenizer(path, name)
    except TokenizerMissing as e:
        raise ConfigError(str(e)) from None
