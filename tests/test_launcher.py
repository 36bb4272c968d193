"""The local launcher: config reading, server and trainer command lines, and real runs of a probe
trainer (retries, signal forwarding, core pinning, teardown). The ray and slurm launchers can only
build their commands here, and those are checked too."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from areal_lite.api.config import RecoverConfig
from areal_lite.api.config_loader import ConfigError
from areal_lite.api.experiment_config import LauncherConfig
from areal_lite.launcher.cli import CONFIG_ERROR_EXIT, stopped_on
from areal_lite.launcher.commands import server_command, trainer_command, trainer_gpus
from areal_lite.launcher.plan import LaunchPlan, read_plan
from areal_lite.launcher.preflight import CPU_OVERRIDES, check_machine, missing_inputs

HERE = os.path.dirname(os.path.abspath(__file__))
PROBE = os.path.join(HERE, "scripts", "launcher_probe.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _write_config(tmp_path, **sections: object) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(sections))
    return str(path)


def test_read_plan_takes_the_launcher_and_recover_sections(tmp_path) -> None:
    cfg = _write_config(
        tmp_path,
        actor={"path": "/models/m"},
        launcher={"backend": "areal", "n_servers": 2},
        experiment_name="e",
        cluster={"fileroot": str(tmp_path)},
    )
    plan = read_plan("train.py", cfg, ["recover.retries=2", "launcher.trainer_nproc=2"])
    assert plan.launcher.backend == "areal" and plan.launcher.n_servers == 2 and plan.launcher.trainer_nproc == 2
    assert plan.recover.retries == 2
    assert plan.model_path == "/models/m", "servers load the actor's model unless told otherwise"
    assert plan.output_dir == os.path.join(str(tmp_path), "e", "trial0")
    plan = read_plan("train.py", cfg, ["launcher.server_model_path=/models/other"])
    assert plan.model_path == "/models/other"
    cfg = _write_config(
        tmp_path, actor={"path": "${cluster.fileroot}/${experiment_name}/model"}, launcher={"backend": "areal"}
    )
    assert read_plan("train.py", cfg, []).model_path == "outputs/areal-lite/model", "interpolations see the defaults"
    plan = read_plan("train.py", cfg, ["profile=cpu", "recover.retries=2"])
    assert plan.launcher.backend == "areal" and plan.engine_args[:4] == ["--dtype", "float32", "--device", "cpu"]
    assert plan.recover.mode == "auto" and plan.overrides[-1] == "recover.mode=auto", "retries resume"
    assert read_plan("train.py", cfg, ["cluster.fileroot=/r"]).model_path == "/r/areal-lite/model"


@pytest.mark.parametrize(
    "override, message",
    [
        ("launcher.n_server=2", "n_server"),
        ("launcher.backend=tgi", "launcher.backend"),
        ("launcher.n_servers=two", "n_servers"),
    ],
)
def test_read_plan_rejects_bad_launcher_config(tmp_path, override: str, message: str) -> None:
    cfg = _write_config(tmp_path, actor={"path": "/m"})
    with pytest.raises(ConfigError, match=message):
        read_plan("train.py", cfg, [override])


def test_read_plan_rejects_a_missing_or_broken_config_file(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        read_plan("train.py", str(tmp_path / "nope.yaml"), [])
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [1,\n")
    with pytest.raises(ConfigError, match=r"broken.yaml.*line 2"):
        read_plan("train.py", str(broken), [])


def test_servers_need_a_model(tmp_path) -> None:
    with pytest.raises(ConfigError, match="server_model_path"):
        read_plan("train.py", _write_config(tmp_path, launcher={"backend": "areal"}), [])


def _plan(**launcher: object) -> LaunchPlan:
    return LaunchPlan(
        "train.py", "cfg.yaml", ["a.b=1"], LauncherConfig(**launcher), RecoverConfig(), "/models/m", "out", python="py"
    )


def test_server_command_lines() -> None:
    assert server_command(_plan(backend="areal", server_args=["--max-running-requests", "8"]), 9000) == [
        "py",
        "-m",
        "areal_lite.engines.server",
        "--model-path",
        "/models/m",
        "--host",
        "127.0.0.1",
        "--port",
        "9000",
        "--max-running-requests",
        "8",
    ]
    assert server_command(_plan(backend="sglang", server_tp_size=2, server_host="0.0.0.0"), 9001, base_gpu_id=2) == [
        "py",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/m",
        "--host",
        "0.0.0.0",
        "--port",
        "9001",
        "--tp-size",
        "2",
        "--base-gpu-id",
        "2",
    ]
    with pytest.raises(ValueError):
        server_command(_plan(backend="local"), 9000)


def test_our_server_gets_the_local_engine_settings_and_server_args_win(tmp_path) -> None:
    from areal_lite.engines.server.server_args import parse_args

    cfg = _write_config(
        tmp_path, actor={"path": "/models/m"}, local_engine={"max_running_requests": 256, "dtype": "bfloat16"},
        launcher={"backend": "areal", "server_args": ["--dtype", "float32"]},
    )  # fmt: skip
    cmd = server_command(read_plan("train.py", cfg, ["local_engine.seed=7"]), 9000)
    args = parse_args(cmd[3:])
    assert args.max_running_requests == 256 and args.random_seed == 7 and args.dtype == "float32"
    assert args.model_path == "/models/m" and args.port == 9000


def test_trainer_command_lines() -> None:
    assert trainer_command(_plan(backend="local"), [], 7000) == ["py", "train.py", "--config", "cfg.yaml", "a.b=1"]
    cmd = trainer_command(_plan(backend="areal", trainer_nproc=2), ["127.0.0.1:1", "127.0.0.1:2"], 7000)
    assert cmd[:3] == ["py", "-m", "torch.distributed.run"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2" and cmd[cmd.index("--master-port") + 1] == "7000"
    assert cmd[-5:] == ["train.py", "--config", "cfg.yaml", "a.b=1", 'rollout.addresses=["127.0.0.1:1","127.0.0.1:2"]']


def test_trainer_gets_the_gpus_after_the_sglang_servers() -> None:
    cfg = LauncherConfig(backend="sglang", n_servers=2, server_tp_size=2, trainer_nproc=4)
    assert trainer_gpus(cfg, None) == "4,5,6,7"
    assert trainer_gpus(cfg, "7,6,5,4,3,2,1,0") == "3,2,1,0", "positions in the launcher's own list"
    with pytest.raises(ConfigError, match="do not fit"):
        trainer_gpus(cfg, "0,1,2,3,4,5")
    assert trainer_gpus(LauncherConfig(backend="areal", trainer_nproc=2), "0,1") is None


def _launch_with_output(tmp_path, *overrides: str, timeout: float = 120) -> tuple[int, list[dict], str]:
    """The launcher's exit code, the probe's records (one per start) and the launcher's stderr."""
    out = tmp_path / "probe.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "areal_lite.launcher.local",
        PROBE,
        f"probe.out={out}",
        f"cluster.fileroot={tmp_path}",
        *overrides,
    ]
    proc = subprocess.run(cmd, env=ENV, check=False, capture_output=True, text=True, timeout=timeout)
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return proc.returncode, records, proc.stderr


