"""The Ray and Slurm launchers on real clusters (marked ``cluster``, deselected by ``make test``):
`make test-cluster` starts a 2-node Ray cluster and a one-node Slurm cluster on this machine
(tests/clusters/ray.sh, tests/clusters/slurm.sh), runs these and stops both. Without them the
tests are skipped.

Each launcher: the quickstart, shortened, completes with its rollout server and trainer placed by
the cluster manager; a rollout server killed through the cluster manager (a Ray actor, a Slurm job
step) mid-run leaves the training to complete on the other; a SIGKILLed trainer rank is restarted
by the launcher and resumes from its last checkpoint with each sample consumed once
(`trainer_kill`); a trainer that fails on an error a restart would meet again runs once, and the
launcher ends with its line."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import trainer_kill

from areal_lite.launcher.cli import stopped_on

pytestmark = pytest.mark.cluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
SHORT_QUICKSTART = [
    "examples/quickstart.py",
    "--config",
    "configs/quickstart.yaml",
    "total_train_steps=12",
    "task.sft_target_acc=0.1",
    "task.n_eval=100",
    "evaluator.freq_steps=6",
    "recover.freq_steps=6",
    "actor.optimizer.warmup_steps_proportion=0.1",
    "stats_logger.wandb_mode=disabled",
]
"""The quickstart cut to a minute of work: SFT to 10% dev accuracy, 12 RL steps."""
REMOTE_TRAIN = os.path.join(ROOT, "tests", "scripts", "remote_train.py")
PROBE = os.path.join(ROOT, "tests", "scripts", "launcher_probe.py")


def _remote_train_args(model: str, fileroot: Path, total_steps: int, pause_after_step: int) -> list[str]:
    return [
        REMOTE_TRAIN,
        f"actor.path={model}",
        f"cluster.fileroot={fileroot}",
        "launcher.backend=areal",
        "launcher.n_servers=2",
        "launcher.server_args=[--max-running-requests,8]",
        "rollout.consumer_batch_size=4",
        "rollout.max_head_offpolicyness=1",
        "rollout.request_timeout=60",
        f"total_steps={total_steps}",
        f"pause_after_step={pause_after_step}",
        "stats_logger.console=false",
        "stats_logger.wandb_mode=disabled",
    ]


def _tiny_model(path: Path) -> str:
    from areal_lite.utils.tiny import build_tiny_model

    return build_tiny_model(str(path), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=256)


def _wait_for(path: Path, failure: Callable[[], str | None], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        why = failure()
        assert why is None, why
        assert time.monotonic() < deadline, f"no {path}"
        time.sleep(0.1)


def _check_steps(out_dir: Path, total_steps: int) -> None:
    steps = [json.loads(line) for line in (out_dir / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(total_steps)), "every step once"
    assert all(s["n"] == 4 for s in steps)
    assert max(steps[-1]["versions"]) >= total_steps - 2, "the survivor got the updates after the kill"


def _run_trainer_kill(
    tmp_path: Path,
    start: Callable[[list[str]], RayLaunch | SlurmJob],
    interrupt: Callable[[RayLaunch | SlurmJob, list[int]], None],
    resumed_attempt: int = 1,
) -> str:
    """The `trainer_kill` scenario under the launch that ``start(args)`` makes: ``interrupt(launch,
    pids of the paused ranks)`` fails the trainer, the launch must complete and resume exactly.
    Returns the launch's output."""
    model = _tiny_model(tmp_path / "model")
    out_dir = tmp_path / "out" / "areal-lite" / "trial0"
    launch = start([trainer_kill.SCRIPT, *trainer_kill.overrides(model, str(tmp_path / "out"))])
    try:
        interrupt(launch, trainer_kill.wait_paused(out_dir, launch.failure))
    finally:
        log = launch.finish(timeout=600)
    assert launch.proc.returncode == 0, log[-3000:]
    trainer_kill.check_resumed(out_dir, resumed_attempt)
    return log


def _recurring_error_args(tmp_path: Path) -> list[str]:
    """The launcher probe failing on a `RecurringError`, with two retries it must not use."""
    out = tmp_path / "probe.jsonl"
    return [
        PROBE,
        f"probe.out={out}",
        f"cluster.fileroot={tmp_path}",
        "probe.recurring_error=true",
        "recover.retries=2",
    ]


def _check_stopped_once(tmp_path: Path, rc: int, log: str) -> None:
    assert rc == 1, log[-3000:]
    attempts = [json.loads(line)["attempt"] for line in (tmp_path / "probe.jsonl").read_text().splitlines()]
    assert attempts == [0], "not restarted"
    assert stopped_on("RecurringError: bad data row at data.jsonl:3: field 'question' is missing") in log


# ---------------------------------------------------------------------------------------------- Ray


