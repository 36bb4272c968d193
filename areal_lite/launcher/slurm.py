"""Run a training script as one Slurm job: the same servers, trainer and restarts as `launcher.local`.

    python -m areal_lite.launcher.slurm SCRIPT --config CONFIG [key=value ...] [--wait | --dry-run]

Writes ``output_dir/slurm/job.sh`` and submits it with ``sbatch`` (``--wait``: and waits for the job,
exiting with its exit code; ``--dry-run`` prints the script instead). The job takes
``server nodes + launcher.trainer_nnodes`` nodes: the first ones run the ``n_servers`` rollout
servers (after the ``launcher.prepare_overrides`` run of the trainer, when set; as many per node as
``gpus_per_node / server_tp_size`` allows; all on one node on CPU; on the first trainer node with
``launcher.slurm.colocate_servers``), each as a job step named
``server<i>`` (``srun --overlap``) on a fixed port; the script waits until each answers
``GET /health``, then the trainer nodes run torchrun in a step named ``trainer`` with
``rollout.addresses`` set. A server step that dies (``scancel JOB.STEP``, a crash) leaves the
trainer to carry on with the others (the remote engine retries elsewhere).

Recovery happens at two levels. A failed trainer step is started again in the same allocation, up
to ``recover.retries`` times, with ``AREAL_LITE_ATTEMPT`` set, like the local launcher, unless it
stopped on an error a restart would meet again (`areal_lite.api.errors.RecurringError`, whose line
the trainer writes to ``logs/recurring_error``, named by ``AREAL_LITE_STOP_FILE``): the job then
ends with that line. The job is
submitted with ``--requeue``: when Slurm requeues it (a node failure, preemption,
``scontrol requeue``), the whole job starts again, the prepare run included (it must skip work that
is already done, as the quickstart's SFT warm-up does), and the trainer resumes from its last
recover checkpoint with ``recover.mode=auto``; attempt numbers go on from the previous run
(``SLURM_RESTART_COUNT``). The job's output is appended to ``logs/slurm-<job id>.out`` across
requeues. Slurm kills the servers when the job ends. The job runs in the submitting directory with
the submitting environment (``sbatch``'s default ``--export=ALL``); the nodes share its file system.
The config is checked before submission as by `launcher.local` (not its paths, which are the
nodes' to see).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys

from areal_lite.api.errors import STOP_FILE_ENV
from areal_lite.launcher.cli import argument_parser, launcher_main, stopped_on
from areal_lite.launcher.commands import script_args, server_command, trainer_gpus
from areal_lite.launcher.plan import LaunchPlan
from areal_lite.launcher.preflight import check_config

SERVER_BASE_PORT = 30000
TRAINER_PORT = 29500


def servers_per_node(plan: LaunchPlan) -> int:
    cfg = plan.launcher
    if cfg.gpus_per_node <= 0:
        return max(cfg.n_servers, 1)
    per_node = cfg.gpus_per_node // cfg.server_tp_size
    if per_node < 1:
        raise ValueError(
            f"launcher.server_tp_size={cfg.server_tp_size} exceeds launcher.gpus_per_node={cfg.gpus_per_node}"
        )
    return per_node


def server_nodes(plan: LaunchPlan) -> int:
    """Nodes of the servers' own (none when they share the first trainer node)."""
    if plan.launcher.backend == "local" or plan.launcher.slurm.colocate_servers:
        return 0
    return -(-plan.launcher.n_servers // servers_per_node(plan))


def sbatch_script(plan: LaunchPlan) -> str:
    """The job script of ``plan`` (bash)."""
    cfg, slurm = plan.launcher, plan.launcher.slurm
    n_server_nodes, n_trainer_nodes = server_nodes(plan), cfg.trainer_nnodes
    name = os.path.basename(os.path.dirname(plan.output_dir)) + "_" + os.path.basename(plan.output_dir)
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={name}",
        f"#SBATCH --nodes={n_server_nodes + n_trainer_nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --cpus-per-task={slurm.cpus_per_task}",
        f"#SBATCH --time={slurm.time}",
        f"#SBATCH --output={plan.log_dir}/slurm-%j.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
    ]
    if cfg.gpus_per_node > 0:
        lines.append(f"#SBATCH --gpus-per-node={cfg.gpus_per_node}")
    if slurm.partition:
        lines.append(f"#SBATCH --partition={slurm.partition}")
    if slurm.account:
        lines.append(f"#SBATCH --account={slurm.account}")
    lines += [f"#SBATCH {opt}" for opt in slurm.extra_sbatch]
    torchrun = [
        plan.python,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(n_trainer_nodes),
        "--nproc-per-node",
        str(cfg.trainer_nproc),
        "--rdzv-backend",
        "c10d",
        "--max-restarts",
        "0",
    ]
    srun_trainer = f'srun --overlap --nodes={n_trainer_nodes} --ntasks-per-node=1 --nodelist="$TRAINER_NODES"'
    attempts = plan.recover.retries + 1
    gpus = trainer_gpus(cfg, None) if slurm.colocate_servers else None
    if gpus is not None:
        srun_trainer = f"CUDA_VISIBLE_DEVICES={gpus} {srun_trainer}"
    trainer = shlex.join(torchrun) + f' --rdzv-endpoint "$MASTER:{TRAINER_PORT}" '
    recurring = f'$(cat "${STOP_FILE_ENV}")'
    lines += [
        "set -uo pipefail",
        f"mkdir -p {shlex.quote(plan.log_dir)}",
        f"export {STOP_FILE_ENV}={shlex.quote(plan.stop_file)}  # where the trainer writes a RecurringError",
        # Says the line and succeeds when the trainer stopped on an error a restart would meet again.
        f'stopped() {{ [ -s "${STOP_FILE_ENV}" ] && echo "{stopped_on(recurring)}"; }}',
        'NODES=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
        f'TRAINER_NODES=$(IFS=,; echo "${{NODES[*]:{n_server_nodes}:{n_trainer_nodes}}}")',
        f'MASTER="${{NODES[{n_server_nodes}]}}"',
        f"FIRST_ATTEMPT=$(( ${{SLURM_RESTART_COUNT:-0}} * {attempts} ))  # attempt numbers go on after a requeue",
        'echo "job $SLURM_JOB_ID starts (restart ${SLURM_RESTART_COUNT:-0}) on ${NODES[*]}"',
    ]
    if cfg.prepare_overrides:
        prepare = trainer + shlex.join(script_args(plan, [], prepare=True))
        lines += [
            f'rm -f "${STOP_FILE_ENV}"',
            f"AREAL_LITE_ATTEMPT=$FIRST_ATTEMPT {srun_trainer} --job-name=prepare {prepare} "
            + '|| { echo "the prepare run failed"; stopped; exit 1; }',
        ]
    lines.append("ADDRESSES=()")
    per_node = cfg.n_servers if slurm.colocate_servers else servers_per_node(plan)
    for i in range(cfg.n_servers if cfg.backend != "local" else 0):
        node, local = i // per_node, i % per_node
        port = SERVER_BASE_PORT + local
        cmd = shlex.join(server_command(plan, port, base_gpu_id=local * cfg.server_tp_size, host="0.0.0.0"))
        log = shlex.quote(os.path.join(plan.log_dir, f"server{i}.log"))
        lines += [
            f'srun --overlap --nodes=1 --ntasks=1 --nodelist="${{NODES[{node}]}}" --job-name=server{i} {cmd} > {log} 2>&1 &',
            f'ADDRESSES+=("\\"${{NODES[{node}]}}:{port}\\"")',
        ]
    timeout = int(cfg.server_startup_timeout)
    lines += [
        'for address in "${ADDRESSES[@]}"; do',
        '  address="${address//\\"/}"',
        f'  for _ in $(seq {timeout}); do curl -sf "http://$address/health" > /dev/null && break; sleep 1; done',
        f'  curl -sf "http://$address/health" > /dev/null || {{ echo "server $address not healthy after {timeout} s"; exit 1; }}',
        "done",
        "OVERRIDES=()",
        'if [ ${#ADDRESSES[@]} -gt 0 ]; then OVERRIDES+=("rollout.addresses=[$(IFS=,; echo "${ADDRESSES[*]}")]"); fi',
    ]
    lines += [
        "status=1",
        f"for attempt in $(seq $FIRST_ATTEMPT $(( FIRST_ATTEMPT + {attempts - 1} ))); do",
        f'  rm -f "${STOP_FILE_ENV}"',
        f"  AREAL_LITE_ATTEMPT=$attempt {srun_trainer} --job-name=trainer \\",
        f'    {trainer}{shlex.join(script_args(plan, []))} "${{OVERRIDES[@]}}" && {{ status=0; break; }}',
        '  status=$?; echo "trainer attempt $attempt failed with $status"',
        "  stopped && break",
        "done",
        "exit $status",
    ]
    return "\n".join(lines) + "\n"


def submit(plan: LaunchPlan, wait: bool = False) -> int:
    """Write the job script and submit it; sbatch's exit code (with ``wait``: the job's)."""
    path = os.path.join(plan.output_dir, "slurm", "job.sh")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.makedirs(plan.log_dir, exist_ok=True)
    with open(path, "w") as f:
        f.write(sbatch_script(plan))
    print(f"[launcher] job script {path}; output in {plan.log_dir}/slurm-<job id>.out", flush=True)
    return subprocess.run(["sbatch", *(["--wait"] if wait else []), path], check=False).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--dry-run", action="store_true", help="print the job script instead of submitting it")
    parser.add_argument("--wait", action="store_true", help="wait for the job and exit with its exit code")

    def launch(plan: LaunchPlan, args: argparse.Namespace) -> int:
        check_config(plan, paths=False)  # paths are those of the job's nodes, not of this one
        if args.dry_run:
            print(sbatch_script(plan), end="")
            return 0
        return submit(plan, wait=args.wait)

    return launcher_main(parser, launch, argv)


if __name__ == "__main__":
    sys.exit(main())
