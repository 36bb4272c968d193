"""Asynchronous vs synchronous RL on the quickstart workload: training steps per minute.

The rollout server runs on core 1 (launcher.server_cores) and the trainer's main thread on core 0
(launcher.trainer_cores). The rollout client (executor loop, HTTP loop, the workflows) runs in
the trainer's process, or its workflows in a child process (rollout.episode_process=true), which
keeps their Python work off the trainer's GIL; pinned runs put it on the server's core
(rollout.client_cores), so training keeps core 0 to itself, and free ones let it use whichever
core is idle. Both modes run in the same four placements (in-process or child, pinned or free)
and each mode's fastest counts, so no placement can inflate the ratio. With
eta = 0 each step waits for its own rollouts; with eta = 2 the server generates the next batches
while the trainer trains on this one. Every run starts from the same SFT checkpoint (made once,
first) and runs the same number of RL steps; only the RL loop is timed (the quickstart prints
it); each configuration runs ``--repeats`` times, alternating, and its best rate counts.

    python benchmarks/async_vs_sync.py [--steps 40] [--repeats 2]

Two stages overlap at most (rollout + train) / max(rollout, train): 2.0 when they are balanced.
The table gives that bound for the quickstart's own stage times, measured in the synchronous run
(weight sync counts with training: generation pauses for it), and how much of it was reached.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_quickstart(fileroot: str, trial: str, overrides: list[str]) -> str:
    cmd = [
        sys.executable, "-m", "areal_lite.launcher.local", "examples/quickstart.py",
        "--config", "configs/quickstart.yaml",
        f"cluster.fileroot={fileroot}", f"trial_name={trial}", "recover.mode=disabled", "recover.retries=0",
        "stats_logger.tensorboard=false", "stats_logger.wandb_mode=disabled", *overrides,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        sys.stderr.write(out.stdout[-4000:] + out.stderr[-4000:])
        raise SystemExit(f"quickstart run {trial} failed with exit code {out.returncode}")
    return out.stdout


def rl_steps_per_minute(log: str) -> float:
    m = re.search(r"\[quickstart\] RL: (\d+) steps in ([\d.]+)s", log)
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
    configs = {f"{mode}, {where}": (eta, overrides) for mode, eta in (("sync", 0), ("async", 2)) for where, overrides in placements.items()}
    fileroot = tempfile.mkdtemp(prefix="areal_async_")
    rates: dict[str, float] = {}
    stages: dict[str, dict[str, float]] = {}
    try:
        # One SFT warm-up shared by every run (the quickstart skips SFT when sft_model exists).
        run_quickstart(fileroot, "sft", ["launcher.backend=local", "task.prepare_only=true"])
        for rep in range(args.repeats):
            for i, (name, (eta, overrides)) in enumerate(configs.items()):
                trial = f"r{rep}c{i}"
                shutil.copytree(os.path.join(fileroot, "quickstart", "sft", "sft_model"), os.path.join(fileroot, "quickstart", trial, "sft_model"))
                log = run_quickstart(
                    fileroot, trial, [f"total_train_steps={args.steps}", f"rollout.max_head_offpolicyness={eta}", "task.n_eval=8", *overrides]
                )
                rate = rl_steps_per_minute(log)
                print(f"[run {rep}] {name:<26}{rate:7.1f} steps/min", flush=True)
                if rate > rates.get(name, 0.0):
                    rates[name], stages[name] = rate, stage_seconds(log)
    finally:
        if not args.keep:
            shutil.rmtree(fileroot, ignore_errors=True)
    sync_name = max((k for k in rates if k.startswith("sync")), key=lambda k: rates[k])
    async_name = max((k for k in rates if k.startswith("async")), key=lambda k: rates[k])
    sync, asyn = rates[sync_name], rates[async_name]
    s = stages[sync_name]
    rollout, train = s["rollout"], s["train"] + s["weight_sync"]
    bound = (rollout + train) / max(rollout, train)
    print(f"\nquickstart RL loop, {args.steps} steps per run, best of {args.repeats}; server on core 1, trainer on core 0")
    print(f"{'configuration':<28}{'steps/min':>10}{'rollout s':>11}{'train s':>9}{'sync s':>8}")
    for name, rate in rates.items():
        st = stages[name]
        print(f"{name:<28}{rate:>10.1f}{st['rollout']:>11.3f}{st['train']:>9.3f}{st['weight_sync']:>8.3f}")
    print(f"sync: {sync_name}; async: {async_name}; overlap bound of the sync stages (rollout + train) / max = {bound:.2f}")
    print(
        f"RESULT async_over_sync={asyn / sync:.2f} sync_steps_per_min={sync:.1f} async_steps_per_min={asyn:.1f} "
        f"overlap_bound={bound:.2f} fraction_of_bound={asyn / sync / bound:.2f}"
    )


if __name__ == "__main__":
    main()