@pytest.fixture(scope="module")
def ray_address() -> str:
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        pytest.skip("no Ray cluster: RAY_ADDRESS is unset (tests/clusters/ray.sh up starts one)")
    return address


class RayLaunch:
    """`python -m areal_lite.launcher.ray ARGS` in the background, its output in ``log``."""

    def __init__(self, args: list[str], log: Path, address: str) -> None:
        self.log = log
        self.out = open(log, "wb")  # noqa: SIM115 (closed in finish)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "areal_lite.launcher.ray", *args],
            cwd=ROOT,
            env={**ENV, "RAY_ADDRESS": address},
            stdout=self.out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def failure(self) -> str | None:
        """None while the launcher runs, else its exit code and the end of its log."""
        if self.proc.poll() is None:
            return None
        return f"the launcher exited with {self.proc.returncode}: {self.log.read_text()[-3000:]}"

    def finish(self, timeout: float) -> str:
        """Wait for the launcher (killing it when it overruns); its output."""
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(timeout=60)
            self.out.close()
        return self.log.read_text()


def _ray_call(address: str, code: str) -> str:
    """Run ``code`` in a fresh driver connected to the cluster (namespace areal_lite); its stdout."""
    prog = f"import ray\nray.init(address={address!r}, namespace='areal_lite', log_to_driver=False)\n{code}"
    proc = subprocess.run(
        [sys.executable, "-c", prog], env=ENV, capture_output=True, text=True, timeout=120, check=True
    )
    return proc.stdout


def test_ray_quickstart_on_two_nodes(ray_address: str, tmp_path: Path) -> None:
    """The rollout server and the trainer on different nodes of the cluster; the run finishes."""
    launch = RayLaunch([*SHORT_QUICKSTART, f"cluster.fileroot={tmp_path}"], tmp_path / "launcher.log", ray_address)
    log = launch.finish(timeout=900)
    assert launch.proc.returncode == 0, log[-3000:]
    assert re.search(r"RESULT acc_before=\S+ acc_after=\S+", log)
    servers = json.loads((tmp_path / "quickstart" / "demo" / "logs" / "servers.json").read_text())
    trainer_nodes = set(re.findall(r"attempt 0 on node (\w+)", log))
    assert len(servers) == 1 and len(trainer_nodes) == 1
    assert servers[0]["node"] not in trainer_nodes, "SPREAD placement: the server and the trainer on distinct nodes"
    assert "RESULT" in (tmp_path / "quickstart" / "demo" / "logs" / "trainer0.log").read_text()


def test_ray_training_completes_when_a_server_actor_is_killed(ray_address: str, tmp_path: Path) -> None:
    model = _tiny_model(tmp_path / "model")
    out_dir = tmp_path / "out" / "areal-lite" / "trial0"
    total_steps = 5
    launch = RayLaunch(
        _remote_train_args(model, tmp_path / "out", total_steps, 1), tmp_path / "launcher.log", ray_address
    )
    try:
        _wait_for(out_dir / "paused", launch.failure)
        servers = json.loads((out_dir / "logs" / "servers.json").read_text())
        _ray_call(ray_address, f"ray.kill(ray.get_actor({servers[1]['actor']!r}))")
        (out_dir / "continue").touch()
    finally:
        log = launch.finish(timeout=300)
    assert launch.proc.returncode == 0, log[-3000:]
    _check_steps(out_dir, total_steps)
    assert re.search(r"server 1 \S+ its actor is gone", log), "the launcher reports the dead server"
    assert _ray_call(ray_address, "print(len(ray.util.list_named_actors()))").strip() == "0", "no actor left"


def test_ray_killed_trainer_resumes_with_each_sample_once(ray_address: str, tmp_path: Path) -> None:
    def start(args: list[str]) -> RayLaunch:
        return RayLaunch(args, tmp_path / "launcher.log", ray_address)

    log = _run_trainer_kill(tmp_path, start, lambda launch, pids: os.kill(pids[1], signal.SIGKILL))
    assert "restart 1 of 1 from the last checkpoint" in log


def test_ray_error_a_restart_would_meet_again_is_not_retried(ray_address: str, tmp_path: Path) -> None:
    """The trainer node returns the line to the driver (its stop file is the node's, not in logs/)."""
    launch = RayLaunch(_recurring_error_args(tmp_path), tmp_path / "launcher.log", ray_address)
    log = launch.finish(timeout=300)
    _check_stopped_once(tmp_path, launch.proc.returncode, log)
    assert not (tmp_path / "areal-lite" / "trial0" / "logs" / "recurring_error").exists()


# -------------------------------------------------------------------------------------------- Slurm


