"""Asynchronous vs synchronous RL on the quickstart workload: training steps per minute.

The rollout server runs on core 1 (launcher.server_cores) and the trainer's main thread on core 0
(launcher.trainer_cores). The rollout client (executor loop, HTTP loop, the workflows) runs in
the trainer's process, or its workflows in a child process (rollout.episode_process=true), which
keeps their Python work off the trainer's GIL; pinned runs put it on the server's core
(rollout.client_cores), so training keeps core 0 to itself; "free" ones are not pinned by
rollout.client_cores and so stay on core 0 with training (the launcher pins the whole trainer
process, its threads and child included). Both modes run in the same four placements (in-process
or child, pinned or free)
and each mode's fastest counts, so no placement can inflate the ratio. With
eta = 0 each step waits for its own rollouts; with eta = 2 the server generates the next batches
while the trainer trains on this one. Every run starts from the same SFT checkpoint (made once,
first) and runs the same number of RL steps; only the RL loop is timed (the quickstart prints
it); each configuration runs ``--repeats`` times, alternating, and its best rate counts.

    python benchmarks/async_vs_sync.py [--steps 40] [--repeats 2]

Two stages overlap at most (rollout + train) / max(rollout, train): 2.0 when they are balanced.
The table gives that bound for the quickstart's own stage times, measured in the synchronous run
(weight sync counts with training: generation pauses for it). A second bound counts CPU: the
benchmark samples the CPU time of every process of a run (server, trainer, client threads or
child) and takes the RL loop's share; a step's work needs that many CPU seconds, so two cores
take at least half of it per step, however the stages overlap. "cores busy" is how many of the
two a configuration kept busy on average; the last line says how much of the lower bound was
reached.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds (user + system) used so far by ``root`` and every process below it; NaN where
    there is no /proc (the CPU columns then read nan)."""
    if not os.path.isdir("/proc"):
        return float("nan")
    parent, cpu = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()
        pid = int(entry)
        parent[pid], cpu[pid] = int(fields[1]), int(fields[11]) + int(fields[12])
    total = 0
    for pid, ticks in cpu.items():
        p = pid
        while p in parent and p != root:
            p = parent[p]
        if p == root:
            total += ticks
    return total / os.sysconf("SC_CLK_TCK")


@dataclass
class Run:
    """One quickstart run's log, and the CPU seconds its processes used in the RL loop."""

    log: str
    rl_cpu_seconds: float