def _launch(tmp_path, *overrides: str, timeout: float = 120) -> tuple[int, list[dict]]:
    rc, records, _ = _launch_with_output(tmp_path, *overrides, timeout=timeout)
    return rc, records


def test_retries_restart_a_failed_trainer(tmp_path) -> None:
    rc, records = _launch(tmp_path, "probe.fail_attempts=2", "recover.retries=2", "recover.mode=auto")
    assert rc == 0
    assert [r["attempt"] for r in records] == [0, 1, 2]
    (tmp_path / "b").mkdir()
    rc, records = _launch(tmp_path / "b", "probe.fail_attempts=2", "recover.retries=1", "recover.mode=auto")
    assert rc == 3, "the trainer's exit code once the retries are spent"
    assert [r["attempt"] for r in records] == [0, 1]


def test_an_error_a_restart_would_meet_again_is_not_retried(tmp_path) -> None:
    """A `RecurringError` (bad data, a broken grader, a full disk) in a trainer rank under torchrun:
    one attempt, and the launcher ends with the error's line."""
    rc, records, _ = _launch_with_output(
        tmp_path,
        "probe.recurring_error=true",
        "recover.retries=3",
        "recover.mode=auto",
        "launcher.trainer_nproc=2",
    )
    assert rc == 1 and sorted({r["attempt"] for r in records}) == [0], "not restarted"
    line = (tmp_path / "areal-lite" / "trial0" / "logs" / "recurring_error").read_text().strip()
    assert line == "RecurringError: bad data row at data.jsonl:3: field 'question' is missing"


