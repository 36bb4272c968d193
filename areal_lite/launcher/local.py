"""Run a training script on one machine: rollout servers, the trainer under torchrun, restarts.

    python -m areal_lite.launcher.local SCRIPT --config CONFIG [key=value ...]

Before it starts anything, the launcher checks the whole config (`areal_lite.launcher.preflight`):
a config error is printed as one line and the launch exits with `CONFIG_ERROR_EXIT` without
starting (or restarting) anything (`areal_lite.launcher.cli`).

With ``launcher.prepare_overrides`` set, the script first runs once with those overrides appended
(e.g. to build the model that the servers then load) and must exit 0 before anything else starts.
With ``launcher.backend=local`` the script runs the embedded inference engine in-process: it is
started directly (under torchrun when ``trainer_nproc > 1``). With ``areal`` (our
`areal_lite.engines.server`), ``sglang`` (SGLang's own server) or ``vllm`` (vLLM's OpenAI server
with our weight-update worker extension; `areal_lite.launcher.commands` builds each command line),
``n_servers`` servers are started on free ports, the launcher waits until each answers
``GET /health`` with 200 (their addresses and pids go to ``output_dir/logs/servers.json``, their
output to ``server<i>.log`` beside it), and the trainer runs under torchrun with the override
``rollout.addresses=[host:port, ...]``. The servers' model must exist by then (after the prepare
run).

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

import json
import logging
import os
import signal
import subprocess
import sys
import time
from types import FrameType

from areal_lite.api.config_loader import ConfigError
from areal_lite.api.errors import STOP_FILE_ENV, read_stop_file
from areal_lite.launcher.cli import argument_parser, launcher_main, stopped_on
from areal_lite.launcher.commands import server_command, trainer_command, trainer_gpus
from areal_lite.launcher.plan import LaunchPlan
from areal_lite.launcher.preflight import check_config, check_machine, check_tokenizer, is_hub_id
from areal_lite.launcher.processes import is_healthy, log_tail, signal_group, spawn, stop
from areal_lite.utils.distributed import find_free_port
from areal_lite.utils.recover import ATTEMPT_ENV

logger = logging.getLogger("areal_lite.launcher")


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
                        f"server {i} exited with {rc} before becoming healthy; {log} ends with:\n{log_tail(log)}"
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
            signal_group(self.trainer, signum)

    def teardown(self) -> None:
        procs = ([self.trainer] if self.trainer is not None else []) + self.servers
        stop(procs)
        self.servers, self.trainer = [], None


def main(argv: list[str] | None = None) -> int:
    def launch(plan: LaunchPlan, _: object) -> int:
        check_machine(plan)
        check_config(plan)
        return LocalLauncher(plan).run()

    return launcher_main(argument_parser(__doc__), launch, argv)


if __name__ == "__main__":
    sys.exit(main())