def run_quickstart(fileroot: str, trial: str, overrides: list[str]) -> Run:
    """Run the quickstart, sampling its process tree's CPU time every 0.2 s; the RL loop's window
    ends when its timing line is printed and starts the reported seconds earlier."""
    cmd = [
        sys.executable, "-m", "areal_lite.launcher.local", "examples/quickstart.py",
        "--config", "configs/quickstart.yaml",
        f"cluster.fileroot={fileroot}", f"trial_name={trial}", "recover.mode=disabled", "recover.retries=0",
        "stats_logger.tensorboard=false", "stats_logger.wandb_mode=disabled",
        "stats_logger.console_keys=[timing/rollout,timing/train,timing/weight_sync]",  # read by stage_seconds
        *overrides,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    samples: list[tuple[float, float]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            samples.append((time.time(), tree_cpu_seconds(proc.pid)))

    def read_stdout(lines: list[str], marks: list[float]) -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if RL_LINE.search(line):
                marks.append(time.time())

    lines: list[str] = []
    marks: list[float] = []
    threads = [threading.Thread(target=sample), threading.Thread(target=read_stdout, args=(lines, marks))]
    for t in threads:
        t.start()
    try:
        stderr = proc.stderr.read()  # type: ignore[union-attr]
        proc.wait(timeout=3600)
    finally:
        done.set()
        if proc.poll() is None:
            proc.kill()
        for t in threads:
            t.join()
    log = "".join(lines)
    if proc.returncode != 0:
        sys.stderr.write(log[-4000:] + stderr[-4000:])
        raise SystemExit(f"quickstart run {trial} failed with exit code {proc.returncode}")
    cpu = float("nan")
    m = RL_LINE.search(log)
    if m and marks:
        end = marks[0]
        cpu = cpu_at(samples, end) - cpu_at(samples, end - float(m.group(2)))
    return Run(log, cpu)


def cpu_at(samples: list[tuple[float, float]], t: float) -> float:
    """The sampled CPU total at time ``t``, interpolated linearly (NaN outside the samples)."""
    if not samples:
        return float("nan")
    times, totals = zip(*samples)
    return float(np.interp(t, times, totals, left=float("nan"), right=float("nan")))


RL_LINE = re.compile(r"\[quickstart\] RL: (\d+) steps in ([\d.]+)s")


def rl_steps_per_minute(log: str) -> float:
    m = RL_LINE.search(log)
    if not m:
        raise SystemExit("the quickstart did not report its RL timing")
    return int(m.group(1)) / float(m.group(2)) * 60


def stage_seconds(log: str) -> dict[str, float]:
    """Mean seconds per step of each timed stage (the first step, with its warm-up, left out)."""
    out = {}
    for stage in ("rollout", "train", "weight_sync"):
        values = [float(v) for v in re.findall(rf"timing/{stage} ([\d.e+-]+)", log)[1:]]
        out[stage] = sum(values) / max(len(values), 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40, help="RL steps per run")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each configuration (best counts)")
    parser.add_argument("--keep", action="store_true", help="keep the output directory")
    args = parser.parse_args()
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("this benchmark puts rollout and training on separate cores: it needs 2")
    place = ["launcher.server_cores=[1]", "launcher.trainer_cores=[0]"]
    pin, child = "rollout.client_cores=[1]", "rollout.episode_process=true"
    placements = {
        "client free": place,
        "client on core 1": [*place, pin],
        "child free": [*place, child],
        "child on core 1": [*place, pin, child],
    }
    configs = {
        f"{mode}, {where}": (eta, overrides)
        for mode, eta in (("sync", 0), ("async", 2))
        for where, overrides in placements.items()
    }
    fileroot = tempfile.mkdtemp(prefix="areal_async_")
    rates: dict[str, float] = {}
    stages: dict[str, dict[str, float]] = {}
    cpu: dict[str, float] = {}  # CPU seconds per RL step, all processes
    try:
        # One SFT warm-up shared by every run (the quickstart skips SFT when sft_model exists).
        run_quickstart(fileroot, "sft", ["launcher.backend=local", "task.prepare_only=true"])
        for rep in range(args.repeats):
            for i, (name, (eta, overrides)) in enumerate(configs.items()):
                trial = f"r{rep}c{i}"
                shutil.copytree(
                    os.path.join(fileroot, "quickstart", "sft", "sft_model"),
                    os.path.join(fileroot, "quickstart", trial, "sft_model"),
                )
                run = run_quickstart(
                    fileroot,
                    trial,
                    [
                        f"total_train_steps={args.steps}",
                        f"rollout.max_head_offpolicyness={eta}",
                        "task.n_eval=8",
                        *overrides,
                    ],
                )
                rate = rl_steps_per_minute(run.log)
                print(f"[run {rep}] {name:<26}{rate:7.1f} steps/min", flush=True)
                if rate > rates.get(name, 0.0):
                    rates[name], stages[name] = rate, stage_seconds(run.log)
                    cpu[name] = run.rl_cpu_seconds / args.steps
    finally:
        if not args.keep:
            shutil.rmtree(fileroot, ignore_errors=True)
    sync_name = max((k for k in rates if k.startswith("sync")), key=lambda k: rates[k])
    async_name = max((k for k in rates if k.startswith("async")), key=lambda k: rates[k])
    sync, asyn = rates[sync_name], rates[async_name]
    s = stages[sync_name]
    rollout, train = s["rollout"], s["train"] + s["weight_sync"]
    bound = (rollout + train) / max(rollout, train)
    # A step's work, summed over every process (server, trainer, client), takes cpu[sync_name]
    # CPU seconds; two cores need at least half that per step, however well the stages overlap.
    cores = 2
    cpu_bound = cores * (60 / sync) / cpu[sync_name]
    print(
        f"\nquickstart RL loop, {args.steps} steps per run, best of {args.repeats}; server on core 1, trainer on core 0"
    )
    print(
        f"{'configuration':<28}{'steps/min':>10}{'rollout s':>11}{'train s':>9}{'sync s':>8}{'CPU s':>8}{'cores busy':>12}"
    )
    for name, rate in rates.items():
        st = stages[name]
        busy = cpu[name] * rate / 60
        print(
            f"{name:<28}{rate:>10.1f}{st['rollout']:>11.3f}{st['train']:>9.3f}{st['weight_sync']:>8.3f}"
            f"{cpu[name]:>8.3f}{busy:>12.2f}"
        )
    print(f"sync: {sync_name}; async: {async_name}")
    print(f"overlap bound of the sync stages, (rollout + train) / max: {bound:.2f}")
    print(f"CPU bound, {cores} cores x sync step seconds / sync CPU seconds per step: {cpu_bound:.2f}")
    print(
        f"RESULT async_over_sync={asyn / sync:.2f} sync_steps_per_min={sync:.1f} async_steps_per_min={asyn:.1f} "
        f"overlap_bound={bound:.2f} cpu_bound={cpu_bound:.2f} fraction_of_bound={asyn / sync / min(bound, cpu_bound):.2f}"
    )


if __name__ == "__main__":
    main()