def test_prepare_run_comes_first_and_must_succeed(tmp_path) -> None:
    rc, records = _launch(tmp_path, "launcher.prepare_overrides=[probe.tag=prepare]")
    assert rc == 0
    assert [r["tag"] for r in records] == ["prepare", "main"]
    (tmp_path / "b").mkdir()
    rc, records = _launch(
        tmp_path / "b", "launcher.prepare_overrides=[probe.tag=prepare,probe.fail_attempts=1]", "recover.retries=2"
    )
    assert rc == 3 and [r["tag"] for r in records] == ["prepare"], "a failed prepare run stops the launch"


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.pause_mode=pause", "config field 'rollout.pause_mode' is 'pause'; choose one of abort, in_place"),
        (
            "probe.model=/nonexistent/model",
            "the config names paths that do not exist: probe.model='/nonexistent/model'",
        ),
        (
            "launcher.prepare_overrides=[probe.tagg=prepare]",
            (
                "unknown config key 'probe.tagg' (from command line); did you mean probe.tag, probe.out, probe.model? "
                "(with launcher.prepare_overrides)"
            ),
        ),
        ("launcher.backend=tgi", "config field 'launcher.backend' is 'tgi'; choose one of local, areal, sglang, vllm"),
        ("train_dataset.batch_size=-4", "config field 'train_dataset.batch_size' is -4; it must be >= 1"),
    ],
)
def test_a_config_error_is_one_line_and_nothing_starts(tmp_path, override: str, message: str) -> None:
    """Checked before any server or trainer starts, with the script's own config class; a failure
    that would repeat is never retried."""
    rc, records, err = _launch_with_output(tmp_path, "recover.mode=auto", "recover.retries=3", override)
    assert rc == CONFIG_ERROR_EXIT
    assert records == [], "no attempt"
    assert err.splitlines() == [f"[launcher] config error: {message}"], err


def test_the_servers_model_must_exist_after_the_prepare_run(tmp_path) -> None:
    model = tmp_path / "areal-lite" / "trial0" / "model"  # in the output directory: the prepare run could write it
    rc, records, err = _launch_with_output(
        tmp_path,
        "launcher.backend=areal",
        f"launcher.server_model_path={model}",
        "launcher.prepare_overrides=[probe.tag=prepare]",
        "recover.retries=3",
    )
    assert rc == CONFIG_ERROR_EXIT
    assert [r["tag"] for r in records] == ["prepare"], "the prepare run, then no server and no trainer"
    last = err.splitlines()[-1]
    assert last == f"[launcher] config error: the servers' model launcher.server_model_path='{model}' does not exist"
    assert "Traceback" not in err and not (model.parent / "logs" / "servers.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without a GPU is told")