@pytest.fixture(scope="module")
def slurm() -> None:
    if shutil.which("sbatch") is None:
        pytest.skip("no Slurm: sbatch is not installed (tests/clusters/slurm.sh up starts a cluster)")
    if subprocess.run(["sinfo", "-h"], capture_output=True, check=False, timeout=30).returncode != 0:
        pytest.skip("no Slurm cluster answers (tests/clusters/slurm.sh up starts one; SLURM_CONF must point at it)")


class SlurmJob:
    """`python -m areal_lite.launcher.slurm ARGS --wait` in the background: sbatch, then the job."""

    def __init__(self, args: list[str], log_dir: Path) -> None:
        self.log_dir = log_dir
        one_node = [f"launcher.slurm.cpus_per_task={os.cpu_count()}", "launcher.slurm.colocate_servers=true"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "areal_lite.launcher.slurm", "--wait", *args, *one_node],
            cwd=ROOT,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def job_id(self) -> str:
        logs = sorted(self.log_dir.glob("slurm-*.out"))
        assert logs, f"no job output in {self.log_dir}"
        return logs[0].name.removeprefix("slurm-").removesuffix(".out")

    def output(self) -> str:
        return "".join(p.read_text() for p in sorted(self.log_dir.glob("slurm-*.out")))

    def failure(self) -> str | None:
        if self.proc.poll() is None:
            return None
        return f"sbatch --wait exited with {self.proc.returncode}: {self.proc.stdout.read().decode()}{self.output()[-3000:]}"

    def step(self, name: str) -> str:
        """The id (JOB.STEP) of this job's running step named ``name``."""
        out = subprocess.run(
            ["squeue", "-s", "-j", self.job_id, "-h", "-o", "%i %j"], capture_output=True, text=True, check=True
        ).stdout
        steps = [line.split()[0] for line in out.splitlines() if line.split()[1:] == [name]]
        assert len(steps) == 1, out
        return steps[0]

    def finish(self, timeout: float) -> str:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                subprocess.run(["scancel", self.job_id], check=False)
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.stdout.read().decode() + self.output()


def test_slurm_quickstart_through_sbatch(slurm: None, tmp_path: Path) -> None:
    job = SlurmJob([*SHORT_QUICKSTART, f"cluster.fileroot={tmp_path}"], tmp_path / "quickstart" / "demo" / "logs")
    log = job.finish(timeout=900)
    assert job.proc.returncode == 0, log[-3000:]
    assert re.search(r"RESULT acc_before=\S+ acc_after=\S+", log)
    assert (tmp_path / "quickstart" / "demo" / "slurm" / "job.sh").exists()


def test_slurm_training_completes_when_a_server_step_is_cancelled(slurm: None, tmp_path: Path) -> None:
    model = _tiny_model(tmp_path / "model")
    out_dir = tmp_path / "out" / "areal-lite" / "trial0"
    total_steps = 5
    job = SlurmJob(_remote_train_args(model, tmp_path / "out", total_steps, 1), out_dir / "logs")
    try:
        _wait_for(out_dir / "paused", job.failure)
        subprocess.run(["scancel", job.step("server1")], check=True)
        (out_dir / "continue").touch()
    finally:
        log = job.finish(timeout=300)
    assert job.proc.returncode == 0, log[-3000:]
    _check_steps(out_dir, total_steps)


def test_slurm_killed_trainer_resumes_with_each_sample_once(slurm: None, tmp_path: Path) -> None:
    def start(args: list[str]) -> SlurmJob:
        return SlurmJob(args, tmp_path / "out" / "areal-lite" / "trial0" / "logs")

    log = _run_trainer_kill(tmp_path, start, lambda job, pids: os.kill(pids[1], signal.SIGKILL))
    assert "trainer attempt 0 failed" in log


def test_slurm_requeued_job_resumes_with_each_sample_once(slurm: None, tmp_path: Path) -> None:
    """`scontrol requeue` (what a node failure or preemption does): the job starts again and the
    trainer resumes from its last checkpoint, as attempt 2 (one retry per run)."""

    def start(args: list[str]) -> SlurmJob:
        return SlurmJob(args, tmp_path / "out" / "areal-lite" / "trial0" / "logs")

    def requeue(job: SlurmJob, pids: list[int]) -> None:
        subprocess.run(["scontrol", "requeue", job.job_id], check=True)

    log = _run_trainer_kill(tmp_path, start, requeue, resumed_attempt=2)
    assert "(restart 1)" in log


def test_slurm_error_a_restart_would_meet_again_is_not_retried(slurm: None, tmp_path: Path) -> None:
    job = SlurmJob(_recurring_error_args(tmp_path), tmp_path / "areal-lite" / "trial0" / "logs")
    log = job.finish(timeout=300)
    _check_stopped_once(tmp_path, job.proc.returncode, log)