def test_the_gpu_recipe_on_a_cpu_machine_names_the_overrides_it_needs(tmp_path) -> None:
    """configs/gsm8k_grpo.yaml as shipped asks for SGLang servers; here the launcher says, in one
    line and before starting anything, which overrides run it on the CPU; with them it passes."""
    root = os.path.dirname(HERE)
    recipe = ["examples/gsm8k_grpo.py", "--config", "configs/gsm8k_grpo.yaml", f"cluster.fileroot={tmp_path}"]
    proc = subprocess.run(
        [sys.executable, "-m", "areal_lite.launcher.local", *recipe],
        cwd=root,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == CONFIG_ERROR_EXIT
    assert proc.stderr.splitlines() == [
        (
            f"[launcher] config error: launcher.backend=sglang needs GPUs and this "
            f"machine has none; on CPU set {CPU_OVERRIDES}"
        )
    ], proc.stderr
    plan = read_plan(recipe[0], recipe[2], [*recipe[3:], *CPU_OVERRIDES.split()])
    check_machine(plan)  # no error
    with pytest.raises(ConfigError, match=r"local_engine.device=cuda but this machine has no GPU; set "):
        check_machine(
            read_plan(recipe[0], recipe[2], [*recipe[3:], "launcher.backend=areal", "launcher.server_args=[]"])
        )
    with pytest.raises(
        ConfigError, match=r"launcher.server_args \['--mem-fraction-static', '0.8'\] are not flags of our"
    ):
        check_machine(
            read_plan(
                recipe[0],
                recipe[2],
                [*recipe[3:], "launcher.backend=areal", "local_engine.device=cpu", "local_engine.dtype=float32"],
            )
        )


def test_which_paths_must_exist(tmp_path) -> None:
    (tmp_path / "data.jsonl").write_text("")
    inputs = {
        "a": ("model", str(tmp_path / "data.jsonl")),
        "b": ("model", "Qwen/Qwen2.5-1.5B-Instruct"),
        "c": ("file", "data/train.parquet"),
        "d": ("model", "/models/m"),
        "e": ("model", "../m/x"),
        "f": ("file", str(tmp_path / "out" / "made_by_the_run.jsonl")),
    }
    assert missing_inputs(inputs, str(tmp_path / "out")) == ["c='data/train.parquet'", "d='/models/m'", "e='../m/x'"]


def test_the_check_run_reports_a_script_that_cannot_load(tmp_path) -> None:
    from areal_lite.launcher.check import check

    nope = tmp_path / "nope.py"
    assert check(str(nope), [], {}) == {"error": f"the training script '{nope}' does not exist"}
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_here\n")
    assert check(str(broken), [], {}) == {
        "logged": True,
        "error": (
            f"{broken} failed before loading its config: ModuleNotFoundError: No module named 'no_such_module_here'"
        ),
    }


def test_trainer_under_torchrun_is_pinned(tmp_path) -> None:
    rc, records = _launch(tmp_path, "launcher.trainer_nproc=2", "launcher.trainer_cores=[0]")
    assert rc == 0
    assert sorted(r["rank"] for r in records) == ["0", "1"]
    assert all(r["affinity"] == [0] for r in records)


def _wait_for(path: str, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        assert proc.poll() is None, f"launcher exited before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"no {what}"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_sigterm_is_forwarded_and_everything_stops(tmp_path) -> None:
    out = tmp_path / "probe.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "areal_lite.launcher.local",
        PROBE,
        f"probe.out={out}",
        "probe.wait_for_signal=true",
        f"cluster.fileroot={tmp_path}",
        "recover.retries=3",
    ]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _wait_for(str(out) + ".ready", proc, "trainer start")
        trainer_pid = json.loads(out.read_text().splitlines()[0])["pid"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        assert (tmp_path / "probe.jsonl.signal").read_text() == str(int(signal.SIGTERM))
        assert len(out.read_text().splitlines()) == 1, "a signalled run is not restarted"
        assert not _alive(trainer_pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _shim(bin_dir, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(0o755)


def _run_job_script(tmp_path, script: str, n_nodes: int, srun: str) -> subprocess.CompletedProcess:
    """The job script run by bash on nodes n0..n<n_nodes - 1>, with shims for scontrol, curl (every
    server healthy) and srun (``srun``, its body)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _shim(bin_dir, "scontrol", "printf '" + "".join(f"n{i}\\n" for i in range(n_nodes)) + "'")
    _shim(bin_dir, "curl", "exit 0")
    _shim(bin_dir, "srun", srun)
    job = tmp_path / "job.sh"
    job.write_text(script)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": f"n[0-{n_nodes - 1}]",
        "SLURM_JOB_ID": "7",
    }
    return subprocess.run(["bash", str(job)], check=False, env=env, capture_output=True, text=True)


def test_slurm_job_script_runs_servers_then_the_trainer_with_retries(tmp_path) -> None:
    """The generated job script, run by bash with shims for scontrol, srun and curl: servers are
    placed per node by GPU count, the trainer gets their addresses as one override and is retried."""
    from areal_lite.launcher.slurm import sbatch_script

    plan = LaunchPlan(
        "train.py",
        "cfg.yaml",
        ["a.b=1"],
        LauncherConfig(
            backend="sglang",
            n_servers=3,
            server_tp_size=4,
            gpus_per_node=8,
            trainer_nnodes=2,
            trainer_nproc=8,
            prepare_overrides=["task.prepare_only=true"],
        ),
        RecoverConfig(mode="auto", retries=1),
        "/models/m",
        str(tmp_path / "out" / "exp" / "trial"),
        python="python",
    )
    script = sbatch_script(plan)
    assert "#SBATCH --nodes=4" in script, "3 servers of 4 GPUs on 8-GPU nodes take 2 nodes, plus 2 trainer nodes"
    calls = tmp_path / "calls.tsv"
    # The servers' sruns run in the background (Slurm stops them when the job ends), so their
    # records may land after the script has exited: bash builtins write them, and we wait for them.
    srun = (
        f"(IFS=$'\\t'; echo \"${{AREAL_LITE_ATTEMPT}}\"$'\\t'\"$*\") >> {calls}\n"
        '[[ "$*" == *torch.distributed.run*rollout.addresses* && "$AREAL_LITE_ATTEMPT" == 0 ]] && exit 5; exit 0'
    )
    proc = _run_job_script(tmp_path, script, 4, srun)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    deadline = time.monotonic() + 30
    while True:
        records = [line.split("\t") for line in calls.read_text().splitlines()]
        servers = [r for r in records if "sglang.launch_server" in r]
        if len(servers) >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    trainers = [r for r in records if "torch.distributed.run" in r]
    # Servers start in the background, so they reach the log in any order.
    assert sorted(
        (
            s[s.index("--nodelist=n0") if "--nodelist=n0" in s else s.index("--nodelist=n1")],
            s[s.index("--port") + 1],
            s[s.index("--base-gpu-id") + 1],
        )
        for s in servers
    ) == [("--nodelist=n0", "30000", "0"), ("--nodelist=n0", "30001", "4"), ("--nodelist=n1", "30000", "0")]
    assert records.index(trainers[0]) == 0 and trainers[0][-1] == "task.prepare_only=true", "the prepare run goes first"
    trainers = trainers[1:]
    assert [t[0] for t in trainers] == ["0", "1"], "one retry after the failed first attempt"
    t = trainers[1]
    assert "--nodelist=n2,n3" in t and "n2:29500" in t
    assert t[-4:] == ["--config", "cfg.yaml", "a.b=1", 'rollout.addresses=["n0:30000","n0:30001","n1:30000"]']


def test_slurm_job_script_stops_retrying_on_an_error_a_restart_would_meet_again(tmp_path) -> None:
    """The trainer's line in ``AREAL_LITE_STOP_FILE`` after a failed attempt ends the job with it; the
    line a previous attempt or job left is removed before each attempt."""
    from areal_lite.launcher.slurm import sbatch_script

    plan = _plan(backend="local")
    plan.recover, plan.output_dir = RecoverConfig(mode="auto", retries=3), str(tmp_path / "out")
    os.makedirs(plan.log_dir)
    with open(plan.stop_file, "w") as f:
        f.write("RecurringError: left by a previous job\n")
    attempts = tmp_path / "attempts"
    srun = (
        f'echo "$AREAL_LITE_ATTEMPT" >> {attempts}\n'
        '[ "$AREAL_LITE_ATTEMPT" = 1 ] && echo "BadRow: bad data row at d.jsonl:3" > "$AREAL_LITE_STOP_FILE"; exit 4'
    )
    proc = _run_job_script(tmp_path, sbatch_script(plan), 1, srun)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert attempts.read_text().split() == ["0", "1"], "the stale line did not stop attempt 0; attempt 1's did"
    assert proc.stdout.splitlines()[-1] == stopped_on("BadRow: bad data row at d.jsonl:3")


def test_ray_trainer_task_returns_the_error_its_node_wrote(tmp_path) -> None:
    """`run_trainer_node` points the trainer at a stop file of its own node and returns its line."""
    from areal_lite.launcher.ray import run_trainer_node

    log = str(tmp_path / "logs" / "trainer0.log")

    def run(error: str, attempt: int) -> tuple[int, str | None]:
        code = f"from areal_lite.api.errors import RecurringError; raise {error}"
        return run_trainer_node([sys.executable, "-c", code], attempt, os.getcwd(), log, [])

    assert run("RecurringError('bad data row\\nat d.jsonl:3')", 0) == (1, "RecurringError: bad data row")
    assert run("RuntimeError('a crash')", 1) == (1, None), "a crash leaves no line: the driver restarts it"
    assert "bad data row" in Path(log).read_text(), "the trainer's output still goes to its log"


def test_slurm_colocated_servers_share_the_first_trainer_node() -> None:
    from areal_lite.api.experiment_config import SlurmConfig
    from areal_lite.launcher.slurm import sbatch_script

    cpu = _plan(backend="areal", n_servers=2, slurm=SlurmConfig(colocate_servers=True))
    script = sbatch_script(cpu)
    assert "#SBATCH --nodes=1" in script and "#SBATCH --requeue" in script
    assert script.count('--nodelist="${NODES[0]}"') == 2 and 'MASTER="${NODES[0]}"' in script
    assert "--job-name=server1" in script and "CUDA_VISIBLE_DEVICES" not in script
    gpu = _plan(
        backend="sglang", n_servers=2, trainer_nproc=4, gpus_per_node=6, slurm=SlurmConfig(colocate_servers=True)
    )
    assert "CUDA_VISIBLE_DEVICES=2,3,4,5 srun" in sbatch_script(gpu), "the trainer gets the GPUs after the servers'"


def test_ray_placement_and_commands() -> None:
    from areal_lite.launcher.ray import forwarded_env, server_bundles, trainer_bundles, trainer_node_commands

    plan = _plan(backend="sglang", n_servers=2, server_tp_size=2, trainer_nnodes=2, trainer_nproc=4, gpus_per_node=4)
    assert server_bundles(plan) == [{"GPU": 2, "CPU": 1}, {"GPU": 2, "CPU": 1}]
    assert trainer_bundles(plan) == [{"GPU": 4, "CPU": 4}, {"GPU": 4, "CPU": 4}]
    plan.launcher.prepare_overrides = ["task.prepare_only=true"]
    prepare = trainer_node_commands(plan, ["10.0.0.1:30000"], master_addr="10.0.0.2", master_port=29500, prepare=True)
    assert all(cmd[-1] == "task.prepare_only=true" for cmd in prepare), "the prepare run gets no server addresses"
    cmds = trainer_node_commands(plan, ["10.0.0.1:30000"], master_addr="10.0.0.2", master_port=29500)
    assert len(cmds) == 2
    for rank, cmd in enumerate(cmds):
        assert cmd[cmd.index("--node-rank") + 1] == str(rank) and cmd[cmd.index("--nnodes") + 1] == "2"
        assert cmd[cmd.index("--master-addr") + 1] == "10.0.0.2"
        assert cmd[-1] == 'rollout.addresses=["10.0.0.1:30000"]'
    cpu = _plan(backend="areal", n_servers=1)
    assert server_bundles(cpu) == [{"CPU": 1}]
    assert trainer_bundles(cpu) == [{"CPU": 1}]
    assert forwarded_env(
        {"PYTHONPATH": "/src", "HOME": "/root", "WANDB_MODE": "offline", "CUDA_VISIBLE_DEVICES": "0"}
    ) == {"PYTHONPATH": "/src", "WANDB_MODE": "offline"}, "never the driver's GPUs: Ray sets each task's"


def test_areal_servers_are_up_for_the_trainer_and_stopped_after_a_failure(tmp_path) -> None:
    from areal_lite.utils.tiny import build_tiny_model

    model = build_tiny_model(str(tmp_path / "model"), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    rc, records = _launch(
        tmp_path,
        "launcher.backend=areal",
        "launcher.n_servers=2",
        f"launcher.server_model_path={model}",
        "probe.fail_attempts=1",
    )
    assert rc == 1, "torchrun turns the trainer's failure into exit code 1"
    servers = json.loads((tmp_path / "areal-lite" / "trial0" / "logs" / "servers.json").read_text())
    assert [r["addresses"] for r in records] == [[s["address"] for s in servers]]
    assert records[0]["healthy"] == [True, True], "the trainer starts once every server is healthy"
    assert not any(_alive(s["pid"]) for s in servers), "the servers are stopped when the trainer fails"


@pytest.mark.parametrize(
    ("weight_update", "fault"),
    [
        # The whole launcher with a server killed or hung: 30 s and more each, so `make test-faults`
        # runs them (and CI with it), not `make test`; the hung server's pause waits on it.
        pytest.param("disk", "kill", marks=pytest.mark.slow),
        pytest.param("distributed", "kill", marks=pytest.mark.slow),
        pytest.param("disk", "hang", marks=pytest.mark.slow),
        pytest.param("distributed", "hang", marks=pytest.mark.slow),
    ],
)
def test_training_completes_when_a_rollout_server_dies(tmp_path, weight_update: str, fault: str) -> None:
    """backend=areal with 2 of our servers: the launcher starts them and passes their addresses;
    after the second step, with rollouts in flight on both, one server is SIGKILLed; the run (requests
    resent to the survivor, weight updates to the survivor: from disk, or broadcast in a new group
    without the dead server) completes every step, and the launcher stops the surviving server at
    the end. Or the server hangs (SIGSTOP) under a request timeout (15 s) below the control timeout
    (30 s): the weight sync's pause, which used to die on a message-less TimeoutError at 15 s, sets
    it aside and the run goes on without it; the launcher stops the hung server at the end too."""
    from areal_lite.utils.tiny import build_tiny_model

    model = build_tiny_model(str(tmp_path / "model"), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    out_dir = tmp_path / "out" / "areal-lite" / "trial0"
    total_steps, kill_after = 5, 1
    cmd = [
        sys.executable,
        "-m",
        "areal_lite.launcher.local",
        os.path.join(HERE, "scripts", "remote_train.py"),
        f"actor.path={model}",
        f"cluster.fileroot={tmp_path / 'out'}",
        "launcher.backend=areal",
        "launcher.n_servers=2",
        "launcher.server_args=[--max-running-requests,8]",
        "rollout.consumer_batch_size=4",
        "rollout.max_head_offpolicyness=1",
        "rollout.request_timeout=15" if fault == "hang" else "rollout.request_timeout=60",
        f"total_steps={total_steps}",
        f"pause_after_step={kill_after}",
        f"weight_update={weight_update}",
        "stats_logger.console=false",
        "stats_logger.wandb_mode=disabled",
    ]
    launcher = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    servers: list[dict] = []
    try:
        _wait_for(str(out_dir / "paused"), launcher, "the trainer pausing after the second step")
        servers = json.loads((out_dir / "logs" / "servers.json").read_text())
        assert len(servers) == 2
        os.kill(servers[1]["pid"], signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        (out_dir / "continue").touch()
        log = launcher.communicate(timeout=300)[0].decode()
        (tmp_path / "launcher.log").write_text(log)
        assert launcher.returncode == 0, f"full log in {tmp_path / 'launcher.log'}; it ends with:\n{log[-3000:]}"
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        for s in servers:  # a stopped server acts on the SIGTERM its dead parent left it once it runs
            with contextlib.suppress(ProcessLookupError):
                os.kill(s["pid"], signal.SIGCONT)
    steps = [json.loads(line) for line in (out_dir / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(total_steps))
    assert all(s["n"] == 4 for s in steps)
    # The survivor's tokens carry the versions of the updates after the kill: they reached it.
    assert max(steps[-1]["versions"]) >= total_steps - 2
    if weight_update == "distributed":
        assert "forming a new group of the live servers" in log
    if fault == "kill":
        assert "server 1" in log and "exited" in log, "the launcher reports the dead server"
    else:
        assert "is unresponsive" in log and "TimeoutError\n" not in log
    assert not any(_alive(s["pid"]) for s in servers), "the servers are stopped at the end"
